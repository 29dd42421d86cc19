"""Items on disk: exact round trips of every dtype and leaf kind, and refusal of bad input."""

import json
import os
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import tree_equal
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minickpt import Checkpointer
from minickpt.errors import (
    CheckpointCorruptedError,
    FormatVersionError,
    StructureMismatchError,
    UnsafeCheckpointError,
    UnsupportedLeafError,
)
from minickpt.format.encode import plan_item, plan_leaf, write_item
from minickpt.format.manifest import read_manifest
from minickpt.format.read import decode_leaf, read_leaves
from minickpt.format.spec import DTYPES, json_text
from minickpt.fs import FileSystem
from minickpt.tree import HostKey, from_skeleton

FS = FileSystem()

NUMPY_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                np.complex128]
ML_DTYPES = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
             ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.int4,
             ml_dtypes.uint4]


def roundtrip(tmp_path, tree, target=None):
    path = tmp_path / f"ck{len(os.listdir(tmp_path))}"
    Checkpointer().save(path, {"item": tree})
    return Checkpointer().restore(path, None if target is None else {"item": target})["item"]


def write_read(tmp_path, tree):
    d = tmp_path / f"item{len(os.listdir(tmp_path))}"
    d.mkdir()
    write_item(FS, str(d), plan_item(tree))
    m = read_manifest(FS, str(d))
    return from_skeleton(m.skeleton, read_leaves(FS, m)), d


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + ML_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (4, 5)])
def test_every_dtype_and_shape_roundtrips_exactly(tmp_path, dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                       dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and subnormals included
    back = roundtrip(tmp_path, {"x": arr})["x"]
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8,
                                   jnp.uint32, jnp.bool_, jnp.complex64,
                                   jnp.float8_e4m3fn])
def test_jax_arrays_restore_into_jax_targets_with_dtype(tmp_path, dtype):
    x = jnp.ones((3, 2), dtype)
    back = roundtrip(tmp_path, {"x": x}, target={"x": x})["x"]
    assert isinstance(back, jax.Array) and back.dtype == x.dtype
    assert np.asarray(back).tobytes() == np.asarray(x).tobytes()


def test_typed_and_legacy_keys(tmp_path):
    tree = {"k": jax.random.key(7), "ks": jax.random.split(jax.random.key(1), 3),
            "rbg": jax.random.key(2, impl="rbg"), "legacy": jax.random.PRNGKey(9)}
    back = roundtrip(tmp_path, tree, target=tree)
    assert tree_equal(back, tree)
    assert str(jax.random.key_impl(back["rbg"])) == str(jax.random.key_impl(tree["rbg"]))
    # the restored key generates the same numbers
    assert float(jax.random.uniform(back["k"])) == float(jax.random.uniform(tree["k"]))
    assert back["legacy"].dtype == jnp.uint32


def test_typed_keys_without_a_target_are_public_host_keys_that_become_keys_again(tmp_path):
    import minickpt as mc

    tree = {"k": jax.random.key(7), "ks": jax.random.split(jax.random.key(1), 3),
            "rbg": jax.random.key(2, impl="rbg"), "w": jnp.ones(2)}
    back = roundtrip(tmp_path, tree)
    assert isinstance(back["w"], np.ndarray)
    for name in ("k", "ks", "rbg"):
        got = back[name]
        assert isinstance(got, mc.HostKey), f"{name}: {type(got).__name__}, not mc.HostKey"
        assert isinstance(got.data, np.ndarray) and got.shape == tree[name].shape
        key = got.to_jax()
        assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(key)) == str(jax.random.key_impl(tree[name]))
        np.testing.assert_array_equal(jax.random.key_data(key),
                                      jax.random.key_data(tree[name]))
    assert float(jax.random.uniform(back["k"].to_jax(jax.devices()[0]))) == \
        float(jax.random.uniform(tree["k"]))


def test_python_leaves_roundtrip_exactly(tmp_path):
    tree = {"i": 2**70, "neg": -3, "f": 0.1, "nan": float("nan"), "inf": float("-inf"),
            "b": True, "c": complex(1.5, -2.0), "s": "héllo", "none": None,
            "np_scalar": np.float32(1.25), "nested": [1, (2.5, None), {"x": "y"}]}
    back, _ = write_read(tmp_path, tree)
    assert back["i"] == 2**70 and back["f"] == 0.1 and back["nan"] != back["nan"]
    assert back["b"] is True and back["c"] == complex(1.5, -2.0) and back["s"] == "héllo"
    assert back["none"] is None and back["np_scalar"] == np.float32(1.25)
    assert isinstance(back["np_scalar"], np.float32)
    assert back["nested"] == [1, (2.5, None), {"x": "y"}]


def test_flax_train_state_keeps_its_code(tmp_path):
    from minickpt.demo import make_state

    state = make_state(0)
    back = roundtrip(tmp_path, state, target=state)
    assert type(back) is type(state)
    assert back.tx is state.tx and back.apply_fn == state.apply_fn  # code is not data
    assert tree_equal(back.params, state.params) and tree_equal(back.opt_state, state.opt_state)


def test_restore_without_target_gives_nested_dicts_of_numpy(tmp_path):
    from minickpt.demo import make_state

    back = roundtrip(tmp_path, make_state(0))
    assert set(back) == {"step", "params", "opt_state"}
    kernel = back["params"]["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, np.ndarray) and kernel.dtype == np.float32
    assert isinstance(back["opt_state"], tuple)  # tuples stay tuples
    assert isinstance(back["opt_state"][0], dict)  # named tuples become dicts of fields


def test_big_endian_leaves_restore_into_their_own_tree_as_native(tmp_path):
    tree = {"i": np.arange(5, dtype=">i4"), "f": np.linspace(0, 1, 3).astype(">f8"),
            "c": np.array([1 + 2j], dtype=">c8"), "s": np.array(7, dtype=">i2")[()],
            "u8": np.arange(3, dtype=">u1")}
    for back in (roundtrip(tmp_path, tree), roundtrip(tmp_path, tree, target=tree)):
        for k, v in tree.items():
            got = back[k]
            assert got.dtype == v.dtype.newbyteorder("=") and got.dtype.isnative, \
                f"{k}: restored as {got.dtype}; Orbax gives the native dtype {v.dtype.name}"
            np.testing.assert_array_equal(got, v)
    assert isinstance(roundtrip(tmp_path, tree, target=tree)["s"], np.generic)
    with pytest.raises(StructureMismatchError, match="saved int32, target int64"):
        roundtrip(tmp_path, tree, target={**tree, "i": np.arange(5, dtype=">i8")})


def test_object_arrays_and_functions_are_refused(tmp_path):
    with pytest.raises(UnsupportedLeafError, match="object"):
        Checkpointer().save(tmp_path / "a", {"x": {"o": np.array([object()], dtype=object)}})
    with pytest.raises(UnsupportedLeafError, match="item 'x'.*leaf f"):
        Checkpointer().save(tmp_path / "b", {"x": {"f": lambda: 0}})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert os.listdir(tmp_path) == []  # no temporary left behind either


# ---- property-based round trips ----------------------------------------------------------
dtypes = st.sampled_from([np.dtype(d) for d in NUMPY_DTYPES + ML_DTYPES])
arrays = dtypes.flatmap(lambda dt: hnp.arrays(
    np.uint8, st.integers(0, 64).map(lambda n: n * dt.itemsize)).map(lambda raw: raw.view(dt)))
shaped = st.tuples(arrays, st.integers(0, 2)).map(
    lambda t: t[0].reshape((1,) * t[1] + t[0].shape))
scalars = st.one_of(st.integers(-2**80, 2**80), st.floats(allow_nan=True), st.booleans(),
                    st.text(max_size=20), st.none(), st.complex_numbers(allow_nan=False))
leaves = st.one_of(shaped, scalars)
keys = st.text(alphabet="abcdefghij_0123456789", min_size=1, max_size=8)
trees = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(keys, kids, max_size=4)), max_leaves=20)


@given(tree=trees)
def test_property_any_tree_roundtrips_bit_exactly(tmp_path_factory, tree):
    tmp = tmp_path_factory.mktemp("prop")
    back, _ = write_read(tmp, tree)
    assert tree_equal(back, tree)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)


@given(tree=trees)
def test_property_restore_into_its_own_structure(tmp_path_factory, tree):
    if not jax.tree_util.tree_leaves(tree):
        return
    tmp = tmp_path_factory.mktemp("prop")
    assert tree_equal(roundtrip(tmp, tree, target=tree), tree)


# ---- damage and hostile manifests -------------------------------------------------------
def _item(tmp_path):
    tree = {"a": np.arange(10, dtype=np.float32), "b": {"c": np.ones((3, 3))}}
    _, d = write_read(tmp_path, tree)
    return d, json.loads((d / "manifest.json").read_text())


def _rewrite(d, obj):
    (d / "manifest.json").write_text(json.dumps(obj))


def test_bit_flip_is_detected_and_names_the_leaf(tmp_path):
    d, man = _item(tmp_path)
    off = next(e for e in man["leaves"] if e["path"] == ["b", "c"])["offset"]
    data = bytearray((d / "data.bin").read_bytes())
    data[off + 5] ^= 0x10
    (d / "data.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match=r"b/c.*checksum|checksum.*b/c") as e:
        read_leaves(FS, read_manifest(FS, str(d)))
    assert "data.bin" in str(e.value)


def test_truncated_data_is_detected(tmp_path):
    d, _ = _item(tmp_path)
    data = (d / "data.bin").read_bytes()
    (d / "data.bin").write_bytes(data[:-8])
    with pytest.raises(CheckpointCorruptedError, match="truncated"):
        read_manifest(FS, str(d))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda m: m["leaves"][0].update(shape=[10**12]), CheckpointCorruptedError, "nbytes"),
    (lambda m: m["leaves"][0].update(offset=10**9), CheckpointCorruptedError, "outside"),
    (lambda m: m["leaves"][0].update(dtype="object"), UnsafeCheckpointError, "object"),
    (lambda m: m["leaves"][0].update(kind="pickle"), UnsafeCheckpointError, "pickle"),
    (lambda m: m.update(data_file="../../etc/passwd"), UnsafeCheckpointError, "plain"),
    (lambda m: m.update(data_file="/etc/passwd"), UnsafeCheckpointError, "plain"),
    (lambda m: m.update(format_version=99), FormatVersionError, "version"),
    (lambda m: m.update(format="pickle"), FormatVersionError, "not a minickpt"),
    (lambda m: m["tree"].update(t="eval"), CheckpointCorruptedError, "container"),
    (lambda m: m["leaves"][0].update(shape=[-1, 10]), CheckpointCorruptedError, "non-negative"),
    (lambda m: m["leaves"].pop(), CheckpointCorruptedError, "skeleton"),
])
def test_lying_manifests_are_refused(tmp_path, mutate, exc, match):
    d, man = _item(tmp_path)
    mutate(man)
    _rewrite(d, man)
    with pytest.raises(exc, match=match):
        read_leaves(FS, read_manifest(FS, str(d)))


def test_malformed_json_and_missing_manifest(tmp_path):
    d, _ = _item(tmp_path)
    (d / "manifest.json").write_text('{"format": "minickpt", ')
    with pytest.raises(CheckpointCorruptedError, match="not valid JSON"):
        read_manifest(FS, str(d))
    (d / "manifest.json").unlink()
    with pytest.raises(CheckpointCorruptedError, match="missing"):
        read_manifest(FS, str(d))


def test_symlinked_data_file_is_refused(tmp_path):
    d, _ = _item(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes((d / "data.bin").read_bytes())
    (d / "data.bin").unlink()
    (d / "data.bin").symlink_to(secret)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        read_leaves(FS, read_manifest(FS, str(d)))


def test_dtype_allow_list_covers_jax_dtypes():
    for dt in [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int4, jnp.float16]:
        assert np.dtype(dt).name in DTYPES


@pytest.mark.task("1.3")
@given(st.sampled_from(NUMPY_DTYPES + ML_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3,
                                                                    min_side=0, max_side=4),
       st.data())
def test_a_leaf_planned_then_decoded_is_the_same_leaf(dtype, shape, data):
    """Task 1.3's two halves are inverses, bit for bit, and decoding never copies."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.uint8)
    arr = raw.view(dtype).reshape(shape)
    entry, buf = plan_leaf(("a", "0"), arr)
    assert entry["path"] == ["a", "0"] and entry["nbytes"] == buf.nbytes == arr.nbytes
    stored = buf.copy()  # what read_leaves hands over: the bytes read from data.bin
    back = decode_leaf({**entry, "crc32": zlib.crc32(stored)}, stored)
    assert back.dtype == arr.dtype and back.shape == arr.shape and back.tobytes() == arr.tobytes()
    assert back.size == 0 or np.shares_memory(back, stored)


@pytest.mark.task("1.3")
def test_decode_leaf_values_keys_scalars_and_damage():
    for value in (3, -2**70, 0.1, float("nan"), 1 + 2j, "s", True):
        entry, buf = plan_leaf(("v",), value)
        assert buf is None
        back = decode_leaf(entry, None)
        assert type(back) is type(value) and (back == value or value != value)
    key = HostKey(np.arange(6, dtype=np.uint32).reshape(3, 2), "threefry2x32")
    entry, buf = plan_leaf(("k",), key)
    back = decode_leaf(entry, buf.copy())
    assert isinstance(back, HostKey) and back.impl == key.impl and back.shape == (3,)
    scalar = decode_leaf({**plan_leaf(("s",), np.array(1.5, np.float32))[0], "scalar": True},
                         np.frombuffer(np.float32(1.5).tobytes(), np.uint8).copy())
    assert type(scalar) is np.float32 and scalar == 1.5
    entry, buf = plan_leaf(("w", "b"), np.arange(4, dtype=np.int32))
    damaged = buf.copy()
    damaged[0] ^= 1
    with pytest.raises(CheckpointCorruptedError, match="w/b") as e:
        decode_leaf({**entry, "crc32": zlib.crc32(buf)}, damaged, where="d.bin")
    assert "d.bin" in str(e.value)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8)


@given(_JSON)
def test_json_text_is_json_dumps_byte_for_byte(value):
    """Metadata and manifests written with the fast path read exactly as before."""
    assert json_text(value) == json.dumps(value)


def _manifest_text(d):
    return (d / "manifest.json").read_bytes()


def test_a_manifest_read_again_is_not_checked_field_by_field_again(tmp_path, monkeypatch):
    import minickpt.format.manifest as mf

    _, d = write_read(tmp_path, {"w": np.arange(6, dtype=np.float32), "b": np.ones(3)})
    checks, crcs = [], []
    real_check, real_crc = mf._check_entry, mf.crc32
    monkeypatch.setattr(mf, "_check_entry", lambda *a: checks.append(a) or real_check(*a))
    monkeypatch.setattr(mf, "crc32", lambda b: crcs.append(b) or real_crc(b))
    m = read_manifest(FS, str(d))
    # the same bytes were checked by write_read's read: their fields are not checked again,
    # but their checksum is computed at every read, and the data file is looked at
    assert checks == [] and len(crcs) == 1
    assert [e["path"] for e in m.entries] == [["b"], ["w"]]
    os.truncate(d / "data.bin", 8)
    with pytest.raises(CheckpointCorruptedError, match="truncated"):
        read_manifest(FS, str(d))


def test_changed_manifest_bytes_are_checked_again(tmp_path):
    _, d = write_read(tmp_path, {"w": np.arange(6, dtype=np.float32)})
    text = _manifest_text(d)
    (d / "manifest.json").write_bytes(text.replace(b'"float32"', b'"object"'))
    with pytest.raises(UnsafeCheckpointError, match="object dtype"):
        read_manifest(FS, str(d))
    (d / "manifest.json").write_bytes(text)
    assert read_manifest(FS, str(d)).entries[0]["dtype"] == "float32"


def test_reads_of_the_same_manifest_share_nothing_a_caller_can_change(tmp_path):
    _, d = write_read(tmp_path, {"w": np.arange(6, dtype=np.float32)})
    first = read_manifest(FS, str(d))
    first.entries[0]["shape"][0] = 99
    first.entries[0]["dtype"] = "float64"
    first.skeleton["t"] = "list"
    again = read_manifest(FS, str(d))
    assert again.entries[0]["shape"] == [6] and again.entries[0]["dtype"] == "float32"
    assert again.skeleton["t"] == "dict"
    assert read_leaves(FS, again)[0].tolist() == list(range(6))


def test_a_step_saved_again_restores_what_it_holds_now(tmp_path):
    import shutil

    path = tmp_path / "ck"
    Checkpointer().save(path, {"item": {"w": np.arange(4, dtype=np.float32)}})
    ck = Checkpointer()
    assert ck.restore(path)["item"]["w"].tolist() == [0, 1, 2, 3]
    shutil.rmtree(path)
    Checkpointer().save(path, {"item": {"w": np.arange(5, dtype=np.int32), "v": np.ones(1)}})
    out = ck.restore(path)["item"]
    assert out["w"].tolist() == [0, 1, 2, 3, 4] and out["w"].dtype == np.int32
    assert out["v"].tolist() == [1.0]
