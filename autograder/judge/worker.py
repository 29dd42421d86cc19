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
