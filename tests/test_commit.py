"""The atomic durable commit: an error or a crash at any single file-system call of a save
leaves either the old set of checkpoints or the new one — never a torn one."""

import errno
import os

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions, StepAlreadyExistsError
from minickpt.commit import (
    cleanup_temporaries,
    commit,
    delete_dir,
    is_temporary,
    make_temporary,
    parse_step,
    step_dir_name,
)
from minickpt.faults import FaultyFileSystem, SimulatedCrash
from minickpt.fs import FileSystem

FS = FileSystem()


def items(v):
    return {"params": {"w": np.full((64,), v, np.float32), "b": np.arange(3)},
            "meta": {"lr": 0.1, "tag": f"v{v}"}}


def check_consistent(root, allowed):
    """A fresh manager sees only complete checkpoints, each restoring to what was saved."""
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2)) as m:
        steps = m.all_steps()
        assert tuple(steps) in allowed, steps
        for s in steps:
            assert m.verify(s).ok
            r = m.restore(s)
            assert float(r["params"]["w"][0]) == s and r["meta"]["tag"] == f"v{s}"
    assert not [n for n in os.listdir(root) if is_temporary(n)]


def count_calls(tmp_path):
    fs = FaultyFileSystem()
    root = tmp_path / "count"
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=fs) as m:
        m.save(1, items(1))
        m.save(2, items(2))
        start = fs.count
        m.save(3, items(3))
        return fs.count - start


@pytest.mark.filterwarnings("ignore:could not delete old checkpoint")
@pytest.mark.parametrize("crash", [False, True], ids=["error", "crash"])
def test_fault_at_every_call_of_a_save(tmp_path, crash):
    n = count_calls(tmp_path)
    assert n > 20  # the save and its retention really go through the layer
    for k in range(n):
        root = tmp_path / f"{'crash' if crash else 'err'}{k}"
        fs = FaultyFileSystem(error=OSError(errno.ENOSPC, "No space left on device"),
                              crash=crash)
        m = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=fs)
        m.save(1, items(1))
        m.save(2, items(2))
        fs.fail_at = fs.count + k
        try:
            m.save(3, items(3))
        except OSError as e:
            assert e.errno == errno.ENOSPC  # the original error, errno intact
        except SimulatedCrash:
            pass
        m._release_lock()
        # old pair, new pair, or (fault during retention) all three
        check_consistent(root, {(1, 2), (2, 3), (1, 2, 3)})


def test_names_never_confuse_temporaries_with_checkpoints():
    assert step_dir_name(5) == "step_5" and parse_step("step_5") == 5
    assert step_dir_name(5, None) == "5" and parse_step("5", None) == 5
    assert step_dir_name(5, "step", 4) == "step_0005" and parse_step("step_0005") == 5
    for name in ["step_5.minickpt-tmp-1a2b", "step_5.minickpt-del-1a2b", "step_x", "step_",
                 ".step_5", "step_5 ", "xstep_5"]:
        assert parse_step(name) is None, name
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_commit_never_replaces_an_existing_directory(tmp_path):
    (tmp_path / "step_1").mkdir()  # even an empty one (POSIX rename would replace it)
    tmp = make_temporary(FS, str(tmp_path), "step_1")
    with pytest.raises(StepAlreadyExistsError):
        commit(FS, tmp, str(tmp_path / "step_1"))
    assert os.path.isdir(tmp)


def test_delete_is_rename_then_remove(tmp_path):
    d = tmp_path / "step_1"
    (d / "a").mkdir(parents=True)
    (d / "a" / "f").write_text("x")
    fs = FaultyFileSystem(crash=True, ops={"unlink"}, fail_at=0)
    with pytest.raises(SimulatedCrash):
        delete_dir(fs, str(d))
    # crashed half-way through removing files: the step name is already gone
    assert not d.exists()
    assert cleanup_temporaries(FS, str(tmp_path)) and os.listdir(tmp_path) == []


def test_rmtree_does_not_follow_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    d = tmp_path / "step_1"
    d.mkdir()
    (d / "link").symlink_to(outside)
    delete_dir(FS, str(d))
    assert (outside / "keep.txt").read_text() == "precious"


def test_sync_order_is_files_then_dir_then_rename_then_parent(tmp_path):
    fs = FaultyFileSystem()
    with CheckpointManager(tmp_path, fs=fs) as m:
        before = len(fs.calls)
        m.save(1, items(1))
    ops = [(op, a) for op, a in fs.calls[before:]]
    names = [op for op, _ in ops]
    rename_at = names.index("rename")
    # every file written was fsynced before the rename, and something fsynced after it
    writes = sum(1 for op in names[:rename_at] if op in ("write", "writev"))
    assert writes >= 3 and names[:rename_at].count("fsync") >= 5
    assert "fsync" in names[rename_at + 1:]
