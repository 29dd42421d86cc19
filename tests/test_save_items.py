"""A save of several large items writes them at once, as a restore reads them (issue 51): the
same files byte for byte as one item after another, one fsync round still, and an error
reported for the first failing item in the checkpoint's order, leaving nothing behind."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from minickpt import Checkpointer
from minickpt import checkpointer as ckpt_mod
from minickpt.fs import FileSystem

pytestmark = pytest.mark.timeout(120)

ITEMS = 4  # 3 MiB each: each small, together worth writing in threads


def _items() -> dict:
    rng = np.random.default_rng(7)
    return {f"part{j}": {"w": rng.standard_normal((3 << 20) // 4, dtype=np.float32), "n": j}
            for j in range(ITEMS)}


class _Together(FileSystem):
    """Holds the first data write of each writer thread until two threads write at once:
    a save that writes its items one after another never gets past it (the barrier breaks)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=20)
        self.waited: set[str] = set()
        self.lock = threading.Lock()

    def open(self, path, flags, mode=0o644):
        me = threading.current_thread().name
        if path.endswith("data.bin") and me.startswith("minickpt-write"):
            with self.lock:
                first = me not in self.waited and len(self.waited) < 2
                if first:
                    self.waited.add(me)
            if first:
                self.barrier.wait()
        return super().open(path, flags, mode)


def _files(root) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f != "_CHECKPOINT_METADATA" and not f.startswith("_checkpoint"):
                p = os.path.join(dirpath, f)
                out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_items_are_written_at_once_and_their_files_are_the_same(tmp_path, monkeypatch):
    items = _items()
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a 1-core CI runner writes in turn
    fs = _Together()
    Checkpointer(fs).save(tmp_path / "together", items)
    assert len(fs.waited) == 2 and not fs.barrier.broken
    monkeypatch.setattr(ckpt_mod, "_ITEM_THREADS", 1)
    Checkpointer().save(tmp_path / "in_turn", items)
    a, b = _files(tmp_path / "together"), _files(tmp_path / "in_turn")
    items_only = {k: v for k, v in a.items() if os.sep in k}
    assert items_only == {k: v for k, v in b.items() if os.sep in k} and len(items_only) == 8
    out = Checkpointer().restore(tmp_path / "together")
    for k, v in items.items():
        assert np.array_equal(out[k]["w"], v["w"]) and out[k]["n"] == v["n"]


class _FailsOn(FileSystem):
    """An I/O error on opening the data files of the named items."""

    def __init__(self, bad: set[str]) -> None:
        self.bad = bad

    def open(self, path, flags, mode=0o644):
        if path.endswith("data.bin") and os.path.basename(os.path.dirname(path)) in self.bad:
            raise OSError(errno.EIO, f"injected error for {path}")
        return super().open(path, flags, mode)


def test_the_first_failing_item_in_order_is_reported_and_nothing_is_left(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    for _ in range(3):
        with pytest.raises(OSError, match="injected") as e:
            Checkpointer(_FailsOn({"part1", "part3"})).save(tmp_path / "ck", _items())
        assert "part1" in str(e.value) and "part3" not in str(e.value)
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
