"""Orbax checkpoints next to minickpt's: recognising them (converting them: :mod:`minickpt.orbax_convert`).

minickpt does not read Orbax's format (OCDBT/Zarr through TensorStore), but it must know one
when it sees one: a writable manager that took an Orbax step for a damaged checkpoint of its
own would count it, delete it through retention, or move it aside. Here a step is "an
Orbax checkpoint" by its layout only (no Orbax import): the files Orbax writes into every
step and item directory. :func:`convert` is the way over for a run moving from Orbax: each
step is restored *with Orbax itself*, saved as a minickpt checkpoint, and read back and
compared leaf by leaf before the next one.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from .commit import METADATA_FILE, is_temporary
from .format.spec import FORMAT_NAME
from .fs import DEFAULT_FS, FileSystem

ORBAX = "an Orbax checkpoint"
# Orbax names a step "<N>" (its default) or "<prefix>_<N>"; temporaries carry this mark
_ORBAX_STEP_RE = re.compile(r"^(?:.+_)?([0-9]+)$")
_ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
# files only Orbax writes: in a step (the commit marker on file systems without atomic
# rename) and in an item directory (PyTree/Standard handlers, OCDBT)
_STEP_FILES = ("commit_success.txt",)
ITEM_FILES = ("_METADATA", "manifest.ocdbt", "_sharding")
_MAX_METADATA = 1 << 20


def orbax_step_number(name: str) -> int | None:
    """The step an Orbax step directory's name stands for (``"100"``, ``"ckpt_100"``)."""
    if is_temporary(name) or _ORBAX_TMP_MARK in name or ".minickpt-" in name:
        return None
    m = _ORBAX_STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _lstat_mode(fs: FileSystem, path: str) -> int:
    try:
        return fs.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def read_json(fs: FileSystem, path: str) -> Any:
    """A small JSON file, or None; never follows a link nor opens a FIFO (a hostile
    checkpoint must not make a look at it read elsewhere, block, or recurse)."""
    if not stat.S_ISREG(_lstat_mode(fs, path)):
        return None
    try:
        return json.loads(fs.read_file(path, _MAX_METADATA))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def real_dir(fs: FileSystem, path: str) -> bool:
    return stat.S_ISDIR(_lstat_mode(fs, path))


def is_orbax_checkpoint(path: str, fs: FileSystem | None = None) -> bool:
    """Whether the directory ``path`` is laid out as an Orbax step (or item) checkpoint.

    minickpt's own ``_CHECKPOINT_METADATA`` names its format, so a minickpt checkpoint is
    never taken for Orbax's, damaged or not. An ``OSError`` (EIO ...) propagates: not being
    able to look says nothing about whose checkpoint it is.
    """
    fs = fs or DEFAULT_FS
    if not real_dir(fs, path):
        return False
    names = set(fs.listdir(path))
    if METADATA_FILE in names:
        meta = read_json(fs, os.path.join(path, METADATA_FILE))
        if isinstance(meta, dict):
            if meta.get("format") == FORMAT_NAME:
                return False
            if "item_handlers" in meta or "item_metadata" in meta:
                return True
    if names & {*_STEP_FILES, *ITEM_FILES}:
        return True
    for name in sorted(names):
        sub = os.path.join(path, name)
        if real_dir(fs, sub) and set(fs.listdir(sub)) & set(ITEM_FILES):
            return True
    return False


def orbax_steps(directory: str, fs: FileSystem | None = None) -> dict[int, str]:
    """The Orbax step checkpoints in a run directory: step -> directory name."""
    fs = fs or DEFAULT_FS
    found: dict[int, str] = {}
    for name in sorted(fs.listdir(directory)):
        step = orbax_step_number(name)
        path = os.path.join(directory, name)
        if step is not None and step not in found and is_orbax_checkpoint(path, fs):
            found[step] = name
    return found


def foreign_note(directory: str, steps: Mapping[int, str]) -> str:
    """What to tell a user whose directory holds Orbax checkpoints."""
    shown = ", ".join(map(str, sorted(steps)[:10])) + (" ..." if len(steps) > 10 else "")
    return (f"{directory} holds {len(steps)} Orbax checkpoint(s) (steps {shown}), which "
            "minickpt does not read, count or delete; convert them with `minickpt "
            f"convert-orbax {directory} NEW_DIR` (see docs/orbax-migration.md)")


def orbax_metrics(step_dir: str, fs: FileSystem | None = None) -> dict[str, Any] | None:
    """An Orbax step's metrics: Orbax's JSON item ``metrics/metrics`` (CheckpointManager's
    ``metrics=``), else those its step metadata records; None without any."""
    fs = fs or DEFAULT_FS
    metrics = read_json(fs, os.path.join(step_dir, "metrics", "metrics"))
    if not isinstance(metrics, dict) or not metrics:
        meta = read_json(fs, os.path.join(step_dir, METADATA_FILE))
        metrics = meta.get("metrics") if isinstance(meta, dict) else None
    return metrics if isinstance(metrics, dict) and metrics else None


def orbax_summary(step_dir: str, fs: FileSystem | None = None) -> dict[str, Any]:
    """What minickpt can say of an Orbax step from its JSON files alone (no Orbax import,
    no array read): its commit time, metrics, and items — each item's handler and, for a
    PyTree item, its leaves' key paths and Orbax's value types."""
    fs = fs or DEFAULT_FS
    meta = read_json(fs, os.path.join(step_dir, METADATA_FILE))
    meta = meta if isinstance(meta, dict) else {}
    handlers = meta.get("item_handlers")
    handlers = handlers if isinstance(handlers, dict) else {}
    names = set(fs.listdir(step_dir))
    dirs = {"default": step_dir} if names & set(ITEM_FILES) else {
        n: os.path.join(step_dir, n) for n in sorted(names | set(handlers))
        if not n.startswith(".") and _ORBAX_TMP_MARK not in n
        and real_dir(fs, os.path.join(step_dir, n))}
    items: dict[str, Any] = {}
    for name, d in sorted(dirs.items()):
        handler = str(handlers.get(name) or "").rsplit(".", 1)[-1] or "unknown handler"
        tree = read_json(fs, os.path.join(d, "_METADATA"))
        tree = tree.get("tree_metadata") if isinstance(tree, dict) else None
        leaves = []
        for rec in tree.values() if isinstance(tree, dict) else []:
            keys = rec.get("key_metadata") if isinstance(rec, dict) else None
            value = rec.get("value_metadata") if isinstance(rec, dict) else None
            if isinstance(keys, list):
                leaves.append({
                    "path": "/".join(str(k.get("key")) for k in keys if isinstance(k, dict)),
                    "type": str(value.get("value_type", "?")) if isinstance(value, dict)
                    else "?"})
        items[name] = {"handler": handler,
                       "leaves": sorted(leaves, key=lambda x: x["path"]) if tree else None}
    when = meta.get("commit_timestamp_nsecs")
    return {"time": when if isinstance(when, int) else None,
            "metrics": orbax_metrics(step_dir, fs), "items": items}
