"""Multi-host checkpoints: every process of a ``jax.distributed`` job saves one checkpoint.

The same :class:`~minickpt.manager.CheckpointManager` code runs on one process and on many.
With several processes a save is a small collective protocol (chapter 4, lab 4):

1. **Agree** (Task 4.1). Every process publishes the step, the item names and a checksum
   of its trees' structure; they must all be equal, else every process raises
   :class:`~minickpt.errors.ProcessDisagreementError` naming who said what.
2. **Snapshot.** Each process copies to host memory the shards it *owns* (Task 4.2): of the
   devices holding the same piece of an array, the first in the sharding's device order
   (``replica_id == 0``). Every piece is thus written exactly once, however replicated it
   is. Values that are not sharded across processes (numbers, numpy arrays, fully
   replicated arrays) are written by the primary process alone.
3. **Write, then commit** (Task 4.3). The primary creates the temporary directory —
   barrier — every process writes and fsyncs its shard files — barrier — the primary
   writes the manifests and the metadata and commits (fsync, rename, fsync of the parent)
   — barrier. The rename is the only publication: a reader never sees a checkpoint whose
   shards are incomplete, and nobody returns from ``save`` before the commit is durable.
4. **Restore onto any sharding** (Task 4.4). Each process reads only the regions its
   devices need (``jax.make_array_from_callback`` over the saved shard files), so a
   checkpoint saved on 4 processes restores on 2, on 1, or on another mesh.

Every barrier has a time-out (``MultiHostOptions.timeout_s``). When a process dies or
hangs, the others raise :class:`~minickpt.errors.PeerTimeoutError` naming the missing
processes; the primary removes the temporary directory, so no step is committed. Barriers
go through the coordination service's key-value store and ``wait_at_barrier`` (the only
JAX primitives with a time-out); XLA collectives (``multihost_utils``) have none and hang
on a dead or hung peer, so minickpt never uses them: even the bytes of a ``primary_only``
restore travel through the key-value store (in chunks), bounded by the same time-out.

What JAX itself does on failure, and what to do about it:

* After a :class:`PeerTimeoutError`, leave with :func:`hard_exit`: a normal exit runs
  ``jax.distributed.shutdown()``, a barrier the dead peer never reaches (it waits
  ``shutdown_timeout_seconds``, then aborts).
* If a process *dies*, the JAX runtime aborts every survivor ``heartbeat_timeout_seconds``
  later (100 s by default). Keep ``timeout_s`` well below it so survivors fail with a
  Python error first.
* If process 0 (it hosts the coordination service, and is the primary by default) dies,
  every other process is aborted by the runtime within a second, with no Python error. A
  temporary directory stays behind; the next primary to open the manager removes it.

**Replicated state, the Flax way.** With ``MultiHostOptions(primary_only=True)`` the
primary alone writes (every leaf must be replicated: data parallelism), and on restore the
primary alone reads and *broadcasts* to the others (through the coordination service, in
1 MiB chunks: the state passes through process 0's memory, and must be sent within
``timeout_s``). Use it when the state is replicated
and you want the other hosts to stay off the storage (one reader instead of N). Use the
default, sharded protocol whenever the state is sharded (FSDP, tensor parallelism): each
host then writes and reads only its part, and no host needs memory for the whole state.

**Async** (chapter 5). The protocol's write phase (:meth:`CollectiveSave.run`) is a plain
callable, safe to run in a background thread: barriers and the key-value store may be used
from any thread. ``CheckpointManager(..., enable_async_checkpointing=True)`` does so: the
agreement and the snapshot (a real copy) happen in ``save()``, the rest in the background,
and every process waits for its save in flight before its next collective operation, so
operations run in the same order everywhere and their barrier ids never collide.

This module touches one private JAX object, the coordination-service client; everything
that does lives in :class:`_Coordination`.
"""

from __future__ import annotations

import base64
import errno
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .checkpointer import Checkpointer, SaveStats, _renamed, metadata_bytes, save_error
from .commit import METADATA_FILE, TMP_MARK, abort, commit
from .errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    MiniCkptError,
    MultiHostError,
    PeerTimeoutError,
    ProcessDisagreementError,
    StepAlreadyExistsError,
    UnsupportedLeafError,
    _ranges,
)
from .format import (
    FORMAT_VERSION,
    SHARDED_FORMAT_VERSION,
    Box,
    ItemData,
    ItemPlan,
    box_of,
    check_name,
    coverage_problems,
    decode_value,
    dtype_name,
    plan_leaf,
    plan_shards,
    sharded_entry,
    write_item_data,
    write_item_manifest,
    write_shards,
)
from .fs import SyncBatch
from .tree import (
    HostKey,
    Names,
    _transfer_made_a_copy,
    is_prng_key,
    path_str,
    skeleton,
    to_host,
)

log = logging.getLogger("minickpt")

__all__ = [
    "CollectiveSave",
    "DistributedSync",
    "LocalGroup",
    "MultiHostOptions",
    "SingleProcessSync",
    "Sync",
    "agree",
    "agree_on_step",
    "coverage_problems",
    "default_sync",
    "hard_exit",
    "initialize",
    "owned_shards",
    "prepare_save",
]

# Environment set by ``python -m minickpt.launch`` for every process it starts.
ENV_COORDINATOR = "MINICKPT_COORDINATOR"
ENV_NUM_PROCESSES = "MINICKPT_NUM_PROCESSES"
ENV_PROCESS_ID = "MINICKPT_PROCESS_ID"
ENV_TOKEN = "MINICKPT_LAUNCH_TOKEN"
ENV_INIT_TIMEOUT = "MINICKPT_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "MINICKPT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "MINICKPT_SHUTDOWN_TIMEOUT"
# Fault injection for tests and recovery drills: "point[@process]:action,...", see _fault.
ENV_FAULT = "MINICKPT_FAULT"


@dataclass(frozen=True)
class MultiHostOptions:
    """How a multi-process save and restore behave (ignored on a single process).

    ``timeout_s`` bounds every barrier: the slowest process's write must fit in it, and it
    should stay below JAX's ``heartbeat_timeout_seconds`` (100 s by default) so that a dead
    peer is reported as an error before the runtime aborts the job. ``primary_host`` is
    Orbax's name for the process that writes metadata and commits. ``primary_only``: see
    the module docstring (replicated state saved by the primary, broadcast on restore).
    """

    timeout_s: float = 60.0
    primary_host: int = 0
    primary_only: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.primary_host, int) or self.primary_host < 0:
            raise ValueError(f"primary_host must be an int >= 0, got {self.primary_host!r}")


# ---------------------------------------------------------------------------------------
# the one adapter around JAX's private coordination-service client
# ---------------------------------------------------------------------------------------
class _Coordination:
    """JAX's coordination-service client (``jax._src.distributed.global_state.client``).

    JAX does not export it, but it is the only way to get barriers and key-value reads
    *with a time-out*. If a future JAX moves it, this class is the one place to fix.
    """

    METHODS = ("key_value_set", "blocking_key_value_get", "key_value_dir_get",
               "key_value_delete", "wait_at_barrier")

    def __init__(self) -> None:
        try:
            from jax._src import distributed
        except ImportError as e:  # pragma: no cover - depends on the JAX version
            raise MultiHostError(self._moved(f"cannot import jax._src.distributed ({e})")) from e
        state = getattr(distributed, "global_state", None)
        client = getattr(state, "client", None)
        if client is None:
            raise MultiHostError("jax.distributed is not initialized in this process: call "
                                 "minickpt.multihost.initialize() (or "
                                 "jax.distributed.initialize()) before any other JAX call")
        missing = [m for m in self.METHODS if not hasattr(client, m)]
        if missing:  # pragma: no cover - depends on the JAX version
            raise MultiHostError(self._moved(f"the client lacks {missing}"))
        self.client = client

    @staticmethod
    def _moved(what: str) -> str:
        return (f"minickpt.multihost needs JAX's coordination-service client, and {what} in "
                f"JAX {jax.__version__}. It was written against JAX 0.4.30-0.10; please report "
                "this (the adapter is minickpt.multihost._Coordination).")

    @staticmethod
    def initialized() -> tuple[int, int] | None:
        """(process id, number of processes) if jax.distributed is up, without touching the
        XLA backend (which would fix the device set before initialize could run)."""
        try:
            from jax._src import distributed
        except ImportError:  # pragma: no cover
            return None
        state = getattr(distributed, "global_state", None)
        if state is None or getattr(state, "client", None) is None:
            return None
        pid, n = getattr(state, "process_id", None), getattr(state, "num_processes", None)
        if isinstance(pid, int) and isinstance(n, int):
            return pid, n
        return jax.process_index(), jax.process_count()  # pragma: no cover


def _is_deadline(e: BaseException) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


def _named_in(message: str) -> set[int]:
    """Process ids listed in a barrier time-out message ("... timed out task names:\\n2\\n")."""
    out: set[int] = set()
    if "timed out task names:" in message:
        for line in message.split("timed out task names:", 1)[1].splitlines():
            line = line.strip().rsplit("/", 1)[-1].rsplit(":", 1)[-1]
            if line.isdigit():
                out.add(int(line))
            elif line:
                break
    return out


# ---------------------------------------------------------------------------------------
# joining a job, leaving it
# ---------------------------------------------------------------------------------------
def initialize(*, initialization_timeout_s: int | None = None,
               heartbeat_timeout_s: int | None = None,
               shutdown_timeout_s: int | None = None) -> bool:
    """Join the job started by ``python -m minickpt.launch``; returns whether it did.

    Reads the launcher's environment (coordinator address, number of processes, this
    process's id) and calls ``jax.distributed.initialize`` with CPU collectives through
    gloo. Not launched (no ``MINICKPT_COORDINATOR``), or already initialized: does nothing,
    so the same script runs as a plain single process. Call it before any other JAX call.
    """
    env = os.environ
    if ENV_COORDINATOR not in env:
        return False
    if _Coordination.initialized() is not None:
        return True
    addr = env[ENV_COORDINATOR]
    n, pid = int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID])
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):  # pragma: no cover - older/newer JAX
        pass

    def pick(arg: int | None, var: str, default: int) -> int:
        return int(arg if arg is not None else env.get(var, default))

    kw: dict[str, Any] = {
        "coordinator_address": addr, "num_processes": n, "process_id": pid,
        "initialization_timeout": pick(initialization_timeout_s, ENV_INIT_TIMEOUT, 60),
        "heartbeat_timeout_seconds": pick(heartbeat_timeout_s, ENV_HEARTBEAT_TIMEOUT, 100),
        "shutdown_timeout_seconds": pick(shutdown_timeout_s, ENV_SHUTDOWN_TIMEOUT, 300),
        "cluster_detection_method": "deactivate",
    }
    host, _, port = addr.rpartition(":")
    if host in ("127.0.0.1", "localhost"):  # never listen beyond this machine
        kw["coordinator_bind_address"] = f"127.0.0.1:{port}"
    import inspect

    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kw.items() if k in accepted})
    token = env.get(ENV_TOKEN)
    if token:  # two jobs on one port would cross-connect: check we joined our own
        c = _Coordination().client
        if pid == 0:
            c.key_value_set("minickpt/launch_token", token)
        got = c.blocking_key_value_get("minickpt/launch_token", 30_000)
        if got != token:
            raise MultiHostError(f"process {pid} joined another job's coordinator at {addr}")
    return True


def hard_exit(code: int = 1) -> None:
    """Leave now, flushing output, without ``jax.distributed.shutdown()``.

    Use it after a :class:`PeerTimeoutError`: the shutdown barrier would wait for the dead
    or hung process for ``shutdown_timeout_seconds`` and then abort anyway.
    """
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(code)


def _fault(sync: Sync, point: str) -> None:
    """A named point of the protocol where a test or a drill can inject a failure.

    ``MINICKPT_FAULT="after_write@2:kill"`` SIGKILLs process 2 once its shards are written;
    actions: ``kill``, ``exit`` (code 13), ``hang``, ``sleep=S``, ``raise`` (EIO). Points:
    ``after_agree``, ``after_create``, ``after_write``, ``before_commit``, ``after_commit``
    (with async saves, the points after ``after_agree`` are reached in the background thread);
    ``before_broadcast`` in a ``primary_only`` restore, once the primary has read the step.
    """
    hook = sync.faults.get(point)
    if hook is not None:
        hook()
    spec = os.environ.get(ENV_FAULT)
    if not spec:
        return
    for part in spec.split(","):
        where, _, action = part.strip().partition(":")
        name, _, who = where.partition("@")
        if name != point or (who and int(who) != sync.process_index):
            continue
        log.warning("minickpt: injected fault %s at %s on process %d", action, point,
                    sync.process_index)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "exit":
            hard_exit(13)
        elif action == "hang":
            while True:
                time.sleep(3600)
        elif action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
        elif action == "raise":
            raise OSError(errno.EIO, f"injected fault at {point}")
        else:
            raise ValueError(f"unknown fault action {action!r} in {ENV_FAULT}")


# ---------------------------------------------------------------------------------------
# synchronisation: exchange a small JSON value with every process, with a time-out
# ---------------------------------------------------------------------------------------
class Sync:
    """How the processes of a job talk: one primitive, :meth:`exchange`.

    ``exchange(key, value)`` publishes this process's value, waits at a barrier, and
    returns every process's value. Its outcome is *consistent*: either every process gets
    all values, or every process raises :class:`PeerTimeoutError` — even one that arrives
    after the time-out. That is what makes it a safe commit point.
    """

    process_index: int = 0
    process_count: int = 1

    def __init__(self) -> None:
        self.faults: dict[str, Callable[[], None]] = {}
        self._ops = itertools.count()
        self._lock = threading.Lock()

    def new_op(self, kind: str) -> str:
        """A fresh name for one collective operation. Every process must run the same
        operations in the same order (as every SPMD program does)."""
        with self._lock:
            return f"{next(self._ops):08d}-{kind}"  # fixed width: no id prefixes another

    def exchange(self, key: str, value: Any, timeout_s: float, what: str = "") -> list[Any]:
        """Every process's ``value`` (JSON), by process; ``what`` names the wait in errors."""
        raise NotImplementedError

    def broadcast_bytes(self, key: str, data: np.ndarray | None, nbytes: int, src: int,
                        timeout_s: float, what: str = "") -> np.ndarray:
        """``data`` (uint8) from process ``src`` on every process. Only call it after an
        :meth:`exchange` has told everyone ``nbytes`` and that ``src`` is ready. Bounded by
        ``timeout_s`` like an exchange: a missing process is named in a PeerTimeoutError."""
        raise NotImplementedError

    def process_of(self, device: Any) -> int:
        return int(device.process_index)

    def forget(self, key: str) -> None:
        """Drop the values of a finished exchange that every process has read (those of
        :meth:`new_op` keys are collected automatically)."""


class SingleProcessSync(Sync):
    """One process: every exchange is with oneself."""

    def exchange(self, key: str, value: Any, timeout_s: float, what: str = "") -> list[Any]:
        return [json.loads(json.dumps(value))]

    def broadcast_bytes(self, key: str, data: np.ndarray | None, nbytes: int, src: int,
                        timeout_s: float, what: str = "") -> np.ndarray:
        assert data is not None
        return data


class DistributedSync(Sync):
    """The processes of a ``jax.distributed`` job, through the coordination service."""

    PREFIX = "minickpt"

    def __init__(self) -> None:
        super().__init__()
        self._coord = _Coordination()
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._recent: list[str] = []

    def new_op(self, kind: str) -> str:
        op = super().new_op(kind)
        with self._lock:
            self._recent.append(op)
            # A process starts operation k only after it finished k-2, so once k has started
            # everywhere nobody reads k-2's keys: the primary deletes them.
            if len(self._recent) > 3:
                old = self._recent.pop(0)
                if self.process_index == 0:
                    try:
                        self._coord.client.key_value_delete(f"{self.PREFIX}/{old}")
                    except Exception as e:  # garbage collection must never fail a save
                        log.debug("minickpt: could not delete keys of %s: %s", old, e)
        return op

    def forget(self, key: str) -> None:
        if self.process_index == 0:
            try:
                self._coord.client.key_value_delete(f"{self.PREFIX}/{key}")
            except Exception as e:  # garbage collection never fails the caller
                log.debug("minickpt: could not delete keys of %s: %s", key, e)

    def exchange(self, key: str, value: Any, timeout_s: float, what: str = "") -> list[Any]:
        c = self._coord.client
        me, n = self.process_index, self.process_count
        base = f"{self.PREFIX}/{key}"
        c.key_value_set(f"{base}/{me}", json.dumps(value), allow_overwrite=True)
        try:
            c.wait_at_barrier(base, max(1, int(timeout_s * 1000)))
        except Exception as e:
            if not _is_deadline(e):
                raise MultiHostError(f"{what or key}: the coordination service failed: {e}") from e
            arrived = self._arrived(base)
            missing = (set(range(n)) - arrived) | _named_in(str(e))
            raise PeerTimeoutError(what or key, missing - {me} or missing, timeout_s) from None
        values = dict(self._read_all(base))
        if len(values) != n:  # pragma: no cover - the barrier guarantees every value
            raise MultiHostError(f"{key}: only processes {sorted(values)} published a value")
        return [values[p] for p in range(n)]

    def _read_all(self, base: str) -> list[tuple[int, Any]]:
        out = []
        for k, v in self._coord.client.key_value_dir_get(f"{base}/"):
            tail = k.rsplit("/", 1)[-1]
            if tail.isdigit():
                out.append((int(tail), json.loads(v)))
        return out

    def _arrived(self, base: str) -> set[int]:
        try:
            return {p for p, _ in self._read_all(base)}
        except Exception:  # pragma: no cover - the service is gone
            return set()

    # Coordination-service calls are gRPC messages (4 MiB at most by default): large
    # payloads travel in chunks well below that.
    KV_CHUNK_BYTES = 1 << 20

    def broadcast_bytes(self, key: str, data: np.ndarray | None, nbytes: int, src: int,
                        timeout_s: float, what: str = "") -> np.ndarray:
        """Through the key-value store, in chunks, not an XLA collective: an XLA broadcast
        has no time-out, so a peer dying mid-restore would hang the others until JAX's
        heartbeat aborts them, naming nobody. Here every wait is an :meth:`exchange`.

        The payload passes through the coordination service (process 0's memory) and must be
        uploaded within ``timeout_s``; ``primary_only`` restores are for replicated state
        that fits comfortably in one host's memory anyway."""
        c = self._coord.client
        me, chunk = self.process_index, max(1, int(self.KV_CHUNK_BYTES))
        data_key = f"{self.PREFIX}/{key}/data"
        nchunks = -(-nbytes // chunk)
        what = what or f"broadcast of {key} from process {src}"
        if me == src:
            assert data is not None and data.nbytes == nbytes
            raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            for i in range(nchunks):
                self._set_bytes(f"{data_key}/{i}", bytes(raw[i * chunk:(i + 1) * chunk]))
        # every chunk is in the store once the source arrives here
        self.exchange(f"{key}/sent", nchunks if me == src else None, timeout_s,
                      f"{what}: waiting for the data")
        if me == src:
            out = np.asarray(data, np.uint8).reshape(-1)
        else:
            out = np.empty(nbytes, np.uint8)
            deadline = time.monotonic() + timeout_s
            for i in range(nchunks):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    got = self._get_bytes(f"{data_key}/{i}", left_ms)
                except Exception as e:
                    raise MultiHostError(f"{what}: chunk {i} of {nchunks} could not be read "
                                         f"from the coordination service: {e}") from e
                lo = i * chunk
                if len(got) != min(chunk, nbytes - lo):
                    raise MultiHostError(f"{what}: chunk {i} has {len(got)} bytes, expected "
                                         f"{min(chunk, nbytes - lo)}")
                out[lo:lo + len(got)] = np.frombuffer(got, np.uint8)
        # everybody has it: the source frees the coordinator's memory
        self.exchange(f"{key}/received", None, timeout_s, f"{what}: waiting for every "
                      "process to receive it")
        if me == src and nchunks:
            try:
                c.key_value_delete(data_key)
            except Exception as e:  # garbage collection never fails a restore
                log.debug("minickpt: could not delete %s: %s", data_key, e)
        return out

    def _set_bytes(self, key: str, value: bytes) -> None:
        c = self._coord.client
        if hasattr(c, "key_value_set_bytes"):
            c.key_value_set_bytes(key, value, allow_overwrite=True)
        else:  # pragma: no cover - older JAX: text values only
            c.key_value_set(key, base64.b64encode(value).decode(), allow_overwrite=True)

    def _get_bytes(self, key: str, timeout_ms: int) -> bytes:
        c = self._coord.client
        if hasattr(c, "blocking_key_value_get_bytes"):
            return bytes(c.blocking_key_value_get_bytes(key, timeout_ms))
        return base64.b64decode(c.blocking_key_value_get(key, timeout_ms))  # pragma: no cover


class LocalGroup:
    """N threads of this process playing N processes, for fast tests of the protocol.

    The devices of this process are split between the simulated processes in id order,
    so a sharding over all local devices looks, to the protocol, like one spanning several
    processes. The key-value store and the barriers live in memory and behave like the
    coordination service: same values, same consistent time-outs.
    """

    def __init__(self, n: int, devices: Sequence[Any] | None = None):
        devs = sorted(devices if devices is not None else jax.devices(), key=lambda d: d.id)
        if not 1 <= n <= len(devs):
            raise ValueError(f"cannot split {len(devs)} devices between {n} processes")
        self.n = n
        self.owner = {d.id: i * n // len(devs) for i, d in enumerate(devs)}
        self._cond = threading.Condition()
        self._values: dict[str, dict[int, Any]] = {}
        self._failed: dict[str, set[int]] = {}

    def sync(self, process_index: int) -> LocalSync:
        return LocalSync(self, process_index)

    def run(self, fn: Callable[[LocalSync], Any], timeout_s: float = 60.0) -> list[Any]:
        """Run ``fn(sync)`` in one thread per simulated process; return results (or the
        exceptions raised) by process."""
        results: list[Any] = [None] * self.n

        def body(p: int) -> None:
            try:
                results[p] = fn(self.sync(p))
            except BaseException as e:
                results[p] = e

        threads = [threading.Thread(target=body, args=(p,), name=f"minickpt-proc{p}",
                                    daemon=True) for p in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        return results


class LocalSync(Sync):
    def __init__(self, group: LocalGroup, process_index: int):
        super().__init__()
        self.group = group
        self.process_index = process_index
        self.process_count = group.n

    def process_of(self, device: Any) -> int:
        return self.group.owner[device.id]

    def exchange(self, key: str, value: Any, timeout_s: float, what: str = "") -> list[Any]:
        g, me = self.group, self.process_index
        value = json.loads(json.dumps(value))
        deadline = time.monotonic() + timeout_s
        with g._cond:
            got = g._values.setdefault(key, {})
            got[me] = value
            g._cond.notify_all()
            while len(got) < g.n and key not in g._failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    g._failed[key] = set(range(g.n)) - set(got)
                    g._cond.notify_all()
                    break
                g._cond.wait(left)
            if key in g._failed:
                raise PeerTimeoutError(what or key, g._failed[key], timeout_s)
            return [got[p] for p in range(g.n)]

    def broadcast_bytes(self, key: str, data: np.ndarray | None, nbytes: int, src: int,
                        timeout_s: float, what: str = "") -> np.ndarray:
        box = self.exchange(key + "/bytes", data.tobytes().hex() if data is not None
                            and self.process_index == src else None, timeout_s, what)[src]
        return np.frombuffer(bytes.fromhex(box), np.uint8).copy()


_DEFAULT: Sync | None = None


def default_sync() -> Sync:
    """The job this process belongs to: a :class:`DistributedSync` under jax.distributed,
    else a :class:`SingleProcessSync`."""
    global _DEFAULT
    state = _Coordination.initialized()
    if state is None or state[1] == 1:
        return SingleProcessSync()
    if not isinstance(_DEFAULT, DistributedSync):
        _DEFAULT = DistributedSync()
    return _DEFAULT


# ---------------------------------------------------------------------------------------
# Task 4.1: agreeing; Task 4.2: who writes what
# ---------------------------------------------------------------------------------------
def agree(values: Sequence[Any], what: str) -> Any:
    """The value every process passed; :class:`ProcessDisagreementError` if they differ."""
    if not values:
        raise ValueError("no values to agree on")
    if any(v != values[0] for v in values[1:]):
        raise ProcessDisagreementError(what, values)
    return values[0]


def agree_on_step(steps: Sequence[int]) -> int:
    """Task 4.1 — the step every process wants to save (``steps[p]`` from process p).

    Pure: the all-gather that collects ``steps`` is :meth:`Sync.exchange`. If two processes
    disagree, saving would mix two training states in one checkpoint, so every process
    raises :class:`ProcessDisagreementError` naming each process and its step.
    """
    return int(agree(list(steps), "the step to save"))


def owned_shards(shape: Sequence[int], devices_indices_map: Mapping[Any, Sequence[slice]],
                 process_index: int, *,
                 process_of: Callable[[Any], int] = lambda d: d.process_index
                 ) -> list[tuple[Box, Any]]:
    """Task 4.2 — the shards process ``process_index`` writes: ``(box, device)`` pairs.

    Pure. ``devices_indices_map`` is ``sharding.devices_indices_map(shape)``: every device
    of the sharding, in the sharding's device order, with the index of the piece it holds.
    Several devices may hold the same piece (replication); the first of them in that order
    owns it — the one JAX gives ``replica_id == 0`` — so across all processes each piece is
    written exactly once.
    """
    seen: set[Box] = set()
    mine = []
    for device, index in devices_indices_map.items():
        box = box_of(index, shape)
        if box in seen:
            continue
        seen.add(box)
        if process_of(device) == process_index:
            mine.append((box, device))
    return mine


# ---------------------------------------------------------------------------------------
# the snapshot: what this process writes for one item
# ---------------------------------------------------------------------------------------
@dataclass
class ProcessItemPlan:
    """One process's part of one item: the primary's plan (every leaf's manifest entry, the
    bytes of the leaves only it writes) and this process's shards."""

    primary: ItemPlan | None
    shards: ItemPlan
    num_sharded: int


def _is_sharded(leaf: Any, sync: Sync, primary_host: int) -> bool:
    """Whether a leaf is written in shards: a global array no single process reads whole."""
    return _spans_processes(leaf, sync.process_of) and not _primary_can_read(
        leaf, sync.process_of, primary_host)


def tree_signature(items: Mapping[str, Any], sync: Sync, primary_host: int = 0) -> str:
    """A checksum of what the processes are about to save: item names, key paths, types,
    shapes, dtypes, and which leaves are sharded. Cheap: no data is read.

    It also refuses leaves that cannot be stored, on *every* process (the primary alone
    copies the unsharded ones, and must not be the only one to fail).
    """
    sig = []
    for name, tree in items.items():
        for names, leaf in skeleton(tree)[1]:
            _check_storable(leaf, f"item '{name}' leaf {path_str(names)}")
            sig.append([name, list(names), type(leaf).__name__,
                        list(np.shape(leaf)) if hasattr(leaf, "shape") else None,
                        str(getattr(leaf, "dtype", "")), _is_sharded(leaf, sync, primary_host)])
    return f"{zlib.crc32(json.dumps(sig, sort_keys=True).encode()):08x}"


def _check_storable(leaf: Any, where: str) -> None:
    if isinstance(leaf, jax.Array):
        dtype = jax.random.key_data(leaf).dtype if is_prng_key(leaf) else leaf.dtype
    elif isinstance(leaf, (np.ndarray, np.generic)):
        to_host(leaf, path=where)  # refuses object arrays, with the reason
        dtype = leaf.dtype
    else:
        to_host(leaf, path=where)  # numbers, strings, None pass; anything else is refused
        return
    try:
        dtype_name(dtype)
    except UnsupportedLeafError as e:
        raise UnsupportedLeafError(f"{where}: {e}") from None


def _spans_processes(leaf: Any, process_of: Callable[[Any], int]) -> bool:
    """Whether a leaf is a global array (its devices belong to more than one process)."""
    if not isinstance(leaf, jax.Array):
        return False
    return len({process_of(d) for d in leaf.sharding.device_set}) > 1


def _primary_can_read(leaf: jax.Array, process_of: Callable[[Any], int], primary: int) -> bool:
    sh = leaf.sharding
    return sh.is_fully_replicated and any(process_of(d) == primary for d in sh.device_set)


def plan_for_process(tree: Any, sync: Sync, *, primary_host: int = 0, copy: bool = False,
                     primary_only: bool = False, item: str = "") -> ProcessItemPlan:
    """The snapshot of one item for this process (device-to-host copies happen here).

    Global arrays that no single process can read whole are *sharded*: this process copies
    the shards it owns (:func:`owned_shards`). Everything else — Python values, numpy
    arrays, process-local arrays (assumed equal on every process, as in data parallelism)
    and fully replicated arrays — is copied by the primary alone. ``copy`` forces real
    copies on CPU too (needed when the write runs in the background).
    """
    me = sync.process_index
    is_primary = me == primary_host
    skel, named = skeleton(tree)
    entries: list[dict[str, Any]] = []
    buffers: list[np.ndarray | None] = []
    shards: list[tuple[int, Names, Box, np.ndarray]] = []
    pending: list[tuple[int, Names, Box, jax.Array]] = []
    offset = 0
    num_sharded = 0
    for i, (names, leaf) in enumerate(named):
        where = path_str(names)
        sharded = _is_sharded(leaf, sync, primary_host)
        if sharded:
            if primary_only:
                raise UnsupportedLeafError(
                    f"item '{item}' leaf {where} is sharded across processes "
                    f"({leaf.sharding}); primary_only=True saves replicated state only. Use "
                    "the default sharded protocol, or replicate the leaf.")
            num_sharded += 1
            key = is_prng_key(leaf)
            data = jax.random.key_data(leaf) if key else leaf
            impl = str(jax.random.key_impl(leaf)) if key else None
            if is_primary:
                entries.append(sharded_entry(names, "prng_key" if key else "array", data.dtype,
                                             data.shape, impl))
                buffers.append(None)
            by_device = {s.device: s for s in data.addressable_shards}
            for box, device in owned_shards(data.shape,
                                            data.sharding.devices_indices_map(data.shape), me,
                                            process_of=sync.process_of):
                pending.append((i, names, box, by_device[device].data))
            continue
        if not is_primary:
            continue
        was_np_scalar = isinstance(leaf, np.generic)
        host = to_host(_readable_copy(leaf), copy=copy, path=where)
        entry, buf = plan_leaf(names, host)
        if was_np_scalar:
            entry["scalar"] = True
        if buf is not None:
            offset = (offset + 63) // 64 * 64
            entry["offset"] = offset
            offset += buf.nbytes
        entries.append(entry)
        buffers.append(buf)
    for *_, data in pending:  # start every device-to-host copy before waiting on any
        try:
            data.copy_to_host_async()
        except Exception:  # already on the host
            pass
    for i, names, box, data in pending:
        host = np.asarray(data)
        if copy and not _transfer_made_a_copy(data):  # on GPU/TPU the transfer is the copy
            host = np.array(host, copy=True)
        shards.append((i, names, box, host))
    primary_plan = ItemPlan(skel, entries, buffers, offset) if is_primary else None
    return ProcessItemPlan(primary_plan, plan_shards(shards), num_sharded)


def _readable_copy(leaf: Any) -> Any:
    """A leaf the primary can read whole: one replica of a replicated global array."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if is_prng_key(leaf):
            data = jax.random.key_data(leaf).addressable_data(0)
            return HostKey(np.asarray(data), str(jax.random.key_impl(leaf)))
        return leaf.addressable_data(0)
    return leaf


# ---------------------------------------------------------------------------------------
# Task 4.3: the collective save
# ---------------------------------------------------------------------------------------
def failure_status(e: BaseException | None = None, **extra: Any) -> dict[str, Any]:
    if e is None:
        return {"ok": True, **extra}
    return {"ok": False, "type": type(e).__name__, "message": str(e),
            "errno": getattr(e, "errno", None),
            "damage": isinstance(e, (CheckpointCorruptedError, OSError))
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


@dataclass
class CollectiveSave:
    """One collective save after its snapshot: :meth:`run` writes and commits it.

    ``run`` may be called in a background thread (the async manager does): it only uses
    the file system and :meth:`Sync.exchange`. ``on_commit`` runs on the primary right
    after the rename (the manager's bookkeeping and retention) and returns what the other
    processes must learn; ``on_done`` runs on the others with it.
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
        """Task 4.3 — the two-barrier commit: write this process's part, then commit.

        The primary creates the temporary directory — barrier — every process writes and
        fsyncs its shards — barrier — the primary writes the manifests and the metadata and
        commits (fsync, rename, fsync of the parent) — barrier. Any failure anywhere is
        reported to every process at the next barrier; the primary then removes the
        temporary directory (one more barrier: nobody raises before it is gone), so the
        step never appears.
        """
        t0 = time.perf_counter()
        stats = self.stats
        try:
            self._run()
        except BaseException as e:
            stats.ok, stats.error = False, f"{type(e).__name__}: {e}"
            raise
        finally:
            stats.total_s += time.perf_counter() - t0
        return stats

    def _run(self) -> None:
        fs, sync, me = self.checkpointer.fs, self.sync, self.sync.process_index
        root, name = os.path.split(os.path.abspath(self.directory))
        tmp = os.path.join(root, f"{name}{TMP_MARK}{self.token}")
        # 1. the primary creates the temporary directory and one directory per item; a
        #    process whose snapshot failed reports it here too (see prepare_save)
        local: BaseException | None = None
        try:
            if self.primary:
                fs.mkdir(tmp)
                for item in self.plans:
                    fs.mkdir(os.path.join(tmp, item))
            _fault(sync, "after_create")
        except Exception as e:
            local = self._save_error(e)
        try:
            statuses = self._exchange("created", failure_status(local),
                                      "waiting for every process to start writing (the "
                                      "primary creates the temporary directory)")
        except BaseException:
            if self.primary:
                abort(fs, tmp)  # a missing process: nothing is published
            raise
        self._raise_failures_after_cleanup(statuses, local, tmp,
                                           f"starting to write step {self.step} ({tmp})")
        # 2. every process writes its shards (the primary also the leaves only it writes)
        written: dict[str, Any] = {}
        primary_data: dict[str, ItemData] = {}
        try:
            # this process's files and directories, fsynced together (one group commit)
            # before it reports them written
            batch = SyncBatch(fs)
            try:
                for item, plan in self.plans.items():
                    item_dir = os.path.join(tmp, item)
                    if plan.primary is not None:
                        primary_data[item] = d = write_item_data(fs, item_dir, plan.primary,
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
                _fault(sync, "after_write")
            except Exception as e:
                local = self._save_error(e)
            finally:
                _close_quietly(batch)
            statuses = self._exchange("written", failure_status(local, files=written),
                                      "waiting for every process to write its shards")
        except BaseException:
            if self.primary:
                abort(fs, tmp)  # nothing was published: the step simply does not exist
            raise
        self._raise_failures_after_cleanup(statuses, local, tmp, f"writing step {self.step}")
        # 3. the primary writes the manifests and the metadata, and commits
        info: Mapping[str, Any] = {}
        committed = False
        if self.primary:
            try:
                _fault(sync, "before_commit")
                t = time.perf_counter()
                # the manifests, the metadata and every directory of the tree: fsynced
                # together by commit(), before its rename
                batch = SyncBatch(fs)
                try:
                    records = self._write_manifests(tmp, primary_data, statuses, batch)
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
                committed = True
                self.stats.fsync_s += batch.flush_s
                self.stats.commit_s = time.perf_counter() - t - batch.flush_s
                _fault(sync, "after_commit")
                info = dict(self.on_commit(self.stats)) if self.on_commit else {}
            except Exception as e:
                if not committed:
                    abort(fs, tmp)
                local = self._save_error(e)
        # 4. nobody returns before the commit is durable (or known to have failed)
        try:
            statuses = self._exchange("committed", failure_status(local, **info)
                                      if self.primary else None, "waiting for the commit")
        except PeerTimeoutError as e:
            if committed:
                e.add_note(f"step {self.step} was committed at {self.directory} before the "
                           "time-out; the missing processes do not know it")
            raise
        result = statuses[self.options.primary_host]
        raise_failures({self.options.primary_host: result}, me, local,
                        f"committing step {self.step}")
        if not self.primary and self.on_done is not None:
            self.on_done(result)

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
                         statuses: Sequence[Mapping[str, Any]], batch: SyncBatch
                         ) -> dict[str, Any]:
        fs = self.checkpointer.fs
        records = {}
        for item, plan in self.plans.items():
            assert plan.primary is not None
            files = [st["files"][item] for st in statuses if st["files"].get(item)]
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
                 on_done: Callable[[Mapping[str, Any]], None] | None = None
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
        _fault(sync, "after_agree")
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
                          on_commit=on_commit, on_done=on_done)


# ---------------------------------------------------------------------------------------
# restoring replicated state: the primary reads, everybody receives (primary_only=True)
# ---------------------------------------------------------------------------------------
def _pack(values: Sequence[Any], skel: Any) -> np.ndarray:
    """Host values (arrays, keys, Python values) as one byte string: JSON header + data."""
    entries, chunks, offset = [], [], 0
    for v in values:
        if isinstance(v, (np.ndarray, np.generic, HostKey)):
            host = np.asarray(v) if isinstance(v, np.generic) else v
            entry, buf = plan_leaf((), host)
            entry.pop("path", None)
            if isinstance(v, np.generic):
                entry["scalar"] = True
            assert buf is not None
            offset = (offset + 63) // 64 * 64
            entry["offset"] = offset
            chunks.append((offset, buf))
            offset += buf.nbytes
        else:
            entry = plan_leaf((), v)[0]
            entry.pop("path", None)
        entries.append(entry)
    header = json.dumps({"entries": entries, "skeleton": skel}).encode()
    start = (8 + len(header) + 63) // 64 * 64
    out = np.zeros(start + offset, np.uint8)
    out[:8] = np.frombuffer(len(header).to_bytes(8, "little"), np.uint8)
    out[8:8 + len(header)] = np.frombuffer(header, np.uint8)
    for off, buf in chunks:
        out[start + off:start + off + buf.nbytes] = buf
    return out


def _unpack(payload: np.ndarray) -> tuple[list[Any], Any]:
    from .format import DTYPES

    n = int.from_bytes(payload[:8].tobytes(), "little")
    head = json.loads(payload[8:8 + n].tobytes().decode())
    start = (8 + n + 63) // 64 * 64
    values = []
    for e in head["entries"]:
        if e["kind"] == "value":
            values.append(decode_value(e, "broadcast restore"))
            continue
        dt = DTYPES[e["dtype"]]
        lo = start + e["offset"]
        arr = payload[lo:lo + e["nbytes"]].copy().view(dt).reshape(e["shape"])
        if e["kind"] == "prng_key":
            values.append(HostKey(arr, e["impl"]))
        else:
            values.append(arr[()] if e.get("scalar") else arr)
    return values, head["skeleton"]


def restore_broadcast(checkpointer: Checkpointer, sync: Sync, key: str, path: str,
                      target: Mapping[str, Any] | None, *, partial: bool, verify: bool,
                      sharding: Any, options: MultiHostOptions,
                      step: int | None = None) -> dict[str, Any]:
    """Restore on the primary, broadcast to all: the other processes never read the disk.

    ``step``: the step ``path``'s name stands for, checked against its metadata.

    Every process then places the values as its own target asks (its shardings). The
    primary's success or failure is exchanged (with a time-out) before the broadcast, so a
    damaged checkpoint fails everywhere instead of leaving the others in a collective.
    """
    from .restore import finish_item, read_item_values

    me, src = sync.process_index, options.primary_host
    names = None if target is None else list(target)
    payloads: dict[str, np.ndarray] = {}
    local: BaseException | None = None
    sizes: dict[str, int] = {}
    if me == src:
        try:
            meta = checkpointer.metadata(path, step=step)
            if verify:
                checkpointer.check_listed(path, meta)
            names = list(meta.items) if names is None else names
            missing = [n for n in names if n not in meta.items]
            if missing:
                raise KeyError(f"checkpoint {path} has no item(s) {missing} "
                               f"(it has {sorted(meta.items)})")
            for name in names:
                m = checkpointer.manifest(path, name, meta)
                t = None if target is None else target[name]
                values = read_item_values(checkpointer.fs, m, t, item=name, partial=partial,
                                          verify=verify)
                payloads[name] = _pack(values, m.skeleton if t is None else None)
                sizes[name] = int(payloads[name].nbytes)
        except Exception as e:
            local = e
    statuses = sync.exchange(f"{key}/ready", failure_status(local, sizes=sizes, names=names)
                             if me == src else None, options.timeout_s,
                             f"restore of {path}: waiting for process {src} to read it")
    head = statuses[src]
    raise_failures({src: head}, me, local, f"restoring {path} on process {src}", reading=True)
    out = {}
    _fault(sync, "before_broadcast")
    for name in head["names"]:
        payload = sync.broadcast_bytes(f"{key}/item/{name}", payloads.get(name),
                                       head["sizes"][name], src, options.timeout_s,
                                       f"restore of {path}: broadcasting item '{name}' from "
                                       f"process {src}")
        values, skel = _unpack(payload)
        t = None if target is None else target[name]
        out[name] = finish_item(values, skel, t, sharding)
    return out
