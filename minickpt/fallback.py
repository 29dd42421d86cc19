"""Restoring with verification and fallback (chapter 3): the newest checkpoint that is not
damaged, on one process or on many.

Only verified damage (a checksum, a structure, a missing file) is a reason to try an older
step; an I/O error or a target that does not match says nothing about the checkpoint and is
raised. A writable manager moves a damaged step it skips aside, so that the resumed run can
save that step again."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .commit import set_aside
from .errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    FormatVersionError,
    PeerTimeoutError,
)
from .multihost.broadcast import restore_broadcast
from .multihost.save import (
    describe_failures,
    failure_status,
    raise_failures,
)
from .multihost.sync import agree
from .orbax_dirs import foreign_note

log = logging.getLogger("minickpt")


class Restored(dict):
    """The items restored, by name; ``.step`` says which step they came from."""

    step: int | None = None


class _Vanished(Exception):
    """A step was deleted while it was being restored (not damage: the steps are listed again)."""


def restore_newest_valid(directory: str, steps: Iterable[int],
                         restore_step: Callable[[int], Any], *, fallback: bool = True,
                         on_skip: Callable[[int, BaseException], None] | None = None
                         ) -> tuple[int, Any]:
    """Task 3.1 — restore the newest checkpoint that restores; ``(step, restored)``.

    ``restore_step(s)`` restores step ``s`` or raises. A step is given up only on evidence
    about that checkpoint — verified damage, or a size this machine cannot hold (an older one
    may fit) — and only with ``fallback``; an error that says the disk or the program is
    failing *now* stops the search, unchanged (falling back past it would silently lose an
    interval of training). Every step given up, the last one included, is reported to
    ``on_skip(s, error)`` before anything else happens; no step is tried twice. No steps:
    :class:`CheckpointNotFoundError`; every step given up: one
    :class:`CheckpointCorruptedError` naming every step tried and why it failed.
    """
    order = sorted(set(steps), reverse=True)
    if not order:
        raise CheckpointNotFoundError(f"no checkpoint to restore in {directory}")
    errors = []
    for s in order:
        try:
            return s, restore_step(s)
        except (CheckpointCorruptedError, CheckpointTooLargeError) as e:
            if not fallback:
                raise
            errors.append(f"step {s}: {e}")
            if on_skip is not None:
                on_skip(s, e)
    raise CheckpointCorruptedError(directory, "no checkpoint can be restored (damaged, or too "
                                   "large):\n  " + "\n  ".join(errors))


class Restoring:
    """The restoring part of :class:`~minickpt.manager.CheckpointManager`."""

    def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None, *,
                partial: bool = False, verify: bool | None = None, sharding: Any = None,
                fallback: bool | None = None) -> Restored:
        """Restore a step's items (all, or those named in ``target``).

        Without ``step`` the latest is restored; if it is damaged and ``fallback`` (default:
        the options' ``fallback_on_damage``), the newest *valid* one is restored instead and a
        warning says which step was skipped and why. The result's ``.step`` says which step
        it is. A structural mismatch with ``target`` is never a reason to fall back, nor is
        an I/O error (EIO ...): that says nothing about the checkpoint, and is raised.

        A writable manager moves a damaged step it skips out of the step namespace, to
        ``step_<N>.minickpt-damaged-<hex>`` (kept for inspection, shown by ``minickpt ls``,
        never counted or cleaned up), so that the resumed run saves step N again.
        """
        verify = self.options.verify_on_restore if verify is None else verify
        fallback = self.options.fallback_on_damage if fallback is None else fallback
        if isinstance(target, Mapping) and not target:
            raise ValueError("restore(target={}): the target is empty, naming no item; pass "
                             "the items (e.g. target={'state': state}), or target=None for "
                             "all of them")
        if self._sync.process_count > 1:
            with self._collective_lock:
                if self._async is not None:
                    # Whatever the step: the restore's barriers must not run alongside the
                    # save's, and retention in the background could delete what it reads.
                    self._collect()
                return self._restore_collective(step, target, partial, verify, sharding,
                                                fallback)
        pending = self._in_flight_step
        if pending is not None and step in (None, pending):
            # Reading the step being written: wait for its commit. If it failed, its error
            # is raised here, not mistaken for a damaged checkpoint to fall back from.
            self.wait_until_finished()
        if step is not None:
            return self._restore_step(self._resolve(step), target, partial, verify, sharding)
        skipped: set[int] = set()

        def skip(s: int, e: BaseException) -> None:
            if s in skipped:
                return
            skipped.add(s)
            why = "too large for this machine" if isinstance(e, CheckpointTooLargeError) \
                else "damaged"
            # a newer format is not damage: it stays where it is for a newer minickpt
            aside = self._set_aside(s) if why == "damaged" and not isinstance(
                e, FormatVersionError) else None
            msg = f"minickpt: skipping {why} checkpoint step {s}: {e}" + (
                f"; moved to {aside} so that step {s} can be saved again (delete it once "
                "you have looked at it)" if aside else "")
            log.error(msg)
            warnings.warn(msg, stacklevel=4)
            self._emit("skip", {"step": s, "error": str(e), "time": time.time(),
                                "moved_to": aside})

        def one(s: int) -> Restored:
            try:
                return self._restore_step(s, target, partial, verify, sharding)
            except CheckpointNotFoundError as e:
                raise _Vanished(s) from e  # deleted while we read: list the steps again

        for _ in range(3):  # a writer's retention may delete steps while we read: look again
            steps = self.all_steps(read=True)
            if not steps:
                raise CheckpointNotFoundError(f"no checkpoint to restore in {self.directory}" + (
                    f"; {foreign_note(self.directory, self.foreign_steps)}"
                    if self.foreign_steps else ""))
            try:
                return restore_newest_valid(self.directory, steps, one, fallback=fallback,
                                            on_skip=skip)[1]
            except _Vanished:
                continue
        raise CheckpointNotFoundError(f"the checkpoints in {self.directory} kept being deleted "
                                      "while they were read; is another process deleting them?")

    def _set_aside(self, step: int) -> str | None:
        """Move a damaged step out of the step namespace (kept for inspection), so that the
        resumed run can save that step again; None where this manager must not write."""
        if self.options.read_only or not self.primary or self._sync.process_count > 1:
            return None
        with self._mutex:
            path = self.step_path(step)
            try:
                aside = set_aside(self.fs, path)
            except OSError as e:
                log.error("minickpt: could not move damaged %s aside: %s", path, e)
                return None
            self._infos.pop(step, None)
            self._names.pop(step, None)
        return aside

    def _restore_collective(self, step: int | None, target: Mapping[str, Any] | None,
                            partial: bool, verify: bool, sharding: Any,
                            fallback: bool) -> Restored:
        """Chapter 4: restore on every process, each reading what its devices need.

        The primary's list of steps is everyone's; after each attempt the processes exchange
        how it went, so that they all return the same step, all fall back together past a
        damaged one, or all raise.
        """
        sync, mh = self._sync, self.options.multihost
        op = sync.new_op("restore")
        mine = [step] if step is not None else sorted(self.all_steps(read=True), reverse=True)
        views = sync.exchange(f"{op}/steps", mine, mh.timeout_s, "restore: listing the steps")
        if step is not None:
            agree([v[0] for v in views], "the step to restore")
        steps = views[mh.primary_host]
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoint to restore in {self.directory}")
        errors: list[str] = []
        for n, s in enumerate(steps):
            local: BaseException | None = None
            out = None
            try:
                if mh.primary_only:
                    out = Restored(restore_broadcast(
                        self._checkpointer, sync, f"{op}/b{n}", self.step_path(s), target,
                        partial=partial, verify=verify, sharding=sharding, options=mh,
                        step=s))
                    out.step = s
                else:
                    out = self._restore_step(self._resolve(s), target, partial, verify,
                                             sharding)
            except PeerTimeoutError:
                raise  # a process is missing (on every survivor alike): no exchange would do
            except Exception as e:
                local = e
            statuses = sync.exchange(f"{op}/try{n}", failure_status(local),
                                     mh.timeout_s, f"restore of step {s}")
            bad = {p: st for p, st in enumerate(statuses) if not st["ok"]}
            if not bad:
                assert out is not None
                return out
            if step is not None or not fallback or not all(st["damage"] for st in bad.values()):
                raise_failures(statuses, sync.process_index, local,
                                         f"restoring step {s}", reading=True)
            why = describe_failures(bad)
            # As one process does: the primary moves the damaged step aside (a newer format
            # stays), every process forgets it, so that the resumed loop saves it again.
            aside = None
            if self.primary and not self.options.read_only and all(
                    st.get("type") != "FormatVersionError" for st in bad.values()):
                with self._mutex:
                    try:
                        aside = set_aside(self.fs, self.step_path(s))
                    except OSError as e:
                        log.error("minickpt: could not move damaged %s aside: %s",
                                  self.step_path(s), e)
            moved = sync.exchange(f"{op}/aside{n}", aside, mh.timeout_s,
                                  f"restore: setting damaged step {s} aside")[mh.primary_host]
            if moved is not None:
                with self._mutex:
                    self._infos.pop(s, None)
                    self._names.pop(s, None)
            msg = f"minickpt: skipping damaged checkpoint step {s}: {why}" + (
                f"; moved to {moved} so that step {s} can be saved again (delete it once "
                "you have looked at it)" if moved else "")
            log.error(msg)
            warnings.warn(msg, stacklevel=3)
            errors.append(f"step {s}: {why}")
            self._emit("skip", {"step": s, "error": why, "time": time.time(),
                                "moved_to": moved})
        raise CheckpointCorruptedError(self.directory, "every checkpoint is damaged:\n  "
                                       + "\n  ".join(errors))

    def _restore_step(self, step: int, target: Mapping[str, Any] | None, partial: bool,
                      verify: bool, sharding: Any) -> Restored:
        t0 = time.perf_counter()
        path = self.step_path(step)
        try:
            try:
                items = self._checkpointer.restore(path, target, partial=partial, verify=verify,
                                                   sharding=sharding, step=step)
            except (CheckpointCorruptedError, OSError) as e:
                if isinstance(e, CheckpointNotFoundError) or self.fs.exists(path):
                    raise
                raise CheckpointNotFoundError(
                    f"step {step} was deleted while it was being restored (by another "
                    f"process?): {path}") from e
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
