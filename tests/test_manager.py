"""CheckpointManager: saving by policy, retention, strict restore, fallback, metadata."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

from minickpt import (
    CheckpointCorruptedError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointNotFoundError,
    MiniCkptError,
    StepAlreadyExistsError,
    StructureMismatchError,
)


def opts(**kw):
    return CheckpointManagerOptions(**kw)


def state(v=0.0):
    return {"w": jnp.full((2, 3), v), "b": jnp.zeros(3, jnp.bfloat16), "step": 0}


def test_save_restore_latest_and_all_steps(tmp_path, small_tree):
    with CheckpointManager(tmp_path, opts()) as m:
        assert m.latest_step() is None and m.all_steps() == []
        for s in (0, 1, 2):
            assert m.save(s, {"s": small_tree, "extra": {"x": np.float64(s)}})
        assert m.all_steps() == [0, 1, 2] and m.latest_step() == 2
        r = m.restore(target={"s": small_tree, "extra": {"x": np.float64(0)}})
        assert r.step == 2 and tree_equal(r["s"], small_tree) and r["extra"]["x"] == 2.0
        assert set(m.restore(0)) == {"s", "extra"}
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock", "step_0", "step_1", "step_2"]


def test_save_interval_and_save_on_steps(tmp_path):
    with CheckpointManager(tmp_path, opts(save_interval_steps=5, save_on_steps=[7])) as m:
        saved = [s for s in range(0, 16) if m.save(s, {"s": state()})]
    assert saved == [0, 5, 7, 10, 15]


def test_force_saves_off_interval_but_never_replaces(tmp_path):
    with CheckpointManager(tmp_path, opts(save_interval_steps=10)) as m:
        assert m.save(0, {"s": state()})  # the first save always happens (Orbax's rule)
        assert not m.save(3, {"s": state()})
        assert m.save(3, {"s": state()}, force=True)
        with pytest.raises(StepAlreadyExistsError, match="step 3"):
            m.save(3, {"s": state(1.0)}, force=True)
        assert float(m.restore(3)["s"]["w"][0, 0]) == 0.0


def test_first_save_happens_whatever_the_interval(tmp_path):
    with CheckpointManager(tmp_path, opts(save_interval_steps=10)) as m:
        assert m.should_save(3) and m.save(3, {"s": state()})  # Orbax's rule too
        assert not m.should_save(4) and m.should_save(10)


def test_max_to_keep_deletes_oldest_after_commit(tmp_path):
    with CheckpointManager(tmp_path, opts(max_to_keep=2, keep_period=4)) as m:
        for s in range(9):
            m.save(s, {"s": state(s)})
        assert m.all_steps() == [0, 4, 7, 8]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step")) == \
        ["step_0", "step_4", "step_7", "step_8"]


def test_best_n_by_metric(tmp_path):
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.8}
    o = opts(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with CheckpointManager(tmp_path, o) as m:
        for s, loss in losses.items():
            m.save(s, {"s": state()}, metrics={"loss": loss})
        assert m.all_steps() == [2, 4] and m.best_step() == 4
    # a fresh manager sees the same metrics from disk
    with CheckpointManager(tmp_path, o) as m:
        assert m.best_step() == 4 and m.metadata(2).metrics == {"loss": 0.3}


def test_metadata_without_loading_arrays(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(10, {"s": state()}, metrics={"acc": 0.5},
               metadata={"version": "v2", "config": {"lr": 1e-3}})
        md = m.metadata(10)
        assert md.step == 10 and md.metrics == {"acc": 0.5}
        assert md.custom_metadata == {"version": "v2", "config": {"lr": 1e-3}}
        assert md.time is not None and md.bytes > 0
        assert m.item_metadata(10)["s"]["w"] == ("float32", [2, 3])
        assert m.item_metadata(10)["s"]["step"] == ("int", None)
        with pytest.raises(TypeError, match="JSON"):
            m.save(11, {"s": state()}, metadata={"bad": object()})
        assert m.all_steps() == [10]


def test_item_metadata_keeps_a_slash_key_apart_from_a_nested_path(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": {"a/b": np.ones(2, np.float32), "a": {"b": np.zeros(3, np.int8)},
                         "l": [np.ones(1, np.float64)]}})
        md = m.item_metadata(1)["s"]
        assert md == {"a/b": ("float32", [2]), "a": {"b": ("int8", [3])},
                      "l": [("float64", [1])]}, \
            "item_metadata must be shaped like the restored tree, one entry per leaf"


def test_strict_restore_names_every_mismatch(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": {"w": jnp.ones((2, 3)), "b": jnp.ones(3), "old": jnp.ones(1)}})
        target = {"w": jnp.ones((3, 2)), "b": jnp.ones(3, jnp.float16), "new": jnp.ones(1)}
        with pytest.raises(StructureMismatchError) as e:
            m.restore(target={"s": target})
        msg = str(e.value)
        for needle in ["w: shape", "(2, 3)", "b: dtype", "float16", "new: in the target",
                       "old: in the checkpoint"]:
            assert needle in msg, msg
        assert len(e.value.mismatches) == 4


def test_strict_restore_never_casts_a_scalar(tmp_path):
    big = 2**53 + 1  # not a float64
    saved = {"big": big, "flag": np.bool_(True), "u": np.uint8(7), "h": np.float16(0.5),
             "i8": np.int8(3), "x": 1.5, "step": jnp.int32(4), "loss": jnp.float32(0.25),
             "arr": np.int32(2)}
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": saved})
        target = {"big": 0.0, "flag": 0, "u": 0, "h": 0.0, "i8": 0, "x": 0, "step": 0,
                  "loss": 0.0, "arr": np.int64(0)}
        with pytest.raises(StructureMismatchError) as e:
            m.restore(target={"s": target})
        msg = str(e.value)
        assert {x.path for x in e.value.mismatches} == {"big", "flag", "u", "h", "i8", "x",
                                                         "arr"}, msg
        for needle in ["big: type", "flag: dtype", "bool", "u: dtype", "uint8", "h: dtype",
                       "float16", "arr: dtype", "int64"]:
            assert needle in msg, msg
        # the same kinds restore, exactly: a jitted int32 step into a Python int is no cast
        same = {"big": 0, "flag": False, "u": np.uint8(0), "h": np.float16(0), "i8": np.int8(0),
                "x": 0.0, "step": 0, "loss": 0.0, "arr": np.int32(0)}
        r = m.restore(target={"s": same})["s"]
        assert r["big"] == big and type(r["big"]) is int
        assert r["flag"] is True and r["step"] == 4 and type(r["step"]) is int
        assert r["loss"] == 0.25 and type(r["loss"]) is float


def test_partial_restore_takes_a_subset_on_purpose(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": {"w": jnp.ones(2), "b": jnp.zeros(2)}})
        with pytest.raises(StructureMismatchError):
            m.restore(target={"s": {"w": jnp.zeros(2)}})
        r = m.restore(target={"s": {"w": jnp.zeros(2)}}, partial=True)
        assert list(r["s"]) == ["w"] and float(r["s"]["w"][0]) == 1.0
        with pytest.raises(StructureMismatchError, match="missing|in the target"):
            m.restore(target={"s": {"w": jnp.zeros(2), "z": jnp.zeros(2)}}, partial=True)


def test_restore_shape_dtype_structs_with_sharding(tmp_path):
    mesh = jax.make_mesh((4,), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    x = jax.device_put(jnp.arange(16.0), sh)
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"s": {"x": x}})
        target = {"x": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=sh)}
        r = m.restore(target={"s": target})["s"]["x"]
        assert r.sharding == sh and np.array_equal(np.asarray(r), np.arange(16.0))
        one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
        r2 = m.restore(sharding=one)["s"]["x"]
        assert r2.sharding == one


def test_fallback_to_newest_valid_checkpoint(tmp_path):
    with CheckpointManager(tmp_path) as m:
        for s in (1, 2, 3):
            m.save(s, {"s": state(float(s))})
        data = tmp_path / "step_3" / "s" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[3] ^= 1
        data.write_bytes(bytes(raw))
        with pytest.raises(CheckpointCorruptedError, match=r"step_3.*leaf b"):
            m.restore(3)
        with pytest.raises(CheckpointCorruptedError):
            m.restore(fallback=False)
        with pytest.warns(UserWarning, match="skipping damaged checkpoint step 3"):
            r = m.restore()
        assert r.step == 2 and float(r["s"]["w"][0, 0]) == 2.0
        # skipped, it was moved aside (kept for a person), so step 3 can be saved again
        assert m.all_steps(read=True) == [1, 2]
        assert [n for n in os.listdir(tmp_path) if n.startswith("step_3.minickpt-damaged-")]
        m.save(3, {"s": state(3.0)})
        assert m.restore().step == 3


def test_structure_mismatch_never_falls_back(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": state()})
        m.save(2, {"s": state()})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(StructureMismatchError):
                m.restore(target={"s": {"w": jnp.ones(1)}})


def test_errors_for_missing_things(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        CheckpointManager(tmp_path / "nope", opts(read_only=True))
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        CheckpointManager(tmp_path / "nope", opts(create=False))
    with CheckpointManager(tmp_path / "run") as m:
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
            m.restore()
        m.save(5, {"s": state()})
        with pytest.raises(CheckpointNotFoundError, match=r"step 4 .*steps: \[5\]"):
            m.restore(4)
        with pytest.raises(KeyError, match="no item"):
            m.restore(5, target={"params": state()})
        with pytest.raises(ValueError, match="non-negative"):
            m.save(-1, {"s": state()})
        with pytest.raises(ValueError, match="not allowed"):
            m.save(6, {"../evil": state()})


def test_delete_reload_and_read_only(tmp_path):
    with CheckpointManager(tmp_path) as m:
        for s in (1, 2, 3):
            m.save(s, {"s": state()})
        m.delete(2)
        assert m.all_steps() == [1, 3]
    ro = CheckpointManager(tmp_path, opts(read_only=True))
    assert ro.all_steps() == [1, 3]
    with pytest.raises(MiniCkptError, match="read_only"):
        ro.save(4, {"s": state()})
    with CheckpointManager(tmp_path) as w:
        w.save(4, {"s": state()})
    assert ro.all_steps() == [1, 3]
    ro.reload()
    assert ro.all_steps() == [1, 3, 4]


def test_two_writers_on_one_directory_are_refused(tmp_path):
    m = CheckpointManager(tmp_path)
    with pytest.raises(MiniCkptError, match="this process already holds"):
        CheckpointManager(tmp_path)  # another process: see test_crash_processes
    m.close()
    CheckpointManager(tmp_path).close()  # released on close


def test_stale_temporaries_are_cleaned_at_startup(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"s": state()})
    (tmp_path / "step_2.minickpt-tmp-dead").mkdir()
    (tmp_path / "step_2.minickpt-tmp-dead" / "junk").write_text("x")
    (tmp_path / "step_0.minickpt-del-dead").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    with CheckpointManager(tmp_path) as m:
        assert m.all_steps() == [1]
        assert sorted(m.removed_temporaries) == ["step_0.minickpt-del-dead",
                                                  "step_2.minickpt-tmp-dead"]
    assert (tmp_path / "notes.txt").exists()


def test_step_prefix_and_fixed_length(tmp_path):
    o = opts(step_prefix="ckpt", step_format_fixed_length=6)
    with CheckpointManager(tmp_path, o) as m:
        m.save(42, {"s": state()})
        assert (tmp_path / "ckpt_000042").is_dir() and m.all_steps() == [42]
    with CheckpointManager(tmp_path, opts(step_prefix=None)) as m:
        m.save(7, {"s": state()})
        assert (tmp_path / "7").is_dir() and m.all_steps() == [7]


def test_save_stats_are_recorded(tmp_path):
    events = []
    with CheckpointManager(tmp_path) as m:
        m.listeners.append(lambda ev, rec: events.append((ev, rec)))
        m.save(1, {"s": {"x": np.ones(1000)}})
        st = m.last_save_stats
        assert st.ok and st.bytes == 8000 and st.total_s > 0 and st.fsync_s > 0
        m.restore()
    assert [e for e, _ in events] == ["save", "restore"]


def test_a_directory_another_process_creates_meanwhile_is_used(tmp_path):
    """Every process of a job opens the same run directory; one may create it between this
    process's two looks at it. That is a directory, not "a file in the way"."""
    from minickpt.fs import FileSystem

    run = tmp_path / "run"

    class OtherProcessMakesIt(FileSystem):
        first = True

        def lstat(self, path):
            if self.first and path == str(run):
                self.first = False
                os.mkdir(run)  # the other process, just after this one looked
                raise FileNotFoundError(path)
            return super().lstat(path)

    with CheckpointManager(run, fs=OtherProcessMakesIt()) as m:
        assert m.save(1, {"s": state()})
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        CheckpointManager(tmp_path / "file")


@pytest.mark.parametrize("name", ["_CHECKPOINT_METADATA", "_checkpoint_metadata"])
def test_reserved_item_names_are_refused_before_anything_is_written(tmp_path, name):
    from minickpt import Checkpointer

    with pytest.raises(ValueError, match="reserved"):
        Checkpointer().save(tmp_path / "ck", {name: {"w": np.ones(2)}})
    assert not (tmp_path / "ck").exists() and os.listdir(tmp_path) == []
    with CheckpointManager(tmp_path / "run") as m:
        with pytest.raises(ValueError, match=f"item name '{name}' is reserved"):
            m.save(1, {"params": {"w": np.ones(2)}, name: {"x": 1}})
        assert m.all_steps() == [] and os.listdir(tmp_path / "run") == [".minickpt.lock"]


@pytest.mark.parametrize("kw", [{}, {"enable_async_checkpointing": True},
                                {"enable_background_delete": True, "max_to_keep": 1}],
                         ids=["sync", "async", "background-delete"])
def test_no_minickpt_thread_outlives_close(tmp_path, kw):
    import threading

    def ours():
        return {t for t in threading.enumerate() if t.name.startswith("minickpt")}

    before = ours()
    m = CheckpointManager(tmp_path, opts(**kw))
    for s in range(3):  # two items: several files and directories to fsync together
        m.save(s, {"a": {"w": jnp.ones(100), "b": np.ones(3)}, "b": {"x": np.ones(2)}})
    m.restore(target={"a": {"w": jnp.ones(100), "b": np.ones(3)}, "b": {"x": np.ones(2)}})
    m.verify()
    m.close()
    left = ours() - before
    fsync = [t.name for t in threading.enumerate() if t.name.startswith("minickpt-fsync")]
    assert not left and not fsync, f"threads left running after close(): {left or fsync}"


def test_a_second_manager_in_this_process_is_told_plainly_or_takes_over(tmp_path):
    first = CheckpointManager(tmp_path)
    first.save(1, {"s": {"w": np.ones(2)}})
    with pytest.raises(MiniCkptError, match="this process already holds") as e:
        CheckpointManager(tmp_path)  # a notebook cell run again, the first still alive
    assert "close()" in str(e.value) and "another CheckpointManager is writing" not in str(e.value)
    with CheckpointManager(tmp_path, opts(read_only=True)) as reader:  # reading is fine
        assert reader.all_steps() == [1]
    first.close()
    second = CheckpointManager(tmp_path)  # the first one closed: allowed, as in Orbax
    assert second.all_steps() == [1]
    second.me = second  # a cycle: only the collector frees it
    del second
    third = CheckpointManager(tmp_path)  # the second one is garbage: allowed too
    third.save(2, {"s": {"w": np.ones(2)}})
    assert third.all_steps() == [1, 2]
    third.close()
