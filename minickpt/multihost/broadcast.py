"""Restoring replicated state (``primary_only=True``): the primary reads, every process
receives the bytes through the coordination service."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..checkpointer import Checkpointer
from ..format.encode import decode_value, plan_leaf
from ..tree import HostKey
from .save import MultiHostOptions, failure_status, raise_failures
from .sync import Sync, fault_point

log = logging.getLogger("minickpt")


def _pack(values: Sequence[Any], skel: Any) -> np.ndarray:
    """Host values (arrays, keys, Python values) as one byte string: JSON header + data."""
    entries, chunks, offset = [], [], 0
    for v in values:
        if isinstance(v, (np.ndarray, np.generic, HostKey)):
            host = np.asarray(v) if isinstance(v, np.generic) else v
            entry, buf = plan_leaf((), host)
            entry.pop("path", None)
            if isinstance(v, np.generic):
                entry["scalar"] = True
            assert buf is not None
            offset = (offset + 63) // 64 * 64
            entry["offset"] = offset
            chunks.append((offset, buf))
            offset += buf.nbytes
        else:
            entry = plan_leaf((), v)[0]
            entry.pop("path", None)
        entries.append(entry)
    header = json.dumps({"entries": entries, "skeleton": skel}).encode()
    start = (8 + len(header) + 63) // 64 * 64
    out = np.zeros(start + offset, np.uint8)
    out[:8] = np.frombuffer(len(header).to_bytes(8, "little"), np.uint8)
    out[8:8 + len(header)] = np.frombuffer(header, np.uint8)
    for off, buf in chunks:
        out[start + off:start + off + buf.nbytes] = buf
    return out


def _unpack(payload: np.ndarray) -> tuple[list[Any], Any]:
    from ..format.spec import DTYPES

    n = int.from_bytes(payload[:8].tobytes(), "little")
    head = json.loads(payload[8:8 + n].tobytes().decode())
    start = (8 + n + 63) // 64 * 64
    values = []
    for e in head["entries"]:
        if e["kind"] == "value":
            values.append(decode_value(e, "broadcast restore"))
            continue
        dt = DTYPES[e["dtype"]]
        lo = start + e["offset"]
        arr = payload[lo:lo + e["nbytes"]].copy().view(dt).reshape(e["shape"])
        if e["kind"] == "prng_key":
            values.append(HostKey(arr, e["impl"]))
        else:
            values.append(arr[()] if e.get("scalar") else arr)
    return values, head["skeleton"]


def restore_broadcast(checkpointer: Checkpointer, sync: Sync, key: str, path: str,
                      target: Mapping[str, Any] | None, *, partial: bool, verify: bool,
                      sharding: Any, options: MultiHostOptions,
                      step: int | None = None) -> dict[str, Any]:
    """Restore on the primary, broadcast to all: the other processes never read the disk.

    ``step``: the step ``path``'s name stands for, checked against its metadata.

    Every process then places the values as its own target asks (its shardings). The
    primary's success or failure is exchanged (with a time-out) before the broadcast, so a
    damaged checkpoint fails everywhere instead of leaving the others in a collective.
    """
    from ..restore import finish_item, read_item_values

    me, src = sync.process_index, options.primary_host
    names = None if target is None else list(target)
    payloads: dict[str, np.ndarray] = {}
    local: BaseException | None = None
    sizes: dict[str, int] = {}
    if me == src:
        try:
            meta = checkpointer.metadata(path, step=step)
            if verify:
                checkpointer.check_listed(path, meta)
            names = list(meta.items) if names is None else names
            missing = [n for n in names if n not in meta.items]
            if missing:
                raise KeyError(f"checkpoint {path} has no item(s) {missing} "
                               f"(it has {sorted(meta.items)})")
            for name in names:
                m = checkpointer.manifest(path, name, meta)
                t = None if target is None else target[name]
                values = read_item_values(checkpointer.fs, m, t, item=name, partial=partial,
                                          verify=verify)
                payloads[name] = _pack(values, m.skeleton if t is None else None)
                sizes[name] = int(payloads[name].nbytes)
        except Exception as e:
            local = e
    statuses = sync.exchange(f"{key}/ready", failure_status(local, sizes=sizes, names=names)
                             if me == src else None, options.timeout_s,
                             f"restore of {path}: waiting for process {src} to read it")
    head = statuses[src]
    raise_failures({src: head}, me, local, f"restoring {path} on process {src}", reading=True)
    out = {}
    fault_point(sync, "before_broadcast")
    for name in head["names"]:
        payload = sync.broadcast_bytes(f"{key}/item/{name}", payloads.get(name),
                                       head["sizes"][name], src, options.timeout_s,
                                       f"restore of {path}: broadcasting item '{name}' from "
                                       f"process {src}")
        values, skel = _unpack(payload)
        t = None if target is None else target[name]
        out[name] = finish_item(values, skel, t, sharding)
    return out
