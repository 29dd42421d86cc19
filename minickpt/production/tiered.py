"""Tiered storage: save fast to a local disk, mirror every checkpoint to a second store.

A local NVMe disk is fast but dies with its machine; a network file system or an object
store survives it but is slow. :class:`TieredCheckpointManager` saves to the local directory
(the training loop waits only for that) and copies each committed checkpoint in a background
thread (:mod:`.copy_queue`) to the mirror (:mod:`.mirror`: another directory or an fsspec
URL, ``pip install minickpt[remote]``), with the mirror's own atomic commit there.

This module is the local tier and what ties the two together:

* retention on both tiers: the mirror's ``mirror_max_to_keep``; on the local disk a
  checkpoint is deleted only once it is in the mirror, or once the mirror's retention would
  not keep it either (so the local disk holds more than ``max_to_keep`` while the mirror
  lags, and a copy that failed keeps its local checkpoint for :meth:`retry_failed`);
* failures: a copy that fails every retry is reported (listeners, log, warning) and raised
  by :meth:`wait_until_mirrored` and :meth:`close` until it is copied after all, or the
  mirror's retention would no longer keep that step;
* :meth:`restore`: the local copy first, the mirror's when the local one is missing or
  damaged (copied back to the local disk and verified first);
* :meth:`close`: the local saves, then the pending copies (at most ``close_timeout``
  seconds: an object store that stops answering never holds a preemption's grace period),
  the local retention, then the local manager;
* a reader (``options.read_only=True``, an evaluation job beside the trainer) never
  uploads, deletes, or applies retention: only a writer changes the mirror.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .. import policy
from ..checkpointer import Checkpointer
from ..commit import METADATA_FILE, makedirs, parse_step, step_dir_name
from ..errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    FormatVersionError,
    MiniCkptError,
    StepAlreadyExistsError,
)
from ..fallback import Restored
from ..fs import DEFAULT_FS, FileSystem
from ..manager import CheckpointManager
from ..options import CheckpointManagerOptions
from .copy_queue import CopyQueue
from .mirror import (
    LeaseHeldError,
    LeaseLostError,
    MirrorError,
    MirrorUnavailableError,
    NotOursError,
    Writer,
    named,
    open_store,
    unreachable,
)
from .transfer import fetch_step, upload_step

log = logging.getLogger("minickpt")

# Managers not closed yet: closed, with a warning, when the interpreter exits without it.
_OPEN: set[TieredCheckpointManager] = set()
_OPEN_LOCK = threading.Lock()
_AT_EXIT = False


def _close_at_exit() -> None:
    """Runs before Python joins its threads and tears down the I/O loops of s3fs/gcsfs, so
    that the last copies finish as they would in close()."""
    with _OPEN_LOCK:
        managers = list(_OPEN)
    for m in managers:
        msg = (f"minickpt: a TieredCheckpointManager on {m.local.directory} was not closed; "
               f"closing it at exit (its copies to {m.store.url} get at most "
               f"close_timeout={m.close_timeout} s). Call close(), or use it in a with block")
        log.warning(msg)
        try:
            m.close()
        except Exception as e:
            log.error("minickpt: closing at exit: %s", e)


def _register(m: TieredCheckpointManager) -> None:
    global _AT_EXIT
    with _OPEN_LOCK:
        _OPEN.add(m)
        if not _AT_EXIT:
            _AT_EXIT = True
            try:  # concurrent.futures' hook: before the threads are joined
                threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]
            except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons
                import atexit

                atexit.register(_close_at_exit)


class TieredCheckpointManager:
    """A :class:`CheckpointManager` on a local directory plus a background mirror.

    >>> with TieredCheckpointManager("/local/run1", "gs://bucket/run1", options) as mngr:
    ...     mngr.save(step, items)                   # waits for the local save only
    ...     restored = mngr.restore(target=items)    # local, or the mirror if local is gone

    Everything else (``should_save``, ``metadata``, ``listeners``, ``save_history`` ...) is the
    local manager's. ``mirror_max_to_keep`` (default: the options' ``max_to_keep``) sets the
    mirror's own retention; ``keep_period`` and ``best_fn`` apply to both.
    ``close_timeout`` (seconds, None: no bound) bounds how long :meth:`close` waits for the
    pending copies.

    **One writer per mirror.** A writer takes the mirror's lease when it opens (see
    :meth:`MirrorStore.acquire`): a second writer on the same prefix is refused with
    :class:`LeaseHeldError` naming the holder; ``force=True`` takes the lease over on purpose
    (the old writer then stops at its next change). A committed step is never replaced, in
    either tier: :meth:`save` raises :class:`StepAlreadyExistsError` for a step the mirror
    holds. Opening while the store does not answer warns, resumes from the local steps and
    catches up once the store answers.
    """

    def __init__(self, local_directory: str | os.PathLike[str], mirror: Any,
                 options: CheckpointManagerOptions | None = None, *,
                 fs: FileSystem | None = None, mirror_max_to_keep: int | str | None = "same",
                 max_attempts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 close_timeout: float | None = 120.0, force: bool = False):
        self.options = options or CheckpointManagerOptions()
        self.read_only = self.options.read_only
        self.close_timeout = close_timeout
        self._closed = False
        if self.read_only:  # the local tier of a reader is its cache: restores fetch into it
            makedirs(fs or DEFAULT_FS, os.path.abspath(os.fspath(local_directory)))
        # Local retention runs here, after each copy, never deleting a checkpoint the mirror
        # still needs; the local manager itself keeps everything.
        self.local = CheckpointManager(local_directory, dataclasses.replace(
            self.options, max_to_keep=None, keep_period=None, keep_latest=None), fs=fs)
        self.store = open_store(mirror)
        self.mirror_max_to_keep = self.options.max_to_keep if mirror_max_to_keep == "same" \
            else mirror_max_to_keep
        self._mirror_infos: dict[int, policy.StepInfo] = {}
        self._mirror_unreadable: set[int] = set()  # listed, but retention leaves them be
        self._local_damage: dict[int, BaseException] = {}  # local copies found damaged
        # steps a restore found damaged in both tiers: saved again, as the plain manager
        # saves again a step it set aside (the mirror's damaged copy is then replaced)
        self._mirror_damaged: set[int] = set()
        self._store_lock = threading.RLock()  # one operation on the mirror at a time
        self.writer = None if self.read_only else Writer()
        self._force = force
        self._copies: CopyQueue | None = None
        self._connected = threading.Event()  # the lease taken and the mirror listed
        # connected and the local steps the mirror lacks queued: what waiters wait for (an
        # empty queue before the catch-up is not "all copied")
        self._caught_up = threading.Event()
        self._lease_error: MirrorError | None = None  # lost or refused after an outage
        self._stop = threading.Event()
        self._backoff = (backoff_s, max_backoff_s)
        try:
            self._connect()
        except MirrorUnavailableError as e:
            if self.writer is None:  # a reader has nothing to catch up: it says so now
                self.local.close()
                raise
            msg = (f"minickpt: {e}; resuming from the local steps "
                   f"{self.local.all_steps()} in {self.local.directory}, and copying them "
                   "once the mirror answers")
            log.warning(msg)
            warnings.warn(msg, stacklevel=2)
        except BaseException:
            if self.writer is not None:
                self.writer.release()
            self.local.close()
            raise
        if self.writer is None:
            return
        self._copies = CopyQueue(
            self._copy, url=self.store.url, after_copy=lambda s: self._apply_mirror_retention(),
            after_job=lambda s: self._apply_local_retention(), notify=self._notify,
            on_exit=self.writer.release, max_attempts=max_attempts, backoff_s=backoff_s,
            max_backoff_s=max_backoff_s)
        self.local.listeners.append(self._on_event)
        _register(self)
        # renews the lease; while the store is down, connects and then catches up
        self._keeper = threading.Thread(target=self._keep_lease, daemon=True,
                                        name="minickpt-lease")
        self._keeper.start()
        if self._connected.is_set():
            with self._store_lock:
                self._catch_up()
            self._caught_up.set()

    def _connect(self) -> None:
        """A writer: take the lease, clean up what a killed writer left; both: list the
        mirror. A store that does not answer: :class:`MirrorUnavailableError`."""
        try:
            with self._store_lock:
                if self.writer is not None:
                    self.store.acquire(self.writer, force=self._force)
                    for name in self.store.cleanup(self.options.step_prefix):
                        log.warning("minickpt: removed %s from the mirror: this mirror's own "
                                    "upload or delete, abandoned by its writer", name)
                self._scan_mirror()
        except MiniCkptError:
            raise
        except Exception as e:
            if unreachable(e):
                raise named(e, self.store.url) from None
            raise
        self._connected.set()

    def _keep_lease(self) -> None:
        """The lease's thread: connect (backing off) while the store is down, then catch
        up; renew the lease every ``stale_after_s / 4``; stop on a lost lease."""
        assert self.writer is not None and self._copies is not None
        delay = self._backoff[0]
        while not self._connected.is_set():
            if self._stop.wait(delay):
                return
            try:
                self._connect()
            except MirrorUnavailableError as e:
                delay = min(2 * delay, self._backoff[1])
                log.info("minickpt: %s; trying again in %.0f s", e, delay)
                continue
            except LeaseHeldError as e:  # another writer started during the outage
                self._lease_error = e
                log.error("minickpt: %s", e)
                return
            except Exception as e:  # pragma: no cover - reported; tried again
                log.error("minickpt: connecting to the mirror %s: %s", self.store.url, e)
                continue
            log.warning("minickpt: the mirror %s answers again: catching up", self.store.url)
            with self._store_lock:
                self._catch_up()
            self._caught_up.set()
            self.retry_failed()
        while not self._stop.wait(self.store.stale_after_s / 4):
            try:
                self.store.renew(self.writer)
            except LeaseLostError as e:
                self._lease_error = e
                log.error("minickpt: %s", e)
                return
            except Exception as e:  # a store down for a while: its copies say so
                log.warning("minickpt: could not renew the lease of %s: %s", self.store.url, e)

    # ---- delegation ----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "local":  # not yet set: __init__ failed early
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def preemption_handler(self) -> Any:
        return self.local.preemption_handler

    @preemption_handler.setter
    def preemption_handler(self, handler: Any) -> None:
        self.local.preemption_handler = handler

    @property
    def failed(self) -> dict[int, str]:
        """step -> the last error, for each step whose copy failed every attempt and that
        the mirror still needs."""
        return self._copies.failed if self._copies is not None else {}

    @property
    def mirrored(self) -> list[int]:
        """The steps copied by this manager, in order."""
        return self._copies.mirrored if self._copies is not None else []

    def save(self, step: int, items: Mapping[str, Any], **kw: Any) -> bool:
        """Save locally (see :meth:`CheckpointManager.save`); the copy to the mirror follows
        in the background once the checkpoint is committed. A step the mirror holds is never
        saved again, ``force`` or not (:class:`StepAlreadyExistsError`), as the plain
        manager refuses a step its disk holds: checked against the mirror's listing (made
        at open, kept by this writer, the only one)."""
        if self._lease_error is not None:
            raise self._lease_error
        # (not under the store's lock, which a copy holds for its whole upload: a save
        # never waits for the mirror; the copy checks again before it uploads)
        if step in self._mirror_infos and step not in self._mirror_damaged:
            raise StepAlreadyExistsError(
                f"step {step} is committed in the mirror {self.store.url} "
                f"({self.store.path(self._name(step))}): minickpt never replaces a committed "
                "checkpoint, in either tier. Restore it (restore(step) fetches it), or save "
                "under a new step")
        return self.local.save(step, items, **kw)

    def mirror_steps(self, read: bool = False) -> list[int]:
        """The steps committed in the mirror, ascending; ``read=True`` lists the mirror
        again first (a reader sees the trainer's new steps)."""
        with self._store_lock:
            if read:
                self._scan_mirror()
            return sorted(self._mirror_infos)

    def all_steps(self, read: bool = False) -> list[int]:
        """Steps restorable from either tier."""
        return sorted(set(self.local.all_steps(read=read)) | set(self.mirror_steps(read)))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- copying -------------------------------------------------------------------------
    def _on_event(self, event: str, record: Mapping[str, Any]) -> None:
        if event != "save" or not isinstance(record.get("step"), int):
            return
        if not record.get("ok"):  # an async save's error is raised by the next blocking call
            log.error("minickpt: the save of step %d failed: %s", record["step"],
                      record.get("error"))
        elif self._copies is not None and self._connected.is_set():
            self._copies.put(record["step"])  # (while the store is down: on catching up)

    def _notify(self, record: dict[str, Any]) -> None:
        for fn in list(self.local.listeners):
            if fn == self._on_event:
                continue
            try:
                fn("mirror", record)
            except Exception:  # a broken listener must not stop the mirror
                log.exception("minickpt: listener failed on a mirror event")

    def _copy(self, step: int) -> int | str | None:
        """Copy one committed local checkpoint into the mirror (on the copy thread); the
        bytes copied, None when it was deleted locally before it could be, or why it is
        skipped (retention retired it while it waited)."""
        assert self.writer is not None
        if self._lease_error is not None:
            raise self._lease_error
        if not self._connected.is_set():
            raise MirrorUnavailableError(f"the mirror {self.store.url} has not answered since "
                                         "this manager opened: copied once it does")
        lfs = self.local.fs
        src = self.local.step_path(step)
        name = os.path.basename(src)
        with self._store_lock:
            if not lfs.is_dir(src):
                return None
            if step not in self._mirror_infos and step not in self._mirror_needs():
                return "retired by the mirror's retention before its copy began"  # retired by the mirror's retention before its turn came
            try:
                self.store.check_lease(self.writer)  # fenced: one writer changes the mirror
            except LeaseLostError as e:
                self._lease_error = e  # the next save says so too
                raise
            if name in self.store.listdir(""):
                if self.store.committed(name):
                    if b"".join(self.store.read_chunks(f"{name}/{METADATA_FILE}")) \
                            == lfs.read_file(os.path.join(src, METADATA_FILE)):
                        self._remember(step, name)
                        return 0  # already there (copied before a restart)
                    if step in self._mirror_damaged and self.store.owned(name):
                        log.warning("minickpt: replacing %s in the mirror: a restore found "
                                    "its copy there damaged, and step %d was saved again",
                                    self.store.path(name), step)
                        self.store.delete(name, self.writer)
                        self._mirror_damaged.discard(step)
                        self._mirror_infos.pop(step, None)
                        return self._upload(step, src, name)
                    self._remember(step, name)
                    raise StepAlreadyExistsError(
                        f"{self.store.path(name)} is a committed checkpoint of step {step} "
                        f"that differs from the local one ({src}): minickpt never replaces a "
                        "committed checkpoint, so the local one is not mirrored. Restore "
                        f"step {step} from the mirror, or delete the local copy")
                elif not self.store.reclaim(name, self.writer):
                    raise NotOursError(
                        f"{self.store.path(name)} is in the mirror but is no checkpoint: "
                        "another writer is uploading it, or it is not this mirror's (no "
                        "in-progress marker of a writer that is gone). Left as it is")
            return self._upload(step, src, name)

    def _upload(self, step: int, src: str, name: str) -> int | None:
        assert self.writer is not None
        lfs = self.local.fs
        try:
            nbytes = upload_step(self.store, self.writer, lfs, src, name)
        except FileNotFoundError:
            if not lfs.is_dir(src):
                return None  # deleted locally (retention) while it was being copied
            raise
        self._remember(step, name, lfs.read_file(os.path.join(src, METADATA_FILE)))
        return nbytes

    def _remember(self, step: int, name: str, data: bytes | None = None) -> None:
        """Note a committed mirror step and its metrics (``data``: its metadata file, just
        uploaded and sized, so not fetched again)."""
        try:
            meta = self.store.metadata(name, data)
            info = policy.StepInfo(step, meta.metrics, meta.time or 0.0)
            self._mirror_unreadable.discard(step)
        except Exception:  # unreadable metadata: listed, never counted nor deleted
            info = policy.StepInfo(step, None, 0.0)
            self._mirror_unreadable.add(step)
        self._mirror_infos[step] = info

    def _scan_mirror(self) -> None:
        self._mirror_infos = {}
        for name in self.store.listdir(""):
            step = parse_step(name, self.options.step_prefix)
            # no commit marker: an upload or a delete cut short (object stores), or not ours
            if step is not None and self.store.committed(name):
                self._remember(step, name)

    def _catch_up(self) -> None:
        """Queue the local checkpoints the mirror lacks and its retention would keep: a
        previous process may have died between a local commit and its copy."""
        assert self._copies is not None
        needed = self._mirror_needs()
        for s in self.local.all_steps():
            if s not in self._mirror_infos and s in needed:
                self._copies.put(s)

    # ---- retention -----------------------------------------------------------------------
    def _mirror_needs(self) -> set[int]:
        """The steps the mirror's retention keeps among those it has and the local ones it
        lacks: a local step outside this set is no loss to the mirror if deleted."""
        infos = [i for s, i in self._mirror_infos.items() if s not in self._mirror_unreadable]
        # a step damaged or still being written locally is left out: nothing to copy yet
        infos += [i for s in self.local.all_steps() if s not in self._mirror_infos
                  and (i := self._local_info(s)) is not None]
        return self._keep(infos, self.mirror_max_to_keep)

    def _apply_mirror_retention(self) -> None:
        assert self.writer is not None
        with self._store_lock:
            readable = [i for s, i in self._mirror_infos.items()
                        if s not in self._mirror_unreadable]
            keep = self._keep(readable, self.mirror_max_to_keep)
            for step in sorted({i.step for i in readable} - keep):
                name = self._name(step)
                try:
                    if not self.store.owned(name):
                        log.warning("minickpt: %s is not deleted by retention: no minickpt "
                                    "writer of this mirror committed it", self.store.path(name))
                        self._mirror_unreadable.add(step)  # neither counted nor deleted again
                        continue
                    self.store.check_lease(self.writer)
                    self.store.delete(name, self.writer)
                    del self._mirror_infos[step]
                    self._notify({"step": step, "ok": True, "deleted": True, "error": None,
                                  "target": self.store.url, "time": time.time()})
                except Exception as e:
                    log.error("minickpt: could not delete %s from the mirror: %s", name, e)

    def _apply_local_retention(self) -> None:
        """The options' retention on the local tier. A step is deleted only once it is in
        the mirror, or once the mirror's retention would not keep it either; a failure to
        copy a step the mirror no longer needs is forgotten (it was reported)."""
        assert self._copies is not None
        # a step whose metadata cannot be read (EIO, damage, still being written) is neither
        # counted nor deleted
        infos = [i for s in self.local.all_steps() if (i := self._local_info(s)) is not None]
        keep = self._keep(infos, self.options.max_to_keep)
        with self._store_lock:
            needed, mirrored = self._mirror_needs(), set(self._mirror_infos)
        for s in sorted(self.failed):
            if s not in needed:
                self._copies.forget(s)
                log.info("minickpt: step %d is no longer needed in the mirror (its retention "
                         "would not keep it): its failed copy is forgotten", s)
        spared = self._copies.pending() | (needed - mirrored)
        for s in sorted({i.step for i in infos} - keep - spared):
            try:
                self.local.delete(s)
            except CheckpointNotFoundError:
                pass
            except OSError as e:
                log.error("minickpt: could not delete old local checkpoint %s: %s",
                          self.local.step_path(s), e)

    def _local_info(self, step: int) -> policy.StepInfo | None:
        """What retention needs of a local step, from its metadata; None when unreadable.
        Read directly from the disk: never through the local manager, which would wait for
        an async save of that step and take its error (the caller's to raise)."""
        try:
            meta = Checkpointer(self.local.fs).metadata(self.local.step_path(step))
        except (MiniCkptError, OSError):
            return None
        return policy.StepInfo(step, meta.metrics, meta.time or 0.0)

    def _keep(self, infos: Sequence[policy.StepInfo], max_to_keep: int | None) -> set[int]:
        """The options' retention rules (``max_to_keep`` differs between the tiers); metrics
        ``best_fn`` raises on are no metric, as in the plain manager (said once per step)."""
        o = self.options
        infos = self.local._scorable(list(infos))
        keep = policy.steps_to_keep(
            infos, max_to_keep=max_to_keep, keep_period=o.keep_period, best_fn=o.best_fn,
            best_mode=o.best_mode,
            keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics,
        ) | policy.newest_steps(infos, o.keep_latest)
        self.local._check_bound(infos, keep, max_to_keep, o)  # said once
        return keep

    def _name(self, step: int) -> str:
        return step_dir_name(step, self.options.step_prefix,
                             self.options.step_format_fixed_length)

    # ---- waiting and closing -------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Wait for the local saves (an async local manager's too, raising its error); not
        for the mirror."""
        self.local.wait_until_finished()

    def wait_until_mirrored(self, timeout: float | None = None) -> None:
        """Wait until every committed checkpoint has been copied (or has failed every retry);
        raise :class:`MirrorError` naming each step the mirror still needs that could not be
        copied, TimeoutError when ``timeout`` runs out first."""
        self.local.wait_until_finished()
        if self._copies is None:
            return
        t0 = time.monotonic()
        while not self._caught_up.wait(0.05):
            if self._lease_error is not None:  # another writer took the mirror meanwhile
                raise self._lease_error
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the mirror {self.store.url} has not answered since this "
                                   f"manager opened ({timeout} s waited): local steps "
                                   f"{self.local.all_steps()} are kept until it does")
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - t0))
        if self._lease_error is not None:
            raise self._lease_error
        if not self._copies.wait(timeout):
            raise TimeoutError(f"steps {sorted(self._copies.pending())} still being copied to "
                               f"{self.store.url} after {timeout} s")
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed = dict(self.failed)
        if not failed:
            return
        here = [s for s in sorted(failed) if self.local.fs.is_dir(self.local.step_path(s))]
        gone = sorted(set(failed) - set(here))
        advice = []
        if here:
            advice.append(f"steps {here} are kept on the local disk: retry_failed() copies "
                          "them again, and so does the next manager on this local directory")
        if gone:
            advice.append(f"steps {gone} are gone from the local disk too (deleted by hand?): "
                          "they cannot be mirrored")
        raise MirrorError("could not copy to the mirror " + self.store.url + ": " + "; ".join(
            f"step {s}: {e}" for s, e in sorted(failed.items())) + " — " + "; ".join(advice))

    def retry_failed(self) -> None:
        """Queue every step that failed all its attempts again; each is cleared once copied
        (or found deleted locally). Wait with :meth:`wait_until_mirrored`."""
        if self._copies is not None:
            for step in sorted(self.failed):
                self._copies.put(step)

    def close(self) -> None:
        """Finish the local saves (raising an async save's error), then the pending copies —
        at most ``close_timeout`` seconds —, apply the local retention, close the local
        manager and stop the copy thread. Raises :class:`MirrorError` when a checkpoint the
        mirror needs could not be copied, or the copies did not finish in time (their local
        checkpoints are kept; the next manager on this local directory copies them)."""
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            _OPEN.discard(self)
        copies, done = self._copies, True
        self._stop.set()  # the lease's thread: no more connecting nor renewing
        keeper = getattr(self, "_keeper", None)
        if keeper is not None and keeper is not threading.current_thread():
            # a connection in progress ends with its catch-up queued, or not at all: what
            # follows then reads one state, not a thread half-way between the two
            keeper.join(30.0 if self.close_timeout is None else self.close_timeout)
        try:
            if copies is not None:
                self.local.wait_until_finished()
        finally:
            try:
                if copies is not None:
                    done = copies.wait(self.close_timeout if self._caught_up.is_set()
                                       else 0.0)
                    if done:
                        try:
                            self._apply_local_retention()
                        except Exception:  # pragma: no cover - the copies are what matter
                            log.exception("minickpt: local retention failed")
                    if copies.stop(10.0 if done else 0.0) and self._caught_up.is_set() \
                            and self._lease_error is None:
                        assert self.writer is not None
                        self.store.release(self.writer)  # the next writer starts at once
            finally:
                self.local.close()
        if copies is not None and not self._caught_up.is_set():
            msg = (f"close(): the mirror {self.store.url} did not answer since this manager "
                   f"opened{'' if self._lease_error is None else f' ({self._lease_error})'}, "
                   f"so nothing was copied; the local checkpoints {self.local.all_steps()} "
                   "are kept, and the next manager on this local directory copies them")
            log.error("minickpt: %s", msg)
            raise MirrorError(msg)
        if not done:
            assert copies is not None
            msg = (f"close(): steps {sorted(copies.pending())} were not copied to the mirror "
                   f"{self.store.url} within close_timeout={self.close_timeout} s (a store "
                   "that does not answer? set the client's time-outs too); their local "
                   "checkpoints are kept, and the next manager on this local directory copies "
                   "them")
            log.error("minickpt: %s", msg)
            raise MirrorError(msg)
        self._raise_failed()

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is already on its way: report mirror failures without masking it
            self.close()
        except MirrorError as e:
            log.error("minickpt: %s", e)

    # ---- restoring -----------------------------------------------------------------------
    def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None,
                **kw: Any) -> Restored:
        """Restore from the local disk, or from the mirror when the local copy is missing or
        damaged (the mirror's copy is fetched to the local disk, verified, then restored).

        Without ``step``: the newest step either tier has; a step damaged in both is skipped
        with a warning, as :meth:`CheckpointManager.restore` does.
        """
        kw.pop("fallback", None)  # falling back is what this method does
        if step is not None:
            return self._restore_step(step, target, kw)
        steps = sorted(set(self.local.all_steps(read=True)) | set(self.mirror_steps()),
                       reverse=True)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoint in {self.local.directory} nor in "
                                          f"the mirror {self.store.url}")
        errors = []
        for s in steps:
            try:
                return self._restore_step(s, target, kw)
            except CheckpointNotFoundError as e:  # gone from the mirror since it was listed
                if len(steps) == 1:
                    raise
                msg = f"minickpt: skipping step {s}: {e}"
                log.error(msg)
                warnings.warn(msg, stacklevel=2)
                errors.append(f"step {s}: {e}")
            except CheckpointCorruptedError as e:  # an I/O error is raised: not damage
                # As CheckpointManager.restore does: the damaged local copy is moved aside
                # (kept for a look), so that the resumed loop can save step s again.
                aside = self.local._set_aside(s) if self._local_damage.pop(s, None) else None
                if self.writer is not None and s in self._mirror_infos:
                    self._mirror_damaged.add(s)  # may be saved again, and replaced there
                msg = f"minickpt: skipping step {s}, damaged locally and in the mirror: {e}" + (
                    f"; the local copy moved to {aside} so that step {s} can be saved again"
                    if aside else "")
                log.error(msg)
                warnings.warn(msg, stacklevel=2)
                errors.append(f"step {s}: {e}")
        raise CheckpointCorruptedError(self.local.directory, "every checkpoint is damaged in "
                                       "both tiers or gone:\n  " + "\n  ".join(errors))

    def _restore_step(self, step: int, target: Any, kw: Mapping[str, Any]) -> Restored:
        local_error: BaseException | None = None
        self._local_damage.pop(step, None)
        if step in self.local.all_steps(read=True):
            try:
                return self.local.restore(step, target, fallback=False, **kw)
            except (CheckpointCorruptedError, OSError) as e:
                local_error = e
                if isinstance(e, CheckpointCorruptedError) \
                        and not isinstance(e, FormatVersionError):
                    self._local_damage[step] = e  # restore() sets it aside if all else fails
                how = "is damaged" if isinstance(e, CheckpointCorruptedError) \
                    else "could not be read"
                msg = (f"minickpt: the local copy of step {step} {how} ({e}); fetching it "
                       f"from the mirror {self.store.url}")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
        if not self._connected.is_set() and local_error is None:
            raise MirrorUnavailableError(
                f"step {step} is not in {self.local.directory}, and the mirror "
                f"{self.store.url} has not answered since this manager opened (its steps are "
                "unknown until it does): restore a local step, or wait_until_mirrored()")
        try:
            in_mirror = step in self.mirror_steps() and self._still_committed(step)
            if in_mirror:
                self._fetch(step)
        except Exception as e:
            if isinstance(e, MiniCkptError) or not unreachable(e):
                raise
            raise named(e, self.store.url) from None
        if not in_mirror:
            if local_error is not None:
                raise local_error
            raise CheckpointNotFoundError(f"no checkpoint for step {step} in "
                                          f"{self.local.directory} nor in {self.store.url}")
        return self.local.restore(step, target, fallback=False, **kw)

    def _still_committed(self, step: int) -> bool:
        """Look again, just before fetching: the listing may be older than a delete (another
        job's retention, an operator); a step without its commit marker is not fetched."""
        with self._store_lock:
            if self.store.committed(self._name(step)):
                return True
            self._mirror_infos.pop(step, None)
            self._mirror_unreadable.discard(step)
            return False

    def _fetch(self, step: int) -> None:
        """Copy a step from the mirror back to the local disk (verified; a damaged local copy
        is replaced)."""
        def replace() -> None:
            self.local.reload()
            self.local.delete(step)

        with self._store_lock:
            fetch_step(self.store, self.local.fs, self.local.directory, self._name(step),
                       replace)
        self.local.reload()
        log.warning("minickpt: restored step %d's checkpoint from the mirror %s", step,
                    self.store.url)
