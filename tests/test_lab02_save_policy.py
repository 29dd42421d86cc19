"""Lab 2's reference functions (tasks 2.3 and 2.4) and the crash checks its tests rely on:
the reference survives every crash point, and each classic mistake — a commit that skips an
fsync or renames first, a cleanup that removes what is not a temporary — is caught, with a
message naming the crash point and what was lost."""

import errno
import os

import numpy as np
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions, labkit
from minickpt.commit import cleanup_temporaries, commit, is_temporary
from minickpt.errors import StepAlreadyExistsError
from minickpt.fs import FileSystem, SyncBatch
from minickpt.policy import steps_to_keep

pytestmark = pytest.mark.timeout(300)


class Journal(FileSystem):
    """Records the fsyncs (group or single) and renames, in the order they finished."""

    def __init__(self):
        self.events = []

    def fsync_all(self, fds=(), dirs=()):
        super().fsync_all(fds, dirs)
        self.events.append(("fsync", len(fds), tuple(os.path.basename(d) for d in dirs)))

    def fsync_dir(self, path):
        super().fsync_dir(path)
        self.events.append(("fsync", 0, (os.path.basename(os.path.abspath(path)),)))

    def rename(self, src, dst):
        super().rename(src, dst)
        self.events.append(("rename", os.path.basename(src), os.path.basename(dst)))


# ---- task 2.3 ----------------------------------------------------------------------------
@pytest.mark.task("2.3")
def test_commit_makes_everything_durable_before_the_rename_and_the_rename_after(tmp_path):
    fs = Journal()
    tmp, final = tmp_path / "step_3.minickpt-tmp-00000000", tmp_path / "step_3"
    (tmp / "params").mkdir(parents=True)
    batch = SyncBatch(fs)
    fd = fs.open(str(tmp / "params" / "data.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    fs.write(fd, b"w")
    batch.add_file(fd)
    commit(fs, str(tmp), str(final), subdirs=["params"], sync=batch)
    r = next(i for i, e in enumerate(fs.events) if e[0] == "rename")
    assert sum(e[1] for e in fs.events[:r]) == 1
    assert {"params", tmp.name} <= {n for e in fs.events[:r] for n in e[2]}
    assert ("fsync", 0, (tmp_path.name,)) in fs.events[r + 1:]
    assert (final / "params" / "data.bin").read_bytes() == b"w" and not tmp.exists()


@pytest.mark.task("2.3")
def test_commit_never_replaces_and_reports_a_failed_parent_fsync(tmp_path):
    (tmp_path / "step_1" / "x").mkdir(parents=True)
    (tmp_path / "step_1.minickpt-tmp-1").mkdir()
    with pytest.raises(StepAlreadyExistsError, match="step_1"):
        commit(FileSystem(), str(tmp_path / "step_1.minickpt-tmp-1"), str(tmp_path / "step_1"))
    assert os.listdir(tmp_path / "step_1") == ["x"]

    class FailParent(FileSystem):
        def fsync_dir(self, path):
            if os.path.abspath(path) == str(tmp_path):
                raise OSError(errno.EIO, "I/O error")
            super().fsync_dir(path)

    (tmp_path / "step_2.minickpt-tmp-2").mkdir()
    with pytest.raises(OSError, match="in place") as err:
        commit(FailParent(), str(tmp_path / "step_2.minickpt-tmp-2"), str(tmp_path / "step_2"))
    assert err.value.errno == errno.EIO and (tmp_path / "step_2").is_dir()


def _dirs(tmp_dir, subdirs):
    return [os.path.join(tmp_dir, s) for s in subdirs] + [tmp_dir]


def no_file_fsync(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    dirs = list(sync.dirs) if sync is not None else []
    if sync is not None:
        sync.close()
    fs.fsync_all([], dirs + _dirs(tmp_dir, subdirs))
    fs.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


def no_dir_fsync(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    batch = sync or SyncBatch(fs)
    batch.dirs = []
    batch.flush()
    fs.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


def rename_first(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    fs.rename(tmp_dir, final_dir)
    batch = sync or SyncBatch(fs)
    batch.dirs = [final_dir + d[len(tmp_dir):] for d in batch.dirs] + _dirs(final_dir, subdirs)
    batch.flush()
    fs.fsync_dir(os.path.dirname(final_dir))


def no_parent_fsync(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    batch = sync or SyncBatch(fs)
    for d in _dirs(tmp_dir, subdirs):
        batch.add_dir(d)
    batch.flush()
    fs.rename(tmp_dir, final_dir)


@pytest.mark.task("2.3")
def test_the_reference_commit_survives_every_crash_point():
    for kw in ({}, {"before": (), "step": 1, "max_to_keep": None}):
        report = labkit.crash_every_call(**kw)  # nothing plugged in: minickpt's own commit
        assert report.points > 20 and not report.problems, report.first()


@pytest.mark.task("2.3")
@pytest.mark.parametrize("wrong, scenario, lost", [
    (no_file_fsync, {}, "is listed but damaged"),
    (no_dir_fsync, {}, "is listed but damaged"),
    (rename_first, {}, "is listed but damaged"),
    (no_parent_fsync, {"before": (), "step": 1, "max_to_keep": None}, "can lose step 1"),
], ids=["no-file-fsync", "no-dir-fsync", "rename-first", "no-parent-fsync"])
def test_each_broken_commit_is_caught_naming_the_crash_point(wrong, scenario, lost):
    wrong.__name__ = "commit"  # what plugged_in looks the reference up by
    report = labkit.crash_every_call(wrong, **scenario)
    assert report.problems, f"{wrong} passed every crash point"
    assert report.first().startswith("crash before call ")
    assert any(lost in p for p in report.problems), report.problems[:3]
    assert "<world>" in report.first() and "/dev/shm" not in report.first()


# ---- task 2.4 ----------------------------------------------------------------------------
@pytest.mark.task("2.4")
def test_cleanup_removes_leftovers_only(tmp_path):
    with CheckpointManager(tmp_path, CheckpointManagerOptions(step_prefix="model")) as m:
        m.save(4, {"x": {"x": np.zeros(2, np.float32)}})
    junk = ["step_2.minickpt-tmp-0a1b2c3d", "model_0.minickpt-del-00000000"]
    for n in junk:
        (tmp_path / n / "p").mkdir(parents=True)
    (tmp_path / "step_7.tmp").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert cleanup_temporaries(FileSystem(), str(tmp_path)) == sorted(junk)
    assert sorted(os.listdir(tmp_path)) == sorted([".minickpt.lock", "model_4", "notes.txt",
                                                   "step_7.tmp"])
    assert cleanup_temporaries(FileSystem(), str(tmp_path / "missing")) == []


def greedy_cleanup(fs, root):
    removed = [n for n in sorted(fs.listdir(root)) if "tmp" in n or "del" in n]
    for n in removed:
        fs.rmtree(os.path.join(root, n))
    return removed


def lazy_cleanup(fs, root):
    return []


@pytest.mark.task("2.4")
def test_crash_checks_pass_the_reference_cleanup_and_catch_broken_ones():
    report = labkit.crash_every_call(leftovers=True)  # minickpt's own cleanup
    assert report.points > 20 and not report.problems, report.first()
    for wrong, said in ((greedy_cleanup, "is not a minickpt temporary"),
                        (lazy_cleanup, "left ['step_3.minickpt-tmp-0badc0de'")):
        wrong.__name__ = "cleanup_temporaries"
        report = labkit.crash_every_call(wrong, leftovers=True)
        assert report.problems and report.first().startswith("crash before call ")
        assert any(said in p for p in report.problems), report.problems[:2]


# ---- task 2.2: the lab's random cases --------------------------------------------------
@pytest.mark.task("2.2")
def test_retention_cases_are_seeded_and_cover_the_hard_cases():
    a, b = list(labkit.retention_cases(200, seed=5)), list(labkit.retention_cases(200, seed=5))
    assert [[(i.step, i.metrics) for i in x] for x, _ in a] == \
        [[(i.step, i.metrics) for i in x] for x, _ in b]
    metrics = [i.metrics for infos, _ in a for i in infos]
    assert None in metrics and {"acc": 0.5} in metrics
    assert any(m and m.get("loss") != m.get("loss") for m in metrics)  # NaN
    for infos, opts in a:
        keep = steps_to_keep(infos, **opts)
        assert keep <= {i.step for i in infos}
        assert "saved {" in labkit.describe_retention(infos, opts)


def test_temporary_names_are_recognised():
    assert is_temporary("step_3.minickpt-tmp-0badc0de") and is_temporary("9.minickpt-del-1")
    assert not is_temporary("step_3.tmp") and not is_temporary("model_4")


# ---- task 2.3 on its own: labkit.crash_commit -------------------------------------------
def replaces_existing(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    batch = sync or SyncBatch(fs)
    for d in _dirs(tmp_dir, subdirs):
        batch.add_dir(d)
    batch.flush()
    if fs.exists(final_dir):
        fs.rmtree(final_dir)
    fs.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


@pytest.mark.task("2.3")
@pytest.mark.parametrize("kw", [{}, {"caller_batch": False}, {"subdirs": ("a", "a/b")},
                                {"existing": True}])
def test_the_reference_commit_survives_a_hand_made_save_crashed_everywhere(kw):
    report = labkit.crash_commit(commit, **kw)
    assert report.points > 10 and not report.problems, report.first()


@pytest.mark.task("2.3")
@pytest.mark.parametrize("wrong, kw, said", [
    (rename_first, {}, "exists but is torn"),
    (no_dir_fsync, {}, "exists but is torn"),
    (no_parent_fsync, {}, "its rename is not durable yet"),
    (replaces_existing, {"existing": True}, "crash states lost the old checkpoint"),
], ids=["rename-first", "no-dir-fsync", "no-parent-fsync", "replaces-existing"])
def test_crash_commit_catches_each_wrong_design(wrong, kw, said):
    report = labkit.crash_commit(wrong, **kw)
    assert any(said in p for p in report.problems), report.problems[:3]
    assert "/dev/shm" not in report.first()


def renames_around_fs(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    """A right order of calls, but its rename is os.rename: the crash test cannot see it."""
    batch = sync or SyncBatch(fs)
    for d in _dirs(tmp_dir, subdirs):
        batch.add_dir(d)
    batch.flush()
    os.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


@pytest.mark.task("2.3")
def test_a_rename_that_bypasses_fs_is_named_first():
    """A fresh student's report: os.rename in the commit left one cryptic problem ("its rename
    is not durable yet") although their order of calls was right."""
    report = labkit.crash_commit(renames_around_fs)
    assert "no rename went through the fs" in report.first(), report.problems[:2]


def trusts_sync_none(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    """sync=None read as "everything is durable already": the directories are never fsynced."""
    if sync is not None:
        for d in _dirs(tmp_dir, subdirs):
            sync.add_dir(d)
        sync.flush()
    fs.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


@pytest.mark.task("2.3")
def test_sync_none_promises_the_files_data_only_and_crash_commit_says_so():
    """The contract's clause: with sync=None the names in tmp_dir are still the commit's to make
    durable; a commit that trusts sync=None for them passes with a batch and tears without."""
    assert not labkit.crash_commit(trusts_sync_none).problems
    report = labkit.crash_commit(trusts_sync_none, caller_batch=False)
    assert any("exists but is torn" in p for p in report.problems), report.problems[:3]


@pytest.mark.task("2.4")
def test_cleanup_makes_a_killed_deletes_rename_durable_before_removing_its_files():
    """A background delete killed after its rename, before its fsync: the cleanup of the next
    manager must fsync the run directory before removing the files, or a power cut brings the
    step back torn (issue 39: 6 distinct problems before the fix)."""
    for kw in ({"before": (1, 2), "step": 3, "max_to_keep": 2}, {"before": (1,), "step": 2, "max_to_keep": 1}):
        report = labkit.crash_every_call(leftovers=True, retired=(1,), **kw)
        assert report.points > 20 and not report.problems, report.first()

    def no_fsync_first(fs, root):
        removed = [n for n in sorted(fs.listdir(root)) if is_temporary(n)]
        for n in removed:
            fs.rmtree(os.path.join(root, n))
        if removed:
            fs.fsync_dir(root)
        return removed

    no_fsync_first.__name__ = "cleanup_temporaries"
    report = labkit.crash_every_call(no_fsync_first, leftovers=True, retired=(1,))
    assert any("step 1 is listed but damaged" in p for p in report.problems), report.problems[:2]
