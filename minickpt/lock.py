"""The directory lock: one writing CheckpointManager per run directory.

Two writers on one directory would interleave their checkpoints and delete each other's. The
primary's manager takes an exclusive ``flock`` on ``.minickpt.lock`` (a note inside says who holds
it) and keeps it until ``close()``; a second writer gets an error naming the holder."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import warnings
import weakref
from typing import Any

from .errors import MiniCkptError

LOCK_FILE = ".minickpt.lock"

# The directories this process's managers hold the lock of: real path -> (pid, manager); the
# pid, because a forked child inherits the dict but not the managers' standing.
_HELD: dict[str, tuple[int, weakref.ref[Any]]] = {}
_HELD_LOCK = threading.Lock()


def _holder_note() -> str:
    return f"pid {os.getpid()} on {os.uname().nodename}\n"


def _held_here(key: str, lock_path: str) -> bool:
    """Whether the lock on a directory is held by this process (one of its managers)."""
    with _HELD_LOCK:
        pid, ref = _HELD.get(key, (0, None))
    return (pid == os.getpid() and ref is not None and ref() is not None) \
        or _read_small(lock_path) == _holder_note().strip()


def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(200).strip() or "holder unknown"
    except OSError:
        return "holder unknown"


class DirectoryLock:
    """The lock part of :class:`~minickpt.manager.CheckpointManager`."""

    def _acquire_lock(self) -> None:
        path = os.path.join(self.directory, LOCK_FILE)
        key = os.path.realpath(self.directory)
        try:
            fd = self.fs.open(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise OSError(e.errno, f"{e.strerror}: a writable CheckpointManager locks "
                          f"{self.directory} through {LOCK_FILE} and cannot create it; to read "
                          "checkpoints on a read-only file system, open it with "
                          "CheckpointManagerOptions(read_only=True)", path) from e
        try:
            try:
                self.fs.flock(fd, exclusive=True, blocking=False)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) \
                        or not _held_here(key, path):
                    raise
                # A manager of this very process holds it. If nothing refers to that one
                # any more (a cycle the collector has not reached yet), collecting it
                # releases the lock, as Orbax lets a new manager replace a dropped one.
                gc.collect()
                self.fs.flock(fd, exclusive=True, blocking=False)
        except OSError as e:
            self.fs.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_small(path)
                for _ in range(20):  # the holder takes the lock, then writes who it is
                    if holder != "holder unknown":
                        break
                    time.sleep(0.05)
                    holder = _read_small(path)
                if _held_here(key, path):
                    raise MiniCkptError(
                        f"this process already holds {self.directory}: a CheckpointManager "
                        "opened on it here earlier is still open (running a notebook cell "
                        "twice keeps the first one alive). Close that one first "
                        "(mngr.close(), or open it as `with CheckpointManager(...) as mngr:`), "
                        "or open this one with read_only=True to read.") from e
                raise MiniCkptError(
                    f"another CheckpointManager is writing to {self.directory} ({holder}). Two "
                    "writers on one directory would interleave checkpoints; open this one with "
                    "read_only=True to read, or use another directory.") from e
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                warnings.warn(f"file locking is not supported on {self.directory}; minickpt "
                              "cannot stop two writers from sharing it", stacklevel=3)
                return
            raise
        self.fs.ftruncate(fd, 0)  # the lock file is a note for people, not checkpoint data
        self.fs.write(fd, _holder_note().encode())
        self._lock_fd = fd
        self._lock_key = key
        with _HELD_LOCK:
            _HELD[key] = (os.getpid(), weakref.ref(self))

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                self.fs.close(self._lock_fd)
            finally:
                self._lock_fd = None
                with _HELD_LOCK:
                    _pid, ref = _HELD.get(self._lock_key, (0, None))
                    if ref is not None and ref() in (self, None):
                        del _HELD[self._lock_key]
