"""Issue 32: minickpt used as a practitioner would — retention on an unreadable step, the
tiered resume loop, foreign directories, and the rough edges found on the way."""

import errno
import os
import warnings

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.faults import FaultyFileSystem

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


# ---- item 2: the tiered resume loop after a fallback ------------------------------------
def flip_a_byte(step_dir) -> None:
    path = os.path.join(step_dir, "params", "data.bin")
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_tiered_resume_loop_saves_again_a_step_damaged_in_both_tiers(tmp_path):
    from minickpt import Checkpointer
    from minickpt.production import TieredCheckpointManager

    local, mirror = tmp_path / "local", tmp_path / "mirror"
    o = CheckpointManagerOptions(max_to_keep=3)
    with TieredCheckpointManager(local, mirror, o) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))
        m.wait_until_mirrored()
    flip_a_byte(local / "step_2")
    flip_a_byte(mirror / "step_2")
    for attempt in range(2):  # every restart of the loop resumes, and saves step 2 again
        with TieredCheckpointManager(local, mirror, o) as m:
            with pytest.warns(UserWarning, match="step 2"):
                r = m.restore(target=tree())
            assert r.step == 1 + attempt
            if attempt == 0:
                assert m.save(2, tree(20))  # raised StepAlreadyExistsError
                m.wait_until_mirrored()
                assert m.all_steps() == [1, 2]
                flip_a_byte(local / "step_2")  # damaged locally again: the mirror has it
        if attempt == 0:
            aside = [n for n in os.listdir(local) if "minickpt-damaged" in n]
            assert len(aside) == 1 and aside[0].startswith("step_2")  # kept for a look
            assert Checkpointer().verify(mirror / "step_2").ok  # the new step reached it
    with TieredCheckpointManager(local, mirror, o) as m:
        assert float(m.restore(2)["params"]["w"][0, 0]) == 20.0


def _two_processes_saved_steps_1_and_2(tmp_path):
    """Two processes (LocalGroup threads) saved a row-sharded array as steps 1 and 2 in
    ``tmp_path``: (the sync module, the array's tree, the options)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from minickpt import MultiHostOptions
    from minickpt.multihost import sync as mh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("p", "l"))
    g = np.arange(32, dtype=np.float32).reshape(8, 4)
    w = {"w": jax.device_put(g, NamedSharding(mesh, P("p")))}
    o = CheckpointManagerOptions(multihost=MultiHostOptions(timeout_s=20))

    def save(sync):
        with CheckpointManager(tmp_path, o, sync=sync) as m:
            m.save(1, {"params": w})
            m.save(2, {"params": w})

    for r in mh.LocalGroup(2).run(save):
        assert not isinstance(r, BaseException), r
    return mh, w, o


def test_multihost_resume_loop_saves_again_a_damaged_step(tmp_path):
    """Every manager sets a damaged step aside: several processes too (LocalGroup threads)."""
    mh, w, o = _two_processes_saved_steps_1_and_2(tmp_path)
    data = tmp_path / "step_2" / "params" / "data.p1.bin"
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0xFF
    data.write_bytes(bytes(raw))

    def resume(sync):
        with CheckpointManager(tmp_path, o, sync=sync) as m:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = m.restore(target={"params": w})
            m.save(2, {"params": w})  # raised StepAlreadyExistsError on every process
            return r.step, m.all_steps()

    for r in mh.LocalGroup(2).run(resume):
        assert r == (1, [1, 2]), r
    assert any(n.startswith("step_2.minickpt-damaged-") for n in os.listdir(tmp_path))


# ---- item 6: keep the newest K and the best N in one manager ----------------------------
def test_keep_latest_keeps_the_newest_steps_besides_the_best(tmp_path):
    from minickpt import policy

    infos = [policy.StepInfo(s, {"loss": v}) for s, v in
             [(1, 0.1), (2, 0.2), (3, 0.5), (4, 0.6), (5, 0.7)]]
    best2 = dict(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    assert policy.steps_to_keep(infos, **best2) == {1, 2}  # Orbax's: the newest is gone
    assert policy.steps_to_keep(infos, **best2) | policy.newest_steps(infos, 2) == {1, 2, 4, 5}
    assert policy.steps_to_keep(infos, max_to_keep=2) | policy.newest_steps(infos, 3) \
        == {3, 4, 5}
    assert policy.newest_steps(infos, None) == set() == policy.newest_steps(infos, 0)
    with pytest.raises(ValueError, match="keep_latest"):
        CheckpointManagerOptions(keep_latest=-1)
    o = loss_opts(max_to_keep=2, keep_latest=1)
    with CheckpointManager(tmp_path, o) as m:  # a run whose validation loss rises
        for s, v in [(1, 0.1), (2, 0.2), (3, 0.5), (4, 0.6)]:
            m.save(s, tree(s), metrics={"loss": v})
            assert m.latest_step() == s  # the step to resume from is always there
        assert m.all_steps() == [1, 2, 4] and m.best_step() == 1
        assert m.restore().step == 4


def test_tiered_keep_latest_applies_to_both_tiers(tmp_path):
    from minickpt.production import TieredCheckpointManager

    o = loss_opts(max_to_keep=1, keep_latest=1)
    with TieredCheckpointManager(tmp_path / "l", tmp_path / "m", o) as m:
        for s, v in [(1, 0.1), (2, 0.5), (3, 0.6)]:
            m.save(s, tree(s), metrics={"loss": v})
            m.wait_until_mirrored()
        assert m.mirror_steps() == [1, 3]
        assert m.local.all_steps(read=True) == [1, 3]


# ---- rough edges ---------------------------------------------------------------------------
def test_inspect_needs_only_the_manifest(tmp_path, capsys):
    from minickpt.cli import main as cli

    with CheckpointManager(tmp_path) as m:
        m.save(1, {"a": {"x": np.arange(100.0), "n": 3}})
    os.truncate(tmp_path / "step_1" / "a" / "data.bin", 10)
    assert cli(["inspect", str(tmp_path)]) == 1  # damage found is still exit 1 ...
    out = capsys.readouterr()
    assert "x" in out.out and "float64" in out.out and "(100,)" in out.out  # ... shown anyway
    assert "truncated" in out.out + out.err


def test_a_writable_manager_on_a_read_only_mount_says_read_only_true(tmp_path):
    class ReadOnlyMount(FaultyFileSystem):
        def open(self, path, flags, mode=0o644):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            return super().open(path, flags, mode)

    with CheckpointManager(tmp_path) as m:
        m.save(1, tree(1))
    with pytest.raises(OSError, match="read_only=True") as e:
        CheckpointManager(tmp_path, fs=ReadOnlyMount())
    assert e.value.errno == errno.EROFS
    with CheckpointManager(tmp_path, CheckpointManagerOptions(read_only=True),
                           fs=ReadOnlyMount()) as m:
        assert m.restore().step == 1


def test_restore_into_an_empty_target_is_an_error(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, tree(1))
        with pytest.raises(ValueError, match="empty"):
            m.restore(target={})
        assert set(m.restore(target=None)) == {"params"}


@pytest.mark.parametrize("bad", ["nan", "0.5", b"1"])
def test_a_metric_that_is_a_string_is_refused(tmp_path, bad):
    with CheckpointManager(tmp_path, loss_opts(max_to_keep=1)) as m:
        with pytest.raises(TypeError, match="loss"):
            m.save(1, tree(1), metrics={"loss": bad})
        assert m.all_steps() == []
        m.save(1, tree(1), metrics={"loss": 0.5, "note": "nan"})  # other strings are fine
    from minickpt import policy
    info = policy.StepInfo(1, {"loss": "nan"})
    assert policy.rank_by_metric([info], lambda m: m["loss"]) == []  # "no metric"


# ---- item 5: a dead primary (it hosts JAX's coordination service) -------------------------
class _DeadCoordinator:
    """What JAX's client raises once process 0, and the service with it, is gone (from
    the call ``dies_at`` on: the write, the barrier, or the read after the barrier)."""

    def __init__(self, dies_at: str):
        self.dead = False
        self.dies_at = dies_at

    def _call(self, name, result=None):
        if name == self.dies_at:
            self.dead = True
        if self.dead:
            raise RuntimeError("UNAVAILABLE: recvmsg: Connection reset by peer")
        return result

    def key_value_set(self, *a, **kw):
        return self._call("set")

    def wait_at_barrier(self, *a, **kw):
        return self._call("barrier")

    def key_value_dir_get(self, *a, **kw):
        return self._call("read", [])


@pytest.mark.parametrize("dies_at", ["set", "barrier", "read"])
def test_a_dead_primary_is_named_not_a_raw_grpc_error(dies_at):
    from minickpt.errors import PeerTimeoutError
    from minickpt.multihost.sync import DistributedSync, Sync

    s = DistributedSync.__new__(DistributedSync)
    Sync.__init__(s)
    s._coord = type("C", (), {"client": _DeadCoordinator(dies_at)})()
    s.process_index, s.process_count, s._recent = 1, 2, []
    with pytest.raises(PeerTimeoutError, match="process 0 hosts JAX's coordination service") \
            as e:
        s.exchange("op/x", 1, 5.0, "save of step 5: writing")
    assert e.value.missing == [0] and "save of step 5" in str(e.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_primary_killed_mid_save_real_processes(tmp_path):
    """Real processes: process 0 dies after writing its shards. The survivor either raises
    the library's error naming process 0 (it reports it and leaves with hard_exit: 3), or
    is terminated by JAX's client first (see minickpt/multihost/coordinator.py); never a raw
    gRPC error, and nothing is committed."""
    from minickpt.launch import launch
    from minickpt.multihost import process as mhp

    here = os.path.dirname(os.path.abspath(__file__))
    r = launch([os.path.join(here, "mh_worker.py"), "kill", str(tmp_path)], 2,
               devices_per_process=1, timeout_s=150, grace_s=30, cwd=here,
               env={"MH_TIMEOUT": "20", mhp.ENV_FAULT: "after_write@0:kill"})
    out = "\n".join(r.outputs[1])
    assert r.returncodes[0] == -9, r.output()
    assert "JaxRuntimeError" not in out, out
    results = r.reports()[1]
    if r.returncodes[1] == 3:
        res = results[0]
        assert res["missing"] == [0] and "coordination service" in res["error"]
        assert res["after_s"] < 15  # at once, not after the time-out
    else:
        assert "Terminating process" in out, out
    assert not [n for n in os.listdir(tmp_path) if n.startswith("step_5") and "tmp" not in n]


# ---- the rest of item 1's kind: an I/O error on restore is raised, never a fallback -----
def _eio_reading(step_dir) -> FaultyFileSystem:
    """EIO on every read of one step's data files (a persistent bad sector)."""
    prefix = os.path.join(str(step_dir), "")

    def hit(op, args):
        return op == "open" and str(args[0]).startswith(prefix) and "data" in \
            os.path.basename(str(args[0]))

    return FaultyFileSystem(0, when=hit, persistent=True)


def test_tiered_restore_raises_an_io_error_instead_of_skipping_the_step(tmp_path):
    from minickpt.production import TieredCheckpointManager

    local, mirror = tmp_path / "local", tmp_path / "mirror"
    o = CheckpointManagerOptions(max_to_keep=3)
    with TieredCheckpointManager(local, mirror, o) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))
        m.wait_until_mirrored()
    import shutil

    shutil.rmtree(mirror / "step_2")  # not mirrored (yet): the local copy is the only one
    from minickpt.production.tiered import MirrorError

    lfs = _eio_reading(local / "step_2")
    m = TieredCheckpointManager(local, mirror, o, fs=lfs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError) as e:
            m.restore(target=tree())  # returned step 1, as if step 2 were damaged
        with pytest.raises(MirrorError, match="step 2"):  # it cannot be read to be mirrored
            m.close()
    assert e.value.errno == errno.EIO
    assert os.path.isdir(local / "step_2")  # not moved aside: nothing says it is damaged


def test_multihost_restore_raises_an_io_error_instead_of_falling_back(tmp_path):
    mh, w, o = _two_processes_saved_steps_1_and_2(tmp_path)

    def resume(sync):
        fs = _eio_reading(tmp_path / "step_2") if sync.process_index == 1 else None
        with CheckpointManager(tmp_path, o, sync=sync, fs=fs) as m:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return m.restore(target={"params": w}).step  # was 1: a fallback past EIO

    results = mh.LocalGroup(2).run(resume)
    assert all(isinstance(r, BaseException) for r in results), results
    assert "EIO" in str(results[1]) or "Input/output" in str(results[1]), results
    assert os.path.isdir(tmp_path / "step_2")
