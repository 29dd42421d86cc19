"""Tiered storage: local saves mirrored in the background, restore from either tier."""

import errno
import os
import uuid
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions
from minickpt.fs import FileSystem
from minickpt.production.monitoring import attach_monitor, load_metrics, summarize
from minickpt.production.tiered import LocalStore, MirrorError, TieredCheckpointManager


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
    assert sorted(os.listdir(mirror)) == ["step_3", "step_4"]  # no temporaries left
    assert m.mirrored == [0, 1, 2, 3, 4]
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
    assert os.listdir(mirror) == ["step_0"]  # the failed attempts left nothing behind


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
    os.makedirs(mirror / "step_1.minickpt-tmp-0badc0de")  # a copy cut short
    m = _save_run(local, mirror, steps=[2])
    assert m.mirror_steps() == [1, 2] and sorted(os.listdir(mirror)) == ["step_1", "step_2"]


def test_mirror_to_an_fsspec_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://minickpt-test-{uuid.uuid4().hex}/run1"
    fs, root = fsspec.core.url_to_fs(url)
    try:
        local = tmp_path / "local"
        m = _save_run(local, url, steps=range(3))
        assert m.mirror_steps() == [1, 2]
        names = sorted(os.path.basename(p) for p in fs.ls(root, detail=False))
        assert names == ["step_1", "step_2"]
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
