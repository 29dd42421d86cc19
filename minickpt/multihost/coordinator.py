"""When process 0 dies, JAX's coordination service (which it hosts) dies with it.

The survivors' call in flight (a barrier, a key-value write) then fails with a raw
``JaxRuntimeError: UNAVAILABLE: ... Connection reset by peer``, which names nobody:
:func:`lost_coordinator` turns it into the :class:`PeerTimeoutError` the library raises for
any dead peer, naming process 0 as unreachable.

What cannot be done from Python (JAX 0.10): within about a second, the client's
error-polling thread terminates the process itself (``client.h``: "Terminating process
because the JAX distributed service detected fatal errors"), from C++, whatever Python is
doing. The only hook, the client factory's ``missed_heartbeat_callback``, is not reachable
through ``jax.distributed.initialize``, and when injected it aborts anyway: the
``absl::Status`` it is called with has no Python conversion (``std::bad_cast``, then
``std::terminate``). So a survivor gets this error when its call fails before that thread
fires — it can then report and ``hard_exit`` — and is otherwise ended by JAX. Either way
nothing is committed, and the next primary removes the temporary directory.
"""

from __future__ import annotations

from ..errors import PeerTimeoutError

# how gRPC and the coordination service say that the service's host is gone
_UNREACHABLE = ("UNAVAILABLE", "Connection reset by peer", "Socket closed",
                "failed to connect to all addresses")


def lost_coordinator(e: BaseException, what: str, timeout_s: float,
                     me: int) -> PeerTimeoutError | None:
    """The error to raise for a failed coordination-service call when process 0 (hosting
    the service) is gone; None when ``e`` says nothing of the kind."""
    if me == 0 or not any(m in str(e) for m in _UNREACHABLE):
        return None
    why = str(e).strip().splitlines()[0][:300]
    return PeerTimeoutError(what, [0], timeout_s, "process 0 hosts JAX's coordination service "
                            f"and cannot be reached: it died, or its host is unreachable "
                            f"({why}); nothing was committed by this operation")
