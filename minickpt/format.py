"""The on-disk format of one item: a data file and a JSON manifest. No pickle, ever.

An item is a pytree saved in its own directory::

    params/
      data.bin        every array's raw little-endian bytes, each starting on a 64-byte boundary
      manifest.json   format version, the tree's container skeleton, and one line per leaf:
                      key path, kind, dtype, shape, byte offset, byte length, CRC-32

Reading trusts nothing: every field of the manifest is checked (types, dtype names against an
allow-list, sizes against the data file) before a single byte is allocated, files are opened
without following symlinks, and every leaf's checksum is verified unless asked not to.

:func:`plan_item` and :func:`write_item` are separate so that the synchronous save, the
background writer and the per-process shard writer share them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from .errors import (
    CheckpointCorruptedError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedLeafError,
)
from .fs import FileSystem, SyncBatch
from .tree import MAX_DEPTH, HostKey, Names, path_str, skeleton, to_host

FORMAT_NAME = "minickpt"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DATA_FILE = "data.bin"
ALIGN = 64
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
_CRC_IN_THREAD_BYTES = 8 << 20  # below this, threads cost more than they save

try:  # ISA-L computes the very same CRC-32 as zlib, ~4× faster (carry-less multiply)
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - isal is an optional extra ("minickpt[fast]")
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
"""The manifest's checksum of a buffer: CRC-32 as zlib computes it (whichever library does)."""
CRC_IMPL = "isal" if _isal_crc32 is not None else "zlib"

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_DATA_FILE_RE = re.compile(r"^data(\.[A-Za-z0-9_\-]{1,64})?\.bin$")


def _allowed_dtypes() -> dict[str, np.dtype]:
    names = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
    out = {n: np.dtype(n) for n in names}
    for n in ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn",
              "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4"]:
        if hasattr(ml_dtypes, n):
            out[n] = np.dtype(getattr(ml_dtypes, n))
    return out


DTYPES = _allowed_dtypes()


_NAME_OF: dict[np.dtype, str] = {}  # dtype -> checked name (numpy's dtype.name is slow)


def dtype_name(dtype: np.dtype) -> str:
    """The manifest's name for a dtype; refuses anything that is not plain numbers."""
    dt = np.dtype(dtype)
    name = _NAME_OF.get(dt)
    if name is not None:
        return name
    name = dt.name
    if name not in DTYPES or DTYPES[name] != dt.newbyteorder("="):
        raise UnsupportedLeafError(f"dtype {dt} cannot be stored (supported: {sorted(DTYPES)})")
    _NAME_OF[dt] = name
    return name


def check_name(name: str, what: str = "item name") -> str:
    """Item and file names must be plain names: no separators, no '..', no hidden files."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"{what} {name!r} is not allowed: use letters, digits, '_', '-' and '.', "
                         "not starting with '.' or '-'")
    return name


# ---------------------------------------------------------------------------------------
# planning: the tree, brought to the host, as manifest entries and byte views
# ---------------------------------------------------------------------------------------
@dataclass
class ItemPlan:
    """An item ready to be written: the skeleton, one manifest entry per leaf, and the bytes."""

    skeleton: dict[str, Any]
    entries: list[dict[str, Any]]
    buffers: list[np.ndarray | None]  # 1-D uint8 views of each array leaf, None otherwise
    nbytes: int = 0

    @property
    def num_leaves(self) -> int:
        return len(self.entries)


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    """A 1-D uint8 view of an array's little-endian C-order bytes (copies only if needed)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def encode_value(value: Any, where: str) -> dict[str, Any]:
    """A Python scalar or string as a JSON manifest entry (exact, including NaN and big ints)."""
    if isinstance(value, bool):
        return {"kind": "value", "type": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "value", "type": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "value", "type": "float", "value": value.hex()}
    if isinstance(value, complex):
        return {"kind": "value", "type": "complex", "value": [value.real.hex(), value.imag.hex()]}
    if isinstance(value, str):
        return {"kind": "value", "type": "str", "value": value}
    raise UnsupportedLeafError(f"leaf {where} of type {type(value).__name__} cannot be stored")


def decode_value(entry: Mapping[str, Any], where: str) -> Any:
    t, v = entry.get("type"), entry.get("value")
    try:
        if t == "bool" and isinstance(v, bool):
            return v
        if t == "int" and isinstance(v, int) and not isinstance(v, bool):
            return v
        if t == "float" and isinstance(v, str):
            return float.fromhex(v)
        if t == "complex" and isinstance(v, list) and len(v) == 2:
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if t == "str" and isinstance(v, str):
            return v
    except (TypeError, ValueError):
        pass
    raise CheckpointCorruptedError(where, f"value leaf of type {t!r} holds {v!r}")


def plan_leaf(names: Names, host: Any) -> tuple[dict[str, Any], np.ndarray | None]:
    """The manifest entry and byte view of one leaf already on the host."""
    where = path_str(names)
    entry: dict[str, Any] = {"path": list(names)}
    if isinstance(host, HostKey):
        data = np.asarray(host.data)
        entry.update(kind="prng_key", impl=host.impl, dtype=dtype_name(data.dtype),
                     shape=list(data.shape))
        buf = _as_bytes(data)
    elif isinstance(host, np.ndarray):
        entry.update(kind="array", dtype=dtype_name(host.dtype), shape=list(host.shape))
        buf = _as_bytes(host)
    else:
        entry.update(encode_value(host, where))
        return entry, None
    entry["nbytes"] = int(buf.nbytes)
    return entry, buf


def plan_item(tree: Any, *, copy: bool = False) -> ItemPlan:
    """Bring a tree to the host and lay it out: skeleton, entries, byte views and offsets."""
    skel, named = skeleton(tree)
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    # start every device-to-host transfer before waiting on any of them (on a CPU backend
    # the arrays already are host memory: nothing to start, and the calls cost ~4 µs each)
    if _on_accelerator(named):
        for _, leaf in named:
            start = getattr(leaf, "copy_to_host_async", None)
            if start is not None and not _is_key(leaf):
                try:
                    start()
                except Exception:
                    pass
    offset = 0
    for names, leaf in named:
        was_np_scalar = isinstance(leaf, np.generic)
        host = to_host(leaf, copy=copy, path=path_str(names))
        entry, buf = plan_leaf(names, host)
        if was_np_scalar:
            entry["scalar"] = True
        if buf is not None:
            offset = _align(offset)
            entry["offset"] = offset
            offset += buf.nbytes
        entries.append(entry)
        buffers.append(buf)
    return ItemPlan(skel, entries, buffers, offset)


def _on_accelerator(named: Sequence[tuple[Names, Any]]) -> bool:
    """Whether leaves may live off the host: some leaf is a jax.Array and JAX's default
    backend is not the CPU (asked only then, so a numpy-only save never starts JAX)."""
    import jax

    if not any(isinstance(leaf, jax.Array) for _, leaf in named):
        return False
    return jax.default_backend() != "cpu"


def _is_key(x: Any) -> bool:
    from .tree import is_prng_key

    return is_prng_key(x)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------
@dataclass
class ItemWriteResult:
    """What writing one item produced, for the checkpoint metadata and for timings."""

    manifest_crc32: int
    data_bytes: int
    num_leaves: int
    write_s: float = 0.0
    fsync_s: float = 0.0


def _crc_all(buffers: Sequence[np.ndarray | None]) -> list[int | None]:
    return [None if b is None else crc32(b) for b in buffers]


_ZEROS = memoryview(bytes(ALIGN))  # padding between leaves is always < ALIGN bytes
_JOIN_BELOW = 1 << 20  # items smaller than this go to disk in one write of one buffer
_WRITEBACK_EVERY = 32 << 20  # start the disk on each 32 MiB written (measured: 400 MB
# written and fsynced ~1.6× faster than write-then-fsync on an ext4 virtual disk)


def _data_chunks(plan: ItemPlan) -> Iterable[memoryview | bytes]:
    pos = 0
    for entry, buf in zip(plan.entries, plan.buffers, strict=True):
        if buf is None:
            continue
        pad = entry["offset"] - pos
        if pad:
            yield _ZEROS[:pad]
        if buf.nbytes:
            yield memoryview(buf)
        pos = entry["offset"] + buf.nbytes


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # the same text as json.dumps(...), and
# made once: json.dumps builds a new encoder on every call with non-default separators


def manifest_bytes(skel: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], *,
                   data_file: str | None, data_bytes: int,
                   extra: Mapping[str, Any] | None = None) -> bytes:
    """The manifest as JSON, one leaf per line so that people (and diffs) can read it."""
    head = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "checksum": "crc32",
            "data_file": data_file, "data_bytes": data_bytes, **(extra or {})}
    lines = ["{"]
    lines += [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append(f'"tree": {_COMPACT.encode(skel)},')
    lines.append('"leaves": [')
    lines.append(",\n".join(map(_COMPACT.encode, entries)))
    lines.append("]}")
    return ("\n".join(lines) + "\n").encode()


def write_item(fs: FileSystem, item_dir: str, plan: ItemPlan, *,
               data_file: str = DATA_FILE, manifest_file: str = MANIFEST_FILE,
               fsync: bool = True, extra: Mapping[str, Any] | None = None,
               sync: SyncBatch | None = None) -> ItemWriteResult:
    """Task 1.3 — write one item (data, then manifest) into the existing ``item_dir``.

    Each file is fsynced before it is closed, and then the directory, so that once this
    returns the item survives a power cut. With ``sync`` (a :class:`~minickpt.fs.SyncBatch`)
    the two files and the directory are handed to the batch instead, which the caller
    flushes — together with the rest of the checkpoint — before its commit. Checksums are
    computed while the data is being written (zlib releases the GIL), so for large items
    they cost almost nothing.
    """
    t0 = time.perf_counter()
    fsync_s = 0.0
    has_data = any(b is not None for b in plan.buffers)
    dpath = os.path.join(item_dir, data_file)
    if plan.nbytes >= _CRC_IN_THREAD_BYTES:
        with ThreadPoolExecutor(1, thread_name_prefix="minickpt-crc") as pool:
            crc_future = pool.submit(_crc_all, plan.buffers)
            fsync_s += _write_data(fs, dpath, plan, fsync, sync)
            crcs = crc_future.result()
    else:
        crcs = _crc_all(plan.buffers)
        if plan.nbytes or has_data:
            fsync_s += _write_data(fs, dpath, plan, fsync, sync)
    entries = []
    for entry, crc in zip(plan.entries, crcs, strict=True):
        if crc is not None:
            entry = {**entry, "crc32": crc}
        entries.append(entry)
    raw = manifest_bytes(plan.skeleton, entries, data_file=data_file if has_data else None,
                         data_bytes=plan.nbytes, extra=extra)
    t1 = time.perf_counter()
    fs.write_file(os.path.join(item_dir, manifest_file), [raw], fsync=fsync, batch=sync)
    if sync is not None:
        sync.add_dir(item_dir)
    elif fsync:
        fs.fsync_dir(item_dir)
    fsync_s += time.perf_counter() - t1  # the manifest is tiny: its cost is its fsyncs
    return ItemWriteResult(crc32(raw), plan.nbytes, plan.num_leaves,
                           write_s=time.perf_counter() - t0 - fsync_s, fsync_s=fsync_s)


def _write_data(fs: FileSystem, path: str, plan: ItemPlan, fsync: bool,
                sync: SyncBatch | None = None) -> float:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if plan.nbytes < _JOIN_BELOW:  # many small leaves: one buffer, one write
            fs.write_all(fd, [b"".join(_data_chunks(plan))])
        else:  # large: let the disk start while the rest is still being copied
            fs.write_all(fd, _data_chunks(plan),
                         writeback_every=_WRITEBACK_EVERY if fsync or sync else 0)
        t = time.perf_counter()
        if sync is not None:
            owned, fd = fd, -1  # the batch fsyncs and closes it
            sync.add_file(owned)
        elif fsync:
            fs.fsync(fd)
        return time.perf_counter() - t
    finally:
        if fd >= 0:
            fs.close(fd)


# ---------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------
@dataclass
class Manifest:
    """A validated manifest. ``entries[i]`` describes leaf ``i``; ``by_path`` finds it by name."""

    item_dir: str
    skeleton: dict[str, Any]
    entries: list[dict[str, Any]]
    data_file: str | None
    data_bytes: int
    crc32: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def by_path(self) -> dict[Names, int]:
        return {tuple(e["path"]): i for i, e in enumerate(self.entries)}

    def leaf_bytes(self) -> int:
        return sum(e.get("nbytes", 0) for e in self.entries)


def _corrupt(where: str, reason: str, leaf: str | None = None) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(where, reason, leaf=leaf)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_manifest(fs: FileSystem, item_dir: str, *, expected_crc32: int | None = None,
                  manifest_file: str = MANIFEST_FILE) -> Manifest:
    """Read and validate an item's manifest; any inconsistency is a clear error."""
    path = os.path.join(item_dir, manifest_file)
    try:
        raw = fs.read_file(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError as e:
        raise _corrupt(path, "manifest is missing") from e
    except ValueError as e:
        raise _corrupt(path, str(e)) from e
    crc = crc32(raw)
    if expected_crc32 is not None and crc != expected_crc32:
        raise _corrupt(path, f"manifest checksum {crc:#010x} differs from the one recorded at "
                             f"commit ({expected_crc32:#010x}): it was changed or damaged")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _corrupt(path, f"manifest is not valid JSON ({e})") from e
    return validate_manifest(obj, path, item_dir, crc, fs=fs)


def validate_manifest(obj: Any, path: str, item_dir: str, crc: int = 0, *,
                      fs: FileSystem | None = None) -> Manifest:
    """Check every field of a parsed manifest against the format's rules and the data file."""
    if not isinstance(obj, dict):
        raise _corrupt(path, "manifest is not a JSON object")
    if obj.get("format") != FORMAT_NAME:
        raise FormatVersionError(path, f"not a minickpt manifest (format={obj.get('format')!r})")
    version = obj.get("format_version")
    if not _is_int(version) or version > FORMAT_VERSION or version < 1:
        raise FormatVersionError(path, f"format version {version!r} is not one this minickpt "
                                       f"reads (it reads 1..{FORMAT_VERSION}); upgrade minickpt")
    if obj.get("checksum") not in ("crc32", None):
        raise _corrupt(path, f"unknown checksum algorithm {obj.get('checksum')!r}")
    data_file = obj.get("data_file")
    if data_file is not None and (not isinstance(data_file, str)
                                  or not _DATA_FILE_RE.match(data_file)):
        raise UnsafeCheckpointError(path, f"data file name {data_file!r} is not a plain "
                                          "'data*.bin' name inside the item directory")
    data_bytes = obj.get("data_bytes")
    if not _is_int(data_bytes) or data_bytes < 0:
        raise _corrupt(path, f"data_bytes is {data_bytes!r}")
    skel, entries = obj.get("tree"), obj.get("leaves")
    if not isinstance(skel, dict) or not isinstance(entries, list):
        raise _corrupt(path, "manifest lacks its 'tree' or its 'leaves'")
    _check_skeleton(skel, len(entries), path)

    file_size = None
    if data_file is not None and fs is not None:
        dpath = os.path.join(item_dir, data_file)
        try:
            st = fs.lstat(dpath)
        except FileNotFoundError as e:
            raise _corrupt(dpath, "data file is missing") from e
        import stat as _stat

        if _stat.S_ISLNK(st.st_mode):
            raise UnsafeCheckpointError(dpath, "is a symbolic link; refusing to follow it")
        if not _stat.S_ISREG(st.st_mode):
            raise _corrupt(dpath, "data file is not a regular file")
        file_size = st.st_size
        if file_size != data_bytes:
            raise _corrupt(dpath, f"data file has {file_size} bytes, the manifest says "
                                  f"{data_bytes} (truncated or padded)")
    seen: set[tuple[str, ...]] = set()
    for i, e in enumerate(entries):
        _check_entry(e, i, path, data_file, data_bytes)
        key = tuple(e["path"])
        if key in seen:
            raise _corrupt(path, "two leaves share this path", leaf=path_str(key))
        seen.add(key)
    return Manifest(item_dir, skel, entries, data_file, data_bytes, crc, obj)


def _check_skeleton(skel: dict[str, Any], n_leaves: int, where: str) -> None:
    seen: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict):
            raise _corrupt(where, "tree skeleton is malformed or nested too deep")
        t = node.get("t")
        if t == "leaf":
            i = node.get("i")
            if not _is_int(i) or not 0 <= i < n_leaves:
                raise _corrupt(where, f"tree skeleton names leaf {i!r} of {n_leaves}")
            seen.append(i)
        elif t == "none":
            pass
        elif t in ("dict", "namedtuple", "node"):
            kids = node.get("c")
            if not isinstance(kids, list):
                raise _corrupt(where, "tree skeleton is malformed")
            for kid in kids:
                if not (isinstance(kid, list) and len(kid) == 2):
                    raise _corrupt(where, "tree skeleton is malformed")
                walk(kid[1], depth + 1)
        elif t in ("list", "tuple"):
            kids = node.get("c")
            if not isinstance(kids, list):
                raise _corrupt(where, "tree skeleton is malformed")
            for kid in kids:
                walk(kid, depth + 1)
        else:
            raise _corrupt(where, f"unknown container type {t!r} in tree skeleton")

    walk(skel, 0)
    if sorted(seen) != list(range(n_leaves)):
        raise _corrupt(where, "tree skeleton and leaf list disagree")


def _check_entry(e: Any, i: int, where: str, data_file: str | None, data_bytes: int) -> None:
    if not isinstance(e, dict) or not isinstance(e.get("path"), list) \
            or not all(isinstance(p, str) for p in e["path"]):
        raise _corrupt(where, f"leaf entry {i} is malformed")
    leaf = path_str(e["path"])
    kind = e.get("kind")
    if kind == "value":
        decode_value(e, f"{where} leaf {leaf}")
        return
    if kind not in ("array", "prng_key"):
        if kind == "pickle" or "pickle" in str(kind):
            raise UnsafeCheckpointError(where, "pickled data is never loaded", leaf=leaf)
        raise _corrupt(where, f"unknown leaf kind {kind!r}", leaf=leaf)
    dt = e.get("dtype")
    if dt not in DTYPES:
        if isinstance(dt, str) and ("O" in dt or "object" in dt):
            raise UnsafeCheckpointError(where, f"object dtype {dt!r} is never loaded", leaf=leaf)
        raise _corrupt(where, f"dtype {dt!r} is not one minickpt stores", leaf=leaf)
    shape = e.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(s) and s >= 0 for s in shape)):
        raise _corrupt(where, f"shape {shape!r} is not a list of non-negative ints", leaf=leaf)
    nbytes, offset = e.get("nbytes"), e.get("offset")
    expect = math.prod(shape) * DTYPES[dt].itemsize
    if not _is_int(nbytes) or nbytes != expect:
        raise _corrupt(where, f"nbytes {nbytes!r} does not match shape {shape} of {dt} "
                              f"({expect} bytes)", leaf=leaf)
    if data_file is None:
        raise _corrupt(where, "array leaf but the item has no data file", leaf=leaf)
    if not _is_int(offset) or offset < 0 or offset + nbytes > data_bytes:
        raise _corrupt(where, f"bytes [{offset}, {offset}+{nbytes}) lie outside the "
                              f"{data_bytes}-byte data file", leaf=leaf)
    crc = e.get("crc32")
    if crc is not None and (not _is_int(crc) or not 0 <= crc < 2**32):
        raise _corrupt(where, f"crc32 {crc!r} is not a 32-bit checksum", leaf=leaf)
    if kind == "prng_key" and not isinstance(e.get("impl"), str):
        raise _corrupt(where, "PRNG key leaf without an impl name", leaf=leaf)


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    numpy aligns large buffers to 16 bytes only; XLA's CPU client takes a host buffer
    aligned to 64 *without copying it* (``jax.device_put`` then aliases it), so a restore
    into jax arrays on a CPU backend costs one read, not a read and a copy — and needs the
    state's size in memory once, not twice.
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dt)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes].view(dt).reshape(shape)


_ALIGN_FROM = 16 << 10  # below this a copy costs less than the bookkeeping


def read_leaves(fs: FileSystem, manifest: Manifest, indices: Sequence[int] | None = None, *,
                verify: bool = True) -> list[Any]:
    """Task 1.3 (read) — the host values of the chosen leaves (all by default).

    Arrays come back as numpy arrays of their saved dtype, keys as :class:`HostKey`, values
    as Python objects. With ``verify`` every array's CRC-32 is checked; a mismatch raises
    :class:`CheckpointCorruptedError` naming the data file and the leaf.
    """
    idx = list(range(len(manifest.entries))) if indices is None else list(indices)
    out: list[Any] = [None] * len(idx)
    arrays: list[tuple[int, dict[str, Any], np.ndarray]] = []
    for k, i in enumerate(idx):
        e = manifest.entries[i]
        if e["kind"] == "value":
            out[k] = decode_value(e, manifest.item_dir)
            continue
        arr = aligned_empty(e["shape"], DTYPES[e["dtype"]])
        arrays.append((k, e, arr))
    if arrays:
        assert manifest.data_file is not None
        dpath = os.path.join(manifest.item_dir, manifest.data_file)
        fd = fs.open_read(dpath)
        try:
            if verify and sum(e["nbytes"] for _, e, _ in arrays) >= _CRC_IN_THREAD_BYTES:
                _read_and_verify(fs, fd, arrays, dpath)
            else:
                _read_arrays(fs, fd, arrays, dpath)
                if verify:
                    for a in arrays:
                        _check_crc(a, dpath)
        finally:
            fs.close(fd)
    for k, e, arr in arrays:
        if e["kind"] == "prng_key":
            out[k] = HostKey(arr, e["impl"])
        elif e.get("scalar"):
            out[k] = arr[()]
        else:
            out[k] = arr
    return out


def _read_batches(arrays: list[tuple[int, dict[str, Any], np.ndarray]]
                  ) -> list[tuple[int, list[memoryview], list[Any]]]:
    """Leaves in file order, grouped into reads: ``(file offset, buffers, leaves)`` each.

    Neighbouring leaves share one preadv call (small gaps are read into scratch buffers);
    a read holds at most 256 leaves and ``_READ_BATCH_BYTES`` bytes, so that checksums can
    be verified — and other reads run — while the next ones are in flight."""
    order = sorted(arrays, key=lambda t: t[1]["offset"])
    batches: list[tuple[int, list[memoryview], list[Any]]] = []
    bufs: list[memoryview] = []
    items: list[Any] = []
    start = pos = nbytes = 0
    for item in order:
        _, e, arr = item
        if e["nbytes"] == 0:
            continue
        view = memoryview(arr.reshape(-1).view(np.uint8))
        gap = e["offset"] - pos
        if not bufs or gap < 0 or gap > 4096 or len(bufs) >= 256 or \
                nbytes + len(view) > _READ_BATCH_BYTES:
            if bufs:
                batches.append((start, bufs, items))
            bufs, items, nbytes, start = [], [], 0, e["offset"]
        elif gap:
            bufs.append(memoryview(bytearray(gap)))
        bufs.append(view)
        items.append(item)
        nbytes += len(view)
        pos = e["offset"] + e["nbytes"]
    if bufs:
        batches.append((start, bufs, items))
    return batches


_READ_BATCH_BYTES = 16 << 20


def _read_batch(fs: FileSystem, fd: int, batch: tuple[int, list[memoryview], list[Any]],
                where: str) -> None:
    start, bufs, _ = batch
    try:
        fs.read_into_many(fd, bufs, start)
    except EOFError as e:
        raise _corrupt(where, f"data file ended early ({e})") from e


def _read_arrays(fs: FileSystem, fd: int, arrays: list[tuple[int, dict[str, Any], np.ndarray]],
                 where: str) -> None:
    """Read leaves in file order; neighbouring leaves are read with one preadv call."""
    for batch in _read_batches(arrays):
        _read_batch(fs, fd, batch, where)


def _check_crc(item: tuple[int, dict[str, Any], np.ndarray], where: str) -> None:
    _, e, arr = item
    if "crc32" not in e:
        return
    got = crc32(arr.reshape(-1).view(np.uint8))
    if got != e["crc32"]:
        raise _corrupt(where, f"checksum mismatch (stored {e['crc32']:#010x}, "
                              f"read {got:#010x}): the bytes were damaged",
                       leaf=path_str(e["path"]))


def _read_and_verify(fs: FileSystem, fd: int,
                     arrays: list[tuple[int, dict[str, Any], np.ndarray]], where: str) -> None:
    """Large items: the file is cut into a few contiguous parts, read by as many threads,
    each through its own descriptor (so each keeps its own sequential read-ahead) and each
    checking the checksums of what it just read. Copying out of the page cache and
    checksumming then use several cores, and a cold file is still read sequentially. The
    first damage in file order is the one reported. ``where`` is the data file's path."""
    batches = _read_batches(arrays)
    n = max(1, min(_READ_THREADS, os.cpu_count() or 1, len(batches)))
    size = (len(batches) + n - 1) // n
    parts = [batches[i * size:(i + 1) * size] for i in range(n)]

    def run(part: list[tuple[int, list[memoryview], list[Any]]], own_fd: bool) -> None:
        f = fs.open_read(where) if own_fd else fd
        try:
            for batch in part:
                _read_batch(fs, f, batch, where)
                for item in batch[2]:
                    _check_crc(item, where)
        finally:
            if own_fd:
                fs.close(f)

    if n == 1:
        run(batches, False)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="minickpt-read") as pool:
        futures = [pool.submit(run, part, i > 0) for i, part in enumerate(parts) if part]
        for f in futures:  # in file order: the first damage is the one raised
            f.result()


_READ_THREADS = 4
