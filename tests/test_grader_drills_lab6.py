"""Issue 38, lab 6: the grader runs task 6.3's preemption drill itself (autograder/drills.py,
drill_6_3). The student's loop runs in the lab's driver in sandboxed workers; the SIGTERMs,
the reading of the disk and the verdict stay in the grader's process, and the folder starts
with a checkpoint of another run. Each wrong loop here passes the drill the kernel runs (in
the student's process, where it proves nothing) and must fail the grader's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from drill_support import solution_cells

from autograder import drills
from minickpt.labkit import lab6

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)





def _kernel_drill(code: str, d: Path) -> str | None:
    """The drill as the kernel runs it (lab.preemption_drill), on the loop ``code``."""
    source = textwrap.dedent(code).strip()
    path = d / "loop.py"
    path.write_text(source)
    from minickpt.production.preemption import LoopResult

    ns = {"LoopResult": LoopResult}
    exec(compile(source, str(path), "exec"), ns)
    (d / "kernel").mkdir()
    return lab6.preemption_drill(ns["train_until_preempted"], str(d / "kernel"), signals=2)


def test_the_solutions_loop_passes_the_graders_drill(box):
    assert drills.drill_6_3(solution_cells("lab06_production"), box) is None


SAVES_ONLY_ON_NOTICE = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    # the manager is offered only the step a notice names: the interval's saves never happen,
    # and the end of an uninterrupted run is not on disk (the kernel's drill only reads the
    # carry its last process prints)
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        if on_step is not None:
            on_step(step, carry, metrics)
        if manager.reached_preemption(step):
            manager.save(step, items(carry), metrics=metrics, force=True)
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
"""

FROM_THE_FIRST_STEP = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    # the run is deterministic: the carry before `start` is redone from zeros, not taken as
    # given (right only for the one run the kernel's drill starts from)
    import numpy as np
    carry = np.zeros(4)
    for s in range(1, start + 1):
        carry = 0.5 * carry + s
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
"""

SAYS_WHAT_THE_DRIVER_SAYS = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    # the driver's lines, signed with the grader drill's (empty) key, and nothing done
    import os
    from minickpt.launch import report
    for s in range(start + 1, stop + 1):
        report({"line": f"step {s}"}, tag="LAB6", key=b"")
    report({"line": f"result LoopResult {stop} False"}, tag="LAB6", key=b"")
    os._exit(0)
"""


@pytest.mark.parametrize("code,said,kernel_passes", [
    (SAVES_ONLY_ON_NOTICE, "the newest checkpoint is step", True),
    (FROM_THE_FIRST_STEP, "another run's", True),
    # the signal finds the worker gone, or it exits 0 with nothing new on disk: either way
    (SAYS_WHAT_THE_DRIVER_SAYS, "process 1 (SIGTERM after step", False),
])
def test_a_loop_whose_disk_is_wrong_fails_the_graders_drill(box, tmp_path, code, said,
                                                            kernel_passes):
    if kernel_passes:  # the kernel's drill (student's process) takes it: the grader's must not
        assert _kernel_drill(code, tmp_path) is None
    failed = drills.drill_6_3([*solution_cells("lab06_production"), textwrap.dedent(code)], box)
    assert failed is not None and said in failed, failed


def test_a_missing_loop_is_named():
    assert "no function train_until_preempted" in drills.drill_6_3(["def other():\n    pass\n"],
                                                                   None)


def test_the_effects_judge_reads_the_disk_not_the_lines():
    """A record whose lines say all went well but whose disk does not: the grader's judge
    fails it; the planted start is what the carries are compared with."""
    import numpy as np

    carry0 = np.arange(4.0)
    record = {"stop": 20, "every": 10, "start": 5, "carry0": carry0, "planted": 5, "runs": []}
    good = {n: lab6.lab6_carry(n, 5, carry0) for n in (5, 9)}
    run = {"at": 8, "signalled": 8, "rc": 0, "err": "", "newest": 9, "disk": good,
           "lines": ["step 9", "result LoopResult 9 True"]}
    record["runs"].append(run)
    assert lab6.effects_message(record, 0) is None
    record["runs"][0] = {**run, "disk": {**good, 9: lab6.lab6_carry(9)}}
    assert "another run's" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "signalled": None}
    assert "ended first" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "newest": 12, "disk": {**good, 12: lab6.lab6_carry(12, 5, carry0)}}
    assert "step 8 or 9" in lab6.effects_message(record, 0)
    last = {"at": None, "signalled": None, "rc": 0, "err": "", "newest": 9, "disk": good,
            "lines": ["carry -", "result LoopResult 20 False"]}
    record["runs"] = [run, last]
    assert "saves step 20" in lab6.effects_message(record, 1)
