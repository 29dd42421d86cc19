"""The mirror: where a tiered manager's copies live, and the one rule of what it may change.

**A mirror owns only the step folders it created, and only a writer changes it.** A mirror
often shares its prefix with other data (``tensorboard/``, ``config/``, another run, a
dataset at the bucket root), and other jobs read it while the trainer writes (an evaluation
job). So every change a writer makes to a step folder — an upload, a delete — begins with an
*in-progress marker*, :data:`UPLOAD_MARKER`, written first into that folder, naming the
writer (a random id, host, pid, time). :meth:`MirrorStore.cleanup` removes a folder only when
it carries such a marker and the writer it names is gone (:func:`abandoned`); a committed step
left with a stale marker loses the marker only. A folder without a marker is never touched:
not ours. Read-only managers never call anything here that changes the store.

Two stores: :class:`LocalStore` (a directory: another disk, an NFS mount; a copy is written
under a temporary name and renamed into place) and :class:`FsspecStore` (``s3://``,
``gs://``, ``memory://`` ...: no rename of a prefix, so a copy is written in place and
published by a commit marker, :data:`COMMIT_SUCCESS_FILE`, written last). Uploading a local
step (:func:`upload_step`) and fetching one back (:func:`fetch_step`) are here too.
"""

from __future__ import annotations

import errno
import io
import itertools
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..checkpointer import Checkpointer, CheckpointMetadata
from ..commit import (
    DELETE_MARK,
    METADATA_FILE,
    TMP_MARK,
    abort,
    commit,
    make_temporary,
    makedirs,
    parse_step,
)
from ..fs import DEFAULT_FS, FileSystem
from .lease import (  # noqa: F401 - the lease and the errors, re-exported: one owner per prefix
    LEASE_FILE,
    LeaseHeldError,
    LeaseLostError,
    MirrorError,
    MirrorUnavailableError,
    NotOursError,
    Writer,
    _base_name,
    abandoned,
    describe_holder,
    named,
    unreachable,
)

log = logging.getLogger("minickpt")
CHUNK = 8 << 20

# Orbax's name for the same object (orbax.checkpoint's CommitFileTemporaryPath, its default on
# gs://): written last into a checkpoint saved in place; a step directory without it is not
# finalized, never listed.
COMMIT_SUCCESS_FILE = "commit_success.txt"
# Written first into a step folder a writer uploads or deletes, removed last: whose change it is.
UPLOAD_MARKER = ".minickpt-upload.json"
# The commit marker's line naming the writer that committed the step.
_OWNER_LINE = "minickpt-writer: "




# ---------------------------------------------------------------------------------------
# the ownership rule, over a store's primitives
# ---------------------------------------------------------------------------------------
class MirrorStore:
    """What both stores share: the in-progress marker and the one rule built on it.

    A store implements ``listdir``, ``exists``, ``committed``, ``put_bytes``,
    ``get_bytes``, ``remove_file`` and ``_remove_files`` (every file under a folder, the
    marker excepted, then what is left of the folder but the marker)."""

    url: str
    atomic_rename: bool
    stale_after_s: float = 600.0  # another host's marker not refreshed for this long: gone

    def listdir(self, rel: str = "") -> list[str]: ...  # pragma: no cover
    def exists(self, rel: str) -> bool: ...  # pragma: no cover
    def committed(self, rel: str) -> bool: ...  # pragma: no cover
    def put_bytes(self, rel: str, data: bytes) -> None: ...  # pragma: no cover
    def get_bytes(self, rel: str) -> bytes: ...  # pragma: no cover
    def remove_file(self, rel: str) -> None: ...  # pragma: no cover
    def _remove_files(self, rel: str) -> None: ...  # pragma: no cover
    def _remove_dir(self, rel: str) -> None: ...  # pragma: no cover

    def path(self, rel: str) -> str: ...  # pragma: no cover

    # whether a create-if-absent (and a replace-if-unchanged) is one atomic request here
    conditional: bool = False

    def _read_tagged(self, rel: str) -> tuple[bytes, Any] | None:
        """(content, tag) of ``rel``, None when absent; the tag is what :meth:`_write_if`
        compares (an ETag, or the content itself where the store has no conditional write)."""
        try:
            data = self.get_bytes(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data, data

    def _write_if(self, rel: str, data: bytes, tag: Any) -> bool:
        """Write ``rel`` only if it is absent (``tag`` None) or unchanged since it was read
        with ``tag``; False when it was not. Best effort here (read, compare, write)."""
        got = self._read_tagged(rel)
        if (got is None) != (tag is None) or (got is not None and got[1] != tag):
            return False
        self.put_bytes(rel, data)
        return True

    # ---- the lease: one writer per mirror ------------------------------------------------
    def lease(self) -> tuple[dict[str, Any] | None, Any] | None:
        """(the lease record, its tag); None when there is no lease; a record that is not
        one (unreadable) is given as None with its tag."""
        got = self._read_tagged(LEASE_FILE)
        if got is None:
            return None
        try:
            rec = json.loads(got[0])
        except ValueError:
            rec = None
        return (rec if isinstance(rec, dict) and "writer" in rec else None), got[1]

    def lease_is_live(self, rec: Mapping[str, Any] | None) -> bool:
        """Whether a lease record names a writer that still holds it (not released, not
        gone: see :func:`abandoned`)."""
        return rec is not None and not rec.get("released") \
            and not abandoned(rec, self.stale_after_s)

    def acquire(self, writer: Writer, *, force: bool = False) -> dict[str, Any] | None:
        """Take the lease for ``writer``: create it (a conditional write where the store has
        one), or take over one that was released, whose writer is gone, or — ``force`` — any.
        Returns the record taken over (None if there was none). Raises
        :class:`LeaseHeldError` naming a live holder."""
        self.ensure_root()
        for _ in range(5):  # another writer may win each conditional write
            got = self.lease()
            if got is None:
                if self._write_if(LEASE_FILE, writer.record("lease"), None):
                    return None
                continue
            rec, tag = got
            if rec is not None and rec.get("writer") == writer.id:
                return rec
            if rec is None and not force:
                raise LeaseHeldError(
                    f"{self.path(LEASE_FILE)} is not a lease minickpt can read: another "
                    "tool's, or damaged. Look at it, then delete it or pass force=True to "
                    "take the mirror over")
            if self.lease_is_live(rec) and not force:
                assert rec is not None
                raise LeaseHeldError(
                    f"the mirror {self.url} is held by {describe_holder(rec)}: one writer per "
                    "prefix, so this one is refused and changes nothing there. If that writer "
                    "is gone (a VM that was preempted), its lease becomes stale "
                    f"{self.stale_after_s:.0f} s after its last renewal and is then taken over "
                    "by itself; to take it over now, on purpose, pass force=True (the old "
                    "writer then stops at its next change). Readers (read_only=True) need "
                    "no lease")
            if self._write_if(LEASE_FILE, writer.record("lease"), tag):
                if rec is not None and not rec.get("released"):
                    log.warning("minickpt: took over the lease of %s from %s (%s)", self.url,
                                describe_holder(rec), "force=True" if force and
                                self.lease_is_live(rec) else "its writer is gone")
                return rec
        raise LeaseHeldError(f"the lease of {self.url} changed under every attempt to take "
                             "it: several writers are starting at once; one of them holds it")

    def renew(self, writer: Writer) -> None:
        """Renew ``writer``'s lease (its time is how another host tells it is alive);
        :class:`LeaseLostError` when another writer holds it now."""
        got = self.lease()
        rec = got[0] if got is not None else None
        if rec is None or rec.get("writer") != writer.id or rec.get("released") \
                or not self._write_if(LEASE_FILE, writer.record("lease"), got[1]):  # type: ignore[index]
            raise self._lost(writer, rec)

    def check_lease(self, writer: Writer) -> None:
        """Before each change: :class:`LeaseLostError` unless ``writer`` holds the lease."""
        got = self.lease()
        rec = got[0] if got is not None else None
        if rec is None or rec.get("writer") != writer.id or rec.get("released"):
            raise self._lost(writer, rec)

    def _lost(self, writer: Writer, rec: Mapping[str, Any] | None) -> LeaseLostError:
        now = "nobody" if rec is None else describe_holder(rec)
        return LeaseLostError(f"writer {writer.id} no longer holds the lease of the mirror "
                              f"{self.url} (held by {now} now, taken over with force=True or "
                              "after this writer looked gone): it changes nothing there any "
                              "more; its local checkpoints are kept")

    def release(self, writer: Writer) -> None:
        """Give the lease up (on close): the next writer takes it at once. Never raises."""
        try:
            got = self.lease()
            if got is not None and got[0] is not None and got[0].get("writer") == writer.id:
                rec = {**got[0], "released": True, "time": time.time()}
                self._write_if(LEASE_FILE, json.dumps(rec).encode(), got[1])
        except Exception as e:  # the store is gone: the lease goes stale (or the pid is)
            log.warning("minickpt: could not release the lease of %s: %s", self.url, e)

    def ensure_root(self) -> None:
        """Make the mirror's root where a store needs one (on the first change only: opening
        a store makes no request)."""

    def owned(self, rel: str) -> bool:
        """Whether a committed step was written by a minickpt writer of this mirror (its
        commit record says so), so retention may delete it."""
        return True

    def begin(self, rel: str, writer: Writer, op: str) -> None:
        """Mark ``rel`` as being changed by ``writer`` (the first object of an upload or a
        delete), and again during a long one (the marker's time is how another host tells a
        live writer from a gone one)."""
        self.put_bytes(f"{rel}/{UPLOAD_MARKER}", writer.record(op))

    def end(self, rel: str) -> None:
        """The change is done: drop the marker (a committed step stays)."""
        if self.exists(f"{rel}/{UPLOAD_MARKER}"):
            self.remove_file(f"{rel}/{UPLOAD_MARKER}")

    def marker(self, rel: str) -> dict[str, Any] | None:
        """The in-progress record in ``rel``; None when there is none (not ours), or it is
        not one (unreadable: not known to be ours)."""
        try:
            rec = json.loads(self.get_bytes(f"{rel}/{UPLOAD_MARKER}"))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and "writer" in rec else None

    def reclaim(self, rel: str, writer: Writer | None = None) -> bool:
        """THE rule: remove ``rel`` if this mirror may — it carries an in-progress marker
        whose writer is ``writer`` or is gone. A committed step loses only its stale marker.
        Returns whether ``rel`` was removed; never touches a folder without a marker."""
        rec = self.marker(rel)
        if rec is None:
            return False
        if not (writer is not None and rec.get("writer") == writer.id) \
                and not abandoned(rec, self.stale_after_s):
            return False
        if rel == _base_name(rel) and self.committed(rel):
            self.end(rel)  # the change stopped after the commit (or before a delete began)
            return False
        self._remove_files(rel)
        self.end(rel)
        self._remove_dir(rel)
        return True

    def cleanup(self, step_prefix: str | None) -> list[str]:
        """Remove the step folders (and their temporaries) whose upload or delete was
        abandoned. Only names this mirror gives its steps are looked at."""
        out = []
        for name in self.listdir(""):
            if parse_step(_base_name(name), step_prefix) is None:
                continue
            if self.reclaim(name):
                out.append(name)
        out += self.abort_multipart(step_prefix)
        return out

    def abort_multipart(self, step_prefix: str | None) -> list[str]:
        """Abort the multipart uploads a killed writer left in step folders (their parts
        are stored, and billed, until aborted). Called by the lease's holder only, before
        its own uploads start, so no live upload is among them."""
        return []

    def delete(self, rel: str, writer: Writer) -> None:
        """Delete a committed step, crash-safe: the marker first (so that a delete cut short
        is known as ours), then the step stops being one, then its data, the marker last."""
        self.begin(rel, writer, "delete")
        if self.atomic_rename:
            doomed = f"{rel}{DELETE_MARK}{secrets.token_hex(4)}"
            self._rename(rel, doomed)
            rel = doomed
        else:
            for f in (COMMIT_SUCCESS_FILE, METADATA_FILE):
                if self.exists(f"{rel}/{f}"):
                    self.remove_file(f"{rel}/{f}")
        self._remove_files(rel)
        self.end(rel)
        self._remove_dir(rel)

    def _rename(self, src: str, dst: str) -> None: ...  # pragma: no cover


# ---------------------------------------------------------------------------------------
# a directory
# ---------------------------------------------------------------------------------------
class LocalStore(MirrorStore):
    """A mirror in a directory (another disk, an NFS mount), through minickpt's FileSystem
    layer: fsync of every file and directory, rename that never replaces, as for saves."""

    atomic_rename = True

    def __init__(self, root: str | os.PathLike[str], fs: FileSystem | None = None):
        self.fs = fs or DEFAULT_FS
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        makedirs(self.fs, self.root)

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

    def put_bytes(self, rel: str, data: bytes) -> None:
        # (not exclusive: a marker or the lease is written again to renew it)
        self.fs.write_file(self.path(rel), [data], fsync=True, exclusive=False)

    def _write_if(self, rel: str, data: bytes, tag: Any) -> bool:
        """Create-if-absent is one system call here (O_EXCL); replacing is best effort."""
        if tag is not None:
            return super()._write_if(rel, data, tag)
        try:
            self.fs.write_file(self.path(rel), [data], fsync=True, exclusive=True)
        except FileExistsError:
            return False
        return True

    def get_bytes(self, rel: str) -> bytes:
        return self.fs.read_file(self.path(rel))

    def remove_file(self, rel: str) -> None:
        self.fs.unlink(self.path(rel))

    def write_file(self, rel: str, chunks: Iterator[bytes]) -> int:
        return self.fs.write_file(self.path(rel), chunks, fsync=True)

    def read_chunks(self, rel: str) -> Iterator[bytes]:
        return read_chunks(self.fs, self.path(rel))

    def size(self, rel: str) -> int:
        return self.fs.lstat(self.path(rel)).st_size

    def metadata(self, rel: str, data: bytes | None = None) -> CheckpointMetadata:
        return Checkpointer(self.fs).metadata(self.path(rel))  # a local read is cheap

    def verify(self, rel: str) -> list[str]:
        rep = Checkpointer(self.fs).verify(self.path(rel), deep=True)
        return [] if rep.ok else rep.problems

    def new_upload(self, name: str, writer: Writer) -> str:
        """The folder a copy of ``name`` is written into: a temporary, marked first."""
        tmp = os.path.basename(make_temporary(self.fs, self.root, name))
        self.begin(tmp, writer, "upload")
        return tmp

    def commit(self, tmp: str, final: str, subdirs: list[str], writer: Writer | None = None
               ) -> None:
        commit(self.fs, self.path(tmp), self.path(final), subdirs=subdirs)
        self.end(final)  # a crash before this: a committed step with a stale marker

    def _rename(self, src: str, dst: str) -> None:
        self.fs.rename(self.path(src), self.path(dst))
        self.fs.fsync_dir(self.root)

    def _remove_files(self, rel: str) -> None:
        p = self.path(rel)
        for name in self.fs.listdir(p):
            if name != UPLOAD_MARKER:
                child = os.path.join(p, name)
                self.fs.rmtree(child)

    def _remove_dir(self, rel: str) -> None:
        abort(self.fs, self.path(rel))

    def abort_upload(self, tmp: str, writer: Writer) -> None:
        """Remove this writer's own failed upload; never raises (the error matters more)."""
        try:
            self.reclaim(tmp, writer)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------
# an fsspec URL
# ---------------------------------------------------------------------------------------
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


class FsspecStore(MirrorStore):
    """A mirror at an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

    ``atomic_rename`` (default: only for a local file system, whose directory rename is one
    system call): copies are written under a temporary name and renamed. Elsewhere —
    object stores, and fsspec's memory file system, whose ``mv`` is a copy then a delete —
    there is no rename of a prefix, and a listing shows every object uploaded so far. A copy
    is written under its final name: the in-progress marker first, every file but the
    metadata, verified (every leaf's checksum, the metadata served from memory), then the
    metadata, its size checked, and last :data:`COMMIT_SUCCESS_FILE`, the commit marker:
    only a step that holds it is listed or restored. ``storage_options`` go to fsspec (for
    ``s3://``: ``endpoint_url``, ``key``, ``secret``, ``config_kwargs`` with botocore's
    ``connect_timeout``, ``read_timeout`` and ``retries`` ...); ``gs://`` (gcsfs) takes the
    same code path.
    """

    def __init__(self, url: str, *, atomic_rename: bool | None = None, create: bool = True,
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
        # s3fs sends If-None-Match / If-Match (S3 honours both since 2024, as do MinIO and
        # moto); other fsspec stores get the best effort of read, compare, write
        self.conditional = bool({"s3", "s3a"} & set(protocols))
        self._create = create  # (a reader, ``create=False``, never makes a bucket)
        self._root_made = False

    def ensure_root(self) -> None:
        """The root, made before the first change (opening a store makes no request, so a
        manager can open while the store is down)."""
        if self._create and not self._root_made:
            self.fs.makedirs(self.root, exist_ok=True)
            self._root_made = True

    def _read_tagged(self, rel: str) -> tuple[bytes, Any] | None:
        if not self.conditional:
            return super()._read_tagged(rel)
        p = self.path(rel)
        self.fs.invalidate_cache(p)
        try:  # the ETag first: if the object changes before it is read, If-Match fails
            tag = self.fs.info(p).get("ETag")
            data = bytes(self.fs.cat_file(p))
        except FileNotFoundError:
            return None
        return data, tag

    def _write_if(self, rel: str, data: bytes, tag: Any) -> bool:
        if not self.conditional:
            return super()._write_if(rel, data, tag)
        p = self.path(rel)
        try:
            if tag is None:
                self.fs.pipe_file(p, data, mode="create")  # If-None-Match: *
            else:
                self.fs.pipe_file(p, data, IfMatch=tag)
        except FileExistsError:  # 412 on If-None-Match
            return False
        except OSError as e:  # 412 on If-Match (s3fs: EINVAL), 409 on a concurrent write
            if e.errno == errno.EINVAL or "recondition" in str(e) or "onflict" in str(e):
                return False
            raise
        finally:
            self.fs.invalidate_cache(p)
        return True

    def abort_multipart(self, step_prefix: str | None) -> list[str]:
        if not self.conditional:  # S3's API (s3fs); other stores have no such uploads
            return []
        bucket, _, key = self.root.partition("/")
        prefix = f"{key.strip('/')}/" if key.strip("/") else ""
        out: list[str] = []
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **args)
            for up in page.get("Uploads") or []:
                folder = up["Key"][len(prefix):].split("/", 1)[0]
                if parse_step(_base_name(folder), step_prefix) is None:
                    continue  # not in a step folder of this mirror: not ours
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                                UploadId=up["UploadId"])
                out.append(f"{up['Key']} (multipart upload {up['UploadId']}, aborted)")
            if not page.get("IsTruncated"):
                return out
            args.update(KeyMarker=page.get("NextKeyMarker"),
                        UploadIdMarker=page.get("NextUploadIdMarker"))

    def owned(self, rel: str) -> bool:
        """A step written in place is ours when its commit marker names a minickpt writer
        (one renamed into place: the lease is the only rule)."""
        return self.atomic_rename or self.owner(rel) is not None

    def owner(self, rel: str) -> dict[str, Any] | None:
        """The writer record in ``rel``'s commit marker; None without one (written by
        another tool, or by a minickpt older than the lease)."""
        try:
            text = self.get_bytes(f"{rel}/{COMMIT_SUCCESS_FILE}").decode("utf-8", "replace")
        except (FileNotFoundError, NotADirectoryError):
            return None
        for line in text.splitlines():
            if line.startswith(_OWNER_LINE):
                try:
                    rec = json.loads(line[len(_OWNER_LINE):])
                except ValueError:
                    return None
                return rec if isinstance(rec, dict) and "writer" in rec else None
        return None

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
        if self.atomic_rename:
            self.fs.makedirs(self.path(rel), exist_ok=True)

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(rel), data)  # one PUT: whole once it has succeeded

    def get_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel)))

    def remove_file(self, rel: str) -> None:
        self.fs.rm_file(self.path(rel))

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

    def new_upload(self, name: str, writer: Writer) -> str:
        """The folder a copy of ``name`` is written into, marked first: a temporary name
        (``atomic_rename``), or the final one (published by the commit marker)."""
        rel = f"{name}{TMP_MARK}{secrets.token_hex(4)}" if self.atomic_rename else name
        self.begin(rel, writer, "upload")
        return rel

    def commit(self, tmp: str, final: str, subdirs: list[str], writer: Writer | None = None
               ) -> None:
        """Publish a verified copy: rename it into place, or (written in place) write the
        commit marker, the last object of a checkpoint, naming its writer (Orbax's text on
        its first line); then drop the in-progress marker."""
        if tmp == final:
            owner = "" if writer is None else \
                f"{_OWNER_LINE}{writer.record('commit').decode()}\n"
            # create-if-absent: a step committed meanwhile by anyone is never replaced
            if not self._write_if(f"{final}/{COMMIT_SUCCESS_FILE}", (
                    f"Checkpoint commit was successful to {self.path(final)}\n"
                    + owner).encode(), None):
                raise FileExistsError(f"{self.path(final)} was committed by another writer "
                                      "meanwhile: never replaced")
        else:
            if self.exists(final):
                raise FileExistsError(f"{self.path(final)} already exists")
            self.fs.mv(self.path(tmp), self.path(final), recursive=True)
        self.end(final)

    def _rename(self, src: str, dst: str) -> None:
        self.fs.mv(self.path(src), self.path(dst), recursive=True)

    def _remove_files(self, rel: str) -> None:
        p = self.path(rel)
        self.fs.invalidate_cache(p)
        keep = self.path(f"{rel}/{UPLOAD_MARKER}")
        for f in self.fs.find(p):  # one by one: a bulk delete has no order
            if f.rstrip("/") != keep:
                self.fs.rm_file(f)

    def _remove_dir(self, rel: str) -> None:
        p = self.path(rel)
        if self.fs.exists(p):  # a directory (local, memory): no keys left to imply it
            self.fs.rm(p, recursive=True)

    def abort_upload(self, tmp: str, writer: Writer) -> None:
        """Remove this writer's own failed upload; never raises (the error matters more)."""
        try:
            self.reclaim(tmp, writer)
        except Exception:
            pass


def open_store(target: Any) -> LocalStore | FsspecStore:
    """A store for a path, a ``file://`` URL (both: :class:`LocalStore`), another fsspec URL,
    or a store object given as it is."""
    if isinstance(target, MirrorStore):
        return target  # type: ignore[return-value]
    target = os.fspath(target)
    if target.startswith("file://"):
        return LocalStore(target[len("file://"):])
    if "://" in target:
        return FsspecStore(target)
    return LocalStore(target)


# ---------------------------------------------------------------------------------------
# copying a step: up to the mirror, and back
# ---------------------------------------------------------------------------------------
def read_chunks(fs: FileSystem, path: str) -> Iterator[bytes]:
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
