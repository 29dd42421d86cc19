"""Two grade.sh runs in one checkout at once (two instructors, or a TA's lab beside another's):
before, the second emptied the first's work folder (``.grading/`` by default) as it started,
and the first's remaining submissions were graded 0 with "status error" (bwrap: "Can't find
source path .grading/graded/<lab>/minickpt"). Now a run holds its work and results folders
while it runs: a second run on the default work folder works beside it in a folder of its own,
and one given a folder in use (``--work`` or ``--out``) stops at once, saying so, and changes
nothing there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import ROOT

pytestmark = pytest.mark.timeout(300)

HOLD = """
import sys, time
from pathlib import Path
from autograder.grade import hold_folder
assert hold_folder(Path(sys.argv[1])) is not None
print("held", flush=True)
time.sleep(120)
"""
"""Another run, as far as the folder is concerned: it holds ``argv[1]`` until it is killed."""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def _holding(folder: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                         text=True, env=_env(), cwd=ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _grade(*args: str) -> subprocess.CompletedProcess[str]:
    # --student nobody: the run stops at the intake (exit 2) after preparing its folders
    return subprocess.run([sys.executable, "-m", "autograder.grade",
                           str(ROOT / "autograder" / "examples"), "--lab", "lab01_basics",
                           "--student", "nobody", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=240)


def _ours(folder: Path) -> None:
    """A folder as a finished grade.sh run leaves it (the mark) with a file in it."""
    folder.mkdir(parents=True)
    (folder / ".minickpt-grading").write_text("written by autograder/grade.sh\n")
    (folder / "graded").mkdir()
    (folder / "graded" / "in-use.txt").write_text("the other run's\n")


@pytest.mark.parametrize("which", ["--work", "--out"])
def test_a_folder_another_run_holds_is_refused_and_left_as_it_is(tmp_path, which):
    busy = tmp_path / "busy"
    _ours(busy)
    other = _holding(busy)
    try:
        free = tmp_path / ("out" if which == "--work" else "work")
        r = _grade(which, str(busy), "--out" if which == "--work" else "--work", str(free))
    finally:
        other.kill()
        other.wait()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "in use by another grade.sh run" in r.stderr and str(busy) in r.stderr, r.stderr
    assert (busy / "graded" / "in-use.txt").read_text() == "the other run's\n"


def test_a_folder_is_free_again_once_its_run_has_ended(tmp_path):
    busy = tmp_path / "work"
    _ours(busy)
    other = _holding(busy)
    other.kill()
    other.wait()
    r = _grade("--work", str(busy), "--out", str(tmp_path / "out"))
    assert "in use" not in r.stderr, r.stderr
    assert "--student nobody: not in" in r.stderr  # it got as far as the intake
    assert not (busy / "graded").exists()  # emptied for its own run, as before


def test_a_second_run_on_the_default_work_folder_works_beside_the_first(tmp_path):
    default = ROOT / ".grading"
    other = _holding(default)
    try:
        r = _grade("--out", str(tmp_path / "out"))
    finally:
        other.kill()
        other.wait()
    assert r.returncode == 2 and "--student nobody: not in" in r.stderr, r.stderr
    said = [line for line in r.stderr.splitlines() if "in use by another grade.sh run" in line]
    assert said and "works in" in said[0], r.stderr
    beside = Path(said[0].split("works in ")[1].split(" ")[0])
    assert beside.parent == default.parent and beside != default
    assert not beside.exists()  # removed at the run's end


def test_one_process_grades_twice_into_the_same_folders(tmp_path, capsys):
    """grade.main called twice in one process (a notebook, a script, the LMS tests): the
    first call's hold on its folders ends when it returns, so the second is not refused as
    "in use" by the first (before: it was, and returned 2; test_lms's Moodle regrade failed)."""
    from autograder import grade

    args = [str(ROOT / "autograder" / "examples"), "--lab", "lab01_basics", "--student",
            "nobody", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    for _ in range(2):
        assert grade.main(args) == 2  # (--student nobody: it stops at the intake)
        err = capsys.readouterr().err
        assert "in use" not in err and "--student nobody: not in" in err, err
