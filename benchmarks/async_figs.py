"""Async figures: how long a save blocks the training loop, and what saving costs throughput.

* **Blocking** — the time ``save()`` holds the training loop with asynchronous
  checkpointing on, against the plain host copy of the same state (every leaf copied into
  fresh host memory: the least any snapshot that is safe against donation must do). Goal:
  ≤ 1.5× the copy.
* **Throughput at equal N** — a training loop whose every step touches the whole state (a
  jitted update that donates its input, like an optimizer step) runs ``k·N`` steps without
  saves and with a save every ``N`` steps; the figure is (steps/s with saves) ÷ (steps/s
  without). Both libraries run at the *same* N, for each N of :func:`schedule`: the shortest
  interval both sustain, and Young's interval τ = √(2·C·MTBF) for a stated MTBF and each
  library's measured save cost C (one whole save, alone). Goals: ≥ Orbax at every N, and
  ≥ 0.97 (CheckFreq reports ≤ 3.5 % overhead).
* **Shortest interval sustained** — how long (and how many steps) after a save, with
  training running, its background write is done (``is_saving_in_progress()`` polled after
  every step): a save every fewer steps than that waits for the previous one.
* **Writer's CPU share** — the CPU seconds one save costs the process (measured alone, the
  main thread asleep in ``wait``) ÷ the CPU seconds N training steps use. On a CPU backend the
  writer and XLA share the cores, so the overhead cannot be much below that share; the row
  gives overhead ÷ share at Young's N (goal ≤ 1.2).

minickpt's figures run once minickpt has its asynchronous checkpointer
(``hasattr(minickpt, "AsyncCheckpointer")``); the functions here take any manager adapter
with ``save_now(tree)``/``wait()`` (see :mod:`benchmarks.contenders`), so the harness itself is
tested today with the synchronous manager, whose "blocking" time is its whole save.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .core import Goal, Op, Row, fmt_time, interleaved

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


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def save_cost(tree: Any, adapter: Adapter, reps: int = 2) -> dict[str, float]:
    """One whole save alone (snapshot + background write + commit): wall seconds (Young's C)
    and the CPU seconds it costs the process (the writer's: the main thread sleeps)."""
    wall, cpu = [], []
    for _ in range(reps):
        adapter.wait()
        c0, t0 = cpu_seconds(), time.perf_counter()
        adapter.save_now(tree)
        adapter.wait()
        wall.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def sustained_interval(tree: Any, adapter: Adapter, saves: int = 3, max_steps: int = 1000
                       ) -> dict[str, float]:
    """Steps (and seconds) after a save, training on, until its write is done: a save every
    fewer steps than ``steps`` would wait for the previous one. Medians over ``saves``."""
    state = _fresh_copy(tree)
    counts, secs = [], []
    for _ in range(saves):
        adapter.wait()
        state = jax.block_until_ready(_step(state))
        adapter.save_now(state)
        t0, k = time.perf_counter(), 0
        while adapter.busy() and k < max_steps:
            state = jax.block_until_ready(_step(state))
            k += 1
        secs.append(time.perf_counter() - t0)
        counts.append(max(1, k))
    adapter.wait()
    return {"steps": int(statistics.median(counts)), "seconds": statistics.median(secs),
            "capped": max(counts) >= max_steps}


def young_every(cost_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's interval τ = √(2·C·MTBF) in whole steps (at least 1)."""
    return max(1, round(math.sqrt(2 * cost_s * mtbf_s) / step_s))


def schedule(sustained: Mapping[str, int], young: Mapping[str, int], max_every: int
             ) -> list[int]:
    """The N both libraries run at: the shortest interval both sustain, and each library's
    Young interval — sorted, each at most ``max_every``. Where the cap makes them fewer than
    three, half the cap joins them (a shorter interval, at which one library may wait)."""
    ns = {min(max_every, max(1, n)) for n in {max(sustained.values()), *young.values()}}
    if len(ns) < 3 and max_every >= 4:
        ns.add(max_every // 2)
    return sorted(ns)


def equal_n_rows(tree: Any, adapters: Mapping[str, Adapter], ns: Sequence[int], *,
                 reps: int, intervals: int, label: str, nbytes: int,
                 why: Mapping[int, str], cost: Mapping[str, Mapping[str, float]],
                 ) -> tuple[list[Row], dict[str, Any]]:
    """One row per N: every library's throughput ratio at that same N. Each repetition runs
    the plain loop once and every library's saving loop after it, so that a change of load
    affects them alike; the plain loop's CPU time gives each library's writer share."""
    rows, detail = [], {}
    for n in ns:
        steps = intervals * n
        run_loop(tree, min(n, 4), None, None)  # warm up
        samples: dict[str, list[float]] = {who: [] for who in adapters}
        cpu_step = []
        for _ in range(reps):
            c0 = cpu_seconds()
            plain = run_loop(tree, steps, None, None)
            cpu_step.append((cpu_seconds() - c0) / steps)
            for who, ad in adapters.items():
                samples[who].append(plain / run_loop(tree, steps, n, ad))
        _log(f"N = {n}: " + ", ".join(f"{w} {statistics.median(v):.3f}"
                                      for w, v in samples.items()))
        per_step = statistics.median(cpu_step)
        share = {who: cost[who]["cpu_s"] / (n * per_step) for who in adapters}
        row = Row.from_samples(f"async.throughput.n{n}", f"{label}: throughput, async save "
                               f"every N = {n} steps ÷ no saves", samples,
                               nbytes=nbytes, unit="r",
                               goals=[Goal("min_x_orbax", 1.0), Goal("min", 0.97)],
                               section="async")
        row.note = f"N = {n}: {why[n]}; writer CPU ÷ the interval's training CPU: " + ", ".join(
            f"{who} {share[who]:.1%}" for who in adapters)
        rows.append(row)
        detail[n] = {"why": why[n], "steps": steps, "cpu_per_step_s": per_step,
                     "writer_share": share}
    return rows, detail


def _log(msg: str) -> None:
    sys.stderr.write(f"[bench]   async: {msg}\n")
    sys.stderr.flush()


def rows(tree: Any, factories: Mapping[str, Callable[[], Adapter]], *, reps: int,
         label: str, nbytes: int, intervals: int = 3, max_every: int = 1000,
         mtbf_s: float = 30.0, thr_reps: int = 2, max_interval_s: float = 6.0
         ) -> tuple[list[Row], dict[str, Any]]:
    """Blocking, the shortest sustained interval, throughput at equal N, and overhead ÷ the
    writer's CPU share at Young's N. An N is at most ``max_every`` steps and at most
    ``max_interval_s`` of training (the run's time; a capped N says so in its note)."""
    adapters = {who: make() for who, make in factories.items()}
    try:
        t0 = time.perf_counter()
        block = blocking_row(tree, adapters, reps=reps, nbytes=nbytes, label=label)
        tc = step_time(tree)
        max_every = max(1, min(max_every, int(max_interval_s / tc)))
        cost = {who: save_cost(tree, ad) for who, ad in adapters.items()}
        _log(f"blocking, step {tc * 1e3:.0f} ms, save cost " + ", ".join(
            f"{w} {c['wall_s']:.2f} s wall / {c['cpu_s']:.2f} s CPU" for w, c in cost.items())
            + f" ({time.perf_counter() - t0:.0f} s)")
        sus = {who: sustained_interval(tree, ad, max_steps=max(max_every, 1000))
               for who, ad in adapters.items()}
        young = {who: young_every(cost[who]["wall_s"], mtbf_s, tc) for who in adapters}
        ns = schedule({w: s["steps"] for w, s in sus.items()}, young, max_every)
        _log("sustained " + ", ".join(f"{w} {s['steps']}" for w, s in sus.items())
             + "; Young " + ", ".join(f"{w} {y}" for w, y in young.items())
             + f"; N = {ns} ({time.perf_counter() - t0:.0f} s)")
        why: dict[int, str] = {}
        both = max(s["steps"] for s in sus.values())
        for n in ns:
            parts = [f"Young's N for {who}" + (f" ({y}, capped)" if y > max_every else "")
                     for who, y in young.items() if min(max_every, y) == n]
            if n == min(max_every, both):
                parts.insert(0, "shortest both sustain" + (f" ({both}, capped)"
                                                           if both > max_every else ""))
            why[n] = ", ".join(parts) or "half the cap on N"

        thr, eq = equal_n_rows(tree, adapters, ns, reps=thr_reps, intervals=intervals,
                               label=label, nbytes=nbytes, why=why, cost=cost)
        _log(f"equal N done ({time.perf_counter() - t0:.0f} s)")
    finally:
        for ad in adapters.values():
            ad.close()
    sus_row = Row(
        "async.sustained", f"{label}: shortest interval sustained without save() waiting "
        "(training on)", unit="s",
        values={who: s["seconds"] for who, s in sus.items()},
        samples={who: [s["seconds"]] for who, s in sus.items()},
        goals=[Goal("x_orbax", 1.0)], section="async")
    sus_row.note = "from a save until its write is done, training on, median of 3: " + \
        ", ".join(f"{who} {'≥ ' if s['capped'] else ''}{s['steps']} steps" for who, s in
                  sus.items()) + f" (a step alone: {fmt_time(tc)}; the first step after a " \
        "save is slower where the snapshot holds the state's buffers)"
    n_y = min(max_every, young["minickpt"]) if "minickpt" in young else ns[-1]
    i_y = ns.index(n_y)
    over = {}
    for who in adapters:
        ratio = thr[i_y].values.get(who)
        share = eq[n_y]["writer_share"][who]
        over[who] = None if ratio is None or share <= 0 else (1 - ratio) / share
    share_row = Row("async.overhead_share", f"{label}: overhead (1 − throughput) ÷ writer's "
                    f"CPU share, every {n_y} steps", unit="r", values=over,
                    goals=[Goal("max", 1.2)], section="async")
    share_row.note = "writer CPU per save, alone: " + ", ".join(
        f"{who} {fmt_time(c['cpu_s'])} of a {fmt_time(c['wall_s'])} save"
        for who, c in cost.items())
    detail = {"step_s": tc, "mtbf_s": mtbf_s, "max_every": max_every, "cost": cost,
              "sustained": sus,
              "young_every": young, "schedule": ns, "equal_n": eq}
    return [block, *thr, sus_row, share_row], detail
