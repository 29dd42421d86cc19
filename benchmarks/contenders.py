"""The contenders: minickpt, Orbax, and the machine's own limits, as timed operations.

Each class holds what one contender needs across repetitions (a checkpointer, a manager, a
buffer) and hands out :class:`~benchmarks.core.Op` objects. A save always goes to a fresh
directory (removed, untimed, after the repetition); a restore always reads the same
checkpoint, written once up front, into an abstract target (shapes, dtypes, shardings —
what a resuming job has), and waits until the arrays are ready.

The limits are measured with plain ``os`` calls on plain files: ``write_fsync`` is what
``dd conv=fsync`` does (write the bytes, fsync the file), ``read`` reads them back into a
preallocated buffer, ``memcpy`` copies them from one host buffer to another.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

from . import machine, states
from .core import Op
from .machine import PageCache, WarmCache

ITEM = "state"
_counter = itertools.count()


def fresh(workdir: str, stem: str) -> str:
    return os.path.join(workdir, f"{stem}-{os.getpid()}-{next(_counter)}")


def remove(path: str) -> None:
    """Delete, then fsync the parent: the journal commit that frees the blocks (and, on a
    file system mounted with ``discard``, trims them) is paid here, untimed, instead of by
    whichever contender happens to fsync next."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
    else:
        return
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def orbax_available() -> bool:
    try:
        import orbax.checkpoint  # noqa: F401
    except Exception:
        return False
    return True


def _ready(tree: Any) -> Any:
    return jax.block_until_ready(tree)


# ---------------------------------------------------------------------------------------
# the machine's limits
# ---------------------------------------------------------------------------------------
class Limits:
    """Sequential write + fsync, read back, and host copy of ``nbytes`` bytes."""

    def __init__(self, workdir: str, nbytes: int):
        self.workdir = workdir
        self.nbytes = max(int(nbytes), 1)
        rng = np.random.default_rng(3)
        self.src = rng.integers(0, 256, size=self.nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        self.dst.fill(0)  # touch every page now, not inside a timed copy
        self._path = ""
        self.read_path = fresh(workdir, "limit-read")
        self._write(self.read_path)

    def _write(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            mv = memoryview(self.src)
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off: off + (1 << 30)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_fsync(self) -> Op:
        def prepare() -> None:
            self._path = fresh(self.workdir, "limit-write")

        return Op("limit", lambda: self._write(self._path), prepare,
                  lambda: remove(self._path))

    def read(self, cache: PageCache | None = None, warm: WarmCache | None = None) -> Op:
        def run() -> None:
            fd = os.open(self.read_path, os.O_RDONLY)
            try:
                mv, off = memoryview(self.dst), 0
                while off < len(mv):
                    n = os.preadv(fd, [mv[off: off + (1 << 30)]], off)
                    if n <= 0:
                        raise EOFError(self.read_path)
                    off += n
            finally:
                os.close(fd)

        prepare = ((lambda: cache.evict(self.read_path)) if cache is not None else
                   (lambda: warm.warm(self.read_path)) if warm is not None else None)
        return Op("limit", run, prepare)

    def memcpy(self) -> Op:
        return Op("limit", lambda: np.copyto(self.dst, self.src))

    def close(self) -> None:
        remove(self.read_path)


class FioLimit:
    """The disk's limit for one row, measured at the row's own moments: fio's best case of
    the sweep at the start (``disk[kind]``, see :func:`machine.fio_limits`) run once per
    repetition, on this row's bytes, in turn with the libraries. The timed op is fio's whole
    process; what counts is fio's own time for the bytes it moved (:attr:`seconds`, the
    row's ``nbytes`` ÷ fio's bytes/s), not its start-up. A write case writes a fresh file each
    time (removed, untimed, after); a read case reads one file, evicted before each read."""

    def __init__(self, workdir: str, nbytes: int, disk: dict[str, Any], kind: str,
                 cache: PageCache | None = None, *, run: Any = None):
        self.workdir, self.nbytes, self.kind, self.cache = workdir, max(int(nbytes), 1), \
            kind, cache
        self.case = machine.FioCase(**disk[kind]["spec"])
        self.run = run
        self.seconds: list[float] = []
        self.bytes_per_s: list[float] = []
        self.read_path = fresh(workdir, "fio-read") if kind == "read" else ""
        self._path = ""

    def _once(self, path: str) -> None:
        r = machine.fio_once(self.case, path, self.nbytes, run=self.run)
        self.bytes_per_s.append(r["bytes_per_s"])
        self.seconds.append(self.nbytes / r["bytes_per_s"])

    def op(self) -> Op:
        if self.kind == "write":
            def prepare() -> None:
                self._path = fresh(self.workdir, "fio-write")

            return Op("limit", lambda: self._once(self._path), prepare,
                      lambda: remove(self._path))

        def prepare_read() -> None:
            if not os.path.exists(self.read_path):  # fio lays it out; written back here
                self._once(self.read_path)
                self.seconds.pop()
                self.bytes_per_s.pop()
            if self.cache is not None:  # fio evicts too (--invalidate=1); this checks it
                self.cache.evict(self.read_path)

        return Op("limit", lambda: self._once(self.read_path), prepare_read)

    def last(self, reps: int) -> tuple[list[float], list[float]]:
        """The seconds and bytes/s of the last ``reps`` runs (the warm-up ones dropped)."""
        return self.seconds[-reps:], self.bytes_per_s[-reps:]

    def close(self) -> None:
        if self.read_path:
            remove(self.read_path)


# ---------------------------------------------------------------------------------------
# the two libraries, through one shape each: a checkpointer and a manager
# ---------------------------------------------------------------------------------------
class _Checkpointer:
    """One checkpoint directory, saved and restored whole; a subclass says how, with
    ``_save(path)`` and ``_restore(path)`` (the restored tree)."""

    label = stem = ""

    def __init__(self, workdir: str, tree: Any):
        self.workdir, self.tree, self.target = workdir, tree, states.abstract(tree)
        self._path = ""
        self.saved = fresh(workdir, f"{self.stem}-restore")
        self._save(self.saved)

    def save(self) -> Op:
        def prepare() -> None:
            self._path = fresh(self.workdir, f"{self.stem}-save")

        return Op(self.label, lambda: self._save(self._path), prepare,
                  lambda: remove(self._path))

    def restore(self, cache: PageCache | None = None, warm: WarmCache | None = None) -> Op:
        """A restore of the checkpoint written up front: cold (``cache`` evicts its files
        first) or warm (``warm`` reads them into the page cache first), both untimed."""
        def run() -> None:
            _ready(self._restore(self.saved))

        prepare = ((lambda: cache.evict(self.saved)) if cache is not None else
                   (lambda: warm.warm(self.saved)) if warm is not None else None)
        return Op(self.label, run, prepare)

    def close(self) -> None:
        remove(self.saved)


class _Manager:
    """A manager keeping ``max_to_keep`` steps, so every save also deletes one; a subclass
    opens it (``_open(directory, **options)``) and saves and restores one step
    (``_save_step(step, tree)``, ``_restore_step(step)``)."""

    label = stem = ""

    def __init__(self, workdir: str, tree: Any, *, async_: bool = False, max_to_keep: int = 2,
                 background_delete: bool = False):
        self.dir = fresh(workdir, f"{self.stem}-mngr")
        self.mngr = self._open(self.dir, max_to_keep=max_to_keep,
                               enable_async_checkpointing=async_,
                               enable_background_delete=background_delete)
        self.async_ = async_
        self.keep, self.background_delete = max_to_keep, background_delete
        self.tree, self.target = tree, states.abstract(tree)
        self.step = 0
        for _ in range(max_to_keep):  # steady state: from now on every save deletes one
            self.save_now(tree)
        self.mngr.wait_until_finished()

    def save_now(self, tree: Any) -> None:
        self._save_step(self.step, tree)
        self.step += 1

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def busy(self) -> bool:
        """Whether a save is still being written (never blocks)."""
        return bool(self.async_ and self.mngr.is_saving_in_progress())

    def save(self) -> Op:
        """A whole save: for an async manager until it is committed; a background delete
        is not waited for (that is the point of the option), only before the next one."""
        if self.async_:
            return Op(self.label, lambda: (self.save_now(self.tree), self.wait()))
        return Op(self.label, lambda: self.save_now(self.tree), after=self.wait)

    def restore(self, warm: WarmCache | None = None) -> Op:
        """A restore of the latest step; with ``warm``, its files are read into the page
        cache first (untimed)."""
        prepare = ((lambda: warm.warm(self.step_dir(self.mngr.latest_step())))
                   if warm is not None else None)
        return Op(self.label, lambda: _ready(self._restore_step(self.mngr.latest_step())),
                  prepare)

    def step_dir(self, step: int) -> str:
        """The directory holding ``step`` (the manager's whole directory if not known)."""
        return self.dir

    def close(self) -> None:
        self.mngr.close()
        remove(self.dir)


# ---------------------------------------------------------------------------------------
# minickpt
# ---------------------------------------------------------------------------------------
class MinickptCheckpointer(_Checkpointer):
    """``minickpt.Checkpointer``: one checkpoint directory, saved and restored whole."""

    label, stem = "minickpt", "mc"

    def __init__(self, workdir: str, tree: Any, *, items: bool = False):
        import minickpt

        self.ck = minickpt.Checkpointer()
        self.items = items  # each top-level key of the tree an item of its own
        super().__init__(workdir, tree)

    def _save(self, path: str) -> None:
        self.ck.save(path, dict(self.tree) if self.items else {ITEM: self.tree})

    def _restore(self, path: str) -> Any:
        return self.ck.restore(path, dict(self.target) if self.items else {ITEM: self.target})


class MinickptManager(_Manager):
    """``minickpt.CheckpointManager`` keeping 2 steps, so every save also deletes one."""

    label, stem = "minickpt", "mc"

    def _open(self, directory: str, **options: Any) -> Any:
        import minickpt

        return minickpt.CheckpointManager(directory,
                                          minickpt.CheckpointManagerOptions(**options))

    def _save_step(self, step: int, tree: Any) -> None:
        self.mngr.save(step, {ITEM: tree}, force=True)

    def _restore_step(self, step: int) -> Any:
        return self.mngr.restore(step, target={ITEM: self.target})

    def step_dir(self, step: int) -> str:
        return self.mngr.step_path(step)


# ---------------------------------------------------------------------------------------
# Orbax
# ---------------------------------------------------------------------------------------
class OrbaxCheckpointer(_Checkpointer):
    """``orbax.checkpoint.StandardCheckpointer``: save, then wait until it is finished."""

    label, stem = "orbax", "ox"

    def __init__(self, workdir: str, tree: Any):
        import orbax.checkpoint as ocp

        self.ck = ocp.StandardCheckpointer()
        super().__init__(workdir, tree)

    def _save(self, path: str) -> None:
        self.ck.save(path, self.tree)
        self.ck.wait_until_finished()

    def _restore(self, path: str) -> Any:
        return self.ck.restore(path, self.target)

    def close(self) -> None:
        self.ck.close()
        super().close()


class OrbaxManager(_Manager):
    """``orbax.checkpoint.CheckpointManager`` with the same options as minickpt's."""

    label, stem = "orbax", "ox"

    def wait(self) -> None:
        """Until the save is finished and, with background delete, the step it retired is
        gone: Orbax's ``wait_until_finished`` does not wait for its deleter thread (0.12.8),
        whose deleting would otherwise overlap the next contender's timed run."""
        super().wait()
        doomed = self.step - 1 - self.keep
        if not self.background_delete or doomed < 0:
            return
        path = os.path.join(self.dir, str(doomed))  # Orbax's default step name
        deadline = time.monotonic() + 60
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _open(self, directory: str, **options: Any) -> Any:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options))

    def _save_step(self, step: int, tree: Any) -> None:
        self.mngr.save(step, args=self.ocp.args.StandardSave(tree), force=True)

    def _restore_step(self, step: int) -> Any:
        return self.mngr.restore(step, args=self.ocp.args.StandardRestore(self.target))

    def step_dir(self, step: int) -> str:
        path = os.path.join(self.dir, str(step))  # Orbax's default step name
        return path if os.path.isdir(path) else self.dir
