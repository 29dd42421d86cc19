"""A large item's restore puts each leaf on its device as soon as its bytes are read and
verified (issue 40, item 5), so that the host-to-device transfers overlap the reads: the same
values as before, every checksum still checked, damage and I/O errors still named."""

import errno
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minickpt import Checkpointer
from minickpt import restore as restore_mod
from minickpt.errors import CheckpointCorruptedError
from minickpt.faults import FaultyFileSystem
from minickpt.format import read as fmt_read
from minickpt.fs import FileSystem
from minickpt.tree import HostKey

pytestmark = pytest.mark.timeout(120)

LEAVES, PER_LEAF = 6, 2 << 20  # 12 MiB of arrays: a large item (read by threads, streamed)


def _state() -> dict:
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": jnp.asarray(rng.standard_normal(PER_LEAF // 4, dtype=np.float32))
              for i in range(LEAVES)}
    return {**arrays, "host": rng.standard_normal(100).astype(np.float64),
            "step": jnp.asarray(7, jnp.int32), "count": 3, "lr": np.float32(0.5),
            "key": jax.random.key(1), "empty": jnp.zeros((0, 4), jnp.float32)}


def _target(state: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            if isinstance(v, jax.Array) and not jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
            else v for k, v in state.items()}


@pytest.fixture
def saved(tmp_path):
    state = _state()
    Checkpointer().save(tmp_path / "ck", {"state": state})
    return tmp_path / "ck", state


def _same(a, b) -> bool:
    if isinstance(b, jax.Array) and jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
        return bool(np.array_equal(jax.random.key_data(a), jax.random.key_data(b)))
    return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))


@pytest.fixture(params=["accelerator", "cpu"])
def streaming(request, monkeypatch):
    """Streaming is for puts that copy to an accelerator; CI has none, so the test says
    that the CPU device is one (the mechanism is the same), or leaves it a CPU."""
    if request.param == "accelerator":
        monkeypatch.setattr(restore_mod, "_on_accelerator", lambda sharding: True)
    return request.param


@pytest.mark.parametrize("verify", [True, False])
def test_a_large_item_restores_every_kind_of_leaf_exactly(saved, verify, streaming):
    path, state = saved
    out = Checkpointer().restore(path, {"state": _target(state)}, verify=verify)["state"]
    assert set(out) == set(state)
    for k, v in state.items():
        assert _same(out[k], v), k
        assert type(out[k]) is type(v) or (isinstance(v, jax.Array) and isinstance(
            out[k], jax.Array)), k
    for k in [f"w{i}" for i in range(LEAVES)] + ["step", "empty"]:
        assert out[k].sharding == state[k].sharding and out[k].dtype == state[k].dtype
    assert isinstance(out["lr"], np.float32) and out["count"] == 3
    # without a target: host values, as ever (nothing placed on a device)
    bare = Checkpointer().restore(path)["state"]
    assert isinstance(bare["w0"], np.ndarray) and isinstance(bare["key"], HostKey)
    assert np.array_equal(bare["w3"], np.asarray(state["w3"]))


class _Recording(FileSystem):
    """Records each read of the data file, in order with the device puts."""

    def __init__(self, events: list) -> None:
        self.events, self.lock = events, threading.Lock()

    def read_into_many(self, fd, buffers, offset):
        super().read_into_many(fd, buffers, offset)
        with self.lock:
            self.events.append(("read", offset))


def test_transfers_start_while_the_item_is_still_being_read(saved, monkeypatch):
    path, state = saved
    monkeypatch.setattr(restore_mod, "_on_accelerator", lambda sharding: True)
    events: list = []
    real_put = jax.device_put

    def put(x, *a, **k):
        if isinstance(x, np.ndarray) and x.nbytes == PER_LEAF:
            events.append(("put", x.nbytes))
        return real_put(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", put)
    monkeypatch.setattr(fmt_read, "_READ_THREADS", 1)  # one reader: a deterministic order
    monkeypatch.setattr(fmt_read, "_READ_BATCH_BYTES", PER_LEAF)  # a read per leaf
    out = Checkpointer(_Recording(events)).restore(path, {"state": _target(state)})["state"]
    kinds = [e[0] for e in events]
    reads = [i for i, e in enumerate(kinds) if e == "read"]
    puts = [i for i, e in enumerate(kinds) if e == "put"]
    assert len(puts) == LEAVES and len(reads) >= LEAVES
    assert puts[0] < reads[-1], f"every put waited for every read: {kinds}"
    assert np.array_equal(np.asarray(out["w5"]), np.asarray(state["w5"]))


def test_damage_in_a_large_item_is_still_found_and_named(saved, streaming):
    path, state = saved
    data = path / "state" / "data.bin"
    raw = bytearray(data.read_bytes())
    man = json.loads((path / "state" / "manifest.json").read_text())
    w4 = next(e for e in man["leaves"] if e["path"] == ["w4"])
    raw[w4["offset"] + 1000] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptedError, match="w4") as e:
        Checkpointer().restore(path, {"state": _target(state)})
    assert "checksum" in str(e.value) and "data.bin" in str(e.value)
    # and without verification the damaged bytes come back as they are (what verify=False is)
    out = Checkpointer().restore(path, {"state": _target(state)}, verify=False)["state"]
    assert not np.array_equal(np.asarray(out["w4"]), np.asarray(state["w4"]))


def test_a_read_error_in_a_large_item_reaches_the_caller(saved, streaming):
    path, state = saved
    fs = FaultyFileSystem(fail_at=0, ops={"preadv"},
                          error=OSError(errno.EIO, "injected read error"))
    with pytest.raises(OSError, match="injected read error"):
        Checkpointer(fs).restore(path, {"state": _target(state)})
    assert fs.tripped


ITEMS = 4  # items of 3 MiB: each small (read in one go), together worth reading in threads


def _items() -> dict:
    rng = np.random.default_rng(1)
    return {f"part{j}": {"w": jnp.asarray(rng.standard_normal((3 << 20) // 4,
                                                              dtype=np.float32)),
                         "n": j} for j in range(ITEMS)}


class _Together(FileSystem):
    """Holds the first read of each reader thread until two threads are reading at once: a
    restore that reads its items one after another never gets past it (the barrier breaks)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=20)
        self.waited: set[str] = set()

    def read_into_many(self, fd, buffers, offset):
        me = threading.current_thread().name
        if me.startswith("minickpt-item") and me not in self.waited and len(self.waited) < 2:
            self.waited.add(me)
            self.barrier.wait()
        super().read_into_many(fd, buffers, offset)


def test_several_items_are_read_at_once_and_come_back_exactly(tmp_path, streaming,
                                                               monkeypatch):
    items = _items()
    Checkpointer().save(tmp_path / "ck", items)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a 1-core CI runner reads one at a time
    fs = _Together()
    target = {k: {"w": jax.ShapeDtypeStruct(v["w"].shape, v["w"].dtype,
                                            sharding=v["w"].sharding), "n": 0}
              for k, v in items.items()}
    out = Checkpointer(fs).restore(tmp_path / "ck", target)
    assert list(out) == list(items)
    for k, v in items.items():
        assert np.array_equal(np.asarray(out[k]["w"]), np.asarray(v["w"]))
        assert isinstance(out[k]["w"], jax.Array) and out[k]["n"] == v["n"]
    assert len(fs.waited) == 2 and not fs.barrier.broken


def test_the_first_damaged_item_in_order_is_the_one_reported(tmp_path):
    items = _items()
    Checkpointer().save(tmp_path / "ck", items)
    for j in (1, 3):  # two damaged items: the error names the first, whichever thread ends first
        data = tmp_path / "ck" / f"part{j}" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        data.write_bytes(bytes(raw))
    for _ in range(3):
        with pytest.raises(CheckpointCorruptedError, match="checksum") as e:
            Checkpointer().restore(tmp_path / "ck")
        assert "part1" in str(e.value) and "part3" not in str(e.value)


def test_a_cpu_target_is_placed_in_one_batch_after_the_reads(saved, monkeypatch):
    """On a CPU a put makes no copy: there the batched put after the reads is cheaper."""
    path, state = saved
    real, seen = restore_mod._streaming_put, []

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(restore_mod, "_streaming_put", spy)
    Checkpointer().restore(path, {"state": _target(state)})
    assert seen == [None]
    assert restore_mod._on_accelerator(jax.devices("cpu")[0]) is False


@pytest.mark.parametrize("size", [512 << 10, 3 << 20])  # checked by decode_leaf; by read_leaves
def test_damage_in_a_middle_sized_item_is_found_and_named(tmp_path, size):
    rng = np.random.default_rng(2)
    tree = {"a": rng.standard_normal(size // 8).astype(np.float32),
            "b": rng.standard_normal(size // 8).astype(np.float32)}
    Checkpointer().save(tmp_path / "ck", {"m": tree})
    man = json.loads((tmp_path / "ck" / "m" / "manifest.json").read_text())
    b = next(e for e in man["leaves"] if e["path"] == ["b"])
    data = tmp_path / "ck" / "m" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[b["offset"] + 7] ^= 0x80
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptedError, match="checksum") as e:
        Checkpointer().restore(tmp_path / "ck")
    assert "(leaf b)" in str(e.value) and "data.bin" in str(e.value)
    out = Checkpointer().restore(tmp_path / "ck", verify=False)["m"]
    assert np.array_equal(out["a"], tree["a"]) and not np.array_equal(out["b"], tree["b"])
