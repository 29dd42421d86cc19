"""How long does an async save block training, compared with a plain copy of the state?

The goal (benchmark issue): the blocking part of an async save — the "photo" to host memory —
takes at most 1.5× a plain host copy of the same state. Also reported: the total time of the
async save (snapshot, background write, fsync, commit) and of a synchronous save.

    .venv/bin/python benchmarks/async_blocking.py [--leaves 50] [--size 2000000] [--reps 7] [--verbose]

Each measurement is repeated ``--reps`` times, interleaved; the median and the minimum are
reported (memory allocation, the page cache and other processes make single runs noisy; on a
busy machine the minimum is the better estimate of the cost itself). The async saves are waited
for between repetitions, so no measurement overlaps a background write.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.asynchronous import AsyncCheckpointer, default_snapshot_threads


def make_state(leaves: int, size: int) -> dict[str, jax.Array]:
    state = {f"w{i:03d}": jnp.full((size,), float(i), jnp.float32) + 0.5 for i in range(leaves)}
    return jax.block_until_ready(state)


def plain_copy(state: dict[str, jax.Array]) -> list[np.ndarray]:
    """What anyone would write: device_get every leaf, then copy it (np.array(copy=True))."""
    return [np.array(jax.device_get(x), copy=True) for x in state.values()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--size", type=int, default=2_000_000, help="float32 elements per leaf")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="print every measurement (ms)")
    a = p.parse_args(argv)

    state = make_state(a.leaves, a.size)
    nbytes = sum(x.nbytes for x in state.values())
    threads = max(2, min(8, os.cpu_count() or 1))
    default_threads = default_snapshot_threads()
    pool = ThreadPoolExecutor(threads)
    root = tempfile.mkdtemp(prefix="minickpt-bench-", dir=a.dir)
    times: dict[str, list[float]] = {k: [] for k in (
        "copy", "copy_threads", "blocking", "blocking_threads", "async_total", "sync_total")}
    try:
        async_opts = CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        with CheckpointManager(os.path.join(root, "async"), async_opts) as am, \
             AsyncCheckpointer(snapshot_threads=threads) as threaded, \
             CheckpointManager(os.path.join(root, "sync"),
                               CheckpointManagerOptions(max_to_keep=1)) as sm:
            def timed(key: str, fn: Callable[[], object], rep: int) -> None:
                t = time.perf_counter()
                result = fn()
                if rep > 0:  # rep 0 warms up caches and allocators
                    times[key].append(time.perf_counter() - t)
                del result

            for rep in range(a.reps + 1):
                # each kind of measurement follows the same kind of predecessor
                sm.save(rep, {"state": state})
                timed("copy", lambda: plain_copy(state), rep)
                timed("blocking", lambda: am.save(rep, {"state": state}), rep)  # noqa: B023
                am.wait_until_finished()
                timed("copy", lambda: plain_copy(state), rep)
                timed("copy_threads", lambda: list(pool.map(
                    lambda x: np.array(jax.device_get(x), copy=True), state.values())), rep)
                path = os.path.join(root, f"threaded_{rep}")
                timed("blocking_threads", lambda: threaded.save(
                    path, {"state": state}), rep)  # noqa: B023
                threaded.wait_until_finished()
                shutil.rmtree(path)
                if rep > 0:
                    times["async_total"].append(am.last_save_stats.total_s)
                    times["sync_total"].append(sm.last_save_stats.total_s)
                assert am.last_save_stats.ok and am.last_save_stats.bytes == nbytes
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    if a.verbose:
        for k, v in times.items():
            print(k, [round(x * 1e3) for x in v])
    med = {k: statistics.median(v) for k, v in times.items()}
    lo = {k: min(v) for k, v in times.items()}
    platform = next(iter(state.values())).devices().pop().platform
    print(f"state: {a.leaves} leaves x {a.size:,} float32 = {nbytes / 1e6:.1f} MB of jax arrays "
          f"on {platform}; {a.reps} repetitions; {os.cpu_count()} CPUs; jax {jax.__version__}")
    rows = [
        ("plain host copy (device_get + np.array copy, serial)", "copy"),
        (f"plain host copy, {threads} threads", "copy_threads"),
        (f"async save: blocking (snapshot, {default_threads} thread(s): default)", "blocking"),
        (f"async save: blocking (snapshot, {threads} threads)", "blocking_threads"),
        ("async save: total (snapshot + background write, commit)", "async_total"),
        ("sync save: total", "sync_total"),
    ]
    print(f"{'':58s} {'median':>9s} {'min':>9s}")
    for label, key in rows:
        print(f"{label:58s} {med[key] * 1e3:7.1f}ms {lo[key] * 1e3:7.1f}ms")
    ratio = med["blocking"] / med["copy"]
    print(f"\nblocking / plain host copy: {ratio:.2f} (medians), "
          f"{lo['blocking'] / lo['copy']:.2f} (minima)  -- goal <= 1.5: "
          f"{'met' if ratio <= 1.5 else 'MISSED'}")
    print(f"blocking ({threads} threads) / plain host copy: "
          f"{med['blocking_threads'] / med['copy']:.2f} (medians), "
          f"{lo['blocking_threads'] / lo['copy']:.2f} (minima)")
    print(f"blocking / sync save: {med['blocking'] / med['sync_total']:.3f} "
          f"(the training loop waits {med['blocking'] * 1e3:.0f} ms instead of "
          f"{med['sync_total'] * 1e3:.0f} ms)")
    return 0 if ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
