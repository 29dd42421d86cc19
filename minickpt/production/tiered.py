"""Tiered storage: save fast to a local disk, mirror every checkpoint to a second store.

A local NVMe disk is fast but dies with its machine; a network file system or an object
store survives it but is slow. :class:`TieredCheckpointManager` saves to the local directory
(the training loop waits only for that) and copies each committed checkpoint in a background
thread to the mirror — another directory or an fsspec URL (``pip install minickpt[remote]``)
— with its own atomic commit there: every file is written under a temporary name, fsynced
where the store can, verified (every leaf's checksum, re-read from the mirror), then renamed
into place. (Object stores cannot rename a prefix atomically, and a listing shows an upload
half done; there every file is uploaded and verified, then a commit marker,
``commit_success.txt`` as Orbax names it, is written last, and a delete removes it first: a
step without it is never listed nor restored.) Retention applies to both tiers; on the local
one a checkpoint is deleted only once its copy is done, so the local disk holds more than
``max_to_keep`` while the mirror lags.
A copy that fails is reported to the manager's
listeners (so the monitor records it), logged, warned about, retried with a bounded
exponential backoff, and if it still fails, :meth:`wait_until_mirrored` raises: never silently
dropped. :meth:`restore` prefers the local copy and falls back to the mirror when the local
one is missing or damaged (checksums are verified), copying it back to the local disk first.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import io
import itertools
import logging
import os
import queue
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .. import policy
from ..checkpointer import Checkpointer, CheckpointMetadata
from ..commit import (
    DELETE_MARK,
    METADATA_FILE,
    TMP_MARK,
    abort,
    cleanup_temporaries,
    commit,
    delete_dir,
    is_temporary,
    make_temporary,
    makedirs,
    parse_step,
    step_dir_name,
)
from ..errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    FormatVersionError,
    MiniCkptError,
)
from ..fallback import Restored
from ..fs import DEFAULT_FS, FileSystem
from ..manager import CheckpointManager
from ..options import CheckpointManagerOptions

log = logging.getLogger("minickpt")
CHUNK = 8 << 20


# Orbax's name for the same object (orbax.checkpoint's CommitFileTemporaryPath, its default on
# gs://): written last into a checkpoint saved in place; a step directory without it is not
# finalized, never listed, and removed as a temporary.
COMMIT_SUCCESS_FILE = "commit_success.txt"


class MirrorError(MiniCkptError):
    """Checkpoints that could not be copied to the mirror, after every retry."""


# ---------------------------------------------------------------------------------------
# stores: where the mirror lives
# ---------------------------------------------------------------------------------------
class LocalStore:
    """A mirror in a directory (another disk, an NFS mount), through minickpt's FileSystem
    layer: fsync of every file and directory, rename that never replaces, as for saves."""

    atomic_rename = True

    def __init__(self, root: str | os.PathLike[str], fs: FileSystem | None = None):
        self.fs = fs or DEFAULT_FS
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.makedirs("")

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return self.fs.listdir(self.path(rel))
        except FileNotFoundError:
            return []

    def is_dir(self, rel: str) -> bool:
        return self.fs.is_dir(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def committed(self, rel: str) -> bool:
        """A checkpoint under its final name: the rename that put it there was its commit."""
        return self.fs.is_dir(self.path(rel)) and self.exists(f"{rel}/{METADATA_FILE}")

    def makedirs(self, rel: str) -> None:
        makedirs(self.fs, self.path(rel))

    def write_file(self, rel: str, chunks: Iterator[bytes]) -> int:
        return self.fs.write_file(self.path(rel), chunks, fsync=True)

    def read_chunks(self, rel: str) -> Iterator[bytes]:
        return _read_chunks(self.fs, self.path(rel))

    def size(self, rel: str) -> int:
        return self.fs.lstat(self.path(rel)).st_size

    def metadata(self, rel: str, data: bytes | None = None) -> CheckpointMetadata:
        return Checkpointer(self.fs).metadata(self.path(rel))  # a local read is cheap

    def verify(self, rel: str) -> list[str]:
        rep = Checkpointer(self.fs).verify(self.path(rel), deep=True)
        return [] if rep.ok else rep.problems

    def commit(self, tmp: str, final: str, subdirs: list[str]) -> None:
        commit(self.fs, self.path(tmp), self.path(final), subdirs=subdirs)

    def delete(self, rel: str) -> None:
        delete_dir(self.fs, self.path(rel))

    def remove_temporary(self, rel: str) -> None:
        abort(self.fs, self.path(rel))

    def cleanup(self) -> list[str]:
        return cleanup_temporaries(self.fs, self.root)


class _FsspecReader(FileSystem):
    """minickpt's :class:`FileSystem`, read-only, over an fsspec file system: the library's own
    verification (metadata, manifests, every leaf's CRC) then runs on a mirror copy where it
    lies. ``overlay`` serves files not uploaded yet (the metadata, checked before it is
    published) from memory. One reader serves one check: what it learnt of a path (its
    size, its type) is kept, as each request to an object store is a round trip."""

    def __init__(self, fs: Any, overlay: Mapping[str, bytes] | None = None):
        self.fs = fs
        self.overlay = dict(overlay or {})
        self._files: dict[int, tuple[Any, int]] = {}
        self._fds = itertools.count(1 << 20)
        self._infos: dict[str, dict[str, Any]] = {}

    def _info(self, path: str) -> dict[str, Any]:
        if path not in self._infos:
            self._infos[path] = self.fs.info(path)  # FileNotFoundError as the OS raises it
        return self._infos[path]

    @staticmethod
    def _stat(mode: int, size: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, 0, 0, size, 0, 0, 0))

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            raise PermissionError(errno.EROFS, "the mirror is only read here", path)
        if path in self.overlay:
            f: Any = io.BytesIO(self.overlay[path])
            size = len(self.overlay[path])
        else:
            info = self._info(path)
            if info.get("type") != "file":
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            size = int(info.get("size") or 0)
            try:  # the size known: no second request for it
                f = self.fs.open(path, "rb", size=size)
            except TypeError:  # pragma: no cover - a file system without that argument
                f = self.fs.open(path, "rb")
        fd = next(self._fds)
        self._files[fd] = (f, size)
        return fd

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        f, _ = self._files[fd]
        f.seek(offset)
        n = 0
        for b in buffers:
            got = f.read(len(b))
            b[:len(got)] = got
            n += len(got)
            if len(got) < len(b):
                break
        return n

    def fstat(self, fd: int) -> os.stat_result:
        return self._stat(stat.S_IFREG | 0o444, self._files[fd][1])

    def close(self, fd: int) -> None:
        self._files.pop(fd)[0].close()

    def lstat(self, path: str) -> os.stat_result:
        if path in self.overlay:
            return self._stat(stat.S_IFREG | 0o444, len(self.overlay[path]))
        if any(p.startswith(path.rstrip("/") + "/") for p in self.overlay):
            return self._stat(stat.S_IFDIR | 0o555, 0)  # it holds a file served from memory
        info = self._info(path)
        if info.get("type") == "directory":
            return self._stat(stat.S_IFDIR | 0o555, 0)
        return self._stat(stat.S_IFREG | 0o444, int(info.get("size") or 0))

    def listdir(self, path: str) -> list[str]:
        entries = self.fs.ls(path, detail=True)
        for e in entries:  # what a listing says of each entry: no request per entry later
            self._infos.setdefault(e["name"].rstrip("/"), e)
        names = {os.path.basename(e["name"].rstrip("/")) for e in entries}
        names |= {os.path.basename(p) for p in self.overlay if os.path.dirname(p) == path}
        return sorted(names)

    def _read_only(self, *args: Any, **kw: Any) -> Any:
        raise PermissionError(errno.EROFS, "the mirror is only read here")

    write = writev = fsync = ftruncate = mkdir = rename = unlink = rmdir = _read_only
    flock = _read_only


class FsspecStore:
    """A mirror at an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

    ``atomic_rename`` (default: only for a local file system, whose directory rename is one
    system call): copies are written under a temporary name and renamed. Elsewhere —
    object stores, and fsspec's memory file system, whose ``mv`` is a copy then a delete —
    there is no rename of a prefix, and a listing shows every object uploaded so far. A copy
    is written under its final name, every file but the metadata, verified (every leaf's
    checksum, the metadata served from memory), then the metadata, its size checked, and
    last :data:`COMMIT_SUCCESS_FILE`, the commit marker: only a step that holds it is listed
    or restored. A delete removes the marker first. So a copy or a delete cut short leaves a
    directory without the marker: never listed, never restored, and removed by the next
    :meth:`cleanup`. ``storage_options`` go to fsspec (for ``s3://``: ``endpoint_url``,
    ``key``, ``secret``, ``client_kwargs`` ...); ``gs://`` (gcsfs) takes the same code path.
    """

    def __init__(self, url: str, *, atomic_rename: bool | None = None,
                 **storage_options: Any):
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"mirroring to {url} needs fsspec: pip install "
                              "'minickpt[remote]'") from e
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (
            self.fs.protocol,)
        self.atomic_rename = bool({"file", "local"} & set(protocols)) \
            if atomic_rename is None else atomic_rename
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def listdir(self, rel: str = "") -> list[str]:
        """The names under ``rel``, listed afresh (never from fsspec's listing cache: what is
        removed or published is decided on it)."""
        p = self.path(rel)
        self.fs.invalidate_cache(p)
        try:
            return [os.path.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False)]
        except FileNotFoundError:
            return []

    def is_dir(self, rel: str) -> bool:
        return bool(self.fs.isdir(self.path(rel)))

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def committed(self, rel: str) -> bool:
        """Whether ``rel`` is a complete checkpoint: renamed into place (``atomic_rename``),
        or else holding the commit marker, which is written last."""
        if self.atomic_rename:
            return self.is_dir(rel) and self.exists(f"{rel}/{METADATA_FILE}")
        self.fs.invalidate_cache(self.path(rel))  # a cached listing may predate the marker
        return self.exists(f"{rel}/{COMMIT_SUCCESS_FILE}")

    def makedirs(self, rel: str) -> None:
        if self.atomic_rename:  # an object store has no directories: a key implies them
            self.fs.makedirs(self.path(rel), exist_ok=True)

    def sizes(self, rel: str) -> dict[str, int]:
        """The size of every file under ``rel``, from one listing (one request per thousand
        objects on S3, not one per file)."""
        p = self.path(rel)
        self.fs.invalidate_cache(p)
        return {k[len(p) + 1:]: int(v.get("size") or 0)
                for k, v in self.fs.find(p, detail=True).items()}

    def write_file(self, rel: str, chunks: Iterator[bytes]) -> int:
        n = 0
        with self.fs.open(self.path(rel), "wb") as f:  # object stores: durable on close
            for c in chunks:
                f.write(c)
                n += len(c)
        return n

    def read_chunks(self, rel: str) -> Iterator[bytes]:
        with self.fs.open(self.path(rel), "rb") as f:
            while True:
                c = f.read(CHUNK)
                if not c:
                    return
                yield c

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def metadata(self, rel: str, data: bytes | None = None) -> CheckpointMetadata:
        """``data``: the metadata file's bytes when the caller has them (no request)."""
        overlay = {} if data is None else {self.path(f"{rel}/{METADATA_FILE}"): data}
        return Checkpointer(_FsspecReader(self.fs, overlay)).metadata(self.path(rel))

    def verify(self, rel: str, metadata: bytes | None = None) -> list[str]:
        """Re-read the copy and check it as a local checkpoint is checked (every leaf's CRC);
        ``metadata``: its metadata file, when it is not uploaded yet."""
        overlay = {} if metadata is None else {self.path(f"{rel}/{METADATA_FILE}"): metadata}
        rep = Checkpointer(_FsspecReader(self.fs, overlay)).verify(self.path(rel), deep=True)
        return [] if rep.ok else rep.problems

    def commit(self, tmp: str, final: str, subdirs: list[str]) -> None:
        """Publish a verified copy: rename it into place, or (written in place) write the
        commit marker, the last object of a checkpoint."""
        if tmp == final:
            # one PUT: on S3 and GCS an object is whole once its upload has succeeded
            self.fs.pipe_file(self.path(f"{final}/{COMMIT_SUCCESS_FILE}"),
                              f"Checkpoint commit was successful to {self.path(final)}\n"
                              .encode())
            return
        if self.exists(final):
            raise FileExistsError(f"{self.path(final)} already exists")
        self.fs.mv(self.path(tmp), self.path(final), recursive=True)

    def delete(self, rel: str) -> None:
        """Crash-safe: the checkpoint stops being one (renamed away, or its commit marker
        removed, then its metadata) before any of its data goes."""
        if self.atomic_rename:  # out of the checkpoint namespace first, as on a local disk
            doomed = f"{rel}{DELETE_MARK}{secrets.token_hex(4)}"
            self.fs.mv(self.path(rel), self.path(doomed), recursive=True)
            rel = doomed
        else:
            for f in (COMMIT_SUCCESS_FILE, METADATA_FILE):
                if self.exists(f"{rel}/{f}"):
                    self.fs.rm_file(self.path(f"{rel}/{f}"))
        self.fs.rm(self.path(rel), recursive=True)

    def remove_temporary(self, rel: str) -> None:
        try:
            if not self.exists(rel):
                return
            if self.atomic_rename:  # a temporary name: never a checkpoint
                self.fs.rm(self.path(rel), recursive=True)
            else:  # the final name: perhaps published already
                self.delete(rel)
        except Exception:
            pass

    def cleanup(self) -> list[str]:
        """Remove temporaries and, on object stores, uploads cut short (no commit marker)."""
        out = [n for n in self.listdir("") if is_temporary(n) or (
            not self.atomic_rename and self.is_dir(n) and not self.committed(n))]
        for n in out:
            if is_temporary(n):
                self.fs.rm(self.path(n), recursive=True)
            else:
                self.delete(n)  # the metadata first: a crash here leaves no checkpoint
        return out


def open_store(target: Any) -> LocalStore | FsspecStore:
    """A store for a path, a ``file://`` URL (both: :class:`LocalStore`), another fsspec URL,
    or a store object given as it is."""
    if isinstance(target, (LocalStore, FsspecStore)):
        return target
    target = os.fspath(target)
    if target.startswith("file://"):
        return LocalStore(target[len("file://"):])
    if "://" in target:
        return FsspecStore(target)
    return LocalStore(target)


def _read_chunks(fs: FileSystem, path: str) -> Iterator[bytes]:
    fd = fs.open_read(path)
    try:
        size, off = fs.fstat(fd).st_size, 0
        while off < size:
            buf = bytearray(min(CHUNK, size - off))
            fs.read_into(fd, memoryview(buf), off)
            off += len(buf)
            yield bytes(buf)
    finally:
        fs.close(fd)


def _walk(listdir: Callable[[str], list[str]], is_dir: Callable[[str], bool], rel: str
          ) -> tuple[list[str], list[str]]:
    """(directories, files) under ``rel``, relative to it, parents before children."""
    dirs, files = [], []
    for name in sorted(listdir(rel)):
        sub = f"{rel}/{name}" if rel else name
        if is_dir(sub):
            d2, f2 = _walk(listdir, is_dir, sub)
            dirs += [name] + [f"{name}/{d}" for d in d2]
            files += [f"{name}/{f}" for f in f2]
        else:
            files.append(name)
    return dirs, files


# ---------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------
class TieredCheckpointManager:
    """A :class:`CheckpointManager` on a local directory plus a background mirror.

    >>> with TieredCheckpointManager("/local/run1", "gs://bucket/run1", options) as mngr:
    ...     mngr.save(step, items)                   # waits for the local save only
    ...     restored = mngr.restore(target=items)    # local, or the mirror if local is gone

    Everything else (``should_save``, ``metadata``, ``listeners``, ``save_history`` ...) is the
    local manager's. ``mirror_max_to_keep`` (default: the options' ``max_to_keep``) sets the
    mirror's own retention; ``keep_period`` and ``best_fn`` apply to both.
    """

    def __init__(self, local_directory: str | os.PathLike[str], mirror: Any,
                 options: CheckpointManagerOptions | None = None, *,
                 fs: FileSystem | None = None, mirror_max_to_keep: int | str | None = "same",
                 max_attempts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self.options = options or CheckpointManagerOptions()
        # Local retention runs here, after each copy, never deleting a checkpoint that has
        # not reached the mirror yet; the local manager itself keeps everything.
        self.local = CheckpointManager(local_directory, dataclasses.replace(
            self.options, max_to_keep=None, keep_period=None, keep_latest=None), fs=fs)
        self.store = open_store(mirror)
        self.mirror_max_to_keep = self.options.max_to_keep if mirror_max_to_keep == "same" \
            else mirror_max_to_keep
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, \
            max_backoff_s
        self.failed: dict[int, str] = {}  # step -> last error, after every retry
        self.mirrored: list[int] = []  # steps copied by this manager, in order
        self._mirror_infos: dict[int, policy.StepInfo] = {}
        self._mirror_unreadable: set[int] = set()  # listed, but retention leaves them be
        self._local_damage: dict[int, BaseException] = {}  # local copies found damaged
        self._store_lock = threading.RLock()  # one operation on the mirror at a time
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._pending: collections.Counter[int] = collections.Counter()  # queued or copying
        self._jobs = 0  # jobs not finished yet (copy and the retention after it)
        self._idle = threading.Condition()
        self._closed = False
        with self._store_lock:
            for name in self.store.cleanup():
                log.warning("minickpt: removed %s from the mirror, left by an interrupted copy",
                            name)
            self._scan_mirror()
        self.local.listeners.append(self._on_event)
        self._thread = threading.Thread(target=self._run, name="minickpt-mirror", daemon=True)
        self._thread.start()
        with self._store_lock:
            self._catch_up()

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

    def save(self, step: int, items: Mapping[str, Any], **kw: Any) -> bool:
        """Save locally (see :meth:`CheckpointManager.save`); the copy to the mirror follows
        in the background once the checkpoint is committed."""
        return self.local.save(step, items, **kw)

    def mirror_steps(self) -> list[int]:
        """The steps committed in the mirror, ascending."""
        with self._store_lock:
            return sorted(self._mirror_infos)

    def all_steps(self, read: bool = False) -> list[int]:
        """Steps restorable from either tier."""
        return sorted(set(self.local.all_steps(read=read)) | set(self.mirror_steps()))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- the mirror worker ---------------------------------------------------------------
    def _on_event(self, event: str, record: Mapping[str, Any]) -> None:
        if event == "save" and record.get("ok") and isinstance(record.get("step"), int):
            self._enqueue(record["step"])

    def _enqueue(self, step: int) -> None:
        with self._idle:
            self._pending[step] += 1
            self._jobs += 1
        self._queue.put(step)

    def _notify(self, record: dict[str, Any]) -> None:
        for fn in list(self.local.listeners):
            if fn == self._on_event:
                continue
            try:
                fn("mirror", record)
            except Exception:  # a broken listener must not stop the mirror
                log.exception("minickpt: listener failed on a mirror event")

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            try:
                self._mirror_with_retries(step)
            except BaseException:  # pragma: no cover - keep the thread alive
                log.exception("minickpt: mirror worker error")
            finally:
                with self._idle:
                    self._pending[step] -= 1
                    if not self._pending[step]:
                        del self._pending[step]
                try:
                    self._apply_local_retention()
                except Exception:  # pragma: no cover - logged, retried after the next copy
                    log.exception("minickpt: local retention failed")
                with self._idle:
                    self._jobs -= 1
                    self._idle.notify_all()

    def _mirror_with_retries(self, step: int) -> None:
        for attempt in range(1, self.max_attempts + 1):
            t0 = time.perf_counter()
            try:
                nbytes = self._copy(step)
            except FileNotFoundError as e:
                if not self.local.fs.is_dir(self.local.step_path(step)):
                    # deleted locally (retention) before it could be copied: nothing to do
                    self._notify({"step": step, "ok": True, "skipped": True, "attempt": attempt,
                                  "error": None, "total_s": time.perf_counter() - t0,
                                  "target": self.store.url, "time": time.time(),
                                  "note": "deleted locally before it was mirrored"})
                    return
                err: BaseException = e
            except Exception as e:
                err = e
            else:
                self.failed.pop(step, None)
                self.mirrored.append(step)
                self._notify({"step": step, "ok": True, "attempt": attempt, "error": None,
                              "bytes": nbytes, "total_s": time.perf_counter() - t0,
                              "target": self.store.url, "time": time.time()})
                self._apply_mirror_retention()
                return
            msg = f"{type(err).__name__}: {err}"
            retry = attempt < self.max_attempts
            self._notify({"step": step, "ok": False, "attempt": attempt, "error": msg,
                          "will_retry": retry, "total_s": time.perf_counter() - t0,
                          "target": self.store.url, "time": time.time()})
            text = (f"minickpt: copying step {step} to the mirror {self.store.url} failed "
                    f"(attempt {attempt} of {self.max_attempts}): {msg}")
            log.error(text)
            warnings.warn(text, stacklevel=2)
            if not retry:
                self.failed[step] = msg
                return
            time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))

    def _copy(self, step: int) -> int:
        """Copy one committed local checkpoint into the mirror, with the mirror's own atomic
        commit. Returns the bytes copied."""
        lfs = self.local.fs
        src = self.local.step_path(step)
        name = os.path.basename(src)
        with self._store_lock:
            if name in self.store.listdir(""):
                if not self.store.committed(name):
                    self.store.remove_temporary(name)  # an upload cut short (object stores)
                elif b"".join(self.store.read_chunks(f"{name}/{METADATA_FILE}")) \
                        == lfs.read_file(os.path.join(src, METADATA_FILE)):
                    self._remember(step, name)
                    return 0  # already there (copied before a restart)
                else:  # another checkpoint of this step (damaged, set aside, saved again)
                    log.warning("minickpt: replacing %s in the mirror: it is not the local "
                                "checkpoint of step %d", name, step)
                    self.store.delete(name)
            dirs, files = _walk(lambda r: lfs.listdir(os.path.join(src, r)),
                                lambda r: lfs.is_dir(os.path.join(src, r)), "")
            files.sort(key=lambda f: f == METADATA_FILE)
            if METADATA_FILE not in files:
                raise CheckpointCorruptedError(src, "has no metadata: not a committed checkpoint")
            tmp = f"{name}{TMP_MARK}{secrets.token_hex(4)}" if self.store.atomic_rename \
                else name
            nbytes = 0
            # Without a rename the commit marker is the publication: every other file is
            # uploaded and verified (the metadata served from memory) before the metadata,
            # then the marker (store.commit), are written.
            verify_first = not self.store.atomic_rename
            try:
                self.store.makedirs(tmp)
                for d in dirs:
                    self.store.makedirs(f"{tmp}/{d}")
                sizes = {f: lfs.lstat(os.path.join(src, f)).st_size for f in files}
                meta = lfs.read_file(os.path.join(src, METADATA_FILE))
                for f in files:  # the metadata, which makes a checkpoint valid, goes last
                    if f == METADATA_FILE and verify_first:
                        # every file there, whole (one listing), and every leaf's checksum
                        there = self.store.sizes(tmp)
                        wrong = [f"{g}: {there.get(g, 'missing')} bytes of {sizes[g]}"
                                 for g in files if g != f and there.get(g) != sizes[g]]
                        if wrong:
                            raise OSError(f"{self.store.path(tmp)}: " + "; ".join(wrong))
                        self._check_copy(tmp, meta)
                    n = self.store.write_file(f"{tmp}/{f}", _read_chunks(lfs, os.path.join(src, f)))
                    # (the files before the metadata were sized above, from one listing)
                    got = self.store.size(f"{tmp}/{f}") \
                        if not verify_first or f == METADATA_FILE else n
                    if n != sizes[f] or got != sizes[f]:
                        raise OSError(f"{self.store.path(f'{tmp}/{f}')}: wrote {n} bytes of "
                                      f"{sizes[f]}, {got} there")
                    nbytes += n
                if not verify_first:
                    self._check_copy(tmp, None)
                self.store.commit(tmp, name, dirs)
            except BaseException:
                self.store.remove_temporary(tmp)
                raise
            self._remember(step, name, meta)
            return nbytes

    def _check_copy(self, rel: str, metadata: bytes | None) -> None:
        """Re-read the mirror's copy and verify every checksum (CheckpointCorruptedError)."""
        problems = self.store.verify(rel) if metadata is None else self.store.verify(
            rel, metadata=metadata)
        if problems:
            raise CheckpointCorruptedError(self.store.path(rel), "the mirror copy does not "
                                           "verify: " + "; ".join(problems))

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
            # no commit marker: an upload or a delete cut short (object stores)
            if step is not None and self.store.committed(name):
                self._remember(step, name)

    def _catch_up(self) -> None:
        """Queue the local checkpoints the mirror lacks and its retention would keep: a
        previous process may have died between a local commit and its copy."""
        missing = [s for s in self.local.all_steps() if s not in self._mirror_infos]
        infos = [i for s, i in self._mirror_infos.items() if s not in self._mirror_unreadable]
        # a step damaged locally is left out: nothing worth copying
        infos += [i for s in missing if (i := self._local_info(s)) is not None]
        keep = self._keep(infos, self.mirror_max_to_keep)
        for s in missing:
            if s in keep:
                self._enqueue(s)

    def _apply_mirror_retention(self) -> None:
        with self._store_lock:
            readable = [i for s, i in self._mirror_infos.items()
                        if s not in self._mirror_unreadable]
            keep = self._keep(readable, self.mirror_max_to_keep)
            for step in sorted({i.step for i in readable} - keep):
                name = self._name(step)
                try:
                    self.store.delete(name)
                    del self._mirror_infos[step]
                    self._notify({"step": step, "ok": True, "deleted": True, "error": None,
                                  "target": self.store.url, "time": time.time()})
                except Exception as e:
                    log.error("minickpt: could not delete %s from the mirror: %s", name, e)

    def _apply_local_retention(self) -> None:
        """The options' retention on the local tier, sparing steps still waiting for their
        copy (a step whose copy failed every retry is no longer spared: it was reported)."""
        # a step whose metadata cannot be read (EIO, damage) is neither counted nor deleted
        infos = [i for s in self.local.all_steps() if (i := self._local_info(s)) is not None]
        keep = self._keep(infos, self.options.max_to_keep)
        with self._idle:
            spared = set(self._pending)
        for s in sorted({i.step for i in infos} - keep - spared):
            try:
                self.local.delete(s)
            except CheckpointNotFoundError:
                pass
            except OSError as e:
                log.error("minickpt: could not delete old local checkpoint %s: %s",
                          self.local.step_path(s), e)

    def _local_info(self, step: int) -> policy.StepInfo | None:
        """What retention needs of a local step, from its metadata; None when unreadable."""
        try:
            meta = self.local.metadata(step)
        except (MiniCkptError, OSError):
            return None
        return policy.StepInfo(step, meta.metrics, meta.time or 0.0)

    def _keep(self, infos: Sequence[policy.StepInfo], max_to_keep: int | None) -> set[int]:
        """The options' retention rules (``max_to_keep`` differs between the tiers)."""
        o = self.options
        return policy.steps_to_keep(
            infos, max_to_keep=max_to_keep, keep_period=o.keep_period, best_fn=o.best_fn,
            best_mode=o.best_mode,
            keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics,
        ) | policy.newest_steps(infos, o.keep_latest)

    def _name(self, step: int) -> str:
        return step_dir_name(step, self.options.step_prefix,
                             self.options.step_format_fixed_length)

    # ---- waiting and closing -------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Wait for the local saves (an async local manager's too); not for the mirror."""
        self.local.wait_until_finished()

    def wait_until_mirrored(self, timeout: float | None = None) -> None:
        """Wait until every committed checkpoint has been copied (or has failed every retry);
        raise :class:`MirrorError` naming each step that could not be mirrored."""
        self.local.wait_until_finished()
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._jobs:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"steps {sorted(self._pending)} still being copied to "
                                       f"{self.store.url} after {timeout} s")
                self._idle.wait(left)
        if self.failed:
            raise MirrorError("could not copy to the mirror " + self.store.url + ": " + "; ".join(
                f"step {s}: {e}" for s, e in sorted(self.failed.items()))
                + " — the local checkpoints are intact; retry_failed() tries again")

    def retry_failed(self) -> None:
        """Queue every step that failed all its attempts again (if it still exists)."""
        for step in sorted(self.failed):
            self._enqueue(step)

    def close(self) -> None:
        """Close the local manager, finish the mirror copies, stop the worker; raises
        :class:`MirrorError` if some checkpoint could not be mirrored."""
        if self._closed:
            return
        try:
            self.local.close()
            self.wait_until_mirrored()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=60)

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
        if step not in self.mirror_steps() or not self._still_committed(step):
            if local_error is not None:
                raise local_error
            raise CheckpointNotFoundError(f"no checkpoint for step {step} in "
                                          f"{self.local.directory} nor in {self.store.url}")
        self._fetch(step)
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
        """Copy a step from the mirror back to the local disk: into a temporary directory,
        verify every checksum, replace a damaged local copy, commit."""
        lfs, root = self.local.fs, self.local.directory
        name = self._name(step)
        final = os.path.join(root, name)
        with self._store_lock:
            tmp = make_temporary(lfs, root, name)
            try:
                dirs, files = _walk(self.store.listdir, self.store.is_dir, name)
                for d in dirs:
                    lfs.mkdir(os.path.join(tmp, d))
                for f in files:
                    if f == COMMIT_SUCCESS_FILE:  # the mirror's marker; a local step is renamed
                        continue
                    lfs.write_file(os.path.join(tmp, f), self.store.read_chunks(f"{name}/{f}"))
                rep = Checkpointer(lfs).verify(tmp, deep=True)
                if not rep.ok:
                    raise CheckpointCorruptedError(self.store.path(name), "the mirror's copy is "
                                                   "damaged too: " + "; ".join(rep.problems))
                if lfs.exists(final):
                    self.local.reload()
                    self.local.delete(step)
                commit(lfs, tmp, final, subdirs=dirs)
            except BaseException:
                abort(lfs, tmp)
                raise
        self.local.reload()
        log.warning("minickpt: restored step %d's checkpoint from the mirror %s", step,
                    self.store.url)
