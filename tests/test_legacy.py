"""Flax's legacy save_checkpoint/restore_checkpoint semantics, on minickpt's core."""

import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from minickpt import CheckpointNotFoundError, legacy, restore_checkpoint, save_checkpoint
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
    assert steps_in(tmp_path) == [5, 25, 40, 45]  # what flax 0.12 keeps: step 0 never by period
    assert legacy_steps_to_keep([0, 5, 10, 15, 20, 25, 30], 2, 10) == {5, 15, 25, 30}
    assert legacy_steps_to_keep([3, 4, 7], 0, None) == {3, 4, 7}  # keep=0 removes nothing
    with pytest.raises(ValueError, match="keep"):
        legacy_steps_to_keep([1], -1)


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


# ---------------------------------------------------------------------------------------
# differential: the same calls through flax.training.checkpoints (legacy, no Orbax) and
# through minickpt.legacy must leave the same steps and restore the same values
# ---------------------------------------------------------------------------------------
@pytest.fixture
def flax_ckpts():
    """Flax's own legacy checkpoints module with the Orbax backend off, put back afterwards."""
    flax = pytest.importorskip("flax")
    checkpoints = pytest.importorskip("flax.training.checkpoints")
    old = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "will soon be deprecated"
            yield checkpoints
    finally:
        flax.config.update("flax_use_orbax_checkpointing", old)


def _tree(step):
    return {"w": np.full(3, step, np.float32), "n": np.int64(step)}


def _steps_on_disk(d, prefix="checkpoint_"):
    return sorted(int(n[len(prefix):]) for n in os.listdir(d)
                  if n.startswith(prefix) and n[len(prefix):].isdigit())


def _run(lib, d, calls, keep, every, prefix):
    """Apply ``calls`` (step, overwrite); record after each what survives or that it failed."""
    log = []
    for step, overwrite in calls:
        try:
            lib.save_checkpoint(d, _tree(step), step, prefix=prefix, keep=keep,
                                overwrite=overwrite, keep_every_n_steps=every)
            log.append(_steps_on_disk(d, prefix))
        except Exception as e:  # Flax and minickpt raise different classes
            log.append("outdated" if "outdated" in str(e) else type(e).__name__)
    return log


def _same_as_flax(flax_lib, tmp_path, calls, keep, every, prefix="checkpoint_"):
    fd, md = tmp_path / "flax", tmp_path / "mini"
    assert _run(legacy, md, calls, keep, every, prefix) == \
        _run(flax_lib, fd, calls, keep, every, prefix)
    target = _tree(-1)
    for step in [None, *_steps_on_disk(fd, prefix)]:
        want = flax_lib.restore_checkpoint(fd, target, step=step, prefix=prefix)
        got = legacy.restore_checkpoint(md, target, step=step, prefix=prefix)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
            assert np.asarray(got[k]).dtype == np.asarray(want[k]).dtype


def _saves(steps, overwrite_at=()):
    return [(s, i in overwrite_at) for i, s in enumerate(steps)]


FLAX_TABLE = [  # (calls, keep, keep_every_n_steps)
    (_saves(range(0, 50, 5)), 2, 20),            # the audit's case: flax keeps 5, 25, 40, 45
    (_saves(range(0, 50, 5)), 1, None),
    (_saves(range(1, 30, 3)), 3, 7),
    (_saves(range(0, 12)), 0, None),               # keep=0 removes nothing
    (_saves(range(0, 12)), 0, 4),
    (_saves(range(0, 40, 4)), 2, 1),               # every older step qualifies but step 0
    (_saves([1, 5, 3, 5, 9, 2]), 3, None),         # outdated steps refused
    (_saves([1, 5, 9, 3, 12], overwrite_at={3}), 5, None),    # overwrite drops 5 and 9
    (_saves([2, 4, 6, 4, 8], overwrite_at={3}), 2, 2),        # overwrite an existing step
    (_saves([10, 20, 30, 40, 0, 5], overwrite_at={4}), 2, 10),
]


@pytest.mark.parametrize("calls,keep,every", FLAX_TABLE)
def test_save_sequences_match_flax(flax_ckpts, tmp_path, calls, keep, every):
    _same_as_flax(flax_ckpts, tmp_path, calls, keep, every)


def test_save_sequences_match_flax_generated(flax_ckpts, tmp_path_factory):
    from hypothesis import given, settings
    from hypothesis import strategies as hs

    call = hs.tuples(hs.integers(0, 60), hs.booleans())

    @settings(max_examples=25, deadline=None)
    @given(hs.lists(call, min_size=1, max_size=10), hs.integers(0, 4),
           hs.one_of(hs.none(), hs.integers(1, 25)), hs.sampled_from(["checkpoint_", "ck_"]))
    def check(calls, keep, every, prefix):
        _same_as_flax(flax_ckpts, tmp_path_factory.mktemp("diff"), calls, keep, every, prefix)

    check()


def test_restore_edge_cases_match_flax(flax_ckpts, tmp_path):
    fd, md = tmp_path / "flax", tmp_path / "mini"
    target = _tree(-1)
    for lib, d in ((flax_ckpts, fd), (legacy, md)):
        assert lib.restore_checkpoint(d, target) is target          # no directory yet
        assert lib.restore_checkpoint(d / "checkpoint_3", target) is target
        with pytest.raises(ValueError, match="Matching checkpoint not found"):
            lib.restore_checkpoint(d, target, step=3)
        for s in (3, 7):
            lib.save_checkpoint(d, _tree(s), s, keep=5)
        lib.save_checkpoint(d, _tree(4), 4, prefix="other_", keep=5)
        assert lib.restore_checkpoint(d, target)["n"] == 7            # step=None: the latest
        assert lib.restore_checkpoint(d, target, prefix="other_")["n"] == 4
        assert lib.restore_checkpoint(d, target, prefix="none_") is target
        # the path of one checkpoint, whatever the prefix asked for
        assert lib.restore_checkpoint(d / "checkpoint_3", target)["n"] == 3
        assert lib.restore_checkpoint(d / "other_4", target)["n"] == 4
        # with a step, ckpt_dir is the directory of checkpoints, never one checkpoint
        with pytest.raises(ValueError, match="Matching checkpoint not found"):
            lib.restore_checkpoint(d / "checkpoint_3", target, step=3)
        assert lib.restore_checkpoint(d, None, step=3)["n"] == 3
        # Flax's own keyword arguments are accepted
        assert lib.restore_checkpoint(d, target, None, "checkpoint_", False, None, False, None,
                                      None)["n"] == 7


def test_flax_keyword_arguments_are_accepted_and_ignored(tmp_path):
    path = save_checkpoint(tmp_path, st(1), 1, "checkpoint_", 1, False, None, None, None)
    assert path.endswith("checkpoint_1")
    got = restore_checkpoint(tmp_path, st(0), parallel=False, gda_manager=None,
                             allow_partial_mpa_restoration=True, orbax_checkpointer=None,
                             orbax_transforms=None)
    assert got["step"] == 1


def test_missing_step_is_both_file_not_found_and_value_error(tmp_path):
    save_checkpoint(tmp_path, st(1), 1)
    for kind in (FileNotFoundError, ValueError, CheckpointNotFoundError):
        with pytest.raises(kind):
            restore_checkpoint(tmp_path, st(0), step=2)


def test_fractional_step_is_refused_not_truncated(tmp_path):
    with pytest.raises(ValueError, match="integer steps"):
        save_checkpoint(tmp_path, st(1), 2.5)
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, st(1), 1, keep=-1)
    assert not os.listdir(tmp_path)
