"""A drill's "in save" column for a worker that prints ``saving step N`` but never ``saved
step N`` (chapter 6's training script): a kill several steps after a save is not a kill
during it (issue 30: the drill called a kill after step 14, saves every 10, "in save")."""

import sys
import textwrap

import pytest

from minickpt.production.drill import plan_kills, run_drill, save_progress

# A worker without JAX (fast): a checkpoint is one JSON file, committed by a rename; the save
# takes 0.5 s so that a kill aimed at it lands inside it.
WORKER = textwrap.dedent('''
    import hashlib, json, os, sys, time
    directory, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "ckpt.json")
    start, w = 0, 0.0
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        start, w = saved["step"], saved["w"]
        print(f"resumed from step {start}", flush=True)
    for step in range(start + 1, total + 1):
        w = w * 0.9 + step
        time.sleep(0.05)
        print(f"step {step}", flush=True)
        if step % every == 0:
            print(f"saving step {step}", flush=True)        # and never "saved step N"
            time.sleep(0.5)
            with open(path + ".tmp", "w") as f:
                json.dump({"step": step, "w": w}, f)
            os.replace(path + ".tmp", path)
    print("final " + hashlib.sha256(repr(w).encode()).hexdigest()[:16], flush=True)
''')

STEPS, EVERY, SEED = 40, 10, 5


def test_the_seed_plans_a_save_kill_then_a_step_kill_past_a_save():
    save, step = plan_kills(2, steps=STEPS, seed=SEED)
    assert save.kind == "save" and save.at <= EVERY       # aims at the save of step 10
    assert step.kind == "step" and 2 * EVERY < step.at and step.at % EVERY not in (0, 9)


def test_a_later_step_ends_a_save_that_is_never_announced():
    ev = [(0, "step", 10), (0, "saving step", 10), (0, "step", 11), (0, "step", 14)]
    assert save_progress(ev, announces_saves=False) == (False, 10)
    assert save_progress(ev[:2], announces_saves=False) == (True, None)
    # a worker that announces its saves is trusted: no "saved step 10" yet, still in it
    assert save_progress(ev, announces_saves=True) == (True, None)
    assert save_progress([*ev, (0, "saved step", 10)], announces_saves=True) == (False, 10)
    assert save_progress([(0, "resumed from step", 20), (0, "step", 21)],
                         announces_saves=False) == (False, 20)


@pytest.mark.timeout(120)
def test_a_kill_between_saves_is_not_counted_as_in_save(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    report = run_drill(kills=2, steps=STEPS, every=EVERY, seed=SEED, sleep=0.02,
                       command=[sys.executable, str(script), "{dir}", str(STEPS), str(EVERY)],
                       timeout_s=100)
    assert report.completed and report.error is None, report.table()
    in_save, between = report.kills
    assert in_save.kind == "save" and in_save.in_save, report.table()
    assert in_save.killed_after_step == EVERY and in_save.resumed_from == 0, report.table()
    assert between.kind == "step", report.table()
    assert between.killed_after_step % EVERY != 0, report.table()
    assert not between.in_save, f"a kill after step {between.killed_after_step} " \
        f"(saves every {EVERY}) counted as during a save:\n{report.table()}"
    assert between.last_saved == between.resumed_from == 2 * EVERY, report.table()
    assert report.kills_in_save == 1 and "(1 during a save)" in report.table()
    assert report.identical, report.table()
