"""CheckpointManager: steps, save policy, retention, restore with verification and fallback.

Its options and methods carry Orbax's names (``save_interval_steps``, ``max_to_keep``,
``keep_period``, ``best_fn``, ``latest_step`` ...) so what you learn here transfers. The
decisions themselves — save this step? keep which steps? — are pure functions in
:mod:`minickpt.policy`; this class only applies them to a directory.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from . import policy
from .asynchronous import AsyncCheckpointer
from .checkpointer import (
    Checkpointer,
    CheckpointMetadata,
    SaveStats,
    VerifyReport,
    _json_safe,
    check_save_args,
)
from .commit import (
    cleanup_temporaries,
    makedirs,
    parse_step,
    step_dir_name,
)
from .errors import (
    CheckpointNotFoundError,
    MiniCkptError,
    StepAlreadyExistsError,
)
from .fallback import Restoring
from .fs import DEFAULT_FS, FileSystem
from .lock import LOCK_FILE, DirectoryLock
from .multihost.save import (
    prepare_save,
)
from .multihost.sync import Sync, default_sync
from .options import CheckpointManagerOptions
from .orbax_dirs import ORBAX, foreign_note, is_orbax_checkpoint, orbax_step_number
from .retention import Retention
from .tree import from_skeleton

log = logging.getLogger("minickpt")


class CheckpointManager(DirectoryLock, Retention, Restoring):
    """Saves a training run's checkpoints under one directory, one sub-directory per step.

    >>> mngr = CheckpointManager("/tmp/run", CheckpointManagerOptions(max_to_keep=3))
    >>> mngr.save(100, {"params": params, "opt_state": opt_state}, metrics={"loss": 0.3})
    >>> restored = mngr.restore(target={"params": params, "opt_state": opt_state})
    """

    def __init__(self, directory: str | os.PathLike[str],
                 options: CheckpointManagerOptions | None = None, *,
                 fs: FileSystem | None = None, primary: bool | None = None,
                 sync: Sync | None = None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.options = options or CheckpointManagerOptions()
        self.fs = fs or DEFAULT_FS
        # Under jax.distributed every process opens the same directory (a shared file
        # system); only the primary locks it, cleans it and commits into it.
        self._sync = sync or default_sync()
        self.primary = (self._sync.process_index == self.options.multihost.primary_host
                        if primary is None else primary)
        self._async: AsyncCheckpointer | None = None
        if self.options.enable_async_checkpointing:
            self._async = AsyncCheckpointer(self.fs)
        self._checkpointer: Checkpointer = self._async or Checkpointer(self.fs)
        self._in_flight_step: int | None = None  # the step an async save is writing
        # Several processes, async: the step of the last save whose outcome this process has
        # not collected yet (see _collect). Save decisions count it, so they stay the same on
        # every process whenever each one's background thread happens to finish.
        self._pending_step: int | None = None
        # Several processes: collective operations (save, restore, delete) run one at a
        # time per process, in program order, as their barrier ids require.
        self._collective_lock = threading.RLock()
        self._lock_fd: int | None = None
        self._lock_key = ""
        self._closed = False
        self._mutex = threading.RLock()
        self.last_save_stats: SaveStats | None = None
        self.save_history: collections.deque[SaveStats] = collections.deque(maxlen=1000)
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        # anything with ``reached(step) -> bool``, e.g. minickpt.production.PreemptionHandler
        self.preemption_handler: Any = None
        self.removed_temporaries: list[str] = []
        self._names: dict[int, str] = {}  # step -> its directory's name, as found on disk
        self._sweep_deletions = False
        self._remover: Any = None  # ThreadPoolExecutor for enable_background_delete
        self._removals: list[Any] = []  # its pending (name, future) pairs
        self._retired: list[str] | None = None  # see _committed
        self._removals_lock = threading.Lock()  # retention may run on the async writer
        opts = self.options
        # The run directory may be a symlink (to a bigger disk, say): that is the user's
        # choice. Only what lies *inside* a checkpoint must never be a link.
        real = os.path.realpath(self.directory)
        if not self.fs.is_dir(real):
            if not self.fs.exists(real):
                if opts.read_only or not opts.create:
                    raise CheckpointNotFoundError(
                        f"checkpoint directory {self.directory} does not exist"
                        + ("" if opts.read_only else " (pass create=True to make it)"))
                makedirs(self.fs, real)
            # look again: another process of the job may have made it meanwhile
            if not self.fs.is_dir(real):
                raise NotADirectoryError(f"{self.directory} exists and is not a directory")
        if not opts.read_only and self.primary:
            if opts.lock:
                self._acquire_lock()
            # Without the lock another writer may be saving right now: its temporary
            # directory would look exactly like one a crash left behind.
            if opts.cleanup_tmp_directories and opts.lock:
                self.removed_temporaries = cleanup_temporaries(self.fs, self.directory)
                for name in self.removed_temporaries:
                    log.warning("minickpt: removed %s left by an interrupted save or delete",
                                os.path.join(self.directory, name))
        self._infos: dict[int, policy.StepInfo] = {}
        self._metric_errors: set[int] = set()  # steps whose metrics best_fn raised on (logged)
        # steps listed whose metadata could not be read (step -> why): never counted or
        # deleted by retention, read again before each retention and at each reload
        self._unreadable: dict[int, str] = {}
        # another library's step directories (Orbax's), step -> name: never listed, counted,
        # deleted, moved or written into
        self.foreign_steps: dict[int, str] = {}
        self.reload()
        if self.foreign_steps:
            note = foreign_note(self.directory, self.foreign_steps)
            if self._lock_fd is not None:
                # the lock must be where every minickpt writer of this directory looks;
                # Orbax lists only step directories, so a file beside them changes nothing
                note += (f". This writable manager locks the directory through "
                         f"{os.path.join(self.directory, LOCK_FILE)} (a file Orbax ignores; "
                         "kept after close(): delete it when no minickpt writer uses the "
                         "directory); open it with read_only=True to write nothing")
            log.warning("minickpt: %s", note)
            warnings.warn(note, stacklevel=2)

    # ---- housekeeping --------------------------------------------------------------------

    def _emit(self, event: str, record: dict[str, Any]) -> None:
        for fn in list(self.listeners):
            try:
                fn(event, record)
            except Exception:  # a broken listener must never break a save
                log.exception("minickpt: listener failed on %s", event)

    def step_path(self, step: int) -> str:
        """The directory of ``step``'s checkpoint (as found on disk: ``step_0042`` is still
        step 42's directory when this manager would name it ``step_42``)."""
        name = self._names.get(step) or step_dir_name(
            step, self.options.step_prefix, self.options.step_format_fixed_length)
        return os.path.join(self.directory, name)

    def reload(self) -> None:
        """Re-read which checkpoints exist (after another process changed the directory)."""
        with self._mutex:
            infos: dict[int, policy.StepInfo] = {}
            dirnames: dict[int, str] = {}
            unreadable: dict[int, str] = {}
            foreign: dict[int, str] = {}
            try:
                names = self.fs.listdir(self.directory)
            except FileNotFoundError:
                names = []
            o = self.options
            for name in sorted(names):
                step = parse_step(name, o.step_prefix)
                if step is None or not self.fs.is_dir(os.path.join(self.directory, name)):
                    continue
                if step in dirnames:  # step_7 and step_07: the canonical name wins
                    if name != step_dir_name(step, o.step_prefix, o.step_format_fixed_length):
                        log.warning("minickpt: ignoring %s: step %d is also in %s", name, step,
                                    dirnames[step])
                        continue
                    log.warning("minickpt: ignoring %s: step %d is also in %s", dirnames[step],
                                step, name)
                dirnames[step] = name
                old = self._infos.get(step)
                if old is not None and self._names.get(step) == name \
                        and step not in self._unreadable:
                    infos[step] = old
                    continue
                if step == self._in_flight_step:  # never wait for a commit under the mutex
                    continue
                try:
                    meta = self._checkpointer.metadata(os.path.join(self.directory, name),
                                                       step=step)
                    infos[step] = policy.StepInfo(step, meta.metrics, meta.time or 0.0)
                except (MiniCkptError, OSError) as e:
                    if isinstance(e, MiniCkptError) and self._is_foreign(name):
                        foreign[step] = name
                        del dirnames[step]
                        continue
                    # Listed (restore() says what is wrong with it), but not "a step without
                    # metrics": one EIO must not change which steps retention keeps.
                    infos[step] = policy.StepInfo(step, None, 0.0)
                    unreadable[step] = f"{type(e).__name__}: {e}"
                    if not isinstance(e, MiniCkptError):
                        log.warning("minickpt: could not read the metadata of step %d (%s); "
                                    "retention neither counts nor deletes it until it can be "
                                    "read", step, e)
            pending = self._in_flight_step
            if pending is not None and pending in self._infos:
                infos.setdefault(pending, self._infos[pending])  # still being written
                if pending in self._names:
                    dirnames.setdefault(pending, self._names[pending])
            taken = set(dirnames.values())
            for name in names:  # Orbax's steps under other names ("100" next to "step_100")
                step = orbax_step_number(name)
                if step is not None and step not in foreign and name not in taken \
                        and self._is_foreign(name):
                    foreign[step] = name
            self._infos, self._names = infos, dirnames
            self._unreadable = unreadable
            self.foreign_steps = foreign

    def _is_foreign(self, name: str) -> bool:
        """Whether ``name`` in the directory is another library's checkpoint (Orbax's)."""
        path = os.path.join(self.directory, name)
        try:
            return is_orbax_checkpoint(path, self.fs)
        except OSError:
            return False  # cannot look: not known to be foreign, so never taken for it

    def close(self) -> None:
        """Finish pending work (raising the error of a failed async save) and release the
        directory."""
        if self._closed:
            return
        try:
            if self._async is not None:
                self._pending_step = None
                self._async.close()
        finally:
            try:
                self._finish_removals()
            finally:
                if self._remover is not None:
                    self._remover.shutdown(wait=True)
                    self._remover = None
                self._release_lock()
            self._closed = True
            if self.preemption_handler is not None and hasattr(self.preemption_handler, "close"):
                self.preemption_handler.close()  # put the previous signal handlers back

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
        """Block until the async save in flight has committed and every background removal
        of a deleted checkpoint has finished; raise the save's error if it failed.

        Sync saves have committed when ``save()`` returns, so then this returns at once.
        Under several processes every process must call it (as every collective call): each
        waits for its own part, and all raise the same failure, naming the process(es)
        where it happened.
        """
        try:
            if self._async is not None:
                self._collect()
        finally:
            self._finish_removals()

    def _collect(self, reason: str | None = None) -> float:
        """Wait for this process's save in flight, then raise its error; seconds waited.

        The blocking points — ``save()`` when it saves, ``wait_until_finished()``,
        ``close()``, and under several processes ``restore()`` and ``delete()`` — are the
        only places a background error is collected by a multi-process manager: every
        process reaches them in the same order, so all raise at the same call.
        """
        assert self._async is not None
        waited = self._async.wait_for_previous(reason)
        self._pending_step = None
        self._async.check_for_errors()
        return waited

    def check_for_errors(self) -> None:
        """Raise the error of a finished async save that failed (once); never blocks.

        Under several processes it answers for this process only, whose background thread
        may finish before or after the others': to stop on an error *together*, use
        :meth:`wait_until_finished` (or let the next ``save()`` raise it).
        """
        if self._async is not None:
            self._async.check_for_errors()

    def is_saving_in_progress(self) -> bool:
        return self._async is not None and self._async.is_saving_in_progress()

    # ---- queries -------------------------------------------------------------------------
    def all_steps(self, read: bool = False) -> list[int]:
        """Every saved step, ascending. ``read=True`` re-scans the directory first.

        A step whose async save is still in flight is included (as in Orbax), so that
        ``latest_step()`` and ``should_save()`` see it; reading it waits for its commit, and if
        it fails it disappears from the list (earlier steps are never removed for it).
        """
        if read:
            self.reload()
        with self._mutex:
            return sorted(self._infos)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best metric (``best_fn``, ``best_mode``); latest without best_fn."""
        o = self.options
        if o.best_fn is None:
            return self.latest_step()
        with self._mutex:
            infos = self._scorable(list(self._infos.values()))
        return policy.best_step(infos, o.best_fn, o.best_mode)

    def metadata(self, step: int | None = None) -> CheckpointMetadata:
        """A step's metadata (metrics, your metadata, times, items) without loading arrays."""
        step = self._resolve(step)
        return self._checkpointer.metadata(self.step_path(step), step=step)

    def item_metadata(self, step: int | None = None) -> dict[str, Any]:
        """Each item's tree, shaped as ``restore()`` without a target returns it (nested
        dicts, lists, tuples), with ``(dtype, shape)`` at every leaf — read from the
        manifests only, like Orbax's ``item_metadata``.

        A leaf is found by its key path, so ``{"a/b": x, "a": {"b": y}}`` gives two leaves
        (``md["a/b"]`` and ``md["a"]["b"]``)."""
        step = self._resolve(step)
        path = self.step_path(step)
        meta = self._checkpointer.metadata(path, step=step)
        out = {}
        for name in meta.items:
            m = self._checkpointer.manifest(path, name, meta)
            out[name] = from_skeleton(m.skeleton, [(e.get("dtype", e.get("type")),
                                                    e.get("shape")) for e in m.entries])
        return out

    def verify(self, step: int | None = None, *, deep: bool = True) -> VerifyReport:
        """Check one step on disk (checksums too when ``deep``) without restoring it."""
        step = self._resolve(step)
        path = self.step_path(step)
        report = self._checkpointer.verify(path, deep=deep, step=step)
        if not report.ok and not self.fs.exists(path):
            raise CheckpointNotFoundError(f"step {step} was deleted while it was being verified "
                                          f"(by another process?): {path}")
        return report

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
        elif step not in self._infos:
            self.reload()
            if step in self.foreign_steps and step not in self._infos:
                name = self.foreign_steps[step]
                raise CheckpointNotFoundError(
                    f"step {step} in {self.directory} is {ORBAX} ({name}/), which minickpt "
                    "does not read; " + foreign_note(self.directory, self.foreign_steps))
            if step not in self._infos:
                raise CheckpointNotFoundError(
                    f"no checkpoint for step {step} in {self.directory} "
                    f"(steps: {self.all_steps() or 'none'})")
        if (self._async is not None and self._sync.process_count > 1
                and step == self._in_flight_step):
            # Reading the step being written waits for it; under several processes its
            # error is left to the collective calls, which raise it on every process alike.
            self._async.wait_for_previous(f"reading step {step}")
            if step not in self._infos:
                raise CheckpointNotFoundError(
                    f"step {step} in {self.directory} was being saved, and its async save "
                    "failed (the next save(), wait_until_finished() or close() raises why)")
        return step

    # ---- saving --------------------------------------------------------------------------
    def reached_preemption(self, step: int) -> bool:
        """Whether ``step`` is the step at which to save and stop after a preemption notice.

        Orbax's name. False unless a ``preemption_handler`` is attached (see
        :class:`minickpt.production.PreemptionHandler`); with one, True from the first step
        boundary the loop reaches after SIGTERM/SIGINT, where :meth:`should_save` is True too.
        """
        h = self.preemption_handler
        return bool(h is not None and h.reached(step))

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save: the options' interval and steps, or a
        preemption reached at this step (:meth:`reached_preemption`)."""
        o = self.options
        last = self.latest_step()
        pending = self._pending_step  # counted until collected, whatever its outcome
        if pending is not None and (last is None or pending > last):
            last = pending
        if self.reached_preemption(step) and (last is None or step > last):
            return True
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
        shared = sorted(s for s, n in self.foreign_steps.items()
                        if parse_step(n, self.options.step_prefix) is not None)
        if shared:  # a minickpt step among Orbax's is one Orbax then fails to read
            raise MiniCkptError(
                f"not saving step {step} into {self.directory}: its steps {shared} are {ORBAX} "
                "named as this manager names its own, and a minickpt step among them would "
                "stop Orbax from opening the directory. Save into another directory; "
                + foreign_note(self.directory, self.foreign_steps))
        policy.check_metric(self.options.best_fn, metrics)
        check_save_args(step, metrics, metadata)  # what a restore would refuse: refused now
        t0, wall0 = time.perf_counter(), time.time()
        if self._sync.process_count > 1:
            return self._save_collective(step, items, metrics, metadata, force, t0, wall0)
        if self._async is not None:
            self._async.check_for_errors()  # a failed background save surfaces here
        with self._mutex:
            self._check_new_step(step)
            if not force and not self.should_save(step):
                return False
            if self._async is None:
                stats = self._save_now(step, items, metrics, metadata)
        if self._async is None:
            # what the caller waited for: the save, and the retention after it
            stats.total_s = stats.blocking_s = time.perf_counter() - t0
            self._record(stats)
            return True
        # Async: wait for the save in flight outside the mutex (its bookkeeping needs it).
        wait_s = 0.0
        while True:
            wait_s += self._async.wait_for_previous(f"the save of step {step}")
            self._async.check_for_errors()
            with self._mutex:
                if self._async.is_saving_in_progress():
                    continue  # another thread's save started meanwhile: wait for it too
                self._check_new_step(step)
                self._start_async(step, items, metrics, metadata, t0, wall0, wait_s)
                return True

    def _check_new_step(self, step: int) -> None:
        if step in self._infos or step == self._pending_step:
            where = ("is being saved (async) into"
                     if step in (self._in_flight_step, self._pending_step)
                     else "is already saved in")
            raise StepAlreadyExistsError(
                f"step {step} {where} {self.step_path(step)}; minickpt never replaces a "
                "committed checkpoint (delete it first to save it again)")

    def _start_async(self, step: int, items: Mapping[str, Any], metrics: Any, metadata: Any,
                     t0: float, wall0: float, wait_s: float) -> None:
        """Snapshot now; write, commit, then bookkeeping and retention in the background."""
        assert self._async is not None
        path = self.step_path(step)
        try:
            metrics = _json_safe(metrics, "metrics") if metrics is not None else None
            self._async.start_save(
                path, items, step=step, metrics=metrics, custom_metadata=metadata,
                on_commit=lambda st: self._committed(step, metrics, st),
                on_finish=lambda st: self._async_finished(step, st),
                t0=t0, wall0=wall0, wait_s=wait_s)
        except BaseException as e:  # the snapshot failed: nothing was started
            self._record(SaveStats(step, path, ok=False, error=f"{type(e).__name__}: {e}",
                                   start_time=wall0, wait_s=wait_s, async_=True,
                                   total_s=time.perf_counter() - t0,
                                   blocking_s=time.perf_counter() - t0))
            raise
        # Counted at once (as in Orbax): latest_step() and should_save() see it.
        self._infos[step] = policy.StepInfo(step, metrics, time.time())
        self._in_flight_step = step

    def _async_finished(self, step: int, stats: SaveStats) -> None:
        """In the background, after the commit and retention, or after a failure."""
        with self._mutex:
            if self._in_flight_step == step:
                self._in_flight_step = None
            if not stats.ok and not self._exists(self.step_path(step)):
                self._infos.pop(step, None)  # it never existed; earlier steps are untouched
        self._record(stats)

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
            if isinstance(e, OSError) and self._exists(self.step_path(step)):
                # only the final fsync failed: the checkpoint is complete and in place, so
                # list it; but its rename may not be durable, so delete nothing for it
                with self._mutex:
                    self._infos[step] = policy.StepInfo(
                        step, dict(metrics) if metrics is not None else None, time.time())
            self._record(failed)
            raise
        self._committed(step, metrics, stats)
        return stats

    def _save_collective(self, step: int, items: Mapping[str, Any], metrics: Any,
                         metadata: Any, force: bool, t0: float, wall0: float) -> bool:
        """Chapter 4: one checkpoint written by every process (see minickpt.multihost).

        Each process decides locally — with the same step list, the same policy says the
        same thing everywhere — then the protocol checks that they all agree on the step.

        Async (chapter 5 too): first wait for this process's previous save and raise its
        error (every process raises the same one, here); then, in this thread, the step
        agreement and the snapshot of the shards this process owns; the shard writes, the
        barriers, the primary's commit and retention run in the background. The next
        collective operation waits for them, so two operations' barriers never interleave.
        """
        with self._collective_lock:
            with self._mutex:
                # An in-flight step, and (without force) any saved step: refused at once. A
                # forced save of an old step checks after the wait below, when retention in
                # the background can no longer make the step lists differ between processes.
                if step == self._pending_step or (step in self._infos and not force):
                    self._check_new_step(step)
                if not force and not self.should_save(step):
                    return False
            wait_s = 0.0
            if self._async is not None:
                wait_s = self._collect(f"the save of step {step}")
                metrics = _json_safe(metrics, "metrics") if metrics is not None else None
                metadata = _json_safe(metadata or {}, "metadata")
            with self._mutex:
                self._check_new_step(step)
            m = dict(metrics) if metrics is not None else None

            retired: list[str] = []  # renamed out by retention, removed after the barrier

            def on_commit(stats: SaveStats) -> dict[str, Any]:  # on the primary
                before = set(self._infos)
                self._committed(step, m, stats, retired=retired)
                return {"deleted": sorted(before - set(self._infos))}

            def after_commit() -> None:  # on the primary, the others already gone on
                t = time.perf_counter()
                self._remove_retired(retired)
                job.stats.retention_s += time.perf_counter() - t

            def on_done(info: Mapping[str, Any]) -> None:  # on the others
                with self._mutex:
                    self._infos[step] = policy.StepInfo(step, m, time.time())
                    for s in info.get("deleted", []):
                        self._infos.pop(s, None)

            path = self.step_path(step)
            try:
                job = prepare_save(
                    self._checkpointer, self._sync, path, items, step=step,
                    force=force, options=self.options.multihost, metrics=metrics,
                    custom_metadata=metadata, copy=self._async is not None,
                    on_commit=on_commit, on_done=on_done, after_commit=after_commit)
                stats = job.stats
                stats.start_time, stats.wait_s = wall0, wait_s
                if self._async is None:
                    job.run()
            except BaseException as e:
                if isinstance(e, Exception) and self._exists(path):
                    # renamed into place (only the parent's fsync, or the last barrier,
                    # failed): the checkpoint is complete, so list it; delete nothing for it
                    with self._mutex:
                        self._infos[step] = policy.StepInfo(step, m, time.time())
                self._record(SaveStats(step, path, ok=False, error=f"{type(e).__name__}: {e}",
                                       start_time=wall0, wait_s=wait_s,
                                       async_=self._async is not None,
                                       total_s=time.perf_counter() - t0,
                                       blocking_s=time.perf_counter() - t0))
                raise
            if self._async is None:
                stats.total_s = stats.blocking_s = time.perf_counter() - t0
                self._record(stats)
                return True
            stats.async_ = True
            with self._mutex:  # the background's bookkeeping waits until this is in place
                stats.blocking_s = time.perf_counter() - t0
                self._async.start_write(path, job.run, stats=stats, t0=t0,
                                        what=f"step {step} ({path})",
                                        on_finish=lambda st: self._async_finished(step, st))
                # Counted at once (as in Orbax), on every process alike.
                self._infos[step] = policy.StepInfo(step, m, time.time())
                self._in_flight_step = self._pending_step = step
            return True

    def _committed(self, step: int, metrics: Any, stats: SaveStats,
                   retired: list[str] | None = None) -> None:
        """Bookkeeping after a durable commit: remember the step, then apply retention.
        With ``retired``, the steps retention deletes are only renamed out (their names
        appended to it); the caller removes their files later (``_remove_retired``)."""
        with self._mutex:
            m = dict(metrics) if metrics is not None else None
            self._infos[step] = policy.StepInfo(step, m, time.time())
            self._unreadable.pop(step, None)  # a new checkpoint under a set-aside one's step
            t = time.perf_counter()
            self._retired = retired
            try:
                self._apply_retention()
            except NotImplementedError:
                raise  # code not written yet (a lab's stub): no run-time condition to ride out
            except Exception as e:
                # step is committed: whatever retention met, the save did not fail (and the
                # next save's retention tries again)
                log.error("minickpt: step %d is saved, but the retention after it failed: "
                          "%s: %s", step, type(e).__name__, e)
                warnings.warn(f"step {step} is saved, but the retention after it failed: "
                              f"{type(e).__name__}: {e}", stacklevel=4)
            finally:
                self._retired = None
            stats.retention_s = time.perf_counter() - t

    def _exists(self, path: str) -> bool:
        try:
            return self.fs.is_dir(path)
        except OSError:
            return False

    def _record(self, stats: SaveStats) -> None:
        self.last_save_stats = stats
        self.save_history.append(stats)
        if self.listeners:  # as_dict() deep-copies: only when someone listens
            self._emit("save", stats.as_dict())
