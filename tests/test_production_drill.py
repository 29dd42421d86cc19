"""Recovery drills with real subprocesses killed by SIGKILL (few kills here; a longer drill
runs by hand: python -m minickpt.production.drill --kills 10 --steps 300)."""

import json
import sys
import textwrap

import pytest

from minickpt.production.drill import (
    DrillReport,
    KillRecord,
    demo_command,
    main,
    plan_kills,
    run_drill,
)


def _check_kills(report, every):
    for k in report.kills:
        # the restart resumes from the newest checkpoint the killed process had committed,
        # or from the one it was writing if the kill came after the commit
        assert k.resumed_from is not None and k.killed_after_step is not None
        if k.temporary_left:  # the write was cut: that save never became a checkpoint
            assert k.resumed_from == k.last_saved
        assert 0 <= k.steps_lost <= every
        assert k.steps_lost == k.killed_after_step - k.resumed_from
        assert 0 < k.restore_s < k.recover_s


@pytest.mark.task("6.4")
def test_drill_kills_during_steps_and_saves_and_ends_bit_identical(reference_fingerprint,
                                                                   compile_cache):
    every, steps = 5, 30
    report = run_drill(kills=3, steps=steps, every=every, seed=2, sleep=0.02,
                       slow_fsync=0.04, reference=reference_fingerprint(steps), timeout_s=240,
                       compile_cache=compile_cache)
    assert report.error is None and report.completed, report.table()
    assert len(report.kills) == 3
    assert {k.kind for k in report.kills} == {"step", "save"}
    assert report.kills_in_save >= 1
    assert any(k.temporary_left for k in report.kills)  # a save was cut in its write phase
    _check_kills(report, every)
    assert report.identical, report.table()
    # the worker's own monitor saw one restore per kill
    assert report.metrics["restores"]["count"] == 3
    assert "bit-identical to the uninterrupted run: YES" in report.table()


@pytest.mark.task("6.4")
def test_drill_catches_a_resume_that_forgets_the_rng(reference_fingerprint, compile_cache):
    """Restoring everything but the dropout key still resumes at the right step with the
    right data, and looks fine in the loss; only the bit-for-bit check notices."""
    steps = 20
    cmd = demo_command(steps=steps, every=5, sleep=0.01, slow_fsync=0.0, forget_rng=True)
    report = run_drill(kills=1, steps=steps, every=5, seed=0, command=cmd,
                       reference=reference_fingerprint(steps), timeout_s=180,
                       compile_cache=compile_cache)
    assert report.completed and len(report.kills) == 1, report.table()
    assert not report.identical
    assert "bit-identical to the uninterrupted run: NO" in report.table()


def test_plan_is_seeded_spread_over_the_run_and_covers_steps_and_saves():
    a = plan_kills(6, steps=300, seed=7, step_time_s=0.1, save_time_s=0.2)
    assert a == plan_kills(6, steps=300, seed=7, step_time_s=0.1, save_time_s=0.2)
    assert a != plan_kills(6, steps=300, seed=8, step_time_s=0.1, save_time_s=0.2)
    for seed in range(50):
        p = plan_kills(2, steps=30, seed=seed)
        assert {k.kind for k in p} == {"step", "save"}
    ats = [k.at for k in a]
    assert ats == sorted(ats) and 1 <= ats[0] and ats[-1] <= 299
    assert [i * 299 // 6 < at <= (i + 1) * 299 // 6 + 1 for i, at in enumerate(ats)] == [True] * 6
    for k in a:
        assert (0 <= k.delay < 0.1) if k.kind == "step" else (0.04 <= k.delay <= 0.16)
    assert {k.kind for k in plan_kills(4, steps=30, seed=1, save_fraction=0.0)} == {"step"}
    assert all(1 <= k.at <= 2 for k in plan_kills(5, steps=3, seed=0))  # a short run


# a small numpy "training script" that speaks the drill protocol: fast, no JAX compilation
_WORKER = textwrap.dedent('''
    import sys, time, hashlib
    import numpy as np
    from minickpt import CheckpointManager, CheckpointManagerOptions

    d, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    w, start = np.zeros(8), 0
    with CheckpointManager(d, CheckpointManagerOptions(save_interval_steps=every,
                                                       max_to_keep=2)) as m:
        if m.latest_step() is not None:
            r = m.restore()
            w, start = r["w"], r.step
            print(f"resumed from step {start}", flush=True)
        for step in range(start + 1, total + 1):
            if step == crash_at:
                raise SystemExit("worker: simulated bug at step %d" % step)
            x = np.random.default_rng(step).normal(size=8)  # data: a function of the step
            w = w - 0.1 * (w - x)
            time.sleep(0.01)
            print(f"step {step}", flush=True)
            if m.should_save(step):
                print(f"saving step {step}", flush=True)
                m.save(step, {"w": w})
                print(f"saved step {step}", flush=True)
    print("final " + hashlib.sha256(w.tobytes()).hexdigest()[:16], flush=True)
''')


@pytest.fixture
def numpy_worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(_WORKER)
    return str(path)


def test_drill_cli_with_another_training_script(numpy_worker, tmp_path, capsys):
    out = tmp_path / "drill.json"
    rc = main(["--kills", "2", "--steps", "40", "--every", "5", "--seed", "3", "--timeout",
               "120", "--json", str(out), "--", sys.executable, numpy_worker, "{dir}", "40",
               "5"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rep = json.loads(out.read_text())
    assert rep["completed"] and rep["identical"] and rep["summary"]["kills"] == 2
    assert rep["reference_fingerprint"] == rep["final_fingerprint"]
    assert rep["reference_wall_s"] > 0  # the harness ran the uninterrupted reference itself
    assert "bit-identical to the uninterrupted run: YES" in printed
    report = DrillReport(**{k: v for k, v in rep.items() if k != "summary"})
    report.kills = [KillRecord(**k) for k in rep["kills"]]
    _check_kills(report, 5)


def test_drill_reports_a_worker_that_fails(numpy_worker):
    cmd = [sys.executable, numpy_worker, "{dir}", "30", "5", "12"]  # dies at step 12
    report = run_drill(kills=1, steps=30, every=5, command=cmd, timeout_s=60)
    assert not report.completed and not report.identical
    assert "uninterrupted run failed" in report.error
    assert "simulated bug at step 12" in report.error


def test_drill_is_bounded_in_time(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\nprint('step 1', flush=True)\ntime.sleep(600)\n")
    report = run_drill(kills=1, steps=10, every=5, reference="x", timeout_s=3,
                       command=[sys.executable, str(hang), "{dir}"])
    assert not report.completed and "deadline" in report.error


def test_drill_needs_the_directory_in_the_command():
    with pytest.raises(ValueError, match="must contain"):
        run_drill(command=[sys.executable, "train.py"])


def test_a_kill_inside_retention_after_the_commit_is_not_a_cut_write(tmp_path):
    """A kill after save(20)'s commit, while its retention removes step 10, leaves step 10's
    delete leftover beside the committed step 20: no write was cut (the restart resumes from
    20). Before, the leftover counted as the write's temporary: under load the drill reported
    temporary_left with last_saved 15 and resumed_from 20 (test above, a CI run)."""
    from minickpt.commit import DELETE_MARK, TMP_MARK
    from minickpt.production import drill

    for name in ("step_15", "step_20", f"step_10{DELETE_MARK}0badc0de"):
        (tmp_path / name).mkdir()
    assert drill._temporaries(str(tmp_path)) == []
    (tmp_path / f"step_25{TMP_MARK}0badc0de").mkdir()  # a write cut in its write phase
    assert drill._temporaries(str(tmp_path)) == [f"step_25{TMP_MARK}0badc0de"]
