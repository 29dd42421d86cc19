"""Model versioning: which code wrote a checkpoint, which checkpoint is best, and moving an old
checkpoint onto a new model.

* Every checkpoint's metadata records the git commit (and branch) of the working tree the
  training process was started in, read from ``.git`` directly — no ``git`` process, nothing
  that can make a save fail. Set ``MINICKPT_GIT=0`` to leave it out.
* :func:`best_checkpoint` picks a checkpoint by a metric, filtered by your metadata (a version
  tag, a config value), reading only the small metadata files, never the arrays.
* :func:`migrate_checkpoint` restores an old checkpoint onto a changed model: rename or map
  key paths, keep the new model's initial values for new parameters, drop what is gone.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..checkpointer import Checkpointer, CheckpointMetadata
from ..commit import METADATA_FILE, parse_step
from ..errors import MiniCkptError
from ..fs import DEFAULT_FS, FileSystem
from ..gitinfo import _git_info_cached, git_info
from ..restore import MigrationReport, Rename, migrate

log = logging.getLogger("minickpt")

__all__ = ["_git_info_cached", "best_checkpoint", "checkpoint_metadata", "git_info",
           "metadata_matches", "metric_value", "migrate_checkpoint", "select_best"]


# ---------------------------------------------------------------------------------------
# the best checkpoint, from metadata only
# ---------------------------------------------------------------------------------------
def _lookup(tree: Any, key: str) -> Any:
    """``tree[key]``, or a dotted path into nested mappings; KeyError when absent."""
    if isinstance(tree, Mapping) and key in tree:
        return tree[key]
    cur = tree
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise KeyError(key)
        cur = cur[part]
    return cur


def metadata_matches(meta: CheckpointMetadata,
                     where: Mapping[str, Any] | Callable[[CheckpointMetadata], bool] | None
                     ) -> bool:
    """Whether a checkpoint's metadata pass ``where``: None passes everything; a predicate is
    called on the whole metadata; a mapping needs each key (dotted for nested values) in the
    custom metadata with that value, or a value the given predicate accepts."""
    if where is None:
        return True
    if callable(where):
        return bool(where(meta))
    for key, want in where.items():
        try:
            got = _lookup(meta.custom_metadata, key)
        except KeyError:
            return False
        if callable(want) and not isinstance(want, type):
            if not want(got):
                return False
        elif got != want:
            return False
    return True


def metric_value(meta: CheckpointMetadata, metric: str | Callable[[Mapping[str, Any]], Any]
                 ) -> float | None:
    """The checkpoint's value of ``metric`` (a name, dotted for nested metrics, or a function
    of the metrics) as a float; None when it has none that can be compared (no metrics, the
    name missing, not a number, NaN)."""
    if meta.metrics is None:
        return None
    try:
        v = metric(meta.metrics) if callable(metric) else _lookup(meta.metrics, metric)
        v = float(v)
    except (KeyError, TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def checkpoint_metadata(source: Any, *, fs: FileSystem | None = None
                        ) -> list[CheckpointMetadata]:
    """The metadata of every readable checkpoint of a manager or a run directory, ascending
    by step (damaged ones are skipped with a log line), or already-read metadata (a list of
    :class:`~minickpt.CheckpointMetadata`, returned as it is). Reads no array."""
    if isinstance(source, (list, tuple)):
        return list(source)
    if hasattr(source, "all_steps") and hasattr(source, "metadata"):
        steps, read = source.all_steps(read=True), source.metadata
    else:
        root = os.fspath(source)
        ck = Checkpointer(fs or DEFAULT_FS)
        names = (fs or DEFAULT_FS).listdir(root)
        found = sorted((s, n) for n in names if (s := parse_step(n)) is not None)
        steps = [s for s, _ in found]
        by_step = dict(found)

        def read(step: int) -> CheckpointMetadata:
            return ck.metadata(os.path.join(root, by_step[step]))
    out = []
    for s in steps:
        try:
            out.append(read(s))
        except (MiniCkptError, OSError) as e:
            log.warning("minickpt: skipping checkpoint step %d, its metadata is unreadable: %s",
                        s, e)
    return out


def best_checkpoint(source: Any, metric: str | Callable[[Mapping[str, Any]], Any], *,
                    mode: str = "min",
                    where: Mapping[str, Any] | Callable[[CheckpointMetadata], bool] | None = None,
                    fs: FileSystem | None = None) -> CheckpointMetadata | None:
    """Task 6.5 — the metadata of the best checkpoint by a metric, among those whose
    metadata match ``where``, read from the small metadata files only, never the arrays.

    ``source`` is a manager, a run directory or a list of metadata (see
    :func:`checkpoint_metadata`); ``metric`` and ``where`` as :func:`metric_value` and
    :func:`metadata_matches` read them. ``mode`` is ``"min"`` (a loss) or ``"max"`` (an
    accuracy); anything else is a ValueError. A checkpoint without a usable value, a finite
    number, never wins: NaN and ±inf are what a diverged run reports, and the manager's
    ``best_step`` never names such a checkpoint either. On a tie the newer step wins; None
    when no checkpoint qualifies.
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    best, best_key = None, None
    for meta in checkpoint_metadata(source, fs=fs):
        if not metadata_matches(meta, where):
            continue
        v = metric_value(meta, metric)
        if v is None or not math.isfinite(v):  # ±inf compares, but is a diverged run's value
            continue
        key = (v if mode == "max" else -v, meta.step if meta.step is not None else -1)
        if best_key is None or key > best_key:
            best, best_key = meta, key
    return best


def select_best(candidates: Iterable[CheckpointMetadata],
                metric: str | Callable[[Mapping[str, Any]], Any], *, mode: str = "min",
                where: Mapping[str, Any] | Callable[[CheckpointMetadata], bool] | None = None
                ) -> CheckpointMetadata | None:
    """:func:`best_checkpoint` among metadata already read (``metric``, ``mode``, ``where``
    as there)."""
    return best_checkpoint(list(candidates), metric, mode=mode, where=where)


# ---------------------------------------------------------------------------------------
# migration to a new model structure
# ---------------------------------------------------------------------------------------
def migrate_checkpoint(source: Any, target: Mapping[str, Any], *, step: int | None = None,
                       rename: Rename | None = None, fill_missing: bool = True,
                       allow_cast: bool = False, fs: FileSystem | None = None
                       ) -> tuple[dict[str, Any], dict[str, MigrationReport]]:
    """Restore an old checkpoint onto a new model's structure.

    ``source`` is a manager, a run directory (the latest step, or ``step``) or one checkpoint
    directory; ``target`` maps item names to the *new* model's trees (e.g. a freshly
    initialised ``TrainState``). Each item is read without a target and mapped with
    :func:`minickpt.restore.migrate`: saved key paths renamed by ``rename`` (regexes on
    slash paths, or a function), new leaves kept from the target (``fill_missing``), leaves
    the new model lacks dropped. Returns the migrated items and one report per item, to read
    before saving the result as a new checkpoint.
    """
    ck = Checkpointer(fs or getattr(source, "fs", None) or DEFAULT_FS)
    if hasattr(source, "step_path"):
        path = source.step_path(step if step is not None else source.latest_step())
    else:
        path = os.fspath(source)
        if not ck.fs.exists(os.path.join(path, METADATA_FILE)):
            metas = checkpoint_metadata(path, fs=ck.fs)
            if not metas:
                raise MiniCkptError(f"no readable checkpoint in {path}")
            chosen = next((m for m in metas if m.step == step), None) if step is not None \
                else metas[-1]
            if chosen is None:
                raise MiniCkptError(f"no checkpoint for step {step} in {path}")
            path = next(os.path.join(path, n) for n in ck.fs.listdir(path)
                        if parse_step(n) == chosen.step)
    saved = ck.restore(path, {name: None for name in target})
    out, reports = {}, {}
    for name, new_tree in target.items():
        out[name], reports[name] = migrate(saved[name], new_tree, rename=rename,
                                           fill_missing=fill_missing, allow_cast=allow_cast)
    return out, reports
