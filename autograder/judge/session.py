"""The judge's side of one submission: start the student's worker (in the sandbox when there
is one), bind proxies to its task functions, run the lab's tests here, end the worker.

Who decides a point: :func:`judge_lab` returns the verdict of every test cell, and only the
code of the test, running in this process, can make one pass. What the worker returns is data
the test checks; what it prints goes nowhere; if it dies, every later call fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack

from . import cells as cells_mod
from . import wire, worker
from .zygote import TRUSTED_PRELOAD, Servers, Zygote

CALL_TIMEOUT = 60.0
"""How long one call into the worker may take before the test that made it fails."""


class Refused(PermissionError):
    """The worker asked the judge for something outside the test's folder."""


def confined_policy(roots: Sequence[str]) -> wire.Policy:
    """What the worker may do with the judge's objects: call their methods and set their
    attributes (a writer's thread, as the contract of lab 5 says), never reach a class, a
    module or a function through them, and never name a path outside ``roots`` (the folder
    the test works in) to one of minickpt's objects: the judge's file systems, batches and
    managers act only there."""
    real = [os.path.realpath(r) for r in roots]

    def check(obj: Any, name: str, args: tuple, kwargs: dict) -> None:
        import types

        owner = obj.__self__ if isinstance(obj, types.MethodType) else obj
        if isinstance(owner, types.FunctionType) or \
                not type(owner).__module__.startswith("minickpt"):
            return  # a test's own callback: its arguments are the test's business
        for a in [*args, *kwargs.values()]:
            if isinstance(a, (str, os.PathLike)) and os.sep in os.fspath(a):
                p = os.path.realpath(os.fspath(a))
                if not any(p == r or p.startswith(r + os.sep) for r in real):
                    raise Refused(f"{type(obj).__name__}.{name}: {os.fspath(a)!r} is outside "
                                  "the folder this test works in")

    return wire.Policy(private=True, setattr=True, check=check)


class StudentWorker:
    """The student's worker process and the wire to it."""

    def __init__(self, lab: str, student_cells: Sequence[str], folder: str, *,
                 wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
                 timeout: float = CALL_TIMEOUT, zygote: Any = None,
                 forked: socket.socket | None = None) -> None:
        """``zygote``: forks the worker (:class:`.zygote.Zygote`) rather than starting it;
        ``forked``: the connection to a worker forked already (by the judge, for a trusted
        process of a test: :func:`worker_in_process`)."""
        self.lab, self.folder, self.wrap, self.timeout = lab, folder, wrap, timeout
        self.zygote, self.forked = zygote, forked
        self.parse_problems: list[str] = []
        self.cells = worker.student_code(list(student_cells), self.parse_problems)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ep: wire.Endpoint | None = None
        self.functions: dict[str, Any] = {}
        self.control: Any = None
        self.problems: list[str] = []
        self.stderr: list[bytes] = []

    def start(self, setup: str, names: Sequence[str]) -> dict[str, Any]:
        if self.forked is not None:  # its process is the judge's to end
            ours = self.forked
        elif self.zygote is not None:
            ours, self.proc = self.zygote.fork()
        else:
            ours, theirs = socket.socketpair()
            argv = [sys.executable, "-c", worker.BOOT, str(theirs.fileno())]
            env = worker_env()
            if self.wrap is not None:
                argv = self.wrap(argv, env)
            elif os.environ.get("PYTHONPATH"):  # no sandbox: the same minickpt as this process
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         env=env, pass_fds=(theirs.fileno(),), cwd=self.folder)
            theirs.close()
        if self.proc is not None:
            threading.Thread(target=self._drain, daemon=True).start()
        conn = Connection(ours.detach())
        if self.forked is None and self.zygote is None:  # a forked worker has its program
            conn.send_bytes(worker_program().encode())
        conn.send_bytes(msgpack.packb({"setup": setup, "cells": self.cells,
                                       "names": list(names)}, use_bin_type=True))
        if not conn.poll(self.timeout * 2):
            self.close()
            raise wire.WireError("your code did not finish loading in the worker in "
                                 f"{self.timeout * 2:.0f} s")
        hello = msgpack.unpackb(conn.recv_bytes(1 << 20), raw=False)
        self.problems = [*self.parse_problems, *(str(p) for p in hello.get("problems", []))]
        self.ep = wire.Endpoint(conn, "judge", confined_policy([self.folder]),
                                timeout=self.timeout)
        found = dict(hello.get("functions", {}))
        control = self.control = self.ep.decode(found.pop("__control__"))
        self.functions = {name: _named(self.ep.decode(enc), name)
                          for name, enc in found.items() if name in names}
        self.ep.start()
        control.set_sinks(_log_sink, _warn_sink)
        return self.functions

    def alive(self) -> bool:
        """Whether the worker still answers: its process runs, its wire is open and no call
        into it has timed out."""
        running = self.proc.poll() is None if self.proc is not None else \
            self.forked is not None  # (a forked worker's process is its judge's to watch)
        return running and self.ep is not None and self.ep._closed is None \
            and not self.ep.timed_out

    def mirror(self, name: str) -> Callable[[], None]:
        """The test's set-up ``name`` made in the worker too; returns how to undo it."""
        if self.control is None:
            return lambda: None
        key = self.control.enter(name)
        return lambda: self.control.leave(key)

    def _drain(self) -> None:
        """The worker's stderr, read as it comes (a full pipe would stop it), kept short."""
        assert self.proc is not None and self.proc.stderr is not None
        kept = 0
        for line in self.proc.stderr:
            if kept < 64 << 10:
                self.stderr.append(line)
                kept += len(line)

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


def worker_env() -> dict[str, str]:
    """The environment a student's worker is started with (the sandbox keeps what it passes)."""
    return {"JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


FD_TOKEN = "@@judge-worker-fd@@"
"""Where the worker's descriptor goes in a command the judge wrapped for another process to
start (:func:`worker_spec`): that process puts its own socket's number there."""


def worker_spec(lab: str, student_cells: Sequence[str], folder: str, setup: str, *,
                wrap: Callable[[list[str], dict[str, str]], list[str]] | None,
                timeout: float, outside: str, fork: Callable[[], Any] | None = None,
                spawn: Callable[[], Any] | None = None) -> Callable[[], dict[str, Any]]:
    """How a trusted process a test starts (lab 4's :func:`minickpt.labkit.lab4.run_processes`:
    each JAX process of the job) starts a student's worker of its own, as data: the lab's setup
    cell, the student's cells, the lab's task names, the worker's folder and its command
    already wrapped in the sandbox (the descriptor left as :data:`FD_TOKEN`), and ``private``,
    a fresh folder outside the sandbox's view (mode 0700) where the test's own script goes.
    No line of a test: the test's text stays in that script, in the trusted process.
    Each call wraps anew (the sandbox's wrap readies ``folder`` for the slot's uid).

    ``fork`` and ``spawn`` (the judge's, not data: the caller pops them) return the fork
    servers' :meth:`.zygote.Zygote.fork` (the caller forks the workers its processes will use
    and hands each its connection: :func:`worker_in_process`'s ``fd``) and
    :meth:`.zygote.Zygote.run` (how it starts those trusted processes), or None."""
    names = list(cells_mod.lab_task_names(lab))
    root = str(Path(__file__).resolve().parents[2])  # where ``autograder`` is imported from

    def spec() -> dict[str, Any]:
        argv = None
        if wrap is not None:
            argv = list(wrap([sys.executable, "-c", worker.BOOT, FD_TOKEN], worker_env()))
        private = os.path.realpath(_REAL_MKDTEMP(prefix="judge-processes-", dir=outside))
        os.chmod(private, 0o700)
        return {"lab": lab, "setup": setup, "cells": list(student_cells), "names": names,
                "folder": folder, "argv": argv, "timeout": timeout, "private": private,
                "path": root, "fork": fork() if fork is not None else None,
                "spawn": spawn() if spawn is not None else None}

    return spec


_REAL_MKDTEMP = tempfile.mkdtemp  # (``shared_with_worker`` makes every mkdtemp the worker's)


def worker_in_process(spec: Mapping[str, Any]) -> tuple[StudentWorker, dict[str, Any]]:
    """In a trusted process a test started (:func:`worker_spec`'s ``spec``): a student's worker
    of its own, started as the judge said (or forked by the judge already: ``fd``, its
    connection); returns it and the proxies to its functions."""
    if spec.get("fd") is not None:
        w = StudentWorker(spec["lab"], spec["cells"], spec["folder"],
                          timeout=float(spec["timeout"]),
                          forked=socket.socket(fileno=int(spec["fd"])))
        return w, w.start(spec["setup"], list(spec["names"]))
    template = spec.get("argv")
    wrap = None
    if template is not None:
        def wrap(argv: list[str], env: dict[str, str]) -> list[str]:
            return [str(a).replace(FD_TOKEN, argv[-1]) for a in template]

    w = StudentWorker(spec["lab"], spec["cells"], spec["folder"], wrap=wrap,
                      timeout=float(spec["timeout"]))
    return w, w.start(spec["setup"], list(spec["names"]))


def worker_program() -> str:
    """The worker's program: :mod:`.wire` and :mod:`.worker` as one module, then its start."""
    future = "from __future__ import annotations\n"
    texts = [Path(m.__file__).read_text(encoding="utf-8").replace(future, "")
             for m in (wire, worker)]
    return future + "\n\n".join(texts) + "\n\nmain(conn)\n"


def _log_sink(name: str, level: int, message: str) -> None:
    """A log record of the worker's, logged here under the same logger (what a test reads)."""
    import logging

    if isinstance(name, str) and name.split(".")[0] == "minickpt" and isinstance(level, int):
        logging.getLogger(name).log(level, "%s", str(message))


def _warn_sink(message: str, category: str) -> None:
    """A warning of the worker's, warned here with its category where the judge knows it."""
    import warnings

    cls = wire.load_class(str(category))
    if cls is None or not issubclass(cls, Warning):
        cls = UserWarning
    warnings.warn(str(message), cls, stacklevel=2)


def _named(remote: Any, name: str) -> Callable[..., Any]:
    """A plain function standing for the student's ``name`` in the judge: minickpt and the
    tests call it like theirs (the plug points need a ``__name__``)."""
    def proxy(*args: Any, **kwargs: Any) -> Any:
        return remote(*args, **kwargs)

    proxy.__name__ = proxy.__qualname__ = name
    proxy._judge_proxy = True  # type: ignore[attr-defined]
    return proxy


def give_sources(functions: dict[str, Any], student_cells: Sequence[str]) -> dict[str, Any]:
    """Each proxy carries the code a process of a test's own runs for it
    (:data:`minickpt.labkit.processes.SOURCE_ATTR`): of the student's cells that define the
    function, their imports, definitions and literal constants (what the grader's drills run,
    :func:`autograder.drills.definitions`). Only the student's text: no line of a test."""
    from minickpt.labkit.processes import SOURCE_ATTR

    from ..drills import definitions

    cells = [worker.ipython_python(c) for c in student_cells]  # as the worker reads them
    for name, fn in functions.items():
        setattr(fn, SOURCE_ATTR, definitions(cells, [name]))
    return functions


@contextlib.contextmanager
def shared_with_worker(active: bool) -> Iterator[None]:
    """While the tests run: what they create is the worker's to read and write, as in one
    process (the judge runs as root, the worker as the slot's uid), and in the folder the
    worker sees. Folders from
    ``tempfile.mkdtemp`` (``lab.tempdir()``) are opened to all, and nothing is masked from
    new files: everything lies in the drill's scratch folder, which only this job reaches."""
    if not active:
        yield
        return
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(suffix: Any = None, prefix: Any = None, dir: Any = None) -> str:
        # a folder asked for elsewhere (/dev/shm) is made in the shared one: the worker's
        # sandbox has its own /dev/shm and /tmp
        d = real_mkdtemp(suffix, prefix, tempfile.gettempdir())
        os.chmod(d, 0o777)
        return d

    old = os.umask(0)
    tempfile.mkdtemp = mkdtemp  # type: ignore[assignment]
    try:
        yield
    finally:
        tempfile.mkdtemp = real_mkdtemp  # type: ignore[assignment]
        os.umask(old)


def judge_lab(lab: str, student_cells: Sequence[str], folder: str, *,
              wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
              uid: int | None = None, tools: Mapping[str, Callable[..., Any]] | None = None,
              source: Path | None = None, timeout: float = CALL_TIMEOUT,
              end_workers: Callable[[], None] | None = None,
              cells: tuple[str, list[cells_mod.TestCell]] | None = None,
              launch: Mapping[str, Any] | None = None
              ) -> tuple[list[cells_mod.Verdict], list[str]]:
    """Every test of ``lab`` judged here against the student's functions, which run in a
    worker started in ``folder`` (by ``wrap``: the sandbox). Returns (verdicts, what went
    wrong loading the student's code).

    A test that starts processes of its own on the student's code (labs 3 and 6) starts them
    as ``launch`` says (:func:`minickpt.labkit.processes.launched_by`; default: by ``wrap``,
    in the sandbox too), with the code of the student's cells the proxies carry
    (:func:`give_sources`)."""
    from minickpt.labkit.processes import DRILL_KEY, launched_by

    cells = cells if cells is not None else cells_mod.lab_cells(lab, source)
    setup = cells[0]
    names = cells_mod.lab_task_names(lab)
    old_tmp = tempfile.tempdir
    outside = tempfile.gettempdir()  # (before the tests' folder becomes every test's)
    tests_dir = os.path.join(folder, "tests")
    os.makedirs(tests_dir, exist_ok=True)
    if uid and os.geteuid() == 0:
        os.chmod(tests_dir, 0o777)
    functions: dict[str, Any] = {}
    problems: list[str] = []
    current: list[StudentWorker] = []

    def trusted_server() -> Any:
        """lab 4's JAX processes' server: outside the sandbox, as the judge's own children."""
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root,
                                                           os.environ.get("PYTHONPATH")]))}
        return Zygote(outside, timeout=timeout, env=env, preload=TRUSTED_PRELOAD)

    # the fork servers (autograder/judge/zygote.py): the student's workers', in the sandbox,
    # and the trusted one, started on lab 4's first job
    servers = Servers(lambda: Zygote(folder, wrap=wrap, timeout=timeout))
    trusted = Servers(trusted_server)

    def start() -> None:
        """A worker with the student's functions; a new one when the last one died (what
        it was running fails; the tests after it start afresh, as each would alone)."""
        if current:
            if not current[-1].functions:
                return  # it never loaded: a new one would fail the same way
            if current[-1].alive() and not tool_ended:
                return
            # dead, or ended by a grader's tool: that kill can land after the tool returns
            # (under load it did), so a worker that still looks alive is not reused either
            hung = current[-1].ep is not None and current[-1].ep.timed_out
            current[-1].close()  # (one that hangs is ended: it would slow every test after it)
            if not tool_ended:
                problems.append("a call into your code did not answer in time; the next test "
                                "got a new worker" if hung else
                                "your code ended its worker process; the next test got a new "
                                "one")
            if end_workers is not None:
                end_workers()
        tool_ended.clear()
        functions.clear()
        for attempt in range(3):  # a worker that dies as it starts (a slot still being
            z = servers.get() if attempt == 0 else None  # (a retry starts one afresh)
            if z is not None and wrap is not None and len(current) > 0:
                wrap([sys.executable], {})  # what the tests wrote is the slot's (as a start)
            w = StudentWorker(lab, student_cells, folder, wrap=wrap, timeout=timeout, zygote=z)
            current.append(w)      # cleared, a busy machine) gets two more tries
            try:
                functions.update(give_sources(w.start(setup, list(names)), student_cells))
                break
            except (wire.WireError, OSError) as e:
                w.close()
                if w.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        w.proc.wait(5)
                tail = b"".join(w.stderr).decode(errors="replace").strip().splitlines()[-3:]
                why = f"({e})" + (": " + " | ".join(tail) if tail else "")
                if attempt == 2 or (tail and "Error" in tail[-1]):
                    problems.append(f"your code could not be loaded in the worker {why}")
                    break
                time.sleep(1.0)
        problems.extend(p for p in w.problems if p not in problems)

    def mirror(name: str) -> Callable[[], None]:
        return current[-1].mirror(name) if current else (lambda: None)

    tool_ended: list[bool] = []

    def grader_tool(fn: Callable[..., Any]) -> Callable[..., Any]:
        """A grader's tool (``grader_drill``) as a test calls it: with minickpt's own
        functions (:func:`.cells.unplugged`); its drill ends the slot's processes when it is
        done, the student's worker among them (not the student's doing: the next test gets a
        new worker and no note says otherwise; a grader check calls its tool last)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                with cells_mod.unplugged():
                    return fn(*args, **kwargs)
            finally:
                tool_ended.append(True)  # (its kill may land after this returns)

        call.__name__ = getattr(fn, "__name__", "tool")
        return call

    try:
        tempfile.tempdir = tests_dir
        how = dict(launch) if launch is not None else ({"wrap": wrap} if wrap else {})
        how["student_worker"] = worker_spec(lab, student_cells, folder, setup,
                                            wrap=how.get("wrap", wrap), timeout=timeout,
                                            outside=outside, fork=servers.method("fork"),
                                            spawn=trusted.method("run"))
        raw = (tools or {}).get("grader_drill")
        if getattr(raw, "for_test", None) is not None:  # a test's own drill: the grader's
            how[DRILL_KEY] = grader_tool(raw.for_test)  # type: ignore[union-attr]
        with shared_with_worker(True), launched_by(**how):
            tools = {name: grader_tool(fn) for name, fn in (tools or {}).items()}
            verdicts = cells_mod.run_tests(lab, functions, tools=tools, cells=cells,
                                           mirror=mirror, before_test=start)
    finally:
        tempfile.tempdir = old_tmp
        for w in current:
            w.close()
        servers.close()
        trusted.close()
        if end_workers is not None:
            end_workers()
    return verdicts, problems[:20]

