"""Sharded leaves (format 2): one leaf written in pieces by several processes.

The geometry of shards (index boxes, the coverage check) and how one process lays out and
writes its shards of an item."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..fs import FileSystem, SyncBatch
from ..tree import Names, path_str
from .encode import ItemPlan, _align, _as_bytes, _json_doc, _write_manifest_file, write_item_data
from .spec import SHARD_MANIFEST_FORMAT, SHARDED_FORMAT_VERSION, crc32, dtype_name

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
