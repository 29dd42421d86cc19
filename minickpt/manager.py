"""CheckpointManager: steps, save policy, retention, restore with verification and fallback.

Its options and methods carry Orbax's names (``save_interval_steps``, ``max_to_keep``,
``keep_period``, ``best_fn``, ``latest_step`` ...) so what you learn here transfers. The
decisions themselves — save this step? keep which steps? — are pure functions in
:mod:`minickpt.policy`; this class only applies them to a directory.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import policy
from .checkpointer import Checkpointer, CheckpointMetadata, SaveStats, VerifyReport
from .commit import (
    cleanup_temporaries,
    delete_dir,
    parse_step,
    remove_retired,
    retire_dir,
    step_dir_name,
)
from .errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    MiniCkptError,
    StepAlreadyExistsError,
)
from .fs import DEFAULT_FS, FileSystem

log = logging.getLogger("minickpt")
LOCK_FILE = ".minickpt.lock"


@dataclass
class CheckpointManagerOptions:
    """Options with Orbax's names and meanings (``step_prefix`` defaults to ``"step"`` here,
    giving ``step_100/``; Orbax's default is a bare ``100/``)."""

    save_interval_steps: int = 1
    save_on_steps: Collection[int] | None = None
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = "step"
    step_format_fixed_length: int | None = None
    create: bool = True
    cleanup_tmp_directories: bool = True
    read_only: bool = False
    enable_async_checkpointing: bool = False
    # Remove a deleted checkpoint's files on a background thread. The deletion itself (the
    # rename out of the step namespace) still happens inside save(), after the new
    # checkpoint is durable; the fsync that makes it durable and the unlinking — slow on a
    # busy or remote file system — leave the critical path, in that order.
    # wait_until_finished()/close() wait for them.
    enable_background_delete: bool = False
    # minickpt's own
    verify_on_restore: bool = True
    fallback_on_damage: bool = True
    lock: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.save_interval_steps, int) or self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be an int >= 1, got "
                             f"{self.save_interval_steps!r}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {self.max_to_keep!r}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be None or >= 1, got {self.keep_period!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        self.save_on_steps = frozenset(self.save_on_steps or ())


class Restored(dict):
    """The items restored, by name; ``.step`` says which step they came from."""

    step: int | None = None


class CheckpointManager:
    """Saves a training run's checkpoints under one directory, one sub-directory per step.

    >>> mngr = CheckpointManager("/tmp/run", CheckpointManagerOptions(max_to_keep=3))
    >>> mngr.save(100, {"params": params, "opt_state": opt_state}, metrics={"loss": 0.3})
    >>> restored = mngr.restore(target={"params": params, "opt_state": opt_state})
    """

    def __init__(self, directory: str | os.PathLike[str],
                 options: CheckpointManagerOptions | None = None, *,
                 fs: FileSystem | None = None, primary: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.options = options or CheckpointManagerOptions()
        self.fs = fs or DEFAULT_FS
        self.primary = primary
        self._checkpointer = Checkpointer(self.fs)
        self._lock_fd: int | None = None
        self._closed = False
        self._mutex = threading.RLock()
        self.last_save_stats: SaveStats | None = None
        self.save_history: collections.deque[SaveStats] = collections.deque(maxlen=1000)
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.removed_temporaries: list[str] = []
        self._remover: Any = None  # ThreadPoolExecutor for enable_background_delete
        self._removals: list[Any] = []  # its pending futures
        opts = self.options
        if not self.fs.is_dir(self.directory):
            if self.fs.exists(self.directory):
                raise NotADirectoryError(f"{self.directory} exists and is not a directory")
            if opts.read_only or not opts.create:
                raise CheckpointNotFoundError(
                    f"checkpoint directory {self.directory} does not exist"
                    + ("" if opts.read_only else " (pass create=True to make it)"))
            _makedirs(self.fs, self.directory)
        if not opts.read_only and self.primary:
            if opts.lock:
                self._acquire_lock()
            if opts.cleanup_tmp_directories:
                self.removed_temporaries = cleanup_temporaries(self.fs, self.directory)
                for name in self.removed_temporaries:
                    log.warning("minickpt: removed %s left by an interrupted save or delete",
                                os.path.join(self.directory, name))
        self._infos: dict[int, policy.StepInfo] = {}
        self.reload()

    # ---- housekeeping --------------------------------------------------------------------
    def _acquire_lock(self) -> None:
        path = os.path.join(self.directory, LOCK_FILE)
        fd = self.fs.open(path, os.O_RDWR | os.O_CREAT)
        try:
            self.fs.flock(fd, exclusive=True, blocking=False)
        except OSError as e:
            self.fs.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_small(path)
                raise MiniCkptError(
                    f"another CheckpointManager is writing to {self.directory} ({holder}). Two "
                    "writers on one directory would interleave checkpoints; open this one with "
                    "read_only=True to read, or use another directory.") from e
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                warnings.warn(f"file locking is not supported on {self.directory}; minickpt "
                              "cannot stop two writers from sharing it", stacklevel=3)
                return
            raise
        os.ftruncate(fd, 0)  # the lock file is a note for people, not checkpoint data
        self.fs.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                self.fs.close(self._lock_fd)
            finally:
                self._lock_fd = None

    def _emit(self, event: str, record: dict[str, Any]) -> None:
        for fn in list(self.listeners):
            try:
                fn(event, record)
            except Exception:  # a broken listener must never break a save
                log.exception("minickpt: listener failed on %s", event)

    def step_path(self, step: int) -> str:
        """The directory of ``step``'s checkpoint."""
        return os.path.join(self.directory, step_dir_name(
            step, self.options.step_prefix, self.options.step_format_fixed_length))

    def reload(self) -> None:
        """Re-read which checkpoints exist (after another process changed the directory)."""
        with self._mutex:
            infos: dict[int, policy.StepInfo] = {}
            try:
                names = self.fs.listdir(self.directory)
            except FileNotFoundError:
                names = []
            for name in names:
                step = parse_step(name, self.options.step_prefix)
                if step is None or not self.fs.is_dir(os.path.join(self.directory, name)):
                    continue
                old = self._infos.get(step)
                if old is not None:
                    infos[step] = old
                    continue
                try:
                    meta = self._checkpointer.metadata(os.path.join(self.directory, name))
                    infos[step] = policy.StepInfo(step, meta.metrics, meta.time or 0.0)
                except (MiniCkptError, OSError):
                    infos[step] = policy.StepInfo(step, None, 0.0)
            self._infos = infos

    def close(self) -> None:
        """Finish pending work and release the directory."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            if self._remover is not None:
                self._remover.shutdown(wait=True)
                self._remover = None
            self._release_lock()
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release_lock()
        except Exception:
            pass

    def wait_until_finished(self) -> None:
        """Block until every save has committed (saves are synchronous here) and every
        background removal of a deleted checkpoint has finished."""
        self._finish_removals()

    def is_saving_in_progress(self) -> bool:
        return False

    # ---- queries -------------------------------------------------------------------------
    def all_steps(self, read: bool = False) -> list[int]:
        """Every committed step, ascending. ``read=True`` re-scans the directory first."""
        if read:
            self.reload()
        return sorted(self._infos)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best metric (``best_fn``, ``best_mode``); latest without best_fn."""
        o = self.options
        if o.best_fn is None:
            return self.latest_step()
        return policy.best_step(list(self._infos.values()), o.best_fn, o.best_mode)

    def metadata(self, step: int | None = None) -> CheckpointMetadata:
        """A step's metadata (metrics, your metadata, times, items) without loading arrays."""
        step = self._resolve(step)
        return self._checkpointer.metadata(self.step_path(step))

    def item_metadata(self, step: int | None = None) -> dict[str, Any]:
        """Each item's tree of ``{path: (dtype, shape)}``, read from the manifests only."""
        step = self._resolve(step)
        path = self.step_path(step)
        meta = self._checkpointer.metadata(path)
        out = {}
        for name in meta.items:
            m = self._checkpointer.manifest(path, name, meta)
            out[name] = {"/".join(e["path"]): (e.get("dtype", e.get("type")), e.get("shape"))
                         for e in m.entries}
        return out

    def verify(self, step: int | None = None, *, deep: bool = True) -> VerifyReport:
        """Check one step on disk (checksums too when ``deep``) without restoring it."""
        step = self._resolve(step)
        return self._checkpointer.verify(self.step_path(step), deep=deep)

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
        elif step not in self._infos:
            self.reload()
            if step not in self._infos:
                raise CheckpointNotFoundError(
                    f"no checkpoint for step {step} in {self.directory} "
                    f"(steps: {self.all_steps() or 'none'})")
        return step

    # ---- saving --------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save, under the options' interval and steps."""
        o = self.options
        last = self.latest_step()
        return policy.should_save(step, last_saved_step=last,
                                  save_interval_steps=o.save_interval_steps,
                                  save_on_steps=o.save_on_steps)

    def _check_writable(self) -> None:
        if self._closed:
            raise MiniCkptError("this CheckpointManager is closed")
        if self.options.read_only:
            raise MiniCkptError(f"{self.directory} was opened read_only=True")

    def save(self, step: int, items: Mapping[str, Any], *,
             metrics: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Save ``items`` (item name -> pytree) as ``step`` if the policy says so, or ``force``.

        Returns whether it saved. Retention runs only after the new checkpoint is durable.
        Raises :class:`StepAlreadyExistsError` if ``step`` is already committed.
        """
        self._check_writable()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        with self._mutex:
            if step in self._infos:
                raise StepAlreadyExistsError(
                    f"step {step} is already saved in {self.step_path(step)}; minickpt never "
                    "replaces a committed checkpoint (delete it first to save it again)")
            if not force and not self.should_save(step):
                return False
            stats = self._save_now(step, items, metrics, metadata)
        self._record(stats)
        return True

    def _save_now(self, step: int, items: Mapping[str, Any], metrics: Any,
                  metadata: Any) -> SaveStats:
        t0 = time.perf_counter()
        try:
            stats = self._checkpointer.save(self.step_path(step), items, step=step,
                                            metrics=metrics, custom_metadata=metadata)
        except BaseException as e:
            failed = SaveStats(step, self.step_path(step), ok=False,
                               error=f"{type(e).__name__}: {e}", start_time=time.time(),
                               total_s=time.perf_counter() - t0)
            self._record(failed)
            raise
        self._committed(step, metrics, stats)
        return stats

    def _committed(self, step: int, metrics: Any, stats: SaveStats) -> None:
        """Bookkeeping after a durable commit: remember the step, then apply retention."""
        with self._mutex:
            m = dict(metrics) if metrics is not None else None
            self._infos[step] = policy.StepInfo(step, m, time.time())
            t = time.perf_counter()
            self._apply_retention()
            stats.retention_s = time.perf_counter() - t

    def _apply_retention(self) -> None:
        o = self.options
        keep = policy.steps_to_keep(
            list(self._infos.values()), max_to_keep=o.max_to_keep, keep_period=o.keep_period,
            best_fn=o.best_fn, best_mode=o.best_mode,
            keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics)
        for step in sorted(set(self._infos) - keep):
            try:
                self._delete_step(step)
            except OSError as e:
                # The new checkpoint is safe; failing to remove an old one must not fail the
                # save, but it must not go unnoticed either (the disk will fill up).
                log.error("minickpt: could not delete old checkpoint %s: %s",
                          self.step_path(step), e)
                warnings.warn(f"could not delete old checkpoint {self.step_path(step)}: {e}",
                              stacklevel=4)

    def _delete_step(self, step: int) -> None:
        path = self.step_path(step)
        try:
            if self.options.enable_background_delete:
                # out of the step namespace now; durable (parent fsync) and removed on the
                # background thread — the fsync always before the first file is removed
                self._remove_later(retire_dir(self.fs, path, durable=False))
            else:
                delete_dir(self.fs, path)
        finally:
            # forget the step once its name is gone, even if removing its files failed
            # (what is left is a deletion temporary, cleaned at the next start-up)
            if not self.fs.is_dir(path):
                self._infos.pop(step, None)
        self._emit("delete", {"step": step, "time": time.time()})

    def _remove_later(self, doomed: str) -> None:
        """Remove a retired checkpoint's files on the background thread (FIFO, one at a time)."""
        from concurrent.futures import ThreadPoolExecutor

        self._finish_removals(block=False)
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="minickpt-delete")
        self._removals.append((doomed, self._remover.submit(remove_retired, self.fs, doomed)))

    def _finish_removals(self, block: bool = True) -> None:
        """Collect finished background removals (all of them when ``block``); a failure is
        logged and warned about — the checkpoint is already gone from the step namespace,
        and what is left is a deletion temporary that the next start-up removes."""
        keep = []
        for doomed, fut in self._removals:
            if not block and not fut.done():
                keep.append((doomed, fut))
                continue
            err = fut.exception()
            if err is not None:
                log.error("minickpt: could not remove %s: %s", doomed, err)
                warnings.warn(f"could not remove deleted checkpoint {doomed}: {err}",
                              stacklevel=3)
        self._removals = keep

    def delete(self, step: int) -> None:
        """Delete one checkpoint, crash-safely (it vanishes from the step list atomically)."""
        self._check_writable()
        with self._mutex:
            self._resolve(step)
            self._delete_step(step)

    def _record(self, stats: SaveStats) -> None:
        self.last_save_stats = stats
        self.save_history.append(stats)
        if self.listeners:  # as_dict() deep-copies: only when someone listens
            self._emit("save", stats.as_dict())

    # ---- restoring -----------------------------------------------------------------------
    def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None, *,
                partial: bool = False, verify: bool | None = None, sharding: Any = None,
                fallback: bool | None = None) -> Restored:
        """Restore a step's items (all, or those named in ``target``).

        Without ``step`` the latest is restored; if it is damaged and ``fallback`` (default:
        the options' ``fallback_on_damage``), the newest *valid* one is restored instead and a
        warning says which step was skipped and why. The result's ``.step`` says which step
        it is. A structural mismatch with ``target`` is never a reason to fall back.
        """
        verify = self.options.verify_on_restore if verify is None else verify
        fallback = self.options.fallback_on_damage if fallback is None else fallback
        if step is not None:
            return self._restore_step(self._resolve(step), target, partial, verify, sharding)
        steps = sorted(self.all_steps(read=True), reverse=True)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoint to restore in {self.directory}")
        errors: list[str] = []
        for s in steps:
            try:
                out = self._restore_step(s, target, partial, verify, sharding)
            except (CheckpointCorruptedError, OSError) as e:
                if isinstance(e, CheckpointNotFoundError) or not fallback:
                    raise
                msg = f"minickpt: skipping damaged checkpoint step {s}: {e}"
                log.error(msg)
                warnings.warn(msg, stacklevel=2)
                errors.append(f"step {s}: {e}")
                self._emit("skip", {"step": s, "error": str(e), "time": time.time()})
                continue
            return out
        raise CheckpointCorruptedError(self.directory, "every checkpoint is damaged:\n  "
                                       + "\n  ".join(errors))

    def _restore_step(self, step: int, target: Mapping[str, Any] | None, partial: bool,
                      verify: bool, sharding: Any) -> Restored:
        t0 = time.perf_counter()
        path = self.step_path(step)
        try:
            items = self._checkpointer.restore(path, target, partial=partial, verify=verify,
                                               sharding=sharding)
        except Exception as e:
            self._emit("restore", {"step": step, "ok": False, "error": f"{type(e).__name__}: "
                                   f"{e}", "total_s": time.perf_counter() - t0,
                                   "time": time.time()})
            raise
        out = Restored(items)
        out.step = step
        self._emit("restore", {"step": step, "ok": True, "total_s": time.perf_counter() - t0,
                               "time": time.time()})
        return out


def _makedirs(fs: FileSystem, path: str) -> None:
    parent = os.path.dirname(path)
    if parent and parent != path and not fs.exists(parent):
        _makedirs(fs, parent)
    try:
        fs.mkdir(path)
    except FileExistsError:
        return
    if parent:
        fs.fsync_dir(parent)


def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(200).strip() or "holder unknown"
    except OSError:
        return "holder unknown"
