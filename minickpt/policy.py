"""Save and retention decisions as pure functions: which steps to save, which to keep.

Nothing here touches the disk, so each rule can be tested (and rebuilt in lab 2) on its own,
and checked against Orbax's ``CheckpointManager`` step for step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepInfo:
    """What retention needs to know of one saved checkpoint."""

    step: int
    metrics: Mapping[str, Any] | None = None
    time: float = 0.0


def should_save(step: int, *, last_saved_step: int | None, save_interval_steps: int = 1,
                save_on_steps: Collection[int] = ()) -> bool:
    """Task 2.1 — save at ``step``?

    Never at or before the last saved step (a restarted run must not re-save what it
    already has). Otherwise yes when ``step % save_interval_steps == 0``, when ``step`` is one
    of ``save_on_steps``, or when nothing has been saved yet — Orbax's rule too, so that a
    run always has a first checkpoint to fall back to.
    """
    if last_saved_step is None:
        return True
    if step <= last_saved_step:
        return False
    return step % save_interval_steps == 0 or step in save_on_steps


def _metric(info: StepInfo, best_fn: Callable[[Mapping[str, Any]], float]) -> float | None:
    if info.metrics is None:
        return None
    try:
        v = float(best_fn(info.metrics))
    except (KeyError, TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def rank_by_metric(infos: Sequence[StepInfo], best_fn: Callable[[Mapping[str, Any]], float],
                   best_mode: str = "max") -> list[StepInfo]:
    """Checkpoints that have a metric, best first (ties: the newer step first)."""
    scored = [(m, i) for i in infos if (m := _metric(i, best_fn)) is not None]
    sign = -1.0 if best_mode == "max" else 1.0
    scored.sort(key=lambda mi: (sign * mi[0], -mi[1].step))
    return [i for _, i in scored]


def best_step(infos: Sequence[StepInfo], best_fn: Callable[[Mapping[str, Any]], float],
              best_mode: str = "max") -> int | None:
    """The step whose metric is best, or None when no checkpoint has one."""
    ranked = rank_by_metric(infos, best_fn, best_mode)
    return ranked[0].step if ranked else None


def steps_to_keep(infos: Sequence[StepInfo], *, max_to_keep: int | None = None,
                  keep_period: int | None = None,
                  best_fn: Callable[[Mapping[str, Any]], float] | None = None,
                  best_mode: str = "max",
                  keep_checkpoints_without_metrics: bool = True) -> set[int]:
    """Task 2.2 — which of the saved steps survive retention (Orbax's rules).

    * ``max_to_keep=None``, or no more than ``max_to_keep`` checkpoints: keep everything.
    * Without ``best_fn``: the ``max_to_keep`` newest steps.
    * With ``best_fn``: the ``max_to_keep`` best steps by metric (``best_mode`` 'max' or
      'min'; on a tie the newer step wins). Steps without a metric are all kept when
      ``keep_checkpoints_without_metrics``, and all deleted otherwise. The newest step is
      not protected: a new checkpoint worse than the best N is deleted at once.
    * ``keep_period=P``: a step with ``step % P == 0`` is kept whatever the rules above say
      (while among the newest it also counts towards ``max_to_keep``).
    """
    steps = sorted(i.step for i in infos)
    if max_to_keep is None or len(steps) <= max_to_keep:
        return set(steps)
    if best_fn is None:
        keep = set(steps[-max_to_keep:]) if max_to_keep > 0 else set()
    else:
        ranked = rank_by_metric(infos, best_fn, best_mode)
        keep = {i.step for i in ranked[:max_to_keep]} if max_to_keep > 0 else set()
        if keep_checkpoints_without_metrics:
            ranked_steps = {i.step for i in ranked}
            keep |= {s for s in steps if s not in ranked_steps}
    if keep_period:
        keep |= {s for s in steps if s % keep_period == 0}
    return keep


def legacy_steps_to_keep(steps: Sequence[int], keep: int,
                         keep_every_n_steps: int | None = None) -> set[int]:
    """Flax's legacy ``save_checkpoint(keep=, keep_every_n_steps=)`` rule, exactly.

    The ``keep`` newest survive (``keep=0`` removes nothing, as in Flax). Among the older ones,
    walking from the oldest, one is kept each time at least ``keep_every_n_steps`` steps have
    passed since the last one kept *in this walk* (the first one always qualifies). Flax tests
    the step for truth before the distance, so step 0 is never kept by the period rule; we
    match that too, so a directory pruned by either library holds the same steps.
    """
    steps = sorted(steps)
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    if keep == 0 or len(steps) <= keep:
        return set(steps)
    kept = set(steps[-keep:])
    if keep_every_n_steps:
        last_kept: float = -math.inf
        for s in steps[:-keep]:
            if s != 0 and s - last_kept >= keep_every_n_steps:
                kept.add(s)
                last_kept = s
    return kept


def num_checkpoints(total_steps: int, interval: int) -> int:
    """N_ckpt = ⌊T_total / T_interval⌋ — how many saves a run makes."""
    return total_steps // interval


def capacity(total_bytes: int, checkpoint_bytes: int) -> int:
    """K = ⌊S_total / S_ckpt⌋ — how many checkpoints fit in a storage budget."""
    if checkpoint_bytes <= 0:
        raise ValueError("checkpoint_bytes must be positive")
    return total_bytes // checkpoint_bytes
