"""Where the judge's and the drills' scratch folders go (autograder/drills.scratch_parent): in
memory where there is room (the judge's tests make and delete thousands of small files, which
a busy disk's journal makes slow), in the job's folder otherwise; a sandboxed worker writes
there all the same, and a dead grader's folders do not stay in memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autograder import drills
from minickpt.launch import helper_env

pytestmark = pytest.mark.timeout(120)
MEMORY = drills.MEMORY_DIR
HAS_MEMORY = os.path.isdir(MEMORY) and os.access(MEMORY, os.W_OK) and \
    os.statvfs(MEMORY).f_bavail * os.statvfs(MEMORY).f_frsize >= 2 * drills.SCRATCH_BYTES


@pytest.mark.skipif(not HAS_MEMORY, reason=f"no room in {MEMORY} on this machine")
def test_a_scratch_folder_is_made_in_memory_and_removed_after(box, tmp_path):
    with box.scratch() as d:
        assert os.path.dirname(d) == MEMORY
        assert os.path.basename(d).startswith(f"{drills.SCRATCH_PREFIX}{os.getpid()}-")
    assert not os.path.exists(d)


def test_without_room_in_memory_or_when_told_it_stays_in_the_jobs_folder(tmp_path, monkeypatch):
    small = tmp_path / "small"
    small.mkdir()
    assert drills.scratch_parent(tmp_path, memory=str(tmp_path / "absent")) == str(tmp_path)
    if HAS_MEMORY:
        monkeypatch.setenv("MINICKPT_GRADE_SCRATCH", "disk")
        assert drills.scratch_parent(tmp_path) == str(tmp_path)
        monkeypatch.delenv("MINICKPT_GRADE_SCRATCH")
        assert drills.scratch_parent(tmp_path) == MEMORY
    monkeypatch.setattr(drills, "SCRATCH_BYTES", 1 << 62)  # no tmpfs has room for two
    assert drills.scratch_parent(tmp_path) == str(tmp_path)


def test_a_dead_graders_scratch_folders_are_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        (tmp_path / f"{drills.SCRATCH_PREFIX}{pid}-abc" / "step_1").mkdir(parents=True)
    (tmp_path / "someone-elses").mkdir()
    os.chmod(tmp_path, 0o1777)
    assert drills.scratch_parent("/nowhere", memory=str(tmp_path)) in (str(tmp_path),
                                                                        "/nowhere")
    drills._sweep(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{drills.SCRATCH_PREFIX}{os.getpid()}-abc", "someone-elses"])


def test_a_sandboxed_worker_reads_and_writes_its_scratch_folder(box):
    """The sandbox mounts a tmpfs of its own on /dev/shm: the scratch folder, bound over it
    at its own path, is the grader's folder, not that tmpfs."""
    with box.scratch() as d:
        with open(os.path.join(d, "given"), "w") as f:
            f.write("from the grader")
        code = ("import os, sys; d = sys.argv[1]; "
                "print(open(os.path.join(d, 'given')).read()); "
                "open(os.path.join(d, 'made'), 'w').write('by the worker')")
        argv = box.wrap(d)([sys.executable, "-c", code, d], {})
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env=helper_env())
        assert out.returncode == 0, out.stderr[-2000:]
        assert "from the grader" in out.stdout
        assert open(os.path.join(d, "made")).read() == "by the worker"
