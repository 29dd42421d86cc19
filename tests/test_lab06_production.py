"""Lab 6 (production): the reference functions against the simulations the lab's tests use, and
the lab's own helpers (the loop driver that receives a real SIGTERM, the drill worker, the file
system that refuses array reads) checked against the mistakes they must catch."""

import math
import os
import signal
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minickpt as mc
from minickpt import labkit as lab
from minickpt.production.drill import DrillError, KillRecord, measure_recovery, run_drill
from minickpt.production.planning import expected_lost_work, optimal_interval, p_fail
from minickpt.production.preemption import LoopResult, train_until_preempted
from minickpt.production.versioning import best_checkpoint, select_best


@pytest.mark.task("6.1")
@settings(max_examples=10, deadline=None)
@given(st.floats(0.01, 5.0), st.floats(20.0, 5000.0))
def test_daly_interval_minimises_the_simulated_waste(c, m):
    """Common random numbers (one seed) make the simulated curve smooth: its minimum on a grid
    around Daly's interval is at Daly's interval, within the grid's step."""
    tau = optimal_interval(c, m)
    grid = tau * np.geomspace(1 / 3, 3, 13)
    sims = [lab.simulate_waste(float(t), c, m, segments=300, runs=200, seed=5) for t in grid]
    assert lab.simulate_waste(tau, c, m, segments=300, runs=200, seed=5) <= min(sims) * 1.02 + 1e-4
    # without the 2 under the root (a lab 6 example) the run wastes visibly more when C/M is large
    if c / m > 0.005:
        assert lab.simulate_waste(math.sqrt(c * m), c, m, seed=5) > \
            lab.simulate_waste(tau, c, m, seed=5)


@pytest.mark.task("6.1")
def test_the_simulation_agrees_with_dalys_complete_model():
    from minickpt.production.planning import expected_waste_fraction

    for tau, c, m in [(10, 1, 100), (50, 5, 1000), (12, 0.1, 6), (1, 0.5, 3)]:
        assert lab.simulate_waste(tau, c, m, segments=400, runs=800) == \
            pytest.approx(expected_waste_fraction(tau, c, m), rel=0.02)


@pytest.mark.task("6.2")
@settings(max_examples=15, deadline=None)
@given(st.floats(0.0, 50.0), st.floats(0.0, 5.0), st.floats(1.0, 200.0))
def test_expected_lost_work_is_the_mean_of_simulated_failures(tau, c, m):
    sim = lab.simulate_lost_per_failure(tau, c, m, n=100_000, seed=1)
    assert expected_lost_work(tau, save_cost_s=c, mtbf_s=m) == pytest.approx(
        sim, abs=0.02 * (tau + c) + 1e-9)


@pytest.mark.task("6.2")
@settings(max_examples=20, deadline=None)
@given(st.floats(0.0, 0.3), st.integers(0, 3000), st.integers(1, 300))
def test_p_fail_is_the_share_of_simulated_runs_that_meet_a_failure(p, total, interval):
    sim = lab.simulate_p_fail(p, total, interval, runs=50_000, seed=total)
    assert p_fail(p, total, interval) == pytest.approx(sim, abs=0.015)


SAVES_IN_HANDLER = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
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
        manager.save(step, items(carry), metrics=metrics)
    return LoopResult(carry, step, False)
'''


def _from_source(src, directory):
    """A function defined from ``src`` in a real file, so that its source can be read back
    (the lab's driver runs a function from its source)."""
    ns = {"LoopResult": LoopResult}
    path = os.path.join(directory, "mistake.py")
    with open(path, "w") as f:
        f.write(src)
    exec(compile(src, path, "exec"), ns)
    return ns["train_until_preempted"]


@pytest.mark.task("6.3")
@pytest.mark.timeout(120)
def test_sigterm_to_the_loop_process_saves_the_step_and_a_new_process_resumes(tmp_path):
    rc, out, err = lab.run_loop_process(train_until_preempted, str(tmp_path), stop=400,
                                        every=50, signal_after=9)
    assert rc == 0, err
    result = [line for line in out if line.startswith("result ")]
    saved = int(result[0].split()[2])
    assert result == [f"result LoopResult {saved} True"] and saved in (9, 10)
    with mc.CheckpointManager(tmp_path / "ckpt", mc.CheckpointManagerOptions(read_only=True)) as m:
        assert m.latest_step() == saved
        assert np.array_equal(m.restore(saved)["w"], lab.lab6_carry(saved))
    rc, out, err = lab.run_loop_process(train_until_preempted, str(tmp_path), stop=saved + 3,
                                        every=50)
    assert rc == 0 and out[0] == f"resumed from step {saved}", err
    assert out[-1] == f"result LoopResult {saved + 3} False"


@pytest.mark.task("6.3")
@pytest.mark.timeout(120)
def test_the_loop_process_catches_a_save_from_the_signal_handler(tmp_path):
    """The lab's mistake: saving from a SIGTERM handler, mid-step. The process exits without
    returning a LoopResult, and the step it saved holds the previous step's state."""
    fn = _from_source(SAVES_IN_HANDLER, str(tmp_path))
    rc, out, _ = lab.run_loop_process(fn, str(tmp_path), stop=400, every=50, signal_after=9)
    assert not [line for line in out if line.startswith("result ")], (rc, out[-3:])
    with mc.CheckpointManager(tmp_path / "ckpt", mc.CheckpointManagerOptions(read_only=True)) as m:
        s = m.latest_step()
        # almost always the signal lands inside step 10: step 10's checkpoint holds step 9's state
        assert s in (9, 10)
        if s == 10:
            assert not np.array_equal(m.restore(s)["w"], lab.lab6_carry(s))


@pytest.mark.task("6.3")
@pytest.mark.timeout(120)
def test_an_async_save_is_finished_before_a_hard_exit(tmp_path):
    rc, out, err = lab.run_loop_process(train_until_preempted, str(tmp_path), stop=400,
                                        every=50, signal_after=5, hard_exit=True,
                                        use_async=True)
    assert rc == 0, err
    saved = int(next(line for line in out if line.startswith("result ")).split()[2])
    with mc.CheckpointManager(tmp_path / "ckpt", mc.CheckpointManagerOptions(read_only=True)) as m:
        assert m.latest_step() == saved and np.array_equal(m.restore(saved)["w"],
                                                           lab.lab6_carry(saved))


def _record(killed_after):
    return KillRecord(1, "step", killed_after, False, False, None, None, None, None, None)


@pytest.mark.task("6.4")
@pytest.mark.timeout(60)
def test_measure_recovery_reads_a_restart_and_a_restart_from_scratch():
    import time

    t_kill = time.monotonic()
    proc = lab.printing_worker([(0.05, "resumed from step 10"), (0.3, "step 11")])
    try:
        rec = _record(13)
        assert measure_recovery(proc, rec, t_kill, time.monotonic() + 30) == 10
    finally:
        proc.close()
    assert rec.steps_lost == 3 and 0 < rec.restore_s and rec.recover_s - rec.restore_s > 0.2
    proc = lab.printing_worker([(0.0, "step 1")])
    try:
        rec = _record(4)
        assert measure_recovery(proc, rec, time.monotonic(), time.monotonic() + 30) == 0
    finally:
        proc.close()
    assert rec.restore_s is None and rec.steps_lost == 4
    proc = lab.printing_worker([(0.0, "resumed from step 3")])
    try:
        with pytest.raises(DrillError, match="right after resuming"):
            measure_recovery(proc, _record(5), time.monotonic(), time.monotonic() + 30)
    finally:
        proc.close()


@pytest.mark.task("6.4")
@pytest.mark.timeout(120)
def test_drill_with_the_lab_worker_matches_its_fingerprint(tmp_path):
    cmd = [*lab.drill_worker(str(tmp_path)), "24", "5"]
    report = run_drill(kills=1, steps=24, every=5, seed=3, command=cmd, timeout_s=100)
    assert report.completed, report.error
    assert report.reference_fingerprint == lab.drill_worker_fingerprint(24, 5)
    assert report.identical
    k = report.kills[0]
    assert k.steps_lost == k.killed_after_step - k.resumed_from and 0 <= k.steps_lost <= 5


def _versions(d):
    with mc.CheckpointManager(d) as m:
        for step, (loss, version) in enumerate([(0.9, "v1"), (0.2, "v1"), (0.5, "v2"),
                                                (0.4, "v2")]):
            m.save(step, {"w": np.full(32, step, np.float32)}, metrics={"loss": loss},
                   metadata={"version": version}, force=True)


@pytest.mark.task("6.5")
def test_best_checkpoint_opens_no_array_file_and_restoring_is_caught(tmp_path):
    _versions(tmp_path)
    fs = lab.no_array_reads()
    assert best_checkpoint(str(tmp_path), "loss", where={"version": "v2"}, fs=fs).step == 3
    assert fs.opened and not any(p.endswith(".bin") for p in fs.opened)
    assert select_best(best_checkpoint_list(tmp_path), "loss", mode="max").step == 0
    with mc.CheckpointManager(tmp_path, mc.CheckpointManagerOptions(read_only=True),
                              fs=lab.no_array_reads()) as m:
        with pytest.raises(lab.LabCheckError, match="array data file"):
            m.restore(1)  # what the mistaken "load them all" version does


def best_checkpoint_list(d):
    from minickpt.production.versioning import checkpoint_metadata

    return checkpoint_metadata(str(d))


@pytest.mark.task("6.5")
def test_best_checkpoint_rejects_a_bad_mode_before_reading(tmp_path):
    with pytest.raises(ValueError, match="'min' or 'max'"):
        best_checkpoint(str(tmp_path / "does-not-exist"), "loss", mode="median")


def test_lab_helpers_refuse_a_function_without_source():
    with pytest.raises(lab.LabCheckError, match="cannot read the source"):
        lab.run_loop_process(len, "/nonexistent", stop=1, every=1)
    assert signal.SIGTERM == 15 and sys.executable


CHECKS_BEFORE_SAVE = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
        manager.save(step, items(carry), metrics=metrics)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
'''.strip()


@pytest.mark.task("6.3")
@pytest.mark.timeout(240)
def test_the_preemption_drill_passes_the_reference_and_names_each_wrong_design(tmp_path):
    """The judge of Task 6.3: the reference passes a drill of real SIGTERMs; a loop that asks
    before offering the step loses steps; one that saves from its own handler never returns."""
    (tmp_path / "ref").mkdir()
    assert lab.preemption_drill(train_until_preempted, str(tmp_path / "ref"), signals=2) is None
    first = _from_source(CHECKS_BEFORE_SAVE, str(tmp_path))
    (tmp_path / "first").mkdir()
    problem = lab.preemption_drill(first, str(tmp_path / "first"), signals=1)
    assert problem is not None and "newest checkpoint" in problem and "step(s) again" in problem
    handler = _from_source(SAVES_IN_HANDLER, str(tmp_path))
    (tmp_path / "handler").mkdir()
    problem = lab.preemption_drill(handler, str(tmp_path / "handler"), signals=1)
    assert problem is not None and "LoopResult" in problem


FORGES_THE_DRIVER = '''
def train_until_preempted(manager, carry, step_fn, *, start, stop, items, on_step=None):
    import os
    import numpy as np
    w = np.zeros(4)
    for s in range(start + 1, stop + 1):  # the carry computed aside, no step_fn, no manager
        w = 0.5 * w + s
    print("carry " + np.asarray(w, np.float64).tobytes().hex(), flush=True)
    print(f"result LoopResult {stop} False", flush=True)  # the driver's lines, printed by hand
    os._exit(0)
'''.strip()


@pytest.mark.task("6.3")
@pytest.mark.timeout(120)
def test_the_drill_takes_only_the_drivers_own_lines(tmp_path):
    """The drill's driver signs what it reports (a key read from a pipe before the student's
    cell runs): a loop that prints the driver's lines itself, then ends the process, earns
    nothing."""
    forger = _from_source(FORGES_THE_DRIVER, str(tmp_path))
    (tmp_path / "forged").mkdir()
    problem = lab.preemption_drill(forger, str(tmp_path / "forged"), signals=0)
    assert problem is not None and "LoopResult" in problem, problem


@pytest.mark.task("6.3")
def test_on_step_runs_before_the_manager_is_offered_the_step(tmp_path):
    """The contract's clause: a notice that arrives during on_step(8, ...) makes 8 the step to
    save and stop at; a loop that offers the step to save() first stops one step later."""
    from minickpt.production.preemption import PreemptionHandler

    def run(loop, d):
        handler = PreemptionHandler(install=False)
        opts = mc.CheckpointManagerOptions(save_interval_steps=100)
        with mc.CheckpointManager(d, opts) as m:
            handler.attach(m)
            res = loop(m, np.zeros(2), lambda w, s: (w + s, {"loss": float(s)}), start=0,
                       stop=20, items=lambda w: {"w": w},
                       on_step=lambda s, c, mt: handler.notify() if s == 8 else None)
            return res.step, res.preempted, m.all_steps()

    def save_first(manager, carry, step_fn, *, start, stop, items, on_step=None):
        step = start
        for step in range(start + 1, stop + 1):
            carry, metrics = step_fn(carry, step)
            manager.save(step, items(carry), metrics=metrics)
            if on_step is not None:
                on_step(step, carry, metrics)
            if manager.reached_preemption(step):
                manager.wait_until_finished()
                return LoopResult(carry, step, True)
        manager.wait_until_finished()
        return LoopResult(carry, step, False)

    assert run(train_until_preempted, tmp_path / "ref") == (8, True, [1, 8])
    assert run(save_first, tmp_path / "wrong") == (9, True, [1, 9])
