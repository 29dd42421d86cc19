"""Timing, rows, goals and the table — the parts every figure shares.

A *row* of the table is one figure measured for up to three contenders: ``minickpt``,
``orbax`` and ``limit`` (what the machine itself can do for the same bytes). Each contender
is an :class:`Op` whose ``run`` is timed and whose ``prepare``/``after`` are not (a fresh
directory, a cache eviction, a deletion). :func:`interleaved` runs them round-robin, so a
noisy neighbour on a shared machine slows every contender of a repetition, not one of them.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

CONTENDERS = ("minickpt", "orbax", "limit")


@dataclass
class Op:
    """One contender's operation: ``run`` is timed, ``prepare`` and ``after`` are not."""

    label: str
    run: Callable[[], Any]
    prepare: Callable[[], None] | None = None
    after: Callable[[], None] | None = None


def time_once(op: Op) -> float:
    if op.prepare is not None:
        op.prepare()
    gc.collect()
    gc.disable()  # a collection in the middle of one contender's run is noise, not cost
    try:
        t0 = time.perf_counter()
        op.run()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    if op.after is not None:
        op.after()
    return dt


def interleaved(ops: Sequence[Op], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per repetition of each op, round-robin: a, b, c, a, b, c, ..."""
    gc.collect()
    gc.freeze()  # what exists now is never collected: the collection before each op stays
    try:         # cheap (with JAX, Orbax and Flax loaded a full one takes ~0.1 s)
        for _ in range(warmup):
            for op in ops:
                time_once(op)
        samples: dict[str, list[float]] = {op.label: [] for op in ops}
        for _ in range(reps):
            for op in ops:
                samples[op.label].append(time_once(op))
    finally:
        gc.unfreeze()
    return samples


def median(xs: Sequence[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------------------
# goals
# ---------------------------------------------------------------------------------------
@dataclass
class Goal:
    """A goal from the issue. ``kind`` says what is compared:

    * ``x_orbax``   — Orbax's time ÷ minickpt's time ≥ target ("20× faster than Orbax")
    * ``of_limit``  — the limit's time ÷ minickpt's time ≥ target ("0.9 of the disk's speed")
    * ``x_limit_max`` — minickpt's time ÷ the limit's time ≤ target ("blocks ≤ 1.5× a copy")
    * ``max`` / ``min`` — minickpt's value itself ≤ / ≥ target (memory ÷ state, throughput)
    * ``min_x_orbax`` / ``max_x_orbax`` — minickpt's value ÷ Orbax's ≥ / ≤ target, for
      values that are not times ("throughput ≥ Orbax's", "sustains intervals ≤ Orbax's")
    """

    kind: str
    target: float
    # below this the value says nothing (overhead ÷ share < 0: the saving intervals ran
    # faster than the no-save ones, noise): neither met nor missed
    floor: float | None = None

    def describe(self) -> str:
        t = f"{self.target:g}"
        return {"x_orbax": f"≥ {t}× Orbax", "of_limit": f"≥ {t} of limit",
                "x_limit_max": f"≤ {t}× limit", "max": f"≤ {t}", "min": f"≥ {t}",
                "min_x_orbax": f"≥ {t}× Orbax's" if self.target != 1 else "≥ Orbax's",
                "max_x_orbax": f"≤ {t}× Orbax's" if self.target != 1 else "≤ Orbax's",
                }[self.kind]

    def value(self, row: Row) -> float | None:
        m, o, lim = (row.values.get(k) for k in CONTENDERS)
        if m is None:
            return None
        if self.kind == "x_orbax":
            return None if o is None or m <= 0 else o / m
        if self.kind == "of_limit":
            return None if lim is None or m <= 0 else lim / m
        if self.kind == "x_limit_max":
            return None if lim is None or lim <= 0 else m / lim
        if self.kind in ("min_x_orbax", "max_x_orbax"):
            return None if o is None or o <= 0 else m / o
        return m

    def met(self, row: Row) -> bool | None:
        v = self.value(row)
        if v is None or (self.floor is not None and v < self.floor):
            return None
        low = ("x_limit_max", "max", "max_x_orbax")
        return v <= self.target if self.kind in low else v >= self.target

    def verdict(self, row: Row) -> str:
        v = self.value(row)
        if v is None:
            return f"{self.describe()}: not measured"
        if self.floor is not None and v < self.floor:
            return f"not judged: {v:.2f}, below {self.floor:g} (noise: no overhead measured)"
        ok = self.met(row)
        shown = _ratio(v) if self.kind in ("x_orbax", "x_limit_max") else f"{v:.2f}"
        if self.kind in ("min_x_orbax", "max_x_orbax"):
            shown = f"{v:.2f}× Orbax's"
        if ok:
            return f"yes ({shown})"
        if self.kind in ("x_orbax", "of_limit", "min", "min_x_orbax"):
            short = self.target / v if v > 0 else math.inf
        else:
            short = v / self.target
        need = {"max": "less", "min": "more", "min_x_orbax": "more",
                "max_x_orbax": "less"}.get(self.kind, "faster")
        return f"NO: {shown}, needs {short:.2f}× {need}"


def _ratio(v: float) -> str:
    return f"{v:.1f}×" if v < 100 else f"{v:.0f}×"


# ---------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: a figure, each contender's median, and the goals it is held to."""

    key: str
    figure: str
    nbytes: int = 0
    unit: str = "s"  # "s" (a time), "x" (a ratio to the state's size), "r" (a plain ratio)
    values: dict[str, float | None] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    limit_name: str | None = None
    goals: list[Goal] = field(default_factory=list)
    note: str = ""
    section: str = "sync"
    limit_source: str = "probe"  # "fio": the limit is the disk's, measured by fio

    @classmethod
    def from_samples(cls, key: str, figure: str, samples: dict[str, list[float]], **kw: Any
                     ) -> Row:
        values = {k: median(samples.get(k)) for k in CONTENDERS}
        return cls(key, figure, values=values, samples=samples, **kw)

    def cell(self, who: str) -> str:
        v = self.values.get(who)
        if v is None:
            return "—"
        if self.unit == "x":
            return f"{v:.2f}× state"
        if self.unit == "r":
            return f"{v:.3f}"
        if self.unit == "steps":
            return f"{v:.0f} steps"
        text = fmt_time(v)
        if self.nbytes >= (16 << 20) and v > 0:
            text += f" · {self.nbytes / v / 1e9:.2f} GB/s"
        return text

    def vs_orbax(self) -> str:
        m, o = self.values.get("minickpt"), self.values.get("orbax")
        if m is None or o is None or m <= 0 or self.unit != "s":
            return "—"
        return f"{_ratio(o / m)} faster" if o >= m else f"{_ratio(m / o)} slower"

    def vs_limit_value(self) -> float | None:
        """The limit's time ÷ minickpt's ("of limit"), or None."""
        m, lim = self.values.get("minickpt"), self.values.get("limit")
        if m is None or lim is None or m <= 0 or self.unit != "s":
            return None
        return lim / m

    def vs_limit(self) -> str:
        v = self.vs_limit_value()
        return "—" if v is None else f"{v:.2f}"

    def verdict(self) -> str:
        if not self.goals:
            return "—"
        return "; ".join(g.verdict(self) for g in self.goals)

    def goal_text(self) -> str:
        return "; ".join(g.describe() for g in self.goals) or "—"

    def all_met(self) -> bool | None:
        results = [g.met(self) for g in self.goals]
        if not results or any(r is None for r in results):
            return None
        return all(results)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["goals"] = [{"kind": g.kind, "target": g.target, "text": g.describe(),
                       "value": g.value(self), "met": g.met(self)} for g in self.goals]
        d["verdict"] = self.verdict()
        return d


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 10e-3:
        return f"{s * 1e3:.2f} ms"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


HEADER = ("figure", "minickpt", "Orbax", "limit", "vs Orbax", "of limit", "goal", "met?")


def table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        limit = r.cell("limit")
        if r.limit_name and limit != "—":
            limit = f"{limit} ({r.limit_name})"
        out.append((r.figure, r.cell("minickpt"), r.cell("orbax"), limit, r.vs_orbax(),
                    r.vs_limit(), r.goal_text(), r.verdict()))
    return out


def markdown_table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
              for cells in table_rows(rows)]
    return "\n".join(lines)


def text_table(rows: Sequence[Row]) -> str:
    cells = [HEADER, *table_rows(rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    sep = "  "
    lines = [sep.join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)),
             sep.join("-" * w for w in widths)]
    lines += [sep.join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in cells[1:]]
    return "\n".join(lines)
