"""The floor of a small save: the very system calls one minickpt save makes, issued bare.

A tiny save costs its durable system calls (two mkdirs, the files created and written, the
group fsync, the rename, the parent's fsync) plus minickpt's Python between them. The floor
is the first part alone, measured on this machine in the row's own repetitions: one save of
the row's tree is recorded through a :class:`~minickpt.fs.FileSystem` that logs every
primitive call (and each group fsync as one group), and :class:`BareCalls` replays exactly
those calls from a short Python loop — ``os.mkdir``, ``os.open``, ``os.write``, the group
fsync as one ``io_submit`` of kernel AIO fsyncs where the library used that (else threads),
``os.rename`` … — on a fresh directory each time, with no tree walk, planning, JSON or checks.
What is left between minickpt's time and this is minickpt's (and JAX's) Python.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from minickpt.fs import FileSystem, _aio_fsync_usable

from .contenders import fresh, remove
from .core import Op


class _Recorder(FileSystem):
    """The real file system, logging each primitive call with copies of its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._in_group = False
        self._paused = False

    def _log(self, op: str, *args: Any) -> None:
        if not self._in_group and not self._paused:
            self.calls.append((op, args))

    def begin(self) -> None:
        """Forget what was logged so far: the save starts now."""
        self.calls.clear()

    def end(self) -> None:
        """Log nothing more (the manager's closing is not part of a save)."""
        self._paused = True

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self._log("open", path, flags, mode, fd)
        return fd

    def write(self, fd: int, data: Any) -> int:
        self._log("write", fd, bytes(memoryview(data).cast("B")))
        return super().write(fd, data)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._log("pwrite", fd, bytes(memoryview(data).cast("B")), offset)
        return super().pwrite(fd, data, offset)

    def writev(self, fd: int, buffers: Sequence[Any]) -> int:
        self._log("writev", fd, [bytes(memoryview(b).cast("B")) for b in buffers])
        return super().writev(fd, buffers)

    def fsync(self, fd: int) -> None:
        self._log("fsync", fd)
        super().fsync(fd)

    def close(self, fd: int) -> None:
        self._log("close", fd)
        super().close(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        self._log("ftruncate", fd, length)
        super().ftruncate(fd, length)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._log("mkdir", path, mode)
        super().mkdir(path, mode)

    def rename(self, src: str, dst: str) -> None:
        self._log("rename", src, dst)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._log("unlink", path)
        super().unlink(path)

    def rmdir(self, path: str) -> None:
        self._log("rmdir", path)
        super().rmdir(path)

    def listdir(self, path: str) -> list[str]:
        self._log("listdir", path)
        return super().listdir(path)

    def lstat(self, path: str) -> os.stat_result:
        self._log("lstat", path)
        return super().lstat(path)

    def fstat(self, fd: int) -> os.stat_result:
        self._log("fstat", fd)
        return super().fstat(fd)

    def fsync_all(self, fds: Sequence[int] = (), dirs: Sequence[str] = ()) -> None:
        self._log("fsync_all", list(fds), list(dirs))
        self._in_group = True
        try:
            super().fsync_all(fds, dirs)
        finally:
            self._in_group = False


def record(save: Callable[[FileSystem, str], None], root: str) -> list[tuple[str, tuple]]:
    """The primitive calls ``save(fs, root)`` makes (root exists and holds what it needs)."""
    rec = _Recorder()
    save(rec, root)
    return rec.calls


class BareCalls:
    """Replays recorded calls on a fresh copy of the directory they were recorded in."""

    def __init__(self, workdir: str, setup: Callable[[str], None],
                 save: Callable[[FileSystem, str], None]):
        self.workdir = workdir
        self.template = fresh(workdir, "bare-template")
        os.makedirs(self.template)
        setup(self.template)
        scratch = fresh(workdir, "bare-record")
        shutil.copytree(self.template, scratch, symlinks=True)
        try:
            self.calls = record(save, scratch)
        finally:
            remove(scratch)
        self.recorded_root = scratch
        self._root = ""

    def _path(self, p: str) -> str:
        return self._root + p[len(self.recorded_root):] if p.startswith(self.recorded_root) \
            else p

    def run(self) -> None:
        fds: dict[int, int] = {}
        path = self._path
        known = {a[3] for op, a in self.calls if op == "open"}
        aio = _aio_fsync_usable(FileSystem())
        for op, a in self.calls:
            if op not in ("open", "mkdir", "rename", "unlink", "rmdir", "listdir", "lstat",
                          "fsync_all") and a[0] not in known:
                continue  # a descriptor opened before the save (the manager's lock)
            if op == "open":
                fds[a[3]] = os.open(path(a[0]), a[1] | getattr(os, "O_CLOEXEC", 0), a[2])
            elif op == "write":
                os.write(fds[a[0]], a[1])
            elif op == "pwrite":
                os.pwrite(fds[a[0]], a[1], a[2])
            elif op == "writev":
                os.writev(fds[a[0]], a[1])
            elif op == "fsync":
                os.fsync(fds[a[0]])
            elif op == "close":
                os.close(fds.pop(a[0]))
            elif op == "ftruncate":
                os.ftruncate(fds[a[0]], a[1])
            elif op == "mkdir":
                os.mkdir(path(a[0]), a[1])
            elif op == "rename":
                os.rename(path(a[0]), path(a[1]))
            elif op == "unlink":
                os.unlink(path(a[0]))
            elif op == "rmdir":
                os.rmdir(path(a[0]))
            elif op == "listdir":
                os.listdir(path(a[0]))
            elif op == "lstat":  # may fail, as it did for the library: "is it there yet?"
                try:
                    os.lstat(path(a[0]))
                except FileNotFoundError:
                    pass
            elif op == "fstat":
                os.fstat(fds[a[0]])
            elif op == "fsync_all":
                _group_fsync([fds[f] for f in a[0]], [path(d) for d in a[1]], aio)

    def op(self, label: str = "limit") -> Op:
        def prepare() -> None:
            self._root = fresh(self.workdir, "bare-run")
            shutil.copytree(self.template, self._root, symlinks=True)

        return Op(label, self.run, prepare, lambda: remove(self._root))

    def close(self) -> None:
        remove(self.template)


def _group_fsync(fds: list[int], dirs: list[str], aio: bool) -> None:
    """The group fsync as the library issues it: one io_submit of AIO fsyncs (the same
    system calls; no Python of minickpt's around them), else one thread per fsync."""
    dir_fds = [os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) for d in dirs]
    try:
        all_fds = fds + dir_fds
        if aio and len(all_fds) > 1:
            from minickpt.aio import _AIO_RINGS

            ring = _AIO_RINGS.get()
            if ring is not None:
                try:
                    ring.fsync(all_fds)
                    return
                finally:
                    _AIO_RINGS.put(ring)
        from minickpt.aio import _run_together

        _run_together([(os.fsync, fd) for fd in all_fds])
    finally:
        for fd in dir_fds:
            os.close(fd)


class RestoreFloor:
    """The floor of a small restore: every file of the checkpoint read whole into memory
    (open, fstat, read, close), and the arrays the manifests list made from those bytes with
    numpy and put on the device with one ``jax.device_put`` — what any restore must do, with
    none of minickpt's parsing, checking or tree building."""

    def __init__(self, ckpt_dir: str):
        import json

        self.files: list[str] = []
        self.arrays: list[tuple[str, int, str, tuple[int, ...]]] = []  # file, off, dtype, shape
        for dirpath, _, names in sorted(os.walk(ckpt_dir)):
            for n in sorted(names):
                p = os.path.join(dirpath, n)
                self.files.append(p)
                if n == "manifest.json":
                    with open(p) as f:
                        doc = json.load(f)
                    data = os.path.join(dirpath, doc.get("data_file") or "data.bin")
                    for e in doc.get("leaves", []):
                        if e.get("kind") == "array" and "offset" in e:
                            self.arrays.append((data, e["offset"], e["dtype"],
                                                tuple(e["shape"])))

    def run(self) -> None:
        import jax
        import numpy as np

        raw: dict[str, bytes] = {}
        for p in self.files:
            fd = os.open(p, os.O_RDONLY)
            try:
                raw[p] = os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        from minickpt.format.spec import DTYPES

        host = [np.frombuffer(raw[f], DTYPES[dt], count=int(np.prod(shape)), offset=off)
                .reshape(shape) for f, off, dt, shape in self.arrays]
        jax.block_until_ready(jax.device_put(host))

    def op(self, label: str = "limit") -> Op:
        return Op(label, self.run)


class UnlinkCost:
    """The unlink of a file of the row's size written as minickpt writes it (``O_DIRECT``
    where the file system takes it, fsynced; written untimed before each repetition): what a
    large manager save's retention costs beyond the write, which no write limit includes."""

    def __init__(self, workdir: str, src: Any):
        self.workdir, self.src = workdir, src
        self._path = ""

    def prepare(self) -> None:
        from minickpt.fs import DirectIORefused

        fs = FileSystem()
        self._path = fresh(self.workdir, "unlink-cost")
        fd = fs.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                dfd = fs.open_direct(self._path)
                try:
                    fs.write_all_direct(dfd, [self.src], size=len(self.src))
                    fs.fsync(dfd)
                finally:
                    fs.close(dfd)
            except DirectIORefused:
                fs.write_all(fd, [self.src])
                fs.fsync(fd)
        finally:
            fs.close(fd)

    def op(self, label: str = "unlink") -> Op:
        return Op(label, lambda: os.unlink(self._path), self.prepare)


class FreshMemory:
    """The first touch of fresh memory the size of the state (one byte per 4 KiB page of a
    new numpy array): what a restore into new arrays pays on top of any read. On a VM whose
    balloon returns freed memory to the host, this moves from a fraction of a second to
    seconds per gigabyte, and no read limit includes it."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def run(self) -> None:
        import numpy as np

        a = np.empty(self.nbytes, np.uint8)
        a[::4096] = 1
        del a

    def op(self, label: str = "fresh memory") -> Op:
        return Op(label, self.run)
