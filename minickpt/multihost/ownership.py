"""Which process writes what (Task 4.2), and the snapshot of one item for this process:
the shards it owns, plus, on the primary, every leaf no process holds in shards."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import UnsupportedLeafError
from ..format.encode import ItemPlan, plan_leaf
from ..format.shards import Box, box_of, plan_shards, sharded_entry
from ..format.spec import dtype_name
from ..tree import HostKey, Names, _transfer_made_a_copy, is_prng_key, path_str, skeleton, to_host
from .sync import Sync

log = logging.getLogger("minickpt")


def owned_shards(shape: Sequence[int], devices_indices_map: Mapping[Any, Sequence[slice]],
                 process_index: int, *,
                 process_of: Callable[[Any], int] = lambda d: d.process_index
                 ) -> list[tuple[Box, Any]]:
    """Task 4.2 — the shards process ``process_index`` writes: ``(box, device)`` pairs.

    Pure. ``devices_indices_map`` is ``sharding.devices_indices_map(shape)``: every device
    of the sharding, in the sharding's device order, with the index of the piece it holds.
    Several devices may hold the same piece (replication); each process decides alone, from
    the map, and across all processes each piece is written exactly once, by the process of
    the device JAX gives ``replica_id == 0`` for it.
    """
    seen: set[Box] = set()
    mine = []
    for device, index in devices_indices_map.items():
        box = box_of(index, shape)
        if box in seen:
            continue
        seen.add(box)
        if process_of(device) == process_index:
            mine.append((box, device))
    return mine


@dataclass
class ProcessItemPlan:
    """One process's part of one item: the primary's plan (every leaf's manifest entry, the
    bytes of the leaves only it writes) and this process's shards."""

    primary: ItemPlan | None
    shards: ItemPlan
    num_sharded: int


def _is_sharded(leaf: Any, sync: Sync, primary_host: int) -> bool:
    """Whether a leaf is written in shards: a global array no single process reads whole."""
    return _spans_processes(leaf, sync.process_of) and not _primary_can_read(
        leaf, sync.process_of, primary_host)


def tree_signature(items: Mapping[str, Any], sync: Sync, primary_host: int = 0) -> str:
    """A checksum of what the processes are about to save: item names, key paths, types,
    shapes, dtypes, and which leaves are sharded. Cheap: no data is read.

    It also refuses leaves that cannot be stored, on *every* process (the primary alone
    copies the unsharded ones, and must not be the only one to fail).
    """
    sig = []
    for name, tree in items.items():
        for names, leaf in skeleton(tree)[1]:
            _check_storable(leaf, f"item '{name}' leaf {path_str(names)}")
            sig.append([name, list(names), type(leaf).__name__,
                        list(np.shape(leaf)) if hasattr(leaf, "shape") else None,
                        str(getattr(leaf, "dtype", "")), _is_sharded(leaf, sync, primary_host)])
    return f"{zlib.crc32(json.dumps(sig, sort_keys=True).encode()):08x}"


def _check_storable(leaf: Any, where: str) -> None:
    if isinstance(leaf, jax.Array):
        dtype = jax.random.key_data(leaf).dtype if is_prng_key(leaf) else leaf.dtype
    elif isinstance(leaf, (np.ndarray, np.generic)):
        to_host(leaf, path=where)  # refuses object arrays, with the reason
        dtype = leaf.dtype
    else:
        to_host(leaf, path=where)  # numbers, strings, None pass; anything else is refused
        return
    try:
        dtype_name(dtype)
    except UnsupportedLeafError as e:
        raise UnsupportedLeafError(f"{where}: {e}") from None


def _spans_processes(leaf: Any, process_of: Callable[[Any], int]) -> bool:
    """Whether a leaf is a global array (its devices belong to more than one process)."""
    if not isinstance(leaf, jax.Array):
        return False
    return len({process_of(d) for d in leaf.sharding.device_set}) > 1


def _primary_can_read(leaf: jax.Array, process_of: Callable[[Any], int], primary: int) -> bool:
    sh = leaf.sharding
    return sh.is_fully_replicated and any(process_of(d) == primary for d in sh.device_set)


def plan_for_process(tree: Any, sync: Sync, *, primary_host: int = 0, copy: bool = False,
                     primary_only: bool = False, item: str = "") -> ProcessItemPlan:
    """The snapshot of one item for this process (device-to-host copies happen here).

    Global arrays that no single process can read whole are *sharded*: this process copies
    the shards it owns (:func:`owned_shards`). Everything else — Python values, numpy
    arrays, process-local arrays (assumed equal on every process, as in data parallelism)
    and fully replicated arrays — is copied by the primary alone. ``copy`` forces real
    copies on CPU too (needed when the write runs in the background).
    """
    me = sync.process_index
    is_primary = me == primary_host
    skel, named = skeleton(tree)
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    shards: list[tuple[int, Names, Box, np.ndarray]] = []
    pending: list[tuple[int, Names, Box, jax.Array]] = []
    offset = 0
    num_sharded = 0
    for i, (names, leaf) in enumerate(named):
        where = path_str(names)
        sharded = _is_sharded(leaf, sync, primary_host)
        if sharded:
            if primary_only:
                raise UnsupportedLeafError(
                    f"item '{item}' leaf {where} is sharded across processes "
                    f"({leaf.sharding}); primary_only=True saves replicated state only. Use "
                    "the default sharded protocol, or replicate the leaf.")
            num_sharded += 1
            key = is_prng_key(leaf)
            data = jax.random.key_data(leaf) if key else leaf
            impl = str(jax.random.key_impl(leaf)) if key else None
            if is_primary:
                entries.append(sharded_entry(names, "prng_key" if key else "array", data.dtype,
                                             data.shape, impl))
                buffers.append(None)
            by_device = {s.device: s for s in data.addressable_shards}
            for box, device in owned_shards(data.shape,
                                            data.sharding.devices_indices_map(data.shape), me,
                                            process_of=sync.process_of):
                pending.append((i, names, box, by_device[device].data))
            continue
        if not is_primary:
            continue
        was_np_scalar = isinstance(leaf, np.generic)
        host = to_host(_readable_copy(leaf), copy=copy, path=where)
        entry, buf = plan_leaf(names, host)
        if was_np_scalar:
            entry["scalar"] = True
        if buf is not None:
            offset = (offset + 63) // 64 * 64
            entry["offset"] = offset
            offset += buf.nbytes
        entries.append(entry)
        buffers.append(buf)
    for *_, data in pending:  # start every device-to-host copy before waiting on any
        try:
            data.copy_to_host_async()
        except Exception:  # already on the host
            pass
    for i, names, box, data in pending:
        host = np.asarray(data)
        if copy and not _transfer_made_a_copy(data):  # on GPU/TPU the transfer is the copy
            host = np.array(host, copy=True)
        shards.append((i, names, box, host))
    primary_plan = ItemPlan(skel, entries, buffers, offset) if is_primary else None
    return ProcessItemPlan(primary_plan, plan_shards(shards), num_sharded)


def _readable_copy(leaf: Any) -> Any:
    """A leaf the primary can read whole: one replica of a replicated global array."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if is_prng_key(leaf):
            data = jax.random.key_data(leaf).addressable_data(0)
            return HostKey(np.asarray(data), str(jax.random.key_impl(leaf)))
        return leaf.addressable_data(0)
    return leaf
