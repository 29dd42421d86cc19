"""The one layer through which minickpt touches the file system.

Every file-system call the library makes goes through a :class:`FileSystem` object. The
primitives (``open``, ``write``, ``fsync``, ``rename`` ...) are the only methods that call the
operating system; the helpers (``write_file``, ``fsync_dir``, ``rmtree`` ...) are built from
them. A test can therefore stop a save at *any* single call — see :class:`minickpt.faults.FaultyFileSystem` —
and check that what is left on disk is still safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from . import dirfds
from .aio import _AIO_RINGS, _AIO_SYSCALL, _LIBC, _run_together
from .errors import CheckpointCorruptedError, UnsafeCheckpointError

Buffer = bytes | bytearray | memoryview

# Linux caps a single write at 0x7ffff000 bytes; stay well below it.
_MAX_IO = 1 << 30
_IOV_MAX = 1024  # the limit on Linux and macOS



def _linux_libc(name: str, argtypes: list[Any]) -> Any:
    """A C library function that only Linux has, typed, or None where it is missing."""
    if not sys.platform.startswith("linux") or _LIBC is None:
        return None
    fn = getattr(_LIBC, name, None)
    if fn is None:  # pragma: no cover - very old C libraries
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _linux_libc("sync_file_range",
                               [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
# not posix_fallocate: that one writes zeros
_FALLOCATE = _linux_libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_SYNC_FILE_RANGE_WRITE = 2

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux and the BSDs; macOS and Windows have none
# what a platform or file system answers when it cannot bypass the page cache (at the open,
# or — some file systems — at the first write)
_DIRECT_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write (measured: 4-16 MiB alike, 64 MiB worse)
_DIO_PAGE = 4096  # a source this aligned (in memory as in the file) needs no bounce copy
DIRECT_IN_FLIGHT = 4  # O_DIRECT writes queued at once per file (fio's best case: 4 deep)


class DirectIORefused(Exception):
    """O_DIRECT was refused (``errno`` says how) before any byte was written."""

    def __init__(self, err: int, where: str):
        super().__init__(f"O_DIRECT refused at {where}: {os.strerror(err)}")
        self.errno = err


def _rename_noreplace(src: str, dst: str) -> None:
    """Rename that fails with EEXIST instead of replacing ``dst`` (POSIX rename replaces empty dirs)."""
    if sys.platform.startswith("linux") and _LIBC is not None and hasattr(_LIBC, "renameat2"):
        at_fdcwd, rename_noreplace = -100, 1
        rc = _LIBC.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst),
                             rename_noreplace)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: this file system lacks the flag
            raise OSError(err, os.strerror(err), src, None, dst)
    elif sys.platform == "darwin" and _LIBC is not None and hasattr(_LIBC, "renamex_np"):
        rename_excl = 0x4
        if _LIBC.renamex_np(os.fsencode(src), os.fsencode(dst), rename_excl) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
            raise OSError(err, os.strerror(err), src, None, dst)
    # Fallback: check, then rename. Racy only against a concurrent writer of the same step,
    # which the manager's lock already excludes.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


class FileSystem:
    """The real file system. Subclass it (or wrap it) to observe or fault calls."""

    # ---- primitives: the only methods that reach the operating system -----------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if (table := self.__dict__.get("_anchors")) is not None:  # inside anchored()
            fd = table.open(path, flags, mode)
            if fd is not None:
                return fd
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)

    def write(self, fd: int, data: Buffer) -> int:
        return os.write(fd, data)

    def writev(self, fd: int, buffers: Sequence[Buffer]) -> int:
        return os.writev(fd, buffers)

    def pwrite(self, fd: int, data: Buffer, offset: int) -> int:
        """Write at ``offset`` without moving the file position: several threads can then
        write one file at once (the O_DIRECT writes in flight of a large file)."""
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        if sys.platform == "darwin":  # plain fsync on macOS does not reach the platter
            import fcntl

            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:
                pass
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """Ask the kernel to start writing these bytes to the disk now, without waiting.

        Only a hint: nothing is durable until ``fsync`` says so, and errors are left for
        ``fsync`` to report. It lets the disk work on the start of a large file while the
        rest is still being copied into the page cache (Linux ``sync_file_range``; a no-op
        elsewhere).
        """
        if _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)

    def allocate(self, fd: int, length: int) -> bool:
        """Reserve the blocks of the first ``length`` bytes of the empty file ``fd`` (its size
        becomes ``length``, reading as zeros); False, with nothing changed, where the platform
        or the file system cannot (Linux ``fallocate``; never the emulation that writes zeros).

        Several O_DIRECT writes of one file then proceed together: writes that extend a file
        are serialised by ext4 (and others) on the file's lock. A full disk fails here, before
        any byte is written. Durability is unchanged: until ``fsync`` the file may come back
        empty or zero-filled, like any un-synced file.
        """
        if _FALLOCATE is None or length <= 0:
            return False
        if _FALLOCATE(fd, 0, 0, length) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
            return False
        raise OSError(err, f"fallocate: {os.strerror(err)}")

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        os.mkdir(path, mode)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename that never replaces an existing ``dst``."""
        _rename_noreplace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def lstat(self, path: str) -> os.stat_result:
        if (table := self.__dict__.get("_anchors")) is not None:
            st = table.lstat(path)
            if st is not None:
                return st
        return os.lstat(path)

    def anchored(self, path: str) -> AbstractContextManager[None]:
        """Reads and ``lstat``s under ``path`` resolve from directory descriptors within this
        block (:mod:`minickpt.dirfds`): the same results, fewer lookups. Only the plain local
        file system anchors; a subclass sees its path calls unchanged."""
        if type(self) is not FileSystem or not dirfds.USABLE:
            return nullcontext()
        return dirfds.Anchored(dirfds.anchors_of(self), path)

    def _known_dir(self, path: str) -> bool:
        """True when an ``anchored`` block knows ``path`` for a real directory (not a
        symbolic link) without an ``lstat``: :meth:`minickpt.dirfds.Anchors.is_dir`. False
        outside such a block, for a subclass, and whenever it is not known: ask ``lstat``."""
        table = self.__dict__.get("_anchors")
        return table is not None and table.is_dir(path)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def flock(self, fd: int, exclusive: bool = True, blocking: bool = False) -> None:
        import fcntl

        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        fcntl.flock(fd, op | (0 if blocking else fcntl.LOCK_NB))

    # ---- helpers, built only from the primitives above ---------------------------------
    def exists(self, path: str) -> bool:
        try:
            self.lstat(path)
            return True
        except FileNotFoundError:
            return False

    def is_dir(self, path: str) -> bool:
        """True for a real directory; a symlink to one is *not* a directory here."""
        try:
            return stat.S_ISDIR(self.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    def write_all(self, fd: int, buffers: Iterable[Buffer], *, writeback_every: int = 0) -> int:
        """Write every buffer in order, batching small ones into one writev call.

        With ``writeback_every`` (bytes), writeback of what was written is started each time
        that much more has been written (see :meth:`start_writeback`), and large buffers are
        written in pieces of that size, so the disk is busy while the copying goes on.
        """
        total = 0
        batch: list[memoryview] = []
        batch_bytes = 0
        piece = min(writeback_every, _MAX_IO) if writeback_every > 0 else _MAX_IO
        started = 0  # bytes whose writeback has been started

        def flush() -> None:
            nonlocal batch, batch_bytes
            i = 0
            while i < len(batch):
                todo = batch[i:i + _IOV_MAX]
                n = self.writev(fd, todo) if len(todo) > 1 else self.write(fd, todo[0])
                if n <= 0:
                    raise OSError(errno.EIO, "write returned no progress")
                # drop what was written, keep the rest
                while i < len(batch) and n >= len(batch[i]):
                    n -= len(batch[i])
                    i += 1
                if n:
                    batch[i] = batch[i][n:]
            batch, batch_bytes = [], 0

        def hint() -> None:
            nonlocal started
            if writeback_every > 0 and total - started >= writeback_every:
                self.start_writeback(fd, started, total - started)
                started = total

        for buf in buffers:
            mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            if len(mv) == 0:
                continue
            if len(mv) >= min(_MAX_IO // 4, piece):  # large: on its own, in pieces
                flush()
                off = 0
                while off < len(mv):
                    n = self.write(fd, mv[off : off + piece])
                    if n <= 0:
                        raise OSError(errno.EIO, "write returned no progress")
                    off += n
                    total += n
                    hint()
                continue
            batch.append(mv)
            batch_bytes += len(mv)
            total += len(mv)
            if len(batch) >= min(_IOV_MAX, 512) or batch_bytes >= min(64 << 20, piece):
                flush()
                hint()
        flush()
        return total

    def write_file(self, path: str, buffers: Iterable[Buffer], *, fsync: bool = True,
                   exclusive: bool = True, batch: SyncBatch | None = None) -> int:
        """Create ``path`` with the given contents; fsync before closing when asked.

        With ``batch`` the file is neither fsynced nor closed here: the batch owns it from
        then on and fsyncs it together with the rest of the save (see :class:`SyncBatch`).
        """
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = self.open(path, flags)
        try:
            n = self.write_all(fd, buffers)
            if batch is not None:
                owned, fd = fd, -1  # the batch closes it from here on, even if add_file fails
                batch.add_file(owned)
            elif fsync:
                self.fsync(fd)
        finally:
            if fd >= 0:
                self.close(fd)
        return n

    # ---- writes that bypass the page cache (O_DIRECT), for large files ----------------
    def open_direct(self, path: str) -> int:
        """Open the existing file ``path`` a second time, for writing with O_DIRECT.

        The data then goes from a bounce buffer straight to the disk: no copy into the page
        cache, no writeback of it later — for a large file, a fraction of the CPU time of a
        buffered write (see :meth:`write_all_direct`). Raises :class:`DirectIORefused` where
        the platform or the file system does not do O_DIRECT (nothing was changed then).
        The file is created by an ordinary ``open(O_CREAT | O_EXCL)`` first because a file
        system may refuse O_DIRECT only *after* creating the file.
        """
        if not O_DIRECT:
            raise DirectIORefused(errno.EOPNOTSUPP, "open (no O_DIRECT on this platform)")
        try:
            return self.open(path, os.O_WRONLY | O_DIRECT)
        except OSError as e:
            if e.errno in _DIRECT_REFUSED:
                raise DirectIORefused(e.errno, "open") from e
            raise

    def write_all_direct(self, fd: int, buffers: Iterable[Buffer], *,
                         chunk: int | None = None, depth: int | None = None,
                         in_flight: int | None = None, size: int | None = None) -> int:
        """Write every buffer in order, from offset 0 of the empty file ``fd`` (opened by
        :meth:`open_direct`); return the bytes written.

        O_DIRECT needs the memory address, the file offset and the length of every write
        aligned to the file system's block size, which host arrays are not: their bytes are
        copied into page-aligned bounce buffers (:func:`minickpt.format.buffers.take_bounce`)
        and written ``chunk`` bytes at a time, each at its own offset (:meth:`pwrite`), by
        ``in_flight`` threads of this call's own that each copy a chunk and write it — so the
        device always has several writes queued (one synchronous stream leaves it idle
        between two writes) and the copying is spread over the cores. ``depth`` bounce
        buffers in all (one per write in flight; ``depth=1``: no thread, every chunk copied and
        written here). The defaults are :data:`DIRECT_CHUNK` and :data:`DIRECT_IN_FLIGHT`.
        The last, partial block is written padded with zeros, after every other write has
        finished, and the file then cut to its exact length (``ftruncate``), so the bytes on
        disk are exactly the buffers' bytes. Given the ``size`` the buffers add up to, the
        file's blocks are reserved first (:meth:`allocate`), so that the writes in flight do
        not wait for each other on the file's lock. Raises :class:`DirectIORefused` if the
        very first write is refused (it runs alone, here: nothing was written and the file is
        left empty, so the caller writes it buffered instead). After a failed write no further
        write is started, every started one is waited for, and the first error is raised.

        Durability is unchanged: writes in flight finish in any order, and none of them is
        durable before the file's ``fsync`` (its size and block map, and the device's
        volatile cache, need it) — the caller fsyncs as for any other file, after this
        returned, that is after every write finished.
        """
        from .format.buffers import give_bounce, take_bounce

        block = _direct_block(self.fstat(fd).st_blksize)
        chunk = DIRECT_CHUNK if chunk is None else chunk
        chunk = max(block, chunk // block * block)
        in_flight = max(1, DIRECT_IN_FLIGHT if in_flight is None else in_flight)
        depth = max(1, in_flight if depth is None else depth)
        in_flight = min(in_flight, depth) if depth > 1 else 0  # 0: everything written here
        bounce = [take_bounce(chunk) for _ in range(depth)]
        views = [np.frombuffer(b, np.uint8) for b in bounce]
        pending: list[Future[None] | None] = [None] * depth
        failed: list[BaseException] = []
        pool: ThreadPoolExecutor | None = None
        first = True  # the first write runs here, so that a refusal can still fall back
        allocated = 0

        def copy_and_write(i: int, pieces: list[np.ndarray] | memoryview, padded: int,
                           at: int) -> None:
            if failed:  # a write before this one failed: write nothing more
                return
            try:
                if isinstance(pieces, memoryview):  # page-aligned source: written as it is
                    mv = pieces
                else:
                    view, fill = views[i], 0
                    for p in pieces:
                        view[fill:fill + len(p)] = p
                        fill += len(p)
                    view[fill:padded] = 0
                    mv = memoryview(bounce[i])[:padded]
                off = 0
                while off < padded:
                    w = self.pwrite(fd, mv[off:], at + off)
                    if w <= 0:
                        raise OSError(errno.EIO, "write returned no progress")
                    off += w
            except BaseException as e:
                failed.append(e)
                raise

        def hand_over(i: int, pieces: list[np.ndarray] | memoryview, padded: int,
                      at: int) -> None:
            nonlocal first, pool
            if first:
                first = False
                try:
                    copy_and_write(i, pieces, padded, at)
                except OSError as e:
                    if e.errno in _DIRECT_REFUSED:
                        if allocated:  # leave the file as it came: empty
                            self.ftruncate(fd, 0)
                        raise DirectIORefused(e.errno, "the first write") from e
                    raise
                return
            if in_flight and not failed:
                try:
                    pool = pool or ThreadPoolExecutor(in_flight,
                                                      thread_name_prefix="minickpt-dio")
                    pending[i] = pool.submit(copy_and_write, i, pieces, padded, at)
                    return
                except RuntimeError:  # interpreter exit: no new threads, write it here
                    pass
            copy_and_write(i, pieces, padded, at)

        def wait(i: int) -> None:
            fut, pending[i] = pending[i], None
            if fut is not None:
                fut.result()

        def wait_all() -> None:
            err: BaseException | None = None
            for i in range(depth):
                try:
                    wait(i)
                except BaseException as e:
                    err = err or e
            if err is not None:
                raise failed[0] if failed else err

        total = fill = k = start = 0
        pieces: list[np.ndarray] = []
        try:
            if size and in_flight > 1:
                padded = -(-size // block) * block
                allocated = padded if self.allocate(fd, padded) else 0
            for buf in buffers:
                mv = memoryview(buf)
                if mv.nbytes == 0:
                    continue
                src = np.frombuffer(mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B"),
                                    np.uint8)
                o = 0
                # the part of a large buffer whose memory lies at the same place within a
                # page as its bytes in the file is written from where it is, not copied
                head = -total % _DIO_PAGE
                direct_from = direct_to = len(src)
                if len(src) - head >= chunk and block <= _DIO_PAGE and \
                        (src.ctypes.data - total) % _DIO_PAGE == 0:
                    direct_from = head
                    direct_to = head + (len(src) - head) // _DIO_PAGE * _DIO_PAGE
                while o < len(src):
                    if o == direct_from:
                        if fill:  # the bytes before, up to this page boundary: written
                            wait(k)
                            hand_over(k, pieces, fill, start)
                            k, start, fill, pieces = (k + 1) % depth, start + fill, 0, []
                        while o < direct_to:
                            m = min(chunk, direct_to - o)
                            if failed:
                                wait_all()
                            wait(k)
                            hand_over(k, memoryview(src[o:o + m]), m, start)
                            k, start, o, total = (k + 1) % depth, start + m, o + m, total + m
                        continue
                    m = min(chunk - fill, len(src) - o, max(0, direct_from - o) or len(src))
                    pieces.append(src[o:o + m])
                    fill, o, total = fill + m, o + m, total + m
                    if fill == chunk:
                        if failed:
                            wait_all()
                        wait(k)  # buffer k is free once its previous write is done
                        hand_over(k, pieces, chunk, start)
                        k, fill, start, pieces = (k + 1) % depth, 0, start + chunk, []
            wait_all()
            if fill:
                padded = -(-fill // block) * block
                hand_over(k, pieces, padded, start)
                wait_all()
                start += padded
            if start != total or (allocated and allocated != total):
                self.ftruncate(fd, total)  # a padded tail, or fewer bytes than ``size`` said
            return total
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # no write may still use a buffer given back below
            views.clear()  # numpy views export the buffers: an mmap with exports cannot close
            for b in bounce:
                give_bounce(b)

    def open_read(self, path: str) -> int:
        """Open a regular file for reading, refusing a symlink (a checkpoint never contains
        one) and anything that is not a regular file: opening a FIFO would block forever
        (``O_NONBLOCK`` lets the open return so that ``fstat`` can refuse it)."""
        return self._open_read(path)[0]

    def _open_read(self, path: str) -> tuple[int, os.stat_result]:
        """:meth:`open_read`, also returning the ``fstat`` it checked (whose size
        :meth:`read_file` needs: one fstat per file, not two)."""
        try:
            fd = self.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                           | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeCheckpointError(path, "is a symbolic link; refusing to follow it") from e
            raise
        try:
            st = self.fstat(fd)
        except BaseException:
            self.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            self.close(fd)
            raise CheckpointCorruptedError(path, "is not a regular file")
        return fd, st

    def read_into(self, fd: int, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``; a short file is an error, not a silent zero fill."""
        self.read_into_many(fd, [buf], offset)

    def read_into_many(self, fd: int, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill consecutive buffers from ``offset`` with as few preadv calls as possible."""
        if len(buffers) == 1:  # a small file, a leaf: the same, without two list builds
            b = buffers[0]
            b = b if b.format == "B" and b.ndim == 1 else b.cast("B")
            bufs = [b] if len(b) else []
        else:
            bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
            bufs = [b for b in bufs if len(b)]
        while bufs:
            head = bufs[:_IOV_MAX]
            if len(head[0]) > _MAX_IO:
                head = [head[0][:_MAX_IO]]
            n = self.preadv(fd, head, offset)
            if n <= 0:
                raise EOFError(f"file ended {sum(len(b) for b in bufs)} bytes early, "
                               f"at offset {offset}")
            offset += n
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if n:
                bufs[0] = bufs[0][n:]

    def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """Read a whole (small) file, refusing files larger than ``max_bytes``."""
        fd, st = self._open_read(path)
        try:
            size = st.st_size
            if size > max_bytes:
                raise ValueError(f"{path} is {size} bytes, more than the {max_bytes} allowed")
            buf = bytearray(size)
            if size:
                self.read_into(fd, memoryview(buf), 0)
            return bytes(buf)
        finally:
            self.close(fd)

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries (creations, renames) durable."""
        if os.name == "nt":  # Windows cannot open a directory; NTFS journals renames itself
            return
        fd = self.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            self.fsync(fd)
        finally:
            self.close(fd)

    def fsync_all(self, fds: Sequence[int] = (), dirs: Sequence[str] = ()) -> None:
        """fsync every file descriptor and directory given, concurrently — a group commit.

        The fsyncs are independent of each other: issued one after another, each waits for a
        journal commit of its own; issued together, the file system gathers them into one or
        two. Returns only when *every* one has finished; if any failed, the first error is
        raised (after all of them finished, so nothing is left running).
        """
        jobs: list[tuple[Callable[..., None], Any]] = [(self.fsync, fd) for fd in fds]
        jobs += [(self.fsync_dir, d) for d in dirs]
        if len(jobs) <= 1:
            for fn, arg in jobs:
                fn(arg)
            return
        if _aio_fsync_usable(self) and self._fsync_all_aio(fds, dirs):
            return
        _run_together(jobs)

    def _fsync_all_aio(self, fds: Sequence[int], dirs: Sequence[str]) -> bool:
        """:meth:`fsync_all` through Linux's kernel AIO: every fsync submitted in one
        ``io_submit`` and run by the kernel's workers, none waiting for a Python thread to be
        started and scheduled (on a loaded machine that costs milliseconds, more than the
        fsyncs themselves). Each is the kernel's own ``vfs_fsync`` — the same durability as
        ``os.fsync``. False (nothing done) where the kernel refuses AIO: threads then."""
        ring = _AIO_RINGS.get()
        if ring is None:
            return False
        dir_fds: list[int] = []
        clean = False
        try:
            for d in dirs:
                dir_fds.append(self.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
            all_fds = list(fds) + dir_fds
            errors = ring.fsync(all_fds)
            clean = True
            if errors is None:  # the kernel refused the opcode: the threads do it all
                return False
            for i, fd in enumerate(all_fds):
                if errors[i] == "unsubmitted":  # io_submit refused this one (a bad fd):
                    try:  # the plain call gives its error, exactly
                        self.fsync(fd)
                        errors[i] = None
                    except OSError as e:
                        errors[i] = e
            first = next((e for e in errors if isinstance(e, BaseException)), None)
            if first is not None:
                raise first
            return True
        finally:
            if clean:
                _AIO_RINGS.put(ring)
            # else interrupted with fsyncs in flight: the ring is dropped, never reused
            for fd in dir_fds:
                self.close(fd)

    def rmtree(self, path: str) -> None:
        """Delete a tree without following symlinks (they are unlinked, never entered)."""
        st = self.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            self.unlink(path)
            return
        for name in self.listdir(path):
            child = os.path.join(path, name)
            if stat.S_ISDIR(self.lstat(child).st_mode):
                self.rmtree(child)
            else:
                self.unlink(child)
        self.rmdir(path)

    def dir_size(self, path: str) -> int:
        """Bytes used by the regular files under ``path`` (symlinks not followed)."""
        total = 0
        try:
            names = self.listdir(path)
        except FileNotFoundError:
            return 0
        for name in names:
            child = os.path.join(path, name)
            try:
                st = self.lstat(child)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                total += self.dir_size(child)
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total


def _direct_block(st_blksize: int) -> int:
    """The alignment for O_DIRECT: the file system's block size where it is a sane power of
    two (a multiple of the device's logical block size), else 4096."""
    b = int(st_blksize or 0)
    return b if 512 <= b <= 1 << 20 and b & (b - 1) == 0 else 4096


def _aio_fsync_usable(fs: FileSystem) -> bool:
    """Only for the real primitives: a subclass that observes or faults ``fsync`` (tests,
    the crash harness) must see every fsync as a call of its own method."""
    return (_AIO_SYSCALL is not None and type(fs).fsync is FileSystem.fsync
            and type(fs).fsync_dir is FileSystem.fsync_dir and type(fs).open is FileSystem.open)


class SyncBatch:
    """Files and directories a save has written, to be made durable together.

    A save registers each file it wrote (the open descriptor, which the batch then owns) and
    each directory it created, *without* fsyncing them one by one; :meth:`flush` fsyncs them
    all at once with :meth:`FileSystem.fsync_all` and closes the files. When the batch is
    flushed, relative to anything else a save does, is its caller's to decide: the batch only
    lets the waits be shared. :meth:`close` (also on ``with`` exit) closes what was not flushed.
    """

    MAX_OPEN = 256  # flush early rather than hold more descriptors than this

    def __init__(self, fs: FileSystem):
        self.fs = fs
        self.fds: list[int] = []
        self.dirs: list[str] = []
        self.flush_s = 0.0

    def add_file(self, fd: int) -> None:
        """Take ``fd`` (it is closed by :meth:`flush` or :meth:`close`, never by the caller)."""
        self.fds.append(fd)
        if len(self.fds) >= self.MAX_OPEN:
            self.flush()

    def add_dir(self, path: str) -> None:
        self.dirs.append(path)

    def flush(self) -> None:
        t = time.perf_counter()
        fds, dirs = self.fds, self.dirs
        self.fds, self.dirs = [], []
        try:
            self.fs.fsync_all(fds, dirs)
        except BaseException:
            try:
                self._close(fds)
            except OSError:
                pass  # the fsync's error is the one that matters
            raise
        finally:
            self.flush_s += time.perf_counter() - t
        self._close(fds)

    def close(self) -> None:
        fds, self.fds, self.dirs = self.fds, [], []
        self._close(fds)

    def _close(self, fds: list[int]) -> None:
        err: BaseException | None = None
        for fd in fds:
            try:
                self.fs.close(fd)
            except OSError as e:
                err = err or e
        if err is not None:
            raise err

    def __enter__(self) -> SyncBatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except OSError:
            if exc[0] is None:
                raise


DEFAULT_FS = FileSystem()
