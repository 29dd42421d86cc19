"""The suite's async throughput figure alone, for several writer settings, interleaved.

    python -m benchmarks.async_throughput [--mb 400] [--reps 3] [--variants copy pinned ...]

A variant names how the async snapshot and writer run: ``copy`` (every CPU array copied,
``MINICKPT_ASYNC_SNAPSHOT=copy``), ``pinned`` (zero-copy pinned views, the default) and
``pinned-nice<K>`` (pinned, writer thread at nice +K, Linux), ``pinned-switch<U>`` (pinned,
the GIL's switch interval ``sys.setswitchinterval`` at U µs while measured) and ``pinned-1thread`` (pinned,
checksums computed in the writer thread instead of a second thread) — the last two are
experiments that did not help (see the commit log) — and ``pinned-buffered`` (pinned, data
files written through the page cache: ``MINICKPT_DIRECT_IO=off``; the default writes large
files with O_DIRECT). Each repetition runs every variant once,
in turn, so that a change of load on a shared machine affects them all alike. The figure is
:func:`benchmarks.async_figs.throughput_row`: steps/s with an async save every N steps ÷
steps/s without, N chosen per variant so that one background write takes about half the N
steps' compute, or ``--every N`` for all (the suite itself runs both libraries at the same
N: :func:`benchmarks.async_figs.equal_n_rows`); also printed: the time ``save()`` blocks,
median over the repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

import minickpt.format.encode as item_encode
import minickpt.format.read as item_read

from . import async_figs, states
from .contenders import MinickptManager

MB = 1 << 20


def make_adapter(workdir: str, tree: Any, variant: str) -> MinickptManager:
    """The suite's minickpt adapter, its async checkpointer set up as ``variant`` says."""
    ad = MinickptManager(workdir, tree, async_=True)
    ck = ad.mngr._async
    assert ck is not None
    ck.zero_copy = not variant.startswith("copy")
    if "nice" in variant:  # every write phase starts by lowering its thread's priority
        nice, writer = int(variant.split("nice")[1].split("-")[0]), ck._writer
        start = writer.start

        def nice_start(fn: Any, *, what: str) -> None:
            def niced() -> Any:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid,
                               os.getpriority(os.PRIO_PROCESS, tid) + nice)
                return fn()

            start(niced, what=what)

        writer.start = nice_start  # type: ignore[method-assign]
    return ad


@contextlib.contextmanager
def setup(variant: str) -> Iterator[None]:
    """Process-wide settings of a variant, for the time it is measured."""
    mods = (item_encode, item_read)  # each reads the threshold from its own globals
    old = [m._CRC_IN_THREAD_BYTES for m in mods]
    old_direct = os.environ.get(item_encode.DIRECT_IO_ENV)
    old_switch = sys.getswitchinterval()
    if "switch" in variant:  # the GIL's switch interval, in µs (Python's default: 5000)
        sys.setswitchinterval(int(variant.split("switch")[1].split("-")[0]) / 1e6)
    if variant.endswith("1thread"):
        for m in mods:
            m._CRC_IN_THREAD_BYTES = 1 << 62
    if variant.endswith("buffered"):
        os.environ[item_encode.DIRECT_IO_ENV] = "off"
    try:
        yield
    finally:
        sys.setswitchinterval(old_switch)
        for m, v in zip(mods, old, strict=True):
            m._CRC_IN_THREAD_BYTES = v
        if old_direct is None:
            os.environ.pop(item_encode.DIRECT_IO_ENV, None)
        else:
            os.environ[item_encode.DIRECT_IO_ENV] = old_direct


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=400, help="state size in MiB (suite: 400)")
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--reps", type=int, default=3, help="repetitions of every variant")
    p.add_argument("--intervals", type=int, default=3, help="saves per loop (suite: 3)")
    p.add_argument("--variants", nargs="+", default=["copy", "pinned"])
    p.add_argument("--every", type=int, default=None,
                   help="save every N steps for every variant (default: N as the suite "
                        "chooses it, from each variant's measured write time)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = p.parse_args(argv)

    tree = jax.block_until_ready(states.uniform(a.mb * MB, a.leaves, seed=7))
    root = tempfile.mkdtemp(prefix="minickpt-thr-", dir=a.dir)
    ratios: dict[str, list[float]] = {v: [] for v in a.variants}
    blocked: dict[str, list[float]] = {v: [] for v in a.variants}
    every: dict[str, list[int]] = {v: [] for v in a.variants}
    writer_cpu: dict[str, list[float]] = {v: [] for v in a.variants}
    try:
        adapters = {v: make_adapter(os.path.join(root, v), tree, v) for v in a.variants}
        tc = async_figs.step_time(tree)
        print(f"{states.nbytes(tree) / 1e6:.0f} MB state, {a.leaves} leaves; step "
              f"{tc * 1e3:.1f} ms; load {os.getloadavg()[0]:.1f}", flush=True)
        def measure(v: str, ad: MinickptManager, rep: int) -> None:
            wt = {v: async_figs.background_write_time(tree, ad)}
            writer_cpu[v].append(async_figs.save_cost(tree, ad)["cpu_s"])  # alone, as the suite
            measured = wt[v]
            if a.every:  # capped by max_every below: N = a.every exactly
                wt = {v: 1e9}
            for _ in range(3):  # the time save() blocks, without training
                ad.wait()
                t0 = time.perf_counter()
                ad.save_now(tree)
                blocked[v].append(time.perf_counter() - t0)
            ad.wait()
            row, detail = async_figs.throughput_row(tree, {v: ad}, wt, reps=1,
                                                    intervals=a.intervals, label=v,
                                                    max_every=a.every or 1000,
                                                    nbytes=states.nbytes(tree))
            r = row.samples[v][0]
            ratios[v].append(r)
            every[v].append(detail[v]["every_n_steps"])
            print(f"rep {rep} {v:16s} ratio {r:.3f}  N {detail[v]['every_n_steps']}  "
                  f"write {measured * 1e3:.0f} ms  writer CPU {writer_cpu[v][-1] * 1e3:.0f} ms  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)

        for rep in range(a.reps):
            for v, ad in adapters.items():
                with setup(v):
                    measure(v, ad, rep)
        for ad in adapters.values():
            ad.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'variant':16s} {'ratio median':>12s} {'min':>6s} {'max':>6s} "
          f"{'blocked median':>15s} {'writer CPU/save':>16s}  N")
    for v in a.variants:
        print(f"{v:16s} {statistics.median(ratios[v]):12.3f} {min(ratios[v]):6.3f} "
              f"{max(ratios[v]):6.3f} {statistics.median(blocked[v]) * 1e3:12.1f} ms "
              f"{statistics.median(writer_cpu[v]) * 1e3:13.0f} ms  {sorted(set(every[v]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
