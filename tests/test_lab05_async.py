"""Lab 5's reference functions as a library (snapshot_leaf, the writer's three steps, overlap)
and the lab's test helpers: each catches the mistake it is there to catch."""

from __future__ import annotations

import errno
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minickpt.asynchronous as masync
import minickpt.tree as mtree
from minickpt import labkit as lab
from minickpt.asynchronous import (
    AsyncWriter,
    collect_error,
    overlap,
    run_in_background,
    save_intervals,
    start_in_background,
)
from minickpt.checkpointer import SaveStats
from minickpt.errors import MiniCkptError, UnsupportedLeafError
from minickpt.tree import HostKey, snapshot_leaf, to_host


# ---- 5.1 ------------------------------------------------------------------------------
@pytest.mark.task("5.1")
@pytest.mark.parametrize("pin", [False, True])
def test_snapshot_leaf_survives_mutation_deletion_and_donation(pin):
    n = np.arange(6.0)
    snap_n = snapshot_leaf(n, pin=pin)
    n += 1
    assert snap_n.tolist() == list(range(6))
    x = jnp.arange(4096, dtype=jnp.float32) + 0
    snap_x = snapshot_leaf(x, pin=pin)
    jax.block_until_ready(jax.jit(lambda a: a * 0 - 7, donate_argnums=0)(x))
    np.testing.assert_array_equal(snap_x, np.arange(4096, dtype=np.float32))
    y = jnp.ones(16) + 0
    snap_y = snapshot_leaf(y, pin=pin)
    y.delete()
    np.testing.assert_array_equal(snap_y, np.ones(16, np.float32))
    assert isinstance(snapshot_leaf(jax.random.key(1), pin=pin), HostKey)
    for v in (1, 2.5, "s", None):
        assert snapshot_leaf(v, pin=pin) is v
    with pytest.raises(UnsupportedLeafError, match="a/b"):
        snapshot_leaf(np.array([object()]), path="a/b", pin=pin)


@pytest.mark.task("5.1")
def test_snapshot_leaf_pins_only_where_jax_pins_and_copies_otherwise():
    x = jnp.arange(1024.0) + 0
    assert not lab.shares_memory(snapshot_leaf(x), np.asarray(x))
    pinned = snapshot_leaf(x, pin=True)
    assert lab.shares_memory(pinned, np.asarray(x)) == mtree.pinning_works()
    n = np.arange(3)
    assert not lab.shares_memory(snapshot_leaf(n, pin=True), n)  # numpy: always a copy
    b = jnp.ones(4, jnp.bfloat16) + 0  # numpy cannot reason about bfloat16's memory itself
    assert snapshot_leaf(b).dtype == b.dtype
    assert not lab.shares_memory(snapshot_leaf(b), np.asarray(b))
    assert lab.shares_memory(snapshot_leaf(b, pin=True), np.asarray(b)) == mtree.pinning_works()


@pytest.mark.task("5.1")
def test_the_training_run_helper_names_the_leaf_a_sharing_snapshot_lets_change(tmp_path):
    assert lab.async_training_run(str(tmp_path / "ref")) is None
    assert lab.async_training_run(str(tmp_path / "copy"), zero_copy=False) is None

    def snapshot_leaf(x, *, path="<leaf>", pin=False):  # the mistake: no copy
        """Task 5.1 — shares memory with numpy leaves."""
        return to_host(x, path=path)

    with lab.plugged_in(snapshot_leaf):
        problem = lab.async_training_run(str(tmp_path / "bad"))
    assert problem is not None and "loader/" in problem and "after save() returned" in problem


# ---- 5.2 ------------------------------------------------------------------------------
@pytest.mark.task("5.2")
def test_one_write_in_flight_and_its_error_raised_once_as_it_was():
    w = AsyncWriter()
    go = threading.Event()
    start_in_background(w, lambda: go.wait(10), "step 1")
    assert w.is_saving_in_progress() and not w._thread.daemon
    with pytest.raises(MiniCkptError, match="step 1"):
        start_in_background(w, lambda: None, "step 2")
    assert w._what == "step 1"
    collect_error(w)  # never blocks: the write is still running
    assert w.is_saving_in_progress()
    go.set()
    w.wait()
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fail():
        raise err

    w.start(fail, what="step 3")
    w.wait()
    with pytest.raises(MiniCkptError, match="not collected"):
        w.start(lambda: None, what="step 4")
    with pytest.raises(OSError) as info:
        w.check_for_errors()
    assert info.value is err and info.value.errno == errno.ENOSPC
    assert any("step 3" in n for n in err.__notes__)
    w.check_for_errors()  # once
    w.start(lambda: None, what="step 4")
    w.wait_until_finished()


@pytest.mark.task("5.2")
def test_a_base_exception_in_the_background_is_kept_too():
    class Stop(BaseException):
        pass

    def stop():
        raise Stop

    w = AsyncWriter()
    run_in_background(w, stop, "step 9")  # the thread's body, run here
    with pytest.raises(Stop):
        collect_error(w)


# ---- 5.3 ------------------------------------------------------------------------------
def _timeline(draw_steps, draw_saves):
    """A consistent timeline: steps one after another; a save after some of them, waiting
    for the previous write (one in flight)."""
    t, steps, saves, prev_end = 0.0, [], [], 0.0
    for d, gap, save in draw_steps:
        steps.append((t, t + d))
        t += d + gap
        if save and draw_saves:
            snap, write = draw_saves.pop()
            unblocked = max(t, prev_end) + snap
            saves.append((t, unblocked, unblocked + write))
            prev_end, t = unblocked + write, unblocked
    return steps, saves


def _sampled(steps, saves, n=4000):
    """The four numbers by brute force: sample the time axis."""
    if not saves:
        return dict.fromkeys(("blocked_s", "stall_s", "write_s", "hidden_s"), 0.0)
    hi = max(max(e for *_, e in saves), max(b for _, b in steps))
    ts = (np.arange(n) + 0.5) * hi / n
    dt = hi / n
    computing = np.zeros(n, bool)
    for a, b in steps:
        computing |= (ts >= a) & (ts < b)
    writing, blocked, stalled = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    prev_end = -1.0
    for s, u, e in sorted(saves):
        writing |= (ts >= u) & (ts < e)
        blocked |= (ts >= s) & (ts < u)
        stalled |= (ts >= s) & (ts < min(u, prev_end))
        prev_end = e
    return {"blocked_s": blocked.sum() * dt, "stall_s": stalled.sum() * dt,
            "write_s": writing.sum() * dt, "hidden_s": (writing & computing).sum() * dt}


@pytest.mark.task("5.3")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 1.0), st.floats(0.0, 0.3), st.booleans()),
                min_size=1, max_size=12),
       st.lists(st.tuples(st.floats(0.0, 0.1), st.floats(0.01, 2.0)), max_size=12),
       st.randoms(use_true_random=False))
def test_overlap_agrees_with_sampling_the_timeline_in_any_order(draw_steps, draw_saves, rnd):
    steps, saves = _timeline(draw_steps, list(draw_saves))
    want = _sampled(steps, saves)
    shuffled_steps, shuffled_saves = steps[:], saves[:]
    rnd.shuffle(shuffled_steps)
    rnd.shuffle(shuffled_saves)
    got = overlap(shuffled_steps, shuffled_saves)
    assert set(got) == set(want) and all(type(v) is float for v in got.values())
    span = max([b for _, b in steps] + [e for *_, e in saves])
    for k in want:
        assert abs(got[k] - want[k]) <= 2 * span / 4000 * (len(steps) + 3 * len(saves)), k
    assert 0.0 <= got["hidden_s"] <= got["write_s"] + 1e-12
    assert 0.0 <= got["stall_s"] <= got["blocked_s"] + 1e-12


@pytest.mark.task("5.3")
def test_save_intervals_place_both_phases_on_the_wall_clock():
    a = SaveStats(1, "/x/step_1", start_time=100.0, blocking_s=0.1, total_s=2.0)
    b = SaveStats(2, "/x/step_2", start_time=101.0, blocking_s=1.2, total_s=1.5)
    assert save_intervals([b, a]) == [(100.0, 100.1, 102.0), (101.0, 102.2, 102.5)]
    got = overlap([(99.0, 100.0), (100.1, 101.0), (102.2, 103.0)], save_intervals([a, b]))
    assert got["stall_s"] == pytest.approx(1.0) and got["hidden_s"] == pytest.approx(0.9 + 0.3)


@pytest.mark.task("5.3")
def test_a_recorded_run_is_consistent_with_the_managers_own_stats(tmp_path):
    steps, saves, history = lab.record_async_run(str(tmp_path), steps=6, every=2)
    got = overlap(steps, saves)
    assert got["blocked_s"] == pytest.approx(sum(h.blocking_s for h in history), abs=1e-6)
    assert 0.0 < got["hidden_s"] < got["write_s"]  # the pause after every save hides nothing


@pytest.mark.task("5.2")
@pytest.mark.timeout(180)
def test_the_faulty_run_passes_the_reference_and_names_each_wrong_writer(tmp_path):
    """The judge of Task 5.2: the reference passes; a writer that swallows a failure, one that
    never clears it, and one that lets a second write start are each named."""
    assert lab.async_faulty_run(str(tmp_path / "ref")) is None

    def run_in_background(writer, fn, what):  # the mistake: log and forget
        """Task 5.2 (run) — swallows."""
        try:
            fn()
        except Exception as e:
            print("warning:", e)

    with lab.plugged_in(run_in_background):
        problem = lab.async_faulty_run(str(tmp_path / "swallow"))
    assert problem is not None and "as if nothing had happened" in problem

    def collect_error(writer):  # the mistake: raised, never forgotten
        """Task 5.2 (collect) — never clears."""
        if writer._error is not None:
            raise writer._error

    with lab.plugged_in(collect_error):
        problem = lab.async_faulty_run(str(tmp_path / "stale"))
    assert problem is not None and "never cleared" in problem

    def start_in_background(writer, fn, what):  # the mistake: no check of the thread in flight
        """Task 5.2 (start) — two in flight."""
        with writer._lock:
            if writer._error is not None:
                raise MiniCkptError("uncollected")
            t = threading.Thread(target=masync.run_in_background, args=(writer, fn, what))
            writer._thread, writer._what = t, what
        t.start()

    with lab.plugged_in(start_in_background):
        problem = lab.async_faulty_run(str(tmp_path / "two"))
    assert problem is not None and "two saves at once" in problem


@pytest.mark.task("5.1")
@pytest.mark.parametrize("pin", [False, True])
def test_a_leaf_deleted_before_the_snapshot_raises_and_is_never_photographed(pin):
    """The contract's clause: a jax.Array deleted (or donated) before the call has nothing to
    photograph; the snapshot raises rather than return freed memory."""
    x = jnp.arange(4.0)
    x.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        snapshot_leaf(x, path="params/w", pin=pin)


@pytest.mark.task("5.2")
def test_two_concurrent_starts_run_one_write_phase():
    """Issue 39: two threads calling start() at once, interleaved at the worst moment by
    lab.start_race. The reference once set writer._thread under the lock but started the
    thread after letting it go: the other caller saw a thread not yet alive and started a
    second write phase. A writer with no lock at all fails the same way."""
    assert lab.start_race(AsyncWriter) is None

    def start_in_background(writer, fn, what):  # the mistake: no lock at all
        if writer._thread is not None and writer._thread.is_alive():
            raise MiniCkptError(f"{what}: {writer._what} in flight")
        thread = threading.Thread(target=run_in_background, args=(writer, fn, what),
                                  name=f"{writer.name}:{what}")
        writer._thread, writer._what = thread, what
        thread.start()

    with lab.plugged_in(start_in_background):
        assert "two saves in flight" in (lab.start_race(AsyncWriter) or "")


@pytest.mark.task("5.1")
def test_pretend_no_pinning_turns_the_probe_off_and_back():
    real = mtree.pinning_works()
    w = jnp.arange(64.0) + 0
    with lab.pretend_no_pinning():
        assert mtree.pinning_works() is False and lab.pinning_works() is False
        assert mtree.pinned_view(w) is None
        snap = snapshot_leaf(w, pin=True)
        assert not lab.shares_memory(snap, np.asarray(w))
    assert mtree.pinning_works() is real
