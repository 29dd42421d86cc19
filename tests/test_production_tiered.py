"""Tiered storage: local saves mirrored in the background, restore from either tier."""

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions
from minickpt.errors import CheckpointNotFoundError
from minickpt.faults import SimulatedCrash
from minickpt.fs import FileSystem
from minickpt.production.mirror import LEASE_FILE, UPLOAD_MARKER, LocalStore, MirrorError
from minickpt.production.monitoring import attach_monitor, load_metrics, summarize
from minickpt.production.tiered import TieredCheckpointManager


def dead_writer(op="upload"):
    """An in-progress record naming a process of this host that has exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return {"writer": "0" * 32, "host": socket.gethostname(), "pid": p.pid, "op": op,
            "time": time.time()}


def _listed(d):
    """A mirror directory's entries but its lease (who writes there)."""
    return sorted(n for n in os.listdir(d) if n != LEASE_FILE)


def _items(v):
    return {"params": {"w": jnp.full((16, 8), float(v)), "b": jnp.arange(8.0) + v},
            "step": {"n": np.int64(v)}}


def _files(root):
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _save_run(local, mirror, steps=range(5), **kw):
    opts = CheckpointManagerOptions(max_to_keep=2)
    with TieredCheckpointManager(local, mirror, opts, backoff_s=0.01, **kw) as m:
        for s in steps:
            m.save(s, _items(s), metrics={"loss": 1.0 / (s + 1)})
        m.wait_until_mirrored(timeout=60)
        return m


def test_each_checkpoint_is_mirrored_with_retention_on_both_tiers(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    m = _save_run(local, mirror)
    assert m.local.all_steps(read=True) == [3, 4] and m.mirror_steps() == [3, 4]
    assert _listed(mirror) == ["step_3", "step_4"]  # no temporaries left
    # in order; a step the mirror's retention retired before its turn is skipped
    assert m.mirrored == sorted(m.mirrored) and {3, 4} <= set(m.mirrored)
    for s in (3, 4):
        assert Checkpointer().verify(mirror / f"step_{s}").ok
        assert _files(mirror / f"step_{s}") == _files(local / f"step_{s}")  # byte for byte


def test_restore_falls_back_to_the_mirror_when_the_local_disk_is_gone(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    _save_run(local, mirror)
    for name in os.listdir(local):  # the machine was replaced: an empty local disk
        p = local / name
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
    with TieredCheckpointManager(local, mirror, CheckpointManagerOptions(max_to_keep=2)) as m:
        assert m.local.all_steps() == [] and m.latest_step() == 4
        r = m.restore(target=_items(0))
        assert r.step == 4 and tree_equal(dict(r), _items(4))
        assert m.local.all_steps() == [4] and m.local.verify(4).ok  # fetched back, verified


def _damage(path):
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_local_checkpoint_is_fetched_from_the_mirror(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    _save_run(local, mirror)
    _damage(local / "step_4" / "params" / "data.bin")
    with TieredCheckpointManager(local, mirror, CheckpointManagerOptions(max_to_keep=2)) as m:
        with pytest.warns(UserWarning, match="local copy of step 4 is damaged"):
            r = m.restore(target=_items(0))
        assert r.step == 4 and tree_equal(dict(r), _items(4))
        assert m.local.verify(4).ok
        # damaged in both tiers: the newest valid step, with a warning
        _damage(local / "step_4" / "params" / "data.bin")
        _damage(mirror / "step_4" / "params" / "data.bin")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = m.restore(target=_items(0))
        assert r.step == 3 and tree_equal(dict(r), _items(3))
        assert any("skipping step 4, damaged locally and in the mirror" in str(w.message)
                   for w in caught)


class SlowFS(FileSystem):
    def fsync(self, fd):
        import time

        time.sleep(0.01)
        super().fsync(fd)


def test_local_retention_waits_for_a_slow_mirror(tmp_path):
    """Local keeps 1, the mirror keeps all: a slow mirror still gets every checkpoint,
    because a local checkpoint is deleted only after its copy."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with TieredCheckpointManager(local, LocalStore(mirror, fs=SlowFS()),
                                 CheckpointManagerOptions(max_to_keep=1),
                                 mirror_max_to_keep=None) as m:
        for s in range(6):
            m.save(s, _items(s))
        assert len(m.local.all_steps()) >= 1
        m.wait_until_mirrored(timeout=60)
        assert m.mirror_steps() == list(range(6)) and m.mirrored == list(range(6))
        assert m.local.all_steps(read=True) == [5]


class FlakyFS(FileSystem):
    """Every rename into the mirror fails ``failures`` times (a full or flaky remote disk)."""

    def __init__(self, failures):
        self.failures = failures

    def rename(self, src, dst):
        if self.failures and ".minickpt-tmp-" in src and ".minickpt-del-" not in dst:
            self.failures -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return super().rename(src, dst)


def test_a_failed_copy_is_reported_and_retried(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    store = LocalStore(mirror, fs=FlakyFS(failures=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TieredCheckpointManager(local, store, backoff_s=0.01) as m:
            attach_monitor(m)
            m.save(0, _items(0))
            m.wait_until_mirrored(timeout=60)
    assert m.mirror_steps() == [0] and not m.failed
    assert [str(w.message).split(": OSError")[0].rsplit(" failed ")[1] for w in caught] == [
        "(attempt 1 of 5)", "(attempt 2 of 5)"]
    mirror_events = [r for r in load_metrics(local).records if r["event"] == "mirror"]
    assert [(r["attempt"], r["ok"]) for r in mirror_events] == [(1, False), (2, False),
                                                               (3, True)]
    assert "No space left" in mirror_events[0]["error"] and mirror_events[0]["will_retry"]
    assert summarize(load_metrics(local))["mirror"] == {"count": 3, "ok": 1, "failed": 2,
                                                         "success_rate": 1 / 3}
    assert _listed(mirror) == ["step_0"]  # the failed attempts left nothing behind


def test_a_copy_that_keeps_failing_is_never_dropped_silently(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    flaky = FlakyFS(failures=10**9)
    store = LocalStore(mirror, fs=flaky)
    m = TieredCheckpointManager(local, store, max_attempts=3, backoff_s=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.save(0, _items(0))
        with pytest.raises(MirrorError, match=r"step 0: OSError: \[Errno 28\]"):
            m.wait_until_mirrored(timeout=60)
    assert sum("attempt" in str(w.message) for w in caught) == 3
    assert m.local.all_steps() == [0] and m.local.verify(0).ok  # the local copy is safe
    flaky.failures = 0  # the disk is fixed
    m.retry_failed()
    m.wait_until_mirrored(timeout=60)
    assert m.mirror_steps() == [0]
    m.close()


def test_a_restarted_job_copies_what_it_had_not_mirrored(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with CheckpointManager(local) as m:  # saved, then the process died before copying
        m.save(0, _items(0))
        m.save(1, _items(1))
    cut = mirror / "step_1.minickpt-tmp-0badc0de"  # a copy cut short: its writer is gone
    os.makedirs(cut)
    (cut / UPLOAD_MARKER).write_text(json.dumps(dead_writer()))
    os.makedirs(mirror / "step_3.minickpt-tmp-0000beef")  # no marker: not this mirror's
    m = _save_run(local, mirror, steps=[2])
    assert m.mirror_steps() == [1, 2]
    assert _listed(mirror) == ["step_1", "step_2", "step_3.minickpt-tmp-0000beef"]


def test_mirror_to_an_fsspec_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://minickpt-test-{uuid.uuid4().hex}/run1"
    fs, root = fsspec.core.url_to_fs(url)
    try:
        local = tmp_path / "local"
        m = _save_run(local, url, steps=range(3))
        assert m.mirror_steps() == [1, 2]
        names = sorted(os.path.basename(p) for p in fs.ls(root, detail=False))
        assert names == [LEASE_FILE, "step_1", "step_2"]  # the lease: who writes here
        assert fs.cat_file(f"{root}/step_2/params/data.bin") == \
            (local / "step_2" / "params" / "data.bin").read_bytes()
        import shutil

        shutil.rmtree(local)
        with TieredCheckpointManager(local, url, CheckpointManagerOptions(max_to_keep=2)) as m2:
            r = m2.restore(target=_items(0))
            assert r.step == 2 and tree_equal(dict(r), _items(2))
            assert m2.local.verify(2).ok
    finally:
        fs.rm(root.rsplit("/", 1)[0], recursive=True)


# ---------------------------------------------------------------------------------------
# an object-store mirror (no directory rename): crashes mid-upload and mid-delete
# ---------------------------------------------------------------------------------------
class CrashingFsspec:
    """An fsspec file system that loses power at the ``at``-th file written (``on="write"``)
    or removed (``on="rm"``): that call and every later one raise SimulatedCrash, so nothing
    gets cleaned up. Recursive removals go file by file, the metadata last (an object store
    deletes in no particular order), so a crash can fall between any two files."""

    def __init__(self, fs, on, at):
        self._fs, self.on, self.at, self.n, self.dead = fs, on, at, 0, False

    def _check(self, op=None):
        if self.dead:
            raise SimulatedCrash("power lost")
        if op == self.on:
            self.n += 1
            if self.n == self.at:
                self.dead = True
                raise SimulatedCrash(f"power lost at {op} #{self.n}")

    def __getattr__(self, name):
        self._check()
        return getattr(self._fs, name)

    def open(self, path, mode="rb", **kw):
        self._check("write" if "w" in mode else None)
        return self._fs.open(path, mode, **kw)

    def pipe_file(self, path, value, **kw):
        # (the lease, taken on opening, is not one of the files of an upload)
        self._check(None if path.endswith(LEASE_FILE) else "write")
        return self._fs.pipe_file(path, value, **kw)

    def rm_file(self, path):
        self._check("rm")
        self._fs.rm_file(path)

    def rm(self, path, recursive=False, **kw):
        for p in sorted(self._fs.find(path), reverse=True):
            self.rm_file(p)
        self._check()
        if self._fs.exists(path):
            self._fs.rm(path, recursive=True)


def _memory_url():
    return f"memory://minickpt-test-{uuid.uuid4().hex}/run1"


def _object_store(url, crash=None):
    from minickpt.production.mirror import FsspecStore

    store = FsspecStore(url, atomic_rename=False)
    if crash is not None:
        store.fs = CrashingFsspec(store.fs, *crash)
    return store


def _restart(tmp_path, url):
    """A new machine (empty local disk) on the same mirror."""
    import shutil

    shutil.rmtree(tmp_path / "local", ignore_errors=True)
    return TieredCheckpointManager(tmp_path / "local", _object_store(url),
                                   CheckpointManagerOptions(max_to_keep=None))


def _mirror_files(url, step):
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    p = f"{root}/step_{step}"
    return sorted(os.path.relpath(f, p) for f in fs.find(p)) if fs.exists(p) else None


def test_memory_urls_take_the_object_store_path():
    pytest.importorskip("fsspec")
    from minickpt.production.mirror import FsspecStore

    url = _memory_url()
    assert not FsspecStore(url).atomic_rename  # fsspec's memory mv is a copy, then a delete
    assert FsspecStore(url, atomic_rename=True).atomic_rename


def test_an_upload_cut_short_is_never_restored(tmp_path):
    pytest.importorskip("fsspec")
    opts = CheckpointManagerOptions(max_to_keep=None)
    url = _memory_url()
    with TieredCheckpointManager(tmp_path / "local", _object_store(url), opts) as m:
        m.save(0, _items(0))
        m.wait_until_mirrored(timeout=60)
    files = _mirror_files(url, 0)
    assert {"_CHECKPOINT_METADATA", "commit_success.txt"} <= set(files)
    # the power goes at each object of step 1's upload: the in-progress marker first, the
    # files, the metadata, and last the commit marker (the metadata is there, the step not)
    for at in range(1, len(files) + 2):
        store = _object_store(url, crash=("write", at))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = TieredCheckpointManager(tmp_path / "local", store, opts, max_attempts=1)
            m.save(1, _items(1))
            m.wait_until_mirrored(timeout=60)
            with contextlib.suppress(SimulatedCrash):  # giving the lease back: no power
                m.close()
        left = _mirror_files(url, 1)
        # a half-written copy (nothing at all when the first upload failed: no directories)
        assert (left is not None) == (at > 1) and "commit_success.txt" not in (left or [])
        assert ("_CHECKPOINT_METADATA" in (left or [])) == (at == len(files) + 1), (at, left)
        assert at == 1 or UPLOAD_MARKER in left  # whose upload it was, written first
        with _restart(tmp_path, url) as m2:
            assert m2.mirror_steps() == [0], at  # never listed, and cleaned up
            r = m2.restore()
            assert r.step == 0 and tree_equal(dict(r), _items(0))
        assert _mirror_files(url, 1) is None
    with _restart(tmp_path, url) as m2:  # no crash: the copy is complete, and taken
        m2.save(1, _items(1))
        m2.wait_until_mirrored(timeout=60)
    with _restart(tmp_path, url) as m2:
        assert m2.restore().step == 1


def test_a_delete_cut_short_is_never_restored(tmp_path):
    pytest.importorskip("fsspec")
    url = _memory_url()
    opts = CheckpointManagerOptions(max_to_keep=None)
    with TieredCheckpointManager(tmp_path / "local", _object_store(url), opts) as m:
        m.save(0, _items(0))
    full = _mirror_files(url, 0)
    for at in range(1, len(full) + 1):  # the power goes at each file of step 0's deletion
        store = _object_store(url, crash=("rm", at))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = TieredCheckpointManager(tmp_path / "local", store, opts)
            with pytest.raises(SimulatedCrash):
                store.delete("step_0", m.writer)
            with contextlib.suppress(SimulatedCrash):  # giving the lease back: no power
                m.close()  # the mirror thread is idle; the 'machine' is gone
        left = _mirror_files(url, 0)
        assert UPLOAD_MARKER in left  # whose delete it was, written first
        left.remove(UPLOAD_MARKER)
        if at == 1:  # the power went as the commit marker was removed: nothing is gone
            assert left == full
            with _restart(tmp_path, url) as m2:
                r = m2.restore(0)
                assert tree_equal(dict(r), _items(0))
                m2.store.delete("step_0", m2.writer)
            assert _mirror_files(url, 0) is None
        else:  # half deleted: no longer a checkpoint
            assert left and "commit_success.txt" not in left, left
            with _restart(tmp_path, url) as m2:
                assert 0 not in m2.mirror_steps()
                with pytest.raises(CheckpointNotFoundError):
                    m2.restore(0)
            assert _mirror_files(url, 0) is None  # cleaned up at the restart
        with _restart(tmp_path, url) as m2:  # step 0 again, for the next crash point
            m2.save(0, _items(0))
            m2.wait_until_mirrored(timeout=60)


def test_verify_re_reads_the_mirror_and_catches_a_flipped_byte(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    url = _memory_url()
    store = _object_store(url)
    with TieredCheckpointManager(tmp_path / "local", store,
                                 CheckpointManagerOptions(max_to_keep=None)) as m:
        m.save(0, _items(0))
        m.wait_until_mirrored(timeout=60)
    assert store.verify("step_0") == []
    fs, root = fsspec.core.url_to_fs(url)
    path = f"{root}/step_0/params/data.bin"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01  # same size: only a checksum sees it
    fs.pipe_file(path, bytes(data))
    problems = store.verify("step_0")
    assert problems and any("data.bin" in p or "checksum" in p.lower() for p in problems)


class FlipOnce:
    """An fsspec file system whose first upload of a data file flips one byte in transit."""

    def __init__(self, fs):
        self._fs, self.flipped = fs, 0

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open(self, path, mode="rb", **kw):
        f = self._fs.open(path, mode, **kw)
        if "w" not in mode or not path.endswith("data.bin") or self.flipped:
            return f
        self.flipped += 1
        write = f.write

        def flip(b):
            b = bytearray(b)
            b[0] ^= 0xFF
            return write(bytes(b))
        f.write = flip
        return f


def test_a_copy_corrupted_in_transit_fails_verify_before_it_is_published(tmp_path):
    pytest.importorskip("fsspec")
    url = _memory_url()
    store = _object_store(url)
    store.fs = FlipOnce(store.fs)
    events = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TieredCheckpointManager(tmp_path / "local", store,
                                     CheckpointManagerOptions(max_to_keep=None),
                                     backoff_s=0.01) as m:
            m.listeners.append(lambda ev, rec: events.append(rec) if ev == "mirror" else None)
            m.save(0, _items(0))
            m.wait_until_mirrored(timeout=60)
            assert m.mirror_steps() == [0]
    fails = [e for e in events if not e["ok"]]
    assert store.fs.flipped == 1 and len(fails) == 1 and fails[0]["will_retry"]
    assert "does not verify" in fails[0]["error"]
    assert events[-1]["ok"] and events[-1]["attempt"] == 2
    with _restart(tmp_path, url) as m2:
        r = m2.restore()
        assert r.step == 0 and tree_equal(dict(r), _items(0))
