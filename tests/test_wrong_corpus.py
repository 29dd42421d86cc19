"""Issue 39: every task of every lab has a corpus of plausible wrong versions, and each loses
that task's points.

The wrong versions live in ``autograder/lab_examples/<lab>.py`` (``WRONG``: a list of
:class:`~autograder.lab_examples.common.Wrong`), bundled into the submissions ``wrong_a``,
``wrong_b`` ... (one version per task each). The corpus tests
(tests/test_grading_hardening.py) grade them and compare with ``expected-<lab>.csv``; this file
checks, without grading anything, that the expected rows say what the corpus promises: every
task has at least three wrong versions, and every row written for a wrong version loses points
on the task it breaks. A row that kept full marks would be a wrong solution the grade accepts.
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

from autograder.lab_examples.common import Wrong
from autograder.make_examples import EXAMPLES

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(p.name for p in (ROOT / "solutions").glob("lab*") if p.is_dir())
MIN_PER_TASK = 3
NOT_TASKS = {"lab", "student", "quiz", "total", "status", "review"}


def _rows(lab: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    with open(ROOT / "autograder" / "examples" / f"expected-{lab}.csv", newline="") as f:
        reader = csv.DictReader(f)
        tasks = [c for c in reader.fieldnames or [] if c not in NOT_TASKS]
        return tasks, {r["student"]: r for r in reader}


def _wrong(lab: str) -> list[Wrong]:
    return list(getattr(importlib.import_module(f"autograder.lab_examples.{lab}"), "WRONG", []))


@pytest.mark.parametrize("lab", LABS)
def test_every_task_has_at_least_three_wrong_versions_naming_their_clause(lab):
    tasks, _ = _rows(lab)
    wrongs = _wrong(lab)
    count = {t: sum(w.task == t for w in wrongs) for t in tasks}
    short = {t: n for t, n in count.items() if n < MIN_PER_TASK}
    assert not short, f"{lab}: tasks with fewer than {MIN_PER_TASK} wrong versions: {short}"
    assert {w.task for w in wrongs} <= set(tasks), f"{lab}: a wrong version names no task"
    assert all(len(w.clause) > 15 for w in wrongs), f"{lab}: say which clause each one breaks"


@pytest.mark.parametrize("lab", LABS)
def test_every_wrong_version_loses_the_points_of_its_task(lab):
    _, rows = _rows(lab)
    best = rows["perfect"]
    bundles = {s: e for s, e in EXAMPLES[lab].items() if s.startswith("wrong_")}
    assert bundles or not _wrong(lab), f"{lab}: WRONG is not in EXAMPLES (wrong_examples)"
    kept = []
    for student, make in sorted(bundles.items()):
        assert student in rows, f"{lab}: {student} has no expected row"
        for w in make.wrongs:
            # a cell may list the scores timing allows ("0|2"): every one must lose points
            if max(map(float, rows[student][w.task].split("|"))) >= float(best[w.task]):
                kept.append(f"{student} {w.task} ({w.clause}): {rows[student][w.task]} "
                            f"of {best[w.task]}")
    assert not kept, f"{lab}: wrong versions that keep full marks:\n" + "\n".join(kept)
