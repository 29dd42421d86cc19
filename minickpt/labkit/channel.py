"""The channel between a grader's drill and its sandboxed workers (issue 47).

A drill's plan (what to save, with which values, where it fails, how the loop is set up) must
reach the student's code only as the arguments of the calls it is judged on: never in
``argv``, the environment or a file the worker can read before it is called. So a worker
starts knowing only its folder; it loads the student's definitions first, and only then
connects to a Unix socket the grader listens on in that folder and receives the plan there,
message by message, as the drill goes on.

The transport is the standard library's :class:`multiprocessing.connection.Connection`
(length-prefixed frames), used with ``send_bytes``/``recv_bytes`` and JSON only: never
``send``/``recv``, which would unpickle what a sandboxed process wrote.
"""

from __future__ import annotations

import json
import os
import socket
from multiprocessing.connection import Connection
from typing import Any

MAX_MESSAGE = 1 << 20
"""The largest message either side reads (a plan or a report is a few kilobytes)."""

SOCKET_NAME = "drill.sock"


class ChannelError(Exception):
    """The other side sent nothing in time, closed the channel, or sent what is not JSON."""


def _address(path: str, dirfd: int) -> str:
    """``path`` as a socket address: a Unix socket's path has at most 107 bytes, so a long one
    is reached through the open directory (``/proc/self/fd/N/name``)."""
    if len(os.fsencode(path)) < 100:
        return path
    return f"/proc/self/fd/{dirfd}/{os.path.basename(path)}"


class Listener:
    """The grader's end: a socket in ``directory`` that the workers connect to."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, SOCKET_NAME)
        self._dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(_address(self.path, self._dirfd))
            os.chmod(self.path, 0o666)  # the workers run as the slot's uid
            self._sock.listen(16)
        except BaseException:
            self.close()
            raise

    def accept(self, timeout_s: float) -> Connection | None:
        """The next worker's connection, or None when none came within ``timeout_s``."""
        self._sock.settimeout(timeout_s)
        try:
            s, _ = self._sock.accept()
        except (TimeoutError, OSError):
            return None
        s.setblocking(True)
        return Connection(s.detach())

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            if self._dirfd >= 0:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
                os.close(self._dirfd)
                self._dirfd = -1

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(directory: str) -> Connection:
    """A worker's end: connect to the grader listening in ``directory``."""
    path = os.path.join(directory, SOCKET_NAME)
    dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(_address(path, dirfd))
    finally:
        os.close(dirfd)
    return Connection(s.detach())


def send(conn: Connection, value: Any) -> None:
    """One message: ``value`` as JSON."""
    conn.send_bytes(json.dumps(value).encode())


def recv(conn: Connection, timeout_s: float) -> Any:
    """The next message, decoded from JSON; :class:`ChannelError` when none came within
    ``timeout_s``, the other side is gone, or it is not a JSON message of at most
    :data:`MAX_MESSAGE` bytes."""
    try:
        if not conn.poll(timeout_s):
            raise ChannelError(f"nothing came within {timeout_s:.0f} s")
        data = conn.recv_bytes(MAX_MESSAGE)
    except (EOFError, OSError) as e:
        raise ChannelError(f"the channel closed ({type(e).__name__})") from None
    try:
        return json.loads(data)
    except ValueError:
        raise ChannelError("a message that is not JSON") from None
