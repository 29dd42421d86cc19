"""The restore path's shortcuts (issue 19) change no answer: the quick check of a manifest
entry passes only entries the full check passes, a lab's plugged-in task 1.1 function still
names the leaves of every restore, a small item read in one call gives the same values, and
the link count spares listing a checkpoint only where it shows there is nothing unlisted."""

import copy
import os
import shutil
import stat

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minickpt
from minickpt import labkit
from minickpt.errors import CheckpointCorruptedError
from minickpt.errors import MiniCkptError as CheckpointError
from minickpt.format import manifest as item_manifest
from minickpt.fs import FileSystem

GOOD = {"path": ["params", "w"], "kind": "array", "dtype": "float32", "shape": [2, 3],
        "nbytes": 24, "offset": 64, "crc32": 12345}

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**33), st.floats(allow_nan=False),
                   st.text(max_size=3), st.sampled_from(["float32", "int8", "O", "array",
                                                         "prng_key", "value"]),
                   st.lists(st.integers(-1, 4), max_size=3),
                   st.lists(st.text(max_size=2), max_size=2))


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from([*GOOD, "sharded", "scalar"]), value=VALUES,
       drop=st.booleans(), data_bytes=st.integers(0, 200))
def test_quick_entry_check_passes_only_what_the_full_check_passes(key, value, drop,
                                                                 data_bytes):
    e = copy.deepcopy(GOOD)
    if drop:
        e.pop(key, None)
    else:
        e[key] = value
    if item_manifest._plain_array_ok(e, "data.bin", data_bytes):
        item_manifest._check_entry_fully(e, 0, "m.json", "data.bin", data_bytes)  # no raise
    try:  # and the check as a whole raises exactly when the full one does
        item_manifest._check_entry_fully(copy.deepcopy(e), 0, "m.json", "data.bin", data_bytes)
        full_ok = True
    except (CheckpointError, TypeError, ValueError):
        full_ok = False
    try:
        item_manifest._check_entry(e, 0, "m.json", "data.bin", data_bytes)
        quick_ok = True
    except (CheckpointError, TypeError, ValueError):
        quick_ok = False
    assert quick_ok == full_ok, e


def test_good_entry_takes_the_quick_check():
    assert item_manifest._plain_array_ok(GOOD, "data.bin", 88)
    assert not item_manifest._plain_array_ok(GOOD, "data.bin", 87)  # ends past the file
    assert not item_manifest._plain_array_ok(GOOD, None, 88)


def test_a_plugged_in_flatten_names_the_leaves_of_every_restore(tmp_path):
    ref = labkit.reference("flatten_with_names")
    calls = []

    def flatten_with_names(tree):
        calls.append(1)
        return ref(tree)

    state = {"w": jax.numpy.arange(6.0).reshape(2, 3), "b": np.int32(3)}
    ck = minickpt.Checkpointer()
    ck.save(str(tmp_path / "c"), {"state": state})
    target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                                    if isinstance(x, jax.Array) else x, state)}
    plain = ck.restore(str(tmp_path / "c"), target)
    with labkit.plugged_in(flatten_with_names):
        got = ck.restore(str(tmp_path / "c"), target)
    assert len(calls) >= 2  # the structure check, and the restore's own naming
    for a, b in ((plain, got), (got, {"state": state})):
        assert labkit.tree_diff(a, b) is None


# ---------------------------------------------------------------------------------------
# a small item's leaves: one read into one buffer
# ---------------------------------------------------------------------------------------
class DataReads(FileSystem):
    """Counts the reads of data files; ``eof=True`` answers them as a file that ended."""

    def __init__(self, eof: bool = False):
        self.data_fds: set[int] = set()
        self.reads = 0
        self.listings: list[str] = []
        self.eof = eof

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        if path.endswith(".bin"):
            self.data_fds.add(fd)
        return fd

    def close(self, fd):
        self.data_fds.discard(fd)
        return super().close(fd)

    def preadv(self, fd, buffers, offset):
        if fd in self.data_fds:
            self.reads += 1
            if self.eof:
                return 0
        return super().preadv(fd, buffers, offset)

    def listdir(self, path):
        self.listings.append(path)
        return super().listdir(path)


DTYPES = ["float32", "int8", "float64", "bool", "uint16", "bfloat16"]
LEAF = st.tuples(st.sampled_from(DTYPES),
                 st.lists(st.integers(0, 9), min_size=0, max_size=3))


def _leaf(rng, dtype, shape):
    dt = jax.numpy.dtype(dtype)
    return np.asarray((rng.standard_normal(shape) * 50).astype(dt) if dt.kind != "b" else
                      rng.integers(0, 2, shape).astype(bool))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(LEAF, min_size=1, max_size=10), pick=st.data())
def test_a_small_item_restores_the_same_values_read_in_one_call(spec, pick, tmp_path_factory):
    rng = np.random.default_rng(len(spec))
    state = {f"l{i}": _leaf(rng, dt, tuple(shape)) for i, (dt, shape) in enumerate(spec)}
    path = str(tmp_path_factory.mktemp("c") / "c")
    minickpt.Checkpointer().save(path, {"s": state})
    fs = DataReads()
    got = minickpt.Checkpointer(fs).restore(path)["s"]
    assert labkit.tree_diff(got, state) is None
    assert all(got[k].dtype == v.dtype and got[k].shape == v.shape for k, v in state.items())
    if any(v.nbytes for v in state.values()):
        assert fs.reads == 1, f"{fs.reads} reads of the data file for {len(state)} small leaves"
    # a partial target: whichever way its leaves are read, the same values
    keep = pick.draw(st.lists(st.sampled_from(sorted(state)), min_size=1, unique=True))
    target = {k: np.empty_like(state[k]) for k in keep}  # numpy: the saved dtype, x64 or not
    part = minickpt.Checkpointer().restore(path, {"s": target}, partial=True)["s"]
    assert sorted(part) == sorted(keep)
    for k in keep:
        assert np.array_equal(np.asarray(part[k]), state[k]), k


def test_a_data_file_that_ends_during_the_one_read_is_reported_as_damage(tmp_path):
    path = str(tmp_path / "c")
    minickpt.Checkpointer().save(path, {"s": {"w": np.arange(12.0), "b": np.ones(3)}})
    with pytest.raises(CheckpointCorruptedError, match="ended early") as e:
        minickpt.Checkpointer(DataReads(eof=True)).restore(path)
    assert "data.bin" in str(e.value)


# ---------------------------------------------------------------------------------------
# unlisted item directories: the link count spares the listing only when it can tell
# ---------------------------------------------------------------------------------------
class NoLinkCount(DataReads):
    """A file system that does not count sub-directories (btrfs: every directory has 1)."""

    def lstat(self, path):
        st_ = super().lstat(path)
        if not stat.S_ISDIR(st_.st_mode):
            return st_
        fields = list(st_)
        fields[stat.ST_NLINK] = 1
        return os.stat_result(fields)


def _two_items(tmp_path) -> str:
    path = str(tmp_path / "c")
    minickpt.Checkpointer().save(path, {"a": {"w": np.arange(4.0)}, "b": {"w": np.ones(2)}})
    return path


def test_a_healthy_restore_need_not_list_the_checkpoint(tmp_path):
    path = _two_items(tmp_path)
    if os.lstat(path).st_nlink != 4:
        pytest.skip("this file system does not count sub-directories")
    fs = DataReads()
    minickpt.Checkpointer(fs).restore(path)
    assert path not in fs.listings
    nolinks = NoLinkCount()
    minickpt.Checkpointer(nolinks).restore(path)
    assert path in nolinks.listings, "without a link count the directory must be listed"


@pytest.mark.parametrize("fs", [DataReads, NoLinkCount])
def test_an_unlisted_item_directory_is_found_whatever_the_link_count(fs, tmp_path):
    path = _two_items(tmp_path)
    shutil.copytree(os.path.join(path, "b"), os.path.join(path, "c"))  # not in the metadata
    for target in (None, {"a": None}, {"a": None, "b": None}):
        with pytest.raises(CheckpointCorruptedError, match="not listed"):
            minickpt.Checkpointer(fs()).restore(path, target)


@pytest.mark.parametrize("fs", [DataReads, NoLinkCount])
def test_a_listed_item_replaced_by_an_unlisted_one_is_found(fs, tmp_path):
    """Metadata lists a and b, the directory holds a and c: as many sub-directories as
    listed items, so the link count matches; a restore of a alone must still list."""
    path = _two_items(tmp_path)
    os.rename(os.path.join(path, "b"), os.path.join(path, "c"))
    with pytest.raises(CheckpointCorruptedError, match="not listed"):
        minickpt.Checkpointer(fs()).restore(path, {"a": None})
    with pytest.raises(CheckpointCorruptedError):
        minickpt.Checkpointer(fs()).restore(path)
