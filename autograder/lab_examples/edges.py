"""The grader's own edges (issue 38, round 4), in lab 1 only: each is cheap to grade (no
time-out is waited out) and fits any lab, since it attacks the grading, not the lab.

* ``cheat_traceback_locals``: the blank lab, and right after its first test (which fails) a
  cell that rebuilds the last exception's traceback with every frame's locals, as the
  standard library allows (``traceback.TracebackException(..., capture_locals=True)``), and
  prints it. It once printed the referee's ``source`` local: the whole text of lab 1's hidden
  tests on the student's own feedback page. Now nothing of a test outlives its cell.
* ``attack_output_budget``: right answers, and after every task cell a cell that prints
  1 MiB: more than one submission may keep. Once 300 such cells grew the grading worker to
  957 MB and 1900 made it fail. The output past the budget is counted, not kept; every test
  still scores (the referee's signs get through) and the row says why output is missing.

Two more classes of the round cannot be example notebooks here, since they are not the
notebook's content: a hand-in that is a symbolic link (to the solutions, to ``/dev/zero``) and
files beside a private ``--source`` notebook. tests/test_grading_edges.py grades those.
"""

from __future__ import annotations

from typing import Any

from .common import Edit, _gid, _insert_after, blank, perfect

TRACEBACK_LOCALS = r'''
# The last failure's traceback, every frame's locals included (no frame attribute named):
import sys
import traceback

_last = getattr(sys, "last_value", None)
if _last is None:
    print("nothing kept of the last failure")
else:
    print("".join(traceback.TracebackException(type(_last), _last, sys.last_traceback,
                                               capture_locals=True).format()))
'''


def cheat_traceback_locals(release: Any, source: Any) -> Any:
    """The blank lab; after its first test cell, the last failure's frames, locals and all,
    printed (issue 38's round 4): no hidden test on the feedback page, 0 points."""
    nb = blank(release, source)
    first_test = next(c for c in nb.cells if _gid(c).startswith("test_"))
    _insert_after(nb, first_test, TRACEBACK_LOCALS)
    return nb


MEGABYTE_CELLS = 6
"""Cells of 1 MiB after each task cell: 4 tasks, 24 MiB, three times the budget."""
MEGABYTE = r'''
# 1 MiB of output in one cell (under the cell's own limits), again and again
print("y" * (1 << 20))
'''


def attack_output_budget(release: Any, source: Any) -> Any:
    """Right answers; after every task cell, cells that print 1 MiB each (24 MiB in all):
    full marks, output past the submission's budget counted, not kept."""
    nb = perfect(release, source)
    for cell in [c for c in nb.cells if _gid(c).startswith("task_")]:
        for _ in range(MEGABYTE_CELLS):
            _insert_after(nb, cell, MEGABYTE)
    return nb


EXAMPLES: dict[str, dict[str, Edit]] = {"lab01_basics": {
    "cheat_traceback_locals": cheat_traceback_locals,
    "attack_output_budget": attack_output_budget,
}}
