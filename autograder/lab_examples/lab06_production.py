"""Lab 6's example submissions (production): the perfect and blank hand-ins, a partial one, and
one typical mistake per task. Expected grades: ``autograder/examples/expected-lab06_production.csv``."""

from __future__ import annotations

from typing import Any

from .common import _answers, _cell, _replace, blank, perfect
from .hostile import ISSUE_20

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
        if not metadata_matches(meta, where) or v is None:
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
    _replace(nb, "task_6_4", '    ev = proc.wait_for(("resumed from step", "step"), deadline)\n',
             '    ev = proc.wait_for(("resumed from step", "step"), deadline)\n    first = ev[0] if ev else None\n')
    _replace(nb, "task_6_4", "rec.recover_s = ev[0] - t_kill", "rec.recover_s = first - t_kill")
    return nb


def loads_every_checkpoint(release: Any, source: Any) -> Any:
    """6.5 restores every checkpoint to read its metrics: right answers, every array read."""
    nb = perfect(release, source)
    _cell(nb, "task_6_5").source = LOADS_EVERYTHING
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
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
}
