"""Real processes: SIGKILL at random moments, two writers on one directory, a reader while
a writer saves and deletes. Workers are forked from one zygote (tests/crash_worker.py) so
that each costs a fork, not an interpreter start with JAX."""

import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
from crash_harness import SCALE, Zygote, _lines, _wait_for, add_figures, check_items, kill_drill
from crash_worker import EXIT_REFUSED, writer_items

from minickpt import CheckpointManager, CheckpointManagerOptions, CheckpointNotFoundError

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def zygote():
    with Zygote() as z:
        yield z


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_never_loses_a_saved_checkpoint(zygote, tmp_path):
    kills = 20 * SCALE
    figs = kill_drill(zygote, str(tmp_path / "run"), kills=kills, seed=7)
    add_figures(**{"SIGKILLs": figs.kills, "SIGKILLs survived": figs.survived,
                   "SIGKILLs that interrupted a save or delete": figs.mid_save})
    assert not figs.failures, "\n".join(figs.failures)
    assert figs.survived == figs.kills == kills
    assert figs.steps_saved > kills  # the worker really saved between kills
    assert figs.mid_save >= kills // 4  # and many kills landed inside a save or a delete


def _check_run(root, writers=("A", "B")):
    """Every checkpoint is one writer's, whole: items agree on writer and step."""
    m = CheckpointManager(root, CheckpointManagerOptions(read_only=True))
    owners = {}
    for s in m.all_steps():
        assert m.verify(s).ok, m.verify(s).problems
        r = m.restore(s)
        tag = r["opt"]["tag"]
        who, step = tag.split("-")
        assert int(step) == s and who in writers, tag
        want = writer_items(s, who)
        assert np.array_equal(r["params"]["w"], want["params"]["w"]), \
            f"step {s}: params written by the other writer than opt ({tag})"
        assert r["opt"]["count"] == want["opt"]["count"]
        owners[s] = who
    return owners


@pytest.mark.timeout(120)
def test_two_writers_at_once_one_is_refused_with_a_clear_error(zygote, tmp_path):
    root, start = str(tmp_path / "run"), time.time() + 1.0
    logs = {w: str(tmp_path / f"{w}.log") for w in "AB"}
    pids = {w: zygote.fork("writer", root=root, log=logs[w], name=w,
                           steps=list(range(1, 6)),
                           start_at=start, wait_for_lock=False) for w in "AB"}
    codes = {w: zygote.wait(pid) for w, pid in pids.items()}
    assert sorted(codes.values()) == [0, EXIT_REFUSED], codes
    loser = next(w for w, c in codes.items() if c == EXIT_REFUSED)
    refusal = _lines(logs[loser])[-1]
    assert "another CheckpointManager is writing to" in refusal and "pid" in refusal, refusal
    owners = _check_run(root)
    assert sorted(owners) == [1, 2, 3, 4, 5] and set(owners.values()) == {"AB".replace(loser, "")}
    add_figures(**{"concurrent-writer runs without interleaving": 1})


@pytest.mark.timeout(120)
def test_two_writers_waiting_for_the_lock_serialise(zygote, tmp_path):
    root, start = str(tmp_path / "run"), time.time() + 1.0
    logs = {w: str(tmp_path / f"{w}.log") for w in "AB"}
    steps = {"A": list(range(10, 16)), "B": list(range(20, 26))}
    pids = {w: zygote.fork("writer", root=root, log=logs[w], name=w, steps=steps[w],
                           start_at=start, wait_for_lock=True) for w in "AB"}
    assert {w: zygote.wait(pid) for w, pid in pids.items()} == {"A": 0, "B": 0}
    owners = _check_run(root)
    assert owners == {s: w for w in "AB" for s in steps[w]}
    add_figures(**{"concurrent-writer runs without interleaving": 1})


@pytest.mark.timeout(120)
def test_without_the_lock_racing_writers_still_never_interleave(zygote, tmp_path):
    """lock=False, both saving the same steps at the same time: each step is one writer's,
    whole; the other gets StepAlreadyExistsError (rename never replaces)."""
    root, start = str(tmp_path / "run"), time.time() + 1.0
    os.makedirs(root)
    logs = {w: str(tmp_path / f"{w}.log") for w in "AB"}
    steps = list(range(1, 13))
    pids = {w: zygote.fork("writer", root=root, log=logs[w], name=w, steps=steps,
                           start_at=start, wait_for_lock=False, lock=False) for w in "AB"}
    codes = {w: zygote.wait(pid) for w, pid in pids.items()}
    assert codes == {"A": 0, "B": 0}, (codes, {w: _lines(p)[-3:] for w, p in logs.items()})
    owners = _check_run(root)
    assert sorted(owners) == steps
    for s in steps:  # exactly one writer saved each step; the other was told it exists
        said = {w: next(ln.split()[0] for ln in _lines(logs[w]) if ln.endswith(f" {s}"))
                for w in "AB"}
        assert sorted(said.values()) == ["exists", "saved"], (s, said)
        assert said[owners[s]] == "saved"
    add_figures(**{"concurrent-writer runs without interleaving": 1})


@pytest.mark.timeout(120)
def test_a_reader_never_sees_a_torn_checkpoint_while_a_writer_saves_and_deletes(
        zygote, tmp_path):
    root = str(tmp_path / "run")
    log = str(tmp_path / "churn.log")
    seconds = 3.0 * SCALE
    pid = zygote.fork("churn", root=root, log=log, seconds=seconds)
    assert _wait_for(log, "ready", 60)
    while not os.path.isdir(root):
        time.sleep(0.01)
    rng = random.Random(3)
    outcomes = {"restored": 0, "not found": 0, "verified": 0}
    reader = CheckpointManager(root, CheckpointManagerOptions(read_only=True))
    deadline = time.monotonic() + seconds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would mean "damaged": never
        while time.monotonic() < deadline:
            try:
                reader.reload()
                steps = reader.all_steps()
                if not steps:
                    continue
                s = rng.choice(steps)
                r = reader.restore(s) if rng.random() < 0.5 else reader.restore()
                check_items(r, r.step, 20000)  # whole, and exactly the step's values
                outcomes["restored"] += 1
                if reader.verify(s).ok:
                    outcomes["verified"] += 1
            except CheckpointNotFoundError:
                outcomes["not found"] += 1
    assert zygote.wait(pid) == 0, _lines(log)
    add_figures(**{"restores while a writer saved and deleted": outcomes["restored"],
                   "clean not-found while a writer deleted": outcomes["not found"]})
    assert outcomes["restored"] > 10, outcomes
    final = CheckpointManager(root, CheckpointManagerOptions(read_only=True))
    assert len(final.all_steps()) == 2


def test_a_killed_worker_leaves_no_lock_behind(zygote, tmp_path):
    """flock dies with its process: a SIGKILLed writer never blocks the next one."""
    root, log = str(tmp_path / "run"), str(tmp_path / "w.log")
    pid = zygote.fork("save_loop", root=root, log=log, size=100, max_to_keep=2, seconds=30.0)
    assert _wait_for(log, "saved", 60)
    os.kill(pid, signal.SIGKILL)
    assert zygote.wait(pid) == -signal.SIGKILL
    with CheckpointManager(root) as m:
        check_items(m.restore(), m.latest_step(), 100)
