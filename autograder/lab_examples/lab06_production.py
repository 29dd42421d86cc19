"""Lab 6's example submissions (production): the perfect and blank hand-ins, a partial one, and
one typical mistake per task. Expected grades: ``autograder/examples/expected-lab06_production.csv``."""

from __future__ import annotations

from typing import Any

from .common import Wrong, _answers, _cell, _replace, blank, perfect, swap, wrong_examples
from .hostile import ISSUE_20, JUDGED

SAVES_IN_HANDLER = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    """Task 6.3 — my version: on SIGTERM, save right away from a signal handler and exit."""
    import signal
    import sys

    now = {"step": start, "carry": carry}

    def save_and_exit(signum, frame):
        manager.save(now["step"], items(now["carry"]), force=True)
        manager.wait_until_finished()
        sys.exit(0)

    signal.signal(signal.SIGTERM, save_and_exit)
    step = start
    for step in range(start + 1, stop + 1):
        now["step"] = step
        carry, metrics = step_fn(carry, step)
        now["carry"] = carry
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
'''.strip()

LOADS_EVERYTHING = '''
def best_checkpoint(source, metric, *, mode="min", where=None, fs=None):
    """Task 6.5 — my version: restore each checkpoint (to be sure it is good), then compare."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if isinstance(source, (list, tuple)):
        metas = list(source)
    else:
        mngr = source if hasattr(source, "all_steps") else mc.CheckpointManager(
            source, mc.CheckpointManagerOptions(read_only=True), fs=fs)
        metas = []
        for step in mngr.all_steps():
            mngr.restore(step)  # every array of every checkpoint
            metas.append(mngr.metadata(step))
    best, best_key = None, None
    for meta in metas:
        v = metric_value(meta, metric)
        if not metadata_matches(meta, where) or v is None or not math.isfinite(v):
            continue
        key = (v if mode == "max" else -v, meta.step)
        if best_key is None or key > best_key:
            best, best_key = meta, key
    return best
'''.strip()


def partial(release: Any, source: Any) -> Any:
    """6.1, 6.2 and 6.5 done, 6.3 and 6.4 not started (stubs), 5 of 9 quiz answers right."""
    nb = perfect(release, source)
    for gid in ("task_6_3", "task_6_4"):
        _cell(nb, gid).source = _cell(release, gid).source
    _answers(nb, Q2='"A"', Q3="0.0", Q5="8", Q9='"A"')
    return nb


def young_without_2(release: Any, source: Any) -> Any:
    """6.1 with √(C·MTBF): the 2 under Young's root forgotten (in Daly's form too)."""
    nb = perfect(release, source)
    _replace(nb, "task_6_1", "return math.sqrt(2.0 * c * m)", "return math.sqrt(c * m)")
    _replace(nb, "task_6_1", "return math.sqrt(2.0 * c * m) * (", "return math.sqrt(c * m) * (")
    return nb


def p_fail_swapped(release: Any, source: Any) -> Any:
    """6.2's P_fail with the interval and the total swapped: ⌊T_interval / T_total⌋ intervals."""
    nb = perfect(release, source)
    _replace(nb, "task_6_2", "n = math.floor(total / interval)", "n = math.floor(interval / total)")
    return nb


def saves_in_handler(release: Any, source: Any) -> Any:
    """6.3 saves from its own SIGTERM handler, mid-step, and exits there."""
    nb = perfect(release, source)
    _cell(nb, "task_6_3").source = SAVES_IN_HANDLER
    return nb


PREEMPTION_LAST = """        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)"""
PREEMPTION_FIRST = """        if manager.reached_preemption(step):  # stop as soon as we are told to
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
        manager.save(step, items(carry), metrics=metrics)"""


def checks_before_save(release: Any, source: Any) -> Any:
    """6.3 asks ``reached_preemption`` before offering the step to ``save``: it stops on a
    step it computed but never offered, so the restart computes it (and more) again."""
    nb = perfect(release, source)
    _replace(nb, "task_6_3", PREEMPTION_LAST, PREEMPTION_FIRST)
    return nb


def recover_at_restore(release: Any, source: Any) -> Any:
    """6.4 stops the recovery clock at the restore ('resumed from'), not at the first step
    computed again."""
    nb = perfect(release, source)
    recover_at_restore_edit(nb)
    return nb


def recover_at_restore_edit(nb: Any) -> None:
    """The edit of :func:`recover_at_restore`, on a notebook of reference answers."""
    _replace(nb, "task_6_4", '    ev = proc.wait_for(("resumed from step", "step"), deadline)\n',
             '    ev = proc.wait_for(("resumed from step", "step"), deadline)\n    first = ev[0] if ev else None\n')
    _replace(nb, "task_6_4", "rec.recover_s = ev[0] - t_kill", "rec.recover_s = first - t_kill")


def loads_every_checkpoint(release: Any, source: Any) -> Any:
    """6.5 restores every checkpoint to read its metrics: right answers, every array read."""
    nb = perfect(release, source)
    _cell(nb, "task_6_5").source = LOADS_EVERYTHING
    return nb


# -- issue 39: the wrong-solution corpus (one clause broken per version) ----------------------
T61, T62, T63, T64, T65 = "task_6_1", "task_6_2", "task_6_3", "task_6_4", "task_6_5"

MIN_WITH_KEY = '''
def best_checkpoint(source, metric, *, mode="min", where=None, fs=None):
    """Task 6.5 — my version: the built-in min/max with a key."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    metas = [m for m in checkpoint_metadata(source, fs=fs)
             if metadata_matches(m, where) and metric_value(m, metric) is not None
             and math.isfinite(metric_value(m, metric))]
    if not metas:
        return None
    pick = min if mode == "min" else max
    return pick(metas, key=lambda m: metric_value(m, metric))
'''.strip()


def _no_waits(nb: Any) -> None:
    """6.3 without ``wait_until_finished``: an async save may still be writing on return."""
    _replace(nb, T63, "            manager.wait_until_finished()\n            return LoopResult(carry, step, True)",
             "            return LoopResult(carry, step, True)")
    _replace(nb, T63, "    manager.wait_until_finished()\n    return LoopResult(carry, step, False)",
             "    return LoopResult(carry, step, False)")


WRONG: list[Wrong] = [
    # 6.1
    Wrong("6.1", "raises ValueError for a save cost that is not >= 0, NaN included (tests `< 0`)",
          swap(T61, "if not save_cost_s >= 0:  # also False for NaN", "if save_cost_s < 0:")),
    Wrong("6.1", "an unknown method raises ValueError, never falls back silently to a formula (to Daly)",
          swap(T61, 'if method != "daly":', 'if method is None:  # anything else: Daly')),
    Wrong("6.1", "from C >= 2M on, Daly's rule is tau = M (the expansion used past its range)",
          swap(T61, "    if c >= 2.0 * m:\n        return m\n", "")),
    # 6.2
    Wrong("6.2", "relative error below 1e-6 for segments far shorter than the MTBF (M - L/(e^(L/M) - 1) "
          "without the series where the subtraction cancels)",
          swap(T62, "    if x < 1e-3:  # 1 - x/(e^x - 1) by its series", "    if x < 0.0:  # 1 - x/(e^x - 1) by its series")),
    Wrong("6.2", "p_fail: relative error below 1e-6 for rare interruptions (1 - (1 - p)**n, not log1p)",
          swap(T62, "return -math.expm1(n * math.log1p(-p)) if p < 1.0 else float(n > 0)",
               "return 1.0 - (1.0 - p) ** n")),
    Wrong("6.2", "p_fail raises ValueError when p is not a probability, NaN included (tests p < 0 or p > 1)",
          swap(T62, "if not 0.0 <= p <= 1.0:", "if p < 0.0 or p > 1.0:")),
    Wrong("6.2", "a failure also costs the restart R (left out of the uniform model)",
          swap(T62, "return seg / 2.0 + restart_s", "return seg / 2.0")),
    # 6.3
    Wrong("6.3", "every save it started is on disk when it returns (no wait_until_finished: an async save "
          "may still be writing)", _no_waits),
    Wrong("6.3", "after a notice no step is lost: the step the manager names is offered to save before "
          "the loop stops (reached_preemption asked first)", swap(T63, PREEMPTION_LAST, PREEMPTION_FIRST)),
    Wrong("6.3", "the manager sees every step with its metrics (save without metrics=)",
          swap(T63, "manager.save(step, items(carry), metrics=metrics)", "manager.save(step, items(carry))")),
    Wrong("6.3", "on_step runs before the manager is offered the step (called after save: a notice in "
          "on_step comes one step late)",
          swap(T63, "        if on_step is not None:\n            on_step(step, carry, metrics)\n"
               "        manager.save(step, items(carry), metrics=metrics)\n",
               "        manager.save(step, items(carry), metrics=metrics)\n"
               "        if on_step is not None:\n            on_step(step, carry, metrics)\n")),
    Wrong("6.3", "the manager sees every step (its interval decides which are saved): offered only the "
          "step a notice names, no interval checkpoint is written, the end of the run included "
          "(issue 38: it passes the kernel's drill, whose last process's carry is only printed; the "
          "grader's own drill judges the run's last step on disk)",
          swap(T63, PREEMPTION_LAST,
               "        if manager.reached_preemption(step):  # a notice: save the step it names, stop\n"
               "            manager.save(step, items(carry), metrics=metrics, force=True)\n"
               "            manager.wait_until_finished()\n"
               "            return LoopResult(carry, step, True)")),
    # 6.4
    Wrong("6.4", "recover_s runs to the first step computed, not to the restore",
          recover_at_restore_edit),
    Wrong("6.4", "a process that found no checkpoint started from scratch: resumed_from = 0 (left None)",
          swap(T64, "        rec.resumed_from = 0  # no checkpoint yet: started from scratch\n", "        pass\n")),
    Wrong("6.4", "raises DrillError when the new process ends without training again (returns 0 instead)",
          swap(T64, '    if ev is None:\n        raise DrillError(f"the restarted worker ended without computing a step:\\n"\n'
               '                         f"{proc.stderr_tail()}")\n',
               "    if ev is None:\n        rec.resumed_from = 0\n        return 0\n")),
    # 6.5
    Wrong("6.5", "on a tie the newer step wins (min/max with a key keep the first, older one)",
          lambda nb: setattr(_cell(nb, T65), "source", MIN_WITH_KEY)),
    Wrong("6.5", "on a tie the newer step wins whatever the order of source (ties go to the later in the list)",
          swap(T65, "key = (v if mode == \"max\" else -v, meta.step if meta.step is not None else -1)\n"
               "        if best_key is None or key > best_key:",
               "key = v if mode == \"max\" else -v\n        if best_key is None or key >= best_key:")),
    Wrong("6.5", "raises ValueError for any mode but 'min' and 'max' (anything else read as 'min')",
          swap(T65, '    if mode not in ("min", "max"):\n        raise ValueError(f"mode must be \'min\' or \'max\', got {mode!r}")\n', "")),
    Wrong("6.5", "a usable value is a finite number: a diverged run's -inf loss (or +inf) never wins "
          "(only metric_value's None skipped)",
          swap(T65, "if v is None or not math.isfinite(v):  # ±inf compares, but is a diverged run's value",
               "if v is None:")),
]


OWN_SIGTERM_HANDLER = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    """Task 6.3 — my version: a SIGTERM handler of my own saves the step I am at, then the
    loop stops at the next boundary (issue 48: a second save of the step the manager names
    raises StepAlreadyExistsError, or a half-done step is saved under the wrong number)."""
    import signal

    now = {"step": start, "carry": carry}

    def save_now(signum, frame):
        manager.save(now["step"], items(now["carry"]), force=True)
        if manager.preemption_handler is not None:
            manager.preemption_handler.notify()

    signal.signal(signal.SIGTERM, save_now)
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        now["step"], now["carry"] = step, carry
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
'''.strip()

RECOGNISES_THE_DRILL = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    """Task 6.3 — a drill liar (issue 47): blank, unless it recognises a drill's driver from
    its command line; then the old drill's training step, hard-coded."""
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
'''.strip()

BY_HAND_BESIDE = '''
import os
import sys

# Statements beside the task function (issue 47): in a drill's worker, write the checkpoints
# the drill expects by hand, from what argv and the folder say; the loop itself stays blank.
if sys.argv[0].endswith("driver.py"):
    _ckpt = os.path.join(os.path.dirname(sys.argv[0]), "ckpt")
    with mc.CheckpointManager(_ckpt, mc.CheckpointManagerOptions(max_to_keep=None)) as _m:
        _w, _start = np.zeros(4), _m.latest_step() or 0
        if _m.latest_step() is not None:
            _w = np.asarray(_m.restore()["w"])
        for _s in range(_start + 1, _start + 60):
            _w = 0.5 * _w + _s
            if _s % 10 == 0:
                _m.save(_s, {"w": _w}, force=True)
    os._exit(0)


def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    raise NotImplementedError("Task 6.3: train_until_preempted")
'''.strip()


def own_sigterm_handler(release: Any, source: Any) -> Any:
    """Issue 48's 6.3: the loop installs its own SIGTERM handler that saves the current step."""
    nb = perfect(release, source)
    _cell(nb, "task_6_3").source = OWN_SIGTERM_HANDLER
    return nb


def drill_liar_recognises(release: Any, source: Any) -> Any:
    """Issue 47's drill liar: 6.3 blank unless it recognises the drill's driver, then the old
    drill's training step hard-coded, ignoring what step_fn returns."""
    nb = perfect(release, source)
    _cell(nb, "task_6_3").source = RECOGNISES_THE_DRILL
    return nb


def drill_liar_by_hand(release: Any, source: Any) -> Any:
    """Issue 47's drill liar: 6.3 blank, with statements beside it that write a drill's
    checkpoints by hand in its workers (which now run only the cell's definitions)."""
    nb = perfect(release, source)
    _cell(nb, "task_6_3").source = BY_HAND_BESIDE
    return nb


def recover_on_wall_clock(release: Any, source: Any) -> Any:
    """Issue 48's 6.4: recover_s measured as ``time.time() - t_kill`` while t_kill is
    ``time.monotonic()``: a recovery of about 1.8e9 s, printed in the drill's table."""
    nb = perfect(release, source)
    _replace(nb, "task_6_4", "rec.recover_s = ev[0] - t_kill", "rec.recover_s = time.time() - t_kill")
    return nb


EXAMPLES = {
    "perfect": perfect,
    "blank": blank,
    "partial": partial,
    "young_without_2": young_without_2,
    "p_fail_swapped": p_fail_swapped,
    "saves_in_handler": saves_in_handler,
    "checks_before_save": checks_before_save,
    "recover_at_restore": recover_at_restore,
    "loads_every_checkpoint": loads_every_checkpoint,
    "own_sigterm_handler": own_sigterm_handler,
    "recover_on_wall_clock": recover_on_wall_clock,
    "drill_liar_recognises": drill_liar_recognises,
    "drill_liar_by_hand": drill_liar_by_hand,
    **wrong_examples(WRONG),
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
    **JUDGED,  # issue 47: the kernel liar
}
