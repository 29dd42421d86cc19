"""Directory descriptors for the reads of one restore (issue 51).

A restore opens a checkpoint's metadata, each item's manifest and data file, and checks that
the checkpoint's and items' directories are real directories. Made by whole paths, each of
these calls resolves every component from the root; on a 9p file system under gVisor (a TPU
VM's disk) that is a round trip per component, and it was the largest part of what a tiny
restore cost above its floor. Within :meth:`minickpt.fs.FileSystem.anchored`, the same calls
resolve from a descriptor of their directory instead (``openat``): the same results and the
same errors, one lookup each.

Only lookups are changed, never what they find: a directory is anchored only when
``O_DIRECTORY | O_NOFOLLOW`` opens it (a symbolic link or a missing directory is left to the
path calls, which report it as before), only read-only opens and ``lstat`` use an anchor, and
any error from a relative call is reproduced by the path call, so that its message and
``filename`` are the ones a caller has always seen.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
_WRITES = (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
           | getattr(os, "O_TMPFILE", 0))
USABLE = (os.name == "posix" and hasattr(os, "O_DIRECTORY") and hasattr(os, "O_NOFOLLOW")
          and os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd)


class Anchors:
    """The directories anchored by the open ``anchored`` blocks of one file system.

    Descriptors are closed when the last block ends and no call is using one, so that a
    reader thread never resolves a name from a descriptor that was closed (or reused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._scopes = 0
        self._uses = 0

    def enter(self, path: str) -> None:
        key = os.path.normpath(path)
        with self._lock:
            self._scopes += 1
            if key in self._fds:
                return
        try:
            fd = os.open(key, _DIR_FLAGS)
        except OSError:
            return  # missing, a symlink, not a directory: the path calls say which
        with self._lock:
            if key in self._fds:
                os.close(fd)
            else:
                self._fds[key] = fd

    def exit(self) -> None:
        with self._lock:
            self._scopes -= 1
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._scopes == 0 and self._uses == 0 and self._fds:
            fds, self._fds = list(self._fds.values()), {}
            for fd in fds:
                os.close(fd)

    def _take(self, path: str) -> tuple[int, str, str] | None:
        """(descriptor of ``path``'s directory, ``path``'s name, the key), marked in use."""
        if not self._fds:  # the common case, no block open: no lock, no normpath
            return None
        parent, name = os.path.split(os.path.normpath(path))
        with self._lock:
            fd = self._fds.get(parent)
            if fd is None:
                return None
            self._uses += 1
            return fd, name, parent

    def _release(self) -> None:
        with self._lock:
            self._uses -= 1
            self._close_if_idle()

    def open(self, path: str, flags: int, mode: int) -> int | None:
        """A read-only open of ``path`` from its directory's descriptor; None: use the path."""
        if flags & _WRITES:
            return None
        got = self._take(path)
        if got is None:
            return None
        fd, name, _ = got
        try:
            return os.open(name, flags | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=fd)
        except OSError:
            return None  # the path call raises the error, with the path in it
        finally:
            self._release()

    def lstat(self, path: str) -> os.stat_result | None:
        """``lstat(path)`` for an anchored directory or an entry of one; a subdirectory
        found this way is anchored too, for the files under it. None: use the path."""
        if not self._fds:
            return None
        key = os.path.normpath(path)
        with self._lock:
            own = self._fds.get(key)
            if own is not None:
                self._uses += 1
        if own is not None:
            try:
                return os.fstat(own)  # opened with O_NOFOLLOW: what lstat would say
            except OSError:
                return None
            finally:
                self._release()
        got = self._take(path)
        if got is None:
            return None
        fd, name, _ = got
        try:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # not a directory (or no such entry): a plain relative lstat
                try:
                    return os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    return None
            st = os.fstat(sub)
            self._keep(key, sub)
            return st
        finally:
            self._release()

    def is_dir(self, path: str) -> bool:
        """True when ``path``, an entry of an anchored directory, is a real directory: one
        that ``O_DIRECTORY | O_NOFOLLOW`` opens, which is exactly what an ``lstat`` would
        call a directory and not a symbolic link, without that ``lstat`` (or an ``fstat``).
        It is anchored then, for the files under it. False: not known here (ask ``lstat``)."""
        if not self._fds:
            return False
        key = os.path.normpath(path)
        if key in self._fds:
            return True
        got = self._take(path)
        if got is None:
            return False
        fd, name, _ = got
        try:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # missing, not a directory, a symbolic link: lstat says which
                return False
            self._keep(key, sub)
            return True
        finally:
            self._release()

    def _keep(self, key: str, fd: int) -> None:
        """Anchor ``key`` at ``fd`` (closed if another thread anchored it meanwhile)."""
        with self._lock:
            if key in self._fds:
                os.close(fd)
            else:
                self._fds[key] = fd


class Anchored:
    """One ``anchored`` block: ``path`` anchored on entry, let go of on exit (a class, not a
    generator: it is entered once per restore)."""

    __slots__ = ("_path", "_table")

    def __init__(self, table: Anchors, path: str) -> None:
        self._table, self._path = table, path

    def __enter__(self) -> None:
        self._table.enter(self._path)

    def __exit__(self, *exc: object) -> None:
        self._table.exit()


def anchors_of(fs: Any) -> Anchors:
    """The file system's table (made on first use: subclasses need not call a constructor)."""
    table = fs.__dict__.get("_anchors")
    if table is None:
        table = fs.__dict__.setdefault("_anchors", Anchors())
    return table
