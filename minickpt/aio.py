"""What minickpt asks of the kernel beyond ``os``: libc, and a group fsync.

A save ends with one fsync per file and directory it wrote. One after the other they cost a
disk round trip each; together the disk can take them as one. On Linux the batch goes to the
kernel as one ``io_submit`` of ``IOCB_CMD_FSYNC`` requests (no thread started); elsewhere, or
when AIO is refused, :func:`_run_together` runs them on a few short-lived threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any


def _load_libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover - exotic platforms
        return None


_LIBC = _load_libc()


_SYNC_THREADS = 8  # fsyncs wait on the disk, not the CPU: more threads than cores is right


# ---- kernel AIO fsync (Linux): a group commit without starting threads -----------------
_AIO_SYSCALLS = {"x86_64": (206, 208, 209), "aarch64": (0, 4, 2)}  # setup, getevents, submit
_IOCB_CMD_FSYNC = 2
_AIO_DEPTH = 128  # fsyncs in flight per ring; a larger batch goes in chunks of this many


class _Iocb(ctypes.Structure):  # struct iocb, <linux/aio_abi.h>, little-endian layout
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


def _aio_syscall() -> Any:
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or _LIBC is None \
            or os.environ.get("MINICKPT_NO_AIO"):
        return None
    import platform

    nrs = _AIO_SYSCALLS.get(platform.machine())
    fn = getattr(_LIBC, "syscall", None)
    if nrs is None or fn is None:
        return None
    fn.restype = ctypes.c_long
    return fn, nrs


_AIO_SYSCALL = _aio_syscall()


class _AioRing:
    """One kernel AIO context (``io_setup``); used by one ``fsync_all`` at a time."""

    def __init__(self, ctx: int):
        self.ctx = ctypes.c_ulong(ctx)
        self.pid = os.getpid()  # a forked child cannot use its parent's context

    def fsync(self, fds: Sequence[int]) -> list[Any] | None:
        """fsync every fd; per fd None, the OSError its fsync gave, or "unsubmitted".
        None if the kernel does not know the opcode (then nothing was done)."""
        call, (_, nr_getevents, nr_submit) = _AIO_SYSCALL
        out: list[Any] = [None] * len(fds)
        for start in range(0, len(fds), _AIO_DEPTH):
            chunk = fds[start:start + _AIO_DEPTH]
            n = len(chunk)
            cbs = (_Iocb * n)()
            ptrs = (ctypes.POINTER(_Iocb) * n)()
            for i, fd in enumerate(chunk):
                cbs[i].data, cbs[i].opcode, cbs[i].fildes = i, _IOCB_CMD_FSYNC, fd
                ptrs[i] = ctypes.pointer(cbs[i])
            submitted = 0
            while submitted < n:
                r = call(nr_submit, self.ctx, ctypes.c_long(n - submitted),
                         ctypes.byref(ptrs, submitted * ctypes.sizeof(ptrs._type_)))
                if r > 0:
                    submitted += r
                    continue
                err = ctypes.get_errno()
                if r < 0 and err == errno.EINTR:
                    continue
                if r < 0 and err in (errno.EINVAL, errno.ENOSYS) and submitted == 0 \
                        and start == 0:
                    _AIO_RINGS.broken = True
                    return None
                for i in range(submitted, n):  # the first refused one and those after it
                    out[start + i] = "unsubmitted"
                break
            events = (_IoEvent * max(submitted, 1))()
            got = 0
            while got < submitted:
                r = call(nr_getevents, self.ctx, ctypes.c_long(submitted - got),
                         ctypes.c_long(submitted - got),
                         ctypes.byref(events, got * ctypes.sizeof(_IoEvent)), None)
                if r < 0:
                    err = ctypes.get_errno()
                    if err == errno.EINTR:
                        continue
                    raise OSError(err, f"io_getevents: {os.strerror(err)}")
                got += r
            for ev in events[:submitted]:
                if ev.res < 0:
                    out[start + ev.data] = OSError(-ev.res, os.strerror(-ev.res))
        return out


class _AioRings:
    """Idle AIO contexts, reused across saves (a context is no thread: nothing runs)."""

    def __init__(self) -> None:
        self.free: list[_AioRing] = []
        self.lock = threading.Lock()
        self.broken = False

    def get(self) -> _AioRing | None:
        with self.lock:
            while self.free:
                ring = self.free.pop()
                if ring.pid == os.getpid():
                    return ring
            if self.broken:
                return None
        call, (nr_setup, _, _) = _AIO_SYSCALL
        ctx = ctypes.c_ulong(0)
        if call(nr_setup, _AIO_DEPTH, ctypes.byref(ctx)) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                self.broken = True  # no AIO here (a sandbox, an old kernel): threads
            return None  # EAGAIN (aio-max-nr reached): threads, this time
        return _AioRing(ctx.value)

    def put(self, ring: _AioRing) -> None:
        with self.lock:
            if ring.pid == os.getpid() and not self.broken:
                self.free.append(ring)


_AIO_RINGS = _AioRings()


def _run_together(jobs: Sequence[tuple[Callable[..., None], Any]]) -> None:
    """Run every ``fn(arg)`` at once: the caller's thread and up to ``_SYNC_THREADS - 1``
    threads started for this call, which all end before it returns — no pool outlives a save,
    so nothing of minickpt's is left running after ``close()``. (Starting a few threads costs
    tens of microseconds; one fsync costs milliseconds.) Raises the first job's error, in job
    order, once every job has finished."""
    errors: list[BaseException | None] = [None] * len(jobs)
    todo = iter(range(len(jobs)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            fn, arg = jobs[i]
            try:
                fn(arg)
            except BaseException as e:
                errors[i] = e

    threads = []
    for n in range(min(_SYNC_THREADS, len(jobs)) - 1):
        t = threading.Thread(target=work, name=f"minickpt-fsync_{n}", daemon=True)
        try:
            t.start()
        except RuntimeError:  # interpreter exit (a pending async save finishing from
            break  # atexit): no new threads, the caller's thread does the rest
        threads.append(t)
    try:
        work()
    finally:
        for t in threads:
            t.join()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


