"""Async saves: a true snapshot, one save in flight, errors that reach the training loop.

Many tests hold the background writer at the start of its write (``GatedFS``) so that what
the test does to the arrays after ``save()`` returns certainly happens *before* the writer
reads them: the outcome does not depend on thread timing.
"""

import errno
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import minickpt.asynchronous as asy
import minickpt.tree as mtree
from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.asynchronous import AsyncCheckpointer, snapshot, timeline
from minickpt.commit import TMP_MARK, is_temporary
from minickpt.faults import FaultyFileSystem
from minickpt.fs import FileSystem
from minickpt.tree import HostKey

ASYNC = dict(enable_async_checkpointing=True)


class GatedFS(FileSystem):
    """Holds a save at the creation of its temporary directory while the gate is shut."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.reached = threading.Event()

    def shut(self):
        self.gate.clear()
        self.reached.clear()

    def mkdir(self, path, mode=0o755):
        if TMP_MARK in os.path.basename(path):
            self.reached.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
        super().mkdir(path, mode)


def temporaries(path):
    return [n for n in os.listdir(path) if is_temporary(n)]


def plain(tree):
    """Typed keys (restored without a target as HostKey) as their raw data, for comparing."""
    def leaf(x):
        if isinstance(x, HostKey):
            return x.data
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return x
    return jax.tree_util.tree_map(leaf, tree)


def same(restored, expected):
    return tree_equal(plain(restored), plain(expected))


def values(step):
    """A state whose every leaf says which step it belongs to."""
    return {"w": jnp.full((64, 64), float(step)), "b": jnp.arange(8, dtype=jnp.int32) + step,
            "n": np.full(5, step, np.int64), "k": jax.random.key(step), "step": step}


# ---- the snapshot is a true snapshot: a copy, or a pinned view --------------------------
@pytest.fixture(params=["zero_copy", "copy"])
def snapshot_mode(request, monkeypatch):
    """Both ways an async save takes its snapshot of CPU arrays: pinned zero-copy views (the
    default, where the probe says JAX pins) and host copies (``MINICKPT_ASYNC_SNAPSHOT=copy``)."""
    if request.param == "copy":
        monkeypatch.setenv(asy.SNAPSHOT_ENV, "copy")
    else:
        monkeypatch.delenv(asy.SNAPSHOT_ENV, raising=False)
        if not mtree.pinning_works():
            pytest.skip(f"jax {jax.__version__} does not pin CPU buffers: every snapshot copies")
    return request.param


@pytest.mark.task("5.1")
def test_donation_after_save_never_changes_what_is_written(tmp_path, snapshot_mode):
    """Donation hands the buffer to XLA, which writes the next state into it.

    On GPU/TPU this is how a training step avoids holding two copies of the state: the output
    is aliased to the donated input's device memory, the new values overwrite the old ones in
    place, and the old ``jax.Array`` is marked deleted. Older JAX ignored donation on CPU (with
    a warning); this one implements it.

    * ``copy``: the test checks that the donation really happened (same buffer, input
      deleted) — so the checkpoint holding the save-time values proves the copy.
    * ``zero_copy``: the snapshot is a view that pins the buffer, so XLA does *not* get it:
      the step writes into a new buffer and the old values stay where the writer reads
      them. Once the save is written the pin is gone, and the array can be donated again.
    """
    fs = GatedFS()
    x = jnp.arange(1 << 16, dtype=jnp.float32)
    expected = np.arange(1 << 16, dtype=np.float32)
    step_fn = jax.jit(lambda a: a * 0.0 - 7.0, donate_argnums=0)
    with CheckpointManager(tmp_path, CheckpointManagerOptions(**ASYNC), fs=fs) as m:
        fs.shut()
        ptr = x.unsafe_buffer_pointer()
        assert m.save(1, {"s": {"x": x}})
        assert fs.reached.wait(10)
        y = step_fn(x)  # the writer is held: it has not read anything yet
        y.block_until_ready()
        if snapshot_mode == "copy":
            assert x.is_deleted(), "the donation did not happen: something still holds the buffer"
            assert y.unsafe_buffer_pointer() == ptr  # XLA wrote -7.0 where x was
        else:
            assert not x.is_deleted(), "the pinned buffer was donated: the snapshot is unsafe"
            assert y.unsafe_buffer_pointer() != ptr
        fs.gate.set()
        m.wait_until_finished()
        saved = m.restore(1)["s"]["x"]
        if snapshot_mode == "zero_copy":  # written: the view is released, x donatable again
            z = step_fn(x)
            z.block_until_ready()
            assert x.is_deleted(), "the save still pins the buffer after it was written"
    np.testing.assert_array_equal(saved, expected)
    np.testing.assert_array_equal(np.asarray(y), np.full_like(expected, -7.0))


@pytest.mark.task("5.1")
def test_mutation_and_deletion_after_save_never_change_what_is_written(tmp_path, snapshot_mode):
    fs = GatedFS()
    n = np.arange(100_000, dtype=np.float64)
    j = jnp.ones((300, 300), jnp.bfloat16)
    keys = jax.random.key(5)
    with CheckpointManager(tmp_path, CheckpointManagerOptions(**ASYNC), fs=fs) as m:
        fs.shut()
        m.save(1, {"s": {"n": n, "j": j, "k": keys}}, metrics={"loss": 1.0})
        assert fs.reached.wait(10)
        n[:] = -1.0  # in-place mutation of a numpy leaf
        j.delete()  # the device buffer is freed
        keys.delete()
        fs.gate.set()
        m.wait_until_finished()
        r = m.restore(1)["s"]
        assert m.metadata(1).metrics == {"loss": 1.0}
    np.testing.assert_array_equal(r["n"], np.arange(100_000, dtype=np.float64))
    assert r["j"].dtype == jnp.bfloat16 and np.all(r["j"] == 1)
    np.testing.assert_array_equal(r["k"].data, jax.random.key_data(jax.random.key(5)))


def _sharded(x, spec):
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    return jax.device_put(x, NamedSharding(mesh, spec))


def test_a_zero_copy_snapshot_pins_cpu_arrays_and_copies_the_rest(tmp_path):
    """Which leaves the zero-copy snapshot shares with the state, and that every one of them,
    donated or mutated after save(), is written with its values at save()."""
    if not mtree.pinning_works():
        pytest.skip(f"jax {jax.__version__} does not pin CPU buffers")
    w = jnp.arange(4096, dtype=jnp.float32)
    rep = _sharded(jnp.arange(64.0), PartitionSpec())  # replicated: one buffer is pinned
    cut = _sharded(jnp.arange(64.0), PartitionSpec("d"))  # 4 shards: assembled, a copy
    n = np.arange(10.0)
    ck = AsyncCheckpointer(GatedFS(), zero_copy=True)
    plan = ck.plan({"s": {"w": w, "rep": rep, "cut": cut, "n": n}}, copy=True, pin=True)["s"]
    buf = {e["path"][0]: b for e, b in zip(plan.entries, plan.buffers, strict=True)}
    assert buf["w"].ctypes.data == w.unsafe_buffer_pointer()
    assert buf["rep"].ctypes.data in {s.data.unsafe_buffer_pointer()
                                      for s in rep.addressable_shards}
    assert not np.shares_memory(buf["n"], n)
    assert all(buf["cut"].ctypes.data != s.data.unsafe_buffer_pointer()
               for s in cut.addressable_shards)
    del plan, buf
    fs = GatedFS()
    donate = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 - 7, t), donate_argnums=0)
    with AsyncCheckpointer(fs, zero_copy=True) as ck:
        fs.shut()
        state = {"w": w, "rep": rep, "cut": cut}
        ck.save(tmp_path / "c", {"s": {**state, "n": n}})
        assert fs.reached.wait(10)
        after = jax.block_until_ready(donate(state))
        n[:] = -1
        fs.gate.set()
        ck.wait_until_finished()
        r = ck.restore(tmp_path / "c")["s"]
    np.testing.assert_array_equal(r["w"], np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(r["rep"], np.arange(64.0))
    np.testing.assert_array_equal(r["cut"], np.arange(64.0))
    np.testing.assert_array_equal(r["n"], np.arange(10.0))
    assert all(np.all(np.asarray(a) == -7) for a in after.values())


def test_forced_copy_shares_no_memory_with_the_state(monkeypatch):
    monkeypatch.setenv(asy.SNAPSHOT_ENV, "copy")
    w = jnp.arange(4096, dtype=jnp.float32)
    ck = AsyncCheckpointer()
    assert not ck.zero_copy
    assert AsyncCheckpointer(zero_copy=True).zero_copy  # the argument wins over the variable
    plan = ck.plan({"s": {"w": w}}, copy=True, pin=ck.zero_copy)["s"]
    assert not np.shares_memory(plan.buffers[0], np.asarray(w))


def test_when_the_probe_says_jax_does_not_pin_the_snapshot_copies(tmp_path, monkeypatch,
                                                                 caplog):
    """Another JAX version may donate or free a buffer a view still points to: then the probe
    fails, once, quietly (debug log), and every snapshot is a copy again."""
    calls = []

    def probe():
        calls.append(1)
        return False

    monkeypatch.setattr(mtree, "_pinning", None)  # not probed yet in this test
    monkeypatch.setattr(mtree, "_probe_pinning", probe)
    fs = GatedFS()
    x = jnp.arange(1 << 12, dtype=jnp.float32)
    ptr = x.unsafe_buffer_pointer()
    step_fn = jax.jit(lambda a: a * 0.0 - 7.0, donate_argnums=0)
    with caplog.at_level(logging.DEBUG, logger="minickpt"), \
            AsyncCheckpointer(fs, zero_copy=True) as ck:
        plan = ck.plan({"s": {"x": x}}, copy=True, pin=True)["s"]
        assert not np.shares_memory(plan.buffers[0], np.asarray(x))
        del plan
        fs.shut()
        ck.save(tmp_path / "c", {"s": {"x": x}})
        assert fs.reached.wait(10)
        y = jax.block_until_ready(step_fn(x))
        assert x.is_deleted() and y.unsafe_buffer_pointer() == ptr  # nothing pinned it
        fs.gate.set()
        ck.wait_until_finished()
        saved = ck.restore(tmp_path / "c")["s"]["x"]
    np.testing.assert_array_equal(saved, np.arange(1 << 12, dtype=np.float32))
    assert calls == [1], "the probe must run once per process"
    assert sum("does not pin" in r.getMessage() for r in caplog.records) == 1


def test_the_probe_treats_any_error_as_no(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("no CPU backend in this build")

    monkeypatch.setattr(mtree.jax, "devices", boom)
    assert mtree._probe_pinning() is False


@pytest.mark.task("5.1")
def test_snapshot_owns_its_bytes():
    n, j = np.arange(6.0), jnp.arange(4 << 18, dtype=jnp.float32)  # j: 4 MB, copied in a thread
    with ThreadPoolExecutor(2) as pool:
        plans = snapshot({"s": {"n": n, "j": j}}, executor=pool)
    n[:] = 0
    j.delete()
    bufs = {tuple(e["path"]): b for e, b in zip(plans["s"].entries, plans["s"].buffers,
                                                 strict=True)}
    assert bufs[("n",)].view(np.float64).tolist() == list(range(6))
    np.testing.assert_array_equal(bufs[("j",)].view(np.float32),
                                  np.arange(4 << 18, dtype=np.float32))


def test_the_gate_catches_a_snapshot_that_is_only_a_view(tmp_path):
    """The harness above can fail: a snapshot without the copy saves the mutated values."""

    class ViewSnapshot(AsyncCheckpointer):
        def plan(self, items, *, copy=False, executor=None, pin=False):
            return super().plan(items, copy=False)

    fs = GatedFS()
    n = np.arange(1000, dtype=np.float64)
    with ViewSnapshot(fs) as ck:
        fs.shut()
        ck.save(tmp_path / "c", {"s": {"n": n}})
        assert fs.reached.wait(10)
        n[:] = -1.0
        fs.gate.set()
        ck.wait_until_finished()
        assert np.all(ck.restore(tmp_path / "c")["s"]["n"] == -1.0)


# ---- one save in flight ------------------------------------------------------------------
@pytest.mark.task("5.2")
def test_one_save_in_flight_the_next_waits_and_says_so(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(asy, "WAIT_WARNING_S", 0.05)
    fs = GatedFS()
    with CheckpointManager(tmp_path, CheckpointManagerOptions(**ASYNC), fs=fs) as m:
        fs.shut()
        m.save(1, {"s": values(1)})
        assert fs.reached.wait(10) and m.is_saving_in_progress()
        second = threading.Thread(target=m.save, args=(2, {"s": values(2)}))
        with caplog.at_level(logging.WARNING, logger="minickpt"):
            second.start()
            second.join(0.3)
            assert second.is_alive(), "save(2) did not wait for the save in flight"
            assert not any(n.startswith("step_2") for n in os.listdir(tmp_path))
            fs.gate.set()
            second.join(20)
        assert not second.is_alive()
        m.wait_until_finished()
        assert not m.is_saving_in_progress()
        assert m.all_steps() == [1, 2]
        h = list(m.save_history)
        assert [s.step for s in h] == [1, 2] and all(s.ok and s.async_ for s in h)
        assert h[1].wait_s >= 0.3 and h[1].blocking_s >= h[1].wait_s
        assert h[1].start_time + h[1].blocking_s >= h[0].start_time + h[0].total_s - 1e-3
        assert same(m.restore(2)["s"], values(2))
    assert any("waits for the background save of step 1" in r.getMessage()
               for r in caplog.records)


def test_saves_from_several_threads_go_one_at_a_time(tmp_path):
    fs = FaultyFileSystem(None)  # records every call
    errors = []

    def save(step):
        try:
            m.save(step, {"s": values(step)}, force=True)
        except Exception as e:
            errors.append(e)

    with CheckpointManager(tmp_path, CheckpointManagerOptions(**ASYNC), fs=fs) as m:
        threads = [threading.Thread(target=save, args=(s,)) for s in range(1, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        m.wait_until_finished()
        assert errors == [] and m.all_steps() == [1, 2, 3, 4, 5, 6]
        assert all(same(m.restore(s)["s"], values(s)) for s in range(1, 7))
    # one in flight: each save's calls end (rename, fsync of the parent) before the next begins
    starts = [(i, os.path.basename(a[0]).split(".")[0]) for i, (op, a) in enumerate(fs.calls)
              if op == "mkdir" and TMP_MARK in os.path.basename(a[0])]
    ends = [(i, os.path.basename(a[1])) for i, (op, a) in enumerate(fs.calls) if op == "rename"]
    assert [n for _, n in starts] == [n for _, n in ends]
    assert sorted(n for _, n in starts) == [f"step_{s}" for s in range(1, 7)]
    assert all(end < start for (end, _), (start, _) in zip(ends, starts[1:], strict=False))


@pytest.mark.task("5.2")
def test_an_in_flight_step_counts_like_in_orbax(tmp_path):
    fs = GatedFS()
    opts = CheckpointManagerOptions(save_interval_steps=10, max_to_keep=1, **ASYNC)
    with CheckpointManager(tmp_path, opts, fs=fs) as m:
        m.save(10, {"s": values(10)})
        m.wait_until_finished()
        fs.shut()
        assert m.save(20, {"s": values(20)})
        assert fs.reached.wait(10)
        # in flight: counted by the queries, not yet on disk, and nothing deleted for it
        assert m.is_saving_in_progress()
        assert m.latest_step() == 20 and m.all_steps() == [10, 20]
        assert m.all_steps(read=True) == [10, 20]
        assert not m.should_save(20) and not m.should_save(25) and m.should_save(30)
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_10"]
        with pytest.raises(FileExistsError, match="being saved"):
            m.save(20, {"s": values(0)}, force=True)
        # reading the step in flight waits for its commit
        threading.Timer(0.2, fs.gate.set).start()
        r = m.restore()
        assert r.step == 20 and same(r["s"], values(20))
        assert not m.is_saving_in_progress()
        assert m.all_steps() == [20] and not (tmp_path / "step_10").exists()  # retention ran


# ---- errors in the background ------------------------------------------------------------
FAULTS = {
    "write": ({"write", "writev"}, errno.ENOSPC),
    "fsync": ({"fsync"}, errno.EIO),
    "rename": ({"rename"}, errno.ENOSPC),
}


@pytest.mark.task("5.2")
@pytest.mark.parametrize("surface", ["save", "wait_until_finished", "close"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_background_failure_surfaces_with_nothing_lost(tmp_path, fault, surface):
    ops, code = FAULTS[fault]
    fs = FaultyFileSystem(None, ops=ops, error=OSError(code, os.strerror(code)))
    events = []
    opts = CheckpointManagerOptions(max_to_keep=1, **ASYNC)
    m = CheckpointManager(tmp_path, opts, fs=fs)
    m.listeners.append(lambda ev, rec: events.append((ev, rec)))
    m.save(1, {"s": values(1)})
    m.wait_until_finished()
    fs.fail_at = fs.count  # the next counted call of the save of step 2 fails
    assert m.save(2, {"s": values(2)})
    with pytest.raises(OSError) as info:
        if surface == "save":
            m.save(3, {"s": values(3)})
        elif surface == "wait_until_finished":
            m.wait_until_finished()
        else:
            m.close()
    e = info.value
    # the errno and the system's words survive, and the error says which save failed
    assert fs.tripped and e.errno == code and e.strerror.startswith(os.strerror(code))
    assert "step_2" in str(e) and "nothing was committed" in str(e)
    assert any("step 2" in note for note in getattr(e, "__notes__", []))
    assert "background" in "".join(e.__notes__)
    # nothing lost, nothing left over, nothing deleted by retention for the failed save
    assert temporaries(tmp_path) == []
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_1"]
    last = m.save_history[-1]
    assert last.step == 2 and not last.ok and os.strerror(code) in last.error and last.async_
    assert [(ev, r["step"], r["ok"]) for ev, r in events] == [("save", 1, True),
                                                              ("save", 2, False)]
    if surface != "close":
        assert m.all_steps() == [1] and m.latest_step() == 1
        m.wait_until_finished()  # raised once, not twice
        assert m.save(3, {"s": values(3)}) and m.save(4, {"s": values(4)})  # works again
        m.close()
        assert [s.ok for s in m.save_history] == [True, False, True, True]
    with CheckpointManager(tmp_path) as again:
        expect = [1] if surface == "close" else [4]
        assert again.all_steps() == expect
        assert same(again.restore()["s"], values(expect[0]))


def test_a_snapshot_error_is_raised_by_save_itself(tmp_path):
    with CheckpointManager(tmp_path, CheckpointManagerOptions(**ASYNC)) as m:
        with pytest.raises(TypeError, match="object"):
            m.save(1, {"s": {"bad": np.array([{}], dtype=object)}})
        assert m.all_steps() == [] and not m.is_saving_in_progress()
        assert not m.save_history[-1].ok
        assert m.save(1, {"s": values(1)})
    assert temporaries(tmp_path) == []


def test_standalone_async_checkpointer(tmp_path):
    fs = FaultyFileSystem(None, ops={"fsync"}, error=OSError(errno.EIO, "I/O error"))
    with pytest.raises(OSError) as info:
        with AsyncCheckpointer(fs) as ck:
            stats = ck.save(tmp_path / "a", {"s": values(1)}, step=1)
            assert stats.async_ and stats.blocking_s > 0
            r = ck.restore(tmp_path / "a")  # waits for the commit of what it reads
            assert same(r["s"], values(1)) and stats.ok and stats.total_s > 0
            fs.fail_at = fs.count
            ck.save(tmp_path / "b", {"s": values(2)})
    assert info.value.errno == errno.EIO  # raised by close(), at the end of the with block
    assert sorted(os.listdir(tmp_path)) == ["a"]


# ---- retention ---------------------------------------------------------------------------
calls_st = st.lists(st.tuples(st.integers(1, 3), st.one_of(
    st.none(), st.sampled_from([0.3, 0.1, 0.7]))), min_size=1, max_size=8)


@settings(max_examples=15, deadline=None)
@given(calls=calls_st, interval=st.integers(1, 2), n=st.one_of(st.none(), st.integers(1, 3)),
       period=st.one_of(st.none(), st.integers(2, 4)), best=st.booleans(),
       waits=st.lists(st.booleans(), min_size=8, max_size=8))
def test_async_keeps_the_same_steps_as_sync(tmp_path_factory, calls, interval, n, period, best,
                                            waits):
    steps = np.cumsum([g for g, _ in calls]).tolist()
    kw = dict(save_interval_steps=interval, max_to_keep=n, keep_period=period,
              best_fn=(lambda mt: mt["loss"]) if best else None, best_mode="min")
    out = []
    for is_async in (False, True):
        d = tmp_path_factory.mktemp("run")
        opts = CheckpointManagerOptions(enable_async_checkpointing=is_async, **kw)
        with CheckpointManager(d, opts) as m:
            decisions = []
            for i, (s, (_, loss)) in enumerate(zip(steps, calls, strict=True)):
                decisions.append(m.save(s, {"x": {"v": np.full(3, s)}},
                                        metrics=None if loss is None else {"loss": loss}))
                if waits[i]:
                    m.wait_until_finished()
            m.wait_until_finished()
            kept = m.all_steps()
            assert kept == m.all_steps(read=True)
        on_disk = sorted(int(x[5:]) for x in os.listdir(d) if x.startswith("step_"))
        assert on_disk == kept and temporaries(d) == []
        out.append((decisions, kept))
    assert out[0] == out[1]


# ---- exiting -----------------------------------------------------------------------------
EXIT_SCRIPT = textwrap.dedent("""
    import errno, os, sys, time
    import numpy as np
    from minickpt import CheckpointManager, CheckpointManagerOptions
    from minickpt.faults import FaultyFileSystem
    from minickpt.fs import FileSystem

    class Slow(FileSystem):  # the save is still writing when the main thread ends
        def mkdir(self, path, mode=0o755):
            time.sleep(0.5)
            super().mkdir(path, mode)

    opts = CheckpointManagerOptions(enable_async_checkpointing=True)
    good = CheckpointManager(sys.argv[1], opts, fs=Slow())
    bad = CheckpointManager(sys.argv[2], opts, fs=FaultyFileSystem(
        None, ops={"rename"}, error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    bad.save(1, {"s": {"x": np.zeros(3)}}); bad.wait_until_finished()
    bad._checkpointer.fs.fail_at = bad._checkpointer.fs.count
    big = {"x": np.arange(4 << 20, dtype=np.float32)}  # 16 MB: checksums run in a thread
    good.save(7, {"s": big})
    bad.save(2, {"s": big})
    print("returned", good.is_saving_in_progress(), flush=True)
    # no wait_until_finished(), no close(): the interpreter exits now
""")


@pytest.mark.task("5.2")
def test_exit_without_waiting_still_commits_and_reports_errors(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(good), str(bad)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "returned True" in out.stdout
    with CheckpointManager(good) as m:
        assert m.all_steps() == [7] and m.verify(7).ok
        np.testing.assert_array_equal(m.restore(7)["s"]["x"],
                                      np.arange(4 << 20, dtype=np.float32))
    assert temporaries(good) == [] and temporaries(bad) == []
    assert sorted(os.listdir(bad)) == [".minickpt.lock", "step_1"]
    assert "async save of step 2" in out.stderr and "No space left on device" in out.stderr


# ---- a real training loop ----------------------------------------------------------------
def test_flax_training_with_donation_and_async_saves_resumes_bit_identically(tmp_path):
    pytest.importorskip("flax")
    from minickpt import demo

    donating_step = jax.jit(demo.train_step.__wrapped__, donate_argnums=(0, 1))
    state, rng = demo.make_state(0), jax.random.key(42)
    ref_state, ref_rng, ref_losses = demo.train(state, rng, 0, 30)

    opts = CheckpointManagerOptions(save_interval_steps=5, max_to_keep=2, **ASYNC)
    st_, key = demo.make_state(0), jax.random.key(42)
    with CheckpointManager(tmp_path, opts) as m:
        for step in range(1, 18):  # "crashes" after step 17: the last save was 15
            st_, key, loss = donating_step(st_, key, *demo.batch(step))
            m.save(step, {"state": st_, "rng": key}, metrics={"loss": loss})
    history = list(m.save_history)  # complete once close() has waited for step 15
    assert [s.step for s in history] == [1, 5, 10, 15] and all(s.async_ for s in history)
    with CheckpointManager(tmp_path, opts) as m:
        r = m.restore(target={"state": demo.make_state(0), "rng": jax.random.key(0)})
        assert r.step == 15 and m.all_steps() == [10, 15]
        st_, key, losses = demo.train(r["state"], r["rng"], r.step, 30)
    assert demo.fingerprint((st_, key)) == demo.fingerprint((ref_state, ref_rng))
    assert losses == ref_losses[15:]


# ---- timings -----------------------------------------------------------------------------
@pytest.mark.task("5.3")
def test_timings_are_recorded_and_consistent(tmp_path):
    big = {"w": jnp.ones((512, 1024)), "v": np.ones(1 << 18)}  # 4 MB
    with CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2, **ASYNC)) as m:
        for step in range(1, 4):
            m.save(step, {"s": big})
        m.wait_until_finished()
        hist = list(m.save_history)
    with CheckpointManager(tmp_path / "sync") as m:
        m.save(1, {"s": big})
        sync = m.last_save_stats
    assert not sync.async_ and sync.blocking_s == sync.total_s
    assert len(hist) == 3
    for s in hist:
        assert s.ok and s.async_ and s.bytes == 4 * 512 * 1024 + 8 * (1 << 18)
        assert 0 < s.snapshot_s <= s.blocking_s < s.total_s
        assert s.wait_s <= s.blocking_s
        assert s.write_s > 0 and s.fsync_s > 0 and s.commit_s > 0
        assert s.snapshot_s + s.write_s + s.fsync_s + s.commit_s <= s.total_s + 1e-6
        assert s.as_dict()["async"] is True
    rows = timeline(hist)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["start"] == 0
    for a, b in itertools.pairwise(rows):
        assert a["start"] <= a["unblocked"] < a["end"] <= b["unblocked"] + 1e-3
    assert all(r["hidden_s"] > 0 for r in rows)


# ---- the pinning probe hears only its own thread's warnings -----------------------------
def _probe_with(monkeypatch, noise):
    """Run the one-time pinning probe again, with ``noise()`` called in the middle of it."""
    real_view = mtree.pinned_view

    def view_with_noise(x, *, probe=True):
        noise()
        return real_view(x, probe=probe)

    monkeypatch.setattr(mtree, "_pinning", None)
    monkeypatch.setattr(mtree, "pinned_view", view_with_noise)
    return mtree.pinning_works()


def test_other_threads_warnings_neither_turn_pinning_off_nor_vanish(monkeypatch):
    """A data loader warning in its own thread while the probe runs (the probe runs once, at
    the first async save, so any busy program may do this) must not turn zero-copy pinning off
    for the whole process, and its warning must still reach the program's warning handling."""
    if not mtree._probe_pinning():
        pytest.skip(f"jax {jax.__version__} does not pin CPU buffers")

    calls = []

    def loader_warns():
        calls.append(1)

        def warn():
            warnings.warn("loader: this API is deprecated", DeprecationWarning, stacklevel=1)
        t = threading.Thread(target=warn)
        t.start()
        t.join()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _probe_with(monkeypatch, loader_warns) is True, \
            "another thread's warning during the probe turned pinning off"
    assert [str(w.message) for w in seen if w.category is DeprecationWarning] == \
        ["loader: this API is deprecated"] * len(calls) and calls, \
        "the loader's warnings were swallowed by the probe"


def test_a_warning_of_the_probe_itself_still_turns_pinning_off(monkeypatch):
    """The probe's own thread warning (e.g. JAX saying a donated buffer was not usable) keeps
    its meaning: the probe cannot vouch for pinning, so snapshots copy."""
    def probe_warns():
        warnings.warn("Some donated buffers were not usable", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _probe_with(monkeypatch, probe_warns) is False
