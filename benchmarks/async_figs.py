"""Async figures: how long a save blocks the training loop, and what saving costs throughput.

* **Blocking** — the time ``save()`` holds the training loop with asynchronous
  checkpointing on, against the plain host copy of the same state (every leaf copied into
  fresh host memory: the least any snapshot that is safe against donation must do). Goal:
  ≤ 1.5× the copy.
* **Throughput** — a training loop whose every step touches the whole state (a jitted
  update that donates its input, like an optimizer step) runs ``k·N`` steps without saves and
  with a save every ``N`` steps, ``N`` chosen so that one background write takes about half of
  the ``N`` steps' compute. The figure is (steps/s with saves) ÷ (steps/s without). Goal:
  ≥ 0.97 (CheckFreq reports ≤ 3.5 % overhead).

minickpt's figures run once minickpt has its asynchronous checkpointer
(``hasattr(minickpt, "AsyncCheckpointer")``); the functions here take any manager adapter
with ``save_now(tree)``/``wait()`` (see :mod:`benchmarks.contenders`), so the harness itself is
tested today with the synchronous manager, whose "blocking" time is its whole save.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .core import Goal, Op, Row, interleaved

Adapter = Any  # MinickptManager | OrbaxManager: save_now(tree), wait(), close()


def minickpt_available() -> bool:
    import minickpt

    return hasattr(minickpt, "AsyncCheckpointer")


def host_copy(tree: Any) -> list[np.ndarray]:
    """Every array leaf copied into fresh host memory (one copy, whatever the backend)."""
    out = []
    cpu = jax.default_backend() == "cpu"
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            out.append(np.array(leaf, copy=True) if cpu else np.asarray(leaf))
    return out


def blocking_row(tree: Any, adapters: Mapping[str, Adapter], *, reps: int, warmup: int = 1,
                 nbytes: int, label: str) -> Row:
    """Median time ``save()`` blocks, per contender, against the plain host copy."""
    ops = []
    for who, ad in adapters.items():
        ops.append(Op(who, lambda ad=ad: ad.save_now(tree), prepare=ad.wait, after=ad.wait))
    ops.append(Op("limit", lambda: host_copy(tree)))
    samples = interleaved(ops, reps, warmup)
    return Row.from_samples("async.blocking", f"{label}: async save, time blocked", samples,
                            nbytes=nbytes, limit_name="host copy",
                            goals=[Goal("x_limit_max", 1.5)], section="async")


def _update(tree: Any) -> Any:
    return jax.tree.map(lambda x: x * 0.999 + 0.001, tree)


_step = jax.jit(_update, donate_argnums=0)


def _fresh_copy(tree: Any) -> Any:
    return jax.block_until_ready(jax.tree.map(lambda x: x + 0, tree))


def step_time(tree: Any, reps: int = 3) -> float:
    state = _fresh_copy(tree)
    state = jax.block_until_ready(_step(state))  # compile
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(_step(state))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_loop(tree: Any, steps: int, every: int | None, adapter: Adapter | None) -> float:
    """Seconds for ``steps`` training steps, saving every ``every`` steps (at 1, 1+N, ...)."""
    state = _fresh_copy(tree)
    t0 = time.perf_counter()
    for i in range(steps):
        state = _step(state)
        jax.block_until_ready(state)  # a real loop syncs on its loss every step
        if adapter is not None and every and i % every == 0:
            adapter.save_now(state)
    if adapter is not None:
        adapter.wait()
    return time.perf_counter() - t0


def throughput_row(tree: Any, adapters: Mapping[str, Adapter],
                   write_time: Mapping[str, float], *, intervals: int = 3, reps: int = 3,
                   label: str, nbytes: int, max_every: int = 1000
                   ) -> tuple[Row, dict[str, Any]]:
    """(steps/s with a save every N steps) ÷ (steps/s without), per contender."""
    tc = step_time(tree)
    samples: dict[str, list[float]] = {}
    detail: dict[str, Any] = {"step_s": tc}
    for who, ad in adapters.items():
        n = min(max_every, max(2, math.ceil(2 * write_time[who] / tc)))
        steps = intervals * n
        ratios = []
        run_loop(tree, n, None, None)  # warm up
        for _ in range(reps):
            plain = run_loop(tree, steps, None, None)
            saving = run_loop(tree, steps, n, ad)
            ratios.append(plain / saving)
        samples[who] = ratios
        detail[who] = {"every_n_steps": n, "steps": steps, "write_s": write_time[who]}
    row = Row.from_samples("async.throughput", f"{label}: training throughput, async save "
                           "every N steps ÷ no saves", samples, nbytes=nbytes, unit="r",
                           goals=[Goal("min", 0.97)], section="async")
    row.note = "N: " + ", ".join(f"{w} {d['every_n_steps']}" for w, d in detail.items()
                                 if isinstance(d, dict))
    return row, detail


def background_write_time(tree: Any, adapter: Adapter, reps: int = 2) -> float:
    """Wall time of one whole save (snapshot + background write + commit), no training."""
    ts = []
    for _ in range(reps):
        adapter.wait()
        t0 = time.perf_counter()
        adapter.save_now(tree)
        adapter.wait()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rows(tree: Any, factories: Mapping[str, Callable[[], Adapter]], *, reps: int,
         label: str, nbytes: int, intervals: int = 3, max_every: int = 1000
         ) -> tuple[list[Row], dict[str, Any]]:
    adapters = {who: make() for who, make in factories.items()}
    try:
        block = blocking_row(tree, adapters, reps=reps, nbytes=nbytes, label=label)
        wt = {who: background_write_time(tree, ad) for who, ad in adapters.items()}
        thr, detail = throughput_row(tree, adapters, wt, reps=max(2, reps // 2),
                                     intervals=intervals, label=label, nbytes=nbytes,
                                     max_every=max_every)
    finally:
        for ad in adapters.values():
            ad.close()
    return [block, thr], detail
