"""Interval planning: Young, Daly, lost work, the seed's P_fail, retention from capacity.

Each formula is checked against something computed another way: published worked examples,
a numerical optimum of the cost model, a Monte Carlo simulation of Poisson failures, or a
binomial sum.
"""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minickpt import CheckpointManager, CheckpointManagerOptions, SaveStats
from minickpt.commit import parse_step
from minickpt.fs import FileSystem
from minickpt.production.planning import (
    daly_interval,
    expected_lost_work,
    expected_waste_fraction,
    interval_failure_probability,
    max_to_keep_for_capacity,
    measured_save_cost,
    optimal_interval,
    p_fail,
    plan_interval,
    recommended_save_interval_steps,
    young_interval,
)


def _argmin(f, lo, hi, n=400_001):
    """The minimiser of f on a fine geometric grid: an optimum found without any formula."""
    xs = np.geomspace(lo, hi, n)
    return float(xs[int(np.argmin(f(xs)))])


def _daly_wall(tau, d, m, r=0.0):
    """Daly (2006), the complete model: T_wall/T_solve = M·e^{R/M}·(e^{(τ+δ)/M} − 1)/τ."""
    return m * np.exp(r / m) * np.expm1((tau + d) / m) / tau


@pytest.mark.task("6.1")
@pytest.mark.parametrize("mtbf_min, expected_min", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_matches_the_papers_worked_examples(mtbf_min, expected_min):
    """Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    FGCS 22 (2006) 303-312, Figs. 3-5: δ = 5 min, R = 10 min, and M = 24 h, 6 h, 15 min;
    "the new model predicts τ_opt = 117 min, 57 min, 9.1 min" (given to the figures shown)."""
    got = optimal_interval(5.0, mtbf_min, method="daly")
    digits = 1 if expected_min < 10 else 0
    assert round(got, digits) == expected_min


@pytest.mark.task("6.1")
def test_young_is_the_optimum_of_youngs_first_order_cost():
    """Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9)
    (1974): lost time per unit of work ≈ C/τ + τ/(2M), whose minimum is √(2CM). For Daly's
    example (δ = 5 min, M = 24 h) that is 120 min, 3 min more than the higher-order 117."""
    c, m = 5.0, 24 * 60.0
    assert young_interval(c, m) == pytest.approx(120.0)
    found = _argmin(lambda t: c / t + t / (2 * m), 1.0, 1e4)
    assert young_interval(c, m) == pytest.approx(found, rel=1e-4)
    assert daly_interval(c, m) < young_interval(c, m)


@pytest.mark.task("6.1")
@pytest.mark.parametrize("c, m", [(5.0, 1440.0), (5.0, 360.0), (1.0, 100.0), (3.0, 10.0),
                                  (30.0, 3600.0)])
def test_daly_is_close_to_the_numerical_optimum_of_the_complete_model(c, m):
    """Daly's estimate approximates the minimiser of his complete cost model; it stays within
    1 % of it where Young's first-order formula is off by 3 % to 30 %."""
    best = _argmin(lambda t: _daly_wall(t, c, m, r=10.0), 1e-3 * m, 10 * m)
    assert daly_interval(c, m) == pytest.approx(best, rel=0.01)
    assert abs(daly_interval(c, m) - best) <= abs(young_interval(c, m) - best)


@pytest.mark.task("6.1")
def test_daly_saturates_at_the_mtbf_and_rejects_bad_input():
    assert daly_interval(20.0, 10.0) == 10.0  # δ >= 2M: τ = M
    assert daly_interval(0.0, 10.0) == 0.0 == young_interval(0.0, 10.0)
    with pytest.raises(ValueError, match="MTBF"):
        optimal_interval(1.0, 0.0)
    with pytest.raises(ValueError, match="method"):
        optimal_interval(1.0, 10.0, method="guess")


def test_waste_model_agrees_with_a_simulation_of_poisson_failures():
    """Monte Carlo: segments of τ compute + C save; a failure (exponential, mean M) throws
    the segment away and costs a restart R, which can itself be interrupted."""
    m, c, r, tau, n = 1.0, 0.1, 0.05, 0.4, 100_000
    rng = np.random.default_rng(0)
    draws, i, wall = rng.exponential(m, 5 * n), 0, 0.0
    for _ in range(n):
        need = tau + c
        while True:
            f = draws[i]
            i += 1
            if f >= need:
                wall += need
                break
            wall += f
            need = r + tau + c
    assert expected_waste_fraction(tau, c, m, r) == pytest.approx(wall / (n * tau) - 1, rel=0.02)


@pytest.mark.task("6.2")
def test_expected_lost_work_first_order_and_exact():
    assert expected_lost_work(100.0, save_cost_s=10.0, restart_s=30.0) == 85.0  # 110/2 + 30
    # exact: the mean of an exponential failure time given it falls within the segment
    m, seg = 50.0, 40.0
    rng = np.random.default_rng(1)
    t = rng.exponential(m, 2_000_000)
    sim = float(t[t < seg].mean())
    assert expected_lost_work(30.0, save_cost_s=10.0, mtbf_s=m) == pytest.approx(sim, rel=0.005)
    # short segments: the exact value approaches the first-order (τ+C)/2
    assert expected_lost_work(1.0, mtbf_s=1e6) == pytest.approx(0.5, rel=1e-5)
    assert expected_lost_work(30.0, mtbf_s=m) < expected_lost_work(30.0)


@pytest.mark.task("6.2")
@pytest.mark.parametrize("x", [1e-15, 1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 2e-3, 0.1, 1.0, 30.0])
def test_expected_lost_work_keeps_its_digits_for_every_segment_to_mtbf_ratio(x):
    """Before: M - L/expm1(L/M) cancels for a segment far shorter than M (a relative error
    of 9e-5 at L/M = 1e-12, where the contract promises 1e-6). Checked against the same
    formula in 60-digit decimal arithmetic."""
    from decimal import Decimal, getcontext

    getcontext().prec = 60
    m = 7.0
    seg = x * m
    d = Decimal(seg) / Decimal(m)
    want = float(Decimal(m) * (1 - d / (d.exp() - 1)))
    got = expected_lost_work(seg, mtbf_s=m)
    assert got == pytest.approx(want, rel=1e-9, abs=0), (x, got, want)


@pytest.mark.task("6.2")
@pytest.mark.parametrize("x", [700.0, 710.0, 800.0, 1e6, 1e300])
def test_expected_lost_work_of_a_segment_far_longer_than_the_mtbf_is_the_mtbf(x):
    """Before: math.expm1(L/M) overflowed past L/M ~ 709, so the planner raised OverflowError
    for a long interval and a short MTBF. A failure then comes early in the segment: the loss
    is M (plus R), the mean of the unconditioned failure time."""
    got = expected_lost_work(x * 2.0, restart_s=3.0, mtbf_s=2.0)
    assert math.isfinite(got) and got == pytest.approx(2.0 + 3.0, rel=1e-12)


@pytest.mark.task("6.2")
def test_p_fail_is_the_seeds_formula():
    """P_fail = 1 − (1 − p)^⌊T_total/T_interval⌋, checked against the binomial sum
    Σ_{k≥1} C(N,k) p^k (1−p)^{N−k}: the probability of at least one failed interval."""
    p, total, interval = 0.01, 1005, 10  # ⌊1005/10⌋ = 100 intervals
    binom = sum(math.comb(100, k) * p**k * (1 - p) ** (100 - k) for k in range(1, 101))
    assert p_fail(p, total, interval) == pytest.approx(binom, rel=1e-12)
    assert p_fail(p, total, interval) == pytest.approx(0.633968, abs=1e-6)
    assert p_fail(0.0, 1000, 10) == 0.0 and p_fail(1.0, 1000, 10) == 1.0
    assert p_fail(0.5, 9, 10) == 0.0  # no complete interval
    with pytest.raises(ValueError):
        p_fail(1.5, 10, 1)


@given(st.floats(0.0, 1.0), st.integers(0, 10_000), st.integers(1, 500), st.integers(0, 500))
def test_p_fail_grows_with_the_number_of_intervals(p, total, interval, more):
    a, b = p_fail(p, total, interval), p_fail(p, total + more, interval)
    assert 0.0 <= a <= b <= 1.0


@pytest.mark.task("6.2")
def test_saving_more_often_does_not_make_failures_rarer():
    """With p derived from an MTBF, P_fail over the same run hardly depends on the interval
    (it is 1 − e^{−T/M} whenever the intervals tile the run): the interval changes the cost
    of a failure, not its odds."""
    total, m = 1000.0, 400.0
    values = [p_fail(interval_failure_probability(i, m), total, i) for i in (1, 10, 50, 100)]
    assert values == pytest.approx([-math.expm1(-total / m)] * 4, rel=1e-9)


class _CountingFS(FileSystem):
    """Records the most step directories that ever existed at once (peak disk use)."""

    def __init__(self):
        self.peak = 0

    def rename(self, src, dst):
        super().rename(src, dst)
        root = os.path.dirname(dst)
        n = sum(parse_step(x) is not None for x in os.listdir(root))
        self.peak = max(self.peak, n)


def test_max_to_keep_for_capacity_leaves_room_for_the_save_in_flight(tmp_path):
    tree = {"w": jnp.zeros((64, 64))}  # 16 KiB of data
    with CheckpointManager(tmp_path / "probe") as m:
        m.save(0, {"t": tree})
        size = m.metadata(0).bytes
    budget = 3 * size + size // 2  # room for 3 checkpoints: K = 3
    keep = max_to_keep_for_capacity(budget, size)
    assert keep == 2
    for name, k in (("fits", keep), ("naive", keep + 1)):
        fs = _CountingFS()
        with CheckpointManager(tmp_path / name, CheckpointManagerOptions(max_to_keep=k),
                               fs=fs) as m:
            for s in range(6):
                m.save(s, {"t": tree})
        assert fs.peak == k + 1
    with pytest.raises(ValueError, match="not enough"):
        max_to_keep_for_capacity(size, size)


def _stats(blocking, total, ok=True):
    return SaveStats(step=0, path="x", blocking_s=blocking, total_s=total, ok=ok)


def test_plan_uses_the_median_blocking_time_of_successful_saves():
    hist = [_stats(1.0, 1.0), _stats(2.0, 2.0), _stats(9.0, 9.0), _stats(50.0, 50.0, ok=False)]
    cost, write, n = measured_save_cost(hist)
    assert (cost, write, n) == (2.0, 2.0, 3)
    m, step_time = 7200.0, 0.5
    plan = plan_interval(hist, mtbf_s=m, step_time_s=step_time, method="young")
    assert plan.save_interval_steps == 339  # √(2·2 s·7200 s) = 169.7 s of 0.5 s steps
    assert recommended_save_interval_steps(hist, mtbf_s=m, step_time_s=step_time) == round(
        daly_interval(2.0, m) / step_time)


def test_async_saves_plan_on_the_blocking_part_but_never_overlap():
    # async: training stops 0.1 s per save, but each write takes 60 s in the background
    hist = [_stats(0.1, 60.0)] * 5
    plan = plan_interval(hist, mtbf_s=3600.0, step_time_s=1.0)
    assert plan.save_cost_s == 0.1 and plan.write_s == 60.0
    assert daly_interval(0.1, 3600.0) < 59.9  # the formula alone would overlap saves
    assert plan.save_interval_steps == 60  # 59.9 s of compute + the 0.1 s snapshot


def test_plan_from_a_real_managers_history(tmp_path):
    with CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match="save once"):
            plan_interval(m, mtbf_s=3600.0, step_time_s=0.1)
        for s in range(3):
            m.save(s, {"t": {"w": jnp.ones((128, 128))}})
        plan = plan_interval(m, mtbf_s=3600.0, step_time_s=0.1)
    assert plan.n_saves == 3
    assert plan.save_cost_s == sorted(s.blocking_s for s in m.save_history)[1] > 0
    assert plan.save_interval_steps >= 1
    assert plan.expected_waste > 0
