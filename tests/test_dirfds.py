"""A restore's lookups from directory descriptors (issue 51, ``minickpt.dirfds``): the same
arrays and the same errors as the path calls, fewer whole-path lookups, no descriptor left."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from minickpt import Checkpointer
from minickpt.fs import FileSystem

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")]


class PathsOnly(FileSystem):
    """The same file system, but a subclass: it never anchors (every call by path)."""


def _save(root, name="ckpt", items=None):
    d = os.path.join(root, name)
    items = items or {"state": {"w": np.arange(6, dtype=np.float32), "b": np.ones(3)},
                      "extra": {"n": np.array([7])}}
    Checkpointer().save(d, items)
    return d


def _fds():
    return set(os.listdir("/proc/self/fd"))


def _outcome(fs, d):
    try:
        out = Checkpointer(fs=fs).restore(d)
        return ("ok", {k: {n: np.asarray(v).tolist() for n, v in t.items()}
                       for k, t in out.items()})
    except Exception as e:  # the comparison is the point
        return (type(e).__name__, str(e))


def _break(kind, d, tmp):
    item = os.path.join(d, "state")
    data = next(f for f in os.listdir(item) if f != "manifest.json")
    if kind == "ckpt is a symlink":
        real = os.path.join(tmp, "elsewhere")
        os.rename(d, real)
        os.symlink(real, d)
    elif kind == "item is a symlink":
        shutil.move(item, os.path.join(tmp, "moved"))
        os.symlink(os.path.join(tmp, "moved"), item)
    elif kind == "item is a file":
        shutil.rmtree(item)
        open(item, "w").close()
    elif kind == "no item dir":
        shutil.rmtree(item)
    elif kind == "no manifest":
        os.unlink(os.path.join(item, "manifest.json"))
    elif kind == "no data":
        os.unlink(os.path.join(item, data))
    elif kind == "data is a symlink":
        target = os.path.join(tmp, "outside.bin")
        shutil.copy(os.path.join(item, data), target)
        os.unlink(os.path.join(item, data))
        os.symlink(target, os.path.join(item, data))
    elif kind == "data is a fifo":
        os.unlink(os.path.join(item, data))
        os.mkfifo(os.path.join(item, data))
    elif kind == "data truncated":
        os.truncate(os.path.join(item, data), 4)
    elif kind == "no metadata":
        os.unlink(os.path.join(d, "_CHECKPOINT_METADATA"))
    elif kind == "no checkpoint":
        shutil.rmtree(d)


KINDS = ["intact", "ckpt is a symlink", "item is a symlink", "item is a file", "no item dir",
         "no manifest", "no data", "data is a symlink", "data is a fifo", "data truncated",
         "no metadata", "no checkpoint"]


@pytest.mark.parametrize("kind", KINDS)
def test_anchored_restore_says_exactly_what_the_path_calls_say(tmp_path, kind):
    d = _save(str(tmp_path))
    _break(kind, d, str(tmp_path))
    before = _fds()
    anchored = _outcome(FileSystem(), d)
    assert _fds() == before, "a descriptor was left open"
    assert anchored == _outcome(PathsOnly(), d)
    assert (anchored[0] == "ok") == (kind == "intact")


def test_a_restore_finds_its_files_from_descriptors_not_whole_paths(tmp_path, monkeypatch):
    d = _save(str(tmp_path))
    seen: list[str] = []
    real_open, real_lstat = os.open, os.lstat

    def spy_open(path, *a, **k):
        if k.get("dir_fd") is None:
            seen.append(os.fspath(path))
        return real_open(path, *a, **k)

    def spy_lstat(path, *a, **k):
        seen.append(os.fspath(path))
        return real_lstat(path, *a, **k)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "lstat", spy_lstat)
    Checkpointer().restore(d)
    monkeypatch.undo()
    # one whole-path lookup: the checkpoint's own directory; every file under it, relative
    assert seen == [d], seen


def test_concurrent_restores_share_descriptors_and_close_them_all(tmp_path):
    d = _save(str(tmp_path))
    want = _outcome(FileSystem(), d)
    fs = FileSystem()
    before = _fds()
    errors: list[object] = []

    def go():
        for _ in range(20):
            got = _outcome(fs, d)
            if got != want:
                errors.append(got)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert _fds() == before
    assert not fs.__dict__["_anchors"]._fds


def test_a_directory_renamed_under_a_restore_is_read_whole_from_where_it_was(tmp_path):
    d = _save(str(tmp_path))
    fs = FileSystem()
    with fs.anchored(d):
        moved = os.path.join(str(tmp_path), "moved")
        os.rename(d, moved)
        # the descriptor still names the directory it opened: its files are still readable
        assert Checkpointer(fs=fs).restore(d)["extra"]["n"].tolist() == [7]
    with pytest.raises(Exception, match="no checkpoint"):
        Checkpointer(fs=fs).restore(d)


def test_writes_never_go_through_an_anchor(tmp_path):
    d = _save(str(tmp_path))
    fs = FileSystem()
    with fs.anchored(d):
        fd = fs.open(os.path.join(d, "new.txt"), os.O_WRONLY | os.O_CREAT)
        os.close(fd)
        st = fs.lstat(os.path.join(d, "new.txt"))
    assert os.path.isfile(os.path.join(d, "new.txt")) and st.st_size == 0


def test_an_item_directory_opened_as_one_needs_no_stat(tmp_path, monkeypatch):
    d = _save(str(tmp_path), items={"state": {"w": np.arange(3, dtype=np.float32)}})
    stats: list[object] = []
    real_fstat, real_stat = os.fstat, os.stat

    def spy_fstat(fd):
        stats.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fstat(fd)

    def spy_stat(path, *a, **k):
        stats.append(path)
        return real_stat(path, *a, **k)

    monkeypatch.setattr(os, "fstat", spy_fstat)
    monkeypatch.setattr(os, "stat", spy_stat)
    out = Checkpointer().restore(d)
    monkeypatch.undo()
    assert out["state"]["w"].tolist() == [0, 1, 2]
    # the checkpoint's directory (its link count), the metadata, the manifest, the data file:
    # the item's directory is known for one by its O_DIRECTORY | O_NOFOLLOW open
    assert stats == [d, os.path.join(d, "_CHECKPOINT_METADATA"),
                     os.path.join(d, "state", "manifest.json"),
                     os.path.join(d, "state", "data.bin")], stats
