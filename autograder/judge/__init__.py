"""The judge: where every graded point of a test cell is decided (issue 47).

What runs where:

* **The judge's process** (trusted, outside the sandbox, the full minickpt): the lab's setup
  cell and every test cell, visible, hidden and grader check alike, in their source's words
  (:mod:`.cells`). The student's task functions are bound there to proxies.
* **The student's worker** (in the submission's sandbox, the graded build): the student's task
  cells' imports and definitions, and nothing else; it runs a function only when a proxy calls
  it, with the arguments the test chose (:mod:`.worker`).
* **Between them** (:mod:`.wire`): plain data (numbers, strings, arrays, pytrees of known
  classes, exceptions of known classes) crosses by value; any other object (a file system, a
  writer, a callback) stays on its side and the other side gets a handle whose public methods
  it may call. Nothing is pickled; nothing the worker says is a verdict.

A test passes when its code ran to its end in the judge. The kernel run is feedback only.
"""

from __future__ import annotations

from typing import Any

from .cells import cells_of, ensure_devices, run_tests

JUDGED_LABS = ("lab01_basics", "lab02_save_policy", "lab03_resume", "lab04_multihost",
               "lab05_async", "lab06_production")
"""The labs whose every test the judge decides. Their hostile corpus asserts what the judge
does (`tests/test_grading_hardening.py`): a worker that dies fails the test that called it, with
its reason, and the tests after it still run on a fresh worker; the kernel runs no test, so
nothing it prints or does (a history-reader, an exit, a forged receipt) decides a point. Labs 3
and 6 start processes of their own in their tests: under the judge they run the code the
proxies carry, in the sandbox (minickpt.labkit.processes). Lab 4's tests run their body in four
trusted JAX processes (labkit.lab4_judged), each with a sandboxed worker of its own for the
student's functions."""


def judges(lab: str) -> bool:
    """Whether the judge decides the tests of ``lab`` (``MINICKPT_JUDGE=off``: none, the
    instructor's override, for comparing with the kernel's verdicts)."""
    import os

    if os.environ.get("MINICKPT_JUDGE", "").lower() in ("off", "0", "no"):
        return False
    return lab in JUDGED_LABS


def judge_lab(*args: Any, **kwargs: Any) -> Any:
    from .session import judge_lab as run

    return run(*args, **kwargs)


__all__ = ["JUDGED_LABS", "cells_of", "ensure_devices", "judge_lab", "judges", "run_tests"]
