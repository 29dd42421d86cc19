"""Joining a ``jax.distributed`` job and leaving it: the launcher's environment,
:func:`initialize`, :func:`hard_exit`, the fault-injection points of the protocol, and the one
adapter around JAX's private coordination-service client."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax

from ..errors import MultiHostError

log = logging.getLogger("minickpt")


# Environment set by ``python -m minickpt.launch`` for every process it starts.
ENV_COORDINATOR = "MINICKPT_COORDINATOR"
ENV_NUM_PROCESSES = "MINICKPT_NUM_PROCESSES"
ENV_PROCESS_ID = "MINICKPT_PROCESS_ID"
ENV_TOKEN = "MINICKPT_LAUNCH_TOKEN"
ENV_INIT_TIMEOUT = "MINICKPT_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "MINICKPT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "MINICKPT_SHUTDOWN_TIMEOUT"
# Fault injection for tests and recovery drills: "point[@process]:action,...", see minickpt.multihost.sync.fault_point.
ENV_FAULT = "MINICKPT_FAULT"


# ---------------------------------------------------------------------------------------
# the one adapter around JAX's private coordination-service client
# ---------------------------------------------------------------------------------------
class Coordination:
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
                                 "minickpt.multihost.process.initialize() (or "
                                 "jax.distributed.initialize()) before any other JAX call")
        missing = [m for m in self.METHODS if not hasattr(client, m)]
        if missing:  # pragma: no cover - depends on the JAX version
            raise MultiHostError(self._moved(f"the client lacks {missing}"))
        self.client = client

    @staticmethod
    def _moved(what: str) -> str:
        return (f"minickpt.multihost needs JAX's coordination-service client, and {what} in "
                f"JAX {jax.__version__}. It was written against JAX 0.4.30-0.10; please report "
                "this (the adapter is minickpt.multihost.process.Coordination).")

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


def is_deadline(e: BaseException) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


def named_in(message: str) -> set[int]:
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
    if Coordination.initialized() is not None:
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
        _gloo_on_loopback()
    import inspect

    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kw.items() if k in accepted})
    token = env.get(ENV_TOKEN)
    if token:  # two jobs on one port would cross-connect: check we joined our own
        c = Coordination().client
        if pid == 0:
            c.key_value_set("minickpt/launch_token", token)
        got = c.blocking_key_value_get("minickpt/launch_token", 30_000)
        if got != token:
            raise MultiHostError(f"process {pid} joined another job's coordinator at {addr}")
    return True


def _jaxlib_module() -> Any:
    """jaxlib's compiled module, where JAX finds its gloo factory: ``_jax`` in newer JAX,
    ``xla_extension`` before it was renamed; None if neither is there."""
    try:
        from jax._src.lib import _jax
    except ImportError:
        try:
            from jax._src.lib import xla_extension as _jax
        except ImportError:
            return None
    return _jax


def _gloo_on_loopback() -> None:
    """Have gloo's TCP transport (the CPU collectives) use 127.0.0.1, not this machine's
    hostname: a job on one machine then listens on the loopback only, and needs no hostname
    that resolves (a sandbox's does not: gloo fails with "device.cc:99 rv == 0. -3 vs 0").

    JAX creates the collectives without arguments; this wraps its factory (private, like
    :class:`Coordination`) to give it the hostname.
    """
    _jax = _jaxlib_module()
    if _jax is None:  # pragma: no cover - depends on the JAX version
        return
    make = getattr(_jax, "make_gloo_tcp_collectives", None)
    if make is None or getattr(make, "minickpt_loopback", False):
        return

    def on_loopback(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 2:
            kwargs.setdefault("hostname", "127.0.0.1")
        return make(*args, **kwargs)

    on_loopback.minickpt_loopback = True  # type: ignore[attr-defined]
    try:
        _jax.make_gloo_tcp_collectives = on_loopback
    except (AttributeError, TypeError):  # pragma: no cover - a read-only module
        pass


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
