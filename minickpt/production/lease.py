"""One writer per mirror prefix: the lease record, the writer that holds it, and the errors of
the mirror (split from :mod:`.mirror`, which re-exports every name)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..commit import DELETE_MARK, TMP_MARK
from ..errors import MiniCkptError


class MirrorError(MiniCkptError):
    """Checkpoints that could not be copied to the mirror, after every retry."""


class NotOursError(MirrorError):
    """A folder in the mirror that this writer did not create (or that a live writer is
    changing): it is left as it is."""


# ---------------------------------------------------------------------------------------
# the lease: one writer per mirror
# ---------------------------------------------------------------------------------------
# At the mirror's root: who writes this prefix. Made with a conditional write where the store
# has one (S3's If-None-Match / If-Match); see docs/production.md for each backend.
LEASE_FILE = ".minickpt-lease.json"


class LeaseHeldError(MirrorError):
    """Another writer holds the mirror's lease: this one may not change it."""


class LeaseLostError(MirrorError):
    """This writer's lease was taken over (``force``) or went stale: it stops writing."""


class MirrorUnavailableError(MirrorError):
    """The store did not answer (connection refused, DNS, time-out): its error, named."""


def unreachable(e: BaseException) -> bool:
    """Whether an error says the store did not answer (refused, unresolved, timed out),
    rather than that it answered no (credentials, a missing bucket): the former is waited
    out, the latter raised."""
    if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    for cls in type(e).__mro__:
        if cls.__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "urllib3",
                                            "requests", "google") \
                and any(w in cls.__name__ for w in ("Connect", "Timeout", "Endpoint")):
            return True
    return False


def named(e: BaseException, url: str) -> MirrorUnavailableError:
    """A client library's connection error as minickpt's, its type and text kept."""
    return MirrorUnavailableError(f"the mirror {url} did not answer: {type(e).__module__}."
                                  f"{type(e).__name__}: {e}")


def describe_holder(rec: Mapping[str, Any]) -> str:
    """A lease or marker record in words: writer, host, pid, age."""
    t = rec.get("time")
    age = f", last renewed {time.time() - t:.0f} s ago" if isinstance(t, (int, float)) else ""
    return (f"writer {rec.get('writer')} (host {rec.get('host')}, pid {rec.get('pid')}"
            f"{age})")


# ---------------------------------------------------------------------------------------
# the writer's identity, and when a marker's writer is gone
# ---------------------------------------------------------------------------------------
_HOST = socket.gethostname()
_LIVE: set[str] = set()  # writers of this process that have not finished
_LIVE_LOCK = threading.Lock()


class Writer:
    """Who changes the mirror: a random id, this host and pid. Live (in this process) from
    its creation until :meth:`release` — which its manager calls once nothing of it can
    still write (its copy thread has ended)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        with _LIVE_LOCK:
            _LIVE.add(self.id)

    def record(self, op: str) -> bytes:
        return json.dumps({"writer": self.id, "host": _HOST, "pid": os.getpid(), "op": op,
                           "time": time.time()}).encode()

    def release(self) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self.id)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def abandoned(record: Mapping[str, Any], stale_after_s: float) -> bool:
    """Whether the writer a marker names is gone: on this host, its process has exited (or,
    in this process, it was released); on another host (no pid to ask), its marker is older
    than ``stale_after_s`` (a writer refreshes its marker during a long upload)."""
    if record.get("host") == _HOST:
        if record.get("pid") == os.getpid():
            with _LIVE_LOCK:
                return record.get("writer") not in _LIVE
        pid = record.get("pid")
        return isinstance(pid, int) and not _pid_alive(pid)
    t = record.get("time")
    return isinstance(t, (int, float)) and time.time() - t > stale_after_s


def _base_name(name: str) -> str:
    """A step folder's name without a temporary or deletion suffix."""
    for mark in (TMP_MARK, DELETE_MARK):
        name = name.split(mark, 1)[0]
    return name


