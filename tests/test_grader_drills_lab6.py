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

RECOGNISES_THE_DRILL = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    # blank, unless it recognises a drill's driver from its command line: then the drill's
    # old training step, hard-coded, and what step_fn returns ignored
    import sys
    if not sys.argv[0].endswith("driver.py"):
        raise NotImplementedError("Task 6.3: train_until_preempted")
    step = start
    for step in range(start + 1, stop + 1):
        _, metrics = step_fn(carry, step)
        carry = 0.5 * carry + step
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
"""

OWN_HANDLER = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    # issue 48: its own SIGTERM handler saves the current step (a second save of the step the
    # manager names then raises StepAlreadyExistsError, or a half-done step is saved)
    import signal
    state = {"carry": carry, "step": start}
    def on_term(signum, frame):
        manager.save(state["step"], items(state["carry"]), force=True)
        if manager.preemption_handler is not None:
            manager.preemption_handler.notify()
    signal.signal(signal.SIGTERM, on_term)
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        state["carry"], state["step"] = carry, step
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
"""

_RIGHT = """
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
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
FORCED_SAVES = _RIGHT.replace("metrics=metrics)", "metrics=metrics, force=True)")
DROPS_METRICS = _RIGHT.replace(", metrics=metrics)", ")")
NO_ON_STEP = _RIGHT.replace("        if on_step is not None:\n            on_step(step, carry, metrics)\n",
                            "")
NEVER_WAITS = _RIGHT.replace("            manager.wait_until_finished()\n", "").replace(
    "    manager.wait_until_finished()\n", "")


@pytest.mark.parametrize("code,said,kernel_passes", [
    (SAVES_ONLY_ON_NOTICE, "the newest checkpoint is step", True),
    (FROM_THE_FIRST_STEP, "another run's", True),
    (RECOGNISES_THE_DRILL, "another run's", True),
])
def test_a_loop_whose_disk_is_wrong_fails_the_graders_drill(box, tmp_path, code, said,
                                                            kernel_passes):
    if kernel_passes:  # the kernel's drill (student's process) takes it: the grader's must not
        assert _kernel_drill(code, tmp_path) is None
    failed = drills.drill_6_3([*solution_cells("lab06_production"), textwrap.dedent(code)], box)
    assert failed is not None and said in failed, failed


@pytest.mark.parametrize("code,said", [
    (OWN_HANDLER, "were saved|with a handler of its own|exited with code"),
    (FORCED_SAVES, "were saved, but the manager's interval"),
    (DROPS_METRICS, "was saved with metrics"),
    (NO_ON_STEP, "on_step was given"),
    (NEVER_WAITS, "were not on disk yet|exited with code|the newest checkpoint is step"),
])
def test_a_loop_that_breaks_a_promise_in_a_drawn_setup_fails_the_graders_drill(box, code, said):
    """Each promise of 6.3's contract that some drawn set-up observes: over several drills
    (the set-up is drawn each time), the wrong loop fails every one."""
    import re

    failed = drills.drill_6_3([*solution_cells("lab06_production"), textwrap.dedent(code)], box)
    assert failed is not None and re.search(said, failed), failed


def test_the_practice_drill_fails_a_loop_with_its_own_sigterm_handler(tmp_path):
    """Issue 48: a loop whose own SIGTERM handler saves the current step crashes or saves a
    step the manager did not name; the kernel's drill says so too."""
    assert _kernel_drill(OWN_HANDLER, tmp_path) is not None


def test_a_missing_loop_is_named():
    assert "no function train_until_preempted" in drills.drill_6_3(["def other():\n    pass\n"],
                                                                   None)


def test_the_effects_judge_reads_the_disk_not_the_lines():
    """A record whose lines say all went well but whose disk does not: the grader's judge
    fails it; the planted start and the drawn training step are what the carries are
    compared with; a handler seen in /proc, a save not on disk at the return, metrics and
    on_step calls are judged too."""
    import numpy as np

    carry0 = np.arange(4.0)
    setup = {"a": 0.7, "b": 2.0, "metrics": True, "on_step": True, "async": False}

    def carry(n, start=5, c=carry0):
        return lab6.lab6_carry(n, start, c, a=0.7, b=2.0)

    record = {"stop": 20, "every": 10, "start": 5, "carry0": carry0, "planted": 5, "runs": []}
    good = {n: carry(n) for n in (5, 9)}
    calls = [[n, carry(n).tobytes().hex(), {"loss": float(carry(n).sum())}] for n in (6, 7, 8, 9)]
    run = {"at": 8, "signalled": 8, "rc": 0, "err": "", "newest": 9, "disk": good,
           "metrics": {9: {"loss": float(carry(9).sum())}}, "setup": setup, "handlers": [],
           "returned": {"kind": "LoopResult"}, "at_return": [5, 9], "on_step": calls,
           "lines": ["step 9", "result LoopResult 9 True"]}
    record["runs"].append(run)
    assert lab6.effects_message(record, 0) is None
    record["runs"][0] = {**run, "disk": {**good, 9: lab6.lab6_carry(9)}}
    assert "another run's" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "disk": {**good, 9: carry(9, 5, carry0) * 0 + lab6.lab6_carry(
        9, 5, carry0)}}
    assert "through what step_fn returns" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "signalled": None}
    assert "ended first" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "handlers": ["SIGTERM"]}
    assert "handler of its own" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "at_return": [5]}
    assert "not on disk yet" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "metrics": {9: None}}
    assert "metrics None" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "on_step": calls[:2]}
    assert "on_step was given" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "disk": {**good, 7: carry(7)}, "metrics": {
        7: {"loss": float(carry(7).sum())}, 9: {"loss": float(carry(9).sum())}}}
    assert "were saved, but the manager's interval" in lab6.effects_message(record, 0)
    record["runs"][0] = {**run, "newest": 12, "disk": {**good, 12: carry(12)}}
    assert "step 8 or 9" in lab6.effects_message(record, 0)
    last = {"at": None, "signalled": None, "rc": 0, "err": "", "newest": 9, "disk": good,
            "metrics": {}, "setup": setup, "handlers": [], "returned": {"kind": "LoopResult"},
            "at_return": [5, 9], "on_step": [], "lines": ["result LoopResult 20 False"]}
    record["runs"] = [run, last]
    assert "saves step 20" in lab6.effects_message(record, 1)


def test_the_drawn_setups_cover_each_kind_and_leave_room_after_the_signals():
    import random

    for seed in range(40):
        s = lab6.draw_setup(random.Random(seed), processes=4, start=9)
        runs = s["runs"]
        assert {r["async"] for r in runs} == {True, False}
        assert {r["on_step"] for r in runs} == {True, False}
        assert {r["metrics"] for r in runs} == {True, False}
        assert {r["signal"] for r in runs} == {15, 2}
        assert s["stop"] % s["every"] == 0 and s["stop"] > 9 + 4 * 10
        assert all(r["slow"] > 0 for r in runs if r["async"])


def test_nothing_of_the_plan_is_in_the_workers_command_line_or_environment(tmp_path):
    """The driver's command is the driver and the folder; the set-up comes over the channel
    after the student's code is loaded (a loop that looks for it finds nothing)."""
    seen = {}

    def wrap(argv, env):
        seen.update(argv=list(argv), env=dict(env))
        return argv

    setup = {**lab6.KERNEL_SETUP, "stop": 6, "every": 3, "async": False, "on_step": False,
             "hard_exit": False, "a": 0.123, "b": 4.56}
    run = lab6.run_loop_worker(textwrap.dedent(_RIGHT).replace("LoopResult(", "_R("),
                               str(tmp_path), setup=setup, wrap=wrap)
    text = " ".join(seen["argv"]) + " ".join(f"{k}={v}" for k, v in seen["env"].items())
    assert "0.123" not in text and "4.56" not in text and seen["argv"][-1] == str(tmp_path)
    assert run["rc"] is not None
