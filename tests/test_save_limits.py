"""A save refuses, before it writes, what a restore would refuse to read (issue 49): the
metadata's and the manifest's size caps (one constant each, shared by the writer and the
reader), a step that is not an int, metrics or metadata a reader would drop. And a
retention that cannot hold its stated bound says so once."""

import os
import warnings

import numpy as np
import pytest

import minickpt as mc
from minickpt.checkpointer import MAX_METADATA_BYTES, Checkpointer

pytestmark = pytest.mark.timeout(120)


def _items(v=0.0):
    return {"params": {"w": np.full((4, 4), v, np.float32)}}


def _left(d):
    """What is in a manager's directory besides its lock: steps, temporaries, anything."""
    return sorted(n for n in os.listdir(d) if n != ".minickpt.lock")


def test_metadata_over_the_read_cap_is_refused_before_anything_is_written(tmp_path):
    big = {"notes": "x" * (MAX_METADATA_BYTES + 1)}
    with mc.CheckpointManager(tmp_path / "run") as m:
        with pytest.raises(ValueError, match="MAX_METADATA_BYTES") as e:
            m.save(0, _items(), metadata=big)
        assert "nothing was written" in str(e.value)
        assert _left(tmp_path / "run") == [] and m.all_steps() == []
        # just under the cap, less minickpt's own room: saved, and restored
        fits = {"notes": "y" * (MAX_METADATA_BYTES - (2 << 20))}
        assert m.save(1, _items(1.0), metadata=fits)
    with mc.CheckpointManager(tmp_path / "run") as m:
        r = m.restore()
        assert r.step == 1 and m.metadata(1).custom_metadata == fits


def test_a_manifest_over_the_read_cap_is_refused_before_anything_is_written(tmp_path,
                                                                           monkeypatch):
    from minickpt.format import encode, manifest

    # the writer and the reader share one constant (format.spec.MAX_MANIFEST_BYTES): both
    # lowered, so that a tree of a few thousand leaves crosses it
    for mod in (encode, manifest):
        monkeypatch.setattr(mod, "MAX_MANIFEST_BYTES", 256 << 10)
    tree = {f"layer_{i:05d}_{'n' * 40}": np.float32(i) for i in range(4000)}
    with mc.CheckpointManager(tmp_path / "run") as m:
        with pytest.raises(ValueError, match="MAX_MANIFEST_BYTES"):
            m.save(0, {"params": tree})
        assert _left(tmp_path / "run") == []
        small = dict(list(tree.items())[:100])
        assert m.save(1, {"params": small})
        assert m.restore(1)["params"] == small
    # one long string leaf: refused by its size alone
    with mc.CheckpointManager(tmp_path / "run2") as m:
        with pytest.raises(ValueError, match="manifest would be"):
            m.save(0, {"text": {"s": "z" * (300 << 10)}})
        assert _left(tmp_path / "run2") == []


def test_a_step_a_restore_calls_damaged_is_refused(tmp_path):
    ck = Checkpointer()
    with pytest.raises(ValueError, match="step must be an int"):
        ck.save(tmp_path / "c", _items(), step=True)
    assert not (tmp_path / "c").exists()
    ck.save(tmp_path / "d", _items(), step=3)
    assert ck.metadata(tmp_path / "d").step == 3


@pytest.mark.parametrize("kw", [{"metrics": 0.5}, {"metrics": [1, 2]},
                                {"metadata": "v1"}, {"metadata": ["a"]}])
def test_metrics_or_metadata_a_restore_would_drop_are_refused(tmp_path, kw):
    with mc.CheckpointManager(tmp_path / "run") as m:
        with pytest.raises(TypeError, match="must be a mapping"):
            m.save(0, _items(), **kw)
        assert _left(tmp_path / "run") == []


def test_retention_that_cannot_hold_its_bound_warns_once_naming_the_option(tmp_path):
    opts = mc.CheckpointManagerOptions(max_to_keep=2, keep_latest=1,
                                       best_fn=lambda m: m["val_loss"], best_mode="min")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mc.CheckpointManager(tmp_path / "run", opts) as m:
            for s in range(20):  # metrics on the evaluation steps only
                m.save(s, _items(s), metrics={"val_loss": 1.0 / (s + 1)} if s % 5 == 0
                       else None)
            kept = m.all_steps()
    said = [str(w.message) for w in caught if "keep_checkpoints_without_metrics" in
            str(w.message)]
    assert len(said) == 1, said
    assert "max_to_keep + keep_latest = 3" in said[0]
    assert len(kept) > 3  # the documented condition: every step without a metric is kept
    # with the option off, the bound holds and nothing is said
    opts = mc.CheckpointManagerOptions(max_to_keep=2, keep_latest=1,
                                       best_fn=lambda m: m["val_loss"], best_mode="min",
                                       keep_checkpoints_without_metrics=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mc.CheckpointManager(tmp_path / "run2", opts) as m:
            for s in range(20):
                m.save(s, _items(s), metrics={"val_loss": 1.0 / (s + 1)} if s % 5 == 0
                       else None)
            assert len(m.all_steps()) <= 3
    assert not [w for w in caught if "keep_checkpoints_without_metrics" in str(w.message)]
