"""Fault injection: a :class:`~minickpt.fs.FileSystem` that fails or stops at any single call.

Tests and the crash harness count every primitive call a save makes, then rerun it failing (an
``OSError``) or crashing (:class:`SimulatedCrash`) at call N, for every N, and check what is
left on disk.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .fs import Buffer, FileSystem

PRIMITIVES = ("open", "write", "pwrite", "writev", "preadv", "fsync", "close", "ftruncate",
              "mkdir", "rename", "unlink", "rmdir", "listdir", "lstat", "fstat", "flock",
              "start_writeback", "allocate")


class FaultyFileSystem(FileSystem):
    """A file system that fails (or crashes) at a chosen call, for crash-safety tests.

    ``fail_at=n`` makes the n-th primitive call (counting from 0, among ``ops``) raise
    ``error``; ``crash=True`` instead raises :class:`SimulatedCrash`, which the library does
    not catch, so nothing after that call runs — like a power cut between two syscalls.
    ``persistent=True`` makes every counted call from the n-th on fail too (a disk that stays
    full or dead, rather than one transient error). Every call is recorded in ``calls`` as
    ``(op, args)``.
    """

    def __init__(self, fail_at: int | None = None, *, error: BaseException | None = None,
                 ops: Iterable[str] = PRIMITIVES, crash: bool = False,
                 base: FileSystem | None = None,
                 when: Callable[[str, tuple[Any, ...]], bool] | None = None,
                 persistent: bool = False):
        self.fail_at = fail_at
        self.persistent = persistent
        self.error = error if error is not None else OSError(errno.EIO, os.strerror(errno.EIO))
        self.ops = frozenset(ops)
        self.crash = crash
        self.base = base or FileSystem()
        self.when = when
        self.count = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.tripped = False
        self._lock = threading.Lock()

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            counted = op in self.ops and (self.when is None or self.when(op, args))
            self.calls.append((op, args))
            trip = counted and self.fail_at is not None and (
                self.count >= self.fail_at if self.persistent else self.count == self.fail_at)
            if counted:
                self.count += 1
            if trip:
                self.tripped = True
        if trip:
            if self.crash:
                raise SimulatedCrash(f"simulated crash at call {self.fail_at}: {op}{args!r}")
            raise self.error
        return getattr(self.base, op)(*args)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return self._call("open", path, flags, mode)

    def write(self, fd: int, data: Buffer) -> int:
        return self._call("write", fd, data)

    def pwrite(self, fd: int, data: Buffer, offset: int) -> int:
        return self._call("pwrite", fd, data, offset)

    def writev(self, fd: int, buffers: Sequence[Buffer]) -> int:
        return self._call("writev", fd, buffers)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return self._call("preadv", fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        return self._call("fsync", fd)

    def close(self, fd: int) -> None:
        return self._call("close", fd)

    def ftruncate(self, fd: int, length: int) -> None:
        return self._call("ftruncate", fd, length)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        return self._call("start_writeback", fd, offset, nbytes)

    def allocate(self, fd: int, length: int) -> bool:
        return self._call("allocate", fd, length)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        return self._call("mkdir", path, mode)

    def rename(self, src: str, dst: str) -> None:
        return self._call("rename", src, dst)

    def unlink(self, path: str) -> None:
        return self._call("unlink", path)

    def rmdir(self, path: str) -> None:
        return self._call("rmdir", path)

    def listdir(self, path: str) -> list[str]:
        return self._call("listdir", path)

    def lstat(self, path: str) -> os.stat_result:
        return self._call("lstat", path)

    def fstat(self, fd: int) -> os.stat_result:
        return self._call("fstat", fd)

    def flock(self, fd: int, exclusive: bool = True, blocking: bool = False) -> None:
        return self._call("flock", fd, exclusive, blocking)


class SimulatedCrash(BaseException):
    """Raised by :class:`FaultyFileSystem` to stop a save dead, like a power cut.

    It derives from BaseException so that no ``except Exception`` cleanup in the library
    runs after it — exactly what happens when a process is killed.
    """


