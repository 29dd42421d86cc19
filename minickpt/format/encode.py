"""Encoding and writing one item: the tree brought to the host as manifest entries and byte views
(:func:`plan_item`), then the data file and the manifest (:func:`write_item`).

Planning and writing are separate so that the synchronous save, the background writer and
the per-process shard writer share them."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptedError, UnsupportedLeafError
from ..fs import DirectIORefused, FileSystem, SyncBatch
from ..tree import HostKey, Names, is_prng_key, path_str, skeleton, snapshot_leaf, to_host
from .spec import (
    _CRC_IN_THREAD_BYTES,
    _HOST_IN_THREAD_BYTES,
    ALIGN,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    crc32,
    dtype_name,
    json_text,
)


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
    # a synchronous save's large device leaves, still on their way to the host: their
    # entries and buffers are None until the writer reaches them (see _Stream)
    stream: _Stream | None = None

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

    Receives a leaf's key path and the leaf as :func:`to_host` gives it (a numpy array, a
    :class:`HostKey`, a Python scalar or string). Returns ``(entry, buf)``: the entry
    describes the leaf in the manifest's terms (``path``, ``kind``, ``dtype``, ``shape``,
    ``nbytes``, for a key those of its raw data; a key's ``impl``; a value's own fields), and
    ``buf`` holds exactly the bytes ``data.bin`` must store for it, as a 1-D ``uint8`` array:
    little-endian and in C order whatever the array's byte order or memory layout, with no
    cast (``None`` for a value, which lives in the entry). Refuses, with :class:`UnsupportedLeafError`, a dtype the
    format cannot store. The offset, the checksum and the ``scalar`` mark are added by
    :func:`plan_item` and :func:`write_item`.
    """
    where = path_str(names)
    entry: dict[str, Any] = {"path": list(names)}
    if isinstance(host, HostKey):
        data = np.asarray(host.data)
        entry.update(kind="prng_key", impl=host.impl)
    elif isinstance(host, np.ndarray):
        data = host
        entry.update(kind="array")
    else:
        entry.update(encode_value(host, where))
        return entry, None
    entry.update(dtype=dtype_name(data.dtype), shape=list(data.shape))
    if data.dtype.byteorder == ">":  # data.bin is little-endian whatever the machine
        data = data.astype(data.dtype.newbyteorder("<"))
    buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    entry["nbytes"] = int(buf.nbytes)
    return entry, buf


def plan_item(tree: Any, *, copy: bool = False, executor: Executor | None = None,
              pin: bool = False, stream: bool = False) -> ItemPlan:
    """Bring a tree to the host and lay it out: skeleton, entries, byte views and offsets.

    With an ``executor``, large leaves are brought over (and copied, with ``copy=True``) in its
    threads: numpy copies release the GIL, so an async save's snapshot uses several cores.
    ``pin=True`` lets a pinned zero-copy view of a CPU array stand in for its copy
    (:func:`minickpt.tree.pinned_view`).

    ``stream=True`` (a synchronous save: no copy, no executor) leaves the item's device arrays
    where they are, their transfers started: the writer takes each when it reaches it
    (:class:`_Stream`), so that writing overlaps the transfers still under way. Every leaf is
    still checked here, in tree order, without a transfer: a leaf minickpt cannot store is
    refused before anything is written.
    """
    skel, named = skeleton(tree)
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
    later = (_deferrable(named) if stream and not copy and executor is None
             and to_host is _OWN[0] and plan_leaf is _OWN[1] else set())

    def leaves() -> Iterator[tuple[Names, Any, bool] | int]:  # in tree order, one at a time
        for i, (names, leaf) in enumerate(named):
            if i in later:  # checked now, brought over when the writer reaches it
                dtype_name(leaf.dtype)  # refuses what plan_leaf would refuse, without a transfer
                yield int(leaf.nbytes)
                continue
            was_np_scalar = isinstance(leaf, np.generic)
            fut = futures.get(i)
            host = fut.result() if fut is not None else _host(leaf, copy, pin, path_str(names))
            yield names, host, was_np_scalar

    plan = lay_out(skel, leaves())
    if later:  # the offsets are laid out as the leaves arrive, by the same rule (_Stream)
        plan.stream = _Stream(plan, {i: named[i] for i in later})
    return plan


def lay_out(skel: dict[str, Any], leaves: Iterable[tuple[Names, Any, bool] | int]) -> ItemPlan:
    """Lay out an item's leaves; shared by plan_item and device snapshots so their bytes match."""
    # leaves, in tree order: (names, host as to_host gives it, was a numpy scalar), or an int
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    offset, streamed = 0, False
    for leaf in leaves:
        if isinstance(leaf, int):  # the byte count of a streamed item's leaf still on its
            # device: its entry comes with it, and _Stream lays the item out again as they arrive
            entries.append(None)  # type: ignore[arg-type]
            buffers.append(None)
            offset, streamed = _align(offset) + leaf, True
            continue
        names, host, was_np_scalar = leaf
        entry, buf = plan_leaf(names, host)
        if was_np_scalar:
            entry["scalar"] = True
        if buf is not None:
            offset = _align(offset)
            entry["offset"] = offset
            offset += buf.nbytes
        entries.append(entry)
        buffers.append(buf)
    if offset >= DIRECT_IO_MIN_BYTES and not streamed:  # whether or not O_DIRECT is on
        offset = _page_congruent(entries, buffers)
    return ItemPlan(skel, entries, buffers, offset)


# the library's own task functions (labkit.plugged_in swaps the module attributes that are
# them): only with these is a streamed item's layout known before its leaves arrive
_OWN = (to_host, plan_leaf)


def _deferrable(named: Sequence[tuple[Names, Any]]) -> set[int]:
    """The leaves a synchronous save may bring over as it writes them: live, fully
    addressable device arrays (not typed keys: small, and laid out by their key data). None
    where they add up to less than :data:`_JOIN_BELOW`: such an item is written in one
    piece, after all of its leaves are on the host."""
    import jax

    later, total = set(), 0
    for i, (_names, leaf) in enumerate(named):
        if not isinstance(leaf, jax.Array) or is_prng_key(leaf):
            continue
        try:
            if leaf.is_deleted() or not leaf.is_fully_addressable:
                continue  # to_host raises for it now, as it always did
        except Exception:  # an unusual array type: brought over now, as before
            continue
        later.add(i)
        total += int(leaf.nbytes)
    return later if total >= _JOIN_BELOW else set()


def _wait_for_host(leaf: Any, path: str) -> Any:
    """The writer's wait for one leaf's device-to-host copy (started by :func:`plan_item`)."""
    return to_host(leaf, path=path)


class _Stream:
    """The leaves of a streamed item (``plan_item(stream=True)``), settled in tree order as
    the writer reaches them: leaf i's transfer is waited for, its entry and bytes made
    (:func:`plan_leaf`), its offset laid out (by :func:`_page_congruent`'s rule, which needs
    only the leaves before it) and its checksum started, while the later transfers go on.

    Once every leaf is settled, the entries, offsets, checksums and data file are exactly
    those of a plan made with every leaf on the host first."""

    def __init__(self, plan: ItemPlan, pending: dict[int, tuple[Names, Any]]):
        self.plan = plan
        self.pending = pending
        self.direct = plan.nbytes >= DIRECT_IO_MIN_BYTES  # laid out for O_DIRECT, as below
        self.next = 0  # the first leaf not settled yet
        self.end = 0  # where the data file's bytes end so far
        self.crcs: list[Any] = [None] * len(plan.entries)
        self.pool: ThreadPoolExecutor | None = None
        self.in_thread = plan.nbytes >= _CRC_IN_THREAD_BYTES
        # the data file's greatest possible size (each large leaf moved < 4 KiB further)
        from .. import fs as _fs

        self.bound = plan.nbytes + (_fs._DIO_PAGE * len(plan.entries) if self.direct else 0)

    def settle(self, i: int) -> np.ndarray | None:
        """Leaf i's bytes (None for a value leaf), settling every leaf up to it first."""
        while self.next <= i:
            self._settle_next()
        return self.plan.buffers[i]

    def _settle_next(self) -> None:
        from .. import fs as _fs

        plan, i = self.plan, self.next
        if i in self.pending:
            names, leaf = self.pending[i]
            path = path_str(names)
            try:
                entry, buf = plan_leaf(names, _wait_for_host(leaf, path))
            except Exception as e:
                e.add_note(f"minickpt: while bringing leaf {path} to the host to write it")
                raise
            if buf is None or buf.nbytes != int(leaf.nbytes):
                raise RuntimeError(f"leaf {path}: {getattr(buf, 'nbytes', None)} bytes on the "
                                   f"host where the device array holds {leaf.nbytes}")
            plan.entries[i], plan.buffers[i] = entry, buf
            del self.pending[i]
        entry, buf = plan.entries[i], plan.buffers[i]
        if buf is not None:
            offset = _align(self.end)
            addr = buf.ctypes.data
            if self.direct and buf.nbytes >= _fs.DIRECT_CHUNK and addr % ALIGN == 0:
                offset += (addr - offset) % _fs._DIO_PAGE
            entry["offset"] = offset
            self.end = offset + buf.nbytes
            self.crcs[i] = self._crc(buf)
        self.next += 1

    def _crc(self, buf: np.ndarray) -> Any:
        if self.in_thread:  # the CRC releases the GIL: it runs while the writer writes
            try:
                self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="minickpt-crc")
                return self.pool.submit(crc32, buf)
            except RuntimeError:  # interpreter exit: no new work may be scheduled
                self.in_thread = False
        return crc32(buf)

    def finish(self) -> list[int | None]:
        """Settle what the writer did not reach; the checksums. The plan is then complete."""
        self.settle(len(self.plan.entries) - 1)
        self.plan.nbytes = self.end
        return [c.result() if isinstance(c, Future) else c for c in self.crcs]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _page_congruent(entries: list[dict[str, Any]], buffers: list[np.ndarray | None]) -> int:
    """Lay out a data file that will be written with O_DIRECT so that each large leaf sits at
    the same place within a 4 KiB page in the file as in memory (up to 4 KiB of zeros before
    it): its bytes then go from its own memory to the disk, with no copy into a bounce buffer
    (:meth:`~minickpt.fs.FileSystem.write_all_direct`) — on a busy machine the copy was
    what kept a large save from the disk's speed. Offsets stay 64-byte aligned, any reader
    takes them from the manifest; a leaf whose memory is not 64-byte aligned is left
    packed. Returns the data file's new size."""
    from .. import fs as _fs

    offset = 0
    for entry, buf in zip(entries, buffers, strict=True):
        if buf is None:
            continue
        offset = _align(offset)
        addr = buf.ctypes.data
        if buf.nbytes >= _fs.DIRECT_CHUNK and addr % ALIGN == 0:
            offset += (addr - offset) % _fs._DIO_PAGE
        entry["offset"] = offset
        offset += buf.nbytes
    return offset


def _host(leaf: Any, copy: bool, pin: bool, path: str) -> Any:
    if copy:  # the snapshot of an async save (Task 5.1), copied or pinned
        return snapshot_leaf(leaf, path=path, pin=pin)
    return to_host(leaf, path=path)


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


_ZEROS = memoryview(bytes(4096))  # padding between leaves: < ALIGN bytes, or < 4 KiB
# before a leaf laid out for O_DIRECT (see _page_congruent)
_JOIN_BELOW = 1 << 20  # items smaller than this go to disk in one write of one buffer
_WRITEBACK_EVERY = 32 << 20  # start the disk on each 32 MiB written (measured: 400 MB
# written and fsynced ~1.6× faster than write-then-fsync on an ext4 virtual disk)


def _data_chunks(plan: ItemPlan) -> Iterable[memoryview | bytes]:
    pos = 0
    stream = plan.stream
    for i, buf in enumerate(plan.buffers):
        if stream is not None:  # leaf i waited for only now, as it is about to be written
            buf = stream.settle(i)
        if buf is None:
            continue
        entry = plan.entries[i]
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
    lines = ["{", *(f"{json_text(k)}: {json_text(v)}," for k, v in head.items()), *middle,
             f'"{key}": [', ",\n".join(map(_COMPACT.encode, entries)), "]}"]
    return ("\n".join(lines) + "\n").encode()


# what a leaf's manifest line holds beside its path and value (kind, dtype, shape of up to
# MAX_NDIM dims, nbytes, offset, crc32, impl, scalar), and a streamed leaf's whole line
_ENTRY_FIXED = 64 * 21 + 256


def check_manifest_fits(name: str, plan: ItemPlan) -> None:
    """Refuse, before anything is written, an item whose manifest a restore would refuse to
    read (it reads at most :data:`MAX_MANIFEST_BYTES`). A bound first, from the leaves'
    names and values (JSON escapes a character into at most 6 bytes; the tree repeats each
    name at most once), and only past it the manifest's exact size."""
    bound = 4096
    for e in plan.entries:
        if e is None:  # a streamed leaf: its path is in the skeleton, its size bounded
            bound += _ENTRY_FIXED
            continue
        v = e.get("value")
        bound += _ENTRY_FIXED + 12 * sum(len(n) + 4 for n in e["path"]) + (
            6 * len(v) if isinstance(v, str) else 64 if v is not None else 0) + (
            v.bit_length() // 3 if isinstance(v, int) else 0)  # a big int's digits
    if bound <= MAX_MANIFEST_BYTES:
        return
    filler = {"offset": 1 << 62, "crc32": 2**32 - 1}
    entries = [{**e, **filler} if e is not None and "nbytes" in e else e or {}
               for e in plan.entries]
    size = len(manifest_bytes(plan.skeleton, entries, data_file=DATA_FILE,
                              data_bytes=1 << 62)) + _ENTRY_FIXED * sum(
                                  e is None for e in plan.entries)
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(
            f"item '{name}': its manifest would be {size / 2**20:.0f} MiB ({plan.num_leaves} "
            f"leaves), over the {MAX_MANIFEST_BYTES >> 20} MiB a restore reads "
            "(MAX_MANIFEST_BYTES), so the checkpoint could never be restored: nothing was "
            "written. Store long strings as arrays, or split the item")


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
    dpath = os.path.join(item_dir, data_file)
    if plan.stream is not None:
        fsync_s, crcs = _write_streamed(fs, dpath, plan, fsync, sync)
        return _item_data(plan, crcs, data_file, True, t0, fsync_s)
    has_data = any(b is not None for b in plan.buffers)
    crc_future = _crc_in_thread(plan) if plan.nbytes >= _CRC_IN_THREAD_BYTES else None
    if crc_future is not None:
        fsync_s += _write_data(fs, dpath, plan, fsync, sync)
        crcs = crc_future.result()
    else:
        crcs = _crc_all(plan.buffers)
        if plan.nbytes or has_data:
            fsync_s += _write_data(fs, dpath, plan, fsync, sync)
    return _item_data(plan, crcs, data_file, has_data, t0, fsync_s)


def _item_data(plan: ItemPlan, crcs: Sequence[int | None], data_file: str, has_data: bool,
               t0: float, fsync_s: float) -> ItemData:
    entries = []
    for entry, crc in zip(plan.entries, crcs, strict=True):
        if crc is not None:
            entry = {**entry, "crc32": crc}
        entries.append(entry)
    return ItemData(entries, data_file if has_data else None, plan.nbytes,
                    write_s=time.perf_counter() - t0 - fsync_s, fsync_s=fsync_s)


def _write_streamed(fs: FileSystem, dpath: str, plan: ItemPlan, fsync: bool,
                    sync: SyncBatch | None) -> tuple[float, list[int | None]]:
    """Write a streamed item's data file, each leaf as it arrives; its fsync time and the
    leaf checksums. The plan is complete afterwards (its offsets, its size)."""
    stream = plan.stream
    assert stream is not None
    try:
        fsync_s = _write_data(fs, dpath, plan, fsync, sync)
        return fsync_s, stream.finish()
    finally:
        stream.close()
        plan.stream = None


def write_item_manifest(fs: FileSystem, item_dir: str, plan: ItemPlan, data: ItemData, *,
                        manifest_file: str = MANIFEST_FILE, fsync: bool = True,
                        extra: Mapping[str, Any] | None = None,
                        sync: SyncBatch | None = None) -> ItemWriteResult:
    """The second half of :func:`write_item`: the manifest, fsynced, then the directory
    (or both handed to ``sync``)."""
    raw = manifest_bytes(plan.skeleton, data.entries, data_file=data.data_file,
                         data_bytes=data.data_bytes, extra=extra)
    if len(raw) > MAX_MANIFEST_BYTES:  # (planned within it: a guard, before the commit)
        raise ValueError(f"{item_dir}: its manifest is {len(raw)} bytes, over the "
                         f"{MAX_MANIFEST_BYTES} a restore reads (MAX_MANIFEST_BYTES): not "
                         "committed")
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


DIRECT_IO_ENV = "MINICKPT_DIRECT_IO"
DIRECT_IO_MIN_BYTES = 32 << 20  # data files from this size on bypass the page cache


def direct_io_enabled() -> bool:
    """Whether large data files are written with O_DIRECT: yes, unless the environment
    variable ``MINICKPT_DIRECT_IO`` is ``0``/``off``/``false``/``no`` (read at every save)."""
    return os.environ.get(DIRECT_IO_ENV, "").strip().lower() not in ("0", "off", "false", "no")


_log = logging.getLogger("minickpt")
_REFUSALS_LOGGED: set[tuple[int, str]] = set()


def _direct_refused(path: str, e: DirectIORefused) -> None:
    """A refusal of O_DIRECT is silent for the user (the file is written buffered, as
    durable as ever): logged at debug level, once per process per kind of refusal."""
    key = (e.errno, str(e))
    if key not in _REFUSALS_LOGGED:
        _REFUSALS_LOGGED.add(key)
        _log.debug("minickpt: %s for %s; large files are written through the page cache",
                   e, os.path.dirname(path))


def _write_direct(fs: FileSystem, path: str, plan: ItemPlan) -> int | None:
    """Write the data file ``path`` (just created, empty) with O_DIRECT; return the
    descriptor to fsync and close, or None where O_DIRECT is refused (nothing written)."""
    try:
        dfd = fs.open_direct(path)
    except DirectIORefused as e:
        _direct_refused(path, e)
        return None
    try:
        size = plan.stream.bound if plan.stream is not None else plan.nbytes
        fs.write_all_direct(dfd, _data_chunks(plan), size=size)
    except BaseException as e:
        try:
            fs.close(dfd)
        except OSError:
            pass  # the write's error (or the refusal) is the one that matters
        if isinstance(e, DirectIORefused):
            _direct_refused(path, e)
            return None
        raise
    return dfd


def _write_data(fs: FileSystem, path: str, plan: ItemPlan, fsync: bool,
                sync: SyncBatch | None = None) -> float:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        dfd = None
        if plan.nbytes < _JOIN_BELOW:  # many small leaves: one buffer, one write
            fs.write_all(fd, [b"".join(_data_chunks(plan))])
        elif ((fsync or sync) and plan.nbytes >= DIRECT_IO_MIN_BYTES and direct_io_enabled()
              and (dfd := _write_direct(fs, path, plan)) is not None):
            # written past the page cache; the O_DIRECT descriptor is the one to fsync
            buffered, fd = fd, dfd
            fs.close(buffered)
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
