"""Flax's legacy ``save_checkpoint`` / ``restore_checkpoint``, on minickpt's durable core.

Many tutorials (and the course's seed material) use ``flax.training.checkpoints``. These two
functions keep its semantics so such code runs unchanged, while the bytes go through the same
atomic, durable, verified path as everything else:

* ``save_checkpoint`` writes ``<ckpt_dir>/<prefix><step>``, refuses a step at or before the
  latest unless ``overwrite=True`` (which then removes the newer ones), and keeps the ``keep``
  newest plus, among older ones, one every ``keep_every_n_steps`` steps.
* ``restore_checkpoint`` restores the latest (or ``step``) into ``target`` — and returns
  ``target`` unchanged when there is nothing to restore, so "resume if you can, else start
  fresh" needs no ``if``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from .checkpointer import Checkpointer
from .commit import delete_dir, is_temporary
from .errors import CheckpointNotFoundError, MiniCkptError
from .fs import DEFAULT_FS, FileSystem
from .manager import _makedirs
from .policy import legacy_steps_to_keep

log = logging.getLogger("minickpt")
ITEM = "state"


class InvalidCheckpointError(MiniCkptError, ValueError):
    """Saving at a step that is not newer than the latest, without ``overwrite=True``."""

    def __init__(self, path: str, step: int):
        super().__init__(f'Trying to save an outdated checkpoint at step {step} ({path}): a '
                         "checkpoint at this or a later step exists. Pass overwrite=True to "
                         "replace it (newer checkpoints are then removed).")


def _steps(fs: FileSystem, ckpt_dir: str, prefix: str) -> dict[int, str]:
    pat = re.compile(rf"{re.escape(prefix)}([0-9]+)")
    out = {}
    try:
        names = fs.listdir(ckpt_dir)
    except FileNotFoundError:
        return out
    for name in names:
        m = pat.fullmatch(name)
        if m and not is_temporary(name) and fs.is_dir(os.path.join(ckpt_dir, name)):
            out[int(m.group(1))] = os.path.join(ckpt_dir, name)
    return out


def latest_checkpoint(ckpt_dir: str | os.PathLike[str], prefix: str = "checkpoint_", *,
                      fs: FileSystem | None = None) -> str | None:
    """Path of the newest checkpoint in ``ckpt_dir``, or None."""
    steps = _steps(fs or DEFAULT_FS, os.fspath(ckpt_dir), prefix)
    return steps[max(steps)] if steps else None


def save_checkpoint(ckpt_dir: str | os.PathLike[str], target: Any, step: int,
                    prefix: str = "checkpoint_", keep: int = 1, overwrite: bool = False,
                    keep_every_n_steps: int | None = None, *,
                    fs: FileSystem | None = None) -> str:
    """Save ``target`` as step ``step`` with Flax's legacy semantics; returns its path."""
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    step = int(step)
    if not fs.is_dir(ckpt_dir):
        _makedirs(fs, ckpt_dir)
    steps = _steps(fs, ckpt_dir, prefix)
    path = os.path.join(ckpt_dir, f"{prefix}{step}")
    if steps and max(steps) >= step:
        if not overwrite:
            raise InvalidCheckpointError(path, step)
        if step in steps:
            delete_dir(fs, steps.pop(step))
    Checkpointer(fs).save(path, {ITEM: target}, step=step)
    steps[step] = path
    # newer checkpoints are invalid once an older step was explicitly overwritten
    for s in sorted(s for s in steps if s > step):
        log.info("minickpt: removing checkpoint %s (newer than overwritten step %d)",
                 steps[s], step)
        delete_dir(fs, steps.pop(s))
    for s in sorted(set(steps) - legacy_steps_to_keep(list(steps), keep, keep_every_n_steps)):
        log.info("minickpt: removing checkpoint %s", steps[s])
        delete_dir(fs, steps[s])
    return path


def restore_checkpoint(ckpt_dir: str | os.PathLike[str], target: Any, step: int | None = None,
                       prefix: str = "checkpoint_", *, partial: bool = False,
                       fs: FileSystem | None = None) -> Any:
    """Task 1.4 — restore the latest (or ``step``) checkpoint into ``target``.

    Returns ``target`` itself when no checkpoint exists. ``ckpt_dir`` may also be the path of
    one checkpoint. Without a target (``None``) the saved tree comes back as nested dicts of
    numpy arrays. Asking for a ``step`` that does not exist is an error, not a fresh start.
    """
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    base = os.path.basename(ckpt_dir)
    if base.startswith(prefix) and re.fullmatch(rf"{re.escape(prefix)}[0-9]+", base) \
            and fs.is_dir(ckpt_dir):
        path = ckpt_dir
    elif step is not None:
        path = os.path.join(ckpt_dir, f"{prefix}{int(step)}")
        if not fs.is_dir(path):
            raise CheckpointNotFoundError(f"Matching checkpoint not found: {path}")
    else:
        latest = latest_checkpoint(ckpt_dir, prefix, fs=fs)
        if latest is None:
            log.info("minickpt: found no checkpoint in %s with prefix %r; returning the target "
                     "unchanged", ckpt_dir, prefix)
            return target
        path = latest
    restored = Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)
    return restored[ITEM]
