"""Issue 48: the committed mutation report describes today's task code and tests.

The report (``docs/mutation-report.json``, written by ``python -m autograder.mutation``)
records, per task, a digest of the task's reference functions and of its test cells (with the
lab's setup cell). For every task the report calls covered (all its mutants measured), a change
to either makes the report stale: this test says which task to re-run. A task not covered
claims nothing but how many of its mutants were not run. It runs no mutant (that takes minutes of CPU per lab); it only generates the mutants'
ids, to check that every explanation in ``equivalent.toml`` still names a mutant that exists.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from autograder.mutation import mutants as M
from autograder.mutation import report as R

ROOT = Path(__file__).resolve().parent.parent
REPORT = json.loads((ROOT / "docs" / "mutation-report.json").read_text(encoding="utf-8"))

pytestmark = pytest.mark.timeout(300)


def test_the_report_covers_every_task_of_every_lab():
    from minickpt.labkit.plugging import reference_functions

    assert set(REPORT["tasks"]) == set(reference_functions()), \
        "re-run python -m autograder.mutation --report: the tasks changed"


@pytest.mark.parametrize("task", sorted(REPORT["tasks"], key=lambda t: tuple(map(int, t.split(".")))))
def test_each_task_report_is_current_for_its_code_and_tests(task):
    entry = REPORT["tasks"][task]
    counted = entry["killed"] + len(entry["equivalent"]) + len(entry["survivors"]) + entry["not_run"]
    assert counted == entry["mutants"], f"task {task}: the report's counts do not add up"
    if not entry["covered"]:
        # not claimed: the report says how many of its mutants were not run (on today's code)
        assert entry["not_run"] > 0, f"task {task} is marked not covered but every mutant ran"
        return
    now = M.task_digest(task)
    assert entry["source_sha256"] == now["source_sha256"], \
        f"task {task}'s reference changed since its mutation report: python -m autograder.mutation --task {task}"
    assert entry["tests_sha256"] == now["tests_sha256"], \
        f"task {task}'s test cells changed since its mutation report: python -m autograder.mutation --task {task}"
    assert entry["mutants"] == len(M.task_mutants(task)), \
        f"task {task} has other mutants now (an operator changed): python -m autograder.mutation --task {task}"


def test_every_equivalent_mutant_says_why_and_still_exists():
    data = tomllib.loads(R.EQUIVALENT.read_text(encoding="utf-8")).get("mutants", {})
    known = {m.id for t in REPORT["tasks"] for m in M.task_mutants(t)}
    for mid, entry in data.items():
        assert len(entry.get("why", "")) > 20, f"{mid}: say in a line why no user could tell it apart"
        assert mid in known, f"{mid} names no mutant of today's code: remove it or re-run the task"


def test_the_markdown_report_is_the_json_report():
    assert (ROOT / "docs" / "mutation-report.md").read_text(encoding="utf-8") == R.markdown(REPORT)


def test_results_measured_on_other_tests_never_count_as_current(tmp_path):
    """Before: a task's results counted as current when the *last* baseline in its file had
    today's digest. A later run that found every mutant already measured wrote a new baseline
    (today's digest) and ran nothing, so results measured on the old tests were reported as
    current (found when 6.2's tests changed and 5 survivors of the old tests stood). Now a
    result counts only under a baseline of today's digest, and a run over a file measured on
    other code or tests starts it afresh."""
    from autograder.mutation import __main__ as runner

    task = "6.1"
    m = M.task_mutants(task)[0]
    old = {"source_sha256": "0" * 64, "tests_sha256": "1" * 64}
    recs = [{"baseline": [], "digest": old}, {"id": m.id, "status": "killed", "by": "x"},
            {"baseline": [], "digest": M.task_digest(task)}]
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    entry = R.task_entry(task, tmp_path, {})
    assert entry["killed"] == 0 and entry["not_run"] == entry["mutants"], entry
    assert runner.stale(tmp_path / f"{task}.jsonl", task)  # the next run starts afresh
    (tmp_path / f"{task}.jsonl").write_text(json.dumps(recs[-1]) + "\n")
    assert not runner.stale(tmp_path / f"{task}.jsonl", task)
