"""The student's worker: runs in the submission's sandbox, holds the student's task functions
and runs one only when the judge calls it.

It is started as ``python -c BOOT FD`` (:data:`BOOT`): the connection's file descriptor is
its only argument. Everything else arrives over that connection, after it started: the text
of :mod:`.wire` and of this file (public code), then the lab's setup cell and the student's
code. No plan, input or expected value is in its argv, environment or files: the inputs of a
test reach the student's functions as the arguments of the calls the judge makes.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

BOOT = ("import sys, types\n"
        "from multiprocessing.connection import Connection\n"
        "c = Connection(int(sys.argv[1]))\n"
        "m = sys.modules['__judge_worker__'] = types.ModuleType('__judge_worker__')\n"
        "m.conn = c\n"
        "exec(compile(c.recv_bytes(1 << 24).decode(), '<judge worker>', 'exec'), m.__dict__)\n")
"""What the worker's interpreter is started with (``-c``)."""

KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
        ast.Assign, ast.AnnAssign)
"""What of a student's cell the worker runs: imports, definitions and assignments (a constant
or a helper beside a task function comes along); no bare call, loop or ``with`` (a demo or a
test of their own)."""


def student_code(cells: list[str], problems: list[str] | None = None) -> list[str]:
    """Per student cell, the code the worker runs (IPython's magics and shell lines made
    Python first, as IPython runs them); a cell that still does not parse contributes
    nothing, and says so in ``problems``."""
    out = []
    for k, source in enumerate(cells):
        text = ipython_python(source)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # nested too deep
            if problems is not None:
                problems.append(f"your cell {k} does not parse ({type(e).__name__}: {e}): "
                                "nothing of it was run")
            continue
        lines = text.splitlines(keepends=True)
        parts = []
        for node in tree.body:
            if isinstance(node, KEPT):
                first = min([node.lineno, *(d.lineno for d in
                                            getattr(node, "decorator_list", []))])
                parts.append("".join(lines[first - 1:node.end_lineno]))
        if parts:
            out.append("\n".join(parts))
    return out


def ipython_python(source: str) -> str:
    """``source`` as IPython runs it: ``%magic`` and ``!shell`` lines become the Python
    IPython would execute for them."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # pragma: no cover - the course environment has IPython
        return source
    try:
        return TransformerManager().transform_cell(source)
    except Exception:
        return source


class Control:
    """What the judge sets up in the worker besides the student's functions: where the
    worker's log records and warnings go (the judge's own logging and warnings, so a test
    that checks what a function logged or warned sees it there)."""

    def set_sinks(self, log: Any, warn: Any) -> None:
        import logging
        import warnings

        class Forward(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    log(record.name, record.levelno, record.getMessage())
                except Exception as e:
                    print(f"[judge] a log record was lost: {type(e).__name__}: {e}",
                          file=sys.stderr)

        lg = logging.getLogger("minickpt")
        lg.setLevel(logging.DEBUG)
        lg.addHandler(Forward())

        def show(message: Any, category: type, filename: str, lineno: int,
                 file: Any = None, line: Any = None) -> None:
            warn(str(message), f"{category.__module__}:{category.__qualname__}")

        warnings.showwarning = show
        warnings.simplefilter("always")

    def enter(self, name: str) -> int:
        """Make the test's set-up ``name`` here too (one of labkit's MIRRORED); its key."""
        from minickpt.labkit import lab5

        if name not in lab5.MIRRORED:
            raise ValueError(f"no set-up {name!r} to mirror")
        cm = getattr(lab5, name)()
        cm.__enter__()
        self._open = getattr(self, "_open", {})
        key = len(self._open) + 1
        self._open[key] = cm
        return key

    def leave(self, key: int) -> None:
        cm = getattr(self, "_open", {}).pop(key, None)
        if cm is not None:
            cm.__exit__(None, None, None)


REACHED = "reached minickpt's own"
"""What a note of :func:`reached` says (the kernel's watch says it too)."""


def reached(ns: dict, names: list) -> list:
    """A task function of the student's that holds minickpt's own function of the same task
    (or, on the graded build, its plug point, which stands for it) in a default argument or
    its closure: a wrapper of the reference handed in as one's own (another task's function
    held there is the library used, as the lab's own code may). On the graded build it earns
    nothing (the plug point calls the student's function back); the note is for the
    instructor's review."""
    out = []
    for name in names:
        fn = ns.get(name)
        if not callable(fn) or getattr(fn, "_minickpt_plug_point", False):
            continue
        held = [*(getattr(fn, "__defaults__", None) or ()),
                *(getattr(fn, "__kwdefaults__", None) or {}).values()]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:
                pass
        for v in held:
            if callable(v) and getattr(v, "__name__", None) == name and (
                    getattr(v, "_minickpt_plug_point", False)
                    or str(getattr(v, "__module__", "")).split(".")[0] == "minickpt"):
                out.append(f"{REACHED} {v.__name__}: your {name} holds it (a default argument "
                           "or a closure)")
                break
    return out


def main(conn: Any) -> None:  # pragma: no cover - runs in the worker (tests start real ones)
    """The worker's life: read the code, define the functions, serve the judge's calls until
    the connection closes."""
    import io
    import os
    import types

    import msgpack

    os.dup2(2, 1)  # what the student's code prints goes to stderr, never into the wire
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    job = msgpack.unpackb(conn.recv_bytes(1 << 26), raw=False)
    main_mod = types.ModuleType("__main__")
    main_mod.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main_mod
    ns = main_mod.__dict__
    problems = []
    try:
        exec(compile(job["setup"], "<setup>", "exec"), ns)
    except BaseException as e:
        problems.append(f"the lab's setup cell failed: {type(e).__name__}: {e}")
    for k, code in enumerate(job["cells"]):
        try:
            exec(compile(code, f"<your cell {k}>", "exec"), ns)
        except BaseException as e:
            problems.append(f"your cell {k} failed: {type(e).__name__}: {e}")
    problems.extend(reached(ns, job["names"]))
    ep = Endpoint(conn, "worker", Policy(private=True, setattr=True))  # noqa: F821 - wire's
    found = {"__control__": ep.encode(Control())}
    for name in job["names"]:
        fn = ns.get(name)
        if callable(fn) and not getattr(fn, "_minickpt_plug_point", False):
            found[name] = ep.encode(fn)
    conn.send_bytes(msgpack.packb({"functions": found, "problems": problems},
                                  use_bin_type=True))
    ep.start()
    ep._reader.join()
    os._exit(0)


PRELOAD = ("numpy", "msgpack", "jax", "jax.numpy", "minickpt", "minickpt.labkit")
"""What the fork server imports once for every worker it forks (:func:`serve_forks`): about a
CPU-second per worker that a fork does not pay again. No JAX backend is started (no threads of
XLA's to lose in the fork): a worker starts its own when the student's code asks for one."""


def serve_forks(conn: Any, preload: tuple[str, ...] = PRELOAD) -> None:  # pragma: no cover
    """The fork server's life (:mod:`autograder.judge.zygote`; it runs in the sandbox, or for
    a test's trusted processes outside it): import ``preload``, then for each request fork a
    child and say its pid, and say each child's exit. A child is a worker serving the
    connection sent with the request (``fork``), or runs a script (``run``: its argv,
    environment, folder and descriptors, as a new interpreter would). One thread only, so a
    fork copies no lock another thread holds. Ends, and ends its children, when the judge
    hangs up."""
    import importlib
    import os
    import select
    import signal
    from multiprocessing import reduction

    import msgpack

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # a child that needs it says why, as it would without the server
            pass
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()

    def say(msg: dict) -> None:
        conn.send_bytes(msgpack.packb(msg))

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    say({"ready": True})
    try:
        while True:
            try:
                ready = select.select([conn, wake_r], [], [])[0]
            except InterruptedError:
                continue
            if wake_r in ready:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                reap()
            if conn not in ready:
                continue
            try:
                msg = msgpack.unpackb(conn.recv_bytes(1 << 20), raw=False)
            except (EOFError, OSError, ValueError):
                return
            if msg.get("op") == "kill" and msg.get("pid") in children:
                os.kill(msg["pid"], signal.SIGKILL)
            if msg.get("op") not in ("fork", "run"):
                continue
            fds = [reduction.recv_handle(conn) for _ in range(int(msg.get("handles", 2)))]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    conn.close()
                    _die_with_parent()
                    code = _forked(msg, fds)
                finally:
                    os._exit(code)
            if msg["op"] == "run":  # (here too: its group exists before the judge hears of it)
                try:
                    os.setpgid(pid, pid)
                except OSError:
                    pass
            for fd in fds:
                os.close(fd)
            children.add(pid)
            say({"pid": pid})
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)


def _forked(msg: dict, fds: list[int]) -> int:  # pragma: no cover - runs in a forked child
    """A forked child's life: a worker (``fork``: its connection, its stderr), or a script
    (``run``: its output, then the descriptors it is given, each at its number)."""
    import fcntl
    import io
    import os
    from multiprocessing.connection import Connection

    if msg["op"] == "fork":
        sock, err = fds
        os.dup2(err, 2)
        os.close(err)
        main(Connection(sock))
        return 0
    import runpy

    os.setpgid(0, 0)  # its own process group, as a launched process (killed with its group)
    base = max([100, *(int(n) + 1 for n in msg["fds"])])  # above every number asked for
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in fds]
    for fd in fds:
        os.close(fd)
    out, given = high[0], high[1:]
    for fd, number in zip(given, msg["fds"], strict=True):
        os.dup2(fd, int(number))
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in high:
        os.close(fd)
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    sys.argv = list(msg["argv"])
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True,
                                  errors="replace")
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True,
                                  errors="replace")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def _die_with_parent() -> None:  # pragma: no cover - runs in a forked child
    """A forked child dies with its fork server (outside the sandbox nothing else ends it)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:
        pass
