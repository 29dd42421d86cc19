"""The on-disk format of one item: a data file and a JSON manifest. No pickle, ever.

An item is a pytree saved in its own directory::

    params/
      data.bin        every array's raw little-endian bytes, each starting on a 64-byte boundary
      manifest.json   format version, the tree's container skeleton, and one line per leaf:
                      key path, kind, dtype, shape, byte offset, byte length, CRC-32
      data.p<i>.bin, manifest.p<i>.json
                      only when several processes saved it (format 2): the shards process
                      i wrote, see "sharded leaves" below

Reading trusts nothing: every field of the manifest is checked (types, dtype names against an
allow-list, sizes against the data file) before a single byte is allocated, files are opened
without following symlinks, and every leaf's checksum is verified unless asked not to.

:func:`plan_item` and :func:`write_item` are separate so that the synchronous save, the
background writer and the per-process shard writer share them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from .errors import (
    CheckpointCorruptedError,
    CheckpointTooLargeError,
    FormatVersionError,
    UnsafeCheckpointError,
    UnsupportedLeafError,
)
from .fs import FileSystem, SyncBatch
from .tree import (
    MAX_DEPTH,
    HostKey,
    Names,
    is_prng_key,
    path_str,
    skeleton,
    snapshot_leaf,
    to_host,
)

FORMAT_NAME = "minickpt"
FORMAT_VERSION = 1  # what an item without sharded leaves is written as (every single-host save)
SHARDED_FORMAT_VERSION = 2  # an item with leaves written in shards by several processes
MAX_FORMAT_VERSION = SHARDED_FORMAT_VERSION  # the newest version this minickpt reads
SHARD_MANIFEST_FORMAT = "minickpt-shards"
MANIFEST_FILE = "manifest.json"
DATA_FILE = "data.bin"
ALIGN = 64
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
_CRC_IN_THREAD_BYTES = 8 << 20  # below this, threads cost more than they save
_HOST_IN_THREAD_BYTES = 1 << 20

try:  # ISA-L computes the very same CRC-32 as zlib, ~4× faster (carry-less multiply)
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - isal is an optional extra ("minickpt[fast]")
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
"""The manifest's checksum of a buffer: CRC-32 as zlib computes it (whichever library does)."""
CRC_IMPL = "isal" if _isal_crc32 is not None else "zlib"

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_DATA_FILE_RE = re.compile(r"^data(\.[A-Za-z0-9_\-]{1,64})?\.bin$")
_SHARD_MANIFEST_RE = re.compile(r"^manifest\.p(\d{1,7})\.json$")


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
    except (TypeError, ValueError, OverflowError):  # 0x1p99999 overflows a float
        pass
    raise CheckpointCorruptedError(where, f"value leaf of type {t!r} holds {str(v)[:100]!r}")


def plan_leaf(names: Names, host: Any) -> tuple[dict[str, Any], np.ndarray | None]:
    """Task 1.3 (write) — one host leaf's manifest entry, and its bytes.

    An array (or a :class:`HostKey`'s raw data) is described by its kind, dtype name, shape
    and byte count, and its bytes come back as a 1-D ``uint8`` view in little-endian order;
    a Python scalar or string is stored in the entry itself (no bytes: ``None``). Where the
    bytes go (the offset) and their checksum are added by :func:`plan_item` and
    :func:`write_item`.
    """
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


def plan_item(tree: Any, *, copy: bool = False, executor: Executor | None = None,
              pin: bool = False) -> ItemPlan:
    """Bring a tree to the host and lay it out: skeleton, entries, byte views and offsets.

    With an ``executor``, large leaves are brought over (and copied, with ``copy=True``) in its
    threads: numpy copies release the GIL, so an async save's snapshot uses several cores.
    ``pin=True`` lets a pinned zero-copy view of a CPU array stand in for its copy
    (:func:`minickpt.tree.pinned_view`).
    """
    skel, named = skeleton(tree)
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    # start every device-to-host transfer before waiting on any of them (on a CPU backend
    # the arrays already are host memory: nothing to start, and the calls cost ~4 µs each)
    if _on_accelerator(named):
        for _, leaf in named:
            start = getattr(leaf, "copy_to_host_async", None)
            if start is not None and not is_prng_key(leaf):
                try:
                    start()
                except Exception:
                    pass
    futures: dict[int, Future[Any]] = {}
    if executor is not None:
        try:
            for i, (names, leaf) in enumerate(named):
                if getattr(leaf, "nbytes", 0) >= _HOST_IN_THREAD_BYTES:
                    futures[i] = executor.submit(_host, leaf, copy, pin, path_str(names))
        except RuntimeError:  # the executor is shut down (interpreter exit): do it here
            pass
    offset = 0
    for i, (names, leaf) in enumerate(named):
        was_np_scalar = isinstance(leaf, np.generic)
        fut = futures.get(i)
        host = fut.result() if fut is not None else _host(leaf, copy, pin, path_str(names))
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


def _host(leaf: Any, copy: bool, pin: bool, path: str) -> Any:
    if copy and pin:
        return snapshot_leaf(leaf, path=path, pin=True)
    return to_host(leaf, copy=copy, path=path)


def _on_accelerator(named: Sequence[tuple[Names, Any]]) -> bool:
    """Whether leaves may live off the host: some leaf is a jax.Array and JAX's default
    backend is not the CPU (asked only then, so a numpy-only save never starts JAX)."""
    import jax

    if not any(isinstance(leaf, jax.Array) for _, leaf in named):
        return False
    return jax.default_backend() != "cpu"


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
    return _json_doc(head, [f'"tree": {_COMPACT.encode(skel)},'], "leaves", entries)


def _json_doc(head: Mapping[str, Any], middle: Sequence[str], key: str,
              entries: Sequence[Mapping[str, Any]]) -> bytes:
    """A manifest's text: one line per field of ``head``, the ``middle`` lines, then the list
    ``key`` of ``entries``, one per line."""
    lines = ["{", *(f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()), *middle,
             f'"{key}": [', ",\n".join(map(_COMPACT.encode, entries)), "]}"]
    return ("\n".join(lines) + "\n").encode()


def _write_manifest_file(fs: FileSystem, item_dir: str, name: str, raw: bytes, fsync: bool,
                         sync: SyncBatch | None) -> float:
    """Write a manifest, then fsync it and the directory (or hand both to ``sync``);
    return the seconds it took (a tiny file: its cost is its fsyncs)."""
    t = time.perf_counter()
    fs.write_file(os.path.join(item_dir, name), [raw], fsync=fsync, batch=sync)
    if sync is not None:
        sync.add_dir(item_dir)
    elif fsync:
        fs.fsync_dir(item_dir)
    return time.perf_counter() - t


def write_item(fs: FileSystem, item_dir: str, plan: ItemPlan, *,
               data_file: str = DATA_FILE, manifest_file: str = MANIFEST_FILE,
               fsync: bool = True, extra: Mapping[str, Any] | None = None,
               sync: SyncBatch | None = None) -> ItemWriteResult:
    """Write one item (data, then manifest) into the existing ``item_dir``.

    Each file is fsynced before it is closed, and then the directory, so that once this
    returns the item survives a power cut. With ``sync`` (a :class:`~minickpt.fs.SyncBatch`)
    the two files and the directory are handed to the batch instead, which the caller
    flushes — together with the rest of the checkpoint — before its commit. Checksums are
    computed while the data is being written (the CRC releases the GIL), so for large items
    they cost almost nothing.
    """
    data = write_item_data(fs, item_dir, plan, data_file=data_file, fsync=fsync, sync=sync)
    return write_item_manifest(fs, item_dir, plan, data, manifest_file=manifest_file,
                               fsync=fsync, extra=extra, sync=sync)


@dataclass
class ItemData:
    """What :func:`write_item_data` wrote: the entries (with checksums) and its timings."""

    entries: list[dict[str, Any]]
    data_file: str | None
    data_bytes: int
    write_s: float = 0.0
    fsync_s: float = 0.0


def write_item_data(fs: FileSystem, item_dir: str, plan: ItemPlan, *,
                    data_file: str = DATA_FILE, fsync: bool = True,
                    sync: SyncBatch | None = None) -> ItemData:
    """The first half of :func:`write_item`: the data file, fsynced (or handed to ``sync``),
    and the leaf checksums.

    A multi-host save writes its data before the barrier and its manifest after it (the
    manifest then lists the other processes' shard files), hence two halves.
    """
    t0 = time.perf_counter()
    fsync_s = 0.0
    has_data = any(b is not None for b in plan.buffers)
    dpath = os.path.join(item_dir, data_file)
    crc_future = _crc_in_thread(plan) if plan.nbytes >= _CRC_IN_THREAD_BYTES else None
    if crc_future is not None:
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
    return ItemData(entries, data_file if has_data else None, plan.nbytes,
                    write_s=time.perf_counter() - t0 - fsync_s, fsync_s=fsync_s)


def write_item_manifest(fs: FileSystem, item_dir: str, plan: ItemPlan, data: ItemData, *,
                        manifest_file: str = MANIFEST_FILE, fsync: bool = True,
                        extra: Mapping[str, Any] | None = None,
                        sync: SyncBatch | None = None) -> ItemWriteResult:
    """The second half of :func:`write_item`: the manifest, fsynced, then the directory
    (or both handed to ``sync``)."""
    raw = manifest_bytes(plan.skeleton, data.entries, data_file=data.data_file,
                         data_bytes=data.data_bytes, extra=extra)
    fsync_s = data.fsync_s + _write_manifest_file(fs, item_dir, manifest_file, raw, fsync, sync)
    return ItemWriteResult(crc32(raw), data.data_bytes, plan.num_leaves,
                           write_s=data.write_s, fsync_s=fsync_s)


def _crc_in_thread(plan: ItemPlan) -> Future[list[int | None]] | None:
    """Start the checksums in a thread, or return None where no new work may be scheduled.

    A background save still writing while the interpreter exits runs after
    ``concurrent.futures`` has stopped accepting work; it then computes checksums inline.
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix="minickpt-crc")
    try:
        return pool.submit(_crc_all, plan.buffers)
    except RuntimeError:
        return None
    finally:
        pool.shutdown(wait=False)  # the submitted task still runs to completion


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
    # sharded leaves (format 2): leaf index -> its shards, from the per-process manifests
    shards: dict[int, list[ShardRef]] = field(default_factory=dict)

    @property
    def by_path(self) -> dict[Names, int]:
        return {tuple(e["path"]): i for i, e in enumerate(self.entries)}

    def leaf_bytes(self) -> int:
        return sum(e.get("nbytes", 0) for e in self.entries)

    @property
    def stored_bytes(self) -> int:
        """Bytes in the item's data files, the shard files of a multi-host save included."""
        files = self.raw.get("shard_files") or []
        return self.data_bytes + sum(int(f.get("data_bytes", 0)) for f in files
                                     if isinstance(f, dict))


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
    obj = parse_json(raw, path, "manifest")
    return validate_manifest(obj, path, item_dir, crc, fs=fs)


def parse_json(raw: bytes, path: str, what: str) -> Any:
    """Parse a manifest or metadata file; every way it can be malformed is a clear error.

    Nesting deeper than the interpreter's recursion limit raises RecursionError inside the
    parser (never a crash), and integers too long to convert raise ValueError: both, like
    bad UTF-8 or bad syntax, become :class:`CheckpointCorruptedError`.
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"{what} is not valid JSON ({type(e).__name__}: "
                             f"{str(e)[:200]})") from e


def _leaf_list(entries: Sequence[Mapping[str, Any]]) -> str:
    names = list(dict.fromkeys(path_str(e["path"]) for e in entries))  # shards: once a leaf
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def validate_manifest(obj: Any, path: str, item_dir: str, crc: int = 0, *,
                      fs: FileSystem | None = None) -> Manifest:
    """Check every field of a parsed manifest against the format's rules and the data file."""
    if not isinstance(obj, dict):
        raise _corrupt(path, "manifest is not a JSON object")
    if obj.get("format") != FORMAT_NAME:
        raise FormatVersionError(path, f"not a minickpt manifest (format={obj.get('format')!r})")
    version = obj.get("format_version")
    if not _is_int(version) or version > MAX_FORMAT_VERSION or version < 1:
        raise FormatVersionError(path, f"format version {version!r} is not one this minickpt "
                                       f"reads (it reads 1..{MAX_FORMAT_VERSION}); upgrade "
                                       "minickpt")
    if obj.get("checksum") not in ("crc32", None):
        raise _corrupt(path, f"unknown checksum algorithm {obj.get('checksum')!r}")
    data_file = obj.get("data_file")
    _check_data_file_name(data_file, path)
    data_bytes = obj.get("data_bytes")
    if not _is_int(data_bytes) or data_bytes < 0:
        raise _corrupt(path, f"data_bytes is {data_bytes!r}")
    skel, entries = obj.get("tree"), obj.get("leaves")
    if not isinstance(skel, dict) or not isinstance(entries, list):
        raise _corrupt(path, "manifest lacks its 'tree' or its 'leaves'")
    seen: set[tuple[str, ...]] = set()
    for i, e in enumerate(entries):
        _check_entry(e, i, path, data_file, data_bytes)
        key = tuple(e["path"])
        if key in seen:
            raise _corrupt(path, "two leaves share this path", leaf=path_str(key))
        seen.add(key)
    _check_skeleton(skel, entries, path)
    # leaves written whole lie in the item's own data file; sharded leaves (format 2) lie in
    # the per-process shard files, checked by _load_shards
    whole = [e for e in entries if e["kind"] != "value" and not e.get("sharded")]
    arrays = sorted((e for e in whole if e["nbytes"]), key=lambda e: e["offset"])
    for a, b in itertools.pairwise(arrays):
        if b["offset"] < a["offset"] + a["nbytes"]:
            raise _corrupt(path, f"leaf {path_str(b['path'])} starts at byte {b['offset']}, "
                                 f"inside leaf {path_str(a['path'])}: leaves never overlap",
                           leaf=path_str(b["path"]))
    if data_file is not None and fs is not None:
        _check_data_file(fs, os.path.join(item_dir, data_file), data_bytes, whole)
    m = Manifest(item_dir, skel, entries, data_file, data_bytes, crc, obj)
    sharded = [i for i, e in enumerate(entries) if e.get("sharded")]
    if "shard_files" in obj or sharded:
        if version < SHARDED_FORMAT_VERSION:
            raise _corrupt(path, f"sharded leaves in a format {version} manifest")
        if fs is not None:
            m.shards = _load_shards(fs, m, path, obj.get("shard_files"), sharded)
    return m


def _check_data_file(fs: FileSystem, dpath: str, data_bytes: int,
                     arrays: Sequence[Mapping[str, Any]]) -> None:
    """The data file must be a regular file of exactly the manifest's size; if it is not,
    the error names the leaves it costs."""
    first = path_str(arrays[0]["path"]) if arrays else None
    try:
        st = fs.lstat(dpath)
    except FileNotFoundError as e:
        raise _corrupt(dpath, f"data file is missing (it holds {_leaf_list(arrays)})",
                       leaf=first) from e
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCheckpointError(dpath, "is a symbolic link; refusing to follow it",
                                    leaf=first)
    if not stat.S_ISREG(st.st_mode):
        raise _corrupt(dpath, f"data file is not a regular file (it should hold "
                              f"{_leaf_list(arrays)})", leaf=first)
    if st.st_size < data_bytes:
        lost = [e for e in arrays if e["offset"] + e["nbytes"] > st.st_size]
        raise _corrupt(dpath, f"data file has {st.st_size} bytes, the manifest says "
                              f"{data_bytes}: truncated, losing {_leaf_list(lost)}",
                       leaf=path_str(lost[0]["path"]) if lost else first)
    if st.st_size > data_bytes:
        raise _corrupt(dpath, f"data file has {st.st_size} bytes, the manifest says "
                              f"{data_bytes}: something was appended to it")


def _check_skeleton(skel: dict[str, Any], entries: Sequence[Mapping[str, Any]],
                    where: str) -> None:
    """The skeleton must name each leaf exactly once, by the same key path as its entry.

    (Restoring without a target follows the skeleton, with one by the entries' paths: a
    manifest where the two disagree would give different trees depending on how it is read.)
    """
    n_leaves = len(entries)
    seen: list[int] = []

    def walk(node: Any, depth: int, names: tuple[str, ...]) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict):
            raise _corrupt(where, "tree skeleton is malformed or nested too deep")
        t = node.get("t")
        if t == "leaf":
            i = node.get("i")
            if not _is_int(i) or not 0 <= i < n_leaves:
                raise _corrupt(where, f"tree skeleton names leaf {i!r} of {n_leaves}")
            if tuple(entries[i]["path"]) != names:
                raise _corrupt(where, f"tree skeleton puts leaf {path_str(entries[i]['path'])} "
                                      f"at {path_str(names)}",
                               leaf=path_str(entries[i]["path"]))
            seen.append(i)
        elif t == "none":
            pass
        elif t in ("dict", "namedtuple", "node"):
            kids = node.get("c")
            if not isinstance(kids, list):
                raise _corrupt(where, "tree skeleton is malformed")
            keys = set()
            for kid in kids:
                if not (isinstance(kid, list) and len(kid) == 2):
                    raise _corrupt(where, "tree skeleton is malformed")
                k = kid[0]
                if not (isinstance(k, str) or (_is_int(k) and t == "dict")) or k in keys:
                    raise _corrupt(where, f"tree skeleton has a bad or repeated key {k!r}")
                keys.add(k)
                walk(kid[1], depth + 1, (*names, str(k)))
        elif t in ("list", "tuple"):
            kids = node.get("c")
            if not isinstance(kids, list):
                raise _corrupt(where, "tree skeleton is malformed")
            for n, kid in enumerate(kids):
                walk(kid, depth + 1, (*names, str(n)))
        else:
            raise _corrupt(where, f"unknown container type {t!r} in tree skeleton")

    walk(skel, 0, ())
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
    if kind == "prng_key":
        impl = e.get("impl")
        key_shape = key_data_shape(impl) if isinstance(impl, str) else None
        if key_shape is None:
            raise _corrupt(where, f"PRNG key leaf with unknown implementation {impl!r}",
                           leaf=leaf)
        if tuple(shape[len(shape) - len(key_shape):]) != key_shape:
            raise _corrupt(where, f"PRNG key data of shape {shape} does not end with the "
                                  f"{impl} key shape {list(key_shape)}", leaf=leaf)
    if "sharded" in e:
        if e["sharded"] is not True or "offset" in e:
            raise _corrupt(where, "malformed sharded leaf entry", leaf=leaf)
        return  # its bytes are described by the per-process shard manifests
    if data_file is None:
        raise _corrupt(where, "array leaf but the item has no data file", leaf=leaf)
    if not _is_int(offset) or offset < 0 or offset + nbytes > data_bytes:
        raise _corrupt(where, f"bytes [{offset}, {offset}+{nbytes}) lie outside the "
                              f"{data_bytes}-byte data file", leaf=leaf)
    _check_crc_field(e.get("crc32"), where, leaf)


def _check_crc_field(crc: Any, where: str, leaf: str) -> None:
    if crc is not None and (not _is_int(crc) or not 0 <= crc < 2**32):
        raise _corrupt(where, f"crc32 {crc!r} is not a 32-bit checksum", leaf=leaf)


def _check_data_file_name(name: Any, where: str) -> None:
    """A data file (None: no data) must be a plain ``data*.bin`` name in the item directory."""
    if name is not None and (not isinstance(name, str) or not _DATA_FILE_RE.match(name)):
        raise UnsafeCheckpointError(where, f"data file name {name!r} is not a plain "
                                           "'data*.bin' name inside the item directory")


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
    """The host values of the chosen leaves (all by default), each decoded by
    :func:`decode_leaf`: arrays of their saved dtype, keys as :class:`HostKey`, values as
    Python objects. With ``verify`` every array's CRC-32 is checked; a mismatch raises
    :class:`CheckpointCorruptedError` naming the data file and the leaf.
    """
    idx = list(range(len(manifest.entries))) if indices is None else list(indices)
    _check_fits_in_memory(sum(manifest.entries[i].get("nbytes", 0) for i in idx),
                          f"from {manifest.item_dir}", " (restore fewer leaves with a partial "
                          "target, or use a bigger machine)")
    out: list[Any] = [None] * len(idx)
    arrays: list[tuple[int, dict[str, Any], np.ndarray]] = []
    for k, i in enumerate(idx):
        e = manifest.entries[i]
        if e["kind"] == "value":
            out[k] = decode_leaf(e, None, where=manifest.item_dir)
            continue
        if e.get("sharded"):
            full = tuple((0, n) for n in e["shape"])
            out[k] = _finish_leaf(e, read_region(fs, manifest, i, full, verify=verify))
            continue
        # raw bytes, 64-byte aligned (so a CPU device_put can alias them); decoded below by
        # task 1.3's decode_leaf, so a student's version runs in every restore
        arrays.append((k, e, aligned_empty((e["nbytes"],), np.uint8)))
    if not arrays:
        return out
    assert manifest.data_file is not None
    dpath = os.path.join(manifest.item_dir, manifest.data_file)
    # a large item is read by several threads that check checksums as they go
    big = verify and sum(e["nbytes"] for _, e, _ in arrays) >= _CRC_IN_THREAD_BYTES
    fd = fs.open_read(dpath)
    try:
        if big:
            _read_and_verify(fs, fd, arrays, dpath)
        else:
            _read_arrays(fs, fd, arrays, dpath)
    finally:
        fs.close(fd)
    for k, e, raw in arrays:
        out[k] = decode_leaf(e, raw, verify=verify and not big, where=dpath)
    return out


def decode_leaf(entry: Mapping[str, Any], raw: np.ndarray | None, *, verify: bool = True,
                where: str = "<data>") -> Any:
    """Task 1.3 (read) — one leaf's value from its manifest entry and its bytes.

    ``raw`` holds the leaf's ``entry["nbytes"]`` bytes from the data file as a 1-D ``uint8``
    array (``None`` for a value leaf: its value is in the entry). With ``verify``, bytes whose
    CRC-32 differs from the entry's raise :class:`CheckpointCorruptedError` naming ``where``
    and the leaf. An array comes back as a numpy array of the saved dtype and shape (a view
    of ``raw``, or a numpy scalar if it was saved from one), a key as :class:`HostKey`.
    """
    if entry["kind"] == "value":
        return decode_value(entry, where)
    if verify and "crc32" in entry:
        got = zlib.crc32(raw)
        if got != entry["crc32"]:
            raise CheckpointCorruptedError(
                where, f"checksum mismatch (stored {entry['crc32']:#010x}, read {got:#010x}): "
                       "the bytes were damaged", leaf=path_str(entry["path"]))
    arr = raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
    if entry["kind"] == "prng_key":
        return HostKey(arr, entry["impl"])
    return arr[()] if entry.get("scalar") else arr


def _finish_leaf(e: Mapping[str, Any], arr: np.ndarray) -> Any:
    """A region read (already of the leaf's dtype and shape) as the leaf's host value."""
    if e["kind"] == "prng_key":
        return HostKey(arr, e["impl"])
    if e.get("scalar"):
        return arr[()]
    return arr


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say).

    Asked once per process: on Linux it is a ``sysinfo`` system call on every restore
    otherwise, for a number that does not change while the process runs.
    """
    if "bytes" not in _HOST_MEMORY:
        try:
            _HOST_MEMORY["bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            _HOST_MEMORY["bytes"] = None
    return _HOST_MEMORY["bytes"]


_HOST_MEMORY: dict[str, int | None] = {}


def _check_fits_in_memory(need: int, what: str, advice: str = "") -> None:
    """Refuse, before allocating, to read ``need`` bytes (``what``: which ones) that exceed
    this machine's memory."""
    limit = host_memory_bytes()
    if limit is not None and need > limit:
        raise CheckpointTooLargeError(
            f"reading {need} bytes {what} would need more than the {limit} bytes of memory "
            f"this machine has; refusing before allocating{advice}")


_KEY_SHAPES: dict[str, tuple[int, ...] | None] = {}
_IMPL_RE = re.compile(r"^[a-z0-9_]{1,64}$")


def key_data_shape(impl: str) -> tuple[int, ...] | None:
    """The trailing data shape of a PRNG key implementation JAX knows (None if unknown).

    Only plain lower-case names reach JAX, and JAX only looks them up in its registry.
    """
    if not _IMPL_RE.match(impl):
        return None
    if impl not in _KEY_SHAPES:
        import jax

        try:
            from .tree import canonical_impl

            name = canonical_impl(impl)  # JAX 0.4.30 wrote "fry" for threefry2x32
            _KEY_SHAPES[impl] = tuple(jax.eval_shape(
                lambda: jax.random.key_data(jax.random.key(0, impl=name))).shape)
        except (ValueError, TypeError, KeyError):
            _KEY_SHAPES[impl] = None
    return _KEY_SHAPES[impl]


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


# ---------------------------------------------------------------------------------------
# sharded leaves (format 2): one leaf written in pieces by several processes
# ---------------------------------------------------------------------------------------
# A multi-process save writes an array that no single process holds as *shards*: each
# process p writes the shards it owns into ``data.p<p>.bin`` and lists them (global index
# box, offset, length, CRC-32) in ``manifest.p<p>.json``. The primary's ``manifest.json``
# describes the whole leaf (global shape and dtype, ``"sharded": true``) and records every
# per-process manifest with its checksum, so one checksum in ``_CHECKPOINT_METADATA`` still
# pins down every byte of the item. A reader checks that the shards of every leaf cover it
# exactly once before it reads anything.
Box = tuple[tuple[int, int], ...]  # per axis [start, stop) in global coordinates

_RUN_DIRECT_BYTES = 64 << 10  # contiguous runs at least this long are read one by one
_SLAB_CHUNK_BYTES = 8 << 20  # otherwise whole rows are read in chunks this big and sliced


def box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A shard's index (a tuple of slices, as in ``Shard.index``) as ``((start, stop), ...)``."""
    if len(index) != len(shape):
        raise ValueError(f"index {index!r} does not match shape {tuple(shape)}")
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index!r} is not supported")
        out.append((start, max(start, stop)))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Slices selecting ``box`` inside an array whose element 0 sits at ``origin``'s start."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they share no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def coverage_problems(shape: Sequence[int], boxes: Sequence[Box], *,
                      max_cells: int = 10_000_000) -> list[str]:
    """Why ``boxes`` do not cover an array of ``shape`` exactly once (empty list if they do).

    Pure. The boxes' edges cut the array into a grid of cells; every cell must be covered by
    exactly one box. For the grid-shaped shardings JAX produces, the grid has one cell per
    shard, so this is cheap even for thousands of shards.
    """
    shape = tuple(int(n) for n in shape)
    problems = []
    good: list[Box] = []
    for b in boxes:
        if len(b) != len(shape) or any(not (0 <= lo <= hi <= n) for (lo, hi), n
                                       in zip(b, shape, strict=False)):
            problems.append(f"shard {list(map(list, b))} lies outside shape {list(shape)}")
        else:
            good.append(b)
    if problems or math.prod(shape) == 0:
        return problems
    cuts = [sorted({0, n, *(b[d][0] for b in good), *(b[d][1] for b in good)})
            for d, n in enumerate(shape)]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > max_cells:
        return [f"{len(good)} shards cut the array into {math.prod(grid)} cells: too "
                "irregular to check"]
    count = np.zeros(grid, np.int32)
    for b in good:
        count[tuple(slice(c.index(lo), c.index(hi)) for c, (lo, hi) in
                    zip(cuts, b, strict=True))] += 1
    sizes = np.ones(grid, np.int64)
    for d, c in enumerate(cuts):
        shape_d = [1] * len(grid)
        shape_d[d] = grid[d]
        sizes = sizes * np.diff(np.asarray(c, np.int64)).reshape(shape_d)
    for bad, what in ((count == 0, "not covered by any shard"),
                      (count > 1, "covered by more than one shard")):
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            region = [[cuts[d][i], cuts[d][i + 1]] for d, i in enumerate(first)]
            problems.append(f"{int(sizes[bad].sum())} element(s) {what} (e.g. {region})")
    return problems


@dataclass(frozen=True)
class ShardRef:
    """Where one shard of a sharded leaf lies on disk (read from a per-process manifest)."""

    leaf: int
    box: Box
    process: int
    data_file: str
    offset: int
    nbytes: int
    crc32: int | None


@dataclass
class ShardFile:
    """What one process wrote for one item: recorded in the primary's manifest."""

    process: int
    manifest: str
    manifest_crc32: int
    data_file: str | None
    data_bytes: int
    num_shards: int
    write_s: float = 0.0
    fsync_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"process": self.process, "manifest": self.manifest,
                "manifest_crc32": self.manifest_crc32, "data_file": self.data_file,
                "data_bytes": self.data_bytes, "num_shards": self.num_shards}


def shard_manifest_name(process: int) -> str:
    return f"manifest.p{process}.json"


def shard_data_name(process: int) -> str:
    return f"data.p{process}.bin"


def sharded_entry(names: Names, kind: str, dtype: np.dtype, shape: Sequence[int],
                  impl: str | None = None) -> dict[str, Any]:
    """The primary manifest's entry of a sharded leaf: global shape and dtype, no bytes."""
    dt = np.dtype(dtype)
    entry: dict[str, Any] = {"path": list(names), "kind": kind, "dtype": dtype_name(dt),
                             "shape": [int(n) for n in shape]}
    if impl is not None:
        entry["impl"] = impl
    entry["nbytes"] = math.prod(entry["shape"]) * dt.itemsize
    entry["sharded"] = True
    return entry


def plan_shards(shards: Iterable[tuple[int, Names, Box, np.ndarray]]) -> ItemPlan:
    """Lay out one process's shards of one item: ``(leaf index, path, box, host data)``."""
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    offset = 0
    for leaf, names, box, host in shards:
        if tuple(host.shape) != box_shape(box):
            raise ValueError(f"shard of {path_str(names)} has shape {host.shape}, its index "
                             f"{box} says {box_shape(box)}")
        buf = _as_bytes(host)
        offset = _align(offset)
        entries.append({"leaf": leaf, "path": list(names), "index": [list(b) for b in box],
                        "offset": offset, "nbytes": int(buf.nbytes)})
        buffers.append(buf)
        offset += buf.nbytes
    return ItemPlan({}, entries, buffers, offset)


def write_shards(fs: FileSystem, item_dir: str, process: int, plan: ItemPlan, *,
                 fsync: bool = True, sync: SyncBatch | None = None) -> ShardFile | None:
    """Write one process's shards of an item (data, then manifest, both fsynced — or both
    handed to ``sync``, with the directory, for one group commit of the process's files).

    Returns None, writing nothing, when the process owns no shard of this item.
    """
    if not plan.entries:
        return None
    data = write_item_data(fs, item_dir, plan, data_file=shard_data_name(process), fsync=fsync,
                           sync=sync)
    head = {"format": SHARD_MANIFEST_FORMAT, "format_version": SHARDED_FORMAT_VERSION,
            "checksum": "crc32", "process": process, "data_file": data.data_file,
            "data_bytes": data.data_bytes}
    raw = _json_doc(head, [], "shards", data.entries)
    name = shard_manifest_name(process)
    fsync_s = data.fsync_s + _write_manifest_file(fs, item_dir, name, raw, fsync, sync)
    return ShardFile(process, name, crc32(raw), data.data_file, data.data_bytes,
                     len(data.entries), write_s=data.write_s, fsync_s=fsync_s)


def _load_shards(fs: FileSystem, m: Manifest, path: str, records: Any,
                 sharded: list[int]) -> dict[int, list[ShardRef]]:
    """Read and check every per-process manifest an item lists; check the coverage."""
    if not isinstance(records, list):
        raise _corrupt(path, "manifest has sharded leaves but no list of shard files")
    shards: dict[int, list[ShardRef]] = {i: [] for i in sharded}
    seen: set[int] = set()
    for rec in records:
        if not isinstance(rec, dict):
            raise _corrupt(path, f"shard file record {rec!r} is malformed")
        p, name, crc = rec.get("process"), rec.get("manifest"), rec.get("manifest_crc32")
        df, db, n = rec.get("data_file"), rec.get("data_bytes"), rec.get("num_shards")
        mt = _SHARD_MANIFEST_RE.match(name) if isinstance(name, str) else None
        if not _is_int(p) or p < 0 or p in seen or mt is None or int(mt.group(1)) != p:
            raise UnsafeCheckpointError(path, f"shard file record {rec!r} does not name a plain "
                                              "'manifest.p<process>.json' of a new process")
        _check_data_file_name(df, path)
        if not (_is_int(crc) and _is_int(db) and _is_int(n) and db >= 0 and n >= 0):
            raise _corrupt(path, f"shard file record {rec!r} is malformed")
        seen.add(p)
        mpath = os.path.join(m.item_dir, name)
        try:
            raw = fs.read_file(mpath, MAX_MANIFEST_BYTES)
        except FileNotFoundError as e:
            raise _corrupt(mpath, f"shard manifest of process {p} is missing") from e
        except ValueError as e:
            raise _corrupt(mpath, str(e)) from e
        got = crc32(raw)
        if got != crc:
            raise _corrupt(mpath, f"shard manifest checksum {got:#010x} differs from the one "
                                  f"recorded at commit ({crc:#010x}): it was changed or damaged")
        obj = parse_json(raw, mpath, "shard manifest")
        if (not isinstance(obj, dict) or obj.get("format") != SHARD_MANIFEST_FORMAT
                or obj.get("process") != p or obj.get("data_file") != df
                or obj.get("data_bytes") != db or not isinstance(obj.get("shards"), list)
                or len(obj["shards"]) != n):
            raise _corrupt(mpath, "shard manifest does not match its record in "
                                  f"{os.path.basename(path)}")
        v = obj.get("format_version")
        if not _is_int(v) or not SHARDED_FORMAT_VERSION <= v <= MAX_FORMAT_VERSION:
            raise FormatVersionError(mpath, f"shard manifest format version {v!r} is not one "
                                            "this minickpt reads; upgrade minickpt")
        if n and df is None:
            raise _corrupt(mpath, "shards listed but no data file")
        refs = [_check_shard(se, m, mpath, p, df, db, shards) for se in obj["shards"]]
        by_offset = sorted((r for r in refs if r.nbytes), key=lambda r: r.offset)
        for a, b in itertools.pairwise(by_offset):
            if b.offset < a.offset + a.nbytes:
                leaf = path_str(m.entries[b.leaf]["path"])
                raise _corrupt(mpath, f"shard {[list(x) for x in b.box]} starts at byte "
                                      f"{b.offset} of {df}, inside another shard: shards never "
                                      "overlap", leaf=leaf)
        if n:
            assert df is not None
            # what a damaged shard file costs, named leaf by leaf (as for data.bin)
            _check_data_file(fs, os.path.join(m.item_dir, df), db,
                             [{"path": m.entries[r.leaf]["path"], "offset": r.offset,
                               "nbytes": r.nbytes} for r in refs])
        for ref in refs:
            shards[ref.leaf].append(ref)
    for i, refs in shards.items():
        e = m.entries[i]
        problems = coverage_problems(e["shape"], [r.box for r in refs])
        if problems:
            raise _corrupt(path, "its shards do not cover it exactly once: "
                                 + "; ".join(problems), leaf=path_str(e["path"]))
    return shards


def _check_shard(se: Any, m: Manifest, where: str, p: int, df: str | None, db: int,
                 shards: Mapping[int, list[ShardRef]]) -> ShardRef:
    if not isinstance(se, dict):
        raise _corrupt(where, f"shard entry {se!r} is malformed")
    leaf, index, off, nb, crc = (se.get(k) for k in ("leaf", "index", "offset", "nbytes",
                                                      "crc32"))
    if not _is_int(leaf) or leaf not in shards:
        raise _corrupt(where, f"shard entry names leaf {leaf!r}, which is not a sharded leaf")
    e = m.entries[leaf]
    name = path_str(e["path"])
    if "path" in se and se["path"] != e["path"]:
        raise _corrupt(where, f"shard entry for leaf {leaf} says path {se['path']!r}", leaf=name)
    shape = e["shape"]
    if (not isinstance(index, list) or len(index) != len(shape)
            or not all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and _is_int(b[1])
                       and 0 <= b[0] <= b[1] <= dim for b, dim in zip(index, shape, strict=False))):
        raise _corrupt(where, f"shard index {index!r} does not fit shape {shape}", leaf=name)
    box = tuple((b[0], b[1]) for b in index)
    expect = math.prod(box_shape(box)) * DTYPES[e["dtype"]].itemsize
    if not _is_int(nb) or nb != expect:
        raise _corrupt(where, f"shard {index} holds {nb!r} bytes, its index needs {expect}",
                       leaf=name)
    if not _is_int(off) or off < 0 or off + nb > db:
        raise _corrupt(where, f"shard bytes [{off}, {off}+{nb}) lie outside the {db}-byte data "
                              "file", leaf=name)
    _check_crc_field(crc, where, name)
    assert df is not None
    return ShardRef(leaf, box, p, df, off, nb, crc)


def read_region(fs: FileSystem, manifest: Manifest, i: int, box: Box, *, verify: bool = True,
                cache: dict[Any, np.ndarray] | None = None) -> np.ndarray:
    """Task 4.4 (read) — the elements ``box`` of array leaf ``i``, reading only what it needs.

    Works for every array leaf: one written whole by a single process, or one written in
    shards. Without ``verify`` only the bytes of the region are read. With ``verify`` every
    shard (or the whole leaf) the region touches is read and its CRC-32 checked, since a
    checksum covers a whole shard; ``cache`` keeps those verified pieces between calls, so
    that the devices of one process that share a shard read it once.
    """
    e = manifest.entries[i]
    if e["kind"] not in ("array", "prng_key"):
        raise TypeError(f"leaf {path_str(e['path'])} is not an array")
    dtype = DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n
                                     in zip(box, shape, strict=False)):
        raise ValueError(f"region {box} lies outside leaf {path_str(e['path'])} of shape {shape}")
    cache = {} if cache is None else cache
    _check_fits_in_memory(math.prod(box_shape(box)) * dtype.itemsize,
                          f"of leaf {path_str(e['path'])} from {manifest.item_dir}")
    out = aligned_empty(box_shape(box), dtype)  # zero-copy into a CPU jax.Array
    if out.size == 0:
        return out
    if not e.get("sharded"):
        whole = tuple((0, n) for n in shape)
        assert manifest.data_file is not None
        dpath = os.path.join(manifest.item_dir, manifest.data_file)
        if verify and "crc32" in e:
            key = ("leaf", manifest.item_dir, i)
            if key not in cache:
                cache[key] = _read_piece(fs, dpath, e["offset"], shape, dtype, whole, e["crc32"],
                                         path_str(e["path"]))
            out[...] = cache[key][box_slices(box)]
        else:
            out[...] = _read_piece(fs, dpath, e["offset"], shape, dtype, box, None,
                                   path_str(e["path"]))
        return out
    for ref in manifest.shards.get(i, []):
        part = intersect(ref.box, box)
        if part is None:
            continue
        dpath = os.path.join(manifest.item_dir, ref.data_file)
        rshape = box_shape(ref.box)
        if verify and ref.crc32 is not None:
            key = ("shard", dpath, ref.offset)
            if key not in cache:
                cache[key] = _read_piece(fs, dpath, ref.offset, rshape, dtype,
                                         tuple((0, n) for n in rshape), ref.crc32,
                                         path_str(e["path"]), ref)
            out[box_slices(part, box)] = cache[key][box_slices(part, ref.box)]
        else:
            local = tuple((a - o, b - o) for (a, b), (o, _) in zip(part, ref.box, strict=True))
            out[box_slices(part, box)] = _read_piece(fs, dpath, ref.offset, rshape, dtype,
                                                     local, None, path_str(e["path"]), ref)
    return out


def _read_piece(fs: FileSystem, dpath: str, offset: int, shape: tuple[int, ...],
                dtype: np.dtype, box: Box, crc: int | None, leaf: str,
                ref: ShardRef | None = None) -> np.ndarray:
    """``box`` of a C-order block of ``shape`` stored at ``offset``; checks ``crc`` (whole
    blocks only)."""
    fd = fs.open_read(dpath)
    try:
        out = _read_block_region(fs, fd, offset, shape, dtype, box)
    except EOFError as e:
        raise _corrupt(dpath, f"data file ended early ({e})", leaf=leaf) from e
    finally:
        fs.close(fd)
    if crc is not None:
        got = crc32(out.reshape(-1).view(np.uint8))
        if got != crc:
            what = "" if ref is None else f"shard {[list(b) for b in ref.box]} "
            raise _corrupt(dpath, f"{what}checksum mismatch (stored {crc:#010x}, read "
                                  f"{got:#010x}): the bytes were damaged", leaf=leaf)
    return out


def _read_block_region(fs: FileSystem, fd: int, offset: int, shape: tuple[int, ...],
                       dtype: np.dtype, box: Box) -> np.ndarray:
    """Read ``box`` of a C-order array of ``shape`` stored at ``offset`` of ``fd``.

    The region is a set of contiguous runs along the trailing axes. Long runs are read one
    by one straight into the result; many short runs (a thin slice across the last axis)
    are read as whole rows, a chunk at a time, and sliced in memory.
    """
    out = np.empty(box_shape(box), dtype)
    if out.size == 0:
        return out
    isz = dtype.itemsize
    flat = out.reshape(-1).view(np.uint8)
    nd = len(shape)
    if nd == 0:
        fs.read_into(fd, memoryview(flat), offset)
        return out
    strides = [math.prod(shape[j + 1:]) for j in range(nd)]  # in elements
    k = nd - 1  # runs are contiguous along axes k.. : the box spans axes k+1.. fully
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    run = (box[k][1] - box[k][0]) * strides[k] * isz
    n_runs = math.prod(b - a for a, b in box[:k])
    if run >= _RUN_DIRECT_BYTES or n_runs <= 64:
        pos = 0
        for outer in itertools.product(*(range(a, b) for a, b in box[:k])):
            start = sum(o * st for o, st in zip(outer, strides, strict=False))
            start += box[k][0] * strides[k]
            fs.read_into(fd, memoryview(flat[pos:pos + run]), offset + start * isz)
            pos += run
        return out
    row = strides[0] * isz
    rows = max(1, _SLAB_CHUNK_BYTES // row)
    inner = box_slices(box[1:])
    for r0 in range(box[0][0], box[0][1], rows):
        r1 = min(r0 + rows, box[0][1])
        tmp = np.empty((r1 - r0, *shape[1:]), dtype)
        fs.read_into(fd, memoryview(tmp.reshape(-1).view(np.uint8)), offset + r0 * row)
        out[r0 - box[0][0]:r1 - box[0][0]] = tmp[(slice(None), *inner)]
    return out


def check_shards(fs: FileSystem, manifest: Manifest) -> int:
    """Re-read every shard of every sharded leaf and check its CRC-32; return bytes checked.

    Streams one shard at a time, so verifying a checkpoint never needs a whole leaf in memory.
    """
    total = 0
    for i, refs in sorted(manifest.shards.items()):
        e = manifest.entries[i]
        dtype = DTYPES[e["dtype"]]
        for ref in refs:
            shape = box_shape(ref.box)
            _read_piece(fs, os.path.join(manifest.item_dir, ref.data_file), ref.offset, shape,
                        dtype, tuple((0, n) for n in shape), ref.crc32, path_str(e["path"]), ref)
            total += ref.nbytes
    return total
