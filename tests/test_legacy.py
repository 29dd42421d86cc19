"""Flax's legacy save_checkpoint/restore_checkpoint semantics, on minickpt's core."""

import jax.numpy as jnp
import numpy as np
import pytest

from minickpt import CheckpointNotFoundError, restore_checkpoint, save_checkpoint
from minickpt.legacy import InvalidCheckpointError, latest_checkpoint
from minickpt.policy import legacy_steps_to_keep


def st(v):
    return {"w": jnp.full(3, float(v)), "step": v}


def steps_in(d):
    return sorted(int(p.name.split("_")[1]) for p in d.iterdir() if p.name.startswith("checkpoint_"))


def test_restore_with_nothing_saved_returns_the_target_itself(tmp_path):
    target = st(0)
    assert restore_checkpoint(tmp_path / "empty", target) is target
    assert restore_checkpoint(tmp_path, None) is None


def test_save_restore_latest_and_by_step(tmp_path):
    for s in (1, 2, 3):
        path = save_checkpoint(tmp_path, st(s), s, keep=5)
        assert path.endswith(f"checkpoint_{s}")
    assert restore_checkpoint(tmp_path, st(0))["step"] == 3
    assert restore_checkpoint(tmp_path, st(0), step=2)["step"] == 2
    assert restore_checkpoint(tmp_path / "checkpoint_1", st(0))["step"] == 1  # a path works too
    raw = restore_checkpoint(tmp_path, None)
    assert isinstance(raw["w"], np.ndarray) and raw["step"] == 3
    with pytest.raises(CheckpointNotFoundError, match="Matching checkpoint not found"):
        restore_checkpoint(tmp_path, st(0), step=7)


def test_keep_removes_oldest(tmp_path):
    for s in range(1, 6):
        save_checkpoint(tmp_path, st(s), s, keep=2)
    assert steps_in(tmp_path) == [4, 5]
    assert latest_checkpoint(tmp_path).endswith("checkpoint_5")


def test_keep_every_n_steps(tmp_path):
    for s in range(0, 50, 5):
        save_checkpoint(tmp_path, st(s), s, keep=2, keep_every_n_steps=20)
    assert steps_in(tmp_path) == [0, 20, 40, 45]
    assert legacy_steps_to_keep([0, 5, 10, 15, 20, 25, 30], 2, 10) == {0, 10, 20, 25, 30}


def test_outdated_step_needs_overwrite(tmp_path):
    save_checkpoint(tmp_path, st(1), 1, keep=5)
    save_checkpoint(tmp_path, st(5), 5, keep=5)
    with pytest.raises(InvalidCheckpointError, match="outdated"):
        save_checkpoint(tmp_path, st(3), 3, keep=5)
    with pytest.raises(InvalidCheckpointError):
        save_checkpoint(tmp_path, st(5), 5, keep=5)
    save_checkpoint(tmp_path, st(3), 3, keep=5, overwrite=True)
    assert steps_in(tmp_path) == [1, 3]  # the newer step 5 is gone
    save_checkpoint(tmp_path, {"w": jnp.zeros(3), "step": 33}, 3, keep=5, overwrite=True)
    assert restore_checkpoint(tmp_path, st(0))["step"] == 33


def test_custom_prefix(tmp_path):
    save_checkpoint(tmp_path, st(2), 2, prefix="ckpt-")
    assert (tmp_path / "ckpt-2").is_dir()
    assert restore_checkpoint(tmp_path, st(0), prefix="ckpt-")["step"] == 2
    assert restore_checkpoint(tmp_path, st(0))["step"] == 0  # other prefix: nothing found
