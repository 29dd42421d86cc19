"""Retention (chapter 2): applying the keep/delete decision of :mod:`minickpt.policy` to a
directory, crash-safely.

A step to delete is first renamed out of the step namespace (atomic: it is gone from every
listing at once), the rename made durable, and only then are its files removed, in the
foreground or on a background thread. An error while deleting never fails the save that
triggered it: what is left has a deletion name and is finished at the next save or start-up."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

from . import policy
from .commit import (
    DELETE_MARK,
    delete_dir,
    remove_retired,
    retire_dir,
)
from .errors import MiniCkptError
from .multihost.save import (
    failure_status,
    raise_failures,
)
from .multihost.sync import agree

log = logging.getLogger("minickpt")


class Retention:
    """The deleting part of :class:`~minickpt.manager.CheckpointManager`."""

    def _read_unreadable(self) -> None:
        """Try again to read the steps whose metadata could not be read (an EIO may pass)."""
        for step in sorted(self._unreadable):
            if step not in self._infos:
                del self._unreadable[step]
                continue
            try:
                meta = self._checkpointer.metadata(self.step_path(step), step=step)
            except (MiniCkptError, OSError):
                continue
            self._infos[step] = policy.StepInfo(step, meta.metrics, meta.time or 0.0)
            del self._unreadable[step]

    def _apply_retention(self) -> None:
        if self._sweep_deletions:
            self._sweep_deletions = False
            self._remove_deletion_leftovers()
        o = self.options
        self._read_unreadable()
        # only what this library wrote and can read is counted, and a candidate for deletion
        readable = self._scorable([i for s, i in self._infos.items()
                                   if s not in self._unreadable])
        keep = policy.steps_to_keep(
            readable, max_to_keep=o.max_to_keep, keep_period=o.keep_period,
            best_fn=o.best_fn, best_mode=o.best_mode,
            keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics,
        ) | policy.newest_steps(readable, o.keep_latest)
        self._check_bound(readable, keep, o.max_to_keep)
        for step in sorted({i.step for i in readable} - keep):
            try:
                self._delete_step(step)
            except OSError as e:
                # The new checkpoint is safe; failing to remove an old one must not fail the
                # save, but it must not go unnoticed either (the disk will fill up). What is
                # left has a deletion name: invisible, and removed at the next save.
                self._sweep_deletions = True
                log.error("minickpt: could not delete old checkpoint %s: %s",
                          self.step_path(step), e)
                warnings.warn(f"could not delete old checkpoint {self.step_path(step)}: {e}",
                              stacklevel=4)

    def _check_bound(self, infos: list[policy.StepInfo], keep: set[int],
                     max_to_keep: int | None, options: Any = None) -> None:
        """Warn once when retention keeps more than its stated bound, ``max_to_keep +
        keep_latest`` (``keep_period``'s steps aside): with ``best_fn`` set, every step saved
        without a metric is kept while ``keep_checkpoints_without_metrics=True`` (Orbax's
        default), so a run that passes metrics on its evaluation steps only fills the disk.
        ``options``: a tiered manager's own (its local manager keeps everything)."""
        o = options or self.options
        if getattr(self, "_bound_warned", False) or max_to_keep is None or o.best_fn is None \
                or not o.keep_checkpoints_without_metrics:
            return
        counted = {s for s in keep if not (o.keep_period and s % o.keep_period == 0)}
        bound = max_to_keep + (o.keep_latest or 0)
        unscored = {i.step for i in infos if i.metrics is None} & counted
        if len(counted) <= bound or not unscored:
            return
        self._bound_warned = True
        msg = (f"minickpt: retention in {self.directory} keeps {len(counted)} checkpoints, "
               f"over its bound max_to_keep + keep_latest = {bound}: {len(unscored)} of them "
               "were saved without a metric best_fn can score, and every such step is kept "
               "while keep_checkpoints_without_metrics=True (Orbax's default). Pass metrics "
               "on every save, or set keep_checkpoints_without_metrics=False, or the disk "
               "fills up (said once)")
        log.warning(msg)
        warnings.warn(msg, stacklevel=5)

    def _scorable(self, infos: list[policy.StepInfo]) -> list[policy.StepInfo]:
        """``infos`` as retention ranks them: the metrics ``best_fn`` raises on are no
        metric (the docs' promise), said once per step with the exception."""
        infos, errors = policy.scorable(infos, self.options.best_fn)
        for step, why in sorted(errors.items()):
            if step not in self._metric_errors:
                self._metric_errors.add(step)
                log.warning("minickpt: best_fn raised %s on the metrics of step %d; that "
                            "checkpoint counts as having no metric "
                            "(keep_checkpoints_without_metrics decides whether it is kept)",
                            why, step)
        return infos

    def _remove_deletion_leftovers(self) -> None:
        """Finish deletions an earlier error interrupted (only names marked for deletion)."""
        try:
            names = self.fs.listdir(self.directory)
        except OSError:
            return
        with self._removals_lock:  # being removed in the background: not a leftover
            busy = {os.path.basename(d) for d, fut in self._removals if not fut.done()}
        doomed = [n for n in sorted(names) if DELETE_MARK in n and n not in busy]
        if not doomed:
            return
        try:  # their renames must be durable before any file goes (else a torn step returns)
            self.fs.fsync_dir(self.directory)
        except OSError as e:
            self._sweep_deletions = True
            log.error("minickpt: could not fsync %s: %s", self.directory, e)
            return
        for name in doomed:
            try:
                self.fs.rmtree(os.path.join(self.directory, name))
            except OSError as e:
                self._sweep_deletions = True
                log.error("minickpt: could not remove %s: %s",
                          os.path.join(self.directory, name), e)

    def _delete_step(self, step: int) -> None:
        path = self.step_path(step)
        try:
            if self.options.enable_background_delete:
                # out of the step namespace now; durable (parent fsync) and removed on the
                # background thread — the fsync always before the first file is removed
                self._remove_later(retire_dir(self.fs, path, durable=False))
            elif self._retired is not None:
                # a collective save: renamed out now, its files removed once the last
                # barrier is passed (_remove_retired), so the others do not wait for them
                self._retired.append(retire_dir(self.fs, path, durable=False))
            else:
                delete_dir(self.fs, path)
        finally:
            # forget the step once its name is gone, even if removing its files failed
            # (what is left is a deletion temporary, cleaned at the next start-up)
            if not self.fs.is_dir(path):
                self._infos.pop(step, None)
                self._names.pop(step, None)
        self._emit("delete", {"step": step, "time": time.time()})

    def _remove_retired(self, retired: list[str]) -> None:
        """Remove the files of steps retention renamed out (the rename made durable first);
        a failure is logged and warned about, and the next save's retention finishes it."""
        for doomed in retired:
            try:
                remove_retired(self.fs, doomed)
            except OSError as e:
                self._removal_failed(doomed, e, stacklevel=3)

    def _removal_failed(self, doomed: str, err: BaseException, stacklevel: int) -> None:
        """A retired checkpoint's files could not all be removed: say so (the disk fills up
        otherwise); the next save's retention finishes the job."""
        self._sweep_deletions = True
        log.error("minickpt: could not remove %s: %s", doomed, err)
        warnings.warn(f"could not remove deleted checkpoint {doomed}: {err}",
                      stacklevel=stacklevel)

    def _remove_later(self, doomed: str) -> None:
        """Remove a retired checkpoint's files on the background thread (FIFO, one at a time)."""
        from concurrent.futures import ThreadPoolExecutor

        self._finish_removals(block=False)
        with self._removals_lock:
            if self._remover is None:
                self._remover = ThreadPoolExecutor(1, thread_name_prefix="minickpt-delete")
            self._removals.append((doomed, self._remover.submit(remove_retired, self.fs,
                                                                doomed)))

    def _finish_removals(self, block: bool = True) -> None:
        """Collect finished background removals (all of them when ``block``); a failure is
        logged and warned about — the checkpoint is already gone from the step namespace,
        and what is left is a deletion temporary that the next start-up removes."""
        with self._removals_lock:
            pending, self._removals = self._removals, []
        keep = []
        for doomed, fut in pending:
            if not block and not fut.done():
                keep.append((doomed, fut))
                continue
            err = fut.exception()
            if err is not None:
                self._removal_failed(doomed, err, stacklevel=4)
        with self._removals_lock:
            self._removals[:0] = keep

    def delete(self, step: int) -> None:
        """Delete one checkpoint, crash-safely (it vanishes from the step list atomically)."""
        self._check_writable()
        if self._sync.process_count > 1:
            with self._collective_lock:
                if self._async is not None:
                    self._collect()  # never alongside a save's barriers; its error, everywhere
                return self._delete_collective(step)
        if step == self._in_flight_step:
            self.wait_until_finished()
        with self._mutex:
            self._resolve(step)
            self._delete_step(step)

    def _delete_collective(self, step: int) -> None:
        """Every process calls delete; the primary deletes, the others follow its result."""
        sync, mh = self._sync, self.options.multihost
        op = sync.new_op("delete")
        agree(sync.exchange(f"{op}/agree", step, mh.timeout_s,
                                      f"delete of step {step}: agreeing on the step"),
                        "the step to delete")
        local: BaseException | None = None
        if self.primary:
            try:
                with self._mutex:
                    self._resolve(step)
                    self._delete_step(step)
            except Exception as e:
                local = e
        statuses = sync.exchange(f"{op}/done", failure_status(local) if self.primary
                                 else None, mh.timeout_s, f"delete of step {step}")
        raise_failures({mh.primary_host: statuses[mh.primary_host]},
                                  sync.process_index, local, f"deleting step {step}")
        with self._mutex:
            self._infos.pop(step, None)
