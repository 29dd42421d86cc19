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
    """Task 2.1 — should the training loop save at ``step``?

    Receives the step about to be saved, the newest step already saved (``None`` when the
    directory holds none), the interval ``I >= 1`` and a collection of extra steps.
    Returns ``True`` exactly when

    * nothing has been saved yet: a run must always get a first checkpoint to fall back to,
      whatever its step (a run resumed from scratch at step 7 saves at 7); otherwise
    * never at or before ``last_saved_step``: a restarted run must not save again what it
      already has, nor go back in time; and then
    * ``step % I == 0``, or ``step`` is one of ``save_on_steps``.

    These are Orbax's rules, so the same options save the same steps in both libraries.
    Pure: no error to raise, nothing touched.
    """
    if last_saved_step is None:
        return True
    if step <= last_saved_step:
        return False
    return step % save_interval_steps == 0 or step in save_on_steps


def _metric(info: StepInfo, best_fn: Callable[[Mapping[str, Any]], float]) -> float | None:
    """The metric ``best_fn`` gives ``info`` (NaN and ±inf included), or None without one."""
    if info.metrics is None:
        return None
    try:
        value = best_fn(info.metrics)
        # text is no metric, even when float() would read it ("nan", "0.5")
        return None if isinstance(value, (str, bytes)) else float(value)
    except (KeyError, TypeError, ValueError):
        return None


def rank_by_metric(infos: Sequence[StepInfo], best_fn: Callable[[Mapping[str, Any]], float],
                   best_mode: str = "max") -> list[StepInfo]:
    """Checkpoints that have a metric, best first (ties: the newer step first).

    A checkpoint has a metric when its ``metrics`` are not None and ``best_fn`` returns a
    number for them (a missing key counts as no metric). A non-finite metric — NaN, +inf or
    -inf, what a diverged run reports — ranks *after every finite one*, whatever
    ``best_mode``, and the non-finite ones among themselves newest first. So a diverged run
    keeps ``max_to_keep`` checkpoints like any other (NaN is not "no metric", which
    ``keep_checkpoints_without_metrics`` would keep forever and fill the disk with), and
    never evicts a finite checkpoint. Orbax sorts NaN with Python's ``sorted``, whose answer
    for NaN depends on the order of the list, and ranks ±inf as ordinary numbers.
    """
    scored = [(m, i) for i in infos if (m := _metric(i, best_fn)) is not None]
    sign = -1.0 if best_mode == "max" else 1.0

    def key(mi: tuple[float, StepInfo]) -> tuple[bool, float, int]:
        finite = math.isfinite(mi[0])
        return (not finite, sign * mi[0] if finite else 0.0, -mi[1].step)

    scored.sort(key=key)
    return [i for _, i in scored]


def best_step(infos: Sequence[StepInfo], best_fn: Callable[[Mapping[str, Any]], float],
              best_mode: str = "max") -> int | None:
    """The step whose metric is best, or None when no checkpoint has a finite one (a
    diverged checkpoint is never the best)."""
    ranked = [i for i in rank_by_metric(infos, best_fn, best_mode)
              if math.isfinite(_metric(i, best_fn) or 0.0)]
    return ranked[0].step if ranked else None


def steps_to_keep(infos: Sequence[StepInfo], *, max_to_keep: int | None = None,
                  keep_period: int | None = None,
                  best_fn: Callable[[Mapping[str, Any]], float] | None = None,
                  best_mode: str = "max",
                  keep_checkpoints_without_metrics: bool = True) -> set[int]:
    """Task 2.2 — which of the saved checkpoints survive retention (Orbax's rules).

    Receives every saved checkpoint (``infos``, in any order: a step and its metrics) and
    the options; returns the set of steps to keep — a subset of the steps given, never a
    step that was not saved. The manager deletes the others, after the newest checkpoint is
    durable. The rules, in Orbax's order:

    * ``max_to_keep=None``, or no more checkpoints than ``max_to_keep``: keep them all.
      This rule comes first: it keeps checkpoints without a metric too, even when
      ``keep_checkpoints_without_metrics`` is false. ``max_to_keep=0`` keeps none by
      the rules below (``keep_period`` and ``keep_checkpoints_without_metrics`` still keep theirs).
    * Without ``best_fn``: the ``max_to_keep`` newest steps (by step number, not by the
      order of ``infos``).
    * With ``best_fn``: the ``max_to_keep`` best checkpoints among those with a metric, as
      :func:`rank_by_metric` ranks them (``best_mode`` 'max' or 'min'; a tie goes to the
      newer step; non-finite metrics rank last). Checkpoints without a metric are all kept
      when ``keep_checkpoints_without_metrics``, all dropped otherwise, and never count
      towards ``max_to_keep``. The newest step has no protection: a new checkpoint worse
      than the best N is dropped at once.
    * ``keep_period=P``: a step with ``step % P == 0`` is kept whatever the rules above say.

    Pure: the infos are not changed, nothing is raised.
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


def newest_steps(infos: Sequence[StepInfo], n: int | None) -> set[int]:
    """The ``n`` newest steps: what ``keep_latest=n`` (minickpt's option) keeps besides the
    rules of :func:`steps_to_keep`, so that with ``best_fn`` a run keeps the step to resume
    from as well as its best ones (Orbax drops a new step worse than the best N, and a crash
    then loses the work since the best)."""
    return set(sorted(i.step for i in infos)[-n:]) if n else set()


def legacy_steps_to_keep(steps: Sequence[int], keep: int,
                         keep_every_n_steps: int | None = None) -> set[int]:
    """Task 2.2 (Flax) — which steps Flax's ``save_checkpoint(keep=, keep_every_n_steps=)``
    leaves on disk, exactly.

    Receives the saved steps (any order) and Flax's two options; returns the set of steps
    kept. The ``keep`` newest survive; ``keep=0`` removes nothing (Flax's meaning, unlike
    Orbax's ``max_to_keep``). Among the older ones, walking from the oldest, one is kept each
    time at least ``keep_every_n_steps`` steps have passed since the last one kept *in this
    walk* (the first one always qualifies) — a distance, not ``step % n == 0``. Flax tests
    the step for truth before the distance, so step 0 is never kept by this rule; matching
    that means a directory pruned by either library holds the same steps. Raises
    ``ValueError`` for ``keep < 0``.
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


def check_metric(best_fn: Callable[[Mapping[str, Any]], float] | None,
                  metrics: Mapping[str, Any] | None) -> None:
    """Refuse a metric that is text: ``float("nan")`` would make the string ``"nan"`` (or
    ``"0.5"``) a number that ranks checkpoints, from what is likely a formatting slip."""
    if best_fn is None or metrics is None:
        return
    try:
        value = best_fn(metrics)
    except Exception:
        # no metric (keep_checkpoints_without_metrics decides); retention says so, naming
        # the step (see scorable): a best_fn that fails must never fail a save
        return
    if isinstance(value, (str, bytes)):
        raise TypeError(f"best_fn gives {value!r} for metrics {dict(metrics)!r}: a metric "
                        "must be a number, not text (pass float(loss), not a formatted string)")


def scorable(infos: Sequence[StepInfo], best_fn: Callable[[Mapping[str, Any]], float] | None
             ) -> tuple[list[StepInfo], dict[int, str]]:
    """``infos`` with the metrics ``best_fn`` raises on replaced by None ("no metric"), and
    those steps -> the error, in one line.

    A ``best_fn`` may work on the caller's values and fail on the same metrics read back
    as JSON (``m["loss"].item()`` on a float, after a restart): what it cannot read is no
    metric, for every exception it raises, not only the ``KeyError``/``TypeError``/
    ``ValueError`` the ranking above already treats so."""
    if best_fn is None:
        return list(infos), {}
    out, errors = [], {}
    for i in infos:
        if i.metrics is not None:
            try:
                best_fn(i.metrics)
            except (KeyError, TypeError, ValueError):
                pass  # no metric already, as rank_by_metric reads it
            except Exception as e:
                errors[i.step] = f"{type(e).__name__}: {e}"
                i = StepInfo(i.step, None, i.time)
        out.append(i)
    return out, errors
