"""Where an async save's cost to the training loop goes: each step's excess time, by what the
writer threads were doing when the step ended (issue 51: async throughput at Young's N).

    python -m benchmarks.async_phases [--mb 400] [--leaves 50] [--every 1000] [--intervals 3]

The loop is :func:`benchmarks.async_figs.run_loop`'s (a jitted step, synced every step), run
without saves and with an async save every N steps, interleaved ``--reps`` times. At the end of
every step the loop notes the innermost ``minickpt`` frame of each ``minickpt-*`` thread (the
writer, its checksum and snapshot helpers), or ``idle``. A step's excess is its time minus the
median step of the no-save loops beside it; the table sums the excess per writer activity, so
the rows say which part of the background save slows the loop, and ``save()`` says how much the
call itself blocked. A profile of ``save()``'s blocking part (``--profile``) follows.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import jax

from . import async_figs, states
from .contenders import MinickptManager

MB = 1 << 20
_OURS = os.sep + "minickpt" + os.sep


def writer_activity() -> str:
    """What the library's background threads are doing now: ``thread:function`` of the
    innermost minickpt frame of each, joined, or ``idle``."""
    names = {t.ident: t.name for t in threading.enumerate() if t.name.startswith("minickpt")}
    if not names:
        return "idle"
    out = []
    for ident, frame in sys._current_frames().items():
        if ident not in names:
            continue
        f, label = frame, None
        while f is not None:
            if _OURS in f.f_code.co_filename:
                label = f.f_code.co_name
                break
            f = f.f_back
        if label is not None:
            name = names[ident]
            who = next((k for k in ("snap", "fetch", "crc", "dio", "fsync", "delete", "write")
                        if f"minickpt-{k}" in name), "writer")
            out.append(f"{who}:{label}")
    return " + ".join(sorted(out)) or "idle"


def loop(tree: Any, steps: int, every: int | None, adapter: Any,
         blocked: list[float]) -> list[tuple[float, str]]:
    """The benchmark's loop; each step's (seconds, writer activity at its end)."""
    state = async_figs._fresh_copy(tree)
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        state = async_figs._step(state)
        jax.block_until_ready(state)
        if adapter is not None and every and i % every == 0:
            t1 = time.perf_counter()
            adapter.save_now(state)
            blocked.append(time.perf_counter() - t1)
        out.append((time.perf_counter() - t0, writer_activity()))
    if adapter is not None:
        adapter.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--intervals", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--profile", type=int, default=5, help="save() calls profiled (0: none)")
    p.add_argument("--dir", default=None)
    a = p.parse_args(argv)

    tree = jax.block_until_ready(states.uniform(a.mb * MB, a.leaves, seed=7))
    root = tempfile.mkdtemp(prefix="minickpt-phases-", dir=a.dir)
    try:
        ad = MinickptManager(os.path.join(root, "mc"), tree, async_=True)
        print(f"{states.nbytes(tree) / 1e6:.0f} MB in {a.leaves} leaves on "
              f"{jax.devices()[0].platform}; step {async_figs.step_time(tree) * 1e3:.2f} ms",
              flush=True)
        steps = a.every * a.intervals
        loop(tree, a.every, None, None, [])  # warm up
        ad.save_now(tree)
        ad.wait()
        excess: dict[str, float] = collections.defaultdict(float)
        count: collections.Counter[str] = collections.Counter()
        blocked: list[float] = []
        ratios = []
        for rep in range(a.reps):
            plain = loop(tree, steps, None, None, [])
            saving = loop(tree, steps, a.every, ad, blocked)
            base = statistics.median(t for t, _ in plain)
            for t, what in saving:
                excess[what] += t - base
                count[what] += 1
            ratios.append(sum(t for t, _ in plain) / sum(t for t, _ in saving))
            print(f"rep {rep}: ratio {ratios[-1]:.3f}; median step {base * 1e3:.3f} ms plain, "
                  f"{statistics.median(t for t, _ in saving) * 1e3:.3f} ms saving", flush=True)
        saves = a.reps * a.intervals
        print(f"\nratio median {statistics.median(ratios):.3f}; save() blocked median "
              f"{statistics.median(blocked) * 1e3:.1f} ms; per save, the loop's excess by what "
              "the writer was doing at the end of each step:")
        for what, ms in sorted(excess.items(), key=lambda kv: -kv[1]):
            print(f"  {ms / saves * 1e3:8.1f} ms  over {count[what] / saves:7.1f} steps  {what}")
        if a.profile:
            prof = cProfile.Profile()
            for _ in range(a.profile):
                ad.wait()
                prof.enable()
                ad.save_now(tree)
                prof.disable()
            ad.wait()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
            print(f"\nprofile of {a.profile} save() calls (the blocking part):\n{s.getvalue()}")
        ad.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
