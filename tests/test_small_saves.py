"""Small saves: how many sequential fsync rounds they wait for, and the kernel-AIO group
commit that issues a round's fsyncs without starting threads (issue 19, item 4).

A durable save needs two rounds, one after the other: every file and directory of the
temporary tree (one group commit), then — after the rename — the parent directory. These
tests count rounds, never time them.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions
from minickpt import fs as mfs
from minickpt.fs import FileSystem, SyncBatch


class RoundCounter(FileSystem):
    """Counts sequential fsync rounds: each ``fsync_all`` is one (its fsyncs run together),
    each fsync outside one is one more."""

    def __init__(self) -> None:
        self.rounds: list[str] = []
        self.fsyncs = 0
        self._in_batch = 0
        self._lock = threading.Lock()

    def fsync_all(self, fds=(), dirs=()) -> None:
        self.rounds.append(f"batch({len(fds)} files, {len(dirs)} dirs)")
        self._in_batch += 1
        try:
            super().fsync_all(fds, dirs)
        finally:
            self._in_batch -= 1

    def fsync(self, fd: int) -> None:
        with self._lock:
            self.fsyncs += 1
            if not self._in_batch:
                self.rounds.append("fsync")
        super().fsync(fd)


def tiny() -> dict:
    return {"w": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(4, np.float32),
            "step": np.int32(7), "lr": np.float32(1e-3)}


def test_a_checkpointer_save_waits_for_two_fsync_rounds(tmp_path):
    fs = RoundCounter()
    Checkpointer(fs).save(tmp_path / "c", {"state": tiny()})
    assert len(fs.rounds) == 2, (f"a save should wait for two fsync rounds (the temporary "
                                 f"tree together, then the parent), it waited for {fs.rounds}")
    assert fs.rounds[0].startswith("batch") and fs.rounds[1] == "fsync"
    assert Checkpointer().verify(tmp_path / "c").ok


@pytest.mark.parametrize("background", [False, True], ids=["sync-delete", "background-delete"])
def test_a_manager_save_with_retention_waits_for_few_rounds(tmp_path, background):
    fs = RoundCounter()
    m = CheckpointManager(tmp_path, CheckpointManagerOptions(
        max_to_keep=2, enable_background_delete=background), fs=fs)
    try:
        for s in range(3):
            m.save(s, {"state": tiny()})
        m.wait_until_finished()
        fs.rounds.clear()
        m.save(3, {"state": tiny()})  # commits step 3, deletes step 1
        rounds = list(fs.rounds)
        m.wait_until_finished()
        assert m.all_steps() == [2, 3]
    finally:
        m.close()
    # the save: tree, parent; the delete: the retirement's rename made durable before any
    # file of the old step goes (on the background thread with background delete)
    limit = 2 if background else 3
    assert len(rounds) <= limit, f"a manager save waited for {rounds} (at most {limit})"
    assert [n for n in sorted(os.listdir(tmp_path)) if n.startswith("step")] == ["step_2", "step_3"]


def _files(tmp_path, n):
    fds = []
    for i in range(n):
        fds.append(os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.write(fds[-1], f"file {i}".encode())
    return fds


def test_fsync_all_syncs_files_and_directories(tmp_path):
    sub = tmp_path / "d"
    sub.mkdir()
    fds = _files(tmp_path, 5)
    try:
        FileSystem().fsync_all(fds, [str(sub), str(tmp_path)])
    finally:
        for fd in fds:
            os.close(fd)
    assert (tmp_path / "f3").read_bytes() == b"file 3"


def test_fsync_all_of_more_than_one_ring_depth(tmp_path):
    fds = _files(tmp_path, mfs._AIO_DEPTH + 3)
    try:
        FileSystem().fsync_all(fds, [str(tmp_path)])
    finally:
        for fd in fds:
            os.close(fd)


def test_fsync_all_raises_a_bad_descriptors_error_after_syncing_the_rest(tmp_path):
    fds = _files(tmp_path, 3)
    bad = 1 << 20  # above any open-file limit: never an open descriptor
    try:
        with pytest.raises(OSError) as e:
            FileSystem().fsync_all([fds[0], bad, fds[1], fds[2]], [str(tmp_path)])
        assert e.value.errno == errno.EBADF
    finally:
        for fd in fds:
            os.close(fd)


def test_without_kernel_aio_the_threads_do_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mfs._AIO_RINGS, "broken", True)
    monkeypatch.setattr(mfs._AIO_RINGS, "free", [])
    fs = FileSystem()
    Checkpointer(fs).save(tmp_path / "c", {"state": tiny()})
    assert Checkpointer().verify(tmp_path / "c").ok


def test_a_subclass_that_watches_fsync_sees_every_one(tmp_path):
    """The AIO path is only for the real primitives: a FileSystem that observes (or faults)
    fsync — the tests, the crash harness — must be called for every file and directory."""
    fs = RoundCounter()
    with SyncBatch(fs) as batch:
        for fd in _files(tmp_path, 4):
            batch.add_file(fd)
        batch.add_dir(str(tmp_path))
        batch.flush()
    assert fs.fsyncs == 5
