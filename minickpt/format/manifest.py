"""Reading an item's manifest, trusting nothing: every field is checked (types, dtype
names against an allow-list, sizes against the data file, the shards of a multi-process
save against each other) before a single byte of data is read."""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptedError, FormatVersionError, UnsafeCheckpointError
from ..fs import FileSystem
from ..tree import MAX_DEPTH, Names, path_str
from .encode import decode_value
from .shards import ShardRef, box_shape, coverage_problems
from .spec import (
    _DATA_FILE_RE,
    _SHARD_MANIFEST_RE,
    DTYPES,
    FORMAT_NAME,
    MANIFEST_FILE,
    MAX_FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    SHARD_MANIFEST_FORMAT,
    SHARDED_FORMAT_VERSION,
    crc32,
    key_data_shape,
)


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
    # False when the data file's type and size are left to the read that opens it
    # (read_manifest(check_data=False)): :func:`open_data` checks them on that open's fstat
    data_checked: bool = True

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
                  manifest_file: str = MANIFEST_FILE, check_data: bool = True) -> Manifest:
    """Read and validate an item's manifest; any inconsistency is a clear error.

    ``check_data=False`` (a restore, which opens the data file next anyway) leaves the data
    file's checks — there, a regular file, exactly the manifest's size — to that open
    (:func:`open_data`, on its ``fstat``) instead of a ``lstat`` of its own: the same checks
    and errors, one path lookup fewer, which is what a tiny restore costs most on a file
    system whose lookups are slow (9p under gVisor, issue 51)."""
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
    if len(raw) <= _CHECKED_MAX_BYTES and raw in _CHECKED:  # its fields were checked before
        return _with_files(obj, path, item_dir, crc, fs, check_data, obj["format_version"],
                           obj.get("data_file"), obj["data_bytes"], obj["tree"], obj["leaves"])
    m = validate_manifest(obj, path, item_dir, crc, fs=fs, check_data=check_data)
    _remember_checked(raw)
    return m


# The bytes of manifests whose fields :func:`_check_fields` found good. Those checks (every
# entry, the skeleton, overlaps: most of a tiny restore's Python) depend on nothing but the
# parsed bytes, and the same bytes parse to the same fields, so they are not repeated for
# bytes read again (issue 51). The key is the whole content just read, never a path or a
# step: a checkpoint deleted and saved again with any byte changed is checked anew. What
# depends on more than these bytes is done at every read: the manifest's checksum against the
# one the metadata recorded, the data file's type and size, the shard manifests. Each read
# still parses its own copy: nothing a caller could change is shared between reads.
_CHECKED: dict[bytes, None] = {}
_CHECKED_MAX = 32  # manifests remembered (the oldest forgotten first) ...
_CHECKED_MAX_BYTES = 256 << 10  # ... each at most this long: at most 8 MiB held
_CHECKED_LOCK = threading.Lock()


def _remember_checked(raw: bytes) -> None:
    if len(raw) > _CHECKED_MAX_BYTES:
        return
    with _CHECKED_LOCK:
        while len(_CHECKED) >= _CHECKED_MAX:
            del _CHECKED[next(iter(_CHECKED))]
        _CHECKED[raw] = None


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
                      fs: FileSystem | None = None, check_data: bool = True) -> Manifest:
    """Check every field of a parsed manifest against the format's rules and the data file."""
    version, data_file, data_bytes, skel, entries = _check_fields(obj, path)
    return _with_files(obj, path, item_dir, crc, fs, check_data, version, data_file,
                       data_bytes, skel, entries)


def _check_fields(obj: Any, path: str) -> tuple[int, str | None, int, dict[str, Any],
                                                list[dict[str, Any]]]:
    """:func:`validate_manifest`'s checks of the parsed manifest itself (nothing else is
    looked at); its version, data file, data size, skeleton and entries."""
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
    return version, data_file, data_bytes, skel, entries


def _with_files(obj: dict[str, Any], path: str, item_dir: str, crc: int, fs: FileSystem | None,
                check_data: bool, version: int, data_file: str | None, data_bytes: int,
                skel: dict[str, Any], entries: list[dict[str, Any]]) -> Manifest:
    """The rest of :func:`validate_manifest`, for a manifest whose own fields are good: the
    checks that look at other files (the data file's type and size, the shard manifests)."""
    if data_file is not None and fs is not None and check_data:
        whole = [e for e in entries if e["kind"] != "value" and not e.get("sharded")]
        _check_data_file(fs, os.path.join(item_dir, data_file), data_bytes, whole)
    m = Manifest(item_dir, skel, entries, data_file, data_bytes, crc, obj,
                 data_checked=check_data or data_file is None or fs is None)
    sharded = [i for i, e in enumerate(entries) if e.get("sharded")]
    if "shard_files" in obj or sharded:
        if version < SHARDED_FORMAT_VERSION:
            raise _corrupt(path, f"sharded leaves in a format {version} manifest")
        if fs is not None:
            m.shards = _load_shards(fs, m, path, obj.get("shard_files"), sharded)
    return m


def _whole_leaves(m: Manifest) -> list[dict[str, Any]]:
    return [e for e in m.entries if e["kind"] != "value" and not e.get("sharded")]


def check_data(fs: FileSystem, m: Manifest) -> None:
    """The data file's checks that ``read_manifest(check_data=False)`` left out, for a
    reader that will not open it (:func:`open_data` does them on its open)."""
    if not m.data_checked:
        assert m.data_file is not None
        _check_data_file(fs, os.path.join(m.item_dir, m.data_file), m.data_bytes,
                         _whole_leaves(m))
        m.data_checked = True


def open_data(fs: FileSystem, m: Manifest) -> int:
    """Open the item's data file for reading (no symlink, a regular file), with the checks
    of :func:`_check_data_file` made on this open's ``fstat`` where the manifest left them
    out: the same errors, naming the leaves a missing or truncated file costs."""
    assert m.data_file is not None
    dpath = os.path.join(m.item_dir, m.data_file)
    if m.data_checked:
        return fs.open_read(dpath)
    arrays = _whole_leaves(m)
    try:
        fd, st = fs._open_read(dpath)
    except FileNotFoundError as e:
        raise _corrupt(dpath, f"data file is missing (it holds {_leaf_list(arrays)})",
                       leaf=_first(arrays)) from e
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(dpath, "is a symbolic link; refusing to follow it",
                                    leaf=_first(arrays)) from e
    except CheckpointCorruptedError as e:  # not a regular file
        raise _corrupt(dpath, f"data file is not a regular file (it should hold "
                              f"{_leaf_list(arrays)})", leaf=_first(arrays)) from e
    try:
        _check_data_stat(st, dpath, m.data_bytes, arrays)
    except BaseException:
        fs.close(fd)
        raise
    m.data_checked = True
    return fd


def _check_data_file(fs: FileSystem, dpath: str, data_bytes: int,
                     arrays: Sequence[Mapping[str, Any]]) -> None:
    """The data file must be a regular file of exactly the manifest's size; if it is not,
    the error names the leaves it costs."""
    try:
        st = fs.lstat(dpath)
    except FileNotFoundError as e:
        raise _corrupt(dpath, f"data file is missing (it holds {_leaf_list(arrays)})",
                       leaf=_first(arrays)) from e
    _check_data_stat(st, dpath, data_bytes, arrays)


def _first(arrays: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the first leaf a damaged data file costs (made only for an error)."""
    return path_str(arrays[0]["path"]) if arrays else None


def _check_data_stat(st: os.stat_result, dpath: str, data_bytes: int,
                     arrays: Sequence[Mapping[str, Any]]) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCheckpointError(dpath, "is a symbolic link; refusing to follow it",
                                    leaf=_first(arrays))
    if not stat.S_ISREG(st.st_mode):
        raise _corrupt(dpath, f"data file is not a regular file (it should hold "
                              f"{_leaf_list(arrays)})", leaf=_first(arrays))
    if st.st_size < data_bytes:
        lost = [e for e in arrays if e["offset"] + e["nbytes"] > st.st_size]
        raise _corrupt(dpath, f"data file has {st.st_size} bytes, the manifest says "
                              f"{data_bytes}: truncated, losing {_leaf_list(lost)}",
                       leaf=path_str(lost[0]["path"]) if lost else _first(arrays))
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
    """One leaf entry against the format's rules; a bad one raises, naming the leaf."""
    if not _plain_array_ok(e, data_file, data_bytes):
        _check_entry_fully(e, i, where, data_file, data_bytes)


def _plain_array_ok(e: Any, data_file: str | None, data_bytes: int) -> bool:
    """True only for a whole array entry that :func:`_check_entry_fully` would pass — the
    common case, checked without building the leaf's name for messages; anything else (and
    anything wrong) goes through the full check, which says what is wrong."""
    if type(e) is not dict or e.get("kind") != "array" or "sharded" in e \
            or data_file is None:
        return False
    path, dt, shape, nbytes = e.get("path"), e.get("dtype"), e.get("shape"), e.get("nbytes")
    offset, crc = e.get("offset"), e.get("crc32")
    if type(path) is not list or any(type(p) is not str for p in path):
        return False
    dtype = DTYPES.get(dt) if type(dt) is str else None
    if dtype is None or type(shape) is not list or len(shape) > MAX_NDIM \
            or any(type(n) is not int or n < 0 for n in shape):
        return False
    if type(nbytes) is not int or nbytes != math.prod(shape) * dtype.itemsize:
        return False
    if type(offset) is not int or offset < 0 or offset + nbytes > data_bytes:
        return False
    return crc is None or (type(crc) is int and 0 <= crc < 2**32)


def _check_entry_fully(e: Any, i: int, where: str, data_file: str | None,
                       data_bytes: int) -> None:
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
