"""The fsyncs of a save run concurrently (a group commit), but the order that makes a
checkpoint durable never changes:

* every file and every directory of the temporary tree is fsynced — finished, not merely
  started — before the rename that publishes the checkpoint;
* the parent is fsynced after that rename;
* an old checkpoint is renamed to a deletion name only after that parent fsync, and its files
  are removed only after the parent is fsynced again.
"""

import errno
import os
import threading

import numpy as np
import pytest

from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions
from minickpt.commit import DELETE_MARK, TMP_MARK
from minickpt.faults import FaultyFileSystem
from minickpt.fs import FileSystem, SyncBatch


class Journal(FileSystem):
    """Records, in the order they *finished*, the operations that change what is durable."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()

    def _log(self, op, path):
        with self._lock:
            self.events.append((op, path))

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        if flags & os.O_CREAT:
            self._log("create", path)
        return fd

    def close(self, fd):
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)

    def fsync(self, fd):
        super().fsync(fd)
        with self._lock:
            path = self._paths[fd]
        self._log("fsync", path)

    def mkdir(self, path, mode=0o755):
        super().mkdir(path, mode)
        self._log("mkdir", path)

    def rename(self, src, dst):
        super().rename(src, dst)
        self._log("rename", f"{src} -> {dst}")

    def unlink(self, path):
        super().unlink(path)
        self._log("remove", path)

    def rmdir(self, path):
        super().rmdir(path)
        self._log("remove", path)


def items(v, n_items=3):
    return {f"item{i}": {"w": np.full((100,), v, np.float32), "b": np.arange(5) + i,
                         "tag": f"v{v}"} for i in range(n_items)}


@pytest.mark.parametrize("background", [False, True], ids=["inline-delete", "background-delete"])
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_every_file_and_dir_is_durable_before_rename_and_parent_after(tmp_path, background,
                                                                      async_):
    fs = Journal()
    root = str(tmp_path)
    opts = CheckpointManagerOptions(max_to_keep=1, enable_background_delete=background,
                                    enable_async_checkpointing=async_)
    with CheckpointManager(root, opts, fs=fs) as m:
        m.save(1, items(1))
        m.wait_until_finished()
        start = len(fs.events)
        m.save(2, items(2))
        m.wait_until_finished()
        assert m.all_steps() == [2] and not (tmp_path / "step_1").exists()
    written = check_order(fs.events[start:], root)
    assert len(written) == 1 + 3 + 3 * 2 + 1  # tmp dir, 3 item dirs, 3×2 files, metadata


def test_a_multi_process_save_keeps_the_order_on_every_process(tmp_path):
    """Two processes (threads of a LocalGroup) write their shard files with group commits of
    their own; the primary's commit still comes after every file of both is durable."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from minickpt import MultiHostOptions
    from minickpt.multihost.sync import LocalGroup

    fs = Journal()  # one journal for both processes: one order of events
    root = str(tmp_path)
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def run(step):
        def save(sync):
            tree = items(step, n_items=2)
            tree["item0"]["w"] = jax.device_put(tree["item0"]["w"], NamedSharding(mesh, P("x")))
            opts = CheckpointManagerOptions(max_to_keep=1,
                                            multihost=MultiHostOptions(timeout_s=30))
            with CheckpointManager(root, opts, fs=fs, sync=sync) as m:
                return m.save(step, tree)
        for r in LocalGroup(2).run(save):
            if isinstance(r, BaseException):
                raise r

    run(1)
    start = len(fs.events)
    run(2)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_2"]
    written = check_order(fs.events[start:], root)
    names = {os.path.basename(p) for p in written}
    assert {"data.p0.bin", "manifest.p0.json", "data.p1.bin", "manifest.p1.json"} <= names


def check_order(ev, root):
    """Assert the durability order in one save's events; return what it wrote."""
    renames = [i for i, (op, p) in enumerate(ev) if op == "rename"]
    commit_at = next(i for i in renames if TMP_MARK in ev[i][1].split(" -> ")[0])
    tmp = ev[commit_at][1].split(" -> ")[0]
    written = {p for op, p in ev[:commit_at] if op in ("create", "mkdir") and p.startswith(tmp)}
    synced_before = {p for op, p in ev[:commit_at] if op == "fsync"}
    assert written - synced_before == set(), "written but not durable before the rename"
    parent_syncs = [i for i, (op, p) in enumerate(ev) if op == "fsync" and p == root]
    assert any(i > commit_at for i in parent_syncs)
    # retention: step_1 leaves the namespace only after the new checkpoint's rename is durable
    delete_at = next(i for i in renames if DELETE_MARK in ev[i][1].split(" -> ")[1])
    assert any(commit_at < i < delete_at for i in parent_syncs)
    first_removal = next(i for i, (op, p) in enumerate(ev) if op == "remove" and DELETE_MARK in p)
    assert any(delete_at < i < first_removal for i in parent_syncs)
    return written


def _open_fds():
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


def _fsyncs_of_a_save(tmp_path):
    fs = FaultyFileSystem(ops={"fsync"})
    Checkpointer(fs).save(str(tmp_path / "count"), items(0))
    return fs.count


def test_a_failed_fsync_in_the_group_fails_the_save_and_leaks_nothing(tmp_path):
    n = _fsyncs_of_a_save(tmp_path)
    assert n >= 11  # 7 files and dirs of the tree + metadata + tmp + parent ...
    before = _open_fds()
    for k in range(n):
        fs = FaultyFileSystem(k, ops={"fsync"}, error=OSError(errno.EIO, "I/O error"))
        target = tmp_path / f"ckpt{k}"
        with pytest.raises(OSError) as info:
            Checkpointer(fs).save(str(target), items(k))
        assert info.value.errno == errno.EIO  # the original error, errno intact
        renamed = any(op == "rename" for op, _ in fs.calls)
        # a failure before the rename never publishes; one after it (the parent's fsync)
        # has published a complete checkpoint, which must then be readable
        if renamed:
            assert Checkpointer().verify(str(target)).ok
        else:
            assert not target.exists()
        assert not [p for p in os.listdir(tmp_path) if TMP_MARK in p]
    assert _open_fds() == before, "a failed save left file descriptors open"


def test_sync_batch_closes_what_it_owns_even_when_nothing_is_flushed(tmp_path):
    before = _open_fds()
    fs = FileSystem()
    with SyncBatch(fs) as batch:
        for i in range(3):
            fs.write_file(str(tmp_path / f"f{i}"), [b"x"], batch=batch)
    assert _open_fds() == before
    batch = SyncBatch(fs)
    batch.MAX_OPEN = 2  # more files than it may hold open: it flushes early, still closes all
    for i in range(5):
        fs.write_file(str(tmp_path / f"g{i}"), [b"y"], batch=batch)
    batch.add_dir(str(tmp_path))
    batch.flush()
    assert _open_fds() == before and batch.fds == [] and batch.dirs == []
    assert (tmp_path / "g4").read_bytes() == b"y"


def test_background_delete_removes_everything_by_close(tmp_path):
    opts = CheckpointManagerOptions(max_to_keep=2, enable_background_delete=True)
    with CheckpointManager(tmp_path, opts) as m:
        for s in range(6):
            m.save(s, items(s, n_items=1))
            assert m.all_steps() == list(range(max(0, s - 1), s + 1))
    assert sorted(os.listdir(tmp_path)) == [".minickpt.lock", "step_4", "step_5"]


def test_background_delete_failure_warns_and_leaves_only_a_cleanable_temporary(tmp_path):
    fs = FaultyFileSystem(0, ops={"unlink"}, error=OSError(errno.EACCES, "Permission denied"))
    opts = CheckpointManagerOptions(max_to_keep=1, enable_background_delete=True)
    m = CheckpointManager(tmp_path, opts, fs=fs)
    m.save(1, items(1, n_items=1))
    m.save(2, items(2, n_items=1))  # step 1 is retired; removing its files fails
    with pytest.warns(UserWarning, match="could not remove deleted checkpoint"):
        m.wait_until_finished()
    m.close()
    assert m.all_steps() == [2]
    left = [n for n in os.listdir(tmp_path) if DELETE_MARK in n]
    assert len(left) == 1
    with CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1)) as m2:
        assert m2.all_steps() == [2] and m2.removed_temporaries == left
    assert not [n for n in os.listdir(tmp_path) if DELETE_MARK in n]
