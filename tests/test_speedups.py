"""Each speed-up of the save and restore paths keeps exactly the behaviour of the plain code:
the same checksums, the same tree skeletons, the same bytes on disk, the same errors."""

import collections
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minickpt import CheckpointCorruptedError, Checkpointer, UnsupportedLeafError
from minickpt.faults import FaultyFileSystem
from minickpt.format.buffers import aligned_empty
from minickpt.format.spec import ALIGN, CRC_IMPL, crc32, dtype_name
from minickpt.restore import put_many
from minickpt.tree import flatten_with_names, skeleton

# ---------------------------------------------------------------------------------------
# checksums: whichever library computes them, they are zlib's CRC-32
# ---------------------------------------------------------------------------------------


@given(st.binary(max_size=5000), st.integers(0, 64))
def test_crc32_is_zlibs_crc32_for_any_bytes_and_view(data, cut):
    assert crc32(data) == zlib.crc32(data)
    arr = np.frombuffer(data, np.uint8)[cut:]
    assert crc32(arr) == zlib.crc32(arr.tobytes())
    assert crc32(memoryview(data)[cut:]) == zlib.crc32(data[cut:])


def test_crc32_of_a_large_buffer_matches_zlib():
    big = np.random.default_rng(0).integers(0, 256, (9 << 20) + 13, dtype=np.uint8)
    assert crc32(big) == zlib.crc32(big)
    assert CRC_IMPL in ("isal", "zlib")


# ---------------------------------------------------------------------------------------
# skeletons: the fast walk gives what JAX's own flattening gives
# ---------------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "first second")

leaves = st.one_of(
    st.integers(-5, 5), st.floats(allow_nan=False), st.booleans(), st.text(max_size=3),
    st.just(np.zeros(2, np.float32)), st.just(np.float64(1.5)), st.just(None),
)


def _trees(children):
    keys = st.one_of(st.text("abcAB_", min_size=1, max_size=3), st.integers(0, 20))
    return st.one_of(
        st.dictionaries(st.text("abcAB_", min_size=1, max_size=3), children, max_size=4),
        st.dictionaries(st.integers(0, 20), children, max_size=4),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.dictionaries(keys, children, max_size=3).map(collections.OrderedDict),
    )


@given(st.recursive(leaves, _trees, max_leaves=25))
def test_fast_skeleton_equals_the_jax_walk(tree):
    try:
        ref = skeleton(tree, fast=False)
    except (TypeError, ValueError) as e:  # JAX refuses it: so must the fast walk
        with pytest.raises(type(e)):
            skeleton(tree)
        return
    fast = skeleton(tree)
    assert fast[0] == ref[0]
    assert [n for n, _ in fast[1]] == [n for n, _ in ref[1]]
    assert all(a is b for (_, a), (_, b) in zip(fast[1], ref[1], strict=True))
    assert [n for n, _ in fast[1]] == [n for n, _ in flatten_with_names(tree)]


def test_fast_skeleton_on_a_real_train_state():
    from minickpt.demo import make_state

    state = {"state": make_state(), "rng": jax.random.key(0), "extra": {2: [1.0, None]}}
    fast, ref = skeleton(state), skeleton(state, fast=False)
    assert fast[0] == ref[0] and [n for n, _ in fast[1]] == [n for n, _ in ref[1]]


# ---------------------------------------------------------------------------------------
# dtype names are cached, checks are not weakened
# ---------------------------------------------------------------------------------------
def test_dtype_names_cached_and_still_checked():
    for _ in range(2):
        assert dtype_name(np.dtype("float32")) == "float32"
        assert dtype_name(np.dtype(">f4")) == "float32"
        assert dtype_name(jnp.bfloat16) == "bfloat16"
        with pytest.raises(UnsupportedLeafError):
            dtype_name(np.dtype(object))
        with pytest.raises(UnsupportedLeafError):
            dtype_name(np.dtype([("a", "f4")]))


# ---------------------------------------------------------------------------------------
# writing: one buffer for small items, early writeback for large ones — same bytes
# ---------------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=30), st.sampled_from([0, 1000, 4096]))
def test_write_all_writes_every_byte_in_order(sizes, every):
    import tempfile

    rng = np.random.default_rng(sum(sizes))
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    fs = FaultyFileSystem(ops={"start_writeback"})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        fd = fs.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            n = fs.write_all(fd, bufs, writeback_every=every)
        finally:
            fs.close(fd)
        with open(path, "rb") as f:
            assert f.read() == b"".join(b.tobytes() for b in bufs)
    assert n == sum(sizes)
    hints = [args for op, args in fs.calls if op == "start_writeback"]
    covered = 0
    for _fd, off, length in hints:  # consecutive ranges of what was already written
        assert off == covered and length >= every > 0
        covered += length
    assert covered <= n


def test_large_save_starts_writeback_and_keeps_the_same_bytes(tmp_path, monkeypatch):
    tree = {f"l{i}": np.random.default_rng(i).standard_normal(3 << 20, dtype=np.float32)
            for i in range(4)}  # 48 MiB: above the early-writeback size
    monkeypatch.setenv("MINICKPT_DIRECT_IO", "off")  # buffered (else O_DIRECT: no page cache)
    fs = FaultyFileSystem(ops={"start_writeback"})
    Checkpointer(fs).save(str(tmp_path / "a"), {"s": tree})
    assert fs.count >= 1  # writeback was started before the final fsync
    monkeypatch.delenv("MINICKPT_DIRECT_IO")
    Checkpointer().save(str(tmp_path / "b"), {"s": tree})  # O_DIRECT where the disk allows
    for name in ("data.bin", "manifest.json"):
        assert (tmp_path / "a" / "s" / name).read_bytes() == \
            (tmp_path / "b" / "s" / name).read_bytes()


def test_small_items_are_written_in_one_call(tmp_path):
    tree = {f"l{i:03d}": np.full(17, i, np.float32) for i in range(200)}
    fs = FaultyFileSystem(ops={"write", "writev"})
    Checkpointer(fs).save(str(tmp_path / "c"), {"s": tree})
    assert fs.count == 3  # data.bin, manifest.json, _CHECKPOINT_METADATA: one call each
    r = Checkpointer().restore(str(tmp_path / "c"))["s"]
    assert all(np.array_equal(r[k], v) for k, v in tree.items())


# ---------------------------------------------------------------------------------------
# restoring: aligned buffers, overlapped verification, batched device_put
# ---------------------------------------------------------------------------------------
def test_aligned_empty_is_aligned_and_shaped():
    for shape, dtype in [((3, 1 << 14), np.float32), ((1 << 15,), jnp.bfloat16), ((0, 4), np.int8),
                         ((), np.float64), ((5,), np.int64)]:
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
        if a.nbytes >= 16 << 10:
            assert a.ctypes.data % ALIGN == 0


def _vm_flags(addr: int) -> list[str] | None:
    """The kernel's flags of the mapping that holds ``addr`` (None off Linux)."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_a_large_restore_buffer_does_not_ask_for_huge_pages():
    """numpy advises huge pages for every allocation of 4 MiB and more; where the kernel
    then compacts memory on the first touch (THP ``defrag=madvise``, a common default, and the
    setting of this project's machines), a first restore in a fresh process stalled for
    0.1-1.6 s on 400 MB. A restore's buffers are written once and handed to XLA: plain pages,
    a predictable first touch."""
    from minickpt.format import buffers

    if buffers._MADVISE is None:
        pytest.skip("no transparent huge pages that stall a first touch here")
    a = aligned_empty((64 << 20,), np.uint8)
    a[::4096] = 1  # touched: the mapping exists
    flags = _vm_flags(a.ctypes.data + a.nbytes // 2)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "hg" not in flags, f"the buffer's mapping asks for huge pages: {flags}"
    assert a.ctypes.data % ALIGN == 0 and a.flags.writeable and a.flags.c_contiguous


def _big_tree():
    rng = np.random.default_rng(7)
    return {f"leaf{i}": rng.standard_normal(1 << 20, dtype=np.float32) for i in range(6)}


def test_large_restore_reads_verifies_and_is_exact(tmp_path):
    tree = _big_tree()  # 24 MiB: read and verified in overlapping pieces
    Checkpointer().save(str(tmp_path / "c"), {"s": tree})
    target = {"s": {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}}
    out = Checkpointer().restore(str(tmp_path / "c"), target)["s"]
    for k, v in tree.items():
        assert isinstance(out[k], jax.Array) and np.array_equal(np.asarray(out[k]), v)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_large_restore_names_the_first_damaged_leaf_in_file_order(tmp_path):
    tree = _big_tree()
    ck = Checkpointer()
    ck.save(str(tmp_path / "c"), {"s": tree})
    m = ck.manifest(str(tmp_path / "c"), "s")
    by = {e["path"][-1]: e for e in m.entries}
    data = str(tmp_path / "c" / "s" / "data.bin")
    _flip(data, by["leaf4"]["offset"] + 100)
    _flip(data, by["leaf2"]["offset"] + by["leaf2"]["nbytes"] - 1)
    with pytest.raises(CheckpointCorruptedError) as info:
        ck.restore(str(tmp_path / "c"))
    assert info.value.leaf == "leaf2" and "checksum mismatch" in str(info.value)
    assert not ck.verify(str(tmp_path / "c")).ok


def test_large_restore_of_a_truncated_file_fails_clearly(tmp_path):
    tree = _big_tree()
    Checkpointer().save(str(tmp_path / "c"), {"s": tree})
    data = tmp_path / "c" / "s" / "data.bin"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)
    with pytest.raises(CheckpointCorruptedError):
        Checkpointer().restore(str(tmp_path / "c"))


def test_put_many_places_each_array_where_asked():
    devs = jax.devices()
    mesh = jax.make_mesh((len(devs),), ("x",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    arrays = [np.arange(8, dtype=np.float32) + i for i in range(4)]
    out = put_many(arrays, [None, devs[-1], named, jax.sharding.SingleDeviceSharding(devs[0])])
    for a, o in zip(arrays, out, strict=True):
        assert np.array_equal(np.asarray(o), a)
    assert out[1].devices() == {devs[-1]}
    assert out[2].sharding == named
    assert out[3].devices() == {devs[0]}


def _alike(fast, ref):
    assert type(fast) is type(ref)
    assert fast.aval == ref.aval and fast.dtype == ref.dtype and fast.weak_type == ref.weak_type
    assert fast.sharding == ref.sharding and _committed(fast) == _committed(ref)
    assert np.array_equal(np.asarray(fast), np.asarray(ref))


def _committed(x):
    """Array.committed, public in newer JAX (``_committed`` before)."""
    return getattr(x, "committed", getattr(x, "_committed", None))


def _enable_x64():
    """jax.enable_x64(True) in newer JAX, jax.experimental.enable_x64() before it."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


@pytest.mark.parametrize("device", [0, -1])
def test_put_many_to_one_device_is_what_device_put_makes(device):
    """Many arrays bound for one device skip jax.device_put's per-array Python; what comes
    out is the same: aval, dtype, sharding, commitment, values (float64 included, which JAX
    converts when x64 is off), and a large aligned buffer is aliased exactly when
    jax.device_put aliases it."""
    import ml_dtypes

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[device])
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.asarray(7, np.int32),
              np.zeros((0, 3), np.int8), np.array([True, False]),
              np.ones(5, ml_dtypes.bfloat16), np.ones((2, 2), np.float64),
              np.asarray(1.5, np.float32)]
    big = aligned_empty((1 << 18,), np.float32)
    big[...] = 3.0
    arrays.append(big)
    out = put_many(arrays, [sharding] * len(arrays))
    for a, o in zip(arrays, out, strict=True):
        _alike(o, jax.device_put(a, sharding))
    alias = jax.device_put(big, sharding).unsafe_buffer_pointer() == big.ctypes.data
    assert (out[-1].unsafe_buffer_pointer() == big.ctypes.data) == alias


def test_put_many_to_another_memory_kind_is_what_device_put_makes():
    device = jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if "pinned_host" not in kinds:
        pytest.skip("this backend has no pinned_host memory")
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    arrays = [np.arange(4, dtype=np.float32), np.arange(3, dtype=np.int32)]
    for a, o in zip(arrays, put_many(arrays, [sharding] * 2), strict=True):
        _alike(o, jax.device_put(a, sharding))
        assert o.sharding.memory_kind == "pinned_host"


def test_put_many_follows_x64_as_it_changes():
    """A float64 array stays float64 with x64 on and becomes float32 with it off — also
    after the first placement made (and remembered) an aval for that shape."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays = [np.ones(3), np.ones(3)]
    with _enable_x64():
        for a, o in zip(arrays, put_many(arrays, [sharding] * 2), strict=True):
            _alike(o, jax.device_put(a, sharding))
            assert o.dtype == np.float64
    for a, o in zip(arrays, put_many(arrays, [sharding] * 2), strict=True):
        _alike(o, jax.device_put(a, sharding))
        assert o.dtype == np.float32


def test_put_many_falls_back_to_device_put_when_the_fast_path_is_off(monkeypatch):
    import minickpt.restore as rs

    monkeypatch.setitem(rs._FAST_PUT, "ok", False)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays = [np.arange(4, dtype=np.float32), np.arange(3, dtype=np.int32)]
    out = put_many(arrays, [sharding, sharding])
    for a, o in zip(arrays, out, strict=True):
        _alike(o, jax.device_put(a, sharding))


def test_peak_memory_of_save_and_restore_stays_near_the_state_size():
    """A save adds (almost) nothing on top of the state; a restore into jax arrays adds the
    restored state once — not a host copy *and* a device copy (measured in a fresh process
    by the benchmark's own memory probe)."""
    import json
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's resettable peak-RSS counter")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--lib", "minickpt",
                           "--bytes", str(32 * 10**6)], capture_output=True, text=True,
                          timeout=120, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY "))
    report = json.loads(line[len("MEMORY "):])
    if report["save_ratio"] is None:
        pytest.skip("peak RSS could not be reset here")
    assert report["save_ratio"] < 0.2, report
    assert report["restore_ratio"] < 1.2, report


def test_huge_page_advice_is_taken_back_only_where_the_kernel_would_stall(tmp_path):
    from minickpt.format.buffers import _madvise

    words = ["always", "defer", "defer+madvise", "madvise", "never"]
    for chosen, stalls in [("always", True), ("madvise", True), ("defer+madvise", True),
                           ("defer", False), ("never", False)]:
        f = tmp_path / chosen
        f.write_text(" ".join(f"[{w}]" if w == chosen else w for w in words) + "\n")
        if sys.platform.startswith("linux"):
            assert (_madvise(str(f)) is not None) is stalls, chosen
    assert _madvise(str(tmp_path / "absent")) is None
