"""Orbax checkpoints next to minickpt's: recognising them, and converting them.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checkpointer import FORMAT_NAME
from .commit import METADATA_FILE, is_temporary
from .errors import CheckpointCorruptedError, CheckpointNotFoundError, MiniCkptError
from .fs import DEFAULT_FS, FileSystem

ORBAX = "an Orbax checkpoint"
# Orbax names a step "<N>" (its default) or "<prefix>_<N>"; temporaries carry this mark
_ORBAX_STEP_RE = re.compile(r"^(?:.+_)?([0-9]+)$")
_ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
# files only Orbax writes: in a step (the commit marker on file systems without atomic
# rename) and in an item directory (PyTree/Standard handlers, OCDBT)
_STEP_FILES = ("commit_success.txt",)
_ITEM_FILES = ("_METADATA", "manifest.ocdbt", "_sharding")
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


def _read_json(fs: FileSystem, path: str) -> Any:
    """A small JSON file, or None; never follows a link nor opens a FIFO (a hostile
    checkpoint must not make a look at it read elsewhere, block, or recurse)."""
    if not stat.S_ISREG(_lstat_mode(fs, path)):
        return None
    try:
        return json.loads(fs.read_file(path, _MAX_METADATA))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _real_dir(fs: FileSystem, path: str) -> bool:
    return stat.S_ISDIR(_lstat_mode(fs, path))


def is_orbax_checkpoint(path: str, fs: FileSystem | None = None) -> bool:
    """Whether the directory ``path`` is laid out as an Orbax step (or item) checkpoint.

    minickpt's own ``_CHECKPOINT_METADATA`` names its format, so a minickpt checkpoint is
    never taken for Orbax's, damaged or not. An ``OSError`` (EIO ...) propagates: not being
    able to look says nothing about whose checkpoint it is.
    """
    fs = fs or DEFAULT_FS
    if not _real_dir(fs, path):
        return False
    names = set(fs.listdir(path))
    if METADATA_FILE in names:
        meta = _read_json(fs, os.path.join(path, METADATA_FILE))
        if isinstance(meta, dict):
            if meta.get("format") == FORMAT_NAME:
                return False
            if "item_handlers" in meta or "item_metadata" in meta:
                return True
    if names & {*_STEP_FILES, *_ITEM_FILES}:
        return True
    for name in sorted(names):
        sub = os.path.join(path, name)
        if _real_dir(fs, sub) and set(fs.listdir(sub)) & set(_ITEM_FILES):
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


# ---- conversion ---------------------------------------------------------------------------
@dataclass
class Converted:
    """One Orbax step converted: where it came from and went, and what was checked."""

    step: int
    source: str
    path: str
    items: list[str]
    leaves: int
    skipped: bool = False  # already converted (the minickpt step was there and verified)


def _item_dirs(step_dir: str, fs: FileSystem) -> dict[str, str]:
    """An Orbax step's items: name -> directory (a bare PyTree save is item 'default')."""
    names = set(fs.listdir(step_dir))
    if names & set(_ITEM_FILES):
        return {"default": step_dir}
    items = {}
    for name in sorted(names):
        sub = os.path.join(step_dir, name)
        if _real_dir(fs, sub) and set(fs.listdir(sub)) & set(_ITEM_FILES):
            items[name] = sub
    return items


def _orbax_metrics(step_dir: str, fs: FileSystem) -> dict[str, Any] | None:
    """A step's metrics: Orbax's JSON item ``metrics/metrics`` (CheckpointManager's
    ``metrics=``), else those its step metadata records."""
    path = os.path.join(step_dir, "metrics", "metrics")
    metrics = _read_json(fs, path) if fs.exists(path) else None
    if not isinstance(metrics, dict) or not metrics:
        meta = _read_json(fs, os.path.join(step_dir, METADATA_FILE))
        metrics = meta.get("metrics") if isinstance(meta, dict) else None
    return metrics if isinstance(metrics, dict) and metrics else None


def _restore_item(path: str) -> Any:
    """One Orbax item restored by Orbax, its arrays as numpy arrays (no device needed)."""
    import jax
    import orbax.checkpoint as ocp

    ck = ocp.PyTreeCheckpointer()
    tree = ck.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                        is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
    try:
        return ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    except (TypeError, ValueError):  # a leaf numpy cannot hold as restore_type: Orbax's own
        return jax.tree.map(np.asarray, ck.restore(path))


def _leaves(tree: Any, at: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, Mapping):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], (*at, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*at, i))
    else:
        yield at, tree


def compare_leaves(expected: Any, got: Any, where: str) -> int:
    """Check ``got`` holds every leaf of ``expected`` with its dtype, shape and bytes;
    returns the number of leaves, raises :class:`CheckpointCorruptedError` naming each
    difference."""
    want, have = dict(_leaves(expected)), dict(_leaves(got))
    problems = [f"{'/'.join(map(str, k))}: missing" for k in want if k not in have]
    problems += [f"{'/'.join(map(str, k))}: not in the original" for k in have if k not in want]
    for k in want.keys() & have.keys():
        a, b = np.asarray(want[k]), np.asarray(have[k])
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            problems.append(f"{'/'.join(map(str, k))}: {a.dtype}{list(a.shape)} differs from "
                            f"{b.dtype}{list(b.shape)} or its values")
    if problems:
        raise CheckpointCorruptedError(where, "the converted checkpoint differs from the "
                                       "Orbax one: " + "; ".join(sorted(problems)))
    return len(want)


def convert(source: str | os.PathLike[str], destination: str | os.PathLike[str], *,
            steps: Iterable[int] | None = None, options: Any = None,
            fs: FileSystem | None = None,
            on_step: Callable[[Converted], None] | None = None) -> list[Converted]:
    """Convert the Orbax checkpoints of run directory ``source`` into minickpt checkpoints
    in ``destination`` (a new or minickpt directory; never ``source`` itself: nothing is
    written into Orbax's directory).

    Each step (all, or ``steps``) is restored with Orbax, its arrays as numpy arrays, saved
    with its metrics as the same step (items keep Orbax's names; a single-item run's is
    ``default``), read back and compared leaf by leaf — dtype, shape and every byte — before
    the next. A step already in ``destination`` is compared instead of saved again, so an
    interrupted conversion resumes. Needs ``orbax-checkpoint`` installed.
    """
    from .manager import CheckpointManager, CheckpointManagerOptions

    fs = fs or DEFAULT_FS
    src, dst = os.path.abspath(os.fspath(source)), os.path.abspath(os.fspath(destination))
    if os.path.realpath(src) == os.path.realpath(dst):
        raise MiniCkptError(f"convert {src} into another directory: writing minickpt "
                            "checkpoints among Orbax's would change the directory Orbax reads")
    if not fs.is_dir(src):
        raise CheckpointNotFoundError(f"no such directory: {src}")
    found = orbax_steps(src, fs)
    if steps is not None:
        wanted = set(steps)
        if wanted - set(found):
            raise CheckpointNotFoundError(f"no Orbax checkpoint for step(s) "
                                          f"{sorted(wanted - set(found))} in {src} (Orbax "
                                          f"steps: {sorted(found) or 'none'})")
        found = {s: n for s, n in found.items() if s in wanted}
    if not found:
        raise CheckpointNotFoundError(f"no Orbax checkpoint in {src}")
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError as e:
        raise MiniCkptError("converting from Orbax restores with Orbax: pip install "
                            "orbax-checkpoint") from e
    out = []
    with CheckpointManager(dst, options or CheckpointManagerOptions(), fs=fs) as mngr:
        for step, name in sorted(found.items()):
            step_dir = os.path.join(src, name)
            item_dirs = _item_dirs(step_dir, fs)
            if not item_dirs:
                raise CheckpointCorruptedError(step_dir, "an Orbax step with no item minickpt "
                                               "can restore (no _METADATA in it or its items)")
            items = {item: _restore_item(p) for item, p in item_dirs.items()}
            metrics = _orbax_metrics(step_dir, fs)
            skipped = step in mngr.all_steps(read=True)
            if not skipped:
                mngr.save(step, items, metrics=metrics or None, force=True,
                          metadata={"converted_from": step_dir})
            back = mngr.restore(step, verify=True)
            n = sum(compare_leaves(items[i], back.get(i, {}), mngr.step_path(step))
                    for i in items)
            rec = Converted(step, step_dir, mngr.step_path(step), sorted(items), n, skipped)
            out.append(rec)
            if on_step is not None:
                on_step(rec)
    return out
