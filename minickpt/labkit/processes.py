"""How the tests' own processes start (lab 3's crash drill, lab 6's loop processes), and the
code they are given.

In a notebook (and in the kernel), a test's process is a plain child of the notebook's, and
its code is the source of the student's function (``inspect.getsource``). Under the grader's
judge (``autograder/judge``) the test runs in the grader's process and the student's function
there is a proxy to their worker: the judge gives the proxy the student's code
(:data:`SOURCE_ATTR`, what the student's cells define, never a test's line) and, for the
duration of the tests, how such a process starts (:func:`launched_by`: in the submission's
sandbox, as the grader's own drills start theirs). What the process did is read by the
test's code, in the judge (its exit code, the lines it printed, the files it left).
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

SOURCE_ATTR = "__minickpt_source__"
"""A function's code as the judge gives it for a proxy: the student's cells' imports,
definitions and literal constants of the cells that define it."""

_HOW: list[dict[str, Any]] = []

LAUNCH_KEYS = ("wrap", "after_run", "send_signal", "locate")
"""What :func:`launched_by` may set: the keyword arguments of
:func:`minickpt.labkit.lab3.run_lab3_drill` and :func:`minickpt.labkit.lab6.run_loop_worker`
that say where a process starts and how it is reached."""

DRILL_KEY = "grader_drill"
"""What else :func:`launched_by` may set: ``grader_drill(task, **params)``, the judge's run of
a task's drill by the grader itself (``autograder.drills``), which a test's own drill of that
task becomes under the judge: one drill, judged from outside, instead of two
(:func:`minickpt.labkit.lab3.lab3_drill`)."""

WORKER_KEY = "student_worker"
"""What else :func:`launched_by` may set: ``student_worker()``, the judge's data for a trusted
process a test starts (lab 4's JAX processes) to start a student's worker of its own
(``autograder.judge.session.worker_spec``)."""


@contextlib.contextmanager
def launched_by(**how: Callable[..., Any] | None) -> Iterator[None]:
    """For the block, the tests' processes start as ``how`` says (``wrap(argv, env)``: the
    command in the sandbox; ``after_run()``: after each process; ``send_signal(proc, sig)``
    and ``locate(proc)``: the process inside the sandbox). The judge's; nothing else sets it."""
    unknown = set(how) - {*LAUNCH_KEYS, WORKER_KEY, DRILL_KEY}
    if unknown:
        raise TypeError(f"launched_by: unknown {sorted(unknown)}")
    _HOW.append({k: v for k, v in how.items() if v is not None})
    try:
        yield
    finally:
        _HOW.pop()


def launch_options(*keys: str) -> dict[str, Any]:
    """The options :func:`launched_by` set that a launcher takes (``keys``); none outside it."""
    how = _HOW[-1] if _HOW else {}
    return {k: how[k] for k in keys if k in how}


def student_worker() -> dict[str, Any] | None:
    """Under the judge: how a process a test starts reaches the student's code (a worker of
    its own, in the sandbox; :data:`WORKER_KEY`), as data; None elsewhere."""
    make = (_HOW[-1] if _HOW else {}).get(WORKER_KEY)
    return None if make is None else make()


def given_source(fn: Any) -> str | None:
    """The code the judge gave for ``fn`` (a proxy to the student's function), or None."""
    src = getattr(fn, SOURCE_ATTR, None)
    return src if isinstance(src, str) else None


def source_of(fn: Any) -> str:
    """The code that defines ``fn`` for a process to run: what the judge gave for it, else
    its own source (``inspect.getsource``; raises OSError or TypeError when there is none)."""
    src = given_source(fn)
    if src is None:
        src = given_source(inspect.unwrap(fn))
    if src is not None:
        return src
    return textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))


def read_tail(stream: Any, tail: list[str], keep: int = 3000) -> None:
    """Read a child's ``stream`` (text) to its end, as it comes, keeping about its last
    ``keep`` characters in ``tail``: a full pipe would stop the child (a traceback of a
    thousand frames fills one), and only the end says how it died."""
    size = 0
    for chunk in iter(lambda: stream.read(4096), ""):
        tail.append(chunk)
        size += len(chunk)
        while len(tail) > 1 and size - len(tail[0]) >= keep:
            size -= len(tail.pop(0))
