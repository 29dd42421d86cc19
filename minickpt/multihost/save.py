"""The collective save: agree and snapshot in the caller's thread (:func:`prepare_save`),
then the two-barrier commit (Task 4.3, :class:`CollectiveSave`), with failures reported to
every process."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checkpointer import Checkpointer, SaveStats, _renamed, metadata_bytes, save_error
from ..commit import METADATA_FILE, TMP_MARK, abort, commit
from ..errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    MiniCkptError,
    MultiHostError,
    PeerTimeoutError,
    StepAlreadyExistsError,
    UnsupportedLeafError,
    _ranges,
)
from ..format.encode import ItemData, write_item_data, write_item_manifest
from ..format.shards import write_shards
from ..format.spec import FORMAT_VERSION, SHARDED_FORMAT_VERSION, check_name
from ..fs import SyncBatch
from .ownership import ProcessItemPlan, plan_for_process, tree_signature
from .sync import Sync, agree, agree_on_step, fault_point

log = logging.getLogger("minickpt")


@dataclass(frozen=True)
class MultiHostOptions:
    """How a multi-process save and restore behave (ignored on a single process).

    ``timeout_s`` bounds every barrier: the slowest process's write must fit in it, and it
    should stay below JAX's ``heartbeat_timeout_seconds`` (100 s by default) so that a dead
    peer is reported as an error before the runtime aborts the job. ``primary_host`` is
    Orbax's name for the process that writes metadata and commits. ``primary_only``: see
    :mod:`minickpt.multihost` (replicated state saved by the primary, broadcast on restore).
    """

    timeout_s: float = 60.0
    primary_host: int = 0
    primary_only: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.primary_host, int) or self.primary_host < 0:
            raise ValueError(f"primary_host must be an int >= 0, got {self.primary_host!r}")


def failure_status(e: BaseException | None = None, **extra: Any) -> dict[str, Any]:
    if e is None:
        return {"ok": True, **extra}
    return {"ok": False, "type": type(e).__name__, "message": str(e),
            "errno": getattr(e, "errno", None),
            # only verified damage: an I/O error (EIO ...) says nothing about the checkpoint,
            # so a restore raises it rather than falling back past a valid step
            "damage": isinstance(e, CheckpointCorruptedError)
            and not isinstance(e, (CheckpointNotFoundError, PeerTimeoutError, MultiHostError))}


def describe_failures(statuses: Mapping[int, Mapping[str, Any]]) -> str:
    """``"processes 0-2: OSError: ...; process 3: ..."``: identical failures said once."""
    groups: dict[tuple[Any, Any], list[int]] = {}
    for p, st in sorted(statuses.items()):
        groups.setdefault((st.get("type"), st.get("message")), []).append(p)
    return "; ".join(f"process{'es' if len(ps) > 1 else ''} {_ranges(ps)}: {t}: {m}"
                     for (t, m), ps in groups.items())


def remote_failure(statuses: Mapping[int, Mapping[str, Any]], what: str, *,
                   reading: bool = False) -> MiniCkptError:
    """One error for failures reported by other processes, naming each process and why.

    When ``reading`` and every failure was damage on disk, it is a
    :class:`CheckpointCorruptedError`, so that a restore falls back to an older step.
    """
    msg = f"{what} failed on {describe_failures(statuses)}"
    first = statuses[min(statuses)]
    if first.get("type") == "StepAlreadyExistsError":
        return StepAlreadyExistsError(first.get("message"))
    if reading and all(st.get("damage") for st in statuses.values()):
        return CheckpointCorruptedError(f"process {min(statuses)}", msg)
    err = MultiHostError(msg)
    # the errno of the first process that failed with one (ENOSPC on a peer's disk, say)
    err.errno = next((st["errno"] for _, st in sorted(statuses.items())
                      if isinstance(st.get("errno"), int)), None)
    return err


def raise_failures(statuses: Sequence[Any] | Mapping[int, Any], me: int,
                    local: BaseException | None, what: str, *, reading: bool = False) -> None:
    """Raise if any process reported a failure: this process's own exception (with the
    others' noted), or one error naming every failed process."""
    by_process = statuses if isinstance(statuses, Mapping) else dict(enumerate(statuses))
    bad = {p: st for p, st in by_process.items() if not (st or {}).get("ok", False)}
    if not bad:
        return
    if local is not None:
        others = {p: st for p, st in bad.items() if p != me}
        if others:
            local.add_note(str(remote_failure(others, what)))
        raise local
    raise remote_failure(bad, what, reading=reading)


_WAITS = {  # the barriers of a collective save, and what a process waits for there
    "created": "waiting for every process to start writing (the primary creates "
               "the temporary directory)",
    "written": "waiting for every process to write its shards",
    "committed": "waiting for the commit",
}


@dataclass
class CollectiveSave:
    """One collective save after its snapshot: :meth:`run` writes and commits it.

    ``run`` may be called in a background thread (the async manager does): it only uses
    the file system and :meth:`Sync.exchange`. ``on_commit`` runs on the primary right
    after the rename (the manager's bookkeeping and retention's decision) and returns what
    the other processes must learn; ``on_done`` runs on the others with it. ``after_commit``
    runs on the primary once the last barrier is passed (removing the files of the steps
    retention retired): the others do not wait for it.
    """

    checkpointer: Checkpointer
    sync: Sync
    op: str
    directory: str
    step: int
    token: str
    plans: dict[str, ProcessItemPlan]
    options: MultiHostOptions
    stats: SaveStats
    metrics: Mapping[str, Any] | None = None
    custom_metadata: Mapping[str, Any] | None = None
    init_ns: int | None = None
    on_commit: Callable[[SaveStats], Mapping[str, Any]] | None = None
    on_done: Callable[[Mapping[str, Any]], None] | None = None
    after_commit: Callable[[], None] | None = None
    committed: bool = field(default=False, init=False)  # renamed: the step is published
    _primary_data: dict[str, ItemData] = field(default_factory=dict, init=False, repr=False)

    @property
    def primary(self) -> bool:
        return self.sync.process_index == self.options.primary_host

    def _exchange(self, phase: str, value: Any, what: str) -> list[Any]:
        t = time.perf_counter()
        try:
            return self.sync.exchange(f"{self.op}/{phase}", value, self.options.timeout_s,
                                      f"save of step {self.step}: {what}")
        finally:
            self.stats.barrier_s += time.perf_counter() - t

    def run(self) -> SaveStats:
        """Write this process's part of the save and commit it: :func:`two_barrier_commit`
        with this save's steps (:meth:`create`, :meth:`write`, :meth:`commit`,
        :meth:`barrier`)."""
        t0 = time.perf_counter()
        stats = self.stats
        try:
            two_barrier_commit(self)
        except BaseException as e:
            stats.ok, stats.error = False, f"{type(e).__name__}: {e}"
            if not isinstance(e, Exception) and self.primary and not self.committed:
                abort(self.checkpointer.fs, self.tmp)  # interrupted: nothing is published
            raise
        finally:
            stats.total_s += time.perf_counter() - t0
        return stats

    @property
    def tmp(self) -> str:
        """The temporary directory the save is written into (renamed by the commit)."""
        root, name = os.path.split(os.path.abspath(self.directory))
        return os.path.join(root, f"{name}{TMP_MARK}{self.token}")

    def create(self) -> None:
        """The primary's first step: the temporary directory and one directory per item."""
        fs = self.checkpointer.fs
        fs.mkdir(self.tmp)
        for item in self.plans:
            fs.mkdir(os.path.join(self.tmp, item))

    def write(self) -> dict[str, Any]:
        """Write this process's shards (the primary also the leaves only it writes) and fsync
        them; returns, by item, the record of its shard files for the primary's manifest."""
        fault_point(self.sync, "before_write")
        fs, me, tmp = self.checkpointer.fs, self.sync.process_index, self.tmp
        written: dict[str, Any] = {}
        # this process's files and directories, fsynced together (one group commit)
        # before it reports them written
        batch = SyncBatch(fs)
        try:
            for item, plan in self.plans.items():
                item_dir = os.path.join(tmp, item)
                if plan.primary is not None:
                    self._primary_data[item] = d = write_item_data(fs, item_dir, plan.primary,
                                                                   sync=batch)
                    self.stats.write_s += d.write_s
                    self.stats.bytes += d.data_bytes  # its directory: by commit()
                sf = write_shards(fs, item_dir, me, plan.shards, sync=batch)
                written[item] = None if sf is None else sf.record()
                if sf is not None:
                    self.stats.write_s += sf.write_s
                    self.stats.bytes += sf.data_bytes
            batch.flush()
            self.stats.fsync_s += batch.flush_s
            fault_point(self.sync, "after_write")
        finally:
            _close_quietly(batch)
        return written

    def commit(self, files: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
        """The primary's last step: the manifests (listing ``files``, every process's shard
        files as :meth:`write` returned them, by process), the metadata, and the commit
        (fsync, rename, fsync of the parent). Returns what the other processes must learn.
        On a failure before the rename the temporary directory is removed."""
        fs, tmp = self.checkpointer.fs, self.tmp
        try:
            fault_point(self.sync, "before_commit")
            t = time.perf_counter()
            # the manifests, the metadata and every directory of the tree: fsynced
            # together by commit(), before its rename
            batch = SyncBatch(fs)
            try:
                records = self._write_manifests(tmp, self._primary_data, files, batch)
                sharded = any(p.num_sharded for p in self.plans.values())
                raw = metadata_bytes(self.step, records, metrics=self.metrics,
                                     custom_metadata=self.custom_metadata,
                                     init_ns=self.init_ns,
                                     format_version=SHARDED_FORMAT_VERSION if sharded
                                     else FORMAT_VERSION)
                fs.write_file(os.path.join(tmp, METADATA_FILE), [raw], batch=batch)
                commit(fs, tmp, self.directory, subdirs=list(self.plans), sync=batch)
            finally:
                _close_quietly(batch)
            self.committed = True
            self.stats.fsync_s += batch.flush_s
            self.stats.commit_s = time.perf_counter() - t - batch.flush_s
            fault_point(self.sync, "after_commit")
            return dict(self.on_commit(self.stats)) if self.on_commit else {}
        except Exception:
            if not self.committed:
                abort(fs, tmp)
            raise

    def barrier(self, phase: str, error: BaseException | None = None,
                value: Any = None) -> list[Any] | None:
        """Wait at barrier ``phase`` (``"created"``, ``"written"``, ``"committed"``) for every
        process, telling them this process's ``error`` (None if its step succeeded) and
        ``value``; returns every process's ``value``, by process.

        If any process reports an error, every process raises it — after the primary has
        removed the temporary directory — so that a failed save leaves nothing behind. A
        process missing at the barrier is a :class:`PeerTimeoutError`, naming it. After
        ``"committed"`` (where only the primary's outcome counts) nothing is returned.
        """
        if phase not in _WAITS:
            raise ValueError(f"no barrier {phase!r} in a collective save (they are "
                             f"{list(_WAITS)})")
        fs, tmp, me = self.checkpointer.fs, self.tmp, self.sync.process_index
        if phase == "created" and error is None:
            try:
                fault_point(self.sync, "after_create")
            except Exception as e:
                error = e
        local = self._save_error(error) if isinstance(error, Exception) else error
        if phase == "committed":
            status = failure_status(local, **(value or {})) if self.primary else None
            try:
                statuses = self._exchange(phase, status, _WAITS[phase])
            except PeerTimeoutError as e:
                if self.committed:
                    e.add_note(f"step {self.step} was committed at {self.directory} before "
                               "the time-out; the missing processes do not know it")
                raise
            finally:  # committed: what retention retired goes, whoever is still there
                if self.primary and self.committed and self.after_commit is not None:
                    self.after_commit()
            result = statuses[self.options.primary_host]
            raise_failures({self.options.primary_host: result}, me, local,
                           f"committing step {self.step}")
            if not self.primary and self.on_done is not None:
                self.on_done(result)
            return None
        try:
            statuses = self._exchange(phase, failure_status(local, value=value),
                                      _WAITS[phase])
        except BaseException:
            if self.primary:
                abort(fs, tmp)  # a missing process: nothing is published
            raise
        self._raise_failures_after_cleanup(
            statuses, local, tmp, f"starting to write step {self.step} ({tmp})"
            if phase == "created" else f"writing step {self.step}")
        return [st.get("value") for st in statuses]

    def _raise_failures_after_cleanup(self, statuses: Sequence[Any],
                                      local: BaseException | None, tmp: str, what: str) -> None:
        """If any process reported a failure, raise it on every process — but only once the
        primary has removed the temporary directory, so that no process returns from a
        failed save while its leftovers are still there (one more barrier, on failure only).
        """
        if all((st or {}).get("ok", False) for st in statuses):
            return
        if self.primary:
            abort(self.checkpointer.fs, tmp)
        try:
            self._exchange("aborted", None, "waiting for the primary to remove the temporary "
                                            "directory of the failed save")
        except PeerTimeoutError as e:  # the failure itself is what matters
            log.warning("minickpt: %s", e)
        raise_failures(statuses, self.sync.process_index, local, what)

    def _save_error(self, e: Exception) -> Exception:
        """A file-system error as the error a failed save raises (same errno, saying which
        checkpoint and that nothing was committed), unless the rename already happened."""
        if (isinstance(e, OSError) and not isinstance(e, MiniCkptError)
                and not _renamed(self.checkpointer.fs, os.path.abspath(self.directory))):
            err = save_error(e, self.directory)
            err.__cause__ = e
            return err
        return e

    def _write_manifests(self, tmp: str, primary_data: Mapping[str, ItemData],
                         by_process: Sequence[Mapping[str, Any] | None], batch: SyncBatch
                         ) -> dict[str, Any]:
        fs = self.checkpointer.fs
        records = {}
        for item, plan in self.plans.items():
            assert plan.primary is not None
            files = [fp[item] for fp in by_process if fp and fp.get(item)]
            extra = None
            if plan.num_sharded:
                extra = {"format_version": SHARDED_FORMAT_VERSION,
                         "process_count": self.sync.process_count, "shard_files": files}
            res = write_item_manifest(fs, os.path.join(tmp, item), plan.primary,
                                      primary_data[item], extra=extra, sync=batch)
            self.stats.num_leaves += res.num_leaves
            shard_bytes = sum(f["data_bytes"] for f in files)
            records[item] = {"manifest_crc32": res.manifest_crc32, "data_bytes": res.data_bytes,
                             "num_leaves": res.num_leaves}
            if plan.num_sharded:
                records[item]["shard_bytes"] = shard_bytes
        return records


def two_barrier_commit(save: CollectiveSave) -> None:
    """Task 4.3 — publish one collective save on every process, or fail it on every process.

    Run by every process with its own ``save``, once the step is agreed. Guarantees: the step
    is published (the primary's ``save.commit`` renames the temporary directory) only once
    every process's shards are durable, and its manifest lists every process's files; nobody
    writes before the temporary directory exists; nobody returns before the step is
    published; a failure of ``create``, ``write`` or ``commit`` on any process makes every
    process raise — learned at a barrier (``save.barrier``), not from a time-out — and leaves
    neither the step nor its temporary directory (unless the rename had happened: the step is
    then complete and stays), the process where it failed ending with its own error; a process
    that dies makes every survivor raise, and nothing incomplete is ever published; after a
    success every process holds what the primary's ``commit`` returned (the manager's
    bookkeeping: which steps retention deleted).
    """
    error: Exception | None = None
    if save.primary:
        try:
            save.create()
        except Exception as e:
            error = e
    save.barrier("created", error)
    files = None
    try:
        files = save.write()
    except Exception as e:
        error = e
    written = save.barrier("written", error, files)
    info: dict[str, Any] = {}
    if save.primary:
        try:
            info = save.commit(written)
        except Exception as e:
            error = e
    save.barrier("committed", error, info)


def _close_quietly(batch: SyncBatch) -> None:
    """Close what a failed write left in its batch; the write's own error matters more."""
    try:
        batch.close()
    except OSError:
        pass


def prepare_save(checkpointer: Checkpointer, sync: Sync, directory: str,
                 items: Mapping[str, Any], *, step: int, force: bool = False,
                 options: MultiHostOptions | None = None,
                 metrics: Mapping[str, Any] | None = None,
                 custom_metadata: Mapping[str, Any] | None = None, copy: bool = False,
                 on_commit: Callable[[SaveStats], Mapping[str, Any]] | None = None,
                 on_done: Callable[[Mapping[str, Any]], None] | None = None,
                 after_commit: Callable[[], None] | None = None
                 ) -> CollectiveSave:
    """Start a collective save in the caller's thread: agree (Task 4.1), then snapshot.

    Every process calls it with the same step and trees of the same structure. Returns
    the job whose :meth:`CollectiveSave.run` writes and commits; ``copy`` makes the
    snapshot a real copy, as a background write needs.
    """
    options = options or MultiHostOptions()
    if options.primary_host >= sync.process_count:
        raise ValueError(f"primary_host {options.primary_host} is not one of the "
                         f"{sync.process_count} processes")
    if not isinstance(items, Mapping) or not items:
        raise TypeError("items must be a non-empty mapping of item name to pytree, "
                        "e.g. {'params': params, 'opt_state': opt_state}")
    init_ns = time.time_ns()
    names = [check_name(str(name)) for name in items]
    op = sync.new_op("save")
    stats = SaveStats(step, directory, start_time=time.time())
    t = time.perf_counter()
    views = sync.exchange(f"{op}/agree", {
        "step": step, "items": names, "force": force, "token": secrets.token_hex(4),
        "trees": tree_signature(items, sync, options.primary_host)}, options.timeout_s,
        f"save of step {step}: agreeing on the step (every process must call save, not "
        "only the primary)")
    stats.barrier_s += time.perf_counter() - t
    agree_on_step([v["step"] for v in views])
    agree([v["items"] for v in views], "the items to save")
    agree([v["trees"] for v in views], "the structure, shapes and dtypes of the saved trees "
                                       "(checksum of their signature)")
    t0 = time.perf_counter()
    plans = {}
    try:
        fault_point(sync, "after_agree")
        for name, tree in zip(names, items.values(), strict=True):
            try:
                plans[name] = plan_for_process(tree, sync, primary_host=options.primary_host,
                                               copy=copy, primary_only=options.primary_only,
                                               item=name)
            except UnsupportedLeafError as e:
                raise UnsupportedLeafError(f"item '{name}': {e}") from None
    except Exception as e:
        # The others agreed and go on to write (perhaps in a background thread): tell them
        # at their first barrier, so they fail now, naming this process, instead of
        # waiting for the time-out. The barrier is bounded; its own failure changes nothing.
        try:
            what = f"save of step {step}: reporting this process's failed snapshot"
            sync.exchange(f"{op}/created", failure_status(e), options.timeout_s, what)
            # and, like every process after a failure, wait for the primary's cleanup
            # (CollectiveSave._raise_failures_after_cleanup)
            sync.exchange(f"{op}/aborted", None, options.timeout_s, what)
        except Exception as report:
            log.debug("minickpt: could not report the failed snapshot: %s", report)
        raise
    stats.snapshot_s = time.perf_counter() - t0
    return CollectiveSave(checkpointer, sync, op, directory, step,
                          views[options.primary_host]["token"], plans, options, stats,
                          metrics=metrics, custom_metadata=custom_metadata, init_ns=init_ns,
                          on_commit=on_commit, on_done=on_done, after_commit=after_commit)
