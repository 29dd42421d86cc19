"""Flax's legacy ``save_checkpoint`` / ``restore_checkpoint``, on minickpt's durable core.

Many tutorials (and the course's seed material) use ``flax.training.checkpoints``. These two
functions keep its semantics so such code runs unchanged, while the bytes go through the same
atomic, durable, verified path as everything else:

* ``save_checkpoint`` writes ``<ckpt_dir>/<prefix><step>``, refuses a step at or before the
  latest unless ``overwrite=True`` (which then removes the newer ones), and keeps the ``keep``
  newest plus, among older ones, one every ``keep_every_n_steps`` steps — Flax's rule to the
  letter (:func:`minickpt.policy.legacy_steps_to_keep`), checked against Flax itself by
  ``tests/test_legacy.py``.
* ``restore_checkpoint`` restores the latest (or ``step``) into ``target`` — and returns
  ``target`` unchanged when there is nothing to restore, so "resume if you can, else start
  fresh" needs no ``if``. A missing ``step`` raises :class:`CheckpointNotFoundError`, which is
  both the ``FileNotFoundError`` minickpt raises and the ``ValueError`` Flax raises.

Deliberate differences from Flax: Flax's backend arguments (``async_manager``,
``orbax_checkpointer``, ``parallel``, ``gda_manager``, ``allow_partial_mpa_restoration``,
``orbax_transforms``) are accepted, so calls written for Flax run, and ignored — minickpt saves
synchronously in its own format. Steps are integers (a float step such as ``2.5`` is refused,
never truncated). Only ``<prefix><digits>`` directories count as checkpoints: Flax also counts,
and may delete, any other file whose name starts with the prefix, and parses a prefix ending in
``-`` as a minus sign.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from .checkpointer import Checkpointer
from .commit import METADATA_FILE, delete_dir, is_temporary, makedirs
from .errors import CheckpointNotFoundError, MiniCkptError
from .fs import DEFAULT_FS, FileSystem
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


def _int_step(step: Any) -> int:
    """``step`` as an int; a fractional step is an error rather than silently truncated."""
    as_int = int(step)
    if as_int != step:
        raise ValueError(f"minickpt's legacy checkpoints have integer steps, got {step!r}")
    return as_int


def latest_checkpoint(ckpt_dir: str | os.PathLike[str], prefix: str = "checkpoint_", *,
                      fs: FileSystem | None = None) -> str | None:
    """Path of the newest checkpoint in ``ckpt_dir``, or None."""
    steps = _steps(fs or DEFAULT_FS, os.fspath(ckpt_dir), prefix)
    return steps[max(steps)] if steps else None


def save_checkpoint(ckpt_dir: str | os.PathLike[str], target: Any, step: int,
                    prefix: str = "checkpoint_", keep: int = 1, overwrite: bool = False,
                    keep_every_n_steps: int | None = None, async_manager: Any = None,
                    orbax_checkpointer: Any = None, *, fs: FileSystem | None = None) -> str:
    """Save ``target`` as step ``step`` with Flax's legacy semantics; returns its path.

    ``async_manager`` and ``orbax_checkpointer`` are Flax's and ignored: the save is synchronous
    and durable when this returns, which is what a later ``wait_previous_save()`` waits for.
    """
    del async_manager, orbax_checkpointer  # accepted for Flax compatibility
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    step = _int_step(step)
    if keep < 0:  # checked before anything is written
        raise ValueError(f"keep must be >= 0, got {keep}")
    if not fs.is_dir(ckpt_dir):
        makedirs(fs, ckpt_dir)
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
                       prefix: str = "checkpoint_", parallel: bool = True,
                       gda_manager: Any = None, allow_partial_mpa_restoration: bool = False,
                       orbax_checkpointer: Any = None, orbax_transforms: Any = None, *,
                       partial: bool = False, fs: FileSystem | None = None) -> Any:
    """Task 1.4 — restore the latest (or ``step``) checkpoint into ``target``.

    Returns ``target`` itself when no checkpoint exists. ``ckpt_dir`` may also be the path of
    one checkpoint (when no ``step`` is given). Without a target (``None``) the saved tree comes
    back as nested dicts of numpy arrays. Asking for a ``step`` that does not exist is an error,
    not a fresh start. ``partial`` is :meth:`Checkpointer.restore`'s (``True``: a target that
    holds only some of the saved leaves gets those), and every file-system call goes through
    ``fs`` (whose paths need not be this machine's). The arguments from ``parallel`` to
    ``orbax_transforms`` are Flax's; they are accepted so Flax code runs unchanged, and ignored.
    """
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    if step is not None:  # as in Flax, ckpt_dir is then the directory of checkpoints
        path = os.path.join(ckpt_dir, f"{prefix}{step}")
        if not fs.is_dir(path):
            raise CheckpointNotFoundError(f"Matching checkpoint not found: {path}")
    elif not fs.exists(ckpt_dir):
        log.info("minickpt: no checkpoint directory at %s; returning the target unchanged",
                 ckpt_dir)
        return target
    elif not fs.is_dir(ckpt_dir) or fs.exists(os.path.join(ckpt_dir, METADATA_FILE)) \
            or re.fullmatch(rf"{re.escape(prefix)}[0-9]+", os.path.basename(ckpt_dir)):
        path = ckpt_dir  # one checkpoint (whatever its name); Checkpointer says if it is not
    else:
        latest = latest_checkpoint(ckpt_dir, prefix, fs=fs)
        if latest is None:
            log.info("minickpt: found no checkpoint in %s with prefix %r; returning the target "
                     "unchanged", ckpt_dir, prefix)
            return target
        path = latest
    restored = Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)
    return restored[ITEM]
