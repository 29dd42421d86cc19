"""Real processes: SIGKILL at random moments, two writers on one directory, a reader while
a writer saves and deletes. Workers are forked from one zygote (tests/crash_worker.py) so
that each costs a fork, not an interpreter start with JAX."""

import os
import signal

import pytest
from crash_harness import (
    SCALE,
    Zygote,
    _wait_for,
    add_figures,
    check_items,
    kill_drill,
    reader_under_churn,
    two_writers,
)

from minickpt import CheckpointManager, CheckpointManagerOptions

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
    assert figs.steps_saved >= kills // 4  # the worker really saved between kills
    assert figs.mid_save >= 1  # and kills landed inside a save or a delete (most do)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["refuse", "serialise", "nolock"])
def test_two_writers_on_one_directory_never_interleave(zygote, tmp_path, mode):
    """refuse: the second gets a clear error; serialise: waiting for the lock, both save;
    nolock (lock=False) racing on the same steps: each step is one writer's, whole."""
    wrong = two_writers(zygote, str(tmp_path), mode)
    add_figures(**{"two-writer runs without interleaving": not wrong})
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(120)
def test_a_reader_never_sees_a_torn_checkpoint_while_a_writer_saves_and_deletes(
        zygote, tmp_path):
    outcomes, wrong = reader_under_churn(zygote, str(tmp_path), 3.0 * SCALE)
    add_figures(**{"restores while a writer saved and deleted": outcomes["restored"],
                   "clean not-found while a writer deleted": outcomes["not found"]})
    assert not wrong, "\n".join(wrong)
    final = CheckpointManager(tmp_path / "run", CheckpointManagerOptions(read_only=True))
    assert len(final.all_steps()) == 2


def test_a_killed_worker_leaves_no_lock_behind(zygote, tmp_path):
    """flock dies with its process: a SIGKILLed writer never blocks the next one."""
    root, log = str(tmp_path / "run"), str(tmp_path / "w.log")
    pid = zygote.fork("save_loop", root=root, log=log, size=100, max_to_keep=2, seconds=30.0)
    assert _wait_for(log, "saved", 60, pid)
    os.kill(pid, signal.SIGKILL)
    assert zygote.wait(pid) == -signal.SIGKILL
    with CheckpointManager(root) as m:
        check_items(m.restore(), m.latest_step(), 100)


def test_without_the_lock_temporaries_are_left_alone(tmp_path):
    """With lock=False another writer may be saving right now, and its temporary looks just
    like a crashed one: a manager that cannot exclude writers must not clean it up."""
    (tmp_path / "step_5.minickpt-tmp-inflight").mkdir()
    with CheckpointManager(tmp_path, CheckpointManagerOptions(lock=False)) as m:
        assert m.removed_temporaries == []
    assert (tmp_path / "step_5.minickpt-tmp-inflight").is_dir()
    with CheckpointManager(tmp_path) as m:  # with the lock it is ours to clean
        assert m.removed_temporaries == ["step_5.minickpt-tmp-inflight"]
