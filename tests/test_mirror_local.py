"""The tiered manager's own duties, on a mirror in a directory (issue 42, items 3, 6, 10 and
local retention): an async local save's failure reaches the caller, mirror errors clear
when they no longer matter, a normal close() finishes the copies first."""

import errno
import logging
import os
import threading
import warnings

import numpy as np
import pytest

from minickpt import CheckpointManagerOptions
from minickpt.faults import FaultyFileSystem
from minickpt.fs import FileSystem
from minickpt.production.mirror import LEASE_FILE, LocalStore, MirrorError
from minickpt.production.tiered import TieredCheckpointManager


def _items(v):
    return {"params": {"w": np.full((64, 8), float(v), np.float32)}, "step": {"n": np.int64(v)}}


def _steps(d):
    return sorted(n for n in os.listdir(d) if n.startswith("step_"))


def _mirror_idle(m):
    """Wait for the copy thread to go idle without collecting a local save's error."""
    copies = getattr(m, "_copies", None)
    if copies is not None:
        assert copies.wait(60)
        return
    with m._idle:  # the code before the split
        while m._jobs:
            assert m._idle.wait(60)


class GatedFS(FileSystem):
    """A mirror disk whose writes wait for ``go`` (the copy is held up)."""

    def __init__(self):
        self.go = threading.Event()

    def write_file(self, path, buffers, **kw):
        if not path.endswith(LEASE_FILE):  # (the lease, taken on opening, is not held up)
            assert self.go.wait(60)
        return super().write_file(path, buffers, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["save", "wait_until_finished", "close"])
def test_an_async_local_save_that_fails_reaches_the_caller(tmp_path, caplog, call):
    full = FaultyFileSystem(
        error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), ops={"open"}, fail_at=0,
        persistent=True, when=lambda op, a: "step_1.minickpt-tmp" in a[0] and a[1] & os.O_CREAT)
    mirror_fs = GatedFS()
    o = CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    m = TieredCheckpointManager(tmp_path / "local", LocalStore(tmp_path / "mirror", mirror_fs),
                                o, fs=full, backoff_s=0.01)
    caplog.set_level(logging.ERROR, logger="minickpt")
    try:
        m.save(0, _items(0))
        m.local._async.wait_for_previous()  # step 0 committed, its copy held up
        m.save(1, _items(1))  # fails in the background: the disk is full
        m.local._async.wait_for_previous()
        assert full.tripped
        mirror_fs.go.set()  # the mirror copies step 0, then applies local retention
        _mirror_idle(m)
        with pytest.raises(OSError) as e:
            if call == "save":
                m.save(2, _items(2))
            elif call == "wait_until_finished":
                m.wait_until_finished()
            else:
                m.close()
        assert e.value.errno == errno.ENOSPC
        assert any("step 1" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        mirror_fs.go.set()
        m.close()


class FailingMirror(FileSystem):
    """A mirror disk on which every copy of the steps in ``broken`` fails."""

    def __init__(self, broken):
        self.broken = set(broken)

    def write_file(self, path, buffers, **kw):
        if any(f"/step_{s}.minickpt-tmp" in path for s in self.broken):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return super().write_file(path, buffers, **kw)


@pytest.mark.timeout(60)
def test_failed_copies_clear_once_retention_would_not_keep_them(tmp_path):
    o = CheckpointManagerOptions(max_to_keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TieredCheckpointManager(tmp_path / "local",
                                     LocalStore(tmp_path / "mirror", FailingMirror({0, 1})), o,
                                     max_attempts=1) as m:
            for s in range(2):
                m.save(s, _items(s))
            with pytest.raises(MirrorError, match="step 0"):
                m.wait_until_mirrored(timeout=60)
            for s in range(2, 4):  # later steps mirrored: 0 and 1 are no longer needed
                m.save(s, _items(s))
            m.wait_until_mirrored(timeout=60)  # nothing left to report
            assert m.mirror_steps() == [2, 3] and m.failed == {}
    assert _steps(tmp_path / "local") == ["step_2", "step_3"]


@pytest.mark.timeout(60)
def test_retry_failed_clears_what_it_copies_and_the_advice_is_true(tmp_path):
    """The local tier keeps 1, the mirror keeps all: a step whose copy failed stays on the
    local disk (as the error says), and retry_failed() copies it and clears it."""
    fs = FailingMirror({0})
    o = CheckpointManagerOptions(max_to_keep=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TieredCheckpointManager(tmp_path / "local", LocalStore(tmp_path / "mirror", fs), o,
                                     mirror_max_to_keep=None, max_attempts=1) as m:
            m.save(0, _items(0))
            m.save(1, _items(1))
            with pytest.raises(MirrorError, match="retry_failed") as e:
                m.wait_until_mirrored(timeout=60)
            assert "step 0" in str(e.value)
            assert (tmp_path / "local" / "step_0").is_dir()  # "kept on the local disk": true
            fs.broken.clear()
            m.retry_failed()
            m.wait_until_mirrored(timeout=60)
            assert m.failed == {} and m.mirror_steps() == [0, 1]
    assert _steps(tmp_path / "local") == ["step_1"]


class SlowMirror(FileSystem):
    def fsync(self, fd):
        threading.Event().wait(0.005)
        super().fsync(fd)


@pytest.mark.timeout(60)
def test_a_normal_close_finishes_the_copies_then_applies_local_retention(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="minickpt")
    o = CheckpointManagerOptions(max_to_keep=2)
    m = TieredCheckpointManager(tmp_path / "local", LocalStore(tmp_path / "mirror",
                                                               SlowMirror()), o)
    for s in range(5):
        m.save(s, _items(s))
    m.close()  # copies still pending
    assert _steps(tmp_path / "local") == ["step_3", "step_4"]
    assert _steps(tmp_path / "mirror") == ["step_3", "step_4"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.timeout(60)
def test_a_best_fn_that_raises_on_read_back_metrics_is_no_metric_on_both_tiers(tmp_path,
                                                                                caplog):
    """Metrics come back from disk as JSON: ``m["loss"].item()`` works on the caller's numpy
    value and raises AttributeError on the float read back. The plain manager counts such a
    step as having no metric (issue 42 item 9); the tiers' retention must too, not stop."""
    o = CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"].item(),
                                 best_mode="min")
    with TieredCheckpointManager(tmp_path / "local", LocalStore(tmp_path / "mirror"), o,
                                 mirror_max_to_keep=2) as m:
        caplog.set_level(logging.WARNING, logger="minickpt")
        for s in range(4):
            m.save(s, _items(s), metrics={"loss": np.float32(1.0 / (s + 1))})
        m.wait_until_mirrored(timeout=60)
        assert m.failed == {}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "no metric" in caplog.text  # said, once per step
    # no metric for any step read back: all kept (keep_checkpoints_without_metrics)
    assert _steps(tmp_path / "mirror") == ["step_0", "step_1", "step_2", "step_3"]


def test_a_long_upload_can_renew_its_marker_on_a_directory_mirror(tmp_path):
    """A writer renews its in-progress marker (and its lease) during a long upload: on a
    directory the second write of the same file must replace it, not fail."""
    from minickpt.production.mirror import UPLOAD_MARKER, Writer

    store, w = LocalStore(tmp_path / "mirror"), Writer()
    try:
        tmp = store.new_upload("step_1", w)
        first = store.marker(tmp)
        store.begin(tmp, w, "upload")  # the heartbeat of an upload longer than stale/10
        assert store.marker(tmp)["time"] >= first["time"]
        assert os.listdir(tmp_path / "mirror" / tmp) == [UPLOAD_MARKER]
        store.acquire(w)
        store.renew(w)  # the lease's heartbeat, on the same kind of file
        assert store.lease()[0]["writer"] == w.id
    finally:
        w.release()


class DownFS(FileSystem):
    """A mirror disk that refuses every call while ``down`` is set, as a store whose
    endpoint refuses connections."""

    def __init__(self):
        self.down = threading.Event()

    def _gate(self):
        if self.down.is_set():
            raise ConnectionRefusedError(errno.ECONNREFUSED, "the mirror is down")


def _gated(f):
    def call(self, *a, **kw):
        self._gate()
        return f(self, *a, **kw)
    return call


for _name in ("open", "open_read", "mkdir", "rename", "unlink", "rmdir", "listdir", "lstat",
              "exists", "is_dir", "write_file", "read_file"):
    setattr(DownFS, _name, _gated(getattr(FileSystem, _name)))


@pytest.mark.timeout(60)
def test_wait_until_mirrored_waits_for_the_catch_up_after_an_outage(tmp_path, monkeypatch):
    """The mirror answers again: between the lease's thread seeing it answer and its queueing
    of the local steps the mirror lacks, wait_until_mirrored() must not take an empty queue
    for "all copied" (a clean CI run lost this race under load)."""
    fs = DownFS()
    store = LocalStore(tmp_path / "mirror", fs)
    fs.down.set()
    slow = TieredCheckpointManager._catch_up

    def catch_up_late(self):
        threading.Event().wait(0.5)  # the lease's thread, preempted right after connecting
        slow(self)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = TieredCheckpointManager(tmp_path / "local", store, CheckpointManagerOptions(),
                                    backoff_s=0.05, max_backoff_s=0.1)
    try:
        for s in range(3):
            m.save(s, _items(s))
        with pytest.raises(TimeoutError, match="has not answered"):
            m.wait_until_mirrored(timeout=0.3)
        monkeypatch.setattr(TieredCheckpointManager, "_catch_up", catch_up_late)
        fs.down.clear()
        m.wait_until_mirrored(timeout=30)
        assert m.mirror_steps() == [0, 1, 2]
    finally:
        m.close()
    assert _steps(tmp_path / "mirror") == ["step_0", "step_1", "step_2"]


@pytest.mark.timeout(60)
def test_close_during_the_catch_up_after_an_outage_copies_what_it_queues(tmp_path, monkeypatch):
    """close() called while the lease's thread is between "the mirror answers" and queueing
    the catch-up: the copies are made (or close says they were not), never dropped silently."""
    fs = DownFS()
    store = LocalStore(tmp_path / "mirror", fs)
    fs.down.set()
    slow, entered = TieredCheckpointManager._catch_up, threading.Event()

    def catch_up_late(self):
        entered.set()
        threading.Event().wait(0.5)
        slow(self)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = TieredCheckpointManager(tmp_path / "local", store,
                                    CheckpointManagerOptions(max_to_keep=2),
                                    backoff_s=0.05, max_backoff_s=0.1)
    for s in range(3):
        m.save(s, _items(s))
    monkeypatch.setattr(TieredCheckpointManager, "_catch_up", catch_up_late)
    fs.down.clear()
    assert entered.wait(30)
    m.close()
    assert _steps(tmp_path / "mirror") == ["step_1", "step_2"]
    assert _steps(tmp_path / "local") == ["step_1", "step_2"]
