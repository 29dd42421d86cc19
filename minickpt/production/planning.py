"""How often to save and how many to keep: the arithmetic of chapter 6, on measured numbers.

Symbols (one unit of time throughout, seconds unless you say otherwise):

* ``C`` (Daly's δ) — what one save costs the training loop: the time it is *stopped*. For a
  synchronous save that is the whole save; for an asynchronous one only the blocking part
  (the snapshot), which is what :class:`~minickpt.SaveStats` calls ``blocking_s``.
* ``M`` — the mean time between failures (MTBF) of the whole job (all its machines together).
* ``τ`` — the compute time between two saves (the save interval, not counting the save).
* ``R`` — the restart cost: notice the failure, get a machine, start, restore, recompile.

Failures are modelled as a Poisson process (independent, memoryless, rate 1/M), the model of
Young (1974) and Daly (2006).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ..policy import capacity

METHODS = ("young", "daly")


def _check_cost(save_cost_s: float, mtbf_s: float) -> None:
    if not save_cost_s >= 0:
        raise ValueError(f"save cost must be >= 0, got {save_cost_s!r}")
    if not mtbf_s > 0:
        raise ValueError(f"MTBF must be > 0, got {mtbf_s!r}")


def optimal_interval(save_cost_s: float, mtbf_s: float, *, method: str = "daly") -> float:
    """Task 6.1 — the compute time τ between saves that minimises the expected run time.

    ``"young"``: Young's first-order optimum (1974); ``"daly"``: Daly's higher-order one
    (2006), which stays accurate when saves are not cheap compared with the MTBF (chapter 6,
    section 2), and is the MTBF itself once C >= 2M (Daly's own rule, where his expansion
    stops holding). C >= 0 and M > 0 share a time unit, which
    the float result has; anything else (an unknown method, NaN) is a ValueError.
    """
    if not save_cost_s >= 0:  # also False for NaN
        raise ValueError(f"save cost must be >= 0, got {save_cost_s!r}")
    if not mtbf_s > 0:
        raise ValueError(f"MTBF must be > 0, got {mtbf_s!r}")
    c, m = float(save_cost_s), float(mtbf_s)
    if method == "young":
        return math.sqrt(2.0 * c * m)
    if method != "daly":
        raise ValueError(f"method must be 'young' or 'daly', got {method!r}")
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum τ ≈ √(2·C·M)."""
    return optimal_interval(save_cost_s, mtbf_s, method="young")


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (see :func:`optimal_interval`)."""
    return optimal_interval(save_cost_s, mtbf_s, method="daly")


def expected_lost_work(interval_s: float, *, save_cost_s: float = 0.0, restart_s: float = 0.0,
                       mtbf_s: float | None = None) -> float:
    """Task 6.2 — the expected time one failure costs: redone work plus the restart.

    What is modelled: training runs in segments of τ compute followed by a save of C; a
    failure throws away everything since the last *committed* checkpoint — the compute of
    the current segment and, if it strikes during the save, the part of the save already
    done — and then costs the restart R. Without ``mtbf_s`` the failure time is uniform over
    the segment (valid when τ + C ≪ M). With ``mtbf_s`` it is the exact mean of an
    exponential failure time conditioned to fall within the segment, plus R: accurate to
    a relative 1e-6 for every segment, far shorter than M as well as far longer (whose loss
    is M: the failure comes early), and R alone for an empty segment.
    """
    if not interval_s >= 0 or not save_cost_s >= 0 or not restart_s >= 0:
        raise ValueError("interval, save cost and restart cost must be >= 0")
    seg = float(interval_s) + float(save_cost_s)
    if mtbf_s is None:
        return seg / 2.0 + restart_s
    if not mtbf_s > 0:
        raise ValueError(f"MTBF must be > 0, got {mtbf_s!r}")
    m = float(mtbf_s)
    x = seg / m  # (0 for an empty segment: the series gives 0, and the loss is R)
    if x < 1e-3:  # 1 - x/(e^x - 1) by its series: the subtraction would cancel the digits
        lost = x / 2.0 - x * x / 12.0 + x**4 / 720.0
    elif x > 700.0:  # e^x overflows a float; x/(e^x - 1) is x·e^-x there
        lost = 1.0 - x * math.exp(-x)
    else:
        lost = 1.0 - x / math.expm1(x)
    return m * lost + restart_s


def p_fail(p: float, total: float, interval: float) -> float:
    """Task 6.2 — the seed's P_fail = 1 − (1 − p)^⌊T_total / T_interval⌋.

    ``p`` is, as the seed defines it, the probability that training is interrupted during
    one save interval (power loss, a crash...); the run is ⌊T_total/T_interval⌋ such
    intervals, each a window in which at most one interval of work can be lost, so P_fail is
    the probability that the run meets at least one interruption (if intervals fail
    independently). ``total`` and ``interval`` share a unit (steps or seconds).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p is a probability, got {p!r}")
    if not interval > 0 or not total >= 0:
        raise ValueError(f"need total >= 0 and interval > 0, got {total!r}, {interval!r}")
    n = math.floor(total / interval)
    return -math.expm1(n * math.log1p(-p)) if p < 1.0 else float(n > 0)


def interval_failure_probability(interval_s: float, mtbf_s: float) -> float:
    """The seed's p for an interval of ``interval_s`` under Poisson failures: 1 − e^{−τ/M}.

    With this p, P_fail hardly depends on the interval (more, shorter intervals, each less
    likely to fail): saving more often does not make failures rarer, it makes each one cost
    less (:func:`expected_lost_work`).
    """
    if not interval_s >= 0 or not mtbf_s > 0:
        raise ValueError("need interval >= 0 and MTBF > 0")
    return -math.expm1(-interval_s / mtbf_s)


def expected_waste_fraction(interval_s: float, save_cost_s: float, mtbf_s: float,
                            restart_s: float = 0.0) -> float:
    """Expected wall time over useful compute time, minus 1, under Poisson failures.

    Daly's (2006) complete model: T_wall / T_solve = M·e^{R/M}·(e^{(τ+C)/M} − 1) / τ, which
    counts the saves, the redone work and restarts that can themselves be interrupted. The
    optimum of this curve is what :func:`optimal_interval` approximates.
    """
    if not interval_s > 0:
        raise ValueError(f"interval must be > 0, got {interval_s!r}")
    _check_cost(save_cost_s, mtbf_s)
    m = float(mtbf_s)
    return m * math.exp(restart_s / m) * math.expm1((interval_s + save_cost_s) / m) \
        / interval_s - 1.0


def max_to_keep_for_capacity(total_bytes: int, checkpoint_bytes: int, *, in_flight: int = 1
                             ) -> int:
    """``max_to_keep`` that fits a storage budget: ⌊S_total / S_ckpt⌋ − ``in_flight``.

    K = ⌊S_total/S_ckpt⌋ checkpoints fit, but a new checkpoint is written in full *before*
    the oldest is deleted (deleting first would leave nothing valid if the save failed), so
    one more than ``max_to_keep`` exists during each save.
    """
    k = capacity(int(total_bytes), int(checkpoint_bytes)) - in_flight
    if k < 1:
        raise ValueError(f"{total_bytes} bytes hold {k + in_flight} checkpoint(s) of "
                         f"{checkpoint_bytes} bytes: not enough to keep one while writing the "
                         "next; get more storage or save less")
    return k


# ---------------------------------------------------------------------------------------
# planning from a manager's own measurements
# ---------------------------------------------------------------------------------------
def _history(source: Any) -> list[Any]:
    hist = getattr(source, "save_history", source)
    return list(hist)


def _get(s: Any, name: str) -> Any:
    return s.get(name) if isinstance(s, dict) else getattr(s, name, None)


def measured_save_cost(source: Any) -> tuple[float, float, int]:
    """(median blocking seconds, median total seconds, number of saves) of the successful
    saves in a manager's ``save_history`` (or any iterable of SaveStats or their dicts)."""
    ok = [s for s in _history(source) if _get(s, "ok")]
    if not ok:
        raise ValueError("no successful save has been measured yet: save once (the first step "
                         "always saves) before planning the interval")
    blocking = [float(_get(s, "blocking_s") or _get(s, "total_s") or 0.0) for s in ok]
    total = [float(_get(s, "total_s") or 0.0) for s in ok]
    return statistics.median(blocking), statistics.median(total), len(ok)


@dataclass
class IntervalPlan:
    """A save interval chosen from measured save costs; every number it was made from."""

    method: str
    save_cost_s: float  # median blocking time of the measured saves
    write_s: float  # median total time (the whole write, background part included)
    n_saves: int
    mtbf_s: float
    step_time_s: float
    interval_s: float  # compute time between saves
    save_interval_steps: int
    expected_lost_s: float  # per failure, redone work only (no restart cost)
    expected_waste: float  # of wall time, saves + redone work, per Daly's complete model

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_interval(source: Any, *, mtbf_s: float, step_time_s: float, method: str = "daly"
                  ) -> IntervalPlan:
    """Choose ``save_interval_steps`` from a manager's *measured* saves and an MTBF.

    The cost C is the median ``blocking_s`` of the successful saves in ``save_history``:
    for an async manager only the part that stops training. An async save also may not
    start before the previous one has finished writing, so the interval is never below the
    median total write time.
    """
    if not step_time_s > 0:
        raise ValueError(f"step time must be > 0, got {step_time_s!r}")
    cost, write, n = measured_save_cost(source)
    tau = max(optimal_interval(cost, mtbf_s, method=method), write - cost, 0.0)
    steps = max(1, round(tau / step_time_s))
    tau_real = steps * step_time_s
    return IntervalPlan(method, cost, write, n, float(mtbf_s), float(step_time_s), tau_real,
                        steps, expected_lost_work(tau_real, save_cost_s=cost, mtbf_s=mtbf_s),
                        expected_waste_fraction(tau_real, cost, mtbf_s))


def recommended_save_interval_steps(source: Any, *, mtbf_s: float, step_time_s: float,
                                    method: str = "daly") -> int:
    """The ``save_interval_steps`` :func:`plan_interval` recommends."""
    return plan_interval(source, mtbf_s=mtbf_s, step_time_s=step_time_s,
                         method=method).save_interval_steps

