"""A synchronous save writes each large device leaf as soon as its host copy has arrived
(issue 40, item 5): the writer takes the leaves in order and waits for leaf i's transfer only
when it is about to write leaf i, while the later transfers go on. The files are the same,
byte for byte, as those of the save that fetched every leaf first; an unsupported leaf is
still refused before anything is written, and a transfer that fails half-way through the
data file leaves nothing behind."""

import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minickpt import Checkpointer
from minickpt.errors import UnsupportedLeafError
from minickpt.format import encode
from minickpt.fs import FileSystem

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
LARGE = [f"w{i}" for i in range(5)]  # 5 × 8 MiB: a data file written with O_DIRECT, if allowed
DEVICE = ["empty", "small", "step", *LARGE]  # _state()'s device arrays, in tree order


def _state() -> dict:
    rng = np.random.default_rng(0)
    arrays = {k: jnp.asarray(rng.standard_normal(8 * MIB // 4, dtype=np.float32))
              for k in LARGE}
    return {**arrays, "host": rng.standard_normal(1000).astype(np.float64),
            "small": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
            "step": jnp.asarray(7, jnp.int32), "count": 3, "lr": np.float32(0.5),
            "key": jax.random.key(1), "empty": jnp.zeros((0, 4), jnp.float32),
            "name": "run", "nothing": None}


@pytest.fixture(params=["direct", "buffered"])
def io(request, monkeypatch):
    """Both ways a large data file is written: O_DIRECT (where the file system allows it) and
    through the page cache."""
    if request.param == "buffered":
        monkeypatch.setenv("MINICKPT_DIRECT_IO", "0")
    return request.param


class _Recorder(FileSystem):
    """Records, in one list with the leaf waits, how many bytes of a data file were written."""

    def __init__(self, events: list):
        self.events = events
        self.data_fds: set[int] = set()

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        if os.path.basename(path) == "data.bin":
            self.data_fds.add(fd)
        return fd

    def _note(self, fd, n):
        if fd in self.data_fds and n > 0:
            self.events.append(("wrote", n))
        return n

    def write(self, fd, data):
        return self._note(fd, super().write(fd, data))

    def writev(self, fd, buffers):
        return self._note(fd, super().writev(fd, buffers))

    def pwrite(self, fd, data, offset):
        return self._note(fd, super().pwrite(fd, data, offset))


def _record_waits(monkeypatch, events: list, fail_at: str | None = None):
    """Wrap the writer's per-leaf wait for a transfer (``encode._wait_for_host``): each wait is
    recorded; the one for ``fail_at`` raises, as a failed device-to-host copy would."""
    real = getattr(encode, "_wait_for_host", None)

    def wait(leaf, path):
        events.append(("wait", path))
        if path == fail_at:
            raise RuntimeError(f"simulated transfer failure for {path}")
        return real(leaf, path)

    monkeypatch.setattr(encode, "_wait_for_host", wait, raising=False)


def _item_files(path) -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            if f == "_CHECKPOINT_METADATA" or f.startswith("metadata"):
                continue  # times of the save, which differ from run to run
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(
                    fh.read()).hexdigest()
    return out


def test_the_first_leaf_is_written_before_the_last_transfer_is_waited_for(tmp_path, io,
                                                                          monkeypatch):
    events: list = []
    _record_waits(monkeypatch, events)
    recorded = encode._wait_for_host

    def wait(leaf, path):
        # the last leaf's transfer is slow: a save that streams writes the first leaf meanwhile
        # (in its writer, however loaded the machine); one that waits for every transfer
        # first writes nothing before it, and fails after the 20 s
        if path == LARGE[-1]:
            deadline = time.monotonic() + 20.0
            while time.monotonic() < deadline and \
                    sum(n for kind, n in list(events) if kind == "wrote") < 8 * MIB:
                time.sleep(0.01)
        return recorded(leaf, path)

    monkeypatch.setattr(encode, "_wait_for_host", wait)
    state = _state()
    Checkpointer(_Recorder(events)).save(tmp_path / "ck", {"state": state}, step=1)
    waits = [e[1] for e in events if e[0] == "wait"]
    assert waits == DEVICE, "each device array is waited for once, in tree order"
    last = events.index(("wait", LARGE[-1]))
    written_before = sum(n for kind, n in events[:last] if kind == "wrote")
    assert written_before >= 8 * MIB, \
        "the first leaf's bytes reach the file before the last leaf's transfer is waited for"
    out = Checkpointer().restore(tmp_path / "ck")["state"]
    for k in LARGE:
        assert np.array_equal(out[k], np.asarray(state[k])), k


def test_the_files_are_byte_for_byte_those_of_fetching_every_leaf_first(tmp_path, io):
    state = _state()
    ck = Checkpointer()
    ck.save(tmp_path / "streamed", {"state": state, "other": {"w": state["w0"] + 1}}, step=3)
    # the save as it was: every leaf brought to the host and laid out, then written
    plans = ck.plan({"state": state, "other": {"w": state["w0"] + 1}})
    assert all(getattr(p, "stream", None) is None for p in plans.values())
    ck.write(str(tmp_path / "fetched"), plans, step=3)
    streamed, fetched = _item_files(tmp_path / "streamed"), _item_files(tmp_path / "fetched")
    assert sorted(streamed) == sorted(fetched) and "state/data.bin" in streamed
    assert streamed == fetched
    assert ck.verify(tmp_path / "streamed").ok


def test_an_unsupported_leaf_is_refused_before_any_transfer_or_write(tmp_path, monkeypatch):
    events: list = []
    _record_waits(monkeypatch, events)
    state = {**_state(), "w2b": object()}  # between w2 and w3 in tree order
    with pytest.raises(UnsupportedLeafError, match="w2b"):
        Checkpointer(_Recorder(events)).save(tmp_path / "ck", {"state": state}, step=1)
    assert events == []
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", ["w0", "w3", LARGE[-1]])
def test_a_failed_transfer_leaves_no_step_and_no_temporary_files(tmp_path, io, monkeypatch,
                                                                 bad):
    events: list = []
    _record_waits(monkeypatch, events, fail_at=bad)
    with pytest.raises(RuntimeError, match="simulated transfer failure") as err:
        Checkpointer(_Recorder(events)).save(tmp_path / "ck", {"state": _state()}, step=1)
    assert any(bad in note for note in getattr(err.value, "__notes__", [])), \
        "the error says which leaf it was bringing over"
    assert os.listdir(tmp_path) == []
    assert [e[1] for e in events if e[0] == "wait"] == DEVICE[:DEVICE.index(bad) + 1]


def test_async_snapshots_are_not_streamed(tmp_path):
    """An async save's snapshot is complete when save() returns: nothing is left to fetch."""
    plans = Checkpointer().plan({"state": _state()}, copy=True)
    assert all(getattr(p, "stream", None) is None and all(e is not None for e in p.entries)
               for p in plans.values())
