"""Chapter 4: multi-host checkpoints — the protocol, the sharded format, the launcher.

Three kinds of tests:

* pure functions of lab 4 (agreement, shard ownership, coverage, region reads);
* the collective protocol with :class:`minickpt.multihost.sync.LocalGroup` — threads of this
  process playing several processes over the 4 CPU devices conftest.py creates (fast, and
  able to inject a failure at any step);
* real ``jax.distributed`` jobs of 2 and 4 processes started with ``minickpt.launch``
  (marked ``multiprocess``), running ``tests/mh_worker.py``.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from collections import namedtuple
from contextlib import nullcontext

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import minickpt as mc
from minickpt.checkpointer import encode_metadata
from minickpt.cli import main as cli
from minickpt.commit import DELETE_MARK, METADATA_FILE, TMP_MARK
from minickpt.errors import (
    CheckpointCorruptedError,
    MultiHostError,
    PeerTimeoutError,
    ProcessDisagreementError,
)
from minickpt.format.manifest import read_manifest
from minickpt.format.regions import read_region
from minickpt.format.shards import box_of, coverage_problems
from minickpt.fs import DEFAULT_FS
from minickpt.launch import launch
from minickpt.multihost.ownership import owned_shards
from minickpt.multihost.process import ENV_COORDINATOR, ENV_FAULT, initialize
from minickpt.multihost.sync import LocalGroup, SingleProcessSync, agree_on_step, default_sync

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mh_worker.py")
Dev = namedtuple("Dev", "id process_index")


def mesh(shape=(2, 2), names=("p", "l")) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def garr(shape, spec, m=None, dtype=np.float32, seed=0):
    g = (np.arange(int(np.prod(shape))) * 7 + seed).reshape(shape).astype(dtype)
    return g, jax.device_put(g, NamedSharding(m or mesh(), spec))


def opts(timeout_s=10.0, **kw):
    return mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=timeout_s), **kw)


def ok(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# ---------------------------------------------------------------------------------------
# Task 4.1 — agreeing on the step
# ---------------------------------------------------------------------------------------
@pytest.mark.task("4.1")
def test_4_1_agree_on_step_returns_the_common_step():
    assert agree_on_step([100, 100, 100, 100]) == 100
    assert agree_on_step([7]) == 7


@pytest.mark.task("4.1")
def test_4_1_disagreement_names_every_process_and_its_step():
    with pytest.raises(ProcessDisagreementError) as e:
        agree_on_step([100, 100, 99, 100, 101])
    msg = str(e.value)
    assert "processes 0-1, 3: 100" in msg and "process 2: 99" in msg and "process 4: 101" in msg
    assert e.value.values == [100, 100, 99, 100, 101]


@pytest.mark.task("4.1")
def test_4_1_collective_save_with_different_steps_fails_everywhere(tmp_path):
    _, w = garr((8, 4), P("p"))

    def work(sync):
        m = mc.CheckpointManager(tmp_path, opts(), sync=sync)
        return m.save(5 if sync.process_index != 1 else 6, {"w": w})

    res = LocalGroup(2).run(work)
    for r in res:
        assert isinstance(r, ProcessDisagreementError)
        assert "process 0: 5" in str(r) and "process 1: 6" in str(r)
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]  # nothing, not even a temporary


# ---------------------------------------------------------------------------------------
# Task 4.2 — which shards a process writes
# ---------------------------------------------------------------------------------------
SPECS = [P("p", "l"), P("p"), P(None, "l"), P(), P("l", "p"), P(("p", "l")), P(None, ("l", "p"))]


@pytest.mark.task("4.2")
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("transpose", [False, True])
def test_4_2_owned_shards_are_jax_replica_zero(spec, transpose):
    m = mesh()
    if transpose:
        m = Mesh(m.devices.T, m.axis_names)
    _, a = garr((8, 8), spec, m)
    dim = a.sharding.devices_indices_map(a.shape)
    mine = {b for b, _ in owned_shards(a.shape, dim, 0)}
    rep0 = {box_of(s.index, a.shape) for s in a.addressable_shards if s.replica_id == 0}
    assert mine == rep0


@pytest.mark.task("4.2")
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_4_2_every_element_is_written_exactly_once_across_processes(nproc, spec):
    _, a = garr((8, 8), spec)
    group = LocalGroup(nproc)
    dim = a.sharding.devices_indices_map(a.shape)
    per_process = [owned_shards(a.shape, dim, p, process_of=group.sync(p).process_of)
                   for p in range(nproc)]
    boxes = [b for shards in per_process for b, _ in shards]
    assert coverage_problems(a.shape, boxes) == []
    assert len(boxes) == len(set(boxes))  # no duplicate writes of replicated data
    if spec == P():  # fully replicated: one process writes the one copy
        assert [len(s) for s in per_process].count(1) == 1


@pytest.mark.task("4.2")
def test_4_2_owned_shards_is_pure_over_any_devices():
    # 2 processes x 2 devices; rows split in two, replicated over the 2 devices of a process
    devs = [Dev(0, 0), Dev(1, 0), Dev(2, 1), Dev(3, 1)]
    top, bottom = (slice(0, 2), slice(None)), (slice(2, 4), slice(None))
    dim = {devs[0]: top, devs[1]: top, devs[2]: bottom, devs[3]: bottom}
    assert owned_shards((4, 3), dim, 0) == [(((0, 2), (0, 3)), devs[0])]
    assert owned_shards((4, 3), dim, 1) == [(((2, 4), (0, 3)), devs[2])]
    # replicated across processes: the first device in the sharding's order owns each piece
    dim = {devs[2]: top, devs[0]: top, devs[3]: bottom, devs[1]: bottom}
    assert owned_shards((4, 3), dim, 0) == []
    assert [b for b, _ in owned_shards((4, 3), dim, 1)] == [((0, 2), (0, 3)), ((2, 4), (0, 3))]


@st.composite
def grids(draw):
    """A shape and a grid partition of it into boxes."""
    ndim = draw(st.integers(1, 3))
    shape, cuts = [], []
    for _ in range(ndim):
        n = draw(st.integers(1, 9))
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        shape.append(n)
        cuts.append([0, *inner, n])
    boxes = [tuple(pair) for pair in itertools.product(
        *[list(itertools.pairwise(c)) for c in cuts])]
    return tuple(shape), boxes


@pytest.mark.task("4.2")
@given(grids(), st.data())
def test_4_2_coverage_detects_gaps_and_overlaps(grid, data):
    shape, boxes = grid
    assert coverage_problems(shape, boxes) == []
    i = data.draw(st.integers(0, len(boxes) - 1))
    gap = coverage_problems(shape, boxes[:i] + boxes[i + 1:])
    assert len(gap) == 1 and "not covered" in gap[0]
    dup = coverage_problems(shape, [*boxes, boxes[i]])
    assert len(dup) == 1 and "more than one" in dup[0]
    assert "outside" in coverage_problems(shape, [((0, shape[0] + 1), *boxes[0][1:])])[0]


# ---------------------------------------------------------------------------------------
# Task 4.4 — reading regions
# ---------------------------------------------------------------------------------------
@st.composite
def arrays_and_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    if draw(st.booleans()) and shape:  # many short rows: exercises the chunked slab reads
        shape = (draw(st.integers(65, 140)), *shape[1:])
    box = []
    for n in shape:
        a = draw(st.integers(0, n))
        box.append((a, draw(st.integers(a, n))))
    dtype = draw(st.sampled_from([np.float32, np.int8, np.float64]))
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape), tuple(box)


@pytest.mark.task("4.4")
@given(arrays_and_boxes(), st.booleans())
def test_4_4_read_region_equals_numpy_slicing(tmp_path_factory, case, verify):
    arr, box = case
    d = tmp_path_factory.mktemp("rr")
    mc.Checkpointer().save(d / "c", {"x": {"a": arr, "pad": np.ones(3, np.int8)}})
    m = read_manifest(DEFAULT_FS, str(d / "c" / "x"))
    i = m.by_path[("a",)]
    got = read_region(DEFAULT_FS, m, i, box, verify=verify)
    np.testing.assert_array_equal(got, arr[tuple(slice(a, b) for a, b in box)])


# ---------------------------------------------------------------------------------------
# Task 4.3 — the collective save, with threads playing processes
# ---------------------------------------------------------------------------------------
def state(m=None):
    m = m or mesh()
    g_w, w = garr((8, 8), P("p", "l"), m)
    g_r, r = garr((8, 4), P("p"), m, seed=1)  # replicated over 'l'
    g_c, c = garr((4, 8), P(), m, np.int32, 2)  # fully replicated: the primary writes it
    keys = jax.device_put(jax.random.split(jax.random.key(9), 8), NamedSharding(m, P("p")))
    return ({"w": g_w, "r": g_r, "c": g_c},
            {"params": {"w": w, "r": r, "c": c}, "keys": keys, "step": 3, "host": np.arange(3.0)})


@pytest.mark.task("4.3")
def test_4_3_collective_save_commits_one_checkpoint_each_shard_once(tmp_path):
    expect, tree = state()

    def work(sync):
        with mc.CheckpointManager(tmp_path, opts(), sync=sync) as m:
            assert m.save(1, tree, metrics={"loss": 1.0})
            return m.all_steps(), m.last_save_stats

    res = ok(LocalGroup(4).run(work))
    assert all(steps == [1] for steps, _ in res)
    item = tmp_path / "step_1" / "params"
    files = sorted(os.listdir(item))
    assert files == ["data.bin", *[f"data.p{p}.bin" for p in range(4)], "manifest.json",
                     *[f"manifest.p{p}.json" for p in range(4)]]
    m = read_manifest(DEFAULT_FS, str(item))
    assert m.raw["format_version"] == 2
    sharded = {tuple(m.entries[i]["path"]): refs for i, refs in m.shards.items()}
    assert len(sharded[("w",)]) == 4 and len(sharded[("r",)]) == 2  # replicas written once
    assert not m.entries[m.by_path[("c",)]].get("sharded")  # in the primary's data.bin
    shard_bytes = sum(int(f["data_bytes"]) for f in m.raw["shard_files"])
    assert shard_bytes == expect["w"].nbytes + expect["r"].nbytes
    assert mc.Checkpointer().verify(tmp_path / "step_1").ok
    assert cli(["verify", str(tmp_path)]) == 0
    # a single process restores it whole, and onto other shardings
    plain = mc.Checkpointer().restore(tmp_path / "step_1")
    for k, v in expect.items():
        np.testing.assert_array_equal(plain["params"][k], v)
    other = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("a", "b"))
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=NamedSharding(other, P(None, "a")))
                         for k, v in expect.items()}, "step": 0, "host": np.zeros(3),
              "keys": jax.device_put(jax.random.split(jax.random.key(0), 8),
                                     NamedSharding(other, P("a")))}
    r = mc.CheckpointManager(tmp_path, opts(read_only=True)).restore(target=target)
    for k, v in expect.items():
        np.testing.assert_array_equal(np.asarray(r["params"][k]), v)
        assert r["params"][k].sharding == target["params"][k].sharding
    np.testing.assert_array_equal(jax.random.key_data(r["keys"]),
                                  jax.random.key_data(tree["keys"]))
    assert r["keys"].sharding == target["keys"].sharding
    stats = [s for _, s in res]
    assert all(s.ok and s.barrier_s >= 0 for s in stats) and stats[0].commit_s > 0


@pytest.mark.task("4.3")
def test_4_3_nobody_sees_the_step_before_every_shard_is_written(tmp_path):
    _, tree = state()
    seen = []

    def work(sync):
        def look():  # process 3, after writing its shards, before the barrier
            time.sleep(0.2)  # let the others reach the barrier
            with mc.CheckpointManager(tmp_path, opts(read_only=True)) as reader:
                seen.append((reader.all_steps(), sorted(os.listdir(tmp_path))))
        if sync.process_index == 3:
            sync.faults["after_write"] = look
        with mc.CheckpointManager(tmp_path, opts(), sync=sync) as m:
            return m.save(1, tree)

    assert ok(LocalGroup(4).run(work)) == [True] * 4
    steps, names = seen[0]
    assert steps == [] and "step_1" not in names and any(TMP_MARK in n for n in names)


@pytest.mark.task("4.3")
def test_4_3_a_failed_write_on_one_process_fails_everyone_and_commits_nothing(tmp_path):
    _, tree = state()

    def enospc():
        raise OSError(errno.ENOSPC, "No space left on device")

    def work(sync):
        with mc.CheckpointManager(tmp_path, opts(), sync=sync) as m:
            m.save(1, tree)
            if sync.process_index == 2:
                sync.faults["after_write"] = enospc
            try:
                m.save(2, tree, force=True)
            except Exception as e:
                return e, m.all_steps()
            return None, m.all_steps()

    res = LocalGroup(4).run(work)
    assert all(steps == [1] for _, steps in res)
    local = res[2][0]
    assert isinstance(local, OSError) and local.errno == errno.ENOSPC  # the original error
    for p in (0, 1, 3):
        e = res[p][0]
        assert isinstance(e, MultiHostError) and "process 2" in str(e) and "No space" in str(e)
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock", "step_1"]  # temporary removed
    assert mc.Checkpointer().verify(tmp_path / "step_1").ok


@pytest.mark.task("4.3")
def test_4_3_a_hung_process_is_named_within_the_timeout(tmp_path):
    _, tree = state()
    release = threading.Event()

    def work(sync):
        if sync.process_index == 3:  # hangs after writing, until the others have given up
            sync.faults["after_write"] = lambda: release.wait(60)
        with mc.CheckpointManager(tmp_path, opts(timeout_s=2), sync=sync) as m:
            t = time.monotonic()
            try:
                m.save(1, tree)
            except PeerTimeoutError as e:
                if sync.process_index == 0:
                    release.set()
                return e, time.monotonic() - t
            return None, None

    res = LocalGroup(4).run(work)
    for p in (0, 1, 2):
        e, _ = res[p]
        assert isinstance(e, PeerTimeoutError) and e.missing == [3]
        assert "process(es) 3 did not arrive" in str(e) and "write its shards" in str(e)
    assert isinstance(res[3][0], PeerTimeoutError)  # arriving late fails the same way
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


@pytest.mark.filterwarnings("ignore:minickpt. skipping damaged checkpoint")
def test_collective_restore_falls_back_together_past_a_damaged_step(tmp_path):
    expect, tree = state()

    def save(sync):
        with mc.CheckpointManager(tmp_path, opts(), sync=sync) as m:
            m.save(1, tree)
            m.save(2, tree)

    ok(LocalGroup(2).run(save))
    data = tmp_path / "step_2" / "params" / "data.p1.bin"
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0xFF
    data.write_bytes(bytes(raw))
    rep = mc.Checkpointer().verify(tmp_path / "step_2")
    assert not rep.ok and "data.p1.bin" in rep.problems[0] and "checksum" in rep.problems[0]
    assert cli(["verify", str(tmp_path)]) == 1

    def restore(sync):
        m = mc.CheckpointManager(tmp_path, opts(read_only=True), sync=sync)
        skipped = []
        m.listeners.append(lambda event, rec: skipped.append(rec) if event == "skip" else None)
        r = m.restore()
        return r.step, r["params"]["w"], skipped

    for step, w, skipped in ok(LocalGroup(2).run(restore)):
        assert step == 1
        np.testing.assert_array_equal(w, expect["w"])
        assert [s["step"] for s in skipped] == [2] and "data.p1.bin" in skipped[0]["error"]


def test_collective_delete_follows_the_primary(tmp_path):
    _, tree = state()

    def work(sync):
        with mc.CheckpointManager(tmp_path, opts(max_to_keep=2), sync=sync) as m:
            for s in (1, 2, 3):
                m.save(s, tree)
            after_retention = m.all_steps()
            m.delete(3)
            return after_retention, m.all_steps()

    assert ok(LocalGroup(4).run(work)) == [([2, 3], [2])] * 4
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock", "step_2"]


class _GatedRemoval(type(DEFAULT_FS)):
    """The primary's file system: removing a retired step's files waits for ``gate``."""

    def __init__(self, gate: threading.Event, fail: bool = False):
        self.gate, self.fail, self.waited = gate, fail, []

    def rmtree(self, path):
        if DELETE_MARK in os.path.basename(path):
            self.waited.append(self.gate.wait(3))
            if self.fail:
                self.fail = False  # once: the next save's retention finishes the removal
                raise OSError(errno.EIO, "injected", path)
        return super().rmtree(path)


@pytest.mark.parametrize("fail", [False, True], ids=["removed", "removal-fails"])
def test_the_others_do_not_wait_for_the_primary_to_remove_a_retired_step(tmp_path, fail):
    """Retention's decision travels in the last barrier; the primary removes the retired
    step's files after it, so the other processes are not held by the unlinks."""
    _, tree = state()
    gate = threading.Event()
    gated = _GatedRemoval(gate, fail)

    def work(sync):
        primary = sync.process_index == 0
        with mc.CheckpointManager(tmp_path, opts(max_to_keep=2),
                                  fs=gated if primary else None, sync=sync) as m:
            m.save(1, tree)
            m.save(2, tree)
            gate.clear()
            if primary:
                m.save(3, tree)  # retires step 1
            else:
                m.save(3, tree)
                gate.set()  # returned while the primary was still removing step 1
            steps = m.all_steps()
            if fail:
                left = [n for n in os.listdir(tmp_path) if DELETE_MARK in n]
                m.save(4, tree)  # its retention finishes the removal (and retires step 2)
                return steps, left, m.all_steps()
            return steps

    with pytest.warns(UserWarning, match="could not remove") if fail else nullcontext():
        res = ok(LocalGroup(2).run(work))
    assert gated.waited[0] is True  # the other process returned first
    if fail:
        assert [r[0] for r in res] == [[2, 3]] * 2 and [r[2] for r in res] == [[3, 4]] * 2
        assert len(res[0][1]) == 1  # the failed removal left a deletion temporary
    else:
        assert res == [[2, 3], [2, 3]]
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if DELETE_MARK in n], names
    assert "step_1" not in names


def test_an_unstorable_leaf_fails_on_every_process_before_anything_is_written(tmp_path):
    _, w = garr((8, 4), P("p"))
    bad = {"w": w, "objects": np.array([{"a": 1}], dtype=object)}

    def work(sync):
        return mc.CheckpointManager(tmp_path, opts(timeout_s=30), sync=sync).save(1, bad)

    t = time.monotonic()
    for r in LocalGroup(2).run(work):
        assert isinstance(r, mc.UnsupportedLeafError) and "objects" in str(r)
    assert time.monotonic() - t < 20  # nobody waited for the time-out
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


def test_primary_only_refuses_sharded_state(tmp_path):
    _, w = garr((8, 4), P("p"))
    o = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(primary_only=True))

    def work(sync):
        return mc.CheckpointManager(tmp_path, o, sync=sync).save(1, {"w": w})

    for r in LocalGroup(2).run(work):
        assert isinstance(r, mc.UnsupportedLeafError) and "primary_only" in str(r)


# ---------------------------------------------------------------------------------------
# async + multi-host: the snapshot in save(), the protocol's write phase in the background
# ---------------------------------------------------------------------------------------
def aopts(timeout_s=10.0, **kw):
    return opts(timeout_s, enable_async_checkpointing=True, **kw)


def temporaries(path):
    return sorted(n for n in os.listdir(path) if TMP_MARK in n)


@pytest.mark.task("5.1")
def test_async_collective_save_returns_after_the_snapshot_and_owns_its_copy(tmp_path):
    expect, tree = state()
    gate, saved = threading.Event(), threading.Barrier(4)
    donate = jax.jit(lambda a: a * 0 - 7, donate_argnums=0)

    def work(sync):
        sync.faults["after_create"] = lambda: gate.wait(30)  # the writers wait here
        with mc.CheckpointManager(tmp_path, aopts(), sync=sync) as m:
            assert m.save(1, tree, metrics={"loss": 1.0})
            seen = (m.is_saving_in_progress(), m.all_steps(), m.should_save(1),
                    os.path.exists(tmp_path / "step_1"))
            saved.wait(30)  # every process has taken its snapshot
            if sync.process_index == 0:  # the next training step reuses the buffers
                w = tree["params"]["w"]
                tree["params"]["w"] = donate(w)
                assert w.is_deleted()
                tree["host"][:] = -1.0
                gate.set()
            m.wait_until_finished()
            stats = m.last_save_stats
            return seen, stats, m.restore(1)

    res = ok(LocalGroup(4).run(work))
    for seen, stats, restored in res:
        assert seen == (True, [1], False, False)
        assert stats.ok and stats.async_ and 0 < stats.blocking_s < stats.total_s
        assert stats.snapshot_s > 0 and stats.barrier_s > 0
        for k, v in expect.items():
            np.testing.assert_array_equal(restored["params"][k], v)
        np.testing.assert_array_equal(restored["host"], np.arange(3.0))
    assert res[0][1].commit_s > 0 and mc.Checkpointer().verify(tmp_path / "step_1").ok
    assert temporaries(tmp_path) == []


@pytest.mark.task("5.2")
@pytest.mark.parametrize("surface", ["save", "wait_until_finished", "close", "restore"])
def test_a_background_failure_on_one_process_is_raised_on_every_process(tmp_path, surface):
    _, tree = state()

    def enospc():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def work(sync):
        m = mc.CheckpointManager(tmp_path, aopts(save_interval_steps=2), sync=sync)
        m.save(2, tree)
        m.wait_until_finished()
        if sync.process_index == 2:
            sync.faults["after_write"] = enospc
        assert m.save(4, tree)
        while m.is_saving_in_progress():  # this process's part has failed, or finished
            time.sleep(0.01)
        sync.faults.clear()
        # a save the policy skips collects nothing: no process raises at a different call
        skipped = m.save(5, tree)
        try:
            if surface == "save":
                m.save(6, tree)
            elif surface == "restore":
                m.restore()
            else:
                getattr(m, surface)()
        except Exception as e:
            raised = e
        else:
            raised = None
        leftovers = temporaries(tmp_path)  # removed before any process raises
        steps = m.all_steps(read=True)
        if surface != "close":
            assert m.save(6, tree)  # saving works again, on every process
            m.close()
        return skipped, raised, leftovers, steps

    res = ok(LocalGroup(4).run(work))
    for p, (skipped, e, leftovers, steps) in enumerate(res):
        assert skipped is False and leftovers == [] and steps == [2]
        if p == 2:
            assert isinstance(e, OSError) and e.errno == errno.ENOSPC  # the original error
        else:
            assert isinstance(e, MultiHostError) and "writing step 4 failed on process 2" in str(e)
            assert os.strerror(errno.ENOSPC) in str(e)
        assert any("background" in n and "step 4" in n for n in e.__notes__)
    assert temporaries(tmp_path) == []
    expect = ["step_2"] if surface == "close" else ["step_2", "step_6"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == expect


def test_save_decisions_count_a_failed_save_until_its_error_is_collected(tmp_path):
    """Whichever process's background thread ends first, the policy answers the same on
    every process until the error is raised, on every process, at the same call."""
    _, tree = state()

    def fail_once(sync):
        del sync.faults["after_write"]
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def work(sync):
        if sync.process_index == 1:
            sync.faults["after_write"] = lambda: fail_once(sync)
        m = mc.CheckpointManager(tmp_path, aopts(save_interval_steps=10), sync=sync)
        assert m.save(10, tree)  # the first save fails in the background
        while m.is_saving_in_progress():
            time.sleep(0.01)
        decisions = [m.save(s, tree) for s in (11, 12)]  # saved nothing yet, but step 10...
        try:
            m.save(20, tree)
        except Exception as e:
            return decisions, e, m.all_steps()
        return decisions, None, m.all_steps()

    for decisions, e, steps in ok(LocalGroup(2).run(work)):
        assert decisions == [False, False] and steps == []
        assert isinstance(e, (OSError, MultiHostError)) and os.strerror(errno.EIO) in str(e)


@pytest.mark.task("5.2")
def test_a_peer_hanging_in_the_background_is_named_at_the_next_call(tmp_path):
    _, tree = state()
    release = threading.Event()

    def work(sync):
        if sync.process_index == 3:
            sync.faults["after_write"] = lambda: release.wait(30)
        m = mc.CheckpointManager(tmp_path, aopts(timeout_s=2), sync=sync)
        t = time.monotonic()
        assert m.save(1, tree)
        returned = time.monotonic() - t
        try:
            m.wait_until_finished()
        except PeerTimeoutError as e:
            if sync.process_index == 0:
                release.set()
            return returned, e
        return returned, None

    res = LocalGroup(4).run(work)
    for p, (returned, e) in enumerate(res):
        assert isinstance(e, PeerTimeoutError), e
        if p != 3:
            assert e.missing == [3] and "write its shards" in str(e)
            assert returned < 2  # save() did not wait for the write
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


def test_collective_calls_wait_for_the_save_in_flight(tmp_path):
    _, tree = state()
    gate = threading.Event()

    def work(sync):
        with mc.CheckpointManager(tmp_path, aopts(max_to_keep=2), sync=sync) as m:
            m.save(1, tree)
            m.save(2, tree)
            m.wait_until_finished()
            sync.faults["after_create"] = lambda: gate.wait(30)
            m.save(3, tree)  # held at its start until the timer opens the gate
            if sync.process_index == 0:
                threading.Timer(0.3, gate.set).start()
            r = m.restore(2)  # another step: still waits, the save's barriers come first
            after_restore = (m.is_saving_in_progress(), os.path.exists(tmp_path / "step_3"))
            sync.faults.clear()
            m.save(4, tree)
            m.delete(3)  # waits for the save of 4, and its retention (deletes 2)
            return r.step, after_restore, m.all_steps()

    for step, after_restore, steps in ok(LocalGroup(4).run(work)):
        assert step == 2 and after_restore == (False, True) and steps == [4]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_4"]


def test_a_snapshot_failure_on_one_process_fails_the_others_without_the_timeout(tmp_path):
    _, tree = state()

    def boom():
        raise MemoryError("injected: no host memory for the snapshot")

    def work(sync):
        if sync.process_index == 1:
            sync.faults["after_agree"] = boom
        m = mc.CheckpointManager(tmp_path, aopts(timeout_s=30), sync=sync)
        try:
            m.save(1, tree)
            m.wait_until_finished()
        except BaseException as e:
            return e
        return None

    t = time.monotonic()
    res = LocalGroup(2).run(work)
    assert time.monotonic() - t < 20  # nobody waited for the time-out
    assert isinstance(res[1], MemoryError)  # raised by save() itself where it happened
    assert isinstance(res[0], MultiHostError) and "process 1: MemoryError" in str(res[0])
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


# ---------------------------------------------------------------------------------------
# the format: sharded items are verified as strictly as single-host ones
# ---------------------------------------------------------------------------------------
def _sharded_checkpoint(tmp_path):
    _, tree = state()
    ok(LocalGroup(4).run(lambda sync: mc.CheckpointManager(tmp_path, opts(), sync=sync)
                            .save(1, tree)))
    return tmp_path / "step_1"


def _rewrite(path, fn):
    """Change a JSON file of a checkpoint and re-seal the checksums that pin it down."""
    obj = json.loads(path.read_text())
    fn(obj)
    raw = json.dumps(obj).encode()
    path.write_bytes(raw)
    item = path.parent
    if path.name != "manifest.json":  # a per-process manifest: its record in manifest.json
        def fix(m):
            for f in m["shard_files"]:
                if f["manifest"] == path.name:
                    f["manifest_crc32"] = zlib.crc32(raw)
                    f["num_shards"] = len(obj["shards"])
        return _rewrite(item / "manifest.json", fix)
    meta = item.parent / METADATA_FILE
    m = json.loads(meta.read_text())
    m["items"][item.name]["manifest_crc32"] = zlib.crc32(raw)
    m.pop("metadata_crc32")
    meta.write_bytes(encode_metadata(m))  # sealed with its own checksum, as minickpt would


def test_a_missing_shard_is_damage_not_a_silent_hole(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)
    _rewrite(ckpt / "params" / "manifest.p1.json", lambda o: o["shards"].pop(0))
    rep = mc.Checkpointer().verify(ckpt)
    assert not rep.ok and "do not cover it exactly once" in rep.problems[0]
    with pytest.raises(CheckpointCorruptedError, match="not covered by any shard"):
        mc.Checkpointer().restore(ckpt)


def test_an_overlapping_shard_is_damage(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)
    theirs = json.loads((ckpt / "params" / "manifest.p1.json").read_text())["shards"]
    taken = next(e["index"] for e in theirs if e["path"] == ["w"])

    def steal(o):  # process 2 claims process 1's part of w (same size, its own bytes)
        next(e for e in o["shards"] if e["path"] == ["w"])["index"] = taken
    _rewrite(ckpt / "params" / "manifest.p2.json", steal)
    with pytest.raises(CheckpointCorruptedError, match="more than one shard"):
        mc.Checkpointer().restore(ckpt)


def test_a_shard_listed_twice_is_damage(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)

    def dup(o):
        o["shards"].append(dict(o["shards"][0]))
    _rewrite(ckpt / "params" / "manifest.p2.json", dup)
    with pytest.raises(CheckpointCorruptedError, match="shards never overlap") as e:
        mc.Checkpointer().restore(ckpt)
    assert "manifest.p2.json" in str(e.value)


def test_tampered_or_missing_shard_files_are_named(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)
    man = ckpt / "params" / "manifest.p3.json"
    man.write_text(man.read_text().replace('"offset":0', '"offset":64', 1))
    rep = mc.Checkpointer().verify(ckpt)
    assert not rep.ok and "manifest.p3.json" in rep.problems[0] and "checksum" in rep.problems[0]
    (ckpt / "params" / "manifest.p3.json").unlink()
    rep = mc.Checkpointer().verify(ckpt)
    assert "shard manifest of process 3 is missing" in rep.problems[0]
    (ckpt / "params" / "data.p2.bin").unlink()
    rep = mc.Checkpointer().verify(ckpt)
    assert any("data.p2.bin" in p and "missing" in p for p in rep.problems)


def test_shard_file_names_cannot_escape_the_item(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)
    _rewrite(ckpt / "params" / "manifest.json",
             lambda o: o["shard_files"][0].update(data_file="../../evil.bin"))
    with pytest.raises(mc.UnsafeCheckpointError, match="plain"):
        mc.Checkpointer().restore(ckpt)


def test_single_process_saves_keep_format_1(tmp_path):
    mc.Checkpointer().save(tmp_path / "c", {"x": {"a": np.arange(3)}})
    assert json.loads((tmp_path / "c" / "x" / "manifest.json").read_text())["format_version"] == 1
    assert json.loads((tmp_path / "c" / METADATA_FILE).read_text())["format_version"] == 1


def test_unknown_future_versions_are_refused(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path)
    _rewrite(ckpt / "params" / "manifest.json", lambda o: o.update(format_version=3))
    with pytest.raises(mc.FormatVersionError, match="upgrade minickpt"):
        mc.Checkpointer().restore(ckpt)


# ---------------------------------------------------------------------------------------
# the launcher (children without JAX: fast)
# ---------------------------------------------------------------------------------------
def _script(tmp_path, body):
    p = tmp_path / "child.py"
    p.write_text("import os, sys, time\n" + body)
    return str(p)


def test_launch_gives_each_process_its_environment_and_prefixes_output(tmp_path):
    s = _script(tmp_path, "e = os.environ\nprint(e['MINICKPT_PROCESS_ID'], "
                          "e['MINICKPT_NUM_PROCESSES'], e['MINICKPT_COORDINATOR'], "
                          "e['JAX_PLATFORMS'], e['XLA_FLAGS'], sys.argv[1:])\n")
    r = launch([s, "a", "b"], 3, devices_per_process=2, timeout_s=60)
    assert r.ok and r.exit_code == 0 and r.returncodes == [0, 0, 0]
    for i in range(3):
        pid, n, coord, plat, flags, args = r.output(i).split(" ", 5)
        assert (pid, n, plat) == (str(i), "3", "cpu") and coord.startswith("127.0.0.1:")
        assert flags == "--xla_force_host_platform_device_count=2" and "'a', 'b'" in args
    assert "[p2] 2 3" in r.output()


def test_a_report_survives_another_threads_log_on_the_same_pipe(tmp_path):
    """CI saw JAX's C++ log land between a ``print``'s text and its newline (stdout and
    stderr share the pipe, unbuffered): the report must still be read, whole."""
    s = _script(tmp_path, (
        "import threading\nfrom minickpt.launch import report\n"
        "stop = threading.Event()\n"
        "def log():\n"
        "    while not stop.is_set():\n"
        "        os.write(2, b'E1202 coordination_service_agent.cc:289] Polled an error\\n')\n"
        "t = threading.Thread(target=log); t.start()\n"
        "for i in range(300):\n"
        "    report({'i': i, 'pad': 'x' * 600})\n"
        "stop.set(); t.join()\n"))
    r = launch([s], 2, timeout_s=60)
    assert r.ok, r.output()
    assert [[v["i"] for v in found] for found in r.reports()] == [list(range(300))] * 2


def test_reports_are_read_when_a_log_line_follows_on_the_same_line():
    from minickpt.launch import LaunchResult

    r = LaunchResult([0, 0], [['RESULT {"a": 1}E1202 agent.cc:289] Polled an error {x}\n',
                               "noise RESULT not json\n", 'RESULT {"a": 2}\n'],
                              ["MY_RESULT {\"b\": 0}\n"]], 1.0)
    assert r.reports() == [[{"a": 1}, {"a": 2}], []]


def test_launch_fails_fast_and_reports_the_first_failure(tmp_path):
    s = _script(tmp_path, "if os.environ['MINICKPT_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                          "time.sleep(60)\n")
    r = launch([s], 3, timeout_s=60, grace_s=0.5)
    assert not r.ok and r.first_failure == 1 and r.exit_code == 3
    assert r.returncodes[1] == 3 and r.returncodes[0] < 0 and r.returncodes[2] < 0
    assert r.wall_s < 30


def test_launch_timeout_kills_everything(tmp_path):
    s = _script(tmp_path, "print('started', flush=True)\ntime.sleep(60)\n")
    r = launch([s], 2, timeout_s=1.5)
    assert r.timed_out and r.exit_code == 124 and all(rc < 0 for rc in r.returncodes)
    assert r.output(0) == "started\n"


def test_launch_command_line(tmp_path):
    s = _script(tmp_path, "sys.exit(int(os.environ['MINICKPT_PROCESS_ID']) * 5)\n")
    p = subprocess.run([sys.executable, "-m", "minickpt.launch", "-n", "2", "--grace", "5",
                        "--env", "X@1=y", s], capture_output=True, text=True, timeout=120)
    assert p.returncode == 5 and "p1=5" in p.stderr
    (tmp_path / "child_mod.py").write_text("import sys\nprint('mod', sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-m", "minickpt.launch", "-n", "2", "-m", "child_mod",
                        "x", "--y"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and "[p1] mod ['x', '--y']" in p.stdout


def test_initialize_is_a_no_op_when_not_launched(monkeypatch):
    monkeypatch.delenv(ENV_COORDINATOR, raising=False)
    assert initialize() is False
    assert isinstance(default_sync(), SingleProcessSync)


# ---------------------------------------------------------------------------------------
# real multi-process jobs
# ---------------------------------------------------------------------------------------
def _run(args, n, k, timeout_s=150, **kw):
    r = launch([WORKER, *args], n, devices_per_process=k, timeout_s=timeout_s, cwd=HERE, **kw)
    results = {p: found[-1] for p, found in enumerate(r.reports()) if found}
    return r, results


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    """A checkpoint saved by 4 processes x 2 devices (and the worker's own checks)."""
    sys.path.insert(0, HERE)
    import mh_worker

    d = tmp_path_factory.mktemp("mh")
    single, multi = d / "single", d / "multi"
    with mc.CheckpointManager(single) as m:  # saved by this one process, for 1 -> 4
        m.save(10, mh_worker.saved_state(4))
    multi.mkdir()
    r, results = _run(["save", str(multi), str(single)], 4, 2)
    return r, results, multi, mh_worker


@pytest.mark.multiprocess
@pytest.mark.task("4.3")
def test_4_processes_save_sharded_state_and_restore_it_resharded(saved_on_4):
    r, results, _, _ = saved_on_4
    assert r.ok, r.output()
    assert sorted(results) == [0, 1, 2, 3]
    for res in results.values():
        assert res["verify_ok"] and res["problems"] == []
        assert res["restored"] == [] and res["other_mesh"] == [] and res["plain_ok"]
        assert res["from_single"] == []  # saved on 1 process, restored sharded on 4
        assert "process 3: 12" in res["disagreement"] and "processes 0-2: 11" in res["disagreement"]
        assert res["steps"] == [10]


@pytest.mark.multiprocess
@pytest.mark.task("4.4")
def test_restore_on_1_process_of_a_4_process_save(saved_on_4):
    _, _, multi, w = saved_on_4
    with mc.CheckpointManager(multi, mc.CheckpointManagerOptions(read_only=True)) as m:
        assert m.verify(10).ok
        target = w.restore_target(Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "l")))
        got = m.restore(target=target)
        assert w.check_restored(got) == []
        plain = m.restore()
    for name in ("w", "rows", "cols", "xproc", "rep", "scalar"):
        np.testing.assert_array_equal(plain["params"][name], w.expected(name))
    files = sorted(os.listdir(multi / "step_10" / "params"))
    assert [f for f in files if f.startswith("data")] == [
        "data.bin", "data.p0.bin", "data.p1.bin", "data.p2.bin", "data.p3.bin"]
    assert cli(["verify", str(multi)]) == 0


@pytest.mark.multiprocess
@pytest.mark.task("4.4")
def test_restore_on_2_processes_and_replicated_state_saved_by_the_primary(saved_on_4, tmp_path):
    _, _, multi, _ = saved_on_4
    r, results = _run(["restore", str(multi), str(tmp_path)], 2, 2)
    assert r.ok, r.output()
    for res in results.values():
        assert res["restored"] == [] and res["transposed"] == [] and res["broadcast_ok"]
        assert res["threaded_ok"], res["errors"]  # the write phase ran in a thread
        assert res["files"] == ["data.bin", "manifest.json"]  # the primary wrote it all


@pytest.mark.multiprocess
@pytest.mark.task("4.3")
def test_a_process_killed_mid_save_is_named_and_nothing_is_committed(tmp_path):
    # with 3 s, on a loaded machine (two suites side by side), process 1 named the live
    # processes 0 and 3 too: they had not reached the barrier within its 3 s. 10 s tells a
    # slow process from a dead one there
    r, results = _run(["kill", str(tmp_path)], 4, 1, timeout_s=120, grace_s=30,
                      env={"MH_TIMEOUT": "10", ENV_FAULT: "after_write@2:kill"})
    assert r.returncodes[2] == -9, r.output()
    assert sorted(results) == [0, 1, 3], r.output()
    for p in (0, 1, 3):
        assert r.returncodes[p] == 3
        assert results[p]["missing"] == [2] and results[p]["steps"] == []
        assert "process(es) 2 did not arrive within 10 s" in results[p]["error"]
    # the primary survived: it removed the temporary directory itself
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


@pytest.mark.multiprocess
@pytest.mark.task("4.4")
def test_a_peer_killed_before_a_primary_only_broadcast_is_named_within_the_time_out(tmp_path):
    r, results = _run(["broadcast_kill", str(tmp_path)], 2, 1, timeout_s=120, grace_s=60,
                      env={"MH_TIMEOUT": "3", ENV_FAULT: "before_broadcast@1:kill"})
    assert r.returncodes[1] == -9, r.output()
    assert r.returncodes[0] == 3 and sorted(results) == [0], r.output()
    res = results[0]
    assert res["missing"] == [1]
    assert "broadcasting item 'params' from process 0" in res["error"]
    assert "process(es) 1 did not arrive within 3 s" in res["error"]
    # within the time-out (plus slack), far from JAX's 100 s heartbeat abort
    assert 2.5 < res["after_s"] < 20


@pytest.mark.multiprocess
@pytest.mark.task("4.3")
def test_a_primary_killed_before_commit_leaves_a_temporary_the_next_primary_removes(tmp_path):
    r, _ = _run(["kill", str(tmp_path)], 2, 2, timeout_s=120, grace_s=30,
                env={"MH_TIMEOUT": "20", ENV_FAULT: "before_commit@0:kill"})
    assert r.returncodes[0] == -9 and r.returncodes[1] != 0, r.output()
    left = [n for n in os.listdir(tmp_path) if TMP_MARK in n]
    assert len(left) == 1 and left[0].startswith("step_5")  # every shard written, no commit
    with mc.CheckpointManager(tmp_path) as m:
        assert m.all_steps() == [] and m.removed_temporaries == left
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]


@pytest.mark.multiprocess
@pytest.mark.task("5.2")
def test_async_saves_on_4_processes_then_the_job_resumes_on_2(tmp_path):
    r, results = _run(["async", str(tmp_path)], 4, 2)
    assert r.ok, r.output()
    assert sorted(results) == [0, 1, 2, 3], r.output()
    for p, res in results.items():
        assert res["saved"] and res["in_progress"] and res["counted"] == 1
        assert res["donated"] and res["snapshot"] == []  # written: the values at save()
        f = res["failure"]  # the ENOSPC of process 3, raised by the next save() everywhere
        if p == 3:
            assert f["type"] == "OSError" and f["errno"] == errno.ENOSPC
        else:
            assert f["type"] == "MultiHostError", f
            assert "writing step 2 failed on process 3: OSError" in f["error"]
        assert os.strerror(errno.ENOSPC) in f["error"]
        assert any("background" in n and "step 2" in n for n in f["notes"])
        assert res["after_failure"] == [1] and res["leftovers"] == []
        assert res["pending_at_exit"]
    # the save still in flight when the processes exited was committed; retention ran
    with mc.CheckpointManager(tmp_path, mc.CheckpointManagerOptions(read_only=True)) as m:
        assert m.all_steps() == [3, 4] and m.verify(4).ok
    assert temporaries(tmp_path) == []
    r, results = _run(["resume", str(tmp_path)], 2, 2)
    assert r.ok, r.output()
    assert sorted(results) == [0, 1], r.output()
    for res in results.values():
        assert res["latest"] == 4 and res["step"] == 4 and res["restored"] == []
        assert res["steps_in_flight"] == [3, 4, 5]
        assert res["steps"] == [4, 5] and res["step5"] == []


@pytest.mark.multiprocess
@pytest.mark.task("5.2")
def test_a_peer_lost_during_an_async_save_in_flight_at_exit_does_not_hang_the_exit(tmp_path):
    r, results = _run(["async_exit", str(tmp_path)], 2, 1, timeout_s=120, grace_s=60,
                      env={"MH_TIMEOUT": "3", ENV_FAULT: "after_write@1:kill"})
    assert r.returncodes[1] == -9, r.output()
    assert sorted(results) == [0, 1], r.output()
    # the survivor reports the lost peer and leaves (status 1) instead of waiting in
    # jax.distributed.shutdown() for a process that will never come
    assert r.returncodes[0] == 1, r.output()
    out = r.output(0)
    assert "process(es) 1 did not arrive within 3 s" in out
    assert "without jax.distributed.shutdown()" in out
    assert r.exit_times[0] < 60
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock"]  # nothing committed, no temporary


def test_gloo_collectives_of_a_localhost_job_are_made_on_the_loopback(monkeypatch):
    """A sandbox's hostname does not resolve; gloo then fails unless it is given 127.0.0.1."""
    from minickpt.multihost import process as mh_process

    _jax = mh_process._jaxlib_module()
    calls = []
    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", lambda **kw: calls.append(kw),
                        raising=False)
    mh_process._gloo_on_loopback()
    mh_process._gloo_on_loopback()  # once is enough: not wrapped twice
    _jax.make_gloo_tcp_collectives(distributed_client=None)
    assert calls == [{"distributed_client": None, "hostname": "127.0.0.1"}]
