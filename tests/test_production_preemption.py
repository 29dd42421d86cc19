"""Preemption: SIGTERM/SIGINT -> save at the next step boundary, stop cleanly, resume there."""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.production.drill import WorkerProcess, compile_cache_env
from minickpt.production.preemption import PreemptionHandler, train_until_preempted


def _sgd(carry, step):
    """A deterministic 'training step': the data is a function of the step."""
    x = np.random.default_rng(step).normal(size=4)
    return carry - 0.1 * (carry - x), {"loss": float(np.sum((carry - x) ** 2))}


@pytest.fixture
def restore_signals():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield before
    for s, h in before.items():
        signal.signal(s, h)


@pytest.mark.task("6.3")
def test_sigterm_mid_step_saves_that_step_and_stops(tmp_path, restore_signals):
    opts = CheckpointManagerOptions(save_interval_steps=5)
    with CheckpointManager(tmp_path, opts) as m:
        h = PreemptionHandler().attach(m)

        def step_fn(carry, step):
            if step == 7:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 7 computes
            return _sgd(carry, step)

        res = train_until_preempted(m, np.zeros(4), step_fn, start=0, stop=20,
                                    items=lambda c: {"w": c})
        assert (res.step, res.preempted) == (7, True)
        assert m.all_steps() == [1, 5, 7]  # first step, the interval, the preemption
        assert h.received == signal.SIGTERM and h.safe_step == 7
    # closing the manager put the previous handlers back
    assert signal.getsignal(signal.SIGTERM) is restore_signals[signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is restore_signals[signal.SIGINT]
    # the resumed loop continues from step 7 and ends where an uninterrupted one ends
    with CheckpointManager(tmp_path, opts) as m:
        r = m.restore()
        assert r.step == 7
        res2 = train_until_preempted(m, r["w"], _sgd, start=7, stop=20,
                                     items=lambda c: {"w": c})
    ref = np.zeros(4)
    for s in range(1, 21):
        ref, _ = _sgd(ref, s)
    assert not res2.preempted and res2.carry.tobytes() == ref.tobytes()


@pytest.mark.task("6.3")
def test_a_signal_after_the_save_decision_saves_at_the_next_step(restore_signals):
    """The loop asked about step 5 before the signal: its save was already decided, so the
    safe step is 6, and should_save / reached_preemption agree on it."""
    with PreemptionHandler() as h:
        assert not h.reached(4) and not h.reached(5)
        os.kill(os.getpid(), signal.SIGTERM)
        assert h.preempted
        assert not h.reached(5)  # same step again: too late for it
        assert h.reached(6) and h.reached(6) and h.reached(7)
        assert h.safe_step == 6


def test_manager_should_save_follows_the_handler(tmp_path, restore_signals):
    with CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=100)) as m:
        assert not m.reached_preemption(3)  # no handler: never
        m.save(0, {"w": np.zeros(2)})
        h = PreemptionHandler().attach(m)
        assert not m.should_save(3)
        h.notify()  # a notice that did not come as a signal (a metadata watcher, say)
        assert not m.should_save(3)  # step 3 was decided before the notice
        assert m.should_save(4) and m.reached_preemption(4)
        assert m.save(4, {"w": np.ones(2)})
        assert m.all_steps() == [0, 4]


def test_second_ctrl_c_falls_through_to_keyboard_interrupt(restore_signals):
    # Python's own Ctrl-C handler first: a run started in the background (nohup, `cmd &`)
    # inherits SIGINT ignored, and the handler rightly falls through to *that* instead
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with PreemptionHandler(signals=(signal.SIGINT,)) as h:
        os.kill(os.getpid(), signal.SIGINT)
        assert h.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the signal is delivered at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_handler_needs_the_main_thread(restore_signals):
    errors = []

    def make():
        try:
            PreemptionHandler()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=make)
    t.start()
    t.join(10)
    assert errors and "main thread" in errors[0]
    h = PreemptionHandler(install=False)  # fine anywhere; driven by notify()
    h.notify()
    assert h.reached(1)


@pytest.mark.task("6.3")
def test_sigterm_to_a_real_training_process(tmp_path, reference_fingerprint, compile_cache):
    """A Flax training subprocess gets SIGTERM mid-step, saves at the next step boundary and
    exits 0; restarted, it resumes at exactly that step; a second SIGTERM lands while a save
    is being written: that save completes, the next step is saved, and the third run ends
    bit-identical to an uninterrupted one."""
    total, every = 30, 10
    cmd = [sys.executable, "-m", "minickpt.demo", "--worker", "--dir", str(tmp_path),
           "--steps", str(total), "--every", str(every), "--sleep", "0.03", "--preemptible",
           "--slow-fsync", "0.05"]

    def run(trigger, at):
        deadline = time.monotonic() + 120
        p = WorkerProcess(cmd, env=compile_cache_env(compile_cache))
        try:
            if trigger:
                assert p.wait_for(trigger, deadline, at_least=at) is not None, p.stderr_tail()
                p.proc.send_signal(signal.SIGTERM)
            assert p.finish(deadline) == 0, p.stderr_tail()
        finally:
            p.close()
        return p

    def check_stopped_cleanly(p):
        stopped = p.last("preempted at step")
        assert stopped is not None and p.last("final") is None
        assert p.last("saved step") == stopped
        with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True)) as m:
            assert m.latest_step() == stopped
        assert not any(".minickpt-tmp-" in n for n in os.listdir(tmp_path))
        return stopped

    first = run("step", 5)  # mid-step: between two saves
    s1 = check_stopped_cleanly(first)
    assert 5 <= s1 <= 8 and s1 % every != 0
    second = run("saving step", 20)  # while the save of step 20 is being written
    assert second.last("resumed from step") == s1
    assert next(v for _, k, v in second.events if k == "step") == s1 + 1
    s2 = check_stopped_cleanly(second)
    assert s2 == 21 and second.last("step") == 21  # the save of 20 finished, then 21
    third = run(None, None)
    assert third.last("resumed from step") == 21
    assert third.last("final") == reference_fingerprint(total)


# ---------------------------------------------------------------------------------------
# several processes: one collective decision
# ---------------------------------------------------------------------------------------
def test_processes_signalled_at_different_steps_agree_on_one_safe_step():
    """Threads playing 3 processes; process 1 is notified at step 4, process 2 at step 8:
    every process decides at check step 6 (k = 3), and only there is anything exchanged."""
    from minickpt.multihost.sync import LocalGroup

    exchanged: list[str] = []

    def work(sync):
        real = sync.exchange

        def spy(key, value, timeout_s, what=""):
            exchanged.append(key)
            return real(key, value, timeout_s, what)

        sync.exchange = spy
        h = PreemptionHandler(install=False, sync=sync, sync_every_steps=3, timeout_s=20)
        out = []
        for step in range(1, 20):
            if (sync.process_index, step) in ((1, 4), (2, 8)):
                h.notify()
            if h.reached(step) and h.reached(step):  # asked twice, as the manager does
                out.append(step)
                break
        return out, h.safe_step, h.preempted

    res = LocalGroup(3).run(work, timeout_s=60)
    assert res == [([6], 6, True)] * 3, res
    assert sorted(set(exchanged)) == ["preemption/3", "preemption/6"]
    assert len(exchanged) == 6  # once per process and check step: the repeat is cached


def test_a_process_that_never_reaches_the_check_step_is_named(tmp_path):
    from minickpt.errors import PeerTimeoutError
    from minickpt.multihost.sync import LocalGroup

    def work(sync):
        h = PreemptionHandler(install=False, sync=sync, sync_every_steps=2, timeout_s=1)
        if sync.process_index == 1:
            return None  # stopped asking: a bug in the loop, or dead
        t = time.monotonic()
        with pytest.raises(PeerTimeoutError) as e:
            h.reached(2)
        return e.value.missing, time.monotonic() - t

    res = LocalGroup(2).run(work, timeout_s=30)
    assert res[0][0] == [1] and res[0][1] < 10


def test_attach_takes_the_managers_sync_under_several_processes(tmp_path):
    from minickpt import MultiHostOptions
    from minickpt.multihost.sync import LocalGroup

    def work(sync):
        opts = CheckpointManagerOptions(multihost=MultiHostOptions(timeout_s=7))
        with CheckpointManager(tmp_path, opts, sync=sync) as m:
            h = PreemptionHandler(install=False).attach(m)
            return h.sync is sync, h.timeout_s

    assert LocalGroup(2).run(work, timeout_s=60) == [(True, 7)] * 2
    with CheckpointManager(tmp_path / "one") as m:  # one process: no collective decision
        assert PreemptionHandler(install=False).attach(m).sync is None


@pytest.mark.multiprocess
@pytest.mark.task("6.3")
def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path):
    """Launched processes; only process 1 gets SIGTERM (at step 4). Both save step 6 (the
    next check step), exit 0, and the restarted job resumes there and ends as an
    uninterrupted one."""

    from minickpt.launch import launch

    here = os.path.dirname(os.path.abspath(__file__))

    def run(scenario):
        r = launch([os.path.join(here, "mh_worker.py"), scenario, str(tmp_path)], 2,
                   timeout_s=120, cwd=here)
        results = {p: found[-1] for p, found in enumerate(r.reports()) if found}
        assert r.ok and sorted(results) == [0, 1], r.output()
        return results

    first = run("preempt")
    for res in first.values():
        assert (res["step"], res["preempted"], res["safe_step"]) == (6, True, 6), res
        assert res["steps"] == [1, 6] and res["signalled"]  # p0 acted on p1's notice
    with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True)) as m:
        assert m.all_steps() == [1, 6] and m.verify(6).ok
    assert not any(".minickpt-tmp-" in n for n in os.listdir(tmp_path))
    second = run("preempt_resume")
    for res in second.values():
        assert res["resumed_at"] == 6 and res["step"] == 10 and not res["preempted"]
        assert res["same"]
