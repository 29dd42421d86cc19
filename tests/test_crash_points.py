"""Every crash point of a save, retention and cleanup, with what a power cut may lose.

For each scenario the save is stopped before every single file-system call, and each state
the crash could leave — only what was fsynced, un-synced directory operations persisted in
order or per directory, un-synced file data lost, zero-filled or half written — is rebuilt
in a fresh directory, where a fresh CheckpointManager must list only complete checkpoints and
restore the old latest step or the new one. See minickpt/crashsim.py for the model.
"""

import os
import threading

import pytest
from crash_harness import (
    MUTATIONS,
    SCALE,
    SCENARIOS,
    add_figures,
    explore_scenario,
    scratch,
)

from minickpt.crashsim import CrashRecorder, CrashState, read_tree
from minickpt.faults import SimulatedCrash
from minickpt.fs import FileSystem, SyncBatch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scn", SCENARIOS, ids=[s.name.split(",")[0] for s in SCENARIOS])
def test_every_crash_point_leaves_the_old_or_the_new_checkpoints(scn, tmp_path):
    with scratch(str(tmp_path)) as d:
        figs = explore_scenario(scn, os.path.join(d, "w"), random_states=4 * SCALE)
    add_figures(**{"crash points tried": figs.crash_points,
                   "crash points survived": figs.survived,
                   "post-crash states checked": figs.states,
                   "distinct post-crash states checked": figs.distinct_states})
    assert not figs.failures, "\n".join(figs.failures)
    assert figs.survived == figs.crash_points > 40
    assert figs.distinct_states > figs.crash_points / 4  # the states really differ


# ---- the harness must fail on a library that is not crash-safe -------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_harness_catches_a_library_that_is_not_crash_safe(name, tmp_path, monkeypatch):
    target, broken, scn, symptom = MUTATIONS[name]
    monkeypatch.setattr(target, broken)
    with scratch(str(tmp_path)) as d:
        figs = explore_scenario(scn, os.path.join(d, "w"), random_states=4)
    assert figs.failures, f"the harness did not notice: {name}"
    assert any(symptom in f for f in figs.failures), figs.failures[:3]


# ---- the model itself -------------------------------------------------------------------
def test_a_rename_is_durable_only_after_its_parent_is_fsynced(tmp_path):
    rec = CrashRecorder(tmp_path)
    rec.mkdir(str(tmp_path / "d"))
    rec.fsync_dir(str(tmp_path))
    rec.write_file(str(tmp_path / "d" / "f"), [b"data"])  # data fsynced, name not
    rec.fsync_dir(str(tmp_path / "d"))
    rec.rename(str(tmp_path / "d"), str(tmp_path / "e"))
    trees = [rec.tree(s) for s in rec.crash_states()]
    assert {"d": {"f": b"data"}} in trees and {"e": {"f": b"data"}} in trees
    rec.fsync_dir(str(tmp_path))
    assert all(rec.tree(s) == {"e": {"f": b"data"}} for s in rec.crash_states())


def test_one_state_is_what_a_killed_process_leaves(tmp_path):
    """Every operation and every byte: the state a SIGKILL (not a power cut) leaves, marked
    so that a reader need not parse the labels."""
    rec = CrashRecorder(tmp_path)
    rec.mkdir(str(tmp_path / "d"))
    fd = rec.open(str(tmp_path / "d" / "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    rec.write(fd, b"abcdefgh")
    rec.close(fd)
    rec.rename(str(tmp_path / "d"), str(tmp_path / "e"))
    killed = [s for s in rec.crash_states() if s.killed]
    assert len(killed) == 1 and rec.tree(killed[0]) == {"e": {"f": b"abcdefgh"}}


def test_unsynced_data_may_come_back_empty_zeroed_or_torn_under_a_durable_name(tmp_path):
    rec = CrashRecorder(tmp_path)
    fd = rec.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    rec.write(fd, b"abcdefgh")
    rec.close(fd)
    rec.fsync_dir(str(tmp_path))  # the name is durable, the data is not
    contents = {rec.tree(s)["f"] for s in rec.crash_states()}
    assert contents == {b"", bytes(8), b"abcd", b"abcdefgh"}
    assert rec.tree(CrashState("x", frozenset(), "old")) == {}  # nothing synced: no name


def test_writes_at_offsets_in_any_order_and_their_holes_are_modelled(tmp_path):
    """pwrite (the O_DIRECT writes in flight) leaves the position alone and may come in any
    order; with IN_FLIGHT_MODES a crash may leave every other 4 KiB block unwritten."""
    from minickpt.crashsim import IN_FLIGHT_MODES

    block = 4096
    rec = CrashRecorder(tmp_path)
    rec.data_modes = IN_FLIGHT_MODES
    fd = rec.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    for i in (2, 0, 1):  # the third block lands first: the file has a hole until the others
        rec.pwrite(fd, bytes([65 + i]) * block, i * block)
    rec.write(fd, b"Z")  # the position was never moved: this lands at offset 0
    rec.close(fd)
    rec.fsync_dir(str(tmp_path))
    whole = b"Z" + b"A" * (block - 1) + b"B" * block + b"C" * block
    assert rec.tree() == read_tree(FileSystem(), str(tmp_path)) == {"f": whole}
    contents = {rec.tree(s)["f"] for s in rec.crash_states()}
    holes = whole[:block] + bytes(block) + whole[2 * block:]
    assert contents == {b"", bytes(3 * block), whole[:len(whole) // 2], whole, holes}


def test_the_model_follows_truncation_appends_and_deletes(tmp_path):
    (tmp_path / "old").write_bytes(b"0123456789")
    rec = CrashRecorder(tmp_path)
    fd = rec.open(str(tmp_path / "old"), os.O_WRONLY | os.O_TRUNC)
    rec.write(fd, b"xy")
    rec.ftruncate(fd, 5)
    rec.fsync(fd)
    rec.close(fd)
    fd = rec.open(str(tmp_path / "old"), os.O_WRONLY | os.O_APPEND)
    rec.writev(fd, [b"A", memoryview(b"BC")])
    rec.close(fd)
    rec.mkdir(str(tmp_path / "d"))
    rec.write_file(str(tmp_path / "d" / "g"), [b"g"], fsync=False)
    rec.unlink(str(tmp_path / "d" / "g"))
    rec.rmdir(str(tmp_path / "d"))
    assert rec.tree() == read_tree(FileSystem(), str(tmp_path)) == {"old": b"xy\0\0\0ABC"}
    # what a power cut leaves: the synced five bytes, the append maybe
    assert {rec.tree(s)["old"] for s in rec.crash_states()} == {
        b"xy\0\0\0", b"xy\0\0\0ABC", bytes(8), b"xy\0\0"}


def test_writeback_is_a_hint_and_a_group_fsync_is_every_fsync(tmp_path):
    """start_writeback makes nothing durable; fsync_all (a SyncBatch's flush) makes every
    file and directory handed to it durable, and is as many crash points as fsyncs."""
    rec = CrashRecorder(tmp_path)
    batch = SyncBatch(rec)
    rec.mkdir(str(tmp_path / "d"))
    fd = rec.open(str(tmp_path / "d" / "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    rec.write(fd, b"abcdefgh")
    rec.start_writeback(fd, 0, 8)
    batch.add_file(fd)
    rec.write_file(str(tmp_path / "d" / "g"), [b"g"], batch=batch)
    batch.add_dir(str(tmp_path / "d"))
    batch.add_dir(str(tmp_path))
    assert {} in [rec.tree(s) for s in rec.crash_states()]  # the hint kept nothing
    n = rec.count
    batch.flush()
    assert [op for op, _ in rec.calls[n:]] == ["fsync", "fsync", "open", "fsync", "close",
                                               "open", "fsync", "close", "close", "close"]
    assert all(rec.tree(s) == {"d": {"f": b"abcdefgh", "g": b"g"}}
               for s in rec.crash_states())


def test_a_crash_stops_every_thread(tmp_path):
    rec = CrashRecorder(tmp_path, crash_at=2)
    rec.mkdir(str(tmp_path / "a"))
    rec.mkdir(str(tmp_path / "b"))
    seen = []

    def background():
        try:
            rec.mkdir(str(tmp_path / "c"))
        except SimulatedCrash as e:
            seen.append(e)

    t = threading.Thread(target=background)
    t.start()
    t.join(10)
    assert seen and rec.crashed and not (tmp_path / "c").exists()
    with pytest.raises(SimulatedCrash):
        rec.listdir(str(tmp_path))
