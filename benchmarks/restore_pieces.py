"""Where a tiny restore's time goes: minickpt's restore beside its floor, call by call.

    .venv/bin/python -m benchmarks.restore_pieces                  # in a folder here
    .venv/bin/python -m benchmarks.restore_pieces --dir /some/fs --reps 300

The tiny restore rows compare minickpt with :class:`benchmarks.floors.RestoreFloor` (every
file read whole, the arrays made with numpy and put with one ``jax.device_put``). This runs
both alternately, each after a ``gc.collect()`` as in the suite, with every file-system call
timed by name through one thin wrapper (``os.open``, ``os.lstat``, ``os.fstat``, ``os.preadv``,
``os.read``, ``os.close``, ``os.listdir``), and three pieces of minickpt timed as a whole:
the metadata (``read_metadata``), the manifest (``read_manifest``) and the placing of the
arrays (``put_many``). Where a path-based call costs much (a 9p file system under gVisor,
each lookup revalidated), the difference shows in the per-call lines (issue 51).
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

_OS_CALLS = ("open", "lstat", "stat", "fstat", "preadv", "read", "close", "listdir")


@contextmanager
def _timed(log: list[tuple[str, int, int]]) -> Iterator[None]:
    import minickpt.checkpointer as ck
    import minickpt.restore as rs

    targets = [(os, n, n) for n in _OS_CALLS]
    targets += [(ck, "read_metadata", "py:read_metadata"), (ck, "read_manifest",
                                                             "py:read_manifest"),
                (rs, "put_many", "py:put_many")]
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


def measure(workdir: str, reps: int = 200) -> dict[str, Any]:
    """Medians in µs over ``reps`` alternating pairs (minickpt restore, floor)."""
    import jax

    import minickpt

    from . import floors, states
    from .contenders import ITEM

    tree = states.tiny()
    target = {ITEM: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)}
    path = os.path.join(workdir, "ck")
    ck = minickpt.Checkpointer()
    ck.save(path, {ITEM: tree})
    floor = floors.RestoreFloor(path)
    runs = {"minickpt": lambda: jax.block_until_ready(ck.restore(path, target)),
            "floor": lambda: floor.run()}
    for f in runs.values():  # warm up: compilation, caches, the fast put's check
        for _ in range(10):
            f()
    out: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list) for k in runs}
    log: list[tuple[str, int, int]] = []
    with _timed(log):
        for i in range(reps):
            for who in ("minickpt", "floor") if i % 2 else ("floor", "minickpt"):
                gc.collect()
                gc.disable()
                log.clear()
                t = time.perf_counter_ns()
                runs[who]()
                total = time.perf_counter_ns() - t
                gc.enable()
                per: dict[str, float] = collections.Counter()
                counts: dict[str, int] = collections.Counter()
                sys_ns = 0
                for kind, s, e in log:
                    per[kind] += (e - s) / 1e3
                    counts[kind] += 1
                    if not kind.startswith("py:"):
                        sys_ns += e - s
                rec = out[who]
                rec["total"].append(total / 1e3)
                rec["file-system calls"].append(sys_ns / 1e3)
                rec["outside the calls"].append((total - sys_ns) / 1e3)
                for k in set(per) | set(_OS_CALLS):
                    rec[k].append(per.get(k, 0.0))
                    rec["n " + k].append(counts.get(k, 0))
    shutil.rmtree(path)
    return {"reps": reps, "workdir": workdir, "platform": jax.devices()[0].platform,
            "medians": {who: {k: statistics.median(v) for k, v in rec.items()}
                        for who, rec in out.items()}}


def report(res: dict[str, Any]) -> str:
    m, f = res["medians"]["minickpt"], res["medians"]["floor"]
    lines = [f"tiny restore (4 leaves) on {res['platform']}, medians of {res['reps']} "
             f"alternating pairs in {res['workdir']}, µs (calls per restore):",
             "| | minickpt | floor |", "|---|---|---|"]
    for k in ("total", "file-system calls", "outside the calls"):
        lines.append(f"| {k} | {m[k]:.0f} | {f[k]:.0f} |")
    for k in _OS_CALLS:
        if m.get("n " + k) or f.get("n " + k):
            lines.append(f"| · os.{k} | {m.get(k, 0):.0f} ({m.get('n ' + k, 0):.0f}) | "
                         f"{f.get(k, 0):.0f} ({f.get('n ' + k, 0):.0f}) |")
    for k in sorted(k for k in m if k.startswith("py:")):
        lines.append(f"| · {k[3:]} (with its calls) | {m[k]:.0f} | — |")
    lines.append(f"ratio {m['total'] / f['total']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restore_pieces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".", help="a folder on the file system to measure "
                   "(a scratch folder is made inside it and removed)")
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="minickpt-restore-pieces-", dir=a.dir)
    try:
        print(report(measure(work, a.reps)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
