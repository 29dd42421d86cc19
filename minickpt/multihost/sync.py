"""How the processes of a job talk and agree: :class:`Sync` (exchange a small JSON value
with every process at a barrier with a time-out), its implementations (one process, a
``jax.distributed`` job, threads playing processes), and agreement on the step (Task 4.1)."""

from __future__ import annotations

import base64
import errno
import itertools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import MultiHostError, PeerTimeoutError, ProcessDisagreementError
from ..format.buffers import aligned_empty
from .coordinator import lost_coordinator
from .process import ENV_FAULT, Coordination, hard_exit, is_deadline, named_in

log = logging.getLogger("minickpt")


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
        self._coord = Coordination()
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
        try:
            c.key_value_set(f"{base}/{me}", json.dumps(value), allow_overwrite=True)
            c.wait_at_barrier(base, max(1, int(timeout_s * 1000)))
        except Exception as e:
            dead = lost_coordinator(e, what or key, timeout_s, me)
            if dead is not None:  # process 0, and the coordination service with it
                raise dead from e
            if not is_deadline(e):
                raise MultiHostError(f"{what or key}: the coordination service failed: {e}") from e
            arrived = self._arrived(base)
            missing = (set(range(n)) - arrived) | named_in(str(e))
            raise PeerTimeoutError(what or key, missing - {me} or missing, timeout_s) from None
        try:
            values = dict(self._read_all(base))
        except Exception as e:  # process 0 died right after the barrier
            dead = lost_coordinator(e, what or key, timeout_s, me)
            if dead is not None:
                raise dead from e
            raise
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
                try:
                    self._set_bytes(f"{data_key}/{i}", bytes(raw[i * chunk:(i + 1) * chunk]))
                except Exception as e:
                    dead = lost_coordinator(e, what, timeout_s, me)
                    if dead is not None:
                        raise dead from e
                    raise
        # every chunk is in the store once the source arrives here
        self.exchange(f"{key}/sent", nchunks if me == src else None, timeout_s,
                      f"{what}: waiting for the data")
        if me == src:
            out = np.asarray(data, np.uint8).reshape(-1)
        else:
            out = aligned_empty((nbytes,), np.uint8)  # fresh memory: plain pages
            deadline = time.monotonic() + timeout_s
            for i in range(nchunks):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    got = self._get_bytes(f"{data_key}/{i}", left_ms)
                except Exception as e:
                    dead = lost_coordinator(e, what, timeout_s, me)
                    if dead is not None:
                        raise dead from e
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
    state = Coordination.initialized()
    if state is None or state[1] == 1:
        return SingleProcessSync()
    if not isinstance(_DEFAULT, DistributedSync):
        _DEFAULT = DistributedSync()
    return _DEFAULT


def agree(values: Sequence[Any], what: str) -> Any:
    """The value every process passed; :class:`ProcessDisagreementError` if they differ."""
    if not values:
        raise ValueError("no values to agree on")
    if any(v != values[0] for v in values[1:]):
        raise ProcessDisagreementError(what, values)
    return values[0]


def agree_on_step(steps: Sequence[int]) -> int:
    """Task 4.1 — the step every process wants to save (``steps[p]`` from process p).

    Pure: the all-gather that collects ``steps`` is :meth:`Sync.exchange`, and every process
    calls this with the same list, so every process reaches the same verdict: all go on
    with one step, or all raise. Processes that disagree would mix two training states in
    one checkpoint (each process's shards from its own step): raise
    :class:`ProcessDisagreementError` naming each process and its step. A step is a Python
    int >= 0 (not a bool, a float or a numpy integer, which ``CheckpointManager.save``
    refuses too); anything else is a plain ``ValueError`` (not a disagreement: a bug in the
    process that sent it) naming the first such process, even when the valid steps also
    disagree. An empty list is a ``ValueError`` too.
    """
    if len(steps) == 0:
        raise ValueError("no steps to agree on: every process reports the step it saves")
    for p, s in enumerate(steps):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"process {p} wants to save step {s!r}: a step is an int >= 0")
    if any(s != steps[0] for s in steps):
        raise ProcessDisagreementError("the step to save", list(steps))
    return int(steps[0])


def fault_point(sync: Sync, point: str) -> None:
    """A named point of the protocol where a test or a drill can inject a failure.

    ``MINICKPT_FAULT="after_write@2:kill"`` SIGKILLs process 2 once its shards are written;
    actions: ``kill``, ``exit`` (code 13), ``hang``, ``sleep=S``, ``raise`` (EIO). Points:
    ``after_agree``, ``after_create``, ``before_write``, ``after_write``, ``before_commit``,
    ``after_commit``
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
