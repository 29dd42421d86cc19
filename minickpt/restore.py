"""Restoring an item into a target: strict structural checks, partial restore, migration.

The target says what the caller expects: its structure, each leaf's shape and dtype, and where
the arrays should live (a device, a sharding). Strict restore compares the checkpoint against
all of it *before* reading a byte and reports every difference in one error, because the fix
for a mismatch is usually a code change and fixing one difference per run is slow and painful.
No dtype is ever cast silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .errors import Mismatch, StructureMismatchError
from .format.buffers import aligned_empty
from .format.manifest import Manifest, check_data
from .format.read import read_leaves
from .format.regions import read_region
from .format.shards import box_of
from .format.spec import DTYPES, canonical_impl
from .fs import FileSystem
from .tree import (
    _LIBRARY_FLATTEN,
    HostKey,
    Names,
    flatten_with_names,
    from_skeleton,
    is_prng_key,
    path_names,
    path_str,
    unflatten_like,
)


# ---------------------------------------------------------------------------------------
# what a target leaf expects
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expect:
    """What one target leaf asks for: an array (shape, dtype, where) or a Python value."""

    kind: str  # "array" | "prng_key" | "value"
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    out: str = "numpy"  # "numpy" | "numpy_scalar" | "jax" | a Python type name
    sharding: Any = None
    impl: str | None = None


def expect_of(leaf: Any) -> Expect:
    """Read a target leaf: a jax.Array, a ShapeDtypeStruct, a numpy array or a Python value."""
    if isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(leaf, jax.Array):
        sharding = getattr(leaf, "sharding", None)
        if is_prng_key(leaf):
            impl = str(jax.random.key_impl(leaf)) if isinstance(leaf, jax.Array) else None
            return Expect("prng_key", tuple(leaf.shape), None, "jax", sharding, impl)
        return Expect("array", tuple(leaf.shape), np.dtype(leaf.dtype), "jax", sharding)
    if isinstance(leaf, np.ndarray):
        return Expect("array", leaf.shape, _native(leaf.dtype), "numpy")
    if isinstance(leaf, np.generic):
        return Expect("array", (), _native(leaf.dtype), "numpy_scalar")
    if isinstance(leaf, (bool, int, float, complex, str)):
        return Expect("value", out=type(leaf).__name__)
    if isinstance(leaf, HostKey):
        return Expect("prng_key", leaf.shape, None, "numpy", None, leaf.impl)
    raise TypeError(f"cannot restore into a target leaf of type {type(leaf).__name__}; use an "
                    "array, a jax.ShapeDtypeStruct, a numpy array or a Python scalar")


def _native(dtype: np.dtype) -> np.dtype:
    """A dtype in this machine's byte order. Byte order is how numbers are laid out, not
    which numbers they are: a checkpoint stores every leaf little-endian, and a ``>i4``
    target takes an ``int32`` leaf and gets it back native (as Orbax restores it)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _saved_desc(e: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None, str | None]:
    if e["kind"] == "value":
        return "value", None, e["type"]
    if e["kind"] == "prng_key":
        return "prng_key", tuple(e["shape"][:-1]), e["impl"]
    return "array", tuple(e["shape"]), e["dtype"]


# The 0-d array dtypes a Python scalar target takes: the ones JAX gives that Python type, with
# or without jax_enable_x64 (a jitted TrainState.step is int32). Nothing else, so no bool or
# uint becomes an int and no float16 a float without the caller asking for it.
_SCALAR_DTYPES = {"int": ("int32", "int64"), "float": ("float32", "float64"),
                  "bool": ("bool",), "complex": ("complex64", "complex128")}


def compare_leaf(path: str, e: Mapping[str, Any], want: Expect) -> list[Mismatch]:
    """The differences between one saved leaf and what its target expects (empty if none)."""
    kind, shape, dt = _saved_desc(e)
    if want.kind == "value":
        if kind == "value":  # the same Python type, or it is a cast (an int above 2**53 in a
            ok = dt == want.out  # float target would lose digits)
            return [] if ok else [Mismatch(path, "type", dt, want.out)]
        if kind == "array" and shape == ():  # a 0-d array restores into a Python scalar
            ok = dt in _SCALAR_DTYPES.get(want.out, ())
            return [] if ok else [Mismatch(path, "dtype", dt, f"a Python {want.out}")]
        return [Mismatch(path, "kind", kind, f"a Python {want.out}")]
    if want.kind == "prng_key":
        if kind != "prng_key":
            return [Mismatch(path, "kind", f"{kind} {dt}", "a typed PRNG key")]
        out = []
        if want.shape is not None and shape != want.shape:
            out.append(Mismatch(path, "shape", str(shape), str(want.shape)))
        if want.impl is not None and canonical_impl(dt) != canonical_impl(want.impl):
            out.append(Mismatch(path, "key impl", dt, want.impl))
        return out
    # an array target
    if kind == "prng_key":
        return [Mismatch(path, "kind", "a typed PRNG key", f"array of {want.dtype}")]
    if kind == "value":
        return [Mismatch(path, "kind", f"Python {dt}", f"array of {want.dtype}")]
    out = []
    if shape != want.shape:
        out.append(Mismatch(path, "shape", str(shape), str(want.shape)))
    if want.dtype is not None and np.dtype(DTYPES[dt]) != want.dtype:
        out.append(Mismatch(path, "dtype", dt, str(want.dtype)))
    return out


# ---------------------------------------------------------------------------------------
# strict structure checks
# ---------------------------------------------------------------------------------------
def check_structure(manifest: Manifest, target: Any, *, item: str = "",
                    partial: bool = False) -> list[tuple[Names, int]]:
    """Task 3.2 — match every target leaf with a saved leaf, or raise listing *every* mismatch.

    Returns ``(target path, saved leaf index)`` pairs in the target's leaf order. Missing
    leaves, unexpected leaves (unless ``partial``), and shape, dtype or kind differences are
    collected together in one :class:`StructureMismatchError` (the target's problems in its
    leaf order, then the unexpected ones), so that one run tells of every change. Its hint:
    with any missing or unexpected leaf, ``partial=True`` or a migration; with differences of
    shape, dtype or kind alone, that minickpt never casts silently.
    """
    saved = manifest.by_path
    pairs: list[tuple[Names, int]] = []
    problems: list[Mismatch] = []
    wanted: set[Names] = set()
    for names, leaf in flatten_with_names(target):
        wanted.add(names)
        where = path_str(names)
        if names not in saved:
            problems.append(Mismatch(where, "missing"))
            continue
        i = saved[names]
        problems += compare_leaf(where, manifest.entries[i], expect_of(leaf))
        pairs.append((names, i))
    if not partial:
        problems += [Mismatch(path_str(n), "unexpected") for n in saved if n not in wanted]
    if problems:
        hint = ("Restore with partial=True to take only the target's leaves on purpose, or "
                "migrate the checkpoint (minickpt.restore.migrate) if the model changed."
                if any(m.kind in ("missing", "unexpected") for m in problems) else
                "minickpt never casts silently: change the target, or convert after restoring.")
        raise StructureMismatchError(item, problems, hint)
    return pairs


# ---------------------------------------------------------------------------------------
# building outputs
# ---------------------------------------------------------------------------------------
def to_output(value: Any, want: Expect, sharding: Any = None) -> Any:
    """A host value turned into what the target leaf asked for."""
    if want.kind == "value":
        if isinstance(value, np.ndarray):
            value = value.item()
        return {"int": int, "float": float, "bool": bool, "complex": complex,
                "str": str}[want.out](value)
    target_sharding = want.sharding if want.sharding is not None else sharding
    if want.kind == "prng_key":
        assert isinstance(value, HostKey)
        if want.out == "numpy":
            return value
        data = put(value.data, _key_data_sharding(target_sharding, value.data.ndim))
        return jax.random.wrap_key_data(data, impl=canonical_impl(value.impl))
    if want.out == "jax":
        return put(value, target_sharding)
    if want.out == "numpy_scalar":
        return value[()] if isinstance(value, np.ndarray) else value
    return value


def _key_data_sharding(sharding: Any, ndim: int) -> Any:
    # a key array's sharding covers the key shape; its data has one more (trailing) axis
    if sharding is None or not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def put(arr: np.ndarray, sharding: Any = None) -> jax.Array:
    """Host array to device(s). Each device gets only its own slice of a sharded array."""
    if sharding is None:
        return jax.device_put(arr)
    if isinstance(sharding, jax.Device):
        return jax.device_put(arr, sharding)
    if len(sharding.device_set) == 1 or sharding.is_fully_addressable:
        return jax.device_put(arr, sharding)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


class _Addressable:
    """``sharding.is_fully_addressable``, asked once per sharding object: 100,000 leaves
    usually share one or a few, and asking costs microseconds (a property, a hash)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, bool]] = {}  # id -> (the sharding, kept alive; answer)

    def __call__(self, sharding: Any) -> bool:
        hit = self._seen.get(id(sharding))
        if hit is None or hit[0] is not sharding:
            hit = self._seen[id(sharding)] = (sharding, bool(sharding.is_fully_addressable))
        return hit[1]


def put_many(arrays: Sequence[np.ndarray], shardings: Sequence[Any],
             addressable: _Addressable | None = None) -> list[jax.Array]:
    """:func:`put` for many arrays: those that go whole to addressable devices travel in one
    batched ``device_put`` (one dispatch instead of one per leaf — most of the cost of
    restoring many small leaves); the others go one by one through :func:`put`.

    On a CPU backend an array whose buffer is 64-byte aligned (as :func:`read_leaves` makes
    them) becomes a jax.Array without being copied.
    """
    out: list[Any] = [None] * len(arrays)
    groups: dict[Any, list[int]] = {}  # one device_put per distinct sharding (usually one)
    local = addressable or _Addressable()  # the caller's, when it asked already
    for i, s in enumerate(shardings):
        if s is None or isinstance(s, jax.Device) or local(s):
            groups.setdefault(s, []).append(i)
        else:
            out[i] = put(arrays[i], s)
    for s, idx in groups.items():
        batch = [arrays[i] for i in idx]
        placed = _put_single_device(batch, s) if len(batch) > 1 else None
        if placed is None:
            placed = jax.device_put(batch, s)
        for i, a in zip(idx, placed, strict=True):
            out[i] = a
    return out


# ---------------------------------------------------------------------------------------
# many small arrays onto one device
# ---------------------------------------------------------------------------------------
# jax.device_put spends ~12 µs of Python per array (avals built and rebuilt, shardings
# checked, handlers looked up) around a ~2.5 µs C++ transfer: for 200 small leaves that is
# most of a restore. For the common case — plain numpy arrays, already of a dtype JAX keeps
# as is, going whole to one device — the arrays below are made by the very call
# jax.device_put ends in (``batched_device_put`` of jaxlib), with the aval and commitment
# it would give them. That call is JAX-internal, so it is checked once per process against
# jax.device_put itself (aval, sharding, commitment, dtype, zero-copy), and any difference
# or error turns this path off for good: the public call is always the fallback.
_FAST_PUT: dict[str, Any] = {}  # "ok": bool once checked; "fns": the internals used
# sharding -> (shape, dtype) -> the aval jax.device_put gives such an array: building one
# costs ~4.5 µs (several interned ShapedArrays), and it depends on nothing else (a dtype
# JAX would convert, whatever x64 is set to now, never gets here). Keyed by the sharding
# first, looked up once per call: hashing a sharding costs ~2 µs, more than the rest
_AVALS: dict[Any, dict[tuple[Any, ...], Any]] = {}


def _fast_put_fns() -> Any:
    if "fns" not in _FAST_PUT:
        try:
            from jax._src import config as jconfig
            from jax._src import core as jcore
            from jax._src import dispatch as jdispatch
            from jax._src import dtypes as jdtypes
            from jax._src.lib import xla_client as xc

            _FAST_PUT["fns"] = (xc.batched_device_put, jcore.shaped_abstractify,
                                jdispatch.update_dp_aval, jdtypes.canonicalize_dtype,
                                jconfig.explicit_device_put_scope, jcore.trace_state_clean)
        except Exception:  # another JAX: the public path only
            _FAST_PUT["fns"] = None
            _FAST_PUT["ok"] = False
    return _FAST_PUT["fns"]


def _put_single_device(arrays: Sequence[np.ndarray], sharding: Any) -> list[jax.Array] | None:
    """What ``jax.device_put(arrays, sharding)`` returns, made without its per-array Python
    overhead; None when this path does not apply (the caller then uses jax.device_put)."""
    if _FAST_PUT.get("ok") is False or not isinstance(sharding,
                                                      jax.sharding.SingleDeviceSharding):
        return None
    fns = _fast_put_fns()
    if fns is None:
        return None
    batched_put, abstractify, dst_aval, canonical, explicit, clean = fns
    try:
        if not clean():
            return None
        (device,) = sharding.device_set
        if not sharding.is_fully_addressable:
            return None
        kind = sharding.memory_kind  # another memory (pinned_host ...): JAX's own path
        if kind is not None and kind != device.default_memory().kind:
            return None
        avals = _AVALS.get(sharding)
        if avals is None or len(avals) > 4096:  # bounded: shapes seen by a long process
            if len(_AVALS) > 64:
                _AVALS.clear()
            avals = _AVALS[sharding] = {}
        with explicit():
            out = []
            for x in arrays:
                if type(x) is not np.ndarray or canonical(x.dtype) != x.dtype:
                    return None  # JAX would convert it (a 64-bit dtype with x64 off)
                key = (x.shape, x.dtype)
                aval = avals.get(key)
                if aval is None:
                    aval = avals[key] = dst_aval(abstractify(x), sharding)
                out.append(batched_put(aval, sharding, [x], [device], True))
    except Exception:
        _FAST_PUT["ok"] = False
        return None
    if "ok" not in _FAST_PUT:
        _FAST_PUT["ok"] = _same_as_device_put(arrays[0], out[0], sharding)
        if not _FAST_PUT["ok"]:
            return None
    return out


def _same_as_device_put(x: np.ndarray, fast: jax.Array, sharding: Any) -> bool:
    """Whether the fast path's array is what jax.device_put makes of ``x``."""
    try:
        ref = jax.device_put(x, sharding)
        same = (type(fast) is type(ref) and fast.aval == ref.aval
                and fast.sharding == ref.sharding and fast.committed == ref.committed
                and fast.dtype == ref.dtype and fast.weak_type == ref.weak_type
                and np.array_equal(np.asarray(fast), x))
        if same and ref.unsafe_buffer_pointer() == x.ctypes.data:  # device_put aliased x:
            same = fast.unsafe_buffer_pointer() == x.ctypes.data  # so must this path
        return bool(same)
    except Exception:
        return False


def read_item_values(fs: FileSystem, manifest: Manifest, target: Any = None, *,
                     item: str = "", partial: bool = False, verify: bool = True) -> list[Any]:
    """The host values of an item: every leaf without a target, else the target's leaves in
    its order (after the strict structure check)."""
    if target is None:
        return read_leaves(fs, manifest, verify=verify)
    pairs = check_structure(manifest, target, item=item, partial=partial)
    return read_leaves(fs, manifest, [i for _, i in pairs], verify=verify)


def finish_item(values: Sequence[Any], skel: Any, target: Any = None,
                sharding: Any = None) -> Any:
    """Host values (from :func:`read_item_values`) turned into the restored item."""
    if target is None:
        if sharding is not None:
            values = [to_output(v, Expect("prng_key" if isinstance(v, HostKey) else "array",
                                          out="jax"), sharding)
                      if isinstance(v, (np.ndarray, HostKey)) else v for v in values]
        return from_skeleton(skel, list(values))
    flat, treedef = jax.tree_util.tree_flatten(target)
    return jax.tree_util.tree_unflatten(treedef, _outputs(values, flat, sharding))


def _outputs(values: Sequence[Any], leaves: Sequence[Any], sharding: Any,
             wants: Sequence[Expect] | None = None,
             addressable: _Addressable | None = None) -> list[Any]:
    """Each host value as its target leaf asks (``wants``: the leaves' :func:`expect_of`,
    when the caller has them already); plain arrays bound for devices are placed together
    (:func:`put_many`)."""
    outs: list[Any] = [None] * len(leaves)
    to_device: list[int] = []
    for k, (v, leaf) in enumerate(zip(values, leaves, strict=True)):
        want = expect_of(leaf) if wants is None else wants[k]
        if want.kind == "array" and want.out == "jax" and isinstance(v, np.ndarray):
            to_device.append(k)
            outs[k] = want.sharding if want.sharding is not None else sharding
        else:
            outs[k] = to_output(v, want, sharding)
    if to_device:
        placed = put_many([values[k] for k in to_device], [outs[k] for k in to_device],
                          addressable)
        for k, arr in zip(to_device, placed, strict=True):
            outs[k] = arr
    return outs


def restore_item(fs: FileSystem, manifest: Manifest, target: Any = None, *, item: str = "",
                 partial: bool = False, verify: bool = True, sharding: Any = None) -> Any:
    """Read one item: into ``target`` (strictly checked) or, without one, as nested dicts,
    lists and numpy arrays, typed PRNG keys as :class:`~minickpt.tree.HostKey` (or jax
    arrays and keys placed with ``sharding`` when it is given).

    A target leaf placed on a sharding that spans several processes, or a leaf saved in
    shards, is read region by region (:func:`restore_by_region`): each process reads only
    what its own devices hold.
    """
    if target is None:
        return finish_item(read_item_values(fs, manifest, verify=verify), manifest.skeleton,
                           None, sharding)
    pairs = check_structure(manifest, target, item=item, partial=partial)
    if flatten_with_names is _LIBRARY_FLATTEN[0]:  # its leaves are tree_leaves', in order
        leaves = jax.tree_util.tree_leaves(target)  # (without naming every leaf again)
    else:  # a lab's student version (labkit.plugged_in): named with it, as every restore is
        leaves = [leaf for _, leaf in flatten_with_names(target)]
    outs: dict[Names, Any] = {}
    rest = []
    local = _Addressable()
    for (names, i), leaf in zip(pairs, leaves, strict=True):
        want = expect_of(leaf)
        where = want.sharding if want.sharding is not None else sharding
        if _by_region(manifest.entries[i], want, where, local):
            if manifest.data_file is not None:
                check_data(fs, manifest)  # (once) what read_manifest may have left to a read
            outs[names] = restore_by_region(fs, manifest, i, want, where, verify=verify)
        else:
            rest.append((names, i, leaf, want))
    stream = _streaming_put(manifest, rest, sharding, local)
    values = read_leaves(fs, manifest, [r[1] for r in rest], verify=verify,
                         on_leaf=None if stream is None else stream[0],
                         transient=() if stream is None else stream[2])
    streamed = set() if stream is None else stream[1]
    if streamed:  # placed already, as their bytes arrived: the others are finished below
        for k in streamed:
            outs[rest[k][0]] = values[k]
        left = [k for k in range(len(rest)) if k not in streamed]
        rest, values = [rest[k] for k in left], [values[k] for k in left]
    placed = _outputs(values, [r[2] for r in rest], sharding, [r[3] for r in rest], local)
    for r, out in zip(rest, placed, strict=True):
        outs[r[0]] = out
    return unflatten_like(target, outs)


_STREAM_FROM_BYTES = 8 << 20  # read by several threads (read_leaves): transfers overlap them


def _streaming_put(manifest: Manifest, rest: Sequence[tuple[Names, int, Any, Expect]],
                   sharding: Any, addressable: _Addressable
                   ) -> tuple[Callable[[int, Any], Any], set[int], set[int]] | None:
    """For a large item: a :func:`read_leaves` ``on_leaf`` that puts each array bound whole
    for addressable accelerator devices on them as soon as its bytes are read and verified
    (the host-to-device transfer of one leaf overlaps the reading of the next), the set it
    fills with the positions it placed, and the positions whose host bytes are transient:
    read into the reused buffers of the restore pool, since the device keeps its own copy
    (:func:`restore_pool_mode`). None for a small item: one batched put of all its leaves
    after the reads costs less there (:func:`put_many`), and so it does for arrays bound
    for CPU devices, which a put makes without copying (measured: streaming them cost a
    400 MB restore ~20 ms on a 2-core machine), unless the pool is forced on for them."""
    entries = manifest.entries
    if sum(entries[i].get("nbytes", 0) for _, i, _, _ in rest) < _STREAM_FROM_BYTES:
        return None
    mode = restore_pool_mode()
    where: dict[int, Any] = {}  # position -> sharding, for the leaves that can go as they come
    off_host: dict[int, bool] = {}  # id(sharding) -> whether its leaves go as they come
    on_device: dict[int, bool] = {}  # id(sharding) -> whether it is on an accelerator
    for k, (_, i, _, want) in enumerate(rest):
        if want.kind != "array" or want.out != "jax" or entries[i]["kind"] != "array" \
                or entries[i].get("scalar"):
            continue
        s = want.sharding if want.sharding is not None else sharding
        if not (s is None or isinstance(s, jax.Device) or addressable(s)):
            continue
        if id(s) not in off_host:
            on_device[id(s)] = _device_memory(s)  # what the put really does
            off_host[id(s)] = mode == "on" or _on_accelerator(s)
        if off_host[id(s)]:
            where[k] = s
    if not where:
        return None
    placed: set[int] = set()
    pooled = mode != "off"

    def on_leaf(k: int, value: Any) -> Any:
        if k not in where or not isinstance(value, np.ndarray):
            return value
        s = where[k]
        if pooled and not on_device[id(s)]:  # a CPU put aliases aligned host memory (even
            value = _own_copy(value)  # with may_alias=False): never the pool's buffer
        out = jax.device_put(value) if s is None else jax.device_put(value, s)
        placed.add(k)
        return out

    return on_leaf, placed, set(where) if pooled else set()


def _own_copy(value: np.ndarray) -> np.ndarray:
    """``value`` copied into 64-byte aligned memory of its own, which a CPU put then takes
    without a second copy."""
    out = aligned_empty(value.shape, value.dtype)
    np.copyto(out, value)
    return out


def restore_pool_mode() -> str:
    """How a large restore onto devices uses host memory (``MINICKPT_RESTORE_POOL``):

    * ``auto`` (the default): leaves bound for an accelerator are read into the restore
      pool's reused buffers and copied to their device; leaves bound for CPU devices are
      read into memory of their own, which their arrays then own without a copy;
    * ``on``: CPU devices too, each array a copy out of the pool (what the tests use to
      show, on a CPU, that such a restore's host memory is bounded);
    * ``off``: every leaf read into memory of its own and kept until the restore returns
      (the path before the pool)."""
    mode = os.environ.get("MINICKPT_RESTORE_POOL", "auto").strip().lower()
    return mode if mode in ("on", "off") else "auto"


def _on_accelerator(sharding: Any) -> bool:
    """Whether a put to ``sharding`` (None: JAX's default device) copies to an accelerator:
    where a restore streams its leaves as they arrive (tests may say so of a CPU)."""
    return _device_memory(sharding)


def _device_memory(sharding: Any) -> bool:
    """Whether a put to ``sharding`` copies into an accelerator's memory: a CPU put may
    alias the host buffer instead, so a pool buffer must not be put there as it is."""
    try:
        if sharding is None:
            return jax.default_backend() != "cpu"
        if isinstance(sharding, jax.Device):
            return sharding.platform != "cpu"
        return any(d.platform != "cpu" for d in sharding.device_set)
    except Exception:  # an unusual sharding: the batched put after the reads, as before
        return False



def _by_region(entry: Mapping[str, Any], want: Expect, sharding: Any,
               addressable: Callable[[Any], bool] | None = None) -> bool:
    if want.out != "jax" or want.kind not in ("array", "prng_key"):
        return False
    if not isinstance(sharding, jax.sharding.Sharding):
        return False
    if want.kind == "prng_key" and not isinstance(sharding, jax.sharding.NamedSharding):
        return False
    if entry.get("sharded"):
        return True
    return not (addressable(sharding) if addressable is not None
                else sharding.is_fully_addressable)


def restore_by_region(fs: FileSystem, manifest: Manifest, i: int, want: Expect, sharding: Any,
                      *, verify: bool = True) -> jax.Array:
    """Leaf ``i`` placed on ``sharding``, reading only the regions needed here.

    ``jax.make_array_from_callback`` asks, for each device of this process, for the global
    region it holds; :func:`minickpt.format.regions.read_region` cuts that region out of whatever
    was saved — one whole array, or shards from any number of processes and any mesh (Task
    4.4, :func:`minickpt.format.regions.region_from_pieces`).
    """
    e = manifest.entries[i]
    shape = tuple(e["shape"])
    cache: dict[Any, np.ndarray] = {}  # verified pieces shared by this process's devices

    def read(index: tuple[slice, ...]) -> np.ndarray:
        return read_region(fs, manifest, i, box_of(index, shape), verify=verify, cache=cache)

    if want.kind == "prng_key":
        data = jax.make_array_from_callback(shape, _key_data_sharding(sharding, len(shape)),
                                            read)
        return jax.random.wrap_key_data(data, impl=canonical_impl(e["impl"]))
    return jax.make_array_from_callback(shape, sharding, read)


# ---------------------------------------------------------------------------------------
# migration
# ---------------------------------------------------------------------------------------
@dataclass
class MigrationReport:
    """What a migration did, leaf by leaf, for a person to check."""

    renamed: dict[str, str] = field(default_factory=dict)
    filled: list[str] = field(default_factory=list)  # new leaves kept from the target
    dropped: list[str] = field(default_factory=list)  # saved leaves the new model has no use for
    converted: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"renamed {len(self.renamed)}, filled {len(self.filled)} from the new model, "
                 f"dropped {len(self.dropped)}, converted {len(self.converted)}"]
        lines += [f"  renamed  {a} -> {b}" for a, b in self.renamed.items()]
        lines += [f"  filled   {p}" for p in self.filled]
        lines += [f"  dropped  {p}" for p in self.dropped]
        lines += [f"  converted {p}: {c}" for p, c in self.converted.items()]
        return "\n".join(lines)


Rename = Mapping[str, str] | Callable[[str], str | None] | Sequence[tuple[str, str]]


def rename_path(path: str, rules: Rename | None) -> str | None:
    """Apply rename rules to a slash path. Mapping/sequence rules are regexes matched against
    the whole path (``{"Dense_(\\d+)": r"layers/\\1"}`` or ``{"old/w": "new/w"}``); a callable
    returns the new path, or None to drop the leaf."""
    if rules is None:
        return path
    if callable(rules):
        return rules(path)
    items = rules.items() if isinstance(rules, Mapping) else rules
    for pattern, repl in items:
        new, n = re.subn(rf"^{pattern}(?=/|$)", repl, path)
        if n:
            return new
    return path


def migrate(saved: Any, target: Any, *, rename: Rename | None = None,
            fill_missing: bool = True, allow_cast: bool = False) -> tuple[Any, MigrationReport]:
    """Task 3.4 — map an old checkpoint's tree onto a new model's structure.

    ``saved`` is a restored tree (without target); ``target`` the new model's state. Each
    saved leaf's path is renamed by ``rename``; target leaves found after renaming take the
    saved value (shapes must match; dtypes too unless ``allow_cast``), target leaves not
    found keep their new initial value when ``fill_missing`` (and are listed in the report),
    and saved leaves the target has no place for are dropped and listed under their saved
    (old) paths. Two saved leaves renamed onto one path would drop one silently: a
    ``"duplicate"`` problem. The error's hint names the knobs that apply: the rename rules,
    ``allow_cast=True`` for a dtype, ``fill_missing=True`` for a missing leaf.
    """
    report = MigrationReport()
    by_new: dict[str, Any] = {}
    olds: dict[str, list[str]] = {}  # new path -> the saved paths renamed onto it
    for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]:
        old = path_str(path_names(p))
        new = rename_path(old, rename)
        if new is None:
            report.dropped.append(old)
            continue
        if new != old:
            report.renamed[old] = new
        olds.setdefault(new, []).append(old)
        by_new[new] = leaf
    dup = [new for new, o in olds.items() if len(o) > 1]  # taking one would drop the others
    problems: list[Mismatch] = [Mismatch(new, "duplicate", saved=" and ".join(olds[new]),
                                         expected="one saved leaf") for new in dup]
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    outs, used = [], set()
    for p, leaf in flat:
        where = path_str(path_names(p))
        if where not in by_new:
            if not fill_missing:
                problems.append(Mismatch(where, "missing"))
            report.filled.append(where)
            outs.append(leaf)
            continue
        used.add(where)
        if where in dup:  # already a problem: its values are not compared
            outs.append(leaf)
            continue
        value, trouble = migrate_leaf(where, by_new[where], leaf, allow_cast=allow_cast,
                                      report=report)
        problems += trouble
        outs.append(value)
    report.dropped += [old for p in by_new if p not in used for old in olds[p]]
    if problems:
        kinds = {m.kind for m in problems}
        hint = "Fix the rename rules (each saved path onto the new model's path)"
        if "dtype" in kinds:
            hint += ", or pass allow_cast=True to cast dtypes (each cast is reported)"
        if "missing" in kinds:
            hint += ", or pass fill_missing=True to keep the new model's initial values"
        raise StructureMismatchError("migration", problems, hint + ".")
    return jax.tree_util.tree_unflatten(treedef, outs), report


def migrate_leaf(where: str, value: Any, leaf: Any, *, allow_cast: bool = False,
                 report: MigrationReport | None = None) -> tuple[Any, list[Mismatch]]:
    """One saved value put in the place of the new model's ``leaf``: ``(new leaf,
    problems)``. Placed like ``leaf`` (its sharding, or numpy, or a Python scalar); shapes
    must match; dtypes too unless ``allow_cast`` (each cast is noted in ``report``). On a
    problem the new leaf is ``leaf`` itself, and the problem says why."""
    if isinstance(value, HostKey) or isinstance(leaf, HostKey) or is_prng_key(leaf):
        outs: list[Any] = []
        problems = _migrate_key(where, value, leaf, outs)
        return outs[0], problems
    want_shape = np.shape(leaf)
    if np.shape(value) != want_shape:
        return leaf, [Mismatch(where, "shape", str(np.shape(value)), str(want_shape))]
    want_dtype = getattr(leaf, "dtype", None)
    got_dtype = getattr(value, "dtype", None)
    if want_dtype is not None and got_dtype is not None and np.dtype(got_dtype) != np.dtype(
            want_dtype):
        if not allow_cast:
            return leaf, [Mismatch(where, "dtype", str(got_dtype), str(want_dtype))]
        if report is not None:
            report.converted[where] = f"{got_dtype} -> {want_dtype}"
        value = np.asarray(value).astype(want_dtype)
    return _like(value, leaf), []


def _migrate_key(where: str, value: Any, leaf: Any, outs: list[Any]) -> list[Mismatch]:
    """A typed PRNG key (restored as a HostKey) into a target key leaf."""
    want = expect_of(leaf)
    if not isinstance(value, HostKey) or want.kind != "prng_key":
        outs.append(leaf)
        return [Mismatch(where, "kind", "a typed PRNG key" if isinstance(value, HostKey)
                         else "an array", "an array" if want.kind != "prng_key"
                         else "a typed PRNG key")]
    problems = []
    if want.shape is not None and value.shape != want.shape:
        problems.append(Mismatch(where, "shape", str(value.shape), str(want.shape)))
    if want.impl is not None and canonical_impl(value.impl) != canonical_impl(want.impl):
        problems.append(Mismatch(where, "key impl", value.impl, want.impl))
    outs.append(leaf if problems else to_output(value, want))
    return problems


def _like(value: Any, leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return put(np.asarray(value), getattr(leaf, "sharding", None))
    if isinstance(leaf, np.ndarray):
        return np.asarray(value)
    if isinstance(leaf, (bool, int, float, complex)):
        return type(leaf)(np.asarray(value).item())
    return value


# ---------------------------------------------------------------------------------------
# resuming a run
# ---------------------------------------------------------------------------------------
def resume(mngr: Any, state: Any, rng: Any) -> tuple[Any, Any, int]:
    """Task 3.3 — where a (re)started run begins: ``(state, rng, first step to compute)``.

    A run killed at any moment and restarted with this computes the uninterrupted run: it
    goes on from the newest valid checkpoint (items ``"state"`` and ``"rng"``), never
    computing that checkpoint's own step again, with everything the next update reads, shaped
    and placed like the given ``state`` and ``rng``. With nothing saved: those themselves, and
    step 1. A checkpoint whose state's own step counter is not its step was saved under the
    wrong number: ``ValueError`` naming both. One whose tree is not the given state's (a
    leaf more or fewer: another model) is a ``StructureMismatchError``: resume never drops
    saved values silently (that is a migration, task 3.4).
    """
    if mngr.latest_step() is None:
        return state, rng, 1
    restored = mngr.restore(target={"state": state, "rng": rng})
    t_ckpt = restored.step
    saved = restored["state"]
    if int(saved.step) != t_ckpt:
        raise ValueError(f"the checkpoint of step {t_ckpt} ({mngr.step_path(t_ckpt)}) holds a "
                         f"state whose step counter is {int(saved.step)}: it was saved under "
                         "the wrong step number, so resuming from it would break step "
                         "continuity")
    return saved, restored["rng"], t_ckpt + 1
