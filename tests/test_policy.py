"""Save and retention rules: properties against a reference model, and against real Orbax."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.policy import (
    StepInfo,
    best_step,
    capacity,
    num_checkpoints,
    should_save,
    steps_to_keep,
)


@pytest.mark.task("2.1")
def test_should_save_examples():
    assert should_save(3, last_saved_step=None, save_interval_steps=5)  # first save always
    assert not should_save(3, last_saved_step=0, save_interval_steps=5)
    assert should_save(5, last_saved_step=0, save_interval_steps=5)
    assert should_save(7, last_saved_step=5, save_interval_steps=5, save_on_steps={7})
    assert not should_save(5, last_saved_step=5, save_interval_steps=5)  # already saved
    assert not should_save(10, last_saved_step=12, save_interval_steps=5)  # not backwards


def reference_keep(infos, max_to_keep, keep_period, metric, mode, kcwm):
    """An independent, deliberately naive statement of the retention rules."""
    steps = sorted(i.step for i in infos)
    if max_to_keep is None or len(steps) <= max_to_keep:
        return set(steps)
    if metric is None:
        keep = set(steps[len(steps) - max_to_keep:])
    else:
        scored = [i for i in infos if i.metrics is not None]
        # best first; among equals the newer step first
        scored.sort(key=lambda i: ((-1 if mode == "max" else 1) * i.metrics[metric], -i.step))
        keep = {i.step for i in scored[:max_to_keep]}
        if kcwm:
            keep |= {i.step for i in infos if i.metrics is None}
    if keep_period:
        keep |= {s for s in steps if s % keep_period == 0}
    return keep


infos_st = st.lists(
    st.tuples(st.integers(0, 60), st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.5, 0.9]))),
    max_size=15, unique_by=lambda t: t[0]).map(
    lambda xs: [StepInfo(s, None if m is None else {"loss": m}) for s, m in xs])


@pytest.mark.task("2.2")
@given(infos=infos_st, n=st.one_of(st.none(), st.integers(1, 5)),
       period=st.one_of(st.none(), st.integers(1, 7)), use_metric=st.booleans(),
       mode=st.sampled_from(["min", "max"]), kcwm=st.booleans())
def test_retention_matches_reference_and_invariants(infos, n, period, use_metric, mode, kcwm):
    best_fn = (lambda m: m["loss"]) if use_metric else None
    keep = steps_to_keep(infos, max_to_keep=n, keep_period=period, best_fn=best_fn,
                         best_mode=mode, keep_checkpoints_without_metrics=kcwm)
    assert keep == reference_keep(infos, n, period, "loss" if use_metric else None, mode, kcwm)
    steps = {i.step for i in infos}
    assert keep <= steps  # never invents a step
    if period:
        assert {s for s in steps if s % period == 0} <= keep  # keep_period always wins
    if n is not None and not use_metric and not period:
        assert len(keep) == min(n, len(steps))
        assert not steps or max(steps) in keep  # the newest survives without best_fn


@given(infos=infos_st, mode=st.sampled_from(["min", "max"]))
def test_best_step_is_the_best_metric(infos, mode):
    b = best_step(infos, lambda m: m["loss"], mode)
    scored = [i for i in infos if i.metrics is not None]
    if not scored:
        assert b is None
        return
    pick = (max if mode == "max" else min)(i.metrics["loss"] for i in scored)
    assert b == max(i.step for i in scored if i.metrics["loss"] == pick)


def test_formulas():
    assert num_checkpoints(100_000, 1_000) == 100
    assert capacity(500 * 2**30, 7 * 2**30) == math.floor(500 / 7)


# ---- differential: the same calls to Orbax and to minickpt keep the same steps -----------
calls_st = st.lists(st.tuples(st.integers(1, 4), st.one_of(
    st.none(), st.sampled_from([0.3, 0.1, 0.7, 0.5]))), min_size=1, max_size=10)


def run_orbax(tmp, options, calls):
    import orbax.checkpoint as ocp

    kw = dict(options)
    if kw.pop("metric", None):
        kw["best_fn"] = lambda m: m["loss"]
    out = []
    mngr = ocp.CheckpointManager(tmp, options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, **kw))
    for step, metrics in calls:
        saved = mngr.save(step, args=ocp.args.StandardSave({"x": np.zeros(2, np.float32)}),
                          metrics=metrics)
        out.append((bool(saved), list(mngr.all_steps())))
    mngr.close()
    return out


def run_minickpt(tmp, options, calls):
    kw = dict(options)
    if kw.pop("metric", None):
        kw["best_fn"] = lambda m: m["loss"]
    out = []
    with CheckpointManager(tmp, CheckpointManagerOptions(**kw)) as m:
        for step, metrics in calls:
            saved = m.save(step, {"x": {"x": np.zeros(2, np.float32)}}, metrics=metrics)
            out.append((saved, m.all_steps()))
    return out


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(gaps=calls_st, interval=st.integers(1, 3), n=st.one_of(st.none(), st.integers(1, 3)),
       period=st.one_of(st.none(), st.integers(2, 4)), metric=st.booleans(),
       mode=st.sampled_from(["min", "max"]), kcwm=st.booleans())
def test_same_decisions_as_orbax(tmp_path_factory, gaps, interval, n, period, metric, mode,
                                 kcwm):
    steps = np.cumsum([g for g, _ in gaps]).tolist()
    calls = [(s, None if m is None else {"loss": m}) for s, (_, m) in zip(steps, gaps,
                                                                          strict=True)]
    options = {"save_interval_steps": interval, "max_to_keep": n, "keep_period": period,
               "best_mode": mode, "keep_checkpoints_without_metrics": kcwm, "metric": metric}
    orbax = run_orbax(tmp_path_factory.mktemp("orbax"), options, calls)
    ours = run_minickpt(tmp_path_factory.mktemp("ours"), options, calls)
    assert [(s, sorted(k)) for s, k in orbax] == ours, (calls, options)


# ---- non-finite metrics (a diverged run) -------------------------------------------------
@pytest.mark.task("2.2")
def test_nan_metrics_do_not_switch_retention_off():
    """Six saves of a diverged run (loss NaN) with max_to_keep=2: two are kept, as Orbax
    keeps two, not all six (NaN once counted as "no metric", and those are kept forever)."""
    infos = [StepInfo(s, {"loss": math.nan}) for s in range(1, 7)]
    keep = steps_to_keep(infos, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    assert keep == {5, 6}


@pytest.mark.task("2.2")
@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_rank_below_every_finite_one(mode, bad):
    infos = [StepInfo(1, {"loss": 0.5}), StepInfo(2, {"loss": bad}), StepInfo(3, {"loss": 0.3}),
             StepInfo(4, {"loss": bad}), StepInfo(5, {"loss": 0.9}), StepInfo(6, {"loss": bad})]
    keep = steps_to_keep(infos, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode)
    assert keep == ({1, 3} if mode == "min" else {1, 5})  # the two best finite ones
    assert best_step(infos, lambda m: m["loss"], mode) == (3 if mode == "min" else 5)
    only_bad = [StepInfo(s, {"loss": bad}) for s in (1, 2, 3)]
    assert steps_to_keep(only_bad, max_to_keep=1, best_fn=lambda m: m["loss"],
                         best_mode=mode) == {3}  # among non-finite ones the newest
    assert best_step(only_bad, lambda m: m["loss"], mode) is None  # never "best"


def test_nan_retention_in_the_manager_is_bounded(tmp_path):
    opts = CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with CheckpointManager(tmp_path, opts) as m:
        for s in range(1, 7):
            m.save(s, {"x": {"x": np.zeros(2, np.float32)}}, metrics={"loss": math.nan})
        assert m.all_steps() == [5, 6]
