"""Async checkpointing: take a photo of the state, let training go on, write it in the background.

An async save has two phases:

1. **The snapshot — the "photo"** (blocking, in ``save()``). Every leaf is brought into host
   memory that nothing else will change: numpy leaves and everything mutable are *copied*;
   arrays on a GPU/TPU come over by their device-to-host transfer (which is a copy); arrays on
   the CPU backend are *pinned zero-copy views* where JAX allows it (below), copies otherwise.
   ``save()`` returns as soon as the photo exists. On an accelerator the photo can stay on
   the device instead (the *device-side snapshot*, below): ``save()`` then only enqueues a
   copy of each array on its own device, and the transfer to the host is part of phase 2.
2. **The background write** (in a thread, :class:`AsyncWriter`). The photo is written with
   exactly the synchronous path's :meth:`Checkpointer.write <minickpt.checkpointer.Checkpointer.write>`
   — temporary directory, fsync of every file and directory, rename that never replaces, fsync
   of the parent — then the manager's bookkeeping and retention run, in that order. Each item's
   copies are freed, and its views unpinned, as soon as its bytes are written.

Why the photo must be finished before ``save()`` returns: the very next training step may
change the buffers the state lives in. A numpy leaf can be mutated in place. A ``jax.Array``
is immutable as a value, but its *buffer* is not: ``jax.jit(step, donate_argnums=0)`` donates
the old state's buffers to XLA, which writes the new state into that same memory (and marks
the old array deleted); ``x.delete()`` frees it. A writer still reading the old buffers would
then save a mixture of two steps, or crash.

Why a view can be enough on the CPU: there, ``np.asarray(x)`` of a single-buffer array is a
view of x's own buffer, and while such a view is alive JAX *pins* the buffer: a donating step
does not get it (XLA writes its output into a new buffer instead) and ``x.delete()`` leaves
the bytes alone. So the view is as safe as a copy, and costs nothing in ``save()``. The price
moves, it does not vanish: the first donating step after a save allocates a fresh output
buffer (page faults for the whole state) where it would have reused the old one. Measured
on a 2-core VM with 400 MB in 50 leaves: that step took 318-377 ms instead of ~20 ms (about
100,000 page faults), where a copy into fresh memory held ``save()`` for 660-700 ms, and a
copy into host buffers reused from save to save (55 ms in ``save()``, no faults) cost the
interval about as much as the pin; nothing at all when the training step does not donate.
This pinning is JAX behaviour, not API, so a one-time probe
(:func:`minickpt.tree.pinning_works`) checks it on a small array at the first save; if it does
not hold in the JAX at hand, every snapshot is a copy (logged once, at debug level).
``MINICKPT_ASYNC_SNAPSHOT=copy`` or ``AsyncCheckpointer(zero_copy=False)`` forces copies.
:func:`snapshot` — the lab's Task 5.1 — is always the copy, the idea the course teaches first.
Arrays sharded over several CPU devices are pinned when replicated (one buffer is viewed);
otherwise they are assembled into a new host array and copied, as before.

**The device-side snapshot** (:mod:`minickpt.device_snapshot`). On a GPU/TPU the host photo
is the device-to-host transfer of the whole state, and ``save()`` waits for it (on a TPU v5e,
400 MB held the training loop 100+ ms: async throughput 0.49 / 0.92 / 0.96 of no-save
throughput with a save every 140 / 500 / 1000 steps). Instead, ``save()`` enqueues
``jnp.copy`` of each accelerator leaf — a jitted copy into new buffers with the leaf's
sharding, dispatched asynchronously — and returns; the background writer transfers the copies
(all started before any is waited for), frees them, and writes as above. The copy is safe
against what the loop does next because it is a JAX computation that reads the leaf,
dispatched before any later step that donates or deletes it; its buffers belong to the save
alone. It costs one state's worth of device memory until written, so by default it is used
only when the accelerator leaves' copies take at most half of every device's free memory
(``memory_stats()``: ``bytes_limit - bytes_in_use``; no figures, no device snapshot).
Everything else (numpy leaves, scalars, typed PRNG keys, CPU arrays) still gets its host photo
in ``save()``, where an unsupported leaf is refused before any copy is enqueued; a transfer
that fails is the save's error, like a failed write, and nothing is committed.
``MINICKPT_ASYNC_SNAPSHOT=device`` or ``AsyncCheckpointer(device_snapshot=True)`` forces it
for every ``jax.Array`` leaf, CPU ones included (how the tests run it); ``host`` (or
``copy``) or ``device_snapshot=False`` rules it out. TPU figures: to be measured.

One save is in flight at a time: the next ``save()`` first waits for the previous one (and logs
a warning when that wait is long — saves are then slower than the interval between them).
An error in the background is never lost: it is raised — with its errno, and the original
exception as its cause — by the next ``save()``, ``wait_until_finished()`` or ``close()``;
the failed save's temporary directory is removed, earlier checkpoints are untouched, and
retention never runs for it. Pending saves are finished when the interpreter exits normally.

:class:`AsyncWriter` runs any write phase given as a callable, so the same writer runs the
single-process :meth:`Checkpointer.write` and a multi-host per-process shard writer with its
barriers and primary commit (:meth:`AsyncCheckpointer.start_write`).

**Several processes** (``jax.distributed``, chapter 4): ``save()`` blocks for the step
agreement and the snapshot of the shards this process owns; the shard writes, the barriers,
the primary's commit and retention run in the background. Every process waits for its own
save in flight before the next collective operation (save, restore, delete) starts, so the
barriers of two operations never interleave, and a failure anywhere — an I/O error on one
process, a peer that does not arrive — is raised on *every* process at the same call (the
next ``save()`` that saves, ``wait_until_finished()``, ``close()``, ``restore()``,
``delete()``), naming the process that failed. See :class:`~minickpt.manager.CheckpointManager`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import device_snapshot
from .checkpointer import (
    Checkpointer,
    CheckpointMetadata,
    SaveStats,
    VerifyReport,
    _json_safe,
    save_error,
)
from .errors import MiniCkptError, PeerTimeoutError, StepAlreadyExistsError
from .format.encode import ItemPlan
from .fs import FileSystem

log = logging.getLogger("minickpt")

WAIT_WARNING_S = 1.0
"""A ``save()`` that waits longer than this for the previous save logs a warning."""


def snapshot(items: Mapping[str, Any], *, executor: ThreadPoolExecutor | None = None
             ) -> dict[str, ItemPlan]:
    """The "photo": every item copied to host memory and laid out for writing.

    The copy is what makes an async save safe: whatever happens to the arrays after this
    returns (in-place mutation of a numpy leaf, ``x.delete()``, donation to a jitted step)
    cannot change what is written. Each leaf goes through :func:`~minickpt.tree.snapshot_leaf`
    (the lab's Task 5.1). Large leaves are copied in ``executor``'s threads.
    (:class:`AsyncCheckpointer` goes one step further on the CPU: pinned views instead of
    copies where JAX allows it, see the module's docstring.)
    """
    return Checkpointer().plan(items, copy=True, executor=executor)


def start_in_background(writer: AsyncWriter, fn: Callable[[], Any], what: str) -> None:
    """Task 5.2 (start) — run the write phase ``fn`` in a thread of its own and return at once.

    Guarantees: at most one write phase runs at any moment — a start while one is in flight
    raises :class:`MiniCkptError` naming both saves and leaves the one in flight as it was,
    and whoever calls ``writer.wait()`` once this returned waits for the new thread; a start
    while a failure of the previous save has not been raised yet is refused the same way
    (starting over it would hide that a checkpoint was never committed); a program that
    ends normally still finishes the pending save. The thread runs
    ``run_in_background(writer, fn, what)``.
    """
    with writer._lock:
        if writer._thread is not None and writer._thread.is_alive():
            raise MiniCkptError(f"cannot start the background save of {what}: the save of "
                                f"{writer._what} is still in flight (wait() first)")
        if writer._error is not None:
            raise MiniCkptError(f"cannot start the background save of {what}: the error "
                                f"of the save of {writer._what} was not collected yet")
        thread = threading.Thread(target=run_in_background, args=(writer, fn, what),
                                  name=f"{writer.name}:{what}", daemon=False)
        thread.start()  # under the lock: a thread set but not started would look finished
        writer._thread, writer._what = thread, what


def run_in_background(writer: AsyncWriter, fn: Callable[[], Any], what: str) -> None:
    """Task 5.2 (run) — the body of the writer's thread: run ``fn()``; lose no failure.

    Nobody is there to catch what ``fn`` raises: left alone, an exception in a thread is
    printed by ``threading.excepthook`` and forgotten, and the training loop goes on believing
    its checkpoint exists. Guarantees: whatever ``fn`` raises — any ``BaseException`` — is kept
    in the writer for the training loop, as the very object raised (errno, traceback), with a
    note naming the save (``what``).
    """
    try:
        fn()
    except BaseException as e:  # kept for the training loop, never swallowed
        e.add_note(f"minickpt: raised in the background by the async save of {what}")
        with writer._lock:
            writer._error = e


def collect_error(writer: AsyncWriter) -> None:
    """Task 5.2 (collect) — raise the kept failure of a finished write phase; never block.

    Guarantees: the failure is raised as it was (an ``OSError`` keeps its errno, say
    ``ENOSPC``, so the loop can react to it), exactly once — afterwards this returns quietly
    and the next save can start; with no failure it returns; it never waits for the disk.
    """
    with writer._lock:
        err, writer._error = writer._error, None
    if err is not None:
        raise err


class AsyncWriter:
    """Runs one write phase at a time in a background thread and keeps its error.

    ``start(fn)`` runs ``fn()`` in a new (non-daemon) thread; the caller must first
    :meth:`wait` for the previous one. An exception from ``fn`` is kept and raised, once, by
    :meth:`check_for_errors` (and so by :meth:`wait_until_finished` and :meth:`close`).
    The three steps are the lab's Task 5.2: :func:`start_in_background`,
    :func:`run_in_background`, :func:`collect_error`.
    """

    def __init__(self, *, name: str = "minickpt-async-save",
                 wait_warning_s: float | None = None):
        self.name = name
        self.wait_warning_s = wait_warning_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._what: str | None = None
        self._error: BaseException | None = None
        _LIVE_WRITERS.add(self)

    def start(self, fn: Callable[[], Any], *, what: str) -> None:
        """Run the write phase ``fn`` in the background; ``what`` names it in messages."""
        start_in_background(self, fn, what)

    def wait(self, *, reason: str | None = None) -> float:
        """Block until no write phase runs; return the seconds waited. Never raises its error.

        With a ``reason`` (e.g. "the save of step 20"), a wait longer than ``wait_warning_s``
        (default: the module's ``WAIT_WARNING_S``) is logged as a warning: saves are then
        slower than the interval between them.
        """
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return 0.0
        t0 = time.perf_counter()
        threshold = WAIT_WARNING_S if self.wait_warning_s is None else self.wait_warning_s
        if reason is not None:
            thread.join(threshold)
            if thread.is_alive():
                log.warning("minickpt: %s waits for the background save of %s, still writing "
                            "after %.1f s (one save is in flight at a time): checkpoints take "
                            "longer to write than the interval between them", reason,
                            self._what, time.perf_counter() - t0)
        thread.join()
        return time.perf_counter() - t0

    def check_for_errors(self) -> None:
        """Raise the error of a finished write phase — the original exception — once."""
        collect_error(self)

    def wait_until_finished(self) -> None:
        """Block until the write phase in flight (if any) is done; raise its error."""
        self.wait()
        self.check_for_errors()

    def is_saving_in_progress(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def in_flight(self) -> str | None:
        """What is being written now (``what`` of the running phase), or None."""
        return self._what if self.is_saving_in_progress() else None

    def close(self) -> None:
        self.wait_until_finished()


_LIVE_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()


@atexit.register
def _finish_pending_saves() -> None:
    """At a normal exit: wait for every background save; report errors nobody collected.

    The writer threads are not daemons, so Python has already joined them when atexit
    handlers run: a pending save — multi-host ones included, whose barriers need
    ``jax.distributed`` — has finished before ``jax.distributed.shutdown()``, which JAX
    registers with atexit when ``jax`` is imported, i.e. before this module registers this
    handler (atexit runs handlers last-registered first). Each barrier of a multi-host save
    is bounded by ``MultiHostOptions.timeout_s``, so that join is bounded too.

    If a save failed because a peer did not arrive (:class:`PeerTimeoutError`: it died or
    hangs), JAX's shutdown would be a barrier waiting for that peer (for
    ``shutdown_timeout_seconds``, then it aborts): the process leaves at once instead, with
    exit status 1 — the end of :func:`minickpt.multihost.process.hard_exit`'s advice.
    """
    lost_peer: PeerTimeoutError | None = None
    for writer in list(_LIVE_WRITERS):
        writer.wait()
        try:
            writer.check_for_errors()
        except BaseException as e:  # at exit there is no caller left to raise to
            log.error("minickpt: the async save of %s failed, and the program exited before "
                      "the error was collected (call wait_until_finished() or close() before "
                      "exiting): %s: %s", writer._what, type(e).__name__, e, exc_info=e)
            if isinstance(e, PeerTimeoutError):
                lost_peer = e
    if lost_peer is not None:
        from .multihost.process import hard_exit

        log.error("minickpt: process(es) %s of the job are gone; exiting now with status 1, "
                  "without jax.distributed.shutdown() (it would wait for them)",
                  ", ".join(map(str, lost_peer.missing)))
        hard_exit(1)


SNAPSHOT_ENV = "MINICKPT_ASYNC_SNAPSHOT"
"""How async snapshots are taken: ``copy`` makes every one a host copy (no pinned zero-copy
views, no device-side copies); ``host`` rules out the device-side snapshot only; ``device``
forces it for every ``jax.Array`` leaf, CPU arrays included, whatever the free memory; unset
(or ``pin``): the defaults — pinned views on the CPU, device-side copies of accelerator leaves
where they fit."""


def _snapshot_env() -> str:
    return os.environ.get(SNAPSHOT_ENV, "").strip().lower()


def default_zero_copy() -> bool:
    """Whether async snapshots may pin CPU arrays instead of copying them: yes, unless the
    environment variable ``MINICKPT_ASYNC_SNAPSHOT`` is ``copy`` (to compare, or to rule the
    pinning out when something looks wrong)."""
    return _snapshot_env() != "copy"


def default_device_snapshot() -> bool | None:
    """Whether async saves copy ``jax.Array`` leaves on their devices and transfer the copies
    in the background (:mod:`minickpt.device_snapshot`): ``MINICKPT_ASYNC_SNAPSHOT=device``
    forces it (True), ``host`` or ``copy`` rules it out (False); otherwise None, automatic:
    accelerator leaves, when their copies fit in the devices' free memory."""
    mode = _snapshot_env()
    if mode == "device":
        return True
    if mode in ("host", "copy"):
        return False
    return None


def default_snapshot_threads() -> int:
    """Threads that copy leaves during the snapshot: a quarter of the CPUs, 1 to 8.

    Parallel copies pay off only with idle cores. On a busy 2-core machine
    (benchmarks/async_blocking.py) 2 copying threads were sometimes faster than 1 and sometimes
    several times slower (each hand-over of the GIL waits for a descheduled thread), so small
    machines copy in one thread. On GPU/TPU the device arrays need no host copy at all (the
    transfer is the copy), so this matters for CPU arrays and numpy leaves.
    """
    return max(1, min(8, (os.cpu_count() or 1) // 4))


class AsyncCheckpointer(Checkpointer):
    """A :class:`Checkpointer` whose ``save()`` returns after the snapshot (Orbax's
    ``AsyncCheckpointer``): the write and commit run in the background, one at a time.

    ``save()`` returns the save's :class:`SaveStats`, which the background fills in;
    :meth:`wait_until_finished` makes it final. Reading the checkpoint being written
    (``restore``, ``metadata``, ``verify``) waits for it first.
    """

    def __init__(self, fs: FileSystem | None = None, *,
                 wait_warning_s: float | None = None,
                 snapshot_threads: int | None = None,
                 zero_copy: bool | None = None,
                 device_snapshot: bool | None = None):
        super().__init__(fs)
        self._writer = AsyncWriter(wait_warning_s=wait_warning_s)
        self._threads = snapshot_threads or default_snapshot_threads()
        self.zero_copy = default_zero_copy() if zero_copy is None else zero_copy
        """Pin CPU arrays instead of copying them in the snapshot (where JAX allows it)."""
        self.device_snapshot = (default_device_snapshot() if device_snapshot is None
                                else device_snapshot)
        """Copy ``jax.Array`` leaves on their devices in ``save()`` and transfer the copies in
        the background: True for every such leaf, False never, None for accelerator leaves
        whose copies fit in the devices' free memory (:mod:`minickpt.device_snapshot`)."""
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight_path: str | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self.last_save_stats: SaveStats | None = None

    # ---- saving ------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str], items: Mapping[str, Any], *,
             step: int | None = None, metrics: Mapping[str, Any] | None = None,
             custom_metadata: Mapping[str, Any] | None = None,
             on_commit: Callable[[SaveStats], Any] | None = None,
             on_finish: Callable[[SaveStats], Any] | None = None) -> SaveStats:
        """Snapshot ``items``, start writing them to ``directory`` in the background, return.

        First raises the error of a previous save, if it failed, and waits for a previous
        save still in flight. ``on_commit(stats)`` runs in the background after the commit;
        ``on_finish(stats)`` after every save, committed or failed (``stats.ok`` says which).
        """
        t0, wall0 = time.perf_counter(), time.time()
        self.check_for_errors()
        wait_s = 0.0
        while True:
            wait_s += self.wait_for_previous(f"the save of {os.fspath(directory)}")
            self.check_for_errors()
            with self._start_lock:
                if self.is_saving_in_progress():
                    continue  # another thread's save started meanwhile: wait for it too
                return self.start_save(directory, items, step=step, metrics=metrics,
                                       custom_metadata=custom_metadata, on_commit=on_commit,
                                       on_finish=on_finish, t0=t0, wall0=wall0, wait_s=wait_s)

    def wait_for_previous(self, reason: str | None = None) -> float:
        """Wait (without raising its error) for the save in flight; return seconds waited.
        With a ``reason`` ("the save of step 20"), a long wait is logged as a warning."""
        return self._writer.wait(reason=reason)

    def start_save(self, directory: str | os.PathLike[str], items: Mapping[str, Any], *,
                   step: int | None = None, metrics: Mapping[str, Any] | None = None,
                   custom_metadata: Mapping[str, Any] | None = None,
                   on_commit: Callable[[SaveStats], Any] | None = None,
                   on_finish: Callable[[SaveStats], Any] | None = None,
                   t0: float | None = None, wall0: float | None = None,
                   wait_s: float = 0.0) -> SaveStats:
        """The part of :meth:`save` after the wait: snapshot, then start the writer.

        For callers (the manager) that wait for the previous save themselves, outside their
        own lock. ``t0``/``wall0``: when the caller's ``save()`` began (perf_counter / time).
        """
        t0 = time.perf_counter() if t0 is None else t0
        wall0 = time.time() if wall0 is None else wall0
        if self._closed:
            raise MiniCkptError("this AsyncCheckpointer is closed")
        directory = os.path.abspath(os.fspath(directory))
        try:
            exists = self.fs.exists(directory)
        except OSError as e:
            raise save_error(e, directory) from e
        if exists:
            raise StepAlreadyExistsError(f"{directory} already exists: minickpt never "
                                         "replaces a committed checkpoint")
        # Metrics and metadata are part of the photo too: plain JSON, copied now.
        metrics = _json_safe(metrics, "metrics") if metrics is not None else None
        custom_metadata = _json_safe(custom_metadata or {}, "metadata")
        init_ns = time.time_ns()
        t_snap = time.perf_counter()
        if self._pool is None and self._threads > 1:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="minickpt-snap")
        on_device = None
        if self.device_snapshot is not False:  # copies enqueued on the devices, or None
            on_device = device_snapshot.take(items, force=self.device_snapshot is True,
                                             executor=self._pool, pin=self.zero_copy)
        plans = ({} if on_device is not None else
                 self.plan(items, copy=True, executor=self._pool, pin=self.zero_copy))
        stats = SaveStats(step, directory, start_time=wall0, async_=True, wait_s=wait_s)
        stats.snapshot_s = time.perf_counter() - t_snap
        what = directory if step is None else f"step {step} ({directory})"

        def write_phase() -> None:
            try:
                if on_device is not None:  # the device-to-host transfer of the copies
                    plans.update(on_device.finish())
                self.write(directory, plans, step=step, metrics=metrics,
                           custom_metadata=custom_metadata, stats=stats, init_ns=init_ns,
                           release=True)
                if on_commit is not None:
                    on_commit(stats)
            finally:
                plans.clear()  # free the copies, unpin the views: written now
                if on_device is not None:
                    on_device.release()

        stats.blocking_s = time.perf_counter() - t0
        self.start_write(directory, write_phase, stats=stats, what=what, t0=t0,
                         on_finish=on_finish)
        return stats

    def start_write(self, directory: str | os.PathLike[str], write_phase: Callable[[], Any], *,
                    stats: SaveStats, what: str, t0: float | None = None,
                    on_finish: Callable[[SaveStats], Any] | None = None) -> None:
        """Run any write phase of ``directory`` in the background, as the save in flight.

        The snapshot must already be taken. This is how a save whose write phase is not
        :meth:`write` runs here — the multi-host manager hands over
        :meth:`minickpt.multihost.save.CollectiveSave.run` (shard writes, barriers, the primary's
        commit) — with the same guarantees: one in flight, its error kept for the caller,
        reads of ``directory`` waiting for it. A failure marks ``stats`` (``ok``,
        ``error``); ``total_s`` is measured from ``t0``; ``on_finish(stats)`` runs last.
        """
        if self._closed:
            raise MiniCkptError("this AsyncCheckpointer is closed")
        t0 = time.perf_counter() if t0 is None else t0

        def run() -> None:
            try:
                write_phase()
            except BaseException as e:
                stats.ok, stats.error = False, f"{type(e).__name__}: {e}"
                raise
            finally:
                stats.total_s = time.perf_counter() - t0
                self._in_flight_path = None
                self.last_save_stats = stats
                if on_finish is not None:
                    try:
                        on_finish(stats)
                    except Exception:  # bookkeeping must not hide the save's own outcome
                        log.exception("minickpt: on_finish failed after the save of %s", what)

        self._in_flight_path = os.path.abspath(os.fspath(directory))
        try:
            self._writer.start(run, what=what)
        except BaseException:
            self._in_flight_path = None
            raise

    # ---- the writer's state ------------------------------------------------------------
    def check_for_errors(self) -> None:
        """Raise the error of a finished background save (once); never blocks."""
        self._writer.check_for_errors()

    def wait_until_finished(self) -> None:
        """Block until the save in flight has committed; raise its error if it failed."""
        self._writer.wait_until_finished()

    def is_saving_in_progress(self) -> bool:
        return self._writer.is_saving_in_progress()

    def close(self) -> None:
        """Finish the pending save (raising its error) and release the snapshot threads."""
        self._closed = True
        try:
            self._writer.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- reading what may be in flight -------------------------------------------------
    def _settle(self, directory: str | os.PathLike[str]) -> None:
        """Reading the checkpoint being written: wait for its commit (or its error) first."""
        path = self._in_flight_path
        if path is not None and os.path.abspath(os.fspath(directory)) == path:
            self.wait_until_finished()

    def metadata(self, directory: str | os.PathLike[str], *, step: int | None = None
                 ) -> CheckpointMetadata:
        self._settle(directory)
        return super().metadata(directory, step=step)

    def restore(self, directory: str | os.PathLike[str], target: Mapping[str, Any] | None = None,
                **kw: Any) -> dict[str, Any]:
        self._settle(directory)
        return super().restore(directory, target, **kw)

    def verify(self, directory: str | os.PathLike[str], *, deep: bool = True,
               step: int | None = None) -> VerifyReport:
        self._settle(directory)
        return super().verify(directory, deep=deep, step=step)


def timeline(history: Iterable[SaveStats]) -> list[dict[str, Any]]:
    """Each save as intervals on one clock, for plotting and measuring overlap (:func:`overlap`).

    Times are seconds since the first save began: ``start`` → ``unblocked`` is the training
    loop's pause (the wait for the previous save, then the snapshot); ``unblocked`` → ``end``
    is the background write, commit and retention. ``hidden_s`` is the part of a save's
    time the training loop did not wait for.
    """
    rows = sorted(history, key=lambda s: s.start_time)
    if not rows:
        return []
    origin = rows[0].start_time
    out = []
    for s in rows:
        start = s.start_time - origin
        out.append({"step": s.step, "async": s.async_, "ok": s.ok, "start": start,
                    "unblocked": start + s.blocking_s, "end": start + s.total_s,
                    "wait_s": s.wait_s, "snapshot_s": s.snapshot_s, "write_s": s.write_s,
                    "fsync_s": s.fsync_s, "commit_s": s.commit_s,
                    "hidden_s": max(0.0, s.total_s - s.blocking_s), "bytes": s.bytes})
    return out


def save_intervals(history: Iterable[SaveStats]) -> list[tuple[float, float, float]]:
    """Each save as ``(start, unblocked, end)`` on the wall clock (``time.time()``): called,
    returned to the training loop, finished in the background. What :func:`overlap` reads."""
    return [(s.start_time, s.start_time + s.blocking_s, s.start_time + s.total_s)
            for s in sorted(history, key=lambda s: s.start_time)]


def overlap(steps: Sequence[tuple[float, float]],
            saves: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """Task 5.3 — what the saves of a real run cost the training loop, from its timestamps.

    ``steps``: each training step's compute as ``(start, end)``; ``saves``: each save as
    ``(start, unblocked, end)`` — ``save()`` called, ``save()`` returned, background write
    finished (:func:`save_intervals`); all on one clock, in seconds, in any order. Steps do
    not overlap one another, nor do two saves' background writes (one save in flight).

    Returns four floats, in seconds: ``blocked_s``, the time the loop spent inside
    ``save()``; ``stall_s``, the part of it spent waiting for the *previous* save's write to
    end; ``write_s``, the background time of the writes; ``hidden_s``, the part of
    ``write_s`` during which a training step was computing (not evaluation, logging or the
    final ``wait_until_finished()``). An empty run costs nothing: every value 0.0.
    """
    saves = sorted(saves)
    blocked = stall = write = hidden = 0.0
    prev_end = float("-inf")
    for start, unblocked, end in saves:
        blocked += unblocked - start
        stall += max(0.0, min(unblocked, prev_end) - start)
        write += end - unblocked
        for s0, s1 in steps:
            hidden += max(0.0, min(end, s1) - max(unblocked, s0))
        prev_end = end
    return {"blocked_s": blocked, "stall_s": stall, "write_s": write, "hidden_s": hidden}
