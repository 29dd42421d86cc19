"""Small saves: how many sequential fsync rounds they wait for, and the kernel-AIO group
commit that issues a round's fsyncs without starting threads (issue 19, item 4).

A durable save needs two rounds, one after the other: every file and directory of the
temporary tree (one group commit), then — after the rename — the parent directory. These
tests count rounds, never time them.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions, aio
from minickpt.fs import FileSystem, SyncBatch


class RoundCounter(FileSystem):
    """Counts sequential fsync rounds: each ``fsync_all`` is one (its fsyncs run together),
    each fsync outside one is one more."""

    def __init__(self) -> None:
        self.rounds: list[str] = []
        self.fsyncs = 0
        self._in_batch = 0
        self._lock = threading.Lock()

    def fsync_all(self, fds=(), dirs=()) -> None:
        self.rounds.append(f"batch({len(fds)} files, {len(dirs)} dirs)")
        self._in_batch += 1
        try:
            super().fsync_all(fds, dirs)
        finally:
            self._in_batch -= 1

    def fsync(self, fd: int) -> None:
        with self._lock:
            self.fsyncs += 1
            if not self._in_batch:
                self.rounds.append("fsync" if threading.current_thread() is
                                   threading.main_thread() else "fsync (background)")
        super().fsync(fd)


def tiny() -> dict:
    return {"w": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(4, np.float32),
            "step": np.int32(7), "lr": np.float32(1e-3)}


def test_a_checkpointer_save_waits_for_two_fsync_rounds(tmp_path):
    fs = RoundCounter()
    Checkpointer(fs).save(tmp_path / "c", {"state": tiny()})
    assert len(fs.rounds) == 2, (f"a save should wait for two fsync rounds (the temporary "
                                 f"tree together, then the parent), it waited for {fs.rounds}")
    assert fs.rounds[0].startswith("batch") and fs.rounds[1] == "fsync"
    assert Checkpointer().verify(tmp_path / "c").ok


@pytest.mark.parametrize("background", [False, True], ids=["sync-delete", "background-delete"])
def test_a_manager_save_with_retention_waits_for_few_rounds(tmp_path, background):
    fs = RoundCounter()
    m = CheckpointManager(tmp_path, CheckpointManagerOptions(
        max_to_keep=2, enable_background_delete=background), fs=fs)
    try:
        for s in range(3):
            m.save(s, {"state": tiny()})
        m.wait_until_finished()
        fs.rounds.clear()
        m.save(3, {"state": tiny()})  # commits step 3, deletes step 1
        m.wait_until_finished()
        rounds = [r for r in fs.rounds if "background" not in r]  # what save() waited for
        assert m.all_steps() == [2, 3]
    finally:
        m.close()
    # the save: tree, parent; the delete: the retirement's rename made durable before any
    # file of the old step goes (on the background thread with background delete)
    limit = 2 if background else 3
    assert len(rounds) <= limit, f"a manager save waited for {rounds} (at most {limit})"
    assert [n for n in sorted(os.listdir(tmp_path)) if n.startswith("step")] == ["step_2", "step_3"]


def _files(tmp_path, n):
    fds = []
    for i in range(n):
        fds.append(os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.write(fds[-1], f"file {i}".encode())
    return fds


def test_fsync_all_syncs_files_and_directories(tmp_path):
    sub = tmp_path / "d"
    sub.mkdir()
    fds = _files(tmp_path, 5)
    try:
        FileSystem().fsync_all(fds, [str(sub), str(tmp_path)])
    finally:
        for fd in fds:
            os.close(fd)
    assert (tmp_path / "f3").read_bytes() == b"file 3"


def test_fsync_all_of_more_than_one_ring_depth(tmp_path):
    fds = _files(tmp_path, aio._AIO_DEPTH + 3)
    try:
        FileSystem().fsync_all(fds, [str(tmp_path)])
    finally:
        for fd in fds:
            os.close(fd)


def test_fsync_all_raises_a_bad_descriptors_error_after_syncing_the_rest(tmp_path):
    fds = _files(tmp_path, 3)
    bad = 1 << 20  # above any open-file limit: never an open descriptor
    try:
        with pytest.raises(OSError) as e:
            FileSystem().fsync_all([fds[0], bad, fds[1], fds[2]], [str(tmp_path)])
        assert e.value.errno == errno.EBADF
    finally:
        for fd in fds:
            os.close(fd)


def test_without_kernel_aio_the_threads_do_it(tmp_path, monkeypatch):
    monkeypatch.setattr(aio._AIO_RINGS, "broken", True)
    monkeypatch.setattr(aio._AIO_RINGS, "free", [])
    fs = FileSystem()
    Checkpointer(fs).save(tmp_path / "c", {"state": tiny()})
    assert Checkpointer().verify(tmp_path / "c").ok


def test_a_subclass_that_watches_fsync_sees_every_one(tmp_path):
    """The AIO path is only for the real primitives: a FileSystem that observes (or faults)
    fsync — the tests, the crash harness — must be called for every file and directory."""
    fs = RoundCounter()
    with SyncBatch(fs) as batch:
        for fd in _files(tmp_path, 4):
            batch.add_file(fd)
        batch.add_dir(str(tmp_path))
        batch.flush()
    assert fs.fsyncs == 5


# ---------------------------------------------------------------------------------------
# the skeleton cache: same structure, same skeleton; a changed structure is never served
# the old one
# ---------------------------------------------------------------------------------------
import collections  # noqa: E402

import jax  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minickpt import tree as mtree  # noqa: E402
from minickpt.tree import skeleton  # noqa: E402

Pair = collections.namedtuple("Pair", "first second")
Other = collections.namedtuple("Other", "first second")

_leaves = st.one_of(st.integers(-3, 3), st.just(np.zeros(2, np.float32)), st.just(None),
                    st.just(np.float32(1.5)), st.text("xy", max_size=2))


def _containers(children):
    return st.one_of(
        st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3),
        st.dictionaries(st.integers(0, 5), children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.tuples(children, children).map(lambda t: Other(*t)),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), children,
                        max_size=3).map(collections.OrderedDict),
    )


_trees = st.recursive(_leaves, _containers, max_leaves=12)


def _reference(tree):
    return skeleton(tree, fast=False)


@settings(max_examples=150, deadline=None)
@given(_trees, _trees)
def test_a_cached_skeleton_is_the_walks_for_every_structure(a, b):
    for tree in (a, b, a, {"wrapped": a}, [a, b], b):  # repeats are served from the cache
        try:
            ref = _reference(tree)
        except (TypeError, ValueError) as e:
            with pytest.raises(type(e)):
                skeleton(tree)
            continue
        got = skeleton(tree)
        assert got[0] == ref[0], "the cache served a skeleton of another structure"
        assert [n for n, _ in got[1]] == [n for n, _ in ref[1]]
        assert all(x is y for (_, x), (_, y) in zip(got[1], ref[1], strict=True)), \
            "the leaves must be this tree's, never the cached call's"


def test_each_caller_gets_its_own_skeleton():
    tree = {"a": np.ones(2), "b": [np.zeros(1), 3]}
    first, _ = skeleton(tree)
    first["c"][0][1]["t"] = "changed by a caller"
    second, _ = skeleton(tree)
    assert second == _reference(tree)[0]


def test_changing_one_key_type_or_class_changes_the_skeleton():
    base = {"p": Pair(np.ones(1), np.ones(2)), "k": [1, 2]}
    variants = [
        {"p": Other(np.ones(1), np.ones(2)), "k": [1, 2]},  # another node class
        {"p": Pair(np.ones(1), np.ones(2)), "k": (1, 2)},  # list -> tuple
        {"p": Pair(np.ones(1), np.ones(2)), "K": [1, 2]},  # a renamed key
        {"p": Pair(np.ones(1), None), "k": [1, 2]},  # a leaf became None
        {"p": Pair(np.ones(1), np.ones(2)), "k": [1, 2, 3]},  # one more leaf
        collections.OrderedDict(base),  # the container's type
    ]
    skeleton(base)
    for v in variants:
        assert skeleton(v)[0] == _reference(v)[0]
        assert skeleton(base)[0] == _reference(base)[0]


def test_a_students_flatten_is_never_served_from_the_cache(monkeypatch):
    """labkit.plugged_in swaps flatten_with_names: a wrong version must still be caught,
    even for a tree whose skeleton the library's own version cached."""
    tree = {"a": np.ones(1), "b": np.ones(2)}
    skeleton(tree)

    def flatten_with_names(t):  # names right, leaves swapped
        leaves = jax.tree_util.tree_leaves(t)
        return [(("a",), leaves[1]), (("b",), leaves[0])]

    monkeypatch.setattr(mtree, "flatten_with_names", flatten_with_names)
    with pytest.raises(ValueError, match="leaves must be named by their key paths"):
        skeleton(tree)


def test_the_cache_stays_bounded():
    for i in range(mtree._SKELETONS_MAX * 2):
        skeleton({f"k{i}": np.ones(1)})
    assert len(mtree._SKELETONS) <= mtree._SKELETONS_MAX
