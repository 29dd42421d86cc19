"""Moving a run from Orbax: each Orbax step restored with Orbax itself, saved as a minickpt
checkpoint, and compared leaf by leaf (``minickpt convert-orbax SRC DST``; see
docs/orbax-migration.md). Recognising an Orbax directory is :mod:`minickpt.orbax_dirs`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .commit import METADATA_FILE
from .errors import CheckpointCorruptedError, CheckpointNotFoundError, MiniCkptError
from .fs import DEFAULT_FS, FileSystem
from .manager import CheckpointManager
from .options import CheckpointManagerOptions
from .orbax_dirs import ITEM_FILES, orbax_steps, read_json, real_dir


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
    if names & set(ITEM_FILES):
        return {"default": step_dir}
    items = {}
    for name in sorted(names):
        sub = os.path.join(step_dir, name)
        if real_dir(fs, sub) and set(fs.listdir(sub)) & set(ITEM_FILES):
            items[name] = sub
    return items


def _orbax_metrics(step_dir: str, fs: FileSystem) -> dict[str, Any] | None:
    """A step's metrics: Orbax's JSON item ``metrics/metrics`` (CheckpointManager's
    ``metrics=``), else those its step metadata records."""
    path = os.path.join(step_dir, "metrics", "metrics")
    metrics = read_json(fs, path) if fs.exists(path) else None
    if not isinstance(metrics, dict) or not metrics:
        meta = read_json(fs, os.path.join(step_dir, METADATA_FILE))
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
