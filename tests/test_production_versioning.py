"""Versioning: the git commit in every checkpoint, the best version from metadata only, and
migrating a real Flax checkpoint onto a changed model."""

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minickpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointMetadata,
    StructureMismatchError,
)
from minickpt.fs import FileSystem
from minickpt.production.versioning import (
    _git_info_cached,
    best_checkpoint,
    git_info,
    migrate_checkpoint,
    select_best,
)


def _git(cwd, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          timeout=30, env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q", "-b", "main")
    (r / "train.py").write_text("print('hi')\n")
    _git(r, "add", ".")
    _git(r, "commit", "-qm", "first")
    _git_info_cached.cache_clear()
    yield r
    _git_info_cached.cache_clear()


def test_every_checkpoint_records_the_git_commit(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo / ".")
    head = _git(repo, "rev-parse", "HEAD")
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(0, {"w": np.zeros(2)})
        assert m.metadata(0).writer["git"] == {"commit": head, "branch": "main",
                                               "root": str(repo)}


@pytest.mark.parametrize("layout", ["packed", "detached", "worktree", "subdir", "unborn"])
def test_git_commit_is_read_like_git_reads_it(repo, layout, tmp_path):
    where, branch = repo, "main"
    if layout == "packed":
        _git(repo, "pack-refs", "--all")
        assert not (repo / ".git" / "refs" / "heads" / "main").exists()
    elif layout == "detached":
        _git(repo, "checkout", "-q", "--detach")
        branch = None
    elif layout == "worktree":  # .git is a file pointing to .git/worktrees/<name>
        where, branch = tmp_path / "wt", "feature"
        _git(repo, "worktree", "add", "-q", "-b", "feature", str(where))
        (where / "x").write_text("x")
        _git(where, "add", "x")
        _git(where, "commit", "-qm", "on the feature branch")
    elif layout == "subdir":
        where = repo / "a" / "b"
        where.mkdir(parents=True)
    elif layout == "unborn":
        _git(repo, "checkout", "-q", "--orphan", "fresh")
        branch = "fresh"
    info = git_info(where)
    want = None if layout == "unborn" else _git(where, "rev-parse", "HEAD")
    assert info["commit"] == want and info["branch"] == branch


def test_no_repository_or_a_broken_one_never_fails_a_save(repo, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    assert git_info(tmp_path / "outside") is None or git_info(outside)["root"] != str(outside)
    (repo / ".git" / "HEAD").write_text("garbage\n")
    _git_info_cached.cache_clear()
    assert git_info(repo) is None
    monkeypatch.chdir(repo)
    with CheckpointManager(tmp_path / "ck") as m:
        assert m.save(0, {"w": np.zeros(2)})
        assert "git" not in m.metadata(0).writer
    monkeypatch.setenv("MINICKPT_GIT", "0")
    assert git_info(repo) is None


def _meta(step, metrics=None, **custom):
    return CheckpointMetadata(step=step, items={}, metrics=metrics, custom_metadata=custom)


@pytest.mark.task("6.5")
def test_select_best_by_metric_mode_and_metadata():
    ms = [_meta(1, {"loss": 0.5, "eval": {"acc": 0.7}}, version="v1"),
          _meta(2, {"loss": 0.3, "eval": {"acc": 0.6}}, version="v1", config={"lr": 0.1}),
          _meta(3, {"loss": 0.4, "eval": {"acc": 0.9}}, version="v2", config={"lr": 0.01}),
          _meta(4, {"loss": float("nan")}, version="v2"),
          _meta(5, None, version="v2"),
          _meta(6, {"loss": "n/a"}, version="v2"),
          _meta(7, {"loss": 0.4}, version="v2", config={"lr": 0.01})]
    assert select_best(ms, "loss").step == 2
    assert select_best(ms, "eval.acc", mode="max").step == 3
    assert select_best(ms, "loss", where={"version": "v2"}).step == 7  # tie: the newer
    assert select_best(ms, "loss", where={"config.lr": 0.1}).step == 2
    assert select_best(ms, "loss", where={"version": lambda v: v >= "v2"}).step == 7
    assert select_best(ms, lambda m: m["loss"] * 2, where=lambda m: m.step < 3).step == 2
    assert select_best(ms, "loss", where={"version": "v3"}) is None
    with pytest.raises(ValueError, match="mode"):
        select_best(ms, "loss", mode="lowest")


@pytest.mark.task("6.5")
def test_a_non_finite_metric_never_wins_whatever_the_mode():
    """A usable value is a finite number: NaN, +inf and -inf are what a diverged run reports,
    and the manager's ``best_step`` never names such a checkpoint (chapter 2)."""
    inf = float("inf")
    ms = [_meta(0, {"loss": 0.5}), _meta(1, {"loss": -inf}), _meta(2, {"loss": 0.4}),
          _meta(3, {"loss": inf}), _meta(4, {"loss": float("nan")})]
    assert select_best(ms, "loss").step == 2
    assert select_best(ms, "loss", mode="max").step == 0
    assert select_best(ms, lambda m: m["loss"] * 10).step == 2
    assert select_best([m for m in ms if m.step in (1, 3, 4)], "loss") is None
    assert select_best([m for m in ms if m.step in (1, 3, 4)], "loss", mode="max") is None


@given(st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True, width=32),
                          st.sampled_from(["a", "b"])), max_size=12),
       st.sampled_from(["min", "max"]))
def test_select_best_is_no_worse_than_any_match(rows, mode):
    ms = [_meta(i, {"m": v}, tag=t) for i, (v, t) in enumerate(rows)]
    best = select_best(ms, "m", mode=mode, where={"tag": "a"})
    ok = [m for m in ms if m.custom_metadata["tag"] == "a" and np.isfinite(m.metrics["m"])]
    if not ok:
        assert best is None
        return
    sign = 1 if mode == "min" else -1
    assert best in ok
    assert all(sign * best.metrics["m"] <= sign * m.metrics["m"] for m in ok)


class NoArrays(FileSystem):
    """Fails any read of a data file: proves the choice reads metadata only."""

    def open(self, path, flags, mode=0o644):
        if path.endswith(".bin"):
            raise AssertionError(f"read an array file: {path}")
        return super().open(path, flags, mode)


@pytest.mark.task("6.5")
def test_best_checkpoint_reads_no_array(tmp_path):
    with CheckpointManager(tmp_path) as m:
        for s, (loss, version) in enumerate([(0.9, "v1"), (0.2, "v1"), (0.5, "v2"),
                                             (0.4, "v2")]):
            m.save(s, {"w": np.full((64,), s, np.float32)}, metrics={"loss": loss},
                   metadata={"version": version, "config": {"lr": 1e-3}})
    best = best_checkpoint(str(tmp_path), "loss", where={"version": "v2"}, fs=NoArrays())
    assert best.step == 3 and best.custom_metadata["version"] == "v2"
    with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True),
                           fs=NoArrays()) as m:
        assert best_checkpoint(m, "loss").step == 1


# ---------------------------------------------------------------------------------------
# migrating a real Flax checkpoint to a changed model
# ---------------------------------------------------------------------------------------
def _v2_state():
    """The new model: layers renamed (Dense_0 -> encoder, Dense_1 -> head) and a new
    per-output ``scale``, initialised to 1 so the migrated model computes what the old one
    did."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    from minickpt.demo import HIDDEN, IN_DIM, OUT_DIM

    class MLPv2(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.relu(nn.Dense(HIDDEN, name="encoder")(x))
            x = nn.Dropout(0.1, deterministic=not train)(x)
            y = nn.Dense(OUT_DIM, name="head")(x)
            return y * self.param("scale", nn.initializers.ones, (OUT_DIM,))

    model = MLPv2()
    params = model.init(jax.random.key(7), jnp.ones((1, IN_DIM)), train=False)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-2))


RENAME = {r"(.*)/Dense_0": r"\1/encoder", r"(.*)/Dense_1": r"\1/head"}


def test_migrate_a_flax_checkpoint_to_a_changed_model(tmp_path):
    from minickpt.demo import batch, make_state, train, train_step

    old, rng, _ = train(make_state(), jax.random.key(42), 0, 5)
    with CheckpointManager(tmp_path) as m:
        m.save(5, {"state": old, "rng": rng}, metadata={"version": "v1"})
        new = _v2_state()
        with pytest.raises(StructureMismatchError) as e:  # why a migration is needed
            m.restore(target={"state": new, "rng": rng})
        assert "params/params/encoder/kernel: in the target but not in the checkpoint" \
            in str(e.value)
        migrated, reports = migrate_checkpoint(m, {"state": new, "rng": rng}, rename=RENAME)
    st = migrated["state"]
    rep = reports["state"]
    assert sorted(rep.filled) == ["opt_state/0/mu/params/scale", "opt_state/0/nu/params/scale",
                          "params/params/scale"]
    assert rep.renamed["params/params/Dense_0/kernel"] == "params/params/encoder/kernel"
    assert len(rep.renamed) == 12 and rep.dropped == []  # params, Adam's mu and nu: 3 x 4
    # renamed leaves carry the old values, bit for bit; the new one keeps its init
    old_p, new_p = old.params["params"], st.params["params"]
    for a, b in (("Dense_0", "encoder"), ("Dense_1", "head")):
        for leaf in ("kernel", "bias"):
            assert np.asarray(new_p[b][leaf]).tobytes() == np.asarray(
                old_p[a][leaf]).tobytes()
            assert np.asarray(st.opt_state[0].mu["params"][b][leaf]).tobytes() == \
                np.asarray(old.opt_state[0].mu["params"][a][leaf]).tobytes()
    assert np.asarray(new_p["scale"]).tolist() == [1.0]
    assert int(st.step) == 5 and int(st.opt_state[0].count) == 5
    # the migrated model computes exactly what the old one did
    x, _ = batch(99)
    assert np.asarray(st.apply_fn(st.params, x, train=False)).tobytes() == np.asarray(
        old.apply_fn(old.params, x, train=False)).tobytes()
    # and it trains on: one more step works and moves the new parameter too
    st2, _, loss = train_step(st, migrated["rng"], *batch(6))
    assert np.isfinite(float(loss)) and int(st2.step) == 6
    assert np.asarray(st2.params["params"]["scale"]).tolist() != [1.0]
    # saved as a new version, it is the one a version filter picks
    with CheckpointManager(tmp_path / "v2") as m2:
        m2.save(5, {"state": st, "rng": migrated["rng"]}, metrics={"loss": float(loss)},
                metadata={"version": "v2", "migrated_from": str(tmp_path / "step_5")})
        assert best_checkpoint(m2, "loss", where={"version": "v2"}).step == 5
        back = m2.restore(target={"state": _v2_state(), "rng": rng})  # strict, now it fits
        assert back.step == 5


def test_migration_carries_typed_prng_keys_and_checks_them(tmp_path):
    from minickpt.restore import migrate

    with CheckpointManager(tmp_path) as m:
        m.save(0, {"s": {"rng": jax.random.key(3), "w": np.ones(2)}})
        saved = m.restore()["s"]  # without a target: keys come back as host keys
    out, _ = migrate(saved, {"rng": jax.random.key(0), "w": np.zeros(2)})
    assert (jax.random.key_data(out["rng"]) == jax.random.key_data(jax.random.key(3))).all()
    with pytest.raises(StructureMismatchError, match="rng: shape differs"):
        migrate(saved, {"rng": jax.random.split(jax.random.key(0), 2), "w": np.zeros(2)})
    with pytest.raises(StructureMismatchError, match="rng: kind differs"):
        migrate(saved, {"rng": np.zeros(2, np.uint32), "w": np.zeros(2)})
