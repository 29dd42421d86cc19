"""How a device-to-host transfer in a background thread slows a training loop, by how the
transfer is made (issue 51: the async save's ``fetch``/``finish`` phases cost the TPU loop
~80 ms a save, the write itself almost nothing).

    python -m benchmarks.d2h_probe [--mb 400] [--leaves 50] [--reps 3]

Each method moves on-device copies of a ``--mb`` state (``--leaves`` leaves) to host memory
in a thread, while the main thread runs :mod:`benchmarks.async_figs`'s jitted step, synced
every step. Printed per method: the transfer's wall time and the loop's excess (its time over
the median step of the same loop without a transfer), median of ``--reps`` interleaved runs.

Methods: ``asarray`` (np.asarray per leaf), ``async+asarray`` (copy_to_host_async on every leaf
first, minickpt's way), ``device_put_cpu`` (jax.device_put to the host's CPU device, then a
zero-copy view), ``into_pool`` (async+asarray, then copied into host buffers touched before), ``ahead<K>``
(np.asarray leaf by leaf, copy_to_host_async started K leaves ahead), ``threads<N>``
(np.asarray in N threads at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import async_figs, states

MB = 1 << 20


def _asarray(copies: list[Any], pool: list[np.ndarray]) -> None:
    for c in copies:
        np.asarray(c)


def _async_asarray(copies: list[Any], pool: list[np.ndarray]) -> None:
    for c in copies:
        c.copy_to_host_async()
    for c in copies:
        np.asarray(c)


def _device_put_cpu(copies: list[Any], pool: list[np.ndarray]) -> None:
    cpu = jax.devices("cpu")[0]
    out = jax.device_put(copies, cpu)
    for x in jax.block_until_ready(out):
        np.asarray(x)


def _into_pool(copies: list[Any], pool: list[np.ndarray]) -> None:
    for c in copies:
        c.copy_to_host_async()
    for c, buf in zip(copies, pool, strict=True):
        np.copyto(buf, np.asarray(c).reshape(buf.shape))


def _ahead(k: int) -> Callable[[list[Any], list[np.ndarray]], None]:
    """np.asarray leaf by leaf, with copy_to_host_async started ``k`` leaves ahead."""
    def go(copies: list[Any], pool: list[np.ndarray]) -> None:
        for c in copies[:k]:
            c.copy_to_host_async()
        for i, c in enumerate(copies):
            if i + k < len(copies):
                copies[i + k].copy_to_host_async()
            np.asarray(c)
    return go


def _threads(n: int) -> Callable[[list[Any], list[np.ndarray]], None]:
    """np.asarray of the leaves in ``n`` threads at once."""
    def go(copies: list[Any], pool: list[np.ndarray]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as ex:
            list(ex.map(np.asarray, copies))
    return go


METHODS: dict[str, Callable[[list[Any], list[np.ndarray]], None]] = {
    "asarray": _asarray, "async+asarray": _async_asarray, "device_put_cpu": _device_put_cpu,
    "into_pool": _into_pool, "ahead1": _ahead(1), "ahead3": _ahead(3), "threads2": _threads(2),
    "threads4": _threads(4), "threads8": _threads(8)}


def run(tree: Any, method: str | None, steps: int, start_at: int,
        pool: list[np.ndarray]) -> tuple[list[float], float]:
    """Step times, and the transfer's seconds (0 without one)."""
    state = async_figs._fresh_copy(tree)
    took: list[float] = [0.0]
    thread = None
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        state = async_figs._step(state)
        jax.block_until_ready(state)
        if method is not None and i == start_at:
            copies = [jnp.copy(x) for x in jax.tree_util.tree_leaves(state)]

            def work(copies: list[Any] = copies) -> None:
                t = time.perf_counter()
                METHODS[method](copies, pool)
                took[0] = time.perf_counter() - t

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
        out.append(time.perf_counter() - t0)
    if thread is not None:
        thread.join()
    return out, took[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    a = p.parse_args(argv)
    tree = jax.block_until_ready(states.uniform(a.mb * MB, a.leaves, seed=7))
    leaves = jax.tree_util.tree_leaves(tree)
    pool = [np.ones(x.shape, x.dtype) for x in leaves]  # touched: no first-touch cost later
    print(f"{states.nbytes(tree) / 1e6:.0f} MB in {len(leaves)} leaves on "
          f"{leaves[0].devices().pop().platform}", flush=True)
    run(tree, None, 50, 0, pool)
    excess: dict[str, list[float]] = {m: [] for m in a.methods}
    took: dict[str, list[float]] = {m: [] for m in a.methods}
    for rep in range(a.reps):
        base, _ = run(tree, None, a.steps, 0, pool)
        med = statistics.median(base)
        for m in a.methods:
            times, t = run(tree, m, a.steps, 20, pool)
            excess[m].append(sum(times) - med * len(times))
            took[m].append(t)
            print(f"rep {rep} {m:16s} transfer {t * 1e3:7.1f} ms  loop excess "
                  f"{excess[m][-1] * 1e3:7.1f} ms  (step {med * 1e3:.2f} ms)", flush=True)
    print(f"\n{'method':16s} {'transfer':>10s} {'loop excess':>12s}  (medians)")
    for m in a.methods:
        print(f"{m:16s} {statistics.median(took[m]) * 1e3:8.1f} ms "
              f"{statistics.median(excess[m]) * 1e3:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
