"""The reference reached (issue 31, classes 1 and 2): blank labs whose every task is a thin
wrapper of minickpt's own function, captured as a default argument through its module's
``__dict__`` (a spelling the static ``reference_use`` scan does not know), and, for the labs
whose tests run the student's code in worker processes (3, 4, 6), a walrus in a default that
rebinds the harness's ``plugged_in`` there. Each function takes the released lab and its source
(nbformat notebooks, as ``make_examples`` passes them) and returns the notebook handed in.
:data:`EXPECTED` holds their rows in the columns of ``autograder/examples/expected-<lab>.csv``
(without the ``lab`` column): what a blank lab gets, and a review flag naming what was reached.

* ``reached_dict_default``: ``def resume(*args, _f=mc.restore.__dict__["resume"], **kwargs):
  return _f(*args, **kwargs)`` for every task: the kernel's watch sees minickpt's ``resume``
  run inside the student's ``resume`` (and the worker's, in lab 3's drill, lab 4's processes
  and lab 6's loop process).
* ``reached_walrus``: the same, the first task's function also rebinding ``plugged_in`` to a
  no-op with a walrus in a default (in a worker that ran the cell in its own globals, the
  harness then never swapped the student's function in, so the library's own ran).
"""

from __future__ import annotations

import ast
from typing import Any

from .common import _cell, blank

WALRUS = '_x=(plugged_in := (lambda *fns: __import__("contextlib").nullcontext())), '


def _modules() -> dict[str, str]:
    """Each reference function's name -> its module (``"minickpt.restore"``)."""
    from minickpt.labkit import reference_functions

    return {f.__name__: f.__module__ for fns in reference_functions().values() for f in fns}


def _wrappers(source: str, walrus: bool) -> str:
    """A cell of thin wrappers, one per function the task cell defines."""
    where = _modules()
    out = ["import minickpt as mc", ""]
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in where:
            extra = WALRUS if walrus else ""
            mod = where[node.name][len("minickpt."):]
            out += [f'def {node.name}(*args, {extra}_f=mc.{mod}.__dict__["{node.name}"], '
                    "**kwargs):",
                    f'    """My own {node.name}."""',
                    "    return _f(*args, **kwargs)", "", ""]
            walrus = False
    return "\n".join(out).rstrip() + "\n"


def _attack(release: Any, source: Any, walrus: bool) -> Any:
    nb = blank(release, source)
    first = True
    for cell in nb.cells:
        gid = str(cell.metadata.get("nbgrader", {}).get("grade_id", ""))
        if cell.metadata.get("nbgrader", {}).get("solution") and gid.startswith("task_"):
            cell.source = _wrappers(_cell(source, gid).source, walrus and first)
            first = False
    return nb


def reached_dict_default(release: Any, source: Any) -> Any:
    return _attack(release, source, walrus=False)


def reached_walrus(release: Any, source: Any) -> Any:
    return _attack(release, source, walrus=True)


LABS = ("lab02_save_policy", "lab03_resume", "lab04_multihost", "lab06_production")
EXAMPLES = {lab: {"reached_dict_default": reached_dict_default,
                  **({"reached_walrus": reached_walrus} if lab != "lab02_save_policy" else {})}
            for lab in LABS}
_FLAG = "reached minickpt's own"
EXPECTED = {
    # student, the tasks' points, quiz, total, status, review (texts some flag contains)
    "lab02_save_policy": [  # judged (issue 47): no test runs in the kernel, so no watch of
        # the kernel's sees minickpt's own run; the scan names the one spelling it knows
        ["reached_dict_default", "0", "0", "0", "0", "0", "0", "graded",
         "minickpt's reference commit (task 2.3)"],
    ],
    "lab03_resume": [
        ["reached_dict_default", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
        ["reached_walrus", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
    ],
    "lab04_multihost": [
        ["reached_dict_default", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
        ["reached_walrus", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
    ],
    "lab06_production": [
        ["reached_dict_default", "0", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
        ["reached_walrus", "0", "0", "0", "0", "0", "0", "0", "graded", _FLAG],
    ],
}
