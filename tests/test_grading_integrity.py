"""The integrity of what grading reports (issue 31): reserved names, what a student writes into
the reports, copies, and floods of the grader itself.

Everything here is quick: no lab is graded in a kernel (``run_pool`` is replaced where a whole
run is needed), except the flood tests, which start one bare kernel each, bounded in time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autograder import ROOT, grade, runner

LAB = "lab01_basics"
RELEASE = ROOT / "labs" / LAB / f"{LAB}.ipynb"
SOURCE = ROOT / "solutions"


# ---------------------------------------------------------------------------------------
# (4) reserved names
# ---------------------------------------------------------------------------------------
def _fake_pool(ran: list):
    """A run_pool that grades nothing: a job for the lab's source scores full marks, any other
    none; every job is recorded."""

    def run_pool(jobs, cfg, n, logs, on_result):
        for job in jobs:
            ran.append(job)
            from_source = Path(job.notebook).resolve().is_relative_to(SOURCE.resolve())
            info = grade.lab_info(SOURCE / job.lab / f"{job.lab}.ipynb", job.lab)
            scores = {g: (p if from_source else 0.0) for g, p in info.cells.items()}
            on_result(job, {"student": job.student, "lab": job.lab, "status": "graded",
                            "reason": "", "isolation": "fake", "ran_all_cells": False,
                            "scores": scores}, 0.0)

    return run_pool


@pytest.mark.parametrize("include_solutions", [False, True])
def test_a_student_id_the_grader_uses_is_graded_as_that_student(tmp_path, monkeypatch,
                                                                include_solutions):
    subs = tmp_path / "subs"
    for student in ("reference", "Reference", "alice"):
        (subs / student / LAB).mkdir(parents=True)
        shutil.copyfile(RELEASE, subs / student / LAB / f"{LAB}.ipynb")
    ran: list = []
    monkeypatch.setattr(runner, "run_pool", _fake_pool(ran))
    rc = grade.main([str(subs), "--lab", LAB, "--unsandboxed", "--out", str(tmp_path / "out"),
                     "--work", str(tmp_path / "work"), "--compile-cache", str(tmp_path / "cc"),
                     *(["--include-solutions"] if include_solutions else [])])
    assert rc == 0
    rows = {r["student"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    for student in ("reference", "Reference", "alice"):  # a blank notebook: 0, its own run
        assert rows[student]["total"] == 0, (student, rows[student])
        assert any(j.student == student and Path(j.notebook) ==
                   subs / student / LAB / f"{LAB}.ipynb" for j in ran), student
    graders = set(rows) - {"reference", "Reference", "alice"}
    assert len(graders) == int(include_solutions)
    for name in graders:  # the grader's own row: full marks, a name no student can have
        assert rows[name]["total"] == rows[name]["max_score"] > 0
        assert not grade.STUDENT_RE.match(name)
    dirs = [j.dir for j in ran]
    assert len(dirs) == len(set(dirs)), "two jobs shared a work folder"
