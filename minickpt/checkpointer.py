"""One checkpoint on disk: its items, its metadata, saving, reading and verifying it.

:class:`Checkpointer` is minickpt's counterpart of Orbax's ``StandardCheckpointer``: it saves
named items into one directory with the atomic durable commit, and restores them. The
:class:`~minickpt.manager.CheckpointManager` adds steps, policies and retention on top.

Layout of one checkpoint::

    step_100/
      _CHECKPOINT_METADATA   JSON: step, times, metrics, your metadata, and per item the
                             manifest's checksum and data size (checked on restore)
      params/                one directory per item (see minickpt.format)
        manifest.json
        data.bin
      opt_state/ ...
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import stat
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .commit import METADATA_FILE, abort, commit, make_temporary
from .errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    FormatVersionError,
    MiniCkptError,
    StepAlreadyExistsError,
    UnsafeCheckpointError,
    UnsupportedLeafError,
)
from .format.encode import ItemPlan, ItemWriteResult, check_manifest_fits, plan_item, write_item
from .format.manifest import Manifest, parse_json, read_manifest
from .format.manifest import check_data as check_data_file
from .format.read import read_leaves
from .format.regions import check_shards
from .format.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAX_FORMAT_VERSION,
    check_name,
    json_text,
)
from .fs import DEFAULT_FS, FileSystem, SyncBatch
from .gitinfo import git_info
from .restore import restore_item
from .version import __version__

MAX_METADATA_BYTES = 16 << 20


@dataclass
class SaveStats:
    """Where a save's time went. ``blocking_s`` is what the caller waited for.

    For an async save, ``blocking_s`` (= ``wait_s`` for the previous save + ``snapshot_s`` +
    starting the writer) is the training loop's pause, and ``total_s`` runs from the call of
    ``save()`` to the end of the commit and retention in the background. ``start_time`` is the
    wall-clock time of that call, so ``[start_time, +blocking_s]`` and ``[+blocking_s, +total_s]``
    place both phases on a timeline.
    """

    step: int | None
    path: str
    bytes: int = 0
    num_leaves: int = 0
    wait_s: float = 0.0  # waiting for the previous (async) save to finish
    snapshot_s: float = 0.0  # device -> host, and the layout plan
    write_s: float = 0.0  # writing data and manifests (excluding their fsyncs)
    fsync_s: float = 0.0  # fsyncing files and item directories
    commit_s: float = 0.0  # metadata, fsync of the directory, rename, fsync of the parent
    barrier_s: float = 0.0  # multi-host: waiting for the other processes
    retention_s: float = 0.0
    total_s: float = 0.0
    blocking_s: float = 0.0
    async_: bool = False
    ok: bool = True
    error: str | None = None
    start_time: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["async"] = d.pop("async_")
        return d


@dataclass
class CheckpointMetadata:
    """The checkpoint-level metadata, as read back from ``_CHECKPOINT_METADATA``."""

    step: int | None
    items: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None
    custom_metadata: dict[str, Any] = field(default_factory=dict)
    init_timestamp_nsecs: int | None = None
    commit_timestamp_nsecs: int | None = None
    writer: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # the checkpoint directory's link count when the metadata was read: 2 + its
    # sub-directories where the file system counts them (ext4, XFS, tmpfs, NFS ...)
    dir_links: int | None = field(default=None, repr=False, compare=False)

    @property
    def time(self) -> float | None:
        """Commit time in seconds since the epoch."""
        t = self.commit_timestamp_nsecs
        return None if t is None else t / 1e9

    @property
    def bytes(self) -> int:
        return sum(int(i.get("data_bytes", 0)) + int(i.get("shard_bytes", 0))
                   for i in self.items.values())


def _json_safe(obj: Any, what: str) -> Any:
    """Check user metadata/metrics are plain JSON (so a checkpoint never needs pickle)."""
    try:
        text = json.dumps(obj, allow_nan=True, default=_np_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): "
                        f"{e}") from e
    return json.loads(text)


def _np_default(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic) or (hasattr(x, "shape") and getattr(x, "shape", None) == ()):
        return np.asarray(x).item()
    raise TypeError(f"{type(x).__name__} is not JSON")


def writer_info() -> dict[str, Any]:
    import jax

    info: dict[str, Any] = {"minickpt": __version__, "jax": jax.__version__,
                            "python": platform.python_version(), "host": platform.node(),
                            "pid": os.getpid()}
    try:
        info["process_count"] = jax.process_count()
    except Exception:  # distributed runtime not usable here; not fatal for metadata
        pass
    git = git_info()  # which code wrote this (never raises)
    if git is not None:
        info["git"] = git
    return info


# room in the metadata file for what minickpt adds to the caller's metrics and metadata
# (items' records, writer, times, checksum): far more than it takes
_METADATA_RESERVE = 1 << 20


def check_save_args(step: Any, metrics: Any, custom_metadata: Any) -> None:
    """Refuse, before anything is written, what :func:`read_metadata` would refuse or drop:
    a step that is not an int, metrics or metadata that are not mappings (a reader keeps
    only dicts), or that are not plain JSON, or that with the rest could not fit in the
    :data:`MAX_METADATA_BYTES` a restore reads — such a checkpoint would commit and then be
    called damaged by every restore."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ValueError(f"step must be an int (or None), got {step!r}: a restore would "
                         "call the checkpoint damaged")
    size = 0
    for what, value in (("metrics", metrics), ("metadata", custom_metadata)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}= must be a mapping (a dict of names to values), got "
                            f"{type(value).__name__}: a restore keeps only a dict, so it "
                            "would be lost")
        if not value and what == "metadata":
            continue
        size += len(json_text(_json_safe(value, what)).encode())
    if size + _METADATA_RESERVE > MAX_METADATA_BYTES:
        raise ValueError(
            f"metrics and metadata= take {size / 2**20:.1f} MiB as JSON; a restore reads at "
            f"most {MAX_METADATA_BYTES >> 20} MiB of a checkpoint's metadata "
            f"(MAX_METADATA_BYTES), {_METADATA_RESERVE >> 20} MiB of it kept for minickpt's "
            "own fields, so the checkpoint could never be restored: nothing was written. "
            "Save large data as an item (an array), not as metadata")


def metadata_bytes(step: int | None, items: Mapping[str, Any], *, metrics: Any = None,
                   custom_metadata: Any = None, init_ns: int | None = None,
                   format_version: int = FORMAT_VERSION) -> bytes:
    meta = {
        "format": FORMAT_NAME,
        "format_version": format_version,
        "step": step,
        "init_timestamp_nsecs": init_ns,
        "commit_timestamp_nsecs": time.time_ns(),
        "items": dict(items),
        "metrics": _json_safe(metrics, "metrics") if metrics is not None else None,
        "custom_metadata": _json_safe(custom_metadata, "metadata") if custom_metadata else {},
        "writer": writer_info(),
    }
    raw = encode_metadata(meta)
    if len(raw) > MAX_METADATA_BYTES:  # checked before the save began: a guard
        raise ValueError(f"the metadata of step {step} is {len(raw)} bytes, over the "
                         f"{MAX_METADATA_BYTES} a restore reads (MAX_METADATA_BYTES): "
                         "not committed")
    return raw


_CRC_KEY = "metadata_crc32"
_CRC_FIELD = b'"' + _CRC_KEY.encode() + b'":'


def encode_metadata(meta: Mapping[str, Any]) -> bytes:
    """The metadata as JSON, ending with the CRC-32 of every byte before that last field.

    The manifests' checksums are recorded in the metadata, but nothing would check the
    metadata itself: a flipped bit in a metric would silently change which checkpoint is the
    best, one in the step would move a checkpoint in time. The field is plain JSON, so any
    reader can ignore it.

    One top-level key per line, each value compact: as readable as ``indent=1`` for the
    handful of fields people look at, and built by json's C encoder instead of its
    pure-Python indenting one.
    """
    head = ("{\n" + ",\n".join(f"{json_text(k)}: {json_text(v)}"
                                for k, v in meta.items() if k != _CRC_KEY)).encode()
    return head + b",\n" + _CRC_FIELD + f" {zlib.crc32(head)}\n}}\n".encode()


def _check_metadata_crc(raw: bytes, obj: dict[str, Any], mpath: str) -> None:
    if _CRC_KEY not in obj:  # written before minickpt recorded it: nothing to check
        return
    want = obj[_CRC_KEY]
    # the checksum covers every byte before the comma that precedes its field (whatever the
    # white space: metadata written with indent=1 carries it too)
    at = raw.rfind(_CRC_FIELD)
    head = raw[:at].rstrip(b" \t\r\n") if at >= 0 else b""
    got = zlib.crc32(head[:-1]) if head.endswith(b",") else None
    if not isinstance(want, int) or isinstance(want, bool) or got != want:
        raise CheckpointCorruptedError(mpath, f"metadata checksum {got!r} differs from the one "
                                              f"it records ({want!r}): it was changed or "
                                              "damaged")


def read_metadata(fs: FileSystem, path: str, *, step: int | None = None) -> CheckpointMetadata:
    """Read and validate a checkpoint's ``_CHECKPOINT_METADATA``.

    ``step``, when given, is the step the directory's name stands for; metadata naming
    another step means the checkpoint was moved or its metadata swapped.
    """
    mpath = os.path.join(path, METADATA_FILE)
    try:
        st = fs.lstat(path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"no checkpoint at {path}") from e
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCheckpointError(path, "the checkpoint directory is a symbolic link; "
                                          "refusing to follow it out of its parent")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: not a directory")
    try:
        raw = fs.read_file(mpath, MAX_METADATA_BYTES)
    except FileNotFoundError as e:
        if not fs.is_dir(path):
            raise CheckpointNotFoundError(f"no checkpoint at {path} (it was deleted)") from e
        raise CheckpointCorruptedError(mpath, "checkpoint metadata is missing (the save never "
                                              "committed, or the file was deleted)") from e
    except ValueError as e:
        raise CheckpointCorruptedError(mpath, str(e)) from e
    obj = parse_json(raw, mpath, "metadata")
    if isinstance(obj, dict):  # checksum first: a flipped byte in "format" or its version is
        _check_metadata_crc(raw, obj, mpath)  # damage, not another format to leave alone
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatVersionError(mpath, "not a minickpt checkpoint")
    v = obj.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_FORMAT_VERSION:
        raise FormatVersionError(mpath, f"format version {v!r} is not one this minickpt reads "
                                        f"(1..{MAX_FORMAT_VERSION}); upgrade minickpt")
    items = obj.get("items")
    if not isinstance(items, dict) or not items \
            or not all(isinstance(i, dict) for i in items.values()):
        raise CheckpointCorruptedError(mpath, "metadata lists no items")
    for name in items:
        try:
            check_name(name)
        except ValueError as e:
            raise UnsafeCheckpointError(mpath, str(e)) from e
    saved_step = obj.get("step")
    if saved_step is not None and (not isinstance(saved_step, int)
                                   or isinstance(saved_step, bool)):
        raise CheckpointCorruptedError(mpath, f"step {saved_step!r} is not an int")
    if step is not None and saved_step is not None and saved_step != step:
        raise CheckpointCorruptedError(mpath, f"the metadata is step {saved_step}'s but the "
                                              f"directory is step {step}'s: the checkpoint was "
                                              "moved, or its metadata swapped")
    metrics = obj.get("metrics")
    custom = obj.get("custom_metadata") or {}
    return CheckpointMetadata(step=saved_step, items=items,
                              metrics=metrics if isinstance(metrics, dict) else None,
                              custom_metadata=custom if isinstance(custom, dict) else {},
                              init_timestamp_nsecs=obj.get("init_timestamp_nsecs"),
                              commit_timestamp_nsecs=obj.get("commit_timestamp_nsecs"),
                              writer=obj.get("writer") or {}, format_version=v,
                              dir_links=st.st_nlink)


def save_error(e: OSError, directory: str) -> OSError:
    """The error a failed save raises: the same errno (and OSError subclass), saying which
    checkpoint failed and that nothing was committed; ENOSPC and EDQUOT say what to do."""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = (" The disk is full: free space, lower max_to_keep, or save elsewhere; the "
                "checkpoints already there are untouched.")
    reason = e.strerror or str(e)
    msg = (f"{reason}: could not save checkpoint {directory}; nothing was committed and no "
           f"temporary directory is left.{hint}")
    if e.errno is None:
        return OSError(msg)
    return OSError(e.errno, msg, e.filename, None, e.filename2)


@dataclass
class VerifyReport:
    """The result of verifying one checkpoint: ``ok``, and every problem found."""

    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    items: dict[str, int] = field(default_factory=dict)  # item -> number of leaves checked
    bytes_checked: int = 0

    def __bool__(self) -> bool:
        return self.ok


class Checkpointer:
    """Saves and restores named items in one checkpoint directory (like Orbax's
    ``StandardCheckpointer``, with several items and an atomic, durable commit)."""

    def __init__(self, fs: FileSystem | None = None):
        self.fs = fs or DEFAULT_FS

    # ---- saving ------------------------------------------------------------------------
    def plan(self, items: Mapping[str, Any], *, copy: bool = False,
             executor: Executor | None = None, pin: bool = False,
             stream: bool = False) -> dict[str, ItemPlan]:
        """The snapshot phase: every item brought to the host and laid out.

        ``copy=True`` makes it a true snapshot that later mutation, deletion or donation of
        the arrays cannot change (what an async save needs); ``executor`` copies large leaves
        in parallel threads; ``pin=True`` lets CPU arrays be pinned zero-copy views instead
        of copies, where JAX allows it (:func:`minickpt.tree.pinned_view`). ``stream=True``
        (the synchronous save) checks every leaf and starts every transfer, but leaves a
        large item's device arrays to :meth:`write`, which writes each as soon as its
        transfer is done (:func:`minickpt.format.encode.plan_item`).
        """
        if not isinstance(items, Mapping) or not items:
            raise TypeError("items must be a non-empty mapping of item name to pytree, "
                            "e.g. {'params': params, 'opt_state': opt_state}")
        plans = {}
        for name, tree in items.items():
            try:
                plans[check_name(str(name))] = plan_item(tree, copy=copy, executor=executor,
                                                         pin=pin, stream=stream)
            except UnsupportedLeafError as e:
                raise UnsupportedLeafError(f"item '{name}': {e}") from None
            check_manifest_fits(str(name), plans[str(name)])
        return plans

    def save(self, directory: str | os.PathLike[str], items: Mapping[str, Any], *,
             step: int | None = None, metrics: Mapping[str, Any] | None = None,
             custom_metadata: Mapping[str, Any] | None = None) -> SaveStats:
        """Save ``items`` as the checkpoint ``directory`` (which must not exist yet)."""
        t0 = time.perf_counter()
        init_ns = time.time_ns()
        directory = os.fspath(directory)
        check_save_args(step, metrics, custom_metadata)
        try:
            exists = self.fs.exists(directory)
        except OSError as e:
            raise save_error(e, directory) from e
        if exists:
            raise StepAlreadyExistsError(f"{directory} already exists: minickpt never "
                                         "replaces a committed checkpoint")
        plans = self.plan(items, stream=True)  # the writer waits for each transfer
        stats = SaveStats(step, directory, start_time=init_ns / 1e9)
        stats.snapshot_s = time.perf_counter() - t0
        self.write(directory, plans, step=step, metrics=metrics,
                   custom_metadata=custom_metadata, stats=stats, init_ns=init_ns)
        stats.total_s = stats.blocking_s = time.perf_counter() - t0
        return stats

    def write(self, directory: str, plans: Mapping[str, ItemPlan], *, step: int | None,
              metrics: Mapping[str, Any] | None = None,
              custom_metadata: Mapping[str, Any] | None = None,
              stats: SaveStats | None = None, init_ns: int | None = None,
              release: bool = False) -> SaveStats:
        """The write phase: items into a temporary directory, then the commit.

        Used by the synchronous save, by the background writer and by the primary process of
        a multi-host save. On any error the temporary directory is removed and nothing
        changes under the final name. ``release=True`` drops each item's buffers once its
        bytes are written (before the fsyncs): an async snapshot's copies are freed, and its
        pinned views unpinned, as early as possible.
        """
        fs = self.fs
        stats = stats or SaveStats(step, directory, start_time=time.time())
        root, final_name = os.path.split(os.path.abspath(directory))
        try:
            if not fs.is_dir(root):
                raise CheckpointNotFoundError(f"parent directory {root} does not exist")
            tmp = make_temporary(fs, root, final_name)
        except OSError as e:
            if isinstance(e, MiniCkptError):
                raise
            raise save_error(e, directory) from e
        batch = SyncBatch(fs)  # every file and directory below, fsynced together at commit
        try:
            records = {}
            for name, res in _write_items(fs, tmp, plans, batch, release, stats).items():
                stats.bytes += res.data_bytes
                stats.num_leaves += res.num_leaves
                records[name] = {"manifest_crc32": res.manifest_crc32,
                                 "data_bytes": res.data_bytes, "num_leaves": res.num_leaves}
            t = time.perf_counter()
            raw = metadata_bytes(step, records, metrics=metrics, custom_metadata=custom_metadata,
                                 init_ns=init_ns)
            fs.write_file(os.path.join(tmp, METADATA_FILE), [raw], batch=batch)
            commit(fs, tmp, os.path.join(root, final_name), sync=batch)
            stats.fsync_s += batch.flush_s
            stats.commit_s = time.perf_counter() - t - batch.flush_s
        except BaseException as e:
            try:
                batch.close()  # descriptors not yet flushed (like write_file's own finally)
            except OSError:
                pass
            if isinstance(e, Exception):
                abort(fs, tmp)
            stats.ok, stats.error = False, f"{type(e).__name__}: {e}"
            if isinstance(e, OSError) and not isinstance(e, MiniCkptError) \
                    and not _renamed(fs, os.path.join(root, final_name)):
                raise save_error(e, directory) from e
            raise
        return stats

    # ---- reading -----------------------------------------------------------------------
    def metadata(self, directory: str | os.PathLike[str], *, step: int | None = None
                 ) -> CheckpointMetadata:
        """The checkpoint's metadata; ``step``: the step its directory name stands for."""
        return read_metadata(self.fs, os.fspath(directory), step=step)

    def manifest(self, directory: str | os.PathLike[str], item: str,
                 meta: CheckpointMetadata | None = None, *,
                 check_data: bool = True) -> Manifest:
        """An item's validated manifest, checked against what the metadata recorded at commit
        (the manifest's checksum, the item's data size and number of leaves).
        ``check_data=False``: the data file's own checks are made by the read that opens it
        (:func:`minickpt.format.manifest.open_data`), not by a lookup of their own here."""
        directory = os.fspath(directory)
        meta = meta or self.metadata(directory)
        if item not in meta.items:
            raise KeyError(f"checkpoint {directory} has no item {item!r} "
                           f"(it has {sorted(meta.items)})")
        item_dir = os.path.join(directory, check_name(item))
        if not self.fs._known_dir(item_dir):  # within a restore: its open said so (issue 51)
            try:
                st = self.fs.lstat(item_dir)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise UnsafeCheckpointError(item_dir, "the item directory is a symbolic "
                                                      "link; refusing to follow it")
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise CheckpointCorruptedError(item_dir, "item directory is missing or not a "
                                                         "directory")
        rec = meta.items[item]
        crc = rec.get("manifest_crc32")
        m = read_manifest(self.fs, item_dir, expected_crc32=crc if isinstance(crc, int) else None,
                          check_data=check_data)
        try:
            _check_against_metadata(m, rec, item_dir)
        except CheckpointCorruptedError:
            check_data_file(self.fs, m)  # the data file's own damage first, as it always was
            raise
        return m


    def unlisted_items(self, directory: str | os.PathLike[str],
                       meta: CheckpointMetadata) -> list[str]:
        """Item directories (holding a manifest) that the metadata does not list: their data
        would silently go missing from a restore, so they mean the metadata is damaged."""
        directory = os.fspath(directory)
        out = []
        for name in sorted(_listdir(self.fs, directory)):
            if name in meta.items or name == METADATA_FILE:
                continue
            path = os.path.join(directory, name)
            if self.fs.is_dir(path) and self.fs.exists(os.path.join(path, MANIFEST_FILE)):
                out.append(name)
        return out

    def check_listed(self, directory: str, meta: CheckpointMetadata,
                     unlisted: list[str] | None = None) -> None:
        """Raise :class:`CheckpointCorruptedError` if an item directory is not in ``meta``
        (``unlisted``: :meth:`unlisted_items`, when the caller has it already)."""
        extra = self.unlisted_items(directory, meta) if unlisted is None else unlisted
        if extra:
            raise CheckpointCorruptedError(
                os.path.join(directory, extra[0]),
                f"item director{'ies' if len(extra) > 1 else 'y'} {extra} not listed in "
                f"{METADATA_FILE} (it lists {sorted(meta.items)}): the metadata is damaged")

    def restore(self, directory: str | os.PathLike[str], target: Mapping[str, Any] | None = None,
                *, partial: bool = False, verify: bool = True, sharding: Any = None,
                step: int | None = None) -> dict[str, Any]:
        """Restore items: all of them without a target, else those named in ``target``.

        ``target`` maps item names to target trees; a ``None`` value restores that item
        without a target (numpy arrays in nested dicts; a typed PRNG key as a
        :class:`~minickpt.tree.HostKey`, which ``.to_jax()`` makes a key again). ``step``: the
        step the directory's name stands for, checked against the metadata.
        """
        directory = os.fspath(directory)
        with self.fs.anchored(directory):  # its files found from its descriptor: issue 51
            return self._restore(directory, target, partial, verify, sharding, step)

    def _restore(self, directory: str, target: Mapping[str, Any] | None, partial: bool,
                 verify: bool, sharding: Any, step: int | None) -> dict[str, Any]:
        meta = self.metadata(directory, step=step)
        names = list(meta.items) if target is None else list(target)
        if verify and not _no_other_dirs(meta, names):
            self.check_listed(directory, meta)
        missing = [n for n in names if n not in meta.items]
        if missing:
            raise KeyError(f"checkpoint {directory} has no item(s) {missing} "
                           f"(it has {sorted(meta.items)})")
        def one(name: str) -> Any:
            m = self.manifest(directory, name, meta, check_data=False)  # checked as it opens
            t = None if target is None else target[name]
            return restore_item(self.fs, m, t, item=name, partial=partial, verify=verify,
                                sharding=sharding)

        workers = _item_workers(meta, names)
        if workers <= 1:
            return {name: one(name) for name in names}
        # several items with data to read: each read (and put on its devices) by its own
        # thread, so that one item's transfers overlap the next one's reads; the results
        # are taken in item order, so the first item that fails is the one reported
        with ThreadPoolExecutor(workers, thread_name_prefix="minickpt-item") as pool:
            futures = {name: pool.submit(one, name) for name in names}
            try:
                return {name: futures[name].result() for name in names}
            except BaseException:
                for f in futures.values():
                    f.cancel()
                raise

    def verify(self, directory: str | os.PathLike[str], *, deep: bool = True,
               step: int | None = None) -> VerifyReport:
        """Check a checkpoint without restoring it: metadata, manifests, sizes, and (when
        ``deep``) every leaf's checksum. Never raises for damage; lists it instead."""
        directory = os.fspath(directory)
        report = VerifyReport(directory, ok=True)
        try:
            meta = self.metadata(directory, step=step)
        except (MiniCkptError, OSError) as e:
            report.ok = False
            report.problems.append(str(e))
            return report
        for name in meta.items:
            try:
                m = self.manifest(directory, name, meta)
                if deep:  # sharded leaves one shard at a time, the others as before
                    read_leaves(self.fs, m, [i for i, e in enumerate(m.entries)
                                             if not e.get("sharded")], verify=True)
                    check_shards(self.fs, m)
                    report.bytes_checked += m.leaf_bytes()
                report.items[name] = len(m.entries)
            except (MiniCkptError, OSError, KeyError) as e:
                report.ok = False
                report.problems.append(str(e))
        unlisted = self.unlisted_items(directory, meta)
        try:
            self.check_listed(directory, meta, unlisted)
        except CheckpointCorruptedError as e:
            report.ok = False
            report.problems.append(str(e))
        extra = (set(_listdir(self.fs, directory)) - set(meta.items) - {METADATA_FILE}
                 - set(unlisted))
        for name in sorted(extra):
            report.problems.append(f"{os.path.join(directory, name)}: not part of the "
                                   "checkpoint (ignored)")
        return report


def _write_one(fs: FileSystem, tmp: str, name: str, plan: ItemPlan, sync: SyncBatch,
               release: bool) -> ItemWriteResult:
    item_dir = os.path.join(tmp, name)
    fs.mkdir(item_dir)
    res = write_item(fs, item_dir, plan, sync=sync)
    if release:
        plan.buffers[:] = [None] * len(plan.buffers)
    return res


def _write_items(fs: FileSystem, tmp: str, plans: Mapping[str, ItemPlan], batch: SyncBatch,
                 release: bool, stats: SaveStats) -> dict[str, ItemWriteResult]:
    """Each item's directory and files under ``tmp``, their fsyncs left to ``batch``.

    Several items holding :data:`_ITEMS_IN_THREADS_FROM` bytes or more together are written
    up to :data:`_ITEM_THREADS` at a time, as a restore reads them: one item's file is
    written by one stream (buffered below 32 MiB), which left a 400 MB save as 50 items at
    half the disk's write limit while the same bytes as one item reached it. Each writer
    hands its files to a batch of its own; they join ``batch`` in item order once every
    item is written, so the fsyncs are still one round, and the first item that failed in
    the checkpoint's order is the error raised (the others' descriptors are closed)."""
    names = list(plans)
    total = sum(p.nbytes for p in plans.values())
    workers = min(_ITEM_THREADS, len(names), os.cpu_count() or 1)
    t = time.perf_counter()
    # each threaded item keeps its two files open until the batch's flush: at most half
    # the batch's descriptors, so a checkpoint of hundreds of items is written in turn
    if workers < 2 or total < _ITEMS_IN_THREADS_FROM \
            or len(batch.fds) + 2 * len(names) > batch.MAX_OPEN:
        out = {}
        for name in names:
            res = out[name] = _write_one(fs, tmp, name, plans[name], batch, release)
            stats.write_s += res.write_s
        return out
    subs = {name: SyncBatch(fs) for name in names}
    for sub in subs.values():
        sub.MAX_OPEN = 1 << 30  # flushed by ``batch``, never on its own from a thread
    with ThreadPoolExecutor(workers, thread_name_prefix="minickpt-write") as pool:
        futures = {name: pool.submit(_write_one, fs, tmp, name, plans[name], subs[name],
                                     release) for name in names}
        try:
            out = {name: futures[name].result() for name in names}
        except BaseException:
            for f in futures.values():
                f.cancel()
            for f in futures.values():  # every writer done before their descriptors close
                if not f.cancelled():
                    f.exception()
            for sub in subs.values():
                sub.close()
            raise
    for name in names:
        batch.fds += subs[name].fds
        batch.dirs += subs[name].dirs
    stats.write_s += time.perf_counter() - t
    return out


_ITEMS_IN_THREADS_FROM = 8 << 20  # data bytes of a restore's (or a save's) items together
_ITEM_THREADS = 4


def _check_against_metadata(m: Manifest, rec: Mapping[str, Any], item_dir: str) -> None:
    """An item's manifest against what the metadata recorded for it at commit."""
    if isinstance(rec.get("data_bytes"), int) and rec["data_bytes"] != m.data_bytes:
        raise CheckpointCorruptedError(item_dir, f"item holds {m.data_bytes} bytes, the "
                                                 f"metadata says {rec['data_bytes']}")
    shard_bytes = m.stored_bytes - m.data_bytes
    if isinstance(rec.get("shard_bytes"), int) and rec["shard_bytes"] != shard_bytes:
        raise CheckpointCorruptedError(item_dir, f"item holds {shard_bytes} bytes in shard "
                                                 "files, the metadata says "
                                                 f"{rec['shard_bytes']}")
    if isinstance(rec.get("num_leaves"), int) and rec["num_leaves"] != len(m.entries):
        raise CheckpointCorruptedError(item_dir, f"item holds {len(m.entries)} leaves, the "
                                                 f"metadata says {rec['num_leaves']}")


def _item_workers(meta: CheckpointMetadata, names: list[str]) -> int:
    """How many items a restore reads at once: one at a time for a single item or a small
    checkpoint (threads cost more than they save there); else up to :data:`_ITEM_THREADS`."""
    if len(names) < 2:
        return 1
    sizes = [meta.items[n].get("data_bytes") for n in names]
    total = sum(b for b in sizes if isinstance(b, int) and b > 0)
    if total < _ITEMS_IN_THREADS_FROM:
        return 1
    return max(1, min(_ITEM_THREADS, len(names), os.cpu_count() or 1))


def _no_other_dirs(meta: CheckpointMetadata, names: list[str]) -> bool:
    """Whether the directory's link count alone shows that it holds no item directory
    the metadata does not list, so that :meth:`Checkpointer.check_listed` need not list
    it: every listed item is being read (and each read checks that its directory is one),
    and there are exactly as many sub-directories as listed items. A file system that does
    not count sub-directories (btrfs, many FUSE ones: 1 or 2 whatever they hold) never
    matches, and the directory is listed as before."""
    n = len(meta.items)
    return meta.dir_links == 2 + n and len(names) >= n and set(meta.items) <= set(names)


def _renamed(fs: FileSystem, final_dir: str) -> bool:
    """Whether a failed save got as far as its rename (only its last fsync failed)."""
    try:
        return fs.is_dir(final_dir)
    except OSError:
        return False


def _listdir(fs: FileSystem, path: str) -> list[str]:
    try:
        return fs.listdir(path)
    except OSError:
        return []


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    units = ["KiB", "MiB", "GiB", "TiB"]
    e = min(int(math.log(n, 1024)), len(units))
    return f"{n / 1024**e:.1f} {units[e - 1]}"
