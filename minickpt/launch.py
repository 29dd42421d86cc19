"""Start N local JAX processes that form one ``jax.distributed`` job.

    python -m minickpt.launch -n 4 [--devices-per-process K] [--timeout S] script.py args...
    python -m minickpt.launch -n 2 -m my.module args...

Each process gets the coordinator's address (a free port on 127.0.0.1), its process id and
the number of processes (``MINICKPT_*``, read by :func:`minickpt.multihost.process.initialize`), K
CPU devices (``--xla_force_host_platform_device_count``), ``JAX_PLATFORMS=cpu`` unless
``--platforms`` says otherwise, and unbuffered output. Each output line is prefixed with
``[p<i>]``. When one process fails, the others get ``--grace`` seconds to report what they
saw, then are killed (fail-fast); ``--timeout`` bounds the whole job. The exit status is 0
when every process exited 0, else the first failure's (128+N for a signal N, 124 for the
time-out).

This is a tool for one machine: for chapters, labs and tests. On a cluster, use its own
launcher (SLURM, Kubernetes...) and let ``jax.distributed.initialize()`` detect it.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, TextIO

from .multihost.process import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TOKEN,
)

_BIND_FAILED = "Failed to add port to server"  # the coordinator lost the race for its port


@dataclass
class LaunchResult:
    """How a launched job ended: per-process exit codes and output lines."""

    returncodes: list[int]
    outputs: list[list[str]]
    wall_s: float
    timed_out: bool = False
    port: int = 0
    first_failure: int | None = None  # the process that failed first
    exit_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    @property
    def exit_code(self) -> int:
        """What ``python -m minickpt.launch`` exits with."""
        if self.ok:
            return 0
        if self.timed_out and self.first_failure is None:
            return 124
        rc = self.returncodes[self.first_failure if self.first_failure is not None else
                              next(i for i, r in enumerate(self.returncodes) if r != 0)]
        return 128 - rc if rc < 0 else rc

    def output(self, process: int | None = None) -> str:
        """The output of one process, or of all of them (prefixed), as one string."""
        if process is not None:
            return "".join(self.outputs[process])
        return "".join(f"[p{i}] {line}" for i, lines in enumerate(self.outputs)
                       for line in lines)

    def reports(self, tag: str = "RESULT") -> list[list[Any]]:
        """The JSON values each process wrote with :func:`report` under ``tag``, in order.

        Processes share one pipe for stdout and stderr, and JAX's C++ logger writes to stderr
        from its own threads: a log line may follow a report on the same line. So each
        report is read as one JSON value from where its tag starts, and what follows is
        ignored.
        """
        marker, decoder = f"{tag} ", json.JSONDecoder()
        found: list[list[Any]] = []
        for lines in self.outputs:
            found.append([])
            for line in lines:
                at = line.find(marker)
                if at >= 0 and (at == 0 or not (line[at - 1].isalnum() or line[at - 1] == "_")):
                    try:
                        found[-1].append(decoder.raw_decode(line, at + len(marker))[0])
                    except json.JSONDecodeError:
                        continue  # the tag inside other text, not a report
        return found

    def signed_reports(self, key: bytes, tag: str = "RESULT") -> tuple[list[list[Any]],
                                                                         list[int]]:
        """The values each process wrote with :func:`report` signed by ``key``, and how
        many lines of each carried the tag without a valid signature (written by other
        code of the process: the student's, in a lab's worker, earns nothing that way)."""
        found: list[list[Any]] = []
        forged: list[int] = []
        for lines in self.outputs:
            values, bad = read_signed(lines, key, tag)
            found.append(values)
            forged.append(bad)
        return found, forged

    def describe(self) -> str:
        codes = ", ".join(f"p{i}={rc}" for i, rc in enumerate(self.returncodes))
        return (f"{len(self.returncodes)} processes, exit codes {codes}"
                + (", timed out" if self.timed_out else "") + f", {self.wall_s:.1f} s")


def read_signed(lines: Sequence[str], key: bytes, tag: str = "RESULT") -> tuple[list[Any], int]:
    """The values of the lines :func:`report` signed with ``key``, in order, and how many
    lines carried ``tag`` without a valid signature (written by other code of the process)."""
    marker, decoder = f"{tag} ", json.JSONDecoder()
    found: list[Any] = []
    forged = 0
    for line in lines:
        at = line.find(marker)
        if at < 0 or (at > 0 and (line[at - 1].isalnum() or line[at - 1] == "_")):
            continue
        rest = at + len(marker)
        mac, _, _ = line[rest:].partition(" ")
        start = rest + len(mac) + 1
        try:
            value, end = decoder.raw_decode(line, start)
        except (json.JSONDecodeError, ValueError):
            forged += 1
            continue
        want = "mac=" + hmac.new(key, line[start:end].encode(), "sha256").hexdigest()
        if hmac.compare_digest(mac, want):
            found.append(value)
        else:
            forged += 1
    return found, forged


def report(value: Any, tag: str = "RESULT", key: bytes | None = None) -> None:
    """Write ``tag {json}`` as one line in one ``write``, for :meth:`LaunchResult.reports`;
    with ``key``, ``tag mac=<HMAC-SHA256 of the json> {json}``, for
    :meth:`LaunchResult.signed_reports` (a line anyone else in the process prints is not
    taken for the harness's).

    Launched processes are unbuffered, where ``print`` writes the text and its newline in two
    calls, and another thread's log line can land between them. One ``os.write`` of less
    than ``PIPE_BUF`` bytes to a pipe is never interleaved.
    """
    text = json.dumps(value, default=repr)
    if key is not None:
        text = f"mac={hmac.new(key, text.encode(), 'sha256').hexdigest()} {text}"
    data = f"{tag} {text}\n".encode()
    sys.stdout.flush()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]


def signer(key_env: str, tag: str = "RESULT") -> tuple[Callable[[Any], None],
                                                     Callable[[CodeType], None]]:
    """For a harness's worker: ``send(value)`` writes a :func:`report` signed with the key
    the parent passed down a pipe (descriptor in ``os.environ[key_env]``), read and the pipe
    closed here, before the student's code runs. Only the code that called ``signer``, and
    the code objects given to ``permit``, may send: a call from anywhere else writes
    nothing. So a line the student's code prints, or writes and then ``os._exit``s, is never
    taken for the harness's (:func:`read_signed`)."""
    fd = os.environ.pop(key_env, "")
    key = b""
    if fd.isdigit():
        try:
            key = os.read(int(fd), 32)
        finally:
            os.close(int(fd))
    allowed = {sys._getframe(1).f_code}

    def send(value: Any) -> None:
        if sys._getframe(1).f_code in allowed:
            report(value, tag=tag, key=key)
    return send, allowed.add


@contextlib.contextmanager
def key_pipe(key: bytes, processes: int) -> Iterator[int]:
    """The read end of a pipe holding ``key`` once per process (each reads its copy: at most
    ``PIPE_BUF`` bytes in all, so the write never blocks), for ``pass_fds``; closed after.
    One per launch: the processes drain it, and a job started again (:func:`lost_port_race`)
    needs a full one, or its processes sign with no key and every report reads as forged."""
    r, w = os.pipe()
    try:
        os.write(w, key * processes)
        os.close(w)
        w = -1
        yield r
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def lost_port_race(result: LaunchResult) -> bool:
    """Whether the job's coordinator could not bind its port (another program took it after
    :func:`pick_free_port`): the job is to be started again, on a new port."""
    return any(_BIND_FAILED in line for line in result.outputs[0])


def loopback_refused(host: str = "127.0.0.1", timeout_s: float = 2.0) -> str | None:
    """Why this machine cannot run a local ``jax.distributed`` job, in one sentence, or None.

    The coordinator and its clients talk TCP over ``host``; some sandboxes (a TPU VM's
    container, a grader without a network namespace of its own) refuse every TCP socket, even
    on loopback. Probed for real: listen, connect, accept, so a chapter or a lab can say so in
    one line and skip what needs the processes instead of failing in each of them.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.settimeout(timeout_s)
            server.bind((host, 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=timeout_s):
                conn, _ = server.accept()
                conn.close()
    except OSError as e:
        return (f"this machine refuses TCP sockets on {host} ({type(e).__name__}: {e}), which "
                "jax.distributed needs to join processes into one job")
    return None


class LaunchRefused(RuntimeError):
    """The processes of a job cannot be started here (see :func:`loopback_refused`)."""


def helper_env(env: Mapping[str, str] | None = None, *, platforms: str = "cpu",
               **extra: str) -> dict[str, str]:
    """The environment of a helper process (a drill's training worker, a reader of files):
    ``env`` (default: this process's), with ``JAX_PLATFORMS`` set to ``platforms``.

    Why always set: a process inherits no choice of platform, so JAX in it takes the
    accelerator it finds, and on a TPU only one process may hold the chip ("libtpu
    multi-process lockfile"): the helper of a notebook that holds it would fail. A helper
    that only trains a small model or reads files runs on the CPU; one whose point is the
    accelerator says so with ``platforms``, after its parent gave the device up.
    """
    out = dict(os.environ if env is None else env)
    out["JAX_PLATFORMS"] = platforms
    out.update(extra)
    return out


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another program may still take it: the
    launcher retries on a new port when the coordinator cannot bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(process_id: int, num_processes: int, port: int, *,
              devices_per_process: int = 1, platforms: str | None = "cpu",
              env: Mapping[str, str] | None = None, token: str = "",
              heartbeat_timeout_s: int | None = None) -> dict[str, str]:
    """The environment of one launched process."""
    out = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}  # JAX: may hang
    flags = [f for f in out.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    out["XLA_FLAGS"] = " ".join(flags)
    if platforms:
        out["JAX_PLATFORMS"] = platforms
    out.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(num_processes),
                ENV_PROCESS_ID: str(process_id), ENV_TOKEN: token, "PYTHONUNBUFFERED": "1"})
    if heartbeat_timeout_s is not None:
        out[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    out.update(env or {})
    return out


Spawn = Callable[[list[str], dict[str, str], "str | None", tuple[int, ...]], Any]
"""How :func:`launch` may start one process: ``(argv after python, env, cwd, pass_fds)`` → an
object with Popen's ``pid`` (its own process group), ``stdout`` (text lines), ``poll``,
``wait`` and ``returncode``."""


def launch(argv: Sequence[str], num_processes: int, *, devices_per_process: int = 1,
           timeout_s: float = 600.0, grace_s: float = 10.0, platforms: str | None = "cpu",
           env: Mapping[str, str] | None = None,
           env_per_process: Mapping[int, Mapping[str, str]] | None = None,
           echo: TextIO | None = None, cwd: str | None = None,
           heartbeat_timeout_s: int | None = None, port_retries: int = 2,
           pass_fds: Sequence[int] = (), spawn: Spawn | None = None) -> LaunchResult:
    """Run ``python *argv`` as ``num_processes`` processes of one JAX job; wait for them.

    ``argv`` is what follows ``python``: ``["train.py", "--steps", "10"]`` or
    ``["-m", "pkg.mod"]``. Output lines are collected (and copied to ``echo`` with a
    ``[p<i>]`` prefix). Once a process exits non-zero the others are killed ``grace_s``
    seconds later; everything is killed at ``timeout_s``. ``pass_fds``: file descriptors
    every process inherits (every attempt's: a pipe its processes drain, like a report key,
    is empty for a job started again after a lost port race, so launch such a job with
    ``port_retries=0`` and a new pipe each time: :func:`key_pipe`, :func:`lost_port_race`).
    ``spawn(argv, env, cwd, pass_fds)`` starts one process (default: a new interpreter; one
    that raises ChildProcessError: a new interpreter from then on): a grader forks them from
    a server that imported JAX once.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("num_processes and devices_per_process must be >= 1")
    refused = loopback_refused()
    if refused is not None:
        raise LaunchRefused(refused)
    token = f"{os.getpid()}-{time.time_ns()}"
    for attempt in range(port_retries + 1):
        port = pick_free_port()
        result = _run_once(argv, num_processes, port, token, devices_per_process, timeout_s,
                           grace_s, platforms, env, env_per_process, echo, cwd,
                           heartbeat_timeout_s, tuple(pass_fds), spawn)
        if attempt < port_retries and lost_port_race(result):
            if echo is not None:
                echo.write(f"[launch] the coordinator could not bind port {port}; retrying\n")
            continue
        return result
    return result  # pragma: no cover - the loop always returns


def _run_once(argv: Sequence[str], n: int, port: int, token: str, k: int, timeout_s: float,
              grace_s: float, platforms: str | None, env: Mapping[str, str] | None,
              env_per_process: Mapping[int, Mapping[str, str]] | None, echo: TextIO | None,
              cwd: str | None, heartbeat_timeout_s: int | None,
              pass_fds: tuple[int, ...] = (), spawn: Spawn | None = None) -> LaunchResult:
    outputs: list[list[str]] = [[] for _ in range(n)]
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    t0 = time.monotonic()
    try:
        for i in range(n):
            e = child_env(i, n, port, devices_per_process=k, platforms=platforms,
                          env={**(env or {}), **((env_per_process or {}).get(i, {}))},
                          token=token, heartbeat_timeout_s=heartbeat_timeout_s)
            if spawn is not None:  # (in its own process group, its output one text stream)
                try:
                    procs.append(spawn(list(argv), e, cwd, pass_fds))
                    continue
                except ChildProcessError:  # it cannot: this one and the rest start anew
                    spawn = None
            procs.append(subprocess.Popen([sys.executable, *argv], env=e, cwd=cwd,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                          errors="replace", start_new_session=True,
                                          pass_fds=pass_fds))

        def pump(i: int, p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                with lock:
                    outputs[i].append(line)
                    if echo is not None:
                        echo.write(f"[p{i}] {line}")
                        echo.flush()

        pumps = [threading.Thread(target=pump, args=(i, p), daemon=True)
                 for i, p in enumerate(procs)]
        for t in pumps:
            t.start()
        deadline = t0 + timeout_s
        exit_times: list[float | None] = [None] * n
        first_failure = None
        timed_out = False
        while True:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if exit_times[i] is None and p.poll() is not None:
                    exit_times[i] = now - t0
                    if p.returncode != 0 and first_failure is None:
                        first_failure = i
                        deadline = min(deadline, now + grace_s)
            if all(t is not None for t in exit_times):
                break
            if now > deadline:
                timed_out = first_failure is None
                break
            time.sleep(0.02)
    finally:
        for p in procs:  # fail-fast, time-out, or the launcher itself interrupted
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()
    for t in pumps:
        t.join(timeout=5)
    end = time.monotonic() - t0
    return LaunchResult([int(p.returncode) for p in procs], outputs, end, timed_out, port,
                        first_failure, [end if t is None else t for t in exit_times])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m minickpt.launch",
        description="Run a script as N processes of one jax.distributed job on this machine.")
    ap.add_argument("-n", "--num-processes", type=int, required=True)
    ap.add_argument("-k", "--devices-per-process", type=int, default=1,
                    help="CPU devices per process (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="kill every process after this many seconds (default 600)")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="once a process fails, kill the others this many seconds later, so "
                         "they can report what they saw (default 10)")
    ap.add_argument("--platforms", default="cpu",
                    help="JAX_PLATFORMS for the processes (default cpu; '' leaves it unset)")
    ap.add_argument("--heartbeat-timeout", type=int, default=None,
                    help="jax.distributed heartbeat_timeout_seconds (default JAX's, 100)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment for every process; K@i=V for process i only")
    ap.add_argument("-m", dest="module", help="run a module, like python -m")
    ap.add_argument("script", nargs="?", help="the Python script to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    if a.module is None and a.script is None:
        ap.error("give a script, or -m module")
    cmd = ["-m", a.module, *([a.script] if a.script else []), *a.args] if a.module \
        else [a.script, *a.args]
    env: dict[str, str] = {}
    per: dict[int, dict[str, str]] = {}
    for kv in a.env:
        key, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"--env {kv!r}: expected K=V")
        name, at, who = key.partition("@")
        if at:
            per.setdefault(int(who), {})[name] = value
        else:
            env[name] = value
    try:
        res = launch(cmd, a.num_processes, devices_per_process=a.devices_per_process,
                     timeout_s=a.timeout, grace_s=a.grace, platforms=a.platforms or None,
                     env=env, env_per_process=per, echo=sys.stdout,
                     heartbeat_timeout_s=a.heartbeat_timeout)
    except LaunchRefused as e:
        print(f"[launch] not started: {e}", file=sys.stderr)
        return 2
    print(f"[launch] {res.describe()}", file=sys.stderr)
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main())
