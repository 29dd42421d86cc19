"""Async figures: how long a save blocks the training loop, and what saving costs throughput.

* **Blocking** — the time ``save()`` holds the training loop with asynchronous
  checkpointing on, against the plain host copy of the same state (every leaf copied into
  fresh host memory: the least any snapshot that is safe against donation must do). Goal:
  ≤ 1.5× the copy.
* **Throughput at equal N** — a training loop whose every step touches the whole state (a
  jitted update that donates its input, like an optimizer step) runs intervals of ``N``
  steps without a save and with a save at the interval's first step (and, at its end, the
  wait until that save is written); the figure is (time without) ÷ (time with). Both
  libraries run at the *same* N, for each N of :func:`schedule`: the shortest interval both
  sustain, and Young's interval τ = √(2·C·MTBF) for a stated MTBF and each library's
  measured save cost C (one whole save, alone). The intervals run in rounds — no saves,
  then each library's, the order turning from round to round — so that a load spike on a
  shared machine falls on a round's baseline and its saving intervals alike; a round's
  ratio is its own, the row the median over rounds, the note the range. Goals: ≥ Orbax at
  every N, and ≥ 0.97 (CheckFreq reports ≤ 3.5 % overhead).
* **Shortest interval sustained** — how long (and how many steps) after a save, with
  training running, its background write is done (``is_saving_in_progress()`` polled after
  every step): a save every fewer steps than that waits for the previous one. The
  libraries' saves in turn; medians and ranges.
* **Writer's CPU share** — the CPU seconds one save costs the process (measured alone, the
  main thread asleep in ``wait``, the libraries in turn, the median) ÷ the CPU seconds of
  the round's own no-save interval. On a CPU backend the writer and XLA share the cores, so
  the overhead cannot be much below that share; the row gives overhead ÷ share at Young's
  N, per round (goal ≤ 1.2), and its note the extra CPU a saving interval used over the
  no-save one beside it.

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
    return save_costs(tree, {"_": adapter}, reps)["_"]


def save_costs(tree: Any, adapters: Mapping[str, Adapter], reps: int = 3
               ) -> dict[str, dict[str, Any]]:
    """:func:`save_cost` for every library, the same way for each and in turn (a, b, a, b,
    …), so that a change of load affects them alike: medians of wall and CPU seconds, and
    every sample."""
    wall: dict[str, list[float]] = {w: [] for w in adapters}
    cpu: dict[str, list[float]] = {w: [] for w in adapters}
    for _ in range(reps):
        for who, ad in adapters.items():
            ad.wait()
            c0, t0 = cpu_seconds(), time.perf_counter()
            ad.save_now(tree)
            ad.wait()
            wall[who].append(time.perf_counter() - t0)
            cpu[who].append(cpu_seconds() - c0)
    return {w: {"wall_s": statistics.median(wall[w]), "cpu_s": statistics.median(cpu[w]),
                "wall_samples": wall[w], "cpu_samples": cpu[w]} for w in adapters}


def sustained_once(tree: Any, adapter: Adapter, state: Any, max_steps: int
                   ) -> tuple[Any, int, float]:
    """One save with training on: the steps and seconds until its write is done."""
    adapter.wait()
    state = jax.block_until_ready(_step(state))
    adapter.save_now(state)
    t0, k = time.perf_counter(), 0
    while adapter.busy() and k < max_steps:
        state = jax.block_until_ready(_step(state))
        k += 1
    secs = time.perf_counter() - t0
    adapter.wait()
    return state, max(1, k), secs


def sustained_interval(tree: Any, adapter: Adapter, saves: int = 3, max_steps: int = 1000
                       ) -> dict[str, Any]:
    """Steps (and seconds) after a save, training on, until its write is done: a save every
    fewer steps than ``steps`` would wait for the previous one. Medians over ``saves``."""
    return sustained_intervals(tree, {"_": adapter}, saves, max_steps)["_"]


def sustained_intervals(tree: Any, adapters: Mapping[str, Adapter], saves: int = 3,
                        max_steps: int = 1000) -> dict[str, dict[str, Any]]:
    """:func:`sustained_interval` for every library, one save of each in turn."""
    state = _fresh_copy(tree)
    counts: dict[str, list[int]] = {w: [] for w in adapters}
    secs: dict[str, list[float]] = {w: [] for w in adapters}
    for _ in range(saves):
        for who, ad in adapters.items():
            state, k, t = sustained_once(tree, ad, state, max_steps)
            counts[who].append(k)
            secs[who].append(t)
    return {w: {"steps": int(statistics.median(counts[w])),
                "seconds": statistics.median(secs[w]), "capped": max(counts[w]) >= max_steps,
                "step_samples": counts[w], "second_samples": secs[w]} for w in adapters}


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


def segment(tree: Any, n: int, adapter: Adapter | None) -> tuple[float, float]:
    """One interval of ``n`` training steps — with a save at its first step and, at its end,
    the wait until that save is written (so a write longer than the interval is paid
    here, as the next save() would pay it), or without a save: wall and CPU seconds."""
    c0 = cpu_seconds()
    wall = run_loop(tree, n, n if adapter is not None else None, adapter)
    return wall, cpu_seconds() - c0


def _spread(xs: Sequence[float], fmt: str = ".3f") -> str:
    return (f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}–{max(xs):{fmt}})" if xs
            else "—")


def equal_n_rows(tree: Any, adapters: Mapping[str, Adapter], ns: Sequence[int], *,
                 rounds: int, label: str, nbytes: int,
                 why: Mapping[int, str], cost: Mapping[str, Mapping[str, float]],
                 ) -> tuple[list[Row], dict[str, Any]]:
    """One row per N: every library's throughput ratio at that same N, from ``rounds``
    rounds of one-interval segments in turn — no saves, then each library's (the order of
    the libraries turning from round to round) — so that a change of load on a shared
    machine falls on a no-save segment and the saving ones beside it alike. A round's ratio
    is its no-save segment's time ÷ the saving one's; the row gives the median over rounds,
    its note the range. The writer's CPU share is each library's CPU seconds of a save
    alone (``cost``, measured the same way for each) ÷ the CPU seconds of the interval's
    training, from the round's own no-save segment; overhead ÷ share per round."""
    rows, detail = [], {}
    who_all: list[str | None] = list(adapters)
    for n in ns:
        run_loop(tree, min(n, 4), None, None)  # warm up
        samples: dict[str, list[float]] = {who: [] for who in adapters}
        shares: dict[str, list[float]] = {who: [] for who in adapters}
        extra_cpu: dict[str, list[float]] = {who: [] for who in adapters}
        over: dict[str, list[float]] = {who: [] for who in adapters}
        plain_s, cpu_step = [], []
        for r in range(rounds):
            order = [None, *who_all]  # None: the segment without saves
            k = r % len(order)
            got = {who: segment(tree, n, adapters[who] if who else None)
                   for who in order[k:] + order[:k]}
            plain, plain_cpu = got[None]
            plain_s.append(plain)
            cpu_step.append(plain_cpu / n)
            for who in adapters:
                wall, cpu = got[who]
                ratio = plain / wall
                share = cost[who]["cpu_s"] / plain_cpu if plain_cpu > 0 else math.inf
                samples[who].append(ratio)
                shares[who].append(share)
                extra_cpu[who].append(cpu - plain_cpu)
                over[who].append((1 - ratio) / share if share > 0 else math.inf)
        _log(f"N = {n}: " + ", ".join(f"{w} {_spread(v)}" for w, v in samples.items()))
        row = Row.from_samples(f"async.throughput.n{n}", f"{label}: throughput, async save "
                               f"every N = {n} steps ÷ no saves", samples,
                               nbytes=nbytes, unit="r",
                               goals=[Goal("min_x_orbax", 1.0), Goal("min", 0.97)],
                               section="async")
        row.note = (f"N = {n}: {why[n]}; median (range) of {rounds} rounds of one interval "
                    "each, no saves and each library's in turn: " + ", ".join(
                        f"{who} {_spread(samples[who])}" for who in adapters)
                    + "; writer CPU ÷ the interval's training CPU: " + ", ".join(
                        f"{who} {statistics.median(shares[who]):.1%}" for who in adapters))
        rows.append(row)
        detail[n] = {"why": why[n], "steps": n, "rounds": rounds,
                     "cpu_per_step_s": statistics.median(cpu_step), "plain_s": plain_s,
                     "cpu_per_step_samples": cpu_step,
                     "writer_share": {w: statistics.median(v) for w, v in shares.items()},
                     "writer_share_samples": shares,
                     "extra_cpu_in_loop_s": extra_cpu, "overhead_share_samples": over}
    return rows, detail


def _log(msg: str) -> None:
    sys.stderr.write(f"[bench]   async: {msg}\n")
    sys.stderr.flush()


def rows(tree: Any, factories: Mapping[str, Callable[[], Adapter]], *, reps: int,
         label: str, nbytes: int, rounds: int = 5, max_every: int = 1000,
         mtbf_s: float = 30.0, max_interval_s: float = 6.0, cost_reps: int = 3,
         sustained_saves: int = 3) -> tuple[list[Row], dict[str, Any]]:
    """Blocking, the shortest sustained interval, throughput at equal N, and overhead ÷ the
    writer's CPU share at Young's N. An N is at most ``max_every`` steps and at most
    ``max_interval_s`` of training (the run's time; a capped N says so in its note)."""
    adapters = {who: make() for who, make in factories.items()}
    try:
        t0 = time.perf_counter()
        block = blocking_row(tree, adapters, reps=reps, nbytes=nbytes, label=label)
        tc = step_time(tree)
        max_every = max(1, min(max_every, int(max_interval_s / tc)))
        cost = save_costs(tree, adapters, cost_reps)
        _log(f"blocking, step {tc * 1e3:.0f} ms, save cost " + ", ".join(
            f"{w} {c['wall_s']:.2f} s wall / {c['cpu_s']:.2f} s CPU" for w, c in cost.items())
            + f" ({time.perf_counter() - t0:.0f} s)")
        sus = sustained_intervals(tree, adapters, sustained_saves,
                                  max_steps=max(max_every, 1000))
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

        thr, eq = equal_n_rows(tree, adapters, ns, rounds=rounds, label=label,
                               nbytes=nbytes, why=why, cost=cost)
        _log(f"equal N done ({time.perf_counter() - t0:.0f} s)")
    finally:
        for ad in adapters.values():
            ad.close()
    sus_row = Row(
        "async.sustained", f"{label}: shortest interval sustained without save() waiting "
        "(training on)", unit="s",
        values={who: s["seconds"] for who, s in sus.items()},
        samples={who: s["second_samples"] for who, s in sus.items()},
        goals=[Goal("x_orbax", 1.0)], section="async")
    sus_row.note = (f"from a save until its write is done, training on, median (range) of "
                    f"{sustained_saves} saves, the libraries in turn: " + ", ".join(
                        f"{who} {'≥ ' if s['capped'] else ''}{s['steps']} steps "
                        f"({min(s['step_samples'])}–{max(s['step_samples'])})"
                        for who, s in sus.items())
                    + f" (a step alone: {fmt_time(tc)}; the first step after a save is "
                    "slower where the snapshot holds the state's buffers)")
    n_y = min(max_every, young["minickpt"]) if "minickpt" in young else ns[-1]
    over_samples = {who: eq[n_y]["overhead_share_samples"][who] for who in adapters}
    share_row = Row.from_samples(
        "async.overhead_share", f"{label}: overhead (1 − throughput) ÷ writer's CPU share, "
        f"every {n_y} steps", over_samples, unit="r", goals=[Goal("max", 1.2, floor=0.0)],
        section="async")
    share_row.note = (f"per round of N = {n_y}, median (range) of {rounds}: " + ", ".join(
        f"{who} {_spread(v, '.2f')}" for who, v in over_samples.items())
        + f"; writer CPU per save, alone, median of {cost_reps} (the libraries in turn): "
        + ", ".join(f"{who} {fmt_time(c['cpu_s'])} of a {fmt_time(c['wall_s'])} save"
                    for who, c in cost.items())
        + "; extra CPU of a saving interval over the no-save one beside it: " + ", ".join(
            f"{who} {statistics.median(eq[n_y]['extra_cpu_in_loop_s'][who]) * 1e3:+.0f} ms"
            for who in adapters))
    detail = {"step_s": tc, "mtbf_s": mtbf_s, "max_every": max_every, "cost": cost,
              "sustained": sus,
              "young_every": young, "schedule": ns, "equal_n": eq}
    return [block, *thr, sus_row, share_row], detail
