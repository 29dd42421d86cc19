"""Large data files are written with O_DIRECT, past the page cache (issue 19): the same bytes
on disk as the buffered path, at any size; a clean fallback where O_DIRECT is refused; and
no committed-but-corrupt checkpoint whichever single call of a direct write fails or crashes.

The tests lower the size threshold and the chunk size so that small states take the direct
path through several chunks (the real ones are MiB: see ``minickpt.format.encode``)."""

import errno
import itertools
import logging
import mmap
import os
import threading

import numpy as np
import pytest
from crash_harness import Scenario, _run_and_drop, explore_scenario, scratch
from crash_harness import items as small_items
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minickpt.crashsim as crashsim
import minickpt.format.encode as ie
import minickpt.fs as mfs
from minickpt import Checkpointer, CheckpointManager, CheckpointManagerOptions
from minickpt.faults import FaultyFileSystem, SimulatedCrash
from minickpt.fs import O_DIRECT, FileSystem

pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")

BLOCK = 4096
CHUNK = 4 * BLOCK


@pytest.fixture(autouse=True)
def small_direct(monkeypatch):
    """Every data file of 1 MiB or more (below that a save joins its leaves into one write)
    takes the direct path, in chunks of 16 KiB."""
    monkeypatch.setattr(ie, "DIRECT_IO_MIN_BYTES", 0)
    monkeypatch.setattr(mfs, "DIRECT_CHUNK", CHUNK)
    monkeypatch.delenv(ie.DIRECT_IO_ENV, raising=False)


class DirectSpy(FileSystem):
    """Records which descriptors were opened with O_DIRECT, and what was written to them."""

    def __init__(self, refuse: str | None = None):
        self.direct: set[int] = set()
        self.direct_writes = 0
        self.refuse = refuse  # "open" or "write": answer EINVAL there, as some systems do
        self.truncates: list[int] = []
        self.lock = threading.Lock()
        self.zero_copy = 0  # direct writes straight from the leaves' memory

    def open(self, path, flags, mode=0o644):
        if flags & O_DIRECT and self.refuse == "open":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        fd = super().open(path, flags, mode)
        if flags & O_DIRECT:
            self.direct.add(fd)
        return fd

    def pwrite(self, fd, data, offset):
        if fd in self.direct:
            if self.refuse == "write":
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            with self.lock:
                self.direct_writes += 1
                self.zero_copy += not isinstance(memoryview(data).obj, mmap.mmap)
        return super().pwrite(fd, data, offset)

    def ftruncate(self, fd, length):
        self.truncates.append(length)
        return super().ftruncate(fd, length)

    def close(self, fd):
        self.direct.discard(fd)
        return super().close(fd)


def _direct_file(fs: FileSystem, path: str, bufs, **kw) -> int:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        dfd = fs.open_direct(path)
        try:
            n = fs.write_all_direct(dfd, bufs, **kw)
            fs.fsync(dfd)
        finally:
            fs.close(dfd)
    finally:
        fs.close(fd)
    return n


# ---------------------------------------------------------------------------------------
# the bytes: any size, any split into buffers, exactly what a buffered write leaves
# ---------------------------------------------------------------------------------------
EDGE_SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 77]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 6 * CHUNK)),
       st.lists(st.integers(0, 3 * CHUNK), max_size=6), st.sampled_from([1, 2, 3, 5]),
       st.sampled_from([None, 1, 4]), st.booleans(), st.booleans())
def test_a_direct_write_leaves_exactly_the_bytes_at_any_size(total, cuts, depth, in_flight,
                                                             sized, paged):
    """Any split into buffers; with ``paged`` the data starts on a page, so every buffer is
    page-congruent with its place in the file and its middle is written without a copy."""
    import tempfile

    data = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8)
    if paged:
        data = _at_page_offset(data, within=0)
    edges = sorted({0, total, *(c for c in cuts if c < total)})
    bufs = [data[a:b] for a, b in itertools.pairwise(edges)]  # unaligned views
    fs = DirectSpy()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        n = _direct_file(fs, path, bufs, chunk=CHUNK, depth=depth, in_flight=in_flight,
                         size=total if sized else None)
        with open(path, "rb") as f:
            assert f.read() == data.tobytes(), f"{total} bytes in {len(bufs)} buffers"
    assert n == total
    if fs.zero_copy == 0:
        assert fs.direct_writes == -(-total // CHUNK)  # whole chunks, then one padded tail
    if paged and any(len(b) >= CHUNK + BLOCK for b in bufs):
        assert fs.zero_copy > 0, "page-congruent buffers were copied"
    assert fs.truncates == ([total] if total % BLOCK else [])  # cut only a padded tail


def _state(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Leaves of odd sizes, so that no leaf starts or ends on a block boundary."""
    rng = np.random.default_rng(seed)
    sizes = [nbytes // 3 + 5, nbytes // 3 - 3, nbytes - 2 * (nbytes // 3) - 2]
    return {f"l{i}": rng.integers(0, 256, s, dtype=np.uint8) for i, s in enumerate(sizes)}


def _placed(tree: dict[str, np.ndarray], aligned: bool) -> dict[str, np.ndarray]:
    """The same leaves in 64-byte aligned memory (as JAX's host buffers are), or at an odd
    address (never page-congruent with the file)."""
    from minickpt.format.buffers import aligned_empty

    out = {}
    for k, v in tree.items():
        out[k] = aligned_empty(v.shape, v.dtype) if aligned else \
            np.empty(v.nbytes + 1, np.uint8)[1:].view(v.dtype)
        out[k][...] = v
    return out


@pytest.mark.parametrize("aligned", [False, True], ids=["packed", "page-congruent"])
@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 1, (1 << 20) + BLOCK - 1, 3 << 20])
def test_a_direct_save_is_byte_identical_to_a_buffered_one(nbytes, aligned, tmp_path,
                                                           monkeypatch):
    """Byte for byte what the buffered path writes for the same layout; 64-byte aligned
    leaves are laid out page-congruent and written from their own memory, the others
    copied through the bounce buffers."""
    tree = {"s": _placed(_state(nbytes), aligned)}
    spy = DirectSpy()
    Checkpointer(spy).save(str(tmp_path / "direct"), tree)
    assert spy.direct_writes >= nbytes // CHUNK, "the data file was not written with O_DIRECT"
    if aligned:
        assert spy.zero_copy >= spy.direct_writes - 8, "aligned leaves were copied"
    else:
        assert spy.zero_copy == 0
    plan = ie.plan_item(tree["s"])  # the same layout as the save's
    monkeypatch.setenv(ie.DIRECT_IO_ENV, "off")
    spy2 = DirectSpy()
    os.makedirs(tmp_path / "buffered")
    ie.write_item(spy2, str(tmp_path / "buffered"), plan)
    assert spy2.direct_writes == 0, "MINICKPT_DIRECT_IO=off did not turn O_DIRECT off"
    assert (tmp_path / "direct" / "s" / "data.bin").read_bytes() == \
        (tmp_path / "buffered" / "data.bin").read_bytes()
    got = Checkpointer().restore(str(tmp_path / "direct"))["s"]
    assert all(np.array_equal(got[k], v) for k, v in tree["s"].items())
    assert Checkpointer().verify(str(tmp_path / "direct")).ok
    Checkpointer().save(str(tmp_path / "off"), tree)  # MINICKPT_DIRECT_IO=off: buffered,
    for name in ("data.bin", "manifest.json"):  # and the same layout, the same bytes
        assert (tmp_path / "off" / "s" / name).read_bytes() == \
            (tmp_path / "direct" / "s" / name).read_bytes(), name


@pytest.mark.parametrize("leaf", ["numpy", "jax"])
def test_an_async_snapshot_is_written_from_its_own_memory(leaf, tmp_path):
    """An async save's snapshot is a fresh copy: laid out page-congruent and written with
    no bounce copy, whatever the alignment of the caller's arrays."""
    import jax

    from minickpt import AsyncCheckpointer

    state = _state(3 << 20)
    tree = {"s": _placed(state, aligned=False) if leaf == "numpy"
            else {k: jax.numpy.asarray(v) for k, v in state.items()}}
    spy = DirectSpy()
    ckpt = AsyncCheckpointer(spy)
    ckpt.save(str(tmp_path / "a"), tree)
    ckpt.wait_until_finished()
    assert spy.direct_writes >= (3 << 20) // CHUNK
    assert spy.zero_copy >= spy.direct_writes - 8, "the snapshot was copied a second time"
    got = Checkpointer().restore(str(tmp_path / "a"))["s"]
    assert all(np.array_equal(got[k], v) for k, v in state.items())


def test_small_files_and_unsynced_saves_stay_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(ie, "DIRECT_IO_MIN_BYTES", 32 << 20)
    spy = DirectSpy()
    Checkpointer(spy).save(str(tmp_path / "a"), {"s": _state(2 << 20)})
    assert spy.direct_writes == 0, "a file under the threshold was written with O_DIRECT"
    monkeypatch.setattr(ie, "DIRECT_IO_MIN_BYTES", 0)
    fs = FaultyFileSystem(ops=())
    ie.write_item(fs, _mkdir(tmp_path / "b"), ie.plan_item(_state(2 << 20)), fsync=False)
    assert not [a for op, a in fs.calls if op == "open" and a[1] & O_DIRECT], \
        "an unsynced write went through O_DIRECT (no gain: it waits for the disk)"


def _mkdir(p) -> str:
    os.makedirs(p)
    return str(p)


class InFlightSpy(DirectSpy):
    """Holds each direct write (after the first, which runs alone) until ``want`` are in
    flight together, or 5 s passed; records the most seen at once, and can fail one."""

    def __init__(self, want: int, fail_nth: int | None = None):
        super().__init__()
        self.want, self.fail_nth = want, fail_nth
        self.active = self.most = self.seen = 0
        self.cv = threading.Condition()

    def pwrite(self, fd, data, offset):
        if fd not in self.direct:
            return super().pwrite(fd, data, offset)
        with self.cv:
            self.seen += 1
            nth = self.seen
            self.active += 1
            self.most = max(self.most, self.active)
            self.cv.notify_all()
            if nth > 1:
                self.cv.wait_for(lambda: self.active >= self.want, timeout=5)
        try:
            if nth == self.fail_nth:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return super().pwrite(fd, data, offset)
        finally:
            with self.cv:
                self.active -= 1
                self.cv.notify_all()


def test_a_large_file_has_four_direct_writes_in_flight(tmp_path):
    tree = {"s": _state(2 << 20)}
    spy = InFlightSpy(want=mfs.DIRECT_IN_FLIGHT)
    Checkpointer(spy).save(str(tmp_path / "a"), tree)
    assert spy.most == mfs.DIRECT_IN_FLIGHT == 4, f"at most {spy.most} writes in flight"
    got = Checkpointer().restore(str(tmp_path / "a"))["s"]
    assert all(np.array_equal(got[k], v) for k, v in tree["s"].items())


@pytest.mark.parametrize("nth", [2, 5, 40])
def test_a_write_failing_while_others_are_in_flight_fails_the_save_cleanly(nth, tmp_path):
    """The failed write's error reaches the caller after every write in flight finished;
    no write starts after it, no thread is left, the older checkpoint is untouched."""
    old, new = {"s": _state(1 << 20, seed=1)}, {"s": _state(2 << 20, seed=2)}
    root = str(tmp_path / "run")
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2)) as m:
        m.save(1, old)
    before = {t.ident for t in threading.enumerate()}
    spy = InFlightSpy(want=2, fail_nth=nth)
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=spy) as m:
        with pytest.raises(OSError) as e:
            m.save(2, new)
        assert e.value.errno == errno.EIO
        assert spy.seen < nth + 2 * mfs.DIRECT_IN_FLIGHT, "writes went on after the failure"
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()
            and t.name.startswith("minickpt-dio")]
    assert not left, left
    assert sorted(os.listdir(root)) == [n for n in sorted(os.listdir(root))
                                        if not n.startswith("step_2")]
    with CheckpointManager(root, CheckpointManagerOptions(read_only=True)) as fresh:
        assert fresh.all_steps() == [1]
        got = fresh.restore(1)["s"]
        assert all(np.array_equal(got[k], v) for k, v in old["s"].items())


def test_the_data_file_is_allocated_first_and_a_full_disk_fails_before_any_write(tmp_path):
    tree = {"s": _state((2 << 20) + 3)}
    fs = FaultyFileSystem()
    Checkpointer(fs).save(str(tmp_path / "a"), tree)
    ops = [op for op, _ in fs.calls]
    assert "allocate" in ops and ops.index("allocate") < ops.index("pwrite")
    full = FaultyFileSystem(error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                            ops={"allocate"}, fail_at=0)
    with pytest.raises(OSError) as e:
        Checkpointer(full).save(str(tmp_path / "b"), tree)
    assert e.value.errno == errno.ENOSPC
    assert not [op for op, _ in full.calls if op == "pwrite"], "wrote after ENOSPC"
    assert sorted(os.listdir(tmp_path)) == ["a"]


class NoAllocate(DirectSpy):
    def allocate(self, fd, length):
        return False  # a file system without fallocate


def test_without_fallocate_the_writes_in_flight_leave_the_same_bytes(tmp_path):
    tree = {"s": _state((3 << 20) + 5)}
    Checkpointer(NoAllocate()).save(str(tmp_path / "a"), tree)
    Checkpointer().save(str(tmp_path / "b"), tree)
    for name in ("data.bin", "manifest.json"):
        assert (tmp_path / "a" / "s" / name).read_bytes() == \
            (tmp_path / "b" / "s" / name).read_bytes(), name


def test_no_thread_outlives_a_direct_save(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    Checkpointer().save(str(tmp_path / "a"), {"s": _state(2 << 20)})
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()
            and t.name.startswith("minickpt-dio")]
    assert not left, left


# ---------------------------------------------------------------------------------------
# refused: tmpfs of old kernels (EINVAL at open), some file systems (EINVAL at the first
# write), macOS (no O_DIRECT) — written buffered, silently, logged at debug level
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["open", "write"])
def test_a_refused_o_direct_falls_back_to_the_same_bytes(where, tmp_path, caplog, monkeypatch):
    tree = {"s": _state((2 << 20) + 3)}
    monkeypatch.setattr(ie, "_REFUSALS_LOGGED", set())
    spy = DirectSpy(refuse=where)
    with caplog.at_level(logging.DEBUG, logger="minickpt"):
        Checkpointer(spy).save(str(tmp_path / "refused"), tree)
    assert spy.direct_writes == 0
    assert any("O_DIRECT refused" in r.getMessage() for r in caplog.records), \
        "the fallback left no trace at debug level"
    Checkpointer().save(str(tmp_path / "direct"), tree)
    for name in ("data.bin", "manifest.json"):
        assert (tmp_path / "refused" / "s" / name).read_bytes() == \
            (tmp_path / "direct" / "s" / name).read_bytes(), name
    assert Checkpointer().verify(str(tmp_path / "refused")).ok
    assert not spy.direct, "a descriptor of the refused attempt was left open"


def test_einval_after_the_first_direct_write_is_an_error_not_a_fallback(tmp_path):
    """Once bytes went out with O_DIRECT, a refusal is a real failure: the save fails, and
    nothing is committed."""
    fs = FaultyFileSystem(error=OSError(errno.EINVAL, os.strerror(errno.EINVAL)),
                          ops={"pwrite"}, fail_at=2)
    with pytest.raises(OSError) as e:
        Checkpointer(fs).save(str(tmp_path / "a"), {"s": _state(2 << 20)})
    assert e.value.errno == errno.EINVAL
    assert not (tmp_path / "a").exists()
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------
# faults and crashes at every call of a direct save
# ---------------------------------------------------------------------------------------
def _calls_of_a_save(root: str, tree) -> int:
    fs = FaultyFileSystem()
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=fs) as m:
        n0 = fs.count
        m.save(2, tree)
        n = fs.count - n0
    assert any(op == "open" and a[1] & O_DIRECT for op, a in fs.calls), "no direct write"
    return n


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash", [False, True], ids=["EIO", "crash"])
def test_a_fault_at_any_call_of_a_direct_save_commits_nothing_corrupt(crash, tmp_path):
    old, new = {"s": _state(1 << 20, seed=1)}, {"s": _state(1 << 20, seed=2)}
    n = _calls_of_a_save(str(tmp_path / "probe"), new)
    assert n > 15
    wrong = []
    for k in range(n):
        root = str(tmp_path / f"k{k}")
        with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2)) as m:
            m.save(1, old)
        fs = FaultyFileSystem(crash=crash)
        m = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=fs)
        fs.fail_at = fs.count + k
        try:
            m.save(2, new)
        except (OSError, SimulatedCrash):
            pass
        finally:
            fs.fail_at = None
            if not crash:
                m.close()
        # read-only: after a simulated crash the dead manager still holds the directory's lock
        with CheckpointManager(root, CheckpointManagerOptions(read_only=True)) as fresh:
            for step in fresh.all_steps():
                want = old if step == 1 else new
                if not fresh.verify(step).ok:
                    wrong.append(f"call {k}: step {step} listed but damaged")
                    continue
                got = fresh.restore(step)["s"]
                if not all(np.array_equal(got[x], want["s"][x]) for x in want["s"]):
                    wrong.append(f"call {k}: step {step} restores other bytes")
            if 1 not in fresh.all_steps():
                wrong.append(f"call {k}: the old checkpoint was lost")
    assert not wrong, "\n".join(wrong[:10])


def _at_page_offset(a: np.ndarray, within: int = 64) -> np.ndarray:
    """``a`` copied to memory ``within`` bytes past a page boundary, as JAX's large host
    buffers are: the save's layout (page-congruent) and its calls are then the same on
    every run, as the crash explorer needs."""
    raw = np.empty(a.nbytes + 8192, np.uint8)
    start = (within - raw.ctypes.data) % 4096
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _big_items(step: int, size: int = 300):
    out = small_items(step)
    # 1.2 MB: direct, and mostly written from its own memory (zero-copy)
    out["params"]["w"] = _at_page_offset(np.arange(300_000, dtype=np.float32) + step)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_crash_point_of_a_direct_save_leaves_the_old_or_the_new_checkpoint(tmp_path,
                                                                                 monkeypatch):
    import crash_harness as ch

    def check(restored, step, size=300):  # the harness's check, for the large "w"
        want = _big_items(step)
        assert np.array_equal(restored["params"]["w"], want["params"]["w"]), \
            f"step {step}: params/w differs"
        assert restored["opt"]["count"] == step

    monkeypatch.setattr(ch, "check_items", check)
    monkeypatch.setattr(ch, "items", _big_items)
    # writes in flight finish in any order: un-synced data may also come back with holes
    monkeypatch.setattr(crashsim.CrashRecorder, "data_modes", crashsim.IN_FLIGHT_MODES)
    direct = []
    write_direct = ie._write_direct

    def spy(fs, path, plan):
        fd = write_direct(fs, path, plan)
        direct.append(fd is not None)
        return fd

    monkeypatch.setattr(ie, "_write_direct", spy)
    scn = Scenario("a direct save after one committed step",
                   setup=lambda w: ch._saved(w, [1]),
                   run=lambda fs, w: _run_and_drop(lambda: scn.manager(w, fs),
                                                   lambda m: m.save(2, _big_items(2))),
                   allowed={(1,), (1, 2)}, new=(2,))
    with scratch(str(tmp_path)) as d:
        figs = explore_scenario(scn, os.path.join(d, "w"), random_states=2)
    assert any(direct), "the scenario never wrote with O_DIRECT (refused here?)"
    assert not figs.failures, "\n".join(figs.failures)
    assert figs.survived == figs.crash_points > 30
