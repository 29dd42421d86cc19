"""Reading a region of an array leaf, whole or sharded, reading only the bytes it needs:
what a restore onto another mesh or another number of processes does."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..fs import FileSystem
from ..tree import path_str
from .buffers import _check_fits_in_memory, aligned_empty
from .manifest import Manifest, _corrupt
from .shards import Box, ShardRef, box_shape, box_slices
from .spec import DTYPES, crc32

_RUN_DIRECT_BYTES = 64 << 10  # contiguous runs at least this long are read one by one
_SLAB_CHUNK_BYTES = 8 << 20  # otherwise whole rows are read in chunks this big and sliced


def read_region(fs: FileSystem, manifest: Manifest, i: int, box: Box, *, verify: bool = True,
                cache: dict[Any, np.ndarray] | None = None) -> np.ndarray:
    """The elements ``box`` of array leaf ``i``, reading only what it needs.

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
    if math.prod(box_shape(box)) == 0:
        return aligned_empty(box_shape(box), dtype)
    if e.get("sharded"):
        pieces = [(ref.box, _shard_reader(fs, manifest, e, ref, dtype, verify, cache))
                  for ref in manifest.shards.get(i, [])]
        return region_from_pieces(box, dtype, pieces)
    out = aligned_empty(box_shape(box), dtype)  # zero-copy into a CPU jax.Array
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


def _shard_reader(fs: FileSystem, manifest: Manifest, e: Mapping[str, Any], ref: ShardRef,
                  dtype: np.dtype, verify: bool, cache: dict[Any, np.ndarray]
                  ) -> Callable[[Box], np.ndarray]:
    """``read(part)`` for one saved shard: the elements ``part`` (global coordinates).

    With ``verify`` the whole shard is read once (its checksum covers all of it) and kept in
    ``cache``; without, only the bytes of ``part``.
    """
    dpath = os.path.join(manifest.item_dir, ref.data_file)
    rshape = box_shape(ref.box)

    def read(part: Box) -> np.ndarray:
        if verify and ref.crc32 is not None:
            key = ("shard", dpath, ref.offset)
            if key not in cache:
                cache[key] = _read_piece(fs, dpath, ref.offset, rshape, dtype,
                                         tuple((0, n) for n in rshape), ref.crc32,
                                         path_str(e["path"]), ref)
            return cache[key][box_slices(part, ref.box)]
        local = tuple((a - o, b - o) for (a, b), (o, _) in zip(part, ref.box, strict=True))
        return _read_piece(fs, dpath, ref.offset, rshape, dtype, local, None,
                           path_str(e["path"]), ref)

    return read


def region_from_pieces(box: Box, dtype: np.dtype,
                       pieces: Sequence[tuple[Box, Callable[[Box], np.ndarray]]]) -> np.ndarray:
    """Task 4.4 — the elements ``box`` of a saved array, put together from the saved pieces.

    ``box`` is the region one device of the *restoring* mesh holds, ``((start, stop), ...)``
    per axis in global coordinates. ``pieces`` are the shards as they were *saved* — by any
    number of processes, on any mesh — each ``(piece_box, read)``, where ``read(part)``
    returns the elements ``part`` (a box inside ``piece_box``, global coordinates) as an
    array of ``box_shape(part)``. The two meshes need have nothing in common: a region may
    take a corner of one piece and all of another. The bytes read are the bytes needed: each
    piece is asked at most once, for nothing outside the region, and a piece that shares
    nothing with it not at all (every host of a large job restores at once; reading whole
    pieces would multiply the bytes read). The pieces cover the array exactly once (checked
    when the manifest was read). Returns an array of ``dtype`` and ``box_shape(box)``, 64-byte
    aligned (a CPU restore then needs no copy).
    """
    out = aligned_empty(box_shape(box), dtype)
    for piece_box, read in pieces:
        part = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(piece_box, box, strict=True))
        if any(lo >= hi for lo, hi in part):
            continue  # this piece holds nothing of the region
        out[box_slices(part, box)] = read(part)
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
    out = aligned_empty(box_shape(box), dtype)  # fresh memory: plain pages (buffers.py)
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
