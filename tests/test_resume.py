"""A resumed Flax/Optax run is bit-for-bit the uninterrupted one (on CPU)."""

import contextlib
import errno
import io
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.cli import main as cli_main
from minickpt.commit import DAMAGED_MARK
from minickpt.demo import fingerprint, make_state, train
from minickpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
)
from minickpt.fallback import restore_newest_valid
from minickpt.faults import FaultyFileSystem


def test_resume_is_bit_identical(tmp_path):
    state, rng = make_state(0), jax.random.key(42)
    ref_state, ref_rng, ref_losses = train(state, rng, 0, 30)

    opts = CheckpointManagerOptions(save_interval_steps=10, max_to_keep=2)
    with CheckpointManager(tmp_path, opts) as m:
        def cb(step, st, key, loss):
            m.save(step, {"state": st, "rng": key}, metrics={"loss": loss})
        train(state, rng, 0, 17, callback=cb)  # "crashes" after step 17: last save was 10
    with CheckpointManager(tmp_path, opts) as m:
        r = m.restore(target={"state": make_state(0), "rng": jax.random.key(0)})
        assert r.step == 10
        st, key, losses = train(r["state"], r["rng"], r.step, 30)
    assert fingerprint((st, key)) == fingerprint((ref_state, ref_rng))
    assert losses == ref_losses[10:]


def test_resume_without_optimizer_state_differs(tmp_path):
    """The chapter's point: weights alone are not a checkpoint."""
    state, rng = make_state(0), jax.random.key(42)
    mid, mid_rng, _ = train(state, rng, 0, 20)
    _ref, _, ref_losses = train(mid, mid_rng, 20, 40)
    fresh_opt = mid.replace(opt_state=mid.tx.init(mid.params))  # params kept, Adam forgotten
    _, _, cold_losses = train(fresh_opt, mid_rng, 20, 40)
    assert cold_losses != ref_losses


def test_demo_kills_and_resumes_identically(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minickpt.demo", "--dir", str(tmp_path / "ck"),
                          "--steps", "30", "--every", "5", "--kill-at", "17"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "killed with SIGKILL after step 17 " in out.stdout  # lockstep: exactly there
    assert "resumed from step 15" in out.stdout
    assert "identical to the uninterrupted one: YES" in out.stdout


# ---------------------------------------------------------------------------------------
# issue 21, bugs 1 and 2: the fallback of task 3.1 inside the manager
# ---------------------------------------------------------------------------------------
def _small(v):
    return {"w": np.full((4,), float(v), np.float32)}


def _flip(path, offset=3):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.task("3.1")
@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
def test_readme_loop_carries_on_after_a_fallback(tmp_path, enable_async):
    """Bug 1: the damaged step_200 kept its name, so save(200) of the resumed run raised
    StepAlreadyExistsError. Now it is set aside (kept, never a checkpoint, shown by ls)."""
    opts = CheckpointManagerOptions(save_interval_steps=100, max_to_keep=3,
                                    enable_async_checkpointing=enable_async)
    with CheckpointManager(tmp_path, opts) as m:
        for s in (100, 200):
            m.save(s, {"s": _small(s)})
    _flip(tmp_path / "step_200" / "s" / "data.bin")
    with CheckpointManager(tmp_path, opts) as m:  # the README's loop
        start, x = 0, _small(0)
        if m.latest_step() is not None:
            with pytest.warns(UserWarning, match="skipping damaged checkpoint step 200"):
                restored = m.restore(target={"s": x})
            x, start = restored["s"], restored.step
        assert start == 100
        for step in range(start + 1, 401):
            m.save(step, {"s": _small(step)})
        m.wait_until_finished()
        assert m.all_steps(read=True) == [200, 300, 400]
        assert all(m.verify(s).ok for s in (200, 300, 400))
    names = sorted(os.listdir(tmp_path))
    aside = [n for n in names if n.startswith("step_200") and n != "step_200"]
    assert len(aside) == 1 and DAMAGED_MARK in aside[0], names
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["ls", str(tmp_path)])
    assert aside[0] in out.getvalue() and "set aside" in out.getvalue(), out.getvalue()
    # set aside, it never counts as a checkpoint again, and no cleanup removes it
    with CheckpointManager(tmp_path, opts) as m:
        assert m.all_steps() == [200, 300, 400] and m.restore().step == 400
    assert aside[0] in os.listdir(tmp_path)


@pytest.mark.task("3.1")
def test_a_read_only_manager_never_moves_a_damaged_step(tmp_path):
    with CheckpointManager(tmp_path) as m:
        for s in (1, 2):
            m.save(s, {"s": _small(s)})
    _flip(tmp_path / "step_2" / "s" / "data.bin")
    with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True)) as m:
        with pytest.warns(UserWarning, match="skipping damaged checkpoint step 2"):
            assert m.restore().step == 1
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock", "step_1", "step_2"]


@pytest.mark.task("3.1")
def test_a_transient_read_error_is_not_damage(tmp_path):
    """Bug 2: one EIO while reading step_200 made restore() skip it as damaged and return
    step 100. An I/O error says nothing about the checkpoint: it is raised, errno intact."""
    with CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=100)) as m:
        for s in (100, 200):
            m.save(s, {"s": _small(s)})
    data = str(tmp_path / "step_200" / "s" / "data.bin")
    reads = []

    def once_on_200(op, args):  # the first read of step_200's data fails, once
        if op == "open" and args and str(args[0]) == data:
            reads.append(args)
        return op == "preadv" and len(reads) == 1

    fs = FaultyFileSystem(0, ops=("open", "preadv"), when=once_on_200)
    with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True), fs=fs) as m:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "skipping damaged" warning
            with pytest.raises(OSError) as err:
                m.restore(target={"s": _small(0)})
        assert err.value.errno == errno.EIO and fs.tripped
        assert not isinstance(err.value, CheckpointNotFoundError)
        assert m.verify(200).ok  # nothing was wrong with it
        r = m.restore(target={"s": _small(0)})  # the next read works
        assert r.step == 200 and float(r["s"]["w"][0]) == 200.0


@pytest.mark.task("3.1")
@given(st.dictionaries(st.integers(0, 10_000), st.sampled_from(["ok", "bad", "big"]),
                       min_size=1, max_size=8))
def test_newest_valid_is_the_newest_restorable_step(outcomes):
    tried, skipped = [], []

    def restore_step(s):
        tried.append(s)
        if outcomes[s] == "bad":
            raise CheckpointCorruptedError(f"step_{s}", "checksum mismatch")
        if outcomes[s] == "big":
            raise CheckpointTooLargeError(f"step {s} needs more memory")
        return f"state {s}"

    good = [s for s, o in outcomes.items() if o == "ok"]
    steps = list(outcomes)  # in no particular order
    if good:
        got = restore_newest_valid("run", steps, restore_step,
                                   on_skip=lambda s, e: skipped.append(s))
        assert got == (max(good), f"state {max(good)}")
    else:
        with pytest.raises(CheckpointCorruptedError) as err:
            restore_newest_valid("run", steps, restore_step,
                                 on_skip=lambda s, e: skipped.append(s))
        assert all(f"step {s}:" in str(err.value) for s in steps)
    assert tried == sorted(tried, reverse=True) and tried[0] == max(steps)
    assert skipped == tried[:-1] if good else skipped == tried


@pytest.mark.task("3.1")
def test_newest_valid_falls_back_only_on_verified_damage():
    def eio(s):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as err:
        restore_newest_valid("run", [1, 2], eio, on_skip=lambda s, e: pytest.fail("skipped"))
    assert err.value.errno == errno.EIO
    with pytest.raises(CheckpointNotFoundError):
        restore_newest_valid("run", [], eio)

    def damaged_2(s):
        if s == 2:
            raise CheckpointCorruptedError("step_2", "bad")
        return s

    with pytest.raises(CheckpointCorruptedError):
        restore_newest_valid("run", [1, 2], damaged_2, fallback=False)
    assert restore_newest_valid("run", [2, 1], damaged_2) == (1, 1)
