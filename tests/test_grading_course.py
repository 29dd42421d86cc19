"""Grading a course, not a lab: any subset of labs per student, one table per lab and the
course total, and what ``grade.sh`` grades with no argument.

The course-level behaviour is checked with lab 1 and a fake second lab (a copy of lab 1 under
another name, in a temporary ``--source``), so that it holds for whatever labs exist.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.grade import (
    HOSTILE_PREFIXES,
    TOUR_EVERY_LAB,
    LabInfo,
    default_jobs,
    example_tour,
    usable_cores,
    write_outputs,
)
from autograder.make_examples import EXAMPLES, TOUR
from autograder.notebook import load_lab

SOLUTIONS, LABS, EXAMPLES_DIR = ROOT / "solutions", ROOT / "labs", ROOT / "autograder" / "examples"
LAB1 = "lab01_basics"
FAKE = "lab99_fake"


def _info(name: str) -> LabInfo:
    info = load_lab(SOLUTIONS / LAB1 / f"{LAB1}.ipynb").info()
    return LabInfo(name, info["cells"], info["fingerprint"], info["questions"])


def _result(student: str, lab: str, score: float) -> dict:
    info = _info(lab)
    return {"student": student, "lab": lab, "status": "graded", "reason": "",
            "isolation": "sandbox", "ran_all_cells": True,
            "scores": {g: p * score for g, p in info.cells.items()}, "messages": {}, "notes": [],
            "review": []}


def test_a_lab_not_handed_in_is_a_zero_with_its_reason_in_every_report(tmp_path):
    labs = {LAB1: _info(LAB1), FAKE: _info(FAKE)}
    results = [_result("ann", LAB1, 1.0), _result("ann", FAKE, 0.0), _result("bob", LAB1, 1.0)]
    text = write_outputs(tmp_path / "out", results, labs, {}, {})
    with open(tmp_path / "out" / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    full = labs[LAB1].max_score
    assert rows["bob"][FAKE] == "0" and rows["bob"]["total"] == f"{full:g}"
    assert FAKE in rows["bob"]["missing"] and "handed in" in rows["bob"]["missing"]
    assert rows["ann"]["missing"] == "" and rows["ann"]["max_score"] == f"{2 * full:g}"
    with open(tmp_path / "out" / f"grades-{FAKE}.csv") as f:
        fake = {r["student"]: r for r in csv.DictReader(f)}
    assert fake["bob"]["status"] == "missing" and fake["bob"]["total"] == "0"
    assert f"{LAB1}: 2 submission(s)" in text and f"{FAKE}: 1 submission(s)" in text
    assert "not handed in (0 points): bob" in text
    course = text[text.index("course: 2 student(s), 2 lab(s)"):].splitlines()
    assert course[1].split() == ["student", LAB1, FAKE, "total"]
    assert course[4].split() == ["bob", f"{full:g}", "-", f"{full:g}"]
    page = (tmp_path / "out" / "class-summary.html").read_text()
    assert f"<h2>{LAB1}</h2>" in page and f"<h2>{FAKE}</h2>" in page
    with open(tmp_path / "out" / f"class-summary-{FAKE}.csv") as f:  # bob's 0 is not a try
        assert {r["submissions"] for r in csv.DictReader(f)} == {"1"}


def test_the_tour_takes_three_examples_of_every_lab_and_the_hostile_ones_once():
    tour = example_tour(set(EXAMPLES))
    for lab, examples in EXAMPLES.items():
        assert set(TOUR_EVERY_LAB) <= set(examples), f"{lab} lacks one of {TOUR_EVERY_LAB}"
        assert {s for s, k in tour if k == lab} == set(TOUR_EVERY_LAB) | set(TOUR.get(lab, ()))
    hostile_labs = {lab for s, lab in tour if s.startswith(HOSTILE_PREFIXES)}
    assert len(hostile_labs) == 1, hostile_labs
    assert len(tour) <= 3 * len(EXAMPLES) + 8  # the run of six labs stays within minutes
    assert {s for s, _ in tour if s.startswith("attack_")} and \
        {s for s, _ in tour if s.startswith("cheat_")}
    for lab, examples in EXAMPLES.items():  # every example is on disk for grade.sh to find
        for s in examples:
            assert (EXAMPLES_DIR / s / lab / f"{lab}.ipynb").is_file(), (s, lab)
    assert 1 <= default_jobs() <= usable_cores()


@pytest.mark.timeout(900)
def test_a_class_with_two_labs_and_a_missing_one_grades_as_a_course(tmp_path):
    """Real kernels: ann hands in lab 1 (right) and the fake lab (blank), bob only lab 1."""
    source = tmp_path / "solutions"
    (source / LAB1).mkdir(parents=True)
    shutil.copyfile(SOLUTIONS / LAB1 / f"{LAB1}.ipynb", source / LAB1 / f"{LAB1}.ipynb")
    (source / FAKE).mkdir()
    shutil.copyfile(SOLUTIONS / LAB1 / f"{LAB1}.ipynb", source / FAKE / f"{FAKE}.ipynb")
    subs = tmp_path / "class"
    for student, lab, nb in (("ann", LAB1, EXAMPLES_DIR / "perfect" / LAB1 / f"{LAB1}.ipynb"),
                             ("ann", FAKE, LABS / LAB1 / f"{LAB1}.ipynb"),
                             ("bob", LAB1, LABS / LAB1 / f"{LAB1}.ipynb")):
        (subs / student / lab).mkdir(parents=True)
        shutil.copyfile(nb, subs / student / lab / f"{lab}.ipynb")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "autograder" / "grade.sh"), str(subs), "--source",
                           str(source), "-j", "1", "--timeout", "30", "--out", str(out),
                           "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=840, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    full = _info(LAB1).max_score
    assert (rows["ann"][LAB1], rows["ann"][FAKE], rows["ann"]["total"]) == (f"{full:g}", "0",
                                                                              f"{full:g}")
    assert (rows["bob"][LAB1], rows["bob"][FAKE], rows["bob"]["total"]) == ("0", "0", "0")
    assert FAKE in rows["bob"]["missing"] and rows["ann"]["missing"] == ""
    assert f"{LAB1}: 2 submission(s)" in proc.stdout and f"{FAKE}: 1 submission(s)" in proc.stdout
    assert "not handed in (0 points): bob" in proc.stdout
    assert "course: 2 student(s), 2 lab(s)" in proc.stdout
    assert (out / "feedback" / "ann" / f"{FAKE}.html").exists()
    assert not (out / "feedback" / "bob" / f"{FAKE}.html").exists()
    page = (out / "class-summary.html").read_text()
    assert f"<h2>{LAB1}</h2>" in page and f"<h2>{FAKE}</h2>" in page
    assert Path(out / f"grades-{FAKE}.csv").read_text().count("missing") == 1


def test_feedback_renders_the_labs_markdown_and_shows_no_hidden_test():
    from autograder import feedback

    md = ("## Task 1.3 — one item\n\n| task | points |\n|---|---|\n| 1.1 | 4 |\n\n"
          "The state $S_t = (\\theta_t, m_t)$, and\n\n$$\\hat m_t = \\frac{m_t}{1-\\beta_1^t}$$\n")
    result = {"student": "ann", "lab": LAB1, "status": "graded", "reason": "", "notes": [],
              "scores": {"test_1_3_leaf": 0.0}, "messages": {"test_1_3_leaf": "LabCheckError: no"},
              "points": {"test_1_3_leaf": 2.0}, "group_of": {"test_1_3_leaf": "1.3"},
              "groups": {"1.3": 0.0}, "total": 0.0, "max_score": 2.0}
    cells = [{"kind": "markdown", "role": "text", "grade_id": "", "show": md, "outputs": []},
             {"kind": "code", "role": "test", "grade_id": "test_1_3_leaf",
              "show": "check(True, 'visible part')",
              "outputs": [{"output_type": "stream", "name": "stdout",
                           "text": "secret_hidden_check_line(42) ran\n"}]}]
    page = feedback.feedback_html(result, cells, {"1.3": 2.0}, {"secret_hidden_check_line(42)"})
    assert "<h2>Task 1.3 — one item</h2>" in page and "<td>1.1</td>" in page
    # formulas as MathML the browser renders itself: no script, no network, no raw TeX
    assert page.count("<math ") == 2 and 'display="block"' in page and "<msub>" in page
    assert "<script" not in page and "\\theta" not in page and "$" not in page
    assert "| task | points |" not in page and "secret_hidden_check_line" not in page


def test_the_class_summary_counts_one_failure_whatever_numbers_the_drawn_inputs_put_in_it():
    """A test's inputs are drawn at each grading (labkit.drawn), so one bug can fail "11 of
    117 leaves" for one student and "10 of 117" for the next: the summary's most common
    failure counts them as one (before: 1× each, and a rarer failure won the tie)."""
    from autograder import feedback

    def result(student: str, msg: str) -> dict:
        return {"student": student, "status": "graded", "scores": {"t": 0.0},
                "messages": {"t": msg}, "groups": {"1.3": 0.0}}

    results = [result("a", "LabCheckError: 11 of 117 leaves do not survive: int16 at offset 3008"),
               result("b", "LabCheckError: 10 of 117 leaves do not survive: int16 at offset 3010"),
               result("c", "WireError: the worker has gone")]
    rows = feedback.class_summary(results, {"t": 2.0}, {"1.3": 2.0}, {"t": "1.3"}, {})
    common = next(r for r in rows if r["name"] == "t")["most_common_failure"]
    assert common == "LabCheckError: 10 of 117 leaves do not survive: int16 at offset 3010 (2×)"
    # numbers that are not drawn still tell failures apart: Q10 and Q11, int16 and int32
    results = [result("a", "LabCheckError: Q10 is wrong"), result("b", "LabCheckError: Q11 is wrong"),
               result("c", "LabCheckError: Q11 is wrong")]
    rows = feedback.class_summary(results, {"t": 2.0}, {"1.3": 2.0}, {"t": "1.3"}, {})
    assert next(r for r in rows if r["name"] == "t")["most_common_failure"] == \
        "LabCheckError: Q11 is wrong (2×)"
