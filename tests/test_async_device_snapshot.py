"""The device-side snapshot of an async save: an on-device copy in ``save()``, the transfer to
the host in the background.

On a GPU/TPU the host snapshot holds ``save()`` for the whole device-to-host transfer of the
state. The device snapshot enqueues a copy of each accelerator leaf on its own device (a new
buffer, so a later donation or ``delete()`` of the leaf cannot touch it), returns, and the
background writer brings the copies over. These tests force it on the CPU
(``AsyncCheckpointer(device_snapshot=True)``) and hold the background transfer through the
module's seam (``minickpt.device_snapshot.fetch``), so what is checked does not depend on
thread timing: nothing here measures time.
"""

import gc
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import minickpt.asynchronous as asy
import minickpt.device_snapshot as dsnap
import minickpt.tree as mtree
from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.asynchronous import AsyncCheckpointer
from minickpt.commit import is_temporary
from minickpt.errors import UnsupportedLeafError

WAIT = 30  # seconds: a bound on every wait, never a measured time


class HeldTransfer:
    """Replaces the background transfer: records each leaf asked for and holds the first one
    until ``release()``; ``fail`` makes it raise instead."""

    def __init__(self, monkeypatch, fail: BaseException | None = None):
        self.real = dsnap.fetch
        self.started = threading.Event()
        self.gate = threading.Event()
        self.fetched: list[str] = []
        self.fail = fail
        monkeypatch.setattr(dsnap, "fetch", self)

    def __call__(self, x, path):
        self.started.set()
        if not self.gate.wait(WAIT):
            raise TimeoutError("the test never released the transfer")
        if self.fail is not None:
            raise self.fail
        self.fetched.append(path)
        return self.real(x, path)

    def release(self):
        self.gate.set()


class CountedCopies:
    """Counts the on-device copies enqueued (and lets them through)."""

    def __init__(self, monkeypatch):
        self.real = dsnap.copy_on_device
        self.calls = 0
        monkeypatch.setattr(dsnap, "copy_on_device", self)

    def __call__(self, x):
        self.calls += 1
        return self.real(x)


def _sharded(x, spec):
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    return jax.device_put(x, NamedSharding(mesh, spec))


def temporaries(path):
    return [n for n in os.listdir(path) if is_temporary(n)] if os.path.isdir(path) else []


# ---- the option ----------------------------------------------------------------------------
def test_the_option_and_the_environment_variable(monkeypatch):
    monkeypatch.delenv(asy.SNAPSHOT_ENV, raising=False)
    assert AsyncCheckpointer().device_snapshot is None  # auto: accelerator leaves that fit
    for value, device, zero_copy in (("device", True, True), ("host", False, True),
                                     ("copy", False, False), ("pin", None, True)):
        monkeypatch.setenv(asy.SNAPSHOT_ENV, value)
        ck = AsyncCheckpointer()
        assert (ck.device_snapshot, ck.zero_copy) == (device, zero_copy), value
    monkeypatch.setenv(asy.SNAPSHOT_ENV, "host")
    assert AsyncCheckpointer(device_snapshot=True).device_snapshot is True  # the argument wins


def test_cpu_arrays_keep_the_host_snapshot_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(asy.SNAPSHOT_ENV, raising=False)
    copies = CountedCopies(monkeypatch)
    x = jnp.arange(1024, dtype=jnp.float32)
    with AsyncCheckpointer() as ck:
        ck.save(tmp_path / "c", {"s": {"x": x}})
        ck.wait_until_finished()
        np.testing.assert_array_equal(ck.restore(tmp_path / "c")["s"]["x"], np.asarray(x))
    assert copies.calls == 0


# ---- what is written is the state at save() --------------------------------------------
def test_save_returns_before_the_transfer_and_deletion_after_it_changes_nothing(
        tmp_path, monkeypatch):
    held = HeldTransfer(monkeypatch)
    copies = CountedCopies(monkeypatch)
    x = jnp.arange(1 << 16, dtype=jnp.float32) + 0
    j = jnp.ones((300, 300), jnp.bfloat16)
    n = np.arange(1000, dtype=np.float64)
    key = jax.random.key(5)
    with AsyncCheckpointer(device_snapshot=True) as ck:
        try:
            stats = ck.save(tmp_path / "c", {"s": {"x": x, "j": j, "n": n, "k": key,
                                                   "g": np.float32(2.5), "i": 7}})
            # save() has returned while the transfer is held: nothing has been fetched yet
            assert held.fetched == [] and ck.is_saving_in_progress()
            assert copies.calls == 2  # x and j: keys and numpy leaves: on the host, now
            x.delete()
            j.delete()
            key.delete()
            n[:] = -1.0
            assert held.started.wait(WAIT)
        finally:
            held.release()
        ck.wait_until_finished()
        assert stats.ok
        r = ck.restore(tmp_path / "c")["s"]
    assert sorted(held.fetched) == ["j", "x"]
    np.testing.assert_array_equal(r["x"], np.arange(1 << 16, dtype=np.float32))
    assert r["j"].dtype == jnp.bfloat16 and np.all(r["j"] == 1)
    np.testing.assert_array_equal(r["n"], np.arange(1000, dtype=np.float64))
    np.testing.assert_array_equal(r["k"].data, jax.random.key_data(jax.random.key(5)))
    assert r["g"] == np.float32(2.5) and type(r["g"]) is np.float32 and r["i"] == 7


def test_donation_right_after_save_changes_nothing(tmp_path, monkeypatch):
    """The step that donates the state is dispatched right after save() returns, while the
    transfer has not started: the copy is a buffer of its own, so the donation really happens
    (x is deleted, its memory reused for the output) and the checkpoint still holds x's
    values at save(). This relies on JAX ordering the donating step after the copy enqueued
    before it (a computation that reads x, dispatched first)."""
    held = HeldTransfer(monkeypatch)
    x = jnp.arange(1 << 16, dtype=jnp.float32) + 0
    ptr = x.unsafe_buffer_pointer()
    cut = _sharded(jnp.arange(256.0), PartitionSpec("d"))  # 4 shards, each copied in place
    state = {"x": x, "cut": cut}
    step_fn = jax.jit(lambda a: a * 0 - 7, donate_argnums=0)
    opts = CheckpointManagerOptions(enable_async_checkpointing=True)
    with CheckpointManager(tmp_path, opts) as m:
        try:
            m._async.device_snapshot = True
            assert m.save(1, {"s": state})
            after = {k: step_fn(v) for k, v in state.items()}  # dispatched at once, no wait
            del state
            jax.block_until_ready(after)
            assert x.is_deleted() and cut.is_deleted(), "the snapshot kept the donated buffers"
            assert after["x"].unsafe_buffer_pointer() == ptr  # XLA wrote -7 where x was
            assert held.fetched == []
        finally:
            held.release()
        m.wait_until_finished()
        r = m.restore(1)["s"]
    np.testing.assert_array_equal(r["x"], np.arange(1 << 16, dtype=np.float32))
    np.testing.assert_array_equal(r["cut"], np.arange(256.0))
    assert all(np.all(np.asarray(a) == -7) for a in after.values())


def test_the_copy_keeps_the_sharding_in_a_new_buffer():
    cut = _sharded(jnp.arange(256.0), PartitionSpec("d"))
    c = dsnap.copy_on_device(cut)
    assert c.sharding == cut.sharding
    assert not ({s.data.unsafe_buffer_pointer() for s in c.addressable_shards}
                & {s.data.unsafe_buffer_pointer() for s in cut.addressable_shards})
    cut.delete()
    np.testing.assert_array_equal(np.asarray(c), np.arange(256.0))


# ---- errors --------------------------------------------------------------------------------
def test_an_unsupported_leaf_raises_at_save_before_any_copy(tmp_path, monkeypatch):
    copies = CountedCopies(monkeypatch)
    x = jnp.arange(16.0)
    with AsyncCheckpointer(device_snapshot=True) as ck:
        with pytest.raises(UnsupportedLeafError, match=r"item 'b'.*leaf f\b"):
            ck.save(tmp_path / "c", {"a": {"x": x}, "b": {"y": x, "f": print}})
        assert not ck.is_saving_in_progress()
    assert copies.calls == 0
    assert not os.path.exists(tmp_path / "c") and temporaries(tmp_path) == []


def test_a_failed_transfer_is_the_saves_error_and_commits_nothing(tmp_path, monkeypatch):
    held = HeldTransfer(monkeypatch, fail=RuntimeError("device lost"))
    opts = CheckpointManagerOptions(enable_async_checkpointing=True)
    with CheckpointManager(tmp_path, opts) as m:
        m._async.device_snapshot = True
        assert m.save(1, {"s": {"x": jnp.arange(64.0)}})
        held.release()
        with pytest.raises(RuntimeError, match="device lost"):
            m.wait_until_finished()
        assert m.all_steps() == [] and m.latest_step() is None
        assert temporaries(tmp_path) == [] and not os.path.exists(m.step_path(1))
        held.fail = None  # the next save works
        assert m.save(2, {"s": {"x": jnp.arange(64.0)}})
        m.wait_until_finished()
        assert m.all_steps() == [2]
        np.testing.assert_array_equal(m.restore(2)["s"]["x"], np.arange(64.0))


def test_a_failed_transfer_is_raised_by_the_next_save(tmp_path, monkeypatch):
    held = HeldTransfer(monkeypatch, fail=RuntimeError("device lost"))
    held.release()
    with AsyncCheckpointer(device_snapshot=True) as ck:
        ck.save(tmp_path / "a", {"s": {"x": jnp.arange(8.0)}})
        with pytest.raises(RuntimeError, match="device lost"):
            ck.save(tmp_path / "b", {"s": {"x": jnp.arange(8.0)}})
        assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
        assert temporaries(tmp_path) == []


# ---- the memory guard (auto mode) ----------------------------------------------------------
@pytest.mark.parametrize("free, used", [(1 << 30, True), (1000, False), (None, False)])
def test_auto_copies_on_the_device_only_when_the_copies_fit(tmp_path, monkeypatch, free, used):
    """Auto mode, with CPU arrays taken for accelerator ones and a faked ``memory_stats``:
    the copies (64 KiB here) must fit in half the device's free memory; with too little
    free, or no figures at all, the save takes today's host snapshot."""
    monkeypatch.delenv(asy.SNAPSHOT_ENV, raising=False)
    monkeypatch.setattr(dsnap, "accelerator_present", lambda: True)
    monkeypatch.setattr(dsnap, "on_accelerator", lambda x: isinstance(x, jax.Array))
    stats = None if free is None else {"bytes_limit": free + 500, "bytes_in_use": 500}
    monkeypatch.setattr(dsnap, "memory_stats", lambda device: stats)
    copies = CountedCopies(monkeypatch)
    x = jnp.arange(1 << 14, dtype=jnp.float32)
    with AsyncCheckpointer() as ck:
        assert ck.device_snapshot is None
        ck.save(tmp_path / "c", {"s": {"x": x}})
        ck.wait_until_finished()
        np.testing.assert_array_equal(ck.restore(tmp_path / "c")["s"]["x"], np.asarray(x))
    assert copies.calls == (1 if used else 0)


def test_the_guard_counts_each_devices_share():
    """A leaf sharded over 4 devices needs a quarter of its bytes on each; a replicated one
    all of them on each."""
    cut = _sharded(jnp.zeros(1024, jnp.float32), PartitionSpec("d"))
    rep = _sharded(jnp.zeros(1024, jnp.float32), PartitionSpec())
    need = dsnap.bytes_per_device([cut, rep])
    assert set(need) == set(jax.devices()[:4])
    assert all(v == 1024 + 4096 for v in need.values())


def test_host_leaves_beside_device_copies_are_let_go_once_written(tmp_path, monkeypatch):
    """In the automatic mode a CPU array next to accelerator leaves keeps its pinned view;
    once the save is written nothing holds it: a donation then gets its buffer."""
    if not mtree.pinning_works():
        pytest.skip(f"jax {jax.__version__} does not pin CPU buffers")
    monkeypatch.delenv(asy.SNAPSHOT_ENV, raising=False)
    monkeypatch.setattr(dsnap, "accelerator_present", lambda: True)
    x = jnp.arange(256.0)
    monkeypatch.setattr(dsnap, "on_accelerator", lambda a: a is x)
    monkeypatch.setattr(dsnap, "memory_stats", lambda d: {"bytes_limit": 1 << 30,
                                                          "bytes_in_use": 0})
    copies = CountedCopies(monkeypatch)
    w = jnp.arange(4096, dtype=jnp.float32) + 0
    with AsyncCheckpointer() as ck:
        ck.save(tmp_path / "c", {"s": {"x": x, "w": w}})
        ck.wait_until_finished()
        jax.block_until_ready(jax.jit(lambda a: a * 0, donate_argnums=0)(w))
        assert w.is_deleted(), "the written save still pins the CPU leaf"
        r = ck.restore(tmp_path / "c")["s"]
    assert copies.calls == 1
    np.testing.assert_array_equal(r["w"], np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(r["x"], np.arange(256.0))


def test_the_save_in_flight_holds_no_reference_to_the_state(tmp_path, monkeypatch):
    """While the copies wait for their transfer, the save holds only them: a state the loop
    drops (without donating it) is freed at once, not kept as a second copy on the device."""
    held = HeldTransfer(monkeypatch)
    x = jnp.arange(1024.0) + 0
    ref = weakref.ref(x)
    with AsyncCheckpointer(device_snapshot=True) as ck:
        try:
            ck.save(tmp_path / "c", {"s": {"x": x}})
            del x
            gc.collect()
            assert ref() is None, "the save in flight keeps the state's array alive"
        finally:
            held.release()
        ck.wait_until_finished()
        np.testing.assert_array_equal(ck.restore(tmp_path / "c")["s"]["x"], np.arange(1024.0))
