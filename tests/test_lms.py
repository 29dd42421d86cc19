"""Issue 52: from an LMS download to grades in the LMS.

* intake: a Canvas zip (a late hand-in, a resubmission, a file that is not a notebook) and a
  Moodle folder (names with spaces and non-ASCII letters): one row per student, from the
  newest file, and every file of the input in intake.csv;
* nobody lost: a refused hand-in is a row and a page; any name gets a key;
* a regrade of one student into the class's results: the others' rows and pages the same
  bytes, his new, said in regrades.csv; an instructor's override survives it;
* the LMS's own gradebook filled: a Canvas export and a Moodle grading worksheet, their columns
  as those LMSs document them;
* repairs: a notebook with 50 MB of outputs and an nbformat 3 notebook of the solution score
  full marks, with a note on the page.

The real gradings (lab 1, the quickest, ``-j 1``) happen once for the module: one Canvas
class, then two regrades of one student. The Moodle layout is graded with a pool that runs no
kernel (what it tests is the intake and the reports, not the kernels).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import ROOT, grade, runner, sandbox
from autograder.lms import gradebook, intake, overrides
from autograder.notebook import SubmissionError, read_submission

LAB = "lab01_basics"
EXAMPLES = ROOT / "autograder" / "examples"
PERFECT = EXAMPLES / "perfect" / LAB / f"{LAB}.ipynb"
PARTIAL = EXAMPLES / "partial" / LAB / f"{LAB}.ipynb"
BLANK = ROOT / "labs" / LAB / f"{LAB}.ipynb"
SOURCE = ROOT / "solutions"
REQUIRE = os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1"


@functools.cache
def _isolation_args() -> tuple[str, ...]:
    """Sandboxed where the sandbox works (CI, as root, requires it); else --unsandboxed."""
    iso = sandbox.probe()
    if iso.sandboxed:
        return ()
    if REQUIRE:
        pytest.fail(f"the sandbox is required here: {iso.detail}")
    return ("--unsandboxed",)


def _grade_sh(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(["bash", str(ROOT / "autograder" / "grade.sh"), *args, "-j", "1",
                           "--timeout", "60", *_isolation_args()],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _big_outputs(path: Path, megabytes: int = 50) -> None:
    """The solution with ``megabytes`` MB of printed output in its first code cell."""
    nb = json.loads(PERFECT.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["outputs"] = [{"output_type": "stream", "name": "stdout",
                        "text": "loss 0.123456789\n" * (megabytes * (1 << 20) // 17)}]
    path.write_text(json.dumps(nb))


def _nbformat3(path: Path) -> None:
    nb = nbformat.read(PERFECT, as_version=4)
    path.write_text(nbformat.writes(nbformat.convert(nb, 3), version=3))


CANVAS = {  # file name in Canvas's zip -> what it holds
    "smithjane_12345_678901_lab01_basics.ipynb": BLANK,        # first try
    "smithjane_12345_678950_lab01_basics-1.ipynb": PERFECT,    # uploaded again: the newest
    "doejohn_LATE_22222_679000_lab01_basics.ipynb": PARTIAL,   # late
    "leeann_33333_679001_essay.pdf": b"%PDF-1.4 not a notebook",
    "bigout_44444_679100_lab01_basics.ipynb": _big_outputs,    # 50 MB of outputs
    "oldfmt_55555_679200_lab01_basics.ipynb": _nbformat3,      # nbformat 3
}
KEYS = {"smithjane_12345", "doejohn_22222", "leeann_33333", "bigout_44444", "oldfmt_55555"}


@pytest.fixture(scope="module")
def canvas(tmp_path_factory):
    """A Canvas download of lab 1 graded for real, once; its out folder and a copy of it."""
    tmp = tmp_path_factory.mktemp("canvas")
    made = tmp / "made"
    made.mkdir()
    archive = tmp / "submissions.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, what in CANVAS.items():
            if isinstance(what, bytes):
                zf.writestr(name, what)
            elif isinstance(what, Path):
                zf.write(what, name)
            else:
                what(made / name)
                zf.write(made / name, name)
        zf.writestr("notes from the LMS.txt", "not anybody's hand-in")
    shutil.rmtree(made)
    out = tmp / "out"
    proc = _grade_sh(str(archive), "--lab", LAB, "--out", str(out), "--work", str(tmp / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    snapshot = tmp / "first"
    shutil.copytree(out, snapshot)
    return {"tmp": tmp, "zip": archive, "out": out, "first": snapshot, "stdout": proc.stdout}


@pytest.mark.timeout(900)
def test_a_canvas_zip_gives_one_row_per_student_from_the_newest_file(canvas):
    first = canvas["first"]
    rows = {r["student"]: r for r in _csv(first / "grades.csv")}
    assert set(rows) == KEYS, rows
    info = grade.lab_info(SOURCE / LAB / f"{LAB}.ipynb", LAB)
    full = f"{info.max_score:g}"
    assert (rows["smithjane_12345"]["name"], rows["smithjane_12345"]["lms_id"]) == \
        ("smithjane", "12345")
    assert rows["smithjane_12345"][LAB] == full, "the resubmission (-1), not the first try"
    assert rows["leeann_33333"]["status"] == "refused" and rows["leeann_33333"][LAB] == "0"
    assert rows["doejohn_22222"]["status"] == "graded"
    with zipfile.ZipFile(canvas["zip"]) as zf:
        names = set(zf.namelist())
    report = {r["file"]: r for r in _csv(first / "intake.csv")}
    assert set(report) == names, "every file of the zip is in the intake report"
    assert report["smithjane_12345_678901_lab01_basics.ipynb"]["status"] == "superseded"
    assert "678950" in report["smithjane_12345_678901_lab01_basics.ipynb"]["reason"]
    assert report["doejohn_LATE_22222_679000_lab01_basics.ipynb"]["late"] == "yes"
    assert report["leeann_33333_679001_essay.pdf"]["status"] == "refused"
    assert report["notes from the LMS.txt"]["status"] == "refused"
    results = json.loads((first / "results.json").read_text())
    assert sorted(r["student"] for r in results) == sorted(KEYS)
    summary = (first / "summary.txt").read_text()
    for key in KEYS:  # a row in every output, and a page
        assert key in summary and (first / "feedback" / key / f"{LAB}.html").is_file(), key
    assert "not a notebook" in (first / "feedback" / "leeann_33333" / f"{LAB}.html").read_text()
    assert "late" in (first / "feedback" / "doejohn_22222" / f"{LAB}.html").read_text()
    page = (first / "feedback" / "smithjane_12345" / f"{LAB}.html").read_text()
    assert "superseded: smithjane_12345_678901_lab01_basics.ipynb" in page


@pytest.mark.timeout(900)
def test_50_mb_of_outputs_and_nbformat_3_are_repaired_and_score_full_marks(canvas):
    first = canvas["first"]
    rows = {r["student"]: r for r in json.loads((first / "results.json").read_text())}
    for key, said in (("bigout_44444", "outputs were cleared"), ("oldfmt_55555", "nbformat 3")):
        r = rows[key]
        assert (r["status"], r["total"]) == ("graded", r["max_score"]), (key, r["reason"])
        assert any(said in n for n in r["notes"]), r["notes"]
        assert said in (first / "feedback" / key / f"{LAB}.html").read_text()


def _lines(folder: Path, name: str) -> dict[str, str]:
    text = (folder / name).read_text(encoding="utf-8").splitlines()
    return {line.split(",")[0]: line for line in text[1:]}


@pytest.mark.timeout(900)
def test_a_regrade_of_one_student_keeps_everyone_else_byte_for_byte(canvas):
    tmp, out, first = canvas["tmp"], canvas["out"], canvas["first"]
    resub = tmp / "resubmitted"
    resub.mkdir()
    shutil.copyfile(BLANK, resub / "doejohn_22222_680000_lab01_basics-1.ipynb")
    proc = _grade_sh(str(resub), "--update", "--lab", LAB, "--out", str(out),
                     "--work", str(tmp / "work2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "regraded doejohn_22222/lab01_basics: replaced" in proc.stdout
    others = KEYS - {"doejohn_22222"}
    for name in ("grades.csv", f"grades-{LAB}.csv"):
        before, after = _lines(first, name), _lines(out, name)
        assert set(after) == set(before)
        for key in others:
            assert after[key] == before[key], (name, key)
        assert after["doejohn_22222"] != before["doejohn_22222"]
    old = {r["student"]: r for r in json.loads((first / "results.json").read_text())}
    new = {r["student"]: r for r in json.loads((out / "results.json").read_text())}
    assert {k: new[k] for k in others} == {k: old[k] for k in others}
    assert new["doejohn_22222"]["total"] == 0 < old["doejohn_22222"]["total"]
    for key in others:
        page = Path("feedback") / key / f"{LAB}.html"
        assert (out / page).read_bytes() == (first / page).read_bytes(), key
    page = Path("feedback") / "doejohn_22222" / f"{LAB}.html"
    assert (out / page).read_bytes() != (first / page).read_bytes()
    log = _csv(out / "regrades.csv")
    assert [(r["student"], r["before"], r["after"]) for r in log] == \
        [("doejohn_22222", f"{old['doejohn_22222']['total']:g}", "0")]
    files = [r["file"] for r in _csv(out / "intake.csv")]
    assert len(files) == len(set(files)), "a file once"
    intake_rows = set(files)
    assert "doejohn_22222_680000_lab01_basics-1.ipynb" in intake_rows
    assert "smithjane_12345_678901_lab01_basics.ipynb" in intake_rows  # the class's, kept


@pytest.mark.timeout(900)
def test_an_override_survives_a_regrade_and_shows_on_the_page(canvas):
    tmp, out = canvas["tmp"], canvas["out"]
    info = grade.lab_info(SOURCE / LAB / f"{LAB}.ipynb", LAB)
    test_id = next(iter(info.cells))
    (out / "overrides.csv").write_text("student,lab,test,points,comment\n"
                                       f"smithjane,{LAB},{test_id},0,read by hand: copied\n")
    proc = _grade_sh(str(canvas["zip"]), "--student", "22222", "--lab", LAB, "--out", str(out),
                     "--work", str(tmp / "work3"))  # doejohn again, by his Canvas id
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["student"]: r for r in json.loads((out / "results.json").read_text())}
    smith = rows["smithjane_12345"]
    assert smith["total"] == info.max_score - info.cells[test_id]
    assert smith["overrides"][0]["graded"] == info.cells[test_id]
    assert rows["doejohn_22222"]["total"] > 0, "his zip's hand-in, graded again"
    page = (out / "feedback" / "smithjane_12345" / f"{LAB}.html").read_text()
    assert "read by hand: copied" in page and "Points set by your instructor" in page
    assert (out / "overrides.csv").exists()
    assert [r["student"] for r in _csv(out / "regrades.csv")] == ["doejohn_22222"] * 2
    files = [r["file"] for r in _csv(out / "intake.csv")]
    assert len(files) == len(set(files)) and "notes from the LMS.txt" in files
    grades = {r["student"]: r for r in _csv(out / "grades.csv")}
    assert grades["smithjane_12345"][LAB] == f"{info.max_score - info.cells[test_id]:g}"


CANVAS_EXPORT = (
    "Student,ID,SIS User ID,SIS Login ID,Section,Lab 1: basics (lab01_basics) (901),"
    "Lab 2 (902),Current Score,Unposted Current Score,Final Score\n"
    "    Points Possible,,,,,,10,(read only),(read only),(read only)\n"
    '"Smith, Jane",12345,s12345,jsmith,Section A,,7,70,70,35\n'
    '"Doe, John",22222,s22222,jdoe,Section A,,,,,\n'
    '"Lee, Ann",33333,s33333,alee,Section A,,9,90,90,45\n'
    '"Big, Out",44444,s44444,bout,Section A,,,,,\n'
    '"Old, Fmt",55555,s55555,ofmt,Section A,,,,,\n'
    '"Absent, Al",66666,s66666,aal,Section A,,,,,\n'
    "\"Student, Test\",99999,,,Section A,,,,,\n")


@pytest.mark.timeout(900)
def test_a_canvas_gradebook_export_is_filled_in_its_own_format(canvas, tmp_path):
    out = canvas["out"]
    book = tmp_path / "export.csv"
    book.write_text(CANVAS_EXPORT)
    assert grade.main(["gradebook", str(book), "--out", str(out)]) == 0
    filled = list(csv.reader(open(out / f"gradebook-canvas-{LAB}.csv", newline="")))
    given = list(csv.reader(io.StringIO(CANVAS_EXPORT)))
    assert filled[0] == given[0], "the header, Canvas's columns and their order, unchanged"
    assert filled[0][:5] == list(gradebook.CANVAS_FIXED)
    col = filled[0].index("Lab 1: basics (lab01_basics) (901)")
    results = {r["lms_id"]: r for r in json.loads((out / "results.json").read_text())}
    assert filled[1][0].strip() == "Points Possible"
    assert filled[1][col] == f"{results['12345']['max_score']:g}"
    by_id = {row[1]: row for row in filled[2:]}
    assert set(by_id) == {row[1] for row in given[2:]}
    for sid in ("12345", "22222", "44444", "55555"):
        assert by_id[sid][col] == f"{results[sid]['total']:g}", sid
    for sid in ("33333", "66666", "99999"):  # refused, absent, Canvas's test student: blank
        assert by_id[sid][col] == "", sid
    for row, old in zip(filled[1:], given[1:], strict=True):  # nothing else changed
        assert row[:col] + row[col + 1:] == old[:col] + old[col + 1:]
    apart = {r["lms_id"]: r for r in _csv(out / f"gradebook-apart-{LAB}.csv")}
    assert apart["33333"]["status"] == "refused" and "notebook" in apart["33333"]["reason"]
    assert set(apart) == {"33333", "66666", "99999"}


def _row(student: str, lms_id: str, status: str, total: float, name: str = "") -> dict:
    return {"student": student, "name": name or student, "lms_id": lms_id, "lab": LAB,
            "status": status, "total": total, "max_score": 26.0, "reason": f"{status} here"}


MOODLE_WORKSHEET = (
    "Identifier,Full name,Email address,Status,Grade,Maximum Grade,Grade can be changed,"
    "Last modified (submission),Last modified (grade),Feedback comments\n"
    "Participant 12345,Jane Smith,jane@example.edu,Submitted for grading,,100.00,Yes,"
    '"Monday, 2 December 2024, 10:00 AM",-,\n'
    "Participant 12346,张伟,zw@example.edu,Submitted for grading,,100.00,Yes,-,-,\n"
    "Participant 12347,Jane Smith,jane2@example.edu,Submitted for grading,,100.00,Yes,-,-,\n"
    "Participant 12349,Ana María,ana@example.edu,No submission,,100.00,Yes,-,-,\n")


def test_a_moodle_grading_worksheet_is_filled_on_its_scale(tmp_path):
    book = tmp_path / "Grades-lab01.csv"
    book.write_text(MOODLE_WORKSHEET, encoding="utf-8")
    results = [_row("Jane-Smith_12345", "12345", "graded", 13.0, "Jane Smith"),
               _row("student_12346", "12346", "graded", 26.0, "张伟"),
               _row("Jane-Smith_12347", "12347", "refused", 0.0, "Jane Smith"),
               _row("Ana-Maria_12348", "12348", "failed", 0.0, "Ana María")]
    done = gradebook.fill(book, tmp_path / "out.csv", results, LAB, 26.0)
    assert done.lms == "moodle" and done.written == 2
    filled = list(csv.reader(open(tmp_path / "out.csv", newline="", encoding="utf-8")))
    given = list(csv.reader(io.StringIO(MOODLE_WORKSHEET)))
    assert filled[0] == given[0] and filled[0][:6] == list(gradebook.MOODLE_FIXED)
    grade_at = filled[0].index("Grade")
    by_id = {row[0]: row for row in filled[1:]}
    assert by_id["Participant 12345"][grade_at] == "50"  # 13 of 26 on Moodle's 100
    assert by_id["Participant 12346"][grade_at] == "100"
    assert by_id["Participant 12347"][grade_at] == ""  # refused: never a plain 0
    assert by_id["Participant 12349"][grade_at] == ""
    for row, old in zip(filled[1:], given[1:], strict=True):
        assert row[:grade_at] + row[grade_at + 1:] == old[:grade_at] + old[grade_at + 1:]
    apart = {a["lms_id"]: a["status"] for a in done.apart}
    assert apart == {"12347": "refused", "12348": "failed", "12349": "no result"}
    assert any("scaled" in n for n in done.notes)


def test_a_canvas_gradebook_without_the_labs_column_gets_one_with_its_points(tmp_path):
    book = tmp_path / "export.csv"
    book.write_text("Student,ID,SIS User ID,SIS Login ID,Section,Final Score\n"
                    '"Smith, Jane",12345,,,A,\n')
    done = gradebook.fill(book, tmp_path / "out.csv", [_row("s", "12345", "graded", 20.0)],
                          LAB, 26.0)
    rows = list(csv.reader(open(tmp_path / "out.csv", newline="")))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", LAB,
                       "Final Score"]
    assert rows[1][0].strip() == "Points Possible" and rows[1][5] == "26"
    assert rows[2][5] == "20" and done.written == 1


def _fake_pool(ran: list):
    """A pool that runs no kernel: every notebook 0 points, its path recorded."""

    def run_pool(jobs, cfg, n, logs, on_result):
        for job in jobs:
            ran.append(job)
            info = grade.lab_info(SOURCE / job.lab / f"{job.lab}.ipynb", job.lab)
            on_result(job, {"student": job.student, "lab": job.lab, "status": "graded",
                            "reason": "", "isolation": "fake", "ran_all_cells": True,
                            "scores": dict.fromkeys(info.cells, 0.0)}, 0.0)

    return run_pool


MOODLE = {  # folder/file -> seconds before now (the file's time)
    "Jane Smith_12345_assignsubmission_file_/lab01_basics.ipynb": 100,
    "张伟_12346_assignsubmission_file_/lab01_basics.ipynb": 500,
    "张伟_12346_assignsubmission_file_/lab01_basics (1).ipynb": 50,
    "Jane Smith_12347_assignsubmission_file_/notes.docx": 80,
    "Ana María_12348_assignsubmission_file_/my lab01_basics.ipynb": 70,
}


def test_a_moodle_folder_with_spaces_and_non_ascii_names_loses_nobody(tmp_path, monkeypatch,
                                                                      capsys):
    subs = tmp_path / "moodle"
    now = time.time()
    for rel, age in MOODLE.items():
        (subs / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".ipynb"):
            shutil.copyfile(BLANK, subs / rel)
        else:
            (subs / rel).write_text("a docx")
        os.utime(subs / rel, (now - age, now - age))
    ran: list = []
    monkeypatch.setattr(runner, "run_pool", _fake_pool(ran))
    out = tmp_path / "out"
    args = ["--lab", LAB, "--unsandboxed", "--out", str(out), "--work", str(tmp_path / "w"),
            "--compile-cache", "off"]
    assert grade.main([str(subs), *args]) == 0
    keys = {"Jane-Smith_12345": "Jane Smith", "student_12346": "张伟",
            "Jane-Smith_12347": "Jane Smith", "Ana-Maria_12348": "Ana María"}
    rows = _csv(out / "grades.csv")
    assert sorted(r["student"] for r in rows) == sorted(keys), "exactly one row per student"
    assert {r["student"]: r["name"] for r in rows} == keys, "the CSV keeps the name as given"
    assert {r["student"]: r["status"] for r in rows}["Jane-Smith_12347"] == "refused"
    graded = {j.student: Path(j.notebook).name for j in ran}
    assert graded["student_12346"] == "lab01_basics (1).ipynb", "the newest file"
    results = json.loads((out / "results.json").read_text())
    assert sorted(r["student"] for r in results) == sorted(keys)
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    assert all(k in summary for k in keys)
    report = {r["file"]: r for r in _csv(out / "intake.csv")}
    assert set(report) == set(MOODLE), "every file of the input"
    assert report["张伟_12346_assignsubmission_file_/lab01_basics.ipynb"]["status"] == "superseded"
    assert (out / "feedback" / "Jane-Smith_12347" / f"{LAB}.html").is_file()
    # a plain run with fewer students into the class's folder says what it drops
    shutil.rmtree(subs / "Ana María_12348_assignsubmission_file_")
    capsys.readouterr()
    assert grade.main([str(subs), *args]) == 0
    err = capsys.readouterr().err
    assert "REPLACING" in err and "Ana-Maria_12348" in err
    assert grade.main([str(subs), "--student", "nobody", *args]) == 2


def test_a_pattern_with_named_groups_reads_any_layout(tmp_path):
    for rel in ("ps1/s001/2024-01-30 15:00:00/lab01_basics.ipynb",
                "ps1/s001/2024-02-01 09:00:00/lab01_basics.ipynb",
                "ps1/s002/2024-01-29 10:00:00/lab01_basics.ipynb"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    pattern = r"ps1/(?P<student_id>s\d+)/(?P<timestamp>[^/]+)/(?P<file_id>.+)"
    found = intake.collect(tmp_path, {LAB, "lab02_save_policy"}, pattern=pattern)
    assert found.layout == "pattern"
    assert {k: p.parent.name for k, p in found.chosen.items()} == {
        ("s001", LAB): "2024-02-01 09:00:00", ("s002", LAB): "2024-01-29 10:00:00"}
    assert [f.status for f in found.files].count("superseded") == 1
    with pytest.raises(intake.IntakeError, match="student_id"):
        intake.collect(tmp_path, {LAB}, pattern=r"(?P<file_id>.+)")


def test_any_name_gets_a_key_that_can_be_a_folder():
    assert intake.student_key("alice") == "alice"
    assert intake.student_key("Jane Smith", "12345") == "Jane-Smith_12345"
    assert intake.student_key("张伟", "12346") == "student_12346"
    odd = intake.student_key("张伟")
    assert grade.STUDENT_RE.match(odd) and odd != intake.student_key("李娜")
    assert grade.STUDENT_RE.match(intake.student_key("../../etc"))
    assert intake.STUDENT_RE.pattern == grade.STUDENT_RE.pattern


def test_one_lms_id_is_one_student_however_a_file_spells_the_name(tmp_path):
    for name in ("smithjane_12345_1_lab01_basics.ipynb", "smithjanet_12345_2_lab01_basics.ipynb"):
        (tmp_path / name).write_text("{}")
    found = intake.collect(tmp_path, {LAB})
    assert list(found.chosen) == [("smithjane_12345", LAB)]
    assert [f.status for f in found.files] == ["superseded", "graded"]


def test_what_cannot_be_repaired_is_a_reason(tmp_path):
    v3 = {"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": "junk"}
    (tmp_path / "a.ipynb").write_text(json.dumps(v3))
    with pytest.raises(SubmissionError, match="nbformat 3"):
        read_submission(tmp_path / "a.ipynb")
    nb = json.loads(BLANK.read_text())
    nb["cells"][-1]["source"] = "x = 1\n" * (4 << 20)  # 24 MiB of code: no output to clear
    (tmp_path / "b.ipynb").write_text(json.dumps(nb))
    with pytest.raises(SubmissionError, match="without its outputs"):
        read_submission(tmp_path / "b.ipynb")


def test_overrides_name_their_line_when_wrong(tmp_path):
    cells = {LAB: {"test_1_1_names": 2.0}}
    for body, why in (("alice,lab09,test_1_1_names,1,x", "no lab"),
                      ("alice,lab01_basics,test_9,1,x", "no test"),
                      ("alice,lab01_basics,test_1_1_names,3,x", "outside 0..2")):
        (tmp_path / "overrides.csv").write_text("student,lab,test,points,comment\n" + body + "\n")
        with pytest.raises(overrides.OverrideError, match=f"line 2: .*{why}"):
            overrides.load(tmp_path / "overrides.csv", cells)


def test_the_slices_of_an_lms_download_merge_into_the_single_runs_reports(tmp_path, monkeypatch):
    """A class sharded and merged (grade.sh --shard, merge) writes the single run's
    grades.csv, results.json and intake.csv (a file no student owns is in every slice's)."""
    subs = tmp_path / "moodle"
    for rel in [*MOODLE, "index.html"]:
        (subs / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(BLANK, subs / rel) if rel.endswith(".ipynb") else \
            (subs / rel).write_text("x")
    monkeypatch.setattr(runner, "run_pool", _fake_pool([]))
    args = ["--lab", LAB, "--unsandboxed", "--compile-cache", "off"]
    for name, extra in (("one", []), ("s1", ["--shard", "1/2"]), ("s2", ["--shard", "2/2"])):
        assert grade.main([str(subs), *args, *extra, "--out", str(tmp_path / name),
                           "--work", str(tmp_path / f"w{name}")]) == 0
    assert grade.main(["merge", str(tmp_path / "s1"), str(tmp_path / "s2"),
                       "--out", str(tmp_path / "merged")]) == 0
    for name in ("grades.csv", "intake.csv", "results.json", f"grades-{LAB}.csv"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_a_resubmission_in_the_course_layout_keeps_the_students_lms_id(tmp_path):
    from autograder.lms import regrade

    old = [_row("Jane-Smith_12345", "12345", "graded", 13.0, "Jane Smith"),
           _row("student_12346", "12346", "graded", 26.0, "张伟")]
    previous = regrade.Previous(tmp_path, old, {})
    new = [{**_row("Jane-Smith_12345", "", "graded", 20.0), "name": "Jane-Smith_12345"}]
    rows, changes = regrade.combine(previous, new)
    assert sorted((r["student"], r["name"], r["lms_id"], r["total"]) for r in rows) == [
        ("Jane-Smith_12345", "Jane Smith", "12345", 20.0),
        ("student_12346", "张伟", "12346", 26.0)]
    assert [(a["total"], b["total"]) for a, b in changes] == [(13.0, 20.0)]


def test_an_old_notebook_reads_as_the_same_cells_as_its_nbformat_4_self(tmp_path):
    """nbformat's converter, from JSON read safely: the student's cells, their grade ids and
    code unchanged, and the first cell says what was repaired (the page shows it)."""
    _nbformat3(tmp_path / "v3.ipynb")
    _big_outputs(tmp_path / "big.ipynb", megabytes=25)
    want = [(c.kind, c.grade_id, c.source) for c in read_submission(PERFECT)]
    for name, said in (("v3.ipynb", "nbformat 3"), ("big.ipynb", "outputs were cleared")):
        got = read_submission(tmp_path / name)
        assert [(c.kind, c.grade_id, c.source) for c in got] == want, name
        assert said in got[0].note
