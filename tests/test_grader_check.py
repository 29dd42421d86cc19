"""Issue 38: a hidden test's comparison with minickpt's own answer runs in the grader.

A test cell's hidden part may hold a ``### BEGIN GRADER CHECK`` block: the kernel runs the
cell without it and reports the values the block reads; the grader runs the block in its own
process, where ``lab.reference`` is. So neither the reference nor an expected value is in the
student's process for these tests. The ratchet below lists the test cells whose kernel text
still calls ``lab.reference``: converting one removes it from the list (the test fails until
the list is updated), and no new one can appear.
"""

from __future__ import annotations

import re

import pytest

from autograder import ROOT, build
from autograder.notebook import (
    CHECK_BEGIN,
    assemble,
    judge_quiz,
    load_lab,
    read_submission,
    split_grader_check,
    split_hidden,
)
from minickpt import labkit

SOLUTIONS = ROOT / "solutions"
LAB_NAMES = build.lab_names(SOLUTIONS)
pytestmark = pytest.mark.timeout(300)

STILL_IN_THE_KERNEL = {
    "lab01_basics": set(),
    "lab02_save_policy": set(),
    "lab03_resume": set(),
    "lab04_multihost": set(),
    "lab05_async": set(),
    "lab06_production": set(),
}
"""Test cells whose kernel text still calls ``lab.reference`` (issue 38: to be moved into
grader checks). It only shrinks."""


def _lab(name):
    return load_lab(SOLUTIONS / name / f"{name}.ipynb")


def _tests(name):
    return [c for c in _lab(name).cells if c.role == "test"]


@pytest.mark.parametrize("name", LAB_NAMES)
def test_the_kernel_calls_the_reference_only_in_the_listed_test_cells(name):
    calls = {c.grade_id for c in _tests(name)
             if re.search(r"\blab\.reference\(", split_grader_check(c.source)[0])}
    assert calls == STILL_IN_THE_KERNEL[name]


@pytest.mark.parametrize("name", LAB_NAMES)
def test_no_visible_test_part_reaches_into_a_grader_check(name):
    for c in _tests(name):
        visible, _ = split_hidden(c.source)
        assert CHECK_BEGIN not in visible, c.grade_id


def _run_cells(name):
    lab = _lab(name)
    nb = read_submission(ROOT / "labs" / name / f"{name}.ipynb")
    cells = assemble(lab, nb, referee_path="/nonexistent/referee.py", key_file="/nonexistent/key")
    return {c.grade_id: c for c in cells.cells if c.role == "test"}


def test_a_grader_check_stays_out_of_the_kernel_and_names_what_the_kernel_reports():
    cells = _run_cells("lab05_async")
    check = cells["test_5_3_overlap"]
    assert check.report == ("answers",)
    assert "lab.reference" in check.hidden and "lab.reference" not in check.full.replace(
        check.hidden, "") and "reference" not in check.show
    assert cells["test_5_1_leaf"].report == ("photos",)
    assert cells["test_5_3_run"].report == ("runs",)
    assert cells["test_5_2_writer"].report == () and cells["test_5_2_writer"].hidden == ""


def test_the_grader_check_passes_the_right_answers_and_names_a_wrong_one():
    check = _run_cells("lab05_async")["test_5_3_overlap"].hidden
    ref = labkit.reference("overlap")
    answers = [ref(steps, sorted(saves)) for steps, saves in labkit.random_timelines(30, seed=5)]
    assert judge_quiz(check, {"answers": answers}) is None
    wrong = [dict(a) for a in answers]
    wrong[3]["hidden_s"] += 0.01
    msg = judge_quiz(check, {"answers": wrong})
    assert msg is not None and "hidden_s" in msg
    assert "could not be read back" in judge_quiz(check, {"answers": answers[:5]})


def test_a_grader_check_outside_the_hidden_part_is_refused(tmp_path):
    import json

    src = SOLUTIONS / "lab05_async" / "lab05_async.ipynb"
    nb = json.loads(src.read_text())
    for c in nb["cells"]:
        if (c.get("metadata", {}).get("nbgrader", {}).get("grade_id")) == "test_5_2_writer":
            c["source"] = ["x = 1\n", f"{CHECK_BEGIN}\n", "check(x == 1)\n",
                           "### END GRADER CHECK\n"]
    bad = tmp_path / "lab05_async.ipynb"
    bad.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="inside the hidden tests"):
        load_lab(bad)
