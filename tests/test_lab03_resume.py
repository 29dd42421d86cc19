"""Lab 3's tasks as library behaviour: 3.2 strict structure checks, 3.3 resume, 3.4 migration
(3.1, the fallback, is in test_resume.py with the manager's bugs it fixed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minickpt import CheckpointManager, StructureMismatchError, labkit
from minickpt.demo import make_state, train
from minickpt.restore import check_structure, migrate, resume

NAMES = ["a", "b", "c", "d", "e"]


@pytest.mark.task("3.2")
@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["same", "missing", "unexpected", "shape", "dtype"]),
                min_size=5, max_size=5), st.booleans())
def test_every_mismatch_is_listed_in_one_error(changes, partial):
    saved = {n: np.zeros(3, np.float32) for n in NAMES}
    target, want = {}, set()
    for n, c in zip(NAMES, changes, strict=True):
        if c == "same":
            target[n] = np.zeros(3, np.float32)
        elif c == "missing":  # in the target only
            target[n + "_new"] = np.zeros(3, np.float32)
            want.add((n + "_new", "missing"))
            if not partial:
                want.add((n, "unexpected"))
        elif c == "unexpected":  # in the checkpoint only
            if not partial:
                want.add((n, "unexpected"))
        elif c == "shape":
            target[n] = np.zeros(4, np.float32)
            want.add((n, "shape"))
        else:
            target[n] = np.zeros(3, np.float16)
            want.add((n, "dtype"))
    manifest = labkit.lab3_manifest(saved, "s")
    if not want:
        pairs = check_structure(manifest, target, item="s", partial=partial)
        assert [n for n, _ in pairs] == [(n,) for n in sorted(target)]
        return
    with pytest.raises(StructureMismatchError) as err:
        check_structure(manifest, target, item="s", partial=partial)
    assert {(m.path, m.kind) for m in err.value.mismatches} == want


@pytest.mark.task("3.3")
def test_resume_fresh_then_at_t_ckpt_plus_one(tmp_path):
    fresh, key = make_state(), jax.random.key(42)
    with CheckpointManager(tmp_path) as m:
        assert resume(m, fresh, key) == (fresh, key, 1)
        state, rng, _ = train(fresh, key, 0, 6)
        m.save(6, {"state": state, "rng": rng})
        s, k, first = resume(m, fresh, key)
    assert first == 7 and int(s.step) == 6  # into a Python-int step, as make_state has
    assert labkit.tree_diff((s.params, s.opt_state, k), (state.params, state.opt_state, rng)) is None
    with CheckpointManager(tmp_path) as m:
        m.save(8, {"state": state, "rng": rng})  # step 6's state under step 8's name
        with pytest.raises(ValueError, match=r"step 8 .*step counter is 6"):
            resume(m, fresh, key)


@pytest.mark.task("3.3")
def test_the_drill_runs_the_students_resume_in_a_killed_process():
    from minickpt.restore import resume as ref

    out = labkit.lab3_drill(ref, steps=15, every=5, kill_after=[8, 12])
    runs = out["runs"]
    assert [r["killed_after"] for r in runs] == [8, 12, None] and runs[-1]["rc"] == 0, out
    assert [r["rc"] for r in runs[:2]] == [-9, -9], out
    assert runs[1]["on_disk"] == runs[1]["resumed_from"] == 5, out
    assert runs[2]["on_disk"] == runs[2]["resumed_from"] == 10, out
    assert runs[2]["steps"] == list(range(11, 16)) and out["diff"] is None, out
    # lockstep: nothing ran past the step it was killed after, however slow this reader was
    assert runs[0]["steps"] == list(range(1, 9)) and runs[1]["steps"] == list(range(6, 13)), out
    assert labkit.drill_message(out) is None


@pytest.mark.task("3.3")
def test_the_drill_message_names_what_a_wrong_resume_did():
    """drill_message on the records of wrong resumes (no processes: the records as the drill
    makes them)."""
    def record(runs, diff=None):
        return {"steps": 15, "every": 5, "runs": runs, "diff": diff}

    killed = {"on_disk": None, "resumed_from": 0, "steps": list(range(1, 9)), "killed_after": 8,
              "rc": -9, "err": ""}
    at_t_ckpt = {"on_disk": 5, "resumed_from": 4, "steps": [5], "killed_after": None, "rc": 1,
                 "err": "minickpt.errors.StepAlreadyExistsError: step 5 exists"}
    assert "t_ckpt + 1" in labkit.drill_message(record([killed, at_t_ckpt]))
    scratch = {"on_disk": 5, "resumed_from": 0, "steps": list(range(1, 16)), "killed_after": None,
               "rc": 0, "err": ""}
    assert "started from scratch" in labkit.drill_message(record([killed, scratch]))
    fine = {"on_disk": 5, "resumed_from": 5, "steps": list(range(6, 16)), "killed_after": None,
            "rc": 0, "err": ""}
    msg = labkit.drill_message(record([killed, fine], diff="state/opt_state/0/mu: values differ"))
    assert "Adam's moments" in msg and "opt_state" in msg
    assert labkit.drill_message(record([killed, fine])) is None
    # a restart that finds the last step committed has nothing to compute: that is right
    done = {"on_disk": 15, "resumed_from": 15, "steps": [], "killed_after": None, "rc": 0,
            "err": ""}
    late = {**killed, "steps": list(range(1, 16)), "killed_after": 15}
    assert labkit.drill_message(record([late, done])) is None
    # a checkpoint of a step the killed worker never reached was written ahead of time
    assert "had not computed yet" in labkit.drill_message(record([killed, done]))
    idle = {"on_disk": 10, "resumed_from": 10, "steps": [], "killed_after": None, "rc": 0,
            "err": ""}
    assert "expected [11]" in labkit.drill_message(record([{**killed, "killed_after": 12}, idle]))


@pytest.mark.task("3.4")
def test_migration_carries_parameters_and_optimizer_state(tmp_path):
    old, _, _ = train(make_state(), jax.random.key(42), 0, 5)
    with CheckpointManager(tmp_path) as m:
        m.save(5, {"state": old})
        saved = m.restore()["state"]
    new = labkit.lab3_new_state()
    got, report = migrate(saved, new, rename={"(.*)/Dense_0": r"\1/encoder",
                                              "(.*)/Dense_1": r"\1/head"})
    assert np.array_equal(got.opt_state[0].nu["params"]["head"]["kernel"],
                          old.opt_state[0].nu["params"]["Dense_1"]["kernel"])
    assert int(got.step) == 5 and not report.dropped
    assert sorted(report.filled) == sorted(f"{p}/params/adapter/{w}" for p in
                                           ("params", "opt_state/0/mu", "opt_state/0/nu")
                                           for w in ("bias", "kernel"))
    with pytest.raises(StructureMismatchError) as err:
        migrate(saved, labkit.lab3_new_state(dtype=jnp.bfloat16),
                rename={"(.*)/Dense_0": r"\1/encoder", "(.*)/Dense_1": r"\1/head"})
    assert len(err.value.mismatches) == 12


@pytest.mark.task("3.4")
def test_migration_never_drops_silently_and_its_hint_names_the_knobs(tmp_path):
    """Two saved leaves renamed onto one path are a "duplicate" problem (taking either would
    drop the other silently); a leaf renamed onto no target leaf is dropped under its saved
    path; the hint names the rename rules, and allow_cast / fill_missing where they apply."""
    old, _, _ = train(make_state(), jax.random.key(42), 0, 2)
    with CheckpointManager(tmp_path) as m:
        m.save(2, {"state": old})
        saved = m.restore()["state"]
    new = labkit.lab3_new_state()
    with pytest.raises(StructureMismatchError) as err:
        migrate(saved, new, rename={"(.*)/Dense_[01]": r"\1/encoder"})
    assert sorted(m.path for m in err.value.mismatches) == sorted(
        f"{p}/params/encoder/{w}" for p in ("params", "opt_state/0/mu", "opt_state/0/nu")
        for w in ("bias", "kernel"))
    assert {m.kind for m in err.value.mismatches} == {"duplicate"}
    assert "Dense_0/kernel and " in str(err.value) and "rename" in str(err.value)
    _, report = migrate(saved, new, rename={"(.*)/Dense_0": r"\1/encoder",
                                            "(.*)/Dense_1": r"\1/old_head"})
    assert "params/params/Dense_1/kernel" in report.dropped
    assert not any("old_head" in p for p in report.dropped)
    with pytest.raises(StructureMismatchError) as err:
        migrate(saved, labkit.lab3_new_state(dtype=jnp.bfloat16), fill_missing=False,
                rename={"(.*)/Dense_0": r"\1/encoder", "(.*)/Dense_1": r"\1/head"})
    assert "allow_cast=True" in str(err.value) and "fill_missing=True" in str(err.value)
    with pytest.raises(StructureMismatchError) as err:
        migrate(saved, new, fill_missing=False,
                rename={"(.*)/Dense_0": r"\1/encoder", "(.*)/Dense_1": r"\1/head"})
    assert "fill_missing=True" in str(err.value) and "allow_cast" not in str(err.value)
