"""A resumed Flax/Optax run is bit-for-bit the uninterrupted one (on CPU)."""

import subprocess
import sys

import jax

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.demo import fingerprint, make_state, train


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
    assert "resumed from step 15" in out.stdout
    assert "identical to the uninterrupted one: YES" in out.stdout
