"""A fork server for the student's workers: one process per submission, started in its
sandbox as a worker is, that has imported what every worker imports (JAX, numpy, minickpt:
:data:`.worker.PRELOAD`) and forks a worker on request (:func:`.worker.serve_forks`).

Why: importing JAX costs about a CPU-second. Lab 4's judged jobs start a worker for each of
their 4 processes, some 40 per submission; forked, a worker starts in milliseconds. A forked
worker is the same program in the same sandbox as a started one: it gets the student's code
over its own connection afterwards, and nothing of another worker's. Nothing of the judge's
is in the server: it holds imported libraries, never a test, a verdict or the student's code.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from . import wire, worker

TRUSTED_PRELOAD = ("numpy", "msgpack", "jax", "jax.numpy", "jax.sharding", "minickpt",
                   "minickpt.launch", "minickpt.labkit", "minickpt.labkit.lab4",
                   "minickpt.labkit.lab4_judged", "minickpt.multihost.process",
                   "minickpt.multihost.sync", "autograder.judge.session")
"""What the trusted server imports for lab 4's JAX processes (the judge's code, outside the
sandbox): each then starts with its job's environment, as a new interpreter would."""


class ForkedProcess:
    """A worker the server forked: the part of :class:`subprocess.Popen` the judge uses."""

    def __init__(self, server: Zygote, pid: int, out_fd: int, *, text: bool = False) -> None:
        """``out_fd``: the read end of its stderr (a worker: bytes) or of its stdout and
        stderr together (a script: text, as a launched process's)."""
        self._server, self.pid = server, pid
        self.stdout: Any = None
        self.stderr: Any = None
        if text:
            self.stdout = open(out_fd, encoding="utf-8", errors="replace")
        else:
            self.stderr = os.fdopen(out_fd, "rb")
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self._server.kill(self.pid)

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()


def program(preload: tuple[str, ...] | None = None) -> str:
    """The server's program: :mod:`.wire` and :mod:`.worker` as the worker's, then the loop
    (importing ``preload``, default :data:`.worker.PRELOAD`)."""
    from .session import worker_program

    loop = "serve_forks(conn)" if preload is None else f"serve_forks(conn, {tuple(preload)!r})"
    return worker_program().replace("\n\nmain(conn)\n", f"\n\n{loop}\n")


class Zygote:
    """The judge's side of one fork server."""

    def __init__(self, folder: str, *, wrap: Callable[[list[str], dict[str, str]], list[str]]
                 | None = None, timeout: float = 60.0, env: dict[str, str] | None = None,
                 preload: tuple[str, ...] | None = None) -> None:
        """``env``: a trusted server's environment (default: a student's worker's)."""
        from .session import worker_env

        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-c", worker.BOOT, str(theirs.fileno())]
        trusted = env is not None
        env = dict(env) if env is not None else worker_env()
        if wrap is not None:
            argv = wrap(argv, env)
        elif not trusted and os.environ.get("PYTHONPATH"):  # the same minickpt as here
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env,
                                     pass_fds=(theirs.fileno(),), cwd=folder)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()  # one fork request (and its reply) at a time
        self._send = threading.Lock()  # one message (with its descriptors) on the wire at a time
        self._replies: queue.Queue[int | None] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits read before their fork's reply was taken
        self._state = threading.Lock()
        self._closed = False
        try:
            self._conn.send_bytes(program(preload).encode())
            if not self._conn.poll(timeout * 2):
                raise wire.WireError(f"the fork server did not start in {timeout * 2:.0f} s")
            if not msgpack.unpackb(self._conn.recv_bytes(1 << 16), raw=False).get("ready"):
                raise wire.WireError("the fork server did not start")
        except BaseException:
            self.close()
            raise
        self._timeout = timeout
        threading.Thread(target=self._read, daemon=True, name="judge-zygote").start()

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def fork(self) -> tuple[socket.socket, ForkedProcess]:
        """A new worker: the judge's end of its connection (send it the job, as to a worker
        started afresh, but not the program: it has it) and its process."""
        ours, theirs = socket.socketpair()
        try:
            proc = self._request({"op": "fork", "handles": 2}, [theirs.fileno()], text=False)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours, proc

    def run(self, argv: list[str], env: dict[str, str], cwd: str | None,
            pass_fds: tuple[int, ...] = ()) -> ForkedProcess:
        """``python *argv`` as a child of the server (a trusted one's: outside the sandbox),
        with ``env``, in ``cwd``, given ``pass_fds`` at their numbers: what
        :func:`minickpt.launch.launch` asks of a new process (its ``spawn``)."""
        msg = {"op": "run", "handles": 1 + len(pass_fds), "argv": list(argv), "env": env,
               "cwd": cwd or os.getcwd(), "fds": list(pass_fds)}
        return self._request(msg, list(pass_fds), text=True)

    def _request(self, msg: dict[str, Any], fds: list[int], *, text: bool) -> ForkedProcess:
        """Send ``msg``, the write end of a new output pipe, then ``fds``; the child."""
        if not self.alive():
            raise ChildProcessError("the fork server has ended")
        with self._lock:
            r, w = os.pipe()
            try:
                with self._send:
                    self._conn.send_bytes(msgpack.packb(msg))
                    if msg["op"] == "fork":  # (a worker: its connection, then its stderr)
                        order = [*fds, w]
                    else:  # (a script: its output, then its descriptors)
                        order = [w, *fds]
                    for fd in order:
                        reduction.send_handle(self._conn, fd, self.proc.pid)
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
            try:
                pid = self._replies.get(timeout=self._timeout)
            except queue.Empty:  # (a late answer would be taken as the next one's)
                self.close()
                pid = None
            if pid is None:
                os.close(r)
                raise ChildProcessError("the fork server did not fork")
            proc = ForkedProcess(self, pid, r, text=text)
            with self._state:
                self._children[pid] = proc
                if pid in self._early:
                    proc._exited(self._early.pop(pid))
        return proc

    def kill(self, pid: int) -> None:
        if not self.alive():
            return
        with contextlib.suppress(OSError), self._send:
            self._conn.send_bytes(msgpack.packb({"op": "kill", "pid": pid}))

    def _read(self) -> None:
        """The server's messages: a fork's pid (to the request waiting for it), an exit."""
        try:
            while True:
                msg = msgpack.unpackb(self._conn.recv_bytes(1 << 16), raw=False)
                if "pid" in msg:
                    self._replies.put(int(msg["pid"]))
                elif "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    with self._state:
                        proc = self._children.pop(pid, None)
                        if proc is None:
                            self._early[pid] = code
                    if proc is not None:
                        proc._exited(code)
        except (EOFError, OSError, ValueError, msgpack.UnpackException):
            pass
        finally:
            self._ended()

    def _ended(self) -> None:
        """The server is gone, and its workers with it (its sandbox's PID namespace, or
        their parent-death signal outside one)."""
        self._closed = True
        self._replies.put(None)
        with self._state:
            procs, self._children = list(self._children.values()), {}
        for p in procs:
            p._exited(-9)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


class Servers:
    """A fork server started on first use, and again once the last one ended (a drill ends
    the slot's processes); after ``tries`` starts, or where none starts, None: the caller
    then starts its processes one by one, as without a server."""

    def __init__(self, make: Callable[[], Zygote], tries: int = 8) -> None:
        self._make, self._tries, self._starts = make, tries, 0
        self._started: list[Zygote] = []
        self._current: Zygote | None = None

    def get(self) -> Zygote | None:
        if self._current is not None and self._current.alive():
            return self._current
        if self._current is not None:
            self._current.close()
        self._current = None
        if self._starts < self._tries:
            self._starts += 1
            try:
                self._current = self._make()
                self._started.append(self._current)
            except (wire.WireError, OSError):
                pass
        return self._current

    def method(self, name: str) -> Callable[[], Any]:
        """``get().<name>`` as a value for later (None where there is no server)."""
        return lambda: getattr(z, name) if (z := self.get()) is not None else None

    def close(self) -> None:
        for z in self._started:
            z.close()
