"""Where a tiny save's time goes: minickpt's pieces beside the bare replay of its calls.

    .venv/bin/python -m benchmarks.tiny_pieces             # 150 pairs, in a folder here
    .venv/bin/python -m benchmarks.tiny_pieces --dir /dev/shm --reps 300

The tiny save row compares minickpt with the same system calls replayed bare
(:class:`benchmarks.floors.BareCalls`). This splits the difference. Both run alternately,
each after a ``gc.collect()`` as in the suite. Every system call of both is timed through
the same thin wrapper: the ``os`` functions, the group fsync's ``io_submit`` and the
no-replace rename. Three pieces of minickpt's Python are timed too: the snapshot
(``Checkpointer.plan``: tree walk, leaves to host, layout), the item's write
(``write_item``: checksums and manifest JSON, less its calls) and the metadata's JSON. The
snapshot and two of JAX's calls in it are then timed right after a collection and in a hot
loop: what cold caches cost code that runs once between two training steps.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_OS_CALLS = ("open", "write", "pwrite", "writev", "fsync", "close", "mkdir", "rename",
             "lstat", "fstat", "listdir", "unlink", "rmdir")


@contextmanager
def _timed(log: list[tuple[str, int, int]]) -> Iterator[None]:
    """Wrap the system calls and minickpt's three pieces; each call appends (kind, start,
    end) in nanoseconds."""
    import minickpt.aio as aio
    import minickpt.checkpointer as ck
    import minickpt.fs as mfs

    targets = [(os, n, "sys") for n in _OS_CALLS]
    targets += [(aio._AioRing, "fsync", "sys"), (mfs, "_rename_noreplace", "sys"),
                (ck.Checkpointer, "plan", "snapshot"), (ck, "write_item", "write_item"),
                (ck, "metadata_bytes", "metadata")]
    saved = []
    for obj, name, kind in targets:
        f = getattr(obj, name)
        saved.append((obj, name, f))

        def wrapper(*a: Any, _f: Callable[..., Any] = f, _k: str = kind, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return _f(*a, **k)
            finally:
                log.append((_k, t, time.perf_counter_ns()))

        setattr(obj, name, wrapper)
    try:
        yield
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)


def _sys_outside_pieces(log: list[tuple[str, int, int]]) -> tuple[int, dict[str, int]]:
    """Nanoseconds in system calls, and each piece's own Python (its time less the calls
    made inside it)."""
    calls = [(s, e) for kind, s, e in log if kind == "sys"]
    pieces: dict[str, int] = collections.Counter()
    for kind, s, e in log:
        if kind != "sys":
            pieces[kind] += (e - s) - sum(ce - cs for cs, ce in calls if s <= cs and ce <= e)
    return sum(e - s for s, e in calls), dict(pieces)


def measure(workdir: str, reps: int = 150) -> dict[str, Any]:
    """Medians in µs over ``reps`` alternating pairs (minickpt save, bare replay)."""
    import minickpt

    from . import floors, states
    from .contenders import ITEM
    from .suite import _mc_save

    tree = states.tiny()

    def save(fs: Any, root: str) -> None:  # the tiny save row's own save
        _mc_save(fs, root, tree)

    bare = floors.BareCalls(workdir, lambda root: None, save)
    ours: dict[str, list[float]] = collections.defaultdict(list)
    theirs: dict[str, list[float]] = collections.defaultdict(list)
    log: list[tuple[str, int, int]] = []
    try:
        with _timed(log):
            for i in range(reps):
                for who in ("minickpt", "bare") if i % 2 else ("bare", "minickpt"):
                    if who == "bare":
                        op = bare.op()
                        assert op.prepare is not None and op.after is not None
                        op.prepare()
                        run, after = op.run, op.after
                    else:
                        d = tempfile.mkdtemp(dir=workdir)
                        run, after = (lambda d=d: save(None, d)), (lambda d=d: shutil.rmtree(d))
                    gc.collect()
                    gc.disable()
                    log.clear()
                    t = time.perf_counter_ns()
                    run()
                    total = time.perf_counter_ns() - t
                    gc.enable()
                    entries = list(log)
                    after()
                    sys_ns, pieces = _sys_outside_pieces(entries)
                    out = ours if who == "minickpt" else theirs
                    out["total"].append(total / 1e3)
                    out["system calls"].append(sys_ns / 1e3)
                    out["outside the calls"].append((total - sys_ns) / 1e3)
                    for k, ns in pieces.items():
                        out[k].append(ns / 1e3)
    finally:
        bare.close()
    import jax
    import numpy as np

    ck = minickpt.Checkpointer()
    leaves = list(tree.values())
    cold_hot = {name: _cold_and_hot(f, reps) for name, f in [
        ("minickpt: the snapshot (Checkpointer.plan)", lambda: ck.plan({ITEM: tree})),
        ("JAX: tree_flatten_with_path", lambda: jax.tree_util.tree_flatten_with_path(tree)),
        ("JAX: np.asarray of the 4 arrays", lambda: [np.asarray(x) for x in leaves])]}
    med = {k: statistics.median(v) for k, v in ours.items()}
    return {"reps": reps, "workdir": workdir, "minickpt": med,
            "bare": {k: statistics.median(v) for k, v in theirs.items()},
            "cold and hot": cold_hot}


def _cold_and_hot(f: Callable[[], Any], reps: int) -> tuple[float, float]:
    """µs per call: the median right after a ``gc.collect()`` (as each repetition runs),
    and the mean in a loop of ten times as many calls (caches warm)."""
    cold = []
    for _ in range(reps):
        gc.collect()
        t = time.perf_counter_ns()
        f()
        cold.append((time.perf_counter_ns() - t) / 1e3)
    for _ in range(50):
        f()
    n = 10 * reps
    t = time.perf_counter_ns()
    for _ in range(n):
        f()
    return statistics.median(cold), (time.perf_counter_ns() - t) / n / 1e3


def report(res: dict[str, Any]) -> str:
    m, b = res["minickpt"], res["bare"]
    lines = [f"tiny save (4 leaves), medians of {res['reps']} alternating pairs in "
             f"{res['workdir']}, µs:",
             "| | minickpt | bare replay |", "|---|---|---|"]
    for k in ("total", "system calls", "outside the calls"):
        lines.append(f"| {k} | {m[k]:.0f} | {b[k]:.0f} |")
    for k in ("snapshot", "write_item", "metadata"):
        lines.append(f"| · {k}: Python | {m.get(k, 0):.0f} | — |")
    lines.append(f"ratio {m['total'] / b['total']:.2f}; minickpt's Python outside the calls "
                 f"{m['outside the calls'] - b['outside the calls']:.0f} µs more than the "
                 "replay's loop")
    lines += ["", "| µs per call | after gc.collect() | in a hot loop |", "|---|---|---|"]
    lines += [f"| {k} | {c:.1f} | {h:.1f} |" for k, (c, h) in res["cold and hot"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiny_pieces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".", help="a folder on the file system to measure "
                   "(a scratch folder is made inside it and removed)")
    p.add_argument("--reps", type=int, default=150)
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="minickpt-tiny-pieces-", dir=a.dir)
    try:
        print(report(measure(work, a.reps)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
