"""Issue 32, items 3 and 4: a directory of Orbax checkpoints, seen by minickpt, and converted.

The Orbax checkpoints are written here by Orbax itself (orbax-checkpoint is in the venv)."""

import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions, CheckpointNotFoundError
from minickpt.cli import main as cli
from minickpt.errors import CheckpointCorruptedError, MiniCkptError
from minickpt.orbax_convert import ConversionFailed, compare_leaves, convert
from minickpt.orbax_dirs import is_orbax_checkpoint, orbax_steps

ocp = pytest.importorskip("orbax.checkpoint")
pytestmark = pytest.mark.timeout(180)


def orbax_state(s: int) -> dict:
    # a step count as jax.device_get hands over optax's: a 0-d array (int64 here, to check
    # the dtype survives), not a numpy scalar, which orbax-checkpoint 0.11 refuses to save
    return {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + s,
                       "b": np.full(3, s, np.int32)},
            "opt": {"count": np.asarray(s, np.int64), "mu": [np.ones(2, np.float16) * s]}}


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


# ---- item 4: default options say what is there; ls too; and the conversion -------------
def test_default_options_say_the_directory_holds_orbax_checkpoints(run):
    with pytest.warns(UserWarning, match="Orbax checkpoint.*convert-orbax"):
        m = CheckpointManager(run, CheckpointManagerOptions(read_only=True))
    assert m.latest_step() is None and sorted(m.foreign_steps) == [0, 1, 2]
    with pytest.raises(CheckpointNotFoundError, match="3 Orbax checkpoint"):
        m.restore()
    m.close()


def test_ls_calls_orbax_steps_orbax_not_damaged(run, capsys):
    assert cli(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "damaged" not in out and out.count("orbax") >= 3 and "convert-orbax" in out
    assert cli(["ls", "--json", str(run)]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["orbax"] * 3


def test_convert_orbax_restores_with_orbax_and_verifies_every_leaf(run, tmp_path, capsys):
    before = listing(run)
    dst = tmp_path / "converted"
    assert cli(["convert-orbax", str(run), str(dst)]) == 0
    out = capsys.readouterr().out
    assert out.count("leaves identical") == 3
    assert listing(run) == before  # nothing written into Orbax's directory
    with CheckpointManager(dst, CheckpointManagerOptions(read_only=True)) as m:
        assert m.all_steps() == [0, 1, 2]
        for s in range(3):
            r = m.restore(s)
            assert compare_leaves(orbax_state(s), r["state"], "here") == 4
            assert m.metadata(s).custom_metadata["converted_from"] == str(run / str(s))
        assert m.metadata(2).metrics == {"loss": pytest.approx(1 / 3)}
    # again: nothing saved twice, every step compared again
    assert cli(["convert-orbax", str(run), str(dst)]) == 0
    assert capsys.readouterr().out.count("(already converted)") == 3


def test_convert_a_single_item_run_and_its_errors(orbax_runs, tmp_path):
    src = orbax_runs / "single"
    assert orbax_steps(str(src)) == {5: "5"}
    done = convert(src, tmp_path / "out")
    assert [(c.step, c.items, c.leaves) for c in done] == [(5, ["default"], 4)]
    with pytest.raises(MiniCkptError, match="another directory"):
        convert(src, src)
    with pytest.raises(CheckpointNotFoundError, match=r"step\(s\) \[7\]"):
        convert(src, tmp_path / "out2", steps=[7])
    with pytest.raises(CheckpointNotFoundError, match="no Orbax checkpoint"):
        convert(tmp_path / "out", tmp_path / "out3")  # a minickpt run is not an Orbax one
    assert cli(["convert-orbax", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2


def test_compare_leaves_names_each_difference():
    a = {"w": np.zeros(3, np.float32), "b": {"c": np.ones(2)}}
    with pytest.raises(CheckpointCorruptedError, match="b/c: missing.*w: float32"):
        compare_leaves(a, {"w": np.ones(3, np.float32)}, "x")


# ---- issue 50: every Orbax of the range (0.11.16 ... 0.12), damage named for what it is ----
def test_convert_reads_the_orbax_that_wrote_it(orbax_runs, tmp_path):
    """The checkpoints the installed Orbax wrote convert, whichever Orbax of the range it is
    (0.11 returns the tree's metadata bare, 0.12 inside a StepMetadata)."""
    done = convert(orbax_runs / "run", tmp_path / "out")
    assert [(c.step, c.items, c.leaves, c.error) for c in done] == [
        (s, ["state"], 4, None) for s in range(3)]


def _remove(p):
    shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.parametrize("damage, why", [
    (lambda item: _remove(item / "_METADATA"), r"_METADATA .* is missing"),
    (lambda item: (item / "_METADATA").write_text("{ not json"),
     r"_METADATA .* is not the JSON Orbax writes"),
    (lambda item: _remove(item / "manifest.ocdbt"), r"manifest\.ocdbt .* is missing"),
    (lambda item: _remove(item / "d"), r"Orbax cannot restore it: \w+: .*NOT_FOUND"),
])
def test_a_damaged_orbax_step_is_named_for_its_damage(run, tmp_path, damage, why):
    """One damaged step of three: the other two convert, and the error says what is wrong
    with the damaged one (not a guess at 'missing or damaged')."""
    damage(run / "1" / "state")
    seen = []
    with pytest.raises(ConversionFailed) as failed:
        convert(run, tmp_path / "out", on_step=seen.append)
    assert sorted(failed.value.failed) == [1]
    assert re.search(why, failed.value.failed[1]), failed.value.failed[1]
    assert [c.step for c in failed.value.converted] == [0, 2]
