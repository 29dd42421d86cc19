"""Issue 32, items 3 and 4: a directory of Orbax checkpoints, seen by minickpt, and converted.

The Orbax checkpoints are written here by Orbax itself (orbax-checkpoint is in the venv)."""

import os
import shutil
import warnings

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions, CheckpointNotFoundError
from minickpt.errors import MiniCkptError
from minickpt.orbax_dirs import is_orbax_checkpoint

ocp = pytest.importorskip("orbax.checkpoint")
pytestmark = pytest.mark.timeout(180)


def orbax_state(s: int) -> dict:
    return {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + s,
                       "b": np.full(3, s, np.int32)},
            "opt": {"count": np.int64(s), "mu": [np.ones(2, np.float16) * s]}}


@pytest.fixture(scope="module")
def orbax_runs(tmp_path_factory):
    """Two Orbax run directories: three composite steps ('state' item, with metrics) and
    one single-item step (Orbax's 'default')."""
    root = tmp_path_factory.mktemp("orbax")
    opts = ocp.CheckpointManagerOptions(max_to_keep=3, best_fn=lambda m: m["loss"],
                                        best_mode="min")
    with ocp.CheckpointManager(root / "run", options=opts) as m:
        for s in range(3):
            m.save(s, args=ocp.args.Composite(state=ocp.args.StandardSave(orbax_state(s))),
                   metrics={"loss": 1.0 / (s + 1)})
        m.wait_until_finished()
    with ocp.CheckpointManager(root / "single") as m:
        m.save(5, args=ocp.args.StandardSave(orbax_state(5)))
        m.wait_until_finished()
    return root


@pytest.fixture
def run(orbax_runs, tmp_path):
    shutil.copytree(orbax_runs / "run", tmp_path / "run")
    return tmp_path / "run"


def listing(d) -> list[str]:
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d)
                  for f in fs)


def orbax_latest(d) -> dict:
    with ocp.CheckpointManager(d) as m:
        return m.all_steps(), m.restore(m.latest_step())


# ---- item 3: a writable manager never deletes, moves or writes into Orbax's steps --------
def test_writable_manager_with_orbax_naming_never_deletes_orbax_steps(run):
    before = listing(run)
    o = CheckpointManagerOptions(step_prefix=None, max_to_keep=2)
    with pytest.warns(UserWarning, match=r"3 Orbax checkpoint\(s\) \(steps 0, 1, 2\)"):
        m = CheckpointManager(run, o)
    with m:
        assert m.all_steps() == [] and m.foreign_steps == {0: "0", 1: "1", 2: "2"}
        with pytest.raises(CheckpointNotFoundError, match="convert-orbax"):
            m.restore()
        with pytest.raises(MiniCkptError, match=r"steps \[0, 1, 2\] are an Orbax checkpoint"):
            m.save(3, {"state": orbax_state(3)})  # deleted 0 and 1 through retention
    after = [p for p in listing(run) if p != ".minickpt.lock"]
    assert after == before
    steps, restored = orbax_latest(run)  # Orbax still opens it, and reads its newest step
    assert steps == [0, 1, 2]
    np.testing.assert_array_equal(restored["state"]["params"]["w"], orbax_state(2)["params"]["w"])


def test_a_damaged_minickpt_step_is_not_taken_for_orbax(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"a": {"x": np.zeros(2)}})
    (tmp_path / "step_1" / "_CHECKPOINT_METADATA").write_text("{ not json")
    assert not is_orbax_checkpoint(str(tmp_path / "step_1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Orbax checkpoint" warning
        with CheckpointManager(tmp_path) as m:
            assert m.all_steps() == [1] and m.foreign_steps == {}
