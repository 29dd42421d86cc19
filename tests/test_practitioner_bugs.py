"""Issue 32: minickpt used as a practitioner would — retention on an unreadable step, the
tiered resume loop, foreign directories, and the rough edges found on the way."""

import os

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.fs import FaultyFileSystem

pytestmark = pytest.mark.timeout(120)


def tree(v: float = 0.0) -> dict:
    return {"params": {"w": np.full((2, 3), v, np.float32)}}


def loss_opts(**kw) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min", **kw)


def eio_on(step_dir: str, *, persistent: bool = False) -> FaultyFileSystem:
    """EIO when opening one step's metadata (once, or every time)."""
    target = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    return FaultyFileSystem(0, when=lambda op, args: op == "open" and args[0] == target,
                            persistent=persistent)


# ---- item 1: an I/O error while opening the directory is not "no metrics" --------------
@pytest.mark.parametrize("persistent", [False, True])
def test_eio_reading_metadata_at_open_never_deletes_the_best(tmp_path, persistent):
    o = loss_opts(max_to_keep=2, keep_checkpoints_without_metrics=False)
    with CheckpointManager(tmp_path, o) as m:
        m.save(1, tree(1), metrics={"loss": 0.1})  # the best
        m.save(2, tree(2), metrics={"loss": 0.5})
    fs = eio_on(str(tmp_path / "step_1"), persistent=persistent)
    with CheckpointManager(tmp_path, o, fs=fs) as m:
        assert fs.tripped
        assert 1 in m.all_steps()  # unreadable now, not gone
        m.save(3, tree(3), metrics={"loss": 0.3})
        assert 1 in m.all_steps()
        if not persistent:  # read again at retention: the best and the better of the rest
            assert m.all_steps() == [1, 3] and m.best_step() == 1
    assert os.path.isdir(tmp_path / "step_1")
    with CheckpointManager(tmp_path, o) as m:  # a healthy disk again: retention as ever
        assert m.best_step() == 1
        m.save(4, tree(4), metrics={"loss": 0.9})
        assert m.all_steps() == [1, 3]


def test_eio_at_open_keeps_max_to_keep(tmp_path):
    o = loss_opts(max_to_keep=2)
    with CheckpointManager(tmp_path, o) as m:
        m.save(1, tree(1), metrics={"loss": 0.1})
        m.save(2, tree(2), metrics={"loss": 0.5})
    with CheckpointManager(tmp_path, o, fs=eio_on(str(tmp_path / "step_1"))) as m:
        m.save(3, tree(3), metrics={"loss": 0.3})
        assert m.all_steps() == [1, 3]  # not three steps kept


def test_tiered_local_retention_never_deletes_an_unreadable_step(tmp_path):
    from minickpt.production import TieredCheckpointManager

    o = loss_opts(max_to_keep=1, keep_checkpoints_without_metrics=False)
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with TieredCheckpointManager(local, mirror, o) as m:
        m.save(1, tree(1), metrics={"loss": 0.1})
        m.wait_until_mirrored()
    fs = eio_on(str(local / "step_1"), persistent=True)
    with TieredCheckpointManager(local, mirror, o, fs=fs) as m:
        m.save(2, tree(2), metrics={"loss": 0.5})
        m.wait_until_mirrored()
    assert os.path.isdir(local / "step_1")
    assert os.path.isdir(mirror / "step_1")
