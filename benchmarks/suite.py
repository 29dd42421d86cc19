"""The suite: which figures, at which sizes, how many repetitions — and the run itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import jax

from . import async_figs, contenders, floors, machine, multihost, states
from .contenders import (
    FioLimit,
    Limits,
    MinickptCheckpointer,
    MinickptManager,
    OrbaxCheckpointer,
    OrbaxManager,
    orbax_available,
)
from .core import (
    Goal,
    Op,
    Row,
    fmt_bytes,
    fmt_time,
    interleaved,
    markdown_table,
    median,
    text_table,
)
from .plot import plot_scaling

MB = 10**6


@dataclass
class Config:
    """What to run. :meth:`full` is the real run; :meth:`smoke` checks the harness fast."""

    mode: str = "full"
    reps_small: int = 60
    warmup_small: int = 3
    reps_medium: int = 21
    reps_large: int = 9
    large_bytes: int = 400 * MB
    large_leaves: int = 50
    # the 1 GiB and 2 GB rows beside Orbax (save, restore warm and cold); none in a smoke
    # run (skipped by size: they need ~6× their size in memory and minutes)
    huge_sizes: Sequence[int] = (1 << 30, 2000 * MB)
    reps_huge: int = 3
    many_leaves: int = 100_000  # the many-small-leaves figure (issue 21)
    reps_many: int = 3
    wide: tuple[int, int] | None = (1024, 4)  # hidden, layers of the wider TrainState
    scaling_sizes: Sequence[int] = (4_000, 64_000, 1 * MB, 16 * MB, 128 * MB)
    scaling_reps: int = 5
    memory_bytes: int = 400 * MB
    async_bytes: int = 400 * MB
    # Young's interval τ = √(2·C·MTBF) for this MTBF: a small one, so that τ is a few
    # seconds of this machine's steps (a real job's MTBF is hours, its C and step larger)
    mtbf_s: float = 30.0
    # rounds per N of one-interval segments, no saves and each library's, in turn (medians)
    async_rounds: int = 5
    multihost_bytes: int = 64 * MB
    multihost_procs: Sequence[int] = (1, 2, 4)
    orbax: bool = True
    fio: bool = True  # the disk's limit by fio (else, or without fio: the probe, labelled)
    fio_runtime_s: float = 2.0  # at most, per fio case of the sweep (20 cases)
    large_row_bytes: int = 16 * MB  # from this size on a row's limit is the disk's (fio)
    cold: bool = True
    evict: str = "fadvise"
    run_async: str = "auto"  # auto: when minickpt has AsyncCheckpointer; on; off
    run_multihost: str = "auto"
    managers: bool = True
    only: Sequence[str] = ()
    workdir: str = ""
    out: str = "bench-out"

    @classmethod
    def full(cls, **kw: Any) -> Config:
        return cls(**kw)

    @classmethod
    def smoke(cls, **kw: Any) -> Config:
        base = dict(mode="smoke", reps_small=2, warmup_small=1, reps_medium=2, reps_large=2,
                    large_bytes=2 * MB, wide=None, scaling_sizes=(4_000, 256_000),
                    many_leaves=500, reps_many=2,
                    scaling_reps=2, async_bytes=1 * MB, mtbf_s=1.0,
                    # 16 MB in 50 leaves: 320 KB each, above malloc's mmap threshold, so a
                    # restore's arrays are fresh pages (with 4 MB they reused freed heap
                    # and the peak looked like 0.5-0.7× the state)
                    memory_bytes=16 * MB,
                    multihost_bytes=1 * MB, multihost_procs=(1, 2),
                    fio_runtime_s=1.0, large_row_bytes=1 * MB, async_rounds=2,
                    huge_sizes=())
        base.update(kw)
        return cls(**base)

    def wants(self, name: str) -> bool:
        """Whether to run a figure: those named in ``only``; without ``only``, all of them but
        the opt-in ones (:data:`OPT_IN`), which the smoke run still checks at its sizes."""
        if self.only:
            return name in self.only
        return name not in OPT_IN or self.mode == "smoke"


# Figures that run only when named (--only): at 100,000 leaves one Orbax save took 22 min on
# the course's 2-core machine (loaded), so the default run would take hours.
OPT_IN = frozenset({"leaves100k"})


@dataclass
class Results:
    machine: dict[str, Any]
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    limits: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    page_cache: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "config": self.config,
                "rows": [r.as_dict() for r in self.rows], "scaling": self.scaling,
                "limits": self.limits, "memory": self.memory, "extra": self.extra,
                "page_cache": self.page_cache, "skipped": self.skipped,
                "seconds": self.seconds}


def log(msg: str) -> None:
    sys.stderr.write(f"[bench] {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# save / restore figures
# ---------------------------------------------------------------------------------------
def save_restore_rows(cfg: Config, key: str, label: str, tree: Any, *, reps: int, warmup: int,
                      goals_save: Sequence[Goal] = (), goals_restore: Sequence[Goal] = (),
                      managers: bool = True, cold: Any = None, warm: Any = None,
                      background_delete: bool = False, disk: dict[str, Any] | None = None,
                      goals_floor: Sequence[Goal] = (), items: bool = False) -> list[Row]:
    """Checkpointer vs StandardCheckpointer (save, restore warm, restore cold) and
    CheckpointManager vs CheckpointManager (save with retention, restore) — plus, with
    ``background_delete``, both managers' save with that option on.

    A large row (``cfg.large_row_bytes`` and more) is held to the disk's limit by fio: the
    sweep's best case (``disk``, :func:`machine.fio_limits`) runs again on the row's own
    bytes inside the row's interleaved repetitions (minickpt, Orbax, probe, fio, minickpt,
    …), so that the row and its limit are sampled at the same moments; the save rows against
    fio's best write ending in fsync, the cold restore against its best cold read. The
    probe, still timed beside them, goes to the row's note. Without fio, or for small rows,
    the limit is the probe, and a large row's limit says so (``probe, not fio``). A small
    row's save (and manager save) is held to its floor instead: the very system calls one
    minickpt save of that tree made, issued bare (:class:`floors.BareCalls`, limit "bare
    calls"; ``goals_floor`` judge it). A warm
    restore (``warm``, a :class:`machine.WarmCache`) reads the checkpoint's files into the
    page cache before each repetition, for every library alike."""
    wd = cfg.workdir
    size = states.nbytes(tree)
    label = f"{label} ({states.num_leaves(tree)} leaves, {fmt_bytes(size)})"
    limits = Limits(wd, size)
    cks = [MinickptCheckpointer(wd, tree, items=items)] + (
        [OrbaxCheckpointer(wd, tree)] if cfg.orbax else [])
    out = []

    large = size >= cfg.large_row_bytes
    with_fio = large and bool(disk) and disk.get("tool") == "fio"

    def row(kind: str, title: str, ops: list[Op], limit_name: str,
            goals: Sequence[Goal], plus_unlink: bool = False) -> Row:
        side = {"write+fsync": "write", "cold read": "read"}.get(limit_name)
        fio = None
        unlink = plus_unlink and with_fio and side == "write"
        if with_fio and side is not None:
            fio = FioLimit(wd, size, disk, side, cold if side == "read" else None)
            ops = [*ops[:-1], replace(ops[-1], label="probe"), fio.op()]
            if unlink:  # a manager save also removes the retired step: its unlink, measured
                ops.append(floors.UnlinkCost(wd, limits.src).op())
        fresh_mem = large and kind in ("restore", "restore_cold", "manager_restore")
        if fresh_mem:  # a restore makes new arrays: the first touch of that much memory
            ops = [*ops, floors.FreshMemory(size).op()]
        t0 = time.perf_counter()
        try:
            samples = interleaved(ops, reps, warmup)
        finally:
            if fio is not None:
                fio.close()
        log(f"  {key}.{kind}: {time.perf_counter() - t0:.1f} s")
        if fio is not None:
            samples["fio_wall"] = samples.pop("limit")
            samples["limit"], samples["fio_bytes_per_s"] = fio.last(reps)
            if unlink:
                samples["fio_write"] = list(samples["limit"])
                samples["limit"] = [w + u for w, u in
                                    zip(samples["limit"], samples["unlink"], strict=True)]
        r = Row.from_samples(f"{key}.{kind}", f"{label} {title}", samples, nbytes=size,
                             limit_name=limit_name, goals=list(goals))
        if large:
            disk_limit(r, side, disk if fio is not None else None)
        if unlink:
            r.note += (f"; limit = fio's write plus the unlink of a file of this size, "
                       f"measured in the same repetitions ({spread(samples['unlink'], fmt_time)})")
        if fresh_mem:
            r.note += ("; the first touch of fresh memory of the state's size (which a restore "
                       "into new arrays pays and no read limit includes), in the same "
                       f"repetitions: {spread(samples['fresh memory'], fmt_time)}")
        return r

    bare: list[floors.BareCalls] = []
    try:
        if large:
            ops = [c.save() for c in cks] + [limits.write_fsync()]
            out.append(row("save", "save", ops, "write+fsync", goals_save))
        else:
            bare.append(floors.BareCalls(wd, lambda root: None,
                                         lambda fs, root: _mc_save(fs, root, tree)))
            ops = [c.save() for c in cks] + [bare[-1].op()]
            out.append(row("save", "save", ops, "bare calls", [*goals_save, *goals_floor]))
        if large:
            ops = [c.restore(warm=warm) for c in cks] + [limits.read(warm=warm)]
            out.append(row("restore", "restore", ops, "read", goals_restore))
        else:  # floor: the files read and the arrays put on the device, bare
            ops = [c.restore(warm=warm) for c in cks] + [floors.RestoreFloor(cks[0].saved).op()]
            out.append(row("restore", "restore", ops, "read + device_put",
                           [*goals_restore, *goals_floor]))
        if cold is not None:
            ops = [c.restore(cold) for c in cks] + [limits.read(cold)]
            out.append(row("restore_cold", "restore, cold cache", ops, "cold read",
                           goals_restore))
    finally:
        for c in cks:
            c.close()
        for b in bare:
            b.close()
    variants = [(False, "manager save")] if managers else []
    if managers and background_delete:
        variants.append((True, "manager save, background delete"))
    for bg, title in variants:
        mms = [MinickptManager(wd, tree, background_delete=bg)] + (
            [OrbaxManager(wd, tree, background_delete=bg)] if cfg.orbax else [])
        floor = None
        try:
            if large or bg:  # a background delete's calls run in a thread of their own
                ops = [m.save() for m in mms] + [limits.write_fsync()]
                out.append(row("manager_save" + ("_bg" if bg else ""), title, ops,
                               "write+fsync", goals_save, plus_unlink=not bg))
            else:
                floor = floors.BareCalls(wd, lambda root: _mm_save(None, root, tree, [0, 1]),
                                         lambda fs, root: _mm_save(fs, root, tree, [2]))
                ops = [m.save() for m in mms] + [floor.op()]
                out.append(row("manager_save", title, ops, "bare calls",
                               [*goals_save, *goals_floor]))
            if not bg:
                ops = [m.restore(warm) for m in mms] + [limits.read(warm=warm)]
                out.append(row("manager_restore", "manager restore", ops, "read",
                               goals_restore))
        finally:
            for m in mms:
                m.close()
            if floor is not None:
                floor.close()
    limits.close()
    return out


def _mc_save(fs: Any, root: str, tree: Any) -> None:
    """One Checkpointer save, as the row's minickpt does it, into ``root``/ck."""
    import minickpt

    minickpt.Checkpointer(fs).save(os.path.join(root, "ck"), {contenders.ITEM: tree})


def _mm_save(fs: Any, root: str, tree: Any, steps: Sequence[int]) -> None:
    """Manager saves of ``steps`` keeping 2 (so the last one retires the oldest), as the
    row's minickpt manager does them; with a recording ``fs`` only the saves are recorded
    (not the manager's opening and closing)."""
    import minickpt

    opts = minickpt.CheckpointManagerOptions(max_to_keep=2)
    with minickpt.CheckpointManager(os.path.join(root, "m"), opts,
                                    **({"fs": fs} if fs is not None else {})) as m:
        if fs is not None:
            fs.begin()
        for step in steps:
            m.save(step, {contenders.ITEM: tree}, force=True)
        if fs is not None:
            fs.end()


def spread(xs: Sequence[float], fmt: Callable[[float], str]) -> str:
    """A median with the range of its samples: ``0.85 (0.71–0.93, 9 runs)``."""
    if not xs:
        return "—"
    return (f"{fmt(median(xs) or 0)} ({fmt(min(xs))}–{fmt(max(xs))}, {len(xs)} "
            f"run{'s' * (len(xs) != 1)})")


def disk_limit(r: Row, kind: str | None, disk: dict[str, Any] | None) -> None:
    """Name a large row's limit: fio's (its median time, sampled in the row's own
    repetitions, already in ``values["limit"]``; fio's bytes/s and the probe's time go to
    the note), or the probe labelled as what it is. A warm restore (``kind`` None) reads the
    page cache: its limit stays the probe's read of it."""
    if kind is None:
        r.limit_name = "read, page cache (probe)"
        return
    probe = r.samples.get("probe")
    if disk and disk.get("tool") == "fio" and probe:
        r.limit_name = machine.limit_label(kind, disk)
        r.limit_source = "fio"
        what = "write+fsync" if kind == "write" else "cold read"
        bw = r.samples.get("fio_bytes_per_s") or []
        r.note = "; ".join(x for x in (r.note, (
            f"limit: fio {disk[kind]['case']} in this row's repetitions, "
            f"{spread([b / 1e9 for b in bw], lambda v: f'{v:.2f}')} GB/s; the probe "
            f"({what}, one stream) took {spread(probe, fmt_time)}")) if x)
        over = r.vs_limit_value()
        if over is not None and over > 1.0:
            r.note += "; " + above_limit_reason(r, kind)
        direct = disk.get(f"{kind}_direct")
        mine = median(r.samples.get("minickpt"))
        if kind == "write" and direct and mine and r.nbytes \
                and not disk[kind]["spec"].get("direct"):
            gbps = r.nbytes / mine / 1e9
            r.note += (f"; fio's best O_DIRECT write in the sweep (the path minickpt's large "
                       f"files take): {direct['case']}, {direct['bytes_per_s'] / 1e9:.2f} GB/s, "
                       f"minickpt {gbps:.2f} GB/s ({gbps * 1e9 / direct['bytes_per_s']:.2f} "
                       "of it)")
    else:
        r.limit_name = machine.limit_label(kind, None)


def above_limit_reason(r: Row, kind: str) -> str:
    """That minickpt beat fio's best case in this row, and how often, pair by pair."""
    m = r.samples.get("minickpt") or []
    lim = r.samples.get("limit") or []
    faster = sum(a < b for a, b in zip(m, lim, strict=False))
    return (f"above 1.0 of limit by the medians: minickpt faster than fio in {faster} of "
            f"{len(m)} repetitions side by side")


def scaling(cfg: Config, cache: Any, warm: Any = None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Save/restore time and the machine's limits over state sizes (50 leaves each)."""
    points, lims = [], []
    for size in cfg.scaling_sizes:
        log(f"scaling: {fmt_bytes(size)}")
        tree = jax.block_until_ready(states.uniform(size, 50, seed=5))
        n = states.nbytes(tree)
        limits = Limits(cfg.workdir, n)
        cks = [MinickptCheckpointer(cfg.workdir, tree)] + (
            [OrbaxCheckpointer(cfg.workdir, tree)] if cfg.orbax else [])
        try:
            save = interleaved([c.save() for c in cks] + [limits.write_fsync()],
                               cfg.scaling_reps, 1)
            restore = interleaved([c.restore(warm=warm) for c in cks]
                                  + [limits.read(warm=warm)],
                                  cfg.scaling_reps, 1)
            lim = interleaved([limits.memcpy()], cfg.scaling_reps, 1)
            entry: dict[str, Any] = {"nbytes": n}
            if cache is not None:
                cold = interleaved([limits.read(cache)], cfg.scaling_reps, 0)
                entry["cold_read"] = median(cold["limit"])
        finally:
            for c in cks:
                c.close()
            limits.close()
        points.append({"nbytes": n,
                       "save": {k: median(v) for k, v in save.items()},
                       "restore": {k: median(v) for k, v in restore.items()},
                       "memcpy": median(lim["limit"]),
                       "samples": {"save": save, "restore": restore}})
        entry.update(write_fsync=median(save["limit"]), read=median(restore["limit"]),
                     memcpy=median(lim["limit"]))
        lims.append(entry)
    return points, lims


# ---------------------------------------------------------------------------------------
# peak memory (fresh subprocesses)
# ---------------------------------------------------------------------------------------
def memory_rows(cfg: Config, leaves: int = 50) -> tuple[list[Row], list[dict[str, Any]]]:
    """One fresh process per library, run side by side (a resident set is per process, so
    they do not disturb each other's figures).

    ``leaves=50`` (the default): the memory figure, ``cfg.memory_bytes`` in 50 leaves, peak
    memory ÷ the state's bytes. Otherwise the many-small-leaves state
    (:func:`states.many_leaves`), peak ÷ the host memory the state itself takes (100,000
    jax.Arrays weigh far more than their 1.6 MB of numbers; a restore makes them anew)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    many = leaves != 50
    key = "leaves100k." if many else ""
    procs = {}
    for lib in ("minickpt", "orbax") if cfg.orbax else ("minickpt",):
        cmd = [sys.executable, "-m", "benchmarks.memory", "--lib", lib, "--dir", cfg.workdir]
        cmd += ["--many-leaves", str(leaves)] if many else \
            ["--bytes", str(cfg.memory_bytes), "--leaves", "50"]
        procs[lib] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=root)
    reports = []
    try:
        for lib, proc in procs.items():
            out, err = proc.communicate(timeout=900)
            line = next((ln for ln in out.splitlines() if ln.startswith("MEMORY ")), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"memory measurement of {lib} failed (exit "
                                   f"{proc.returncode}):\n{err[-3000:]}")
            reports.append(json.loads(line[len("MEMORY "):]))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    size = reports[0]["state_bytes"]
    shape = f"{leaves} leaves, {fmt_bytes(size)}"
    rows = []
    if many:
        shape += f", {fmt_bytes(reports[0]['state_resident_bytes'] or 0)} in memory"
    else:
        for phase in ("save", "restore"):
            samples = {r["lib"]: [r[f"{phase}_s"]] for r in reports}
            rows.append(Row.from_samples(f"fresh.{phase}", f"first {phase} in a fresh process "
                                         f"({shape})", samples, nbytes=size, section="memory"))
    ratio = "resident_ratio" if many else "ratio"
    for phase in ("save", "restore"):
        values = {r["lib"]: r[f"{phase}_{ratio}"] for r in reports}
        row = Row(f"memory.{key}{phase}", f"peak memory of a {phase} ({shape}"
                  f"{'; ÷ the state in memory' if many else ''})", nbytes=size, unit="x",
                  values={"minickpt": values.get("minickpt"), "orbax": values.get("orbax"),
                          "limit": None},
                  goals=[Goal("max", 1.2)], section="memory")
        rows.append(row)
    return rows, reports


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
def run(cfg: Config) -> Results:
    t_start = time.perf_counter()
    os.makedirs(cfg.out, exist_ok=True)
    own_workdir = not cfg.workdir
    if own_workdir:
        cfg.workdir = tempfile.mkdtemp(prefix="work-", dir=os.path.abspath(cfg.out))
    os.makedirs(cfg.workdir, exist_ok=True)
    if cfg.orbax and not orbax_available():
        log("orbax-checkpoint is not installed: Orbax columns will be empty")
        cfg.orbax = False
    res = Results(machine.describe(cfg.workdir), asdict(cfg))
    res.machine["disk_limit"] = disk_limits(cfg)
    cache = None
    if cfg.cold:
        try:
            cache = machine.PageCache(cfg.evict)
        except PermissionError as e:
            log(f"cold-cache figures skipped: {e}")
            res.skipped.append(f"cold cache: {e}")
    warm = machine.WarmCache()
    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
    try:
        _run_figures(cfg, res, cache, warm)
    finally:
        if own_workdir:
            shutil.rmtree(cfg.workdir, ignore_errors=True)
    res.page_cache = {
        "warm": warm.statement(),
        "cold": cache.statement() if cache is not None else "not measured",
        "drop_caches_possible": str(machine.drop_caches_possible()),
    }
    res.machine["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    res.seconds = time.perf_counter() - t_start
    return res


NO_DISK_ROWS = "no row of this run is held to the disk's limit"


def disk_limits(cfg: Config) -> dict[str, Any]:
    """fio on the checkpoints' file system, or why not (then the probe is the limit)."""
    if not cfg.fio:
        return {"tool": None, "reason": "fio turned off (--no-fio)"}
    if not (cfg.wants("large") or (cfg.wants("trainstate") and cfg.wide is not None)):
        return {"tool": None, "reason": NO_DISK_ROWS}
    t0 = time.perf_counter()
    disk = machine.fio_limits(cfg.workdir, max(cfg.large_bytes, 8 * MB),
                              runtime_s=cfg.fio_runtime_s, smoke=cfg.mode == "smoke")
    if disk.get("tool") == "fio":
        for c in disk["cases"]:
            log(f"  fio {c['case']}: {c['bytes_per_s'] / 1e9:.2f} GB/s")
        log(f"disk limit by fio ({time.perf_counter() - t0:.0f} s): write+fsync "
            f"{disk['write']['bytes_per_s'] / 1e9:.2f} GB/s ({disk['write']['case']}), read "
            f"{disk['read']['bytes_per_s'] / 1e9:.2f} GB/s ({disk['read']['case']})")
    else:
        log(f"no fio: {disk['reason']}; large rows are held to the probe "
            f"({machine.PROBE_LABEL})")
    return disk


def _run_figures(cfg: Config, res: Results, cache: Any, warm: Any) -> None:
    disk = res.machine.get("disk_limit")
    x20 = [Goal("x_orbax", 20)]
    small = dict(reps=cfg.reps_small, warmup=cfg.warmup_small, managers=cfg.managers,
                 warm=warm)
    if cfg.wants("tiny"):
        log("tiny tree")
        res.rows += save_restore_rows(cfg, "tiny", "tiny", states.tiny(), goals_save=x20,
                                      goals_restore=x20, background_delete=True,
                                      goals_floor=[Goal("x_limit_max", 1.25)], **small)
    if cfg.wants("leaves200"):
        log("200-leaf tree")
        res.rows += save_restore_rows(cfg, "leaves200", "200-leaf", states.leaves200(),
                                      goals_save=x20, goals_restore=x20, background_delete=True,
                                      **small)
    if cfg.wants("trainstate"):
        log("TrainState")
        res.rows += save_restore_rows(cfg, "trainstate", "TrainState, demo MLP",
                                      states.train_state(), **small)
        if cfg.wide is not None:
            hidden, layers = cfg.wide
            log("wide TrainState")
            res.rows += save_restore_rows(
                cfg, "trainstate_wide", f"TrainState, {layers}×{hidden} MLP",
                states.train_state(hidden, layers), reps=cfg.reps_medium, warmup=1,
                managers=cfg.managers, disk=disk, warm=warm)
    if cfg.wants("leaves100k"):
        log(f"{cfg.many_leaves}-leaf tree")
        tree = jax.block_until_ready(states.many_leaves(cfg.many_leaves))
        x1 = [Goal("x_orbax", 1)]
        res.rows += save_restore_rows(cfg, "leaves100k", "many small leaves", tree,
                                      reps=cfg.reps_many, warmup=0, goals_save=x1,
                                      goals_restore=x1, managers=False, warm=warm)
        del tree
        log("peak memory, many small leaves")
        rows, reports = memory_rows(cfg, leaves=cfg.many_leaves)
        res.rows += rows
        res.extra["memory_many_leaves"] = reports
    if cfg.wants("large"):
        log(f"large state ({fmt_bytes(cfg.large_bytes)})")
        tree = jax.block_until_ready(states.uniform(cfg.large_bytes, cfg.large_leaves))
        res.rows += save_restore_rows(
            cfg, "large", "large", tree, reps=cfg.reps_large, warmup=1,
            goals_save=[Goal("of_limit", 0.9), Goal("x_orbax", 3)],
            goals_restore=[Goal("of_limit", 0.8), Goal("x_orbax", 2)], managers=cfg.managers,
            cold=cache, disk=disk, warm=warm)
        del tree
    if cfg.wants("items"):
        # the large state's leaves as as many items (minickpt: one item per top-level key,
        # Orbax: the same dict as one tree), each below the size that is read by threads:
        # what a restore does across items, not within one (issue 40)
        log(f"large state as {cfg.large_leaves} items ({fmt_bytes(cfg.large_bytes)})")
        tree = jax.block_until_ready(states.uniform(cfg.large_bytes, cfg.large_leaves))
        res.rows += save_restore_rows(
            cfg, "items", f"large, {cfg.large_leaves} items", tree, reps=cfg.reps_large,
            warmup=1, goals_save=[Goal("x_orbax", 3)], goals_restore=[Goal("x_orbax", 2)],
            managers=False, disk=disk, warm=warm, items=True)
        del tree
    if cfg.wants("huge"):
        if not cfg.huge_sizes:
            res.skipped.append("huge: the 1 GiB and 2 GB rows, skipped by size in this run")
        for n in cfg.huge_sizes:
            log(f"huge state ({fmt_bytes(n)})")
            tree = jax.block_until_ready(states.uniform(n, cfg.large_leaves))
            res.rows += save_restore_rows(
                cfg, "large_" + fmt_bytes(n).replace(" ", "").replace(".", "_"), "large",
                tree, reps=cfg.reps_huge, warmup=1,
                goals_save=[Goal("of_limit", 0.9), Goal("x_orbax", 3)],
                goals_restore=[Goal("of_limit", 0.8), Goal("x_orbax", 2)], managers=False,
                cold=cache, disk=disk, warm=warm)
            del tree
    if cfg.wants("memory"):
        log(f"peak memory ({fmt_bytes(cfg.memory_bytes)})")
        rows, reports = memory_rows(cfg)
        res.rows += rows
        res.memory = reports
    if cfg.wants("scaling"):
        res.scaling, res.limits = scaling(cfg, cache, warm)
        title = machine.one_line(res.machine)
        res.extra["plot"] = plot_scaling(res.scaling, os.path.join(cfg.out, "scaling.png"),
                                         title)
    if cfg.wants("async"):
        _async(cfg, res)
    if cfg.wants("multihost"):
        _multihost(cfg, res)


def _async(cfg: Config, res: Results) -> None:
    have = async_figs.minickpt_available()
    if cfg.run_async == "off" or (cfg.run_async == "auto" and not have):
        res.skipped.append("async: minickpt has no AsyncCheckpointer yet (branch 'async'); "
                           "the figures run as soon as it has")
        return
    log(f"async ({fmt_bytes(cfg.async_bytes)})")
    tree = jax.block_until_ready(states.uniform(cfg.async_bytes, cfg.large_leaves, seed=7))
    factories: dict[str, Callable[[], Any]] = {
        "minickpt": lambda: MinickptManager(cfg.workdir, tree, async_=have)}
    if cfg.orbax:
        factories["orbax"] = lambda: OrbaxManager(cfg.workdir, tree, async_=True)
    rows, detail = async_figs.rows(tree, factories, reps=min(cfg.reps_large, 5),
                                   label=f"{fmt_bytes(states.nbytes(tree))} state",
                                   nbytes=states.nbytes(tree), rounds=cfg.async_rounds,
                                   max_every=1000 if cfg.mode == "full" else 20,
                                   mtbf_s=cfg.mtbf_s)
    if not have:
        for r in rows:
            r.note = "; ".join(x for x in ("minickpt has no async checkpointer yet: its "
                                           "figure is a blocking save", r.note) if x)
    res.rows += rows
    res.extra["async"] = detail


def _multihost(cfg: Config, res: Results) -> None:
    have = multihost.minickpt_available()
    if cfg.run_multihost == "off" or (cfg.run_multihost == "auto" and not have):
        res.skipped.append("multi-host: minickpt.multihost does not exist yet (branch "
                           "'multihost'); the figures run as soon as it does")
        return
    log(f"multi-host ({fmt_bytes(cfg.multihost_bytes)})")
    rows, raw = multihost.rows(cfg.multihost_bytes, cfg.workdir, procs=cfg.multihost_procs,
                               reps=10 if cfg.mode == "full" else cfg.reps_large,
                               rounds=2 if cfg.mode == "full" else 1, orbax=cfg.orbax,
                               minickpt=have)
    res.rows += rows
    res.extra["multihost"] = raw


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def scaling_table(res: Results) -> str:
    if not res.scaling:
        return ""
    head = "| state | minickpt save | Orbax save | write+fsync (probe) | minickpt restore | " \
           "Orbax restore | read (warm, probe) | read (cold, probe) | memcpy |"
    lines = [head, "|" + "---|" * 9]
    cold = {e["nbytes"]: e.get("cold_read") for e in res.limits}
    for p in res.scaling:
        def t(v: float | None) -> str:
            from .core import fmt_time

            return "—" if v is None else fmt_time(v)

        lines.append(f"| {fmt_bytes(p['nbytes'])} | {t(p['save'].get('minickpt'))} | "
                     f"{t(p['save'].get('orbax'))} | {t(p['save'].get('limit'))} | "
                     f"{t(p['restore'].get('minickpt'))} | {t(p['restore'].get('orbax'))} | "
                     f"{t(p['restore'].get('limit'))} | {t(cold.get(p['nbytes']))} | "
                     f"{t(p.get('memcpy'))} |")
    return "\n".join(lines)


def report_markdown(res: Results, *, scaling: bool = True) -> str:
    m = res.machine
    parts = [f"Machine: {machine.one_line(m)}. minickpt's CRC-32 via {m['minickpt_crc32']}. "
             f"Load average {fmt_load(m.get('load_avg_start'))} at the start, "
             f"{fmt_load(m.get('load_avg_end'))} at the end (the machine is shared). "
             f"{m.get('time')}, git {m.get('git', '?')}, mode {res.config['mode']}, "
             f"{res.seconds:.0f} s.",
             "",
             arrays_statement(m),
             "",
             "Page cache — warm rows: " + res.page_cache.get("warm", "") + "; cold rows: "
             + res.page_cache.get("cold", "") + ".",
             "",
             disk_statement(m.get("disk_limit")),
             "",
             markdown_table(res.rows)]
    notes = [f"- {r.figure}: {r.note}" for r in res.rows if r.note]
    if notes:
        parts += ["", *notes]
    if res.skipped:
        parts += ["", *[f"- not run: {s}" for s in res.skipped]]
    st = scaling_table(res) if scaling else ""
    if st:
        parts += ["", "Scaling (medians; 50 float32 leaves):", "", st]
    return "\n".join(parts) + "\n"


def arrays_statement(m: dict[str, Any]) -> str:
    """Where the states' arrays live: a save starts from them there, a restore ends there."""
    where = m.get("jax_devices", "?")
    backend = m.get("jax_backend", "?")
    if backend == "cpu":
        return (f"Arrays: on the CPU ({where}, JAX's default backend): a save reads host "
                "memory, a restore's arrays stay in host memory.")
    return (f"Arrays: on the device — {where} (JAX's default backend, {backend}). Every state "
            "is made of jax.Arrays placed there; a save includes the device-to-host copy, "
            "and a restore ends with the arrays placed back there (its target carries their "
            "shardings), for every library alike.")


def disk_statement(disk: dict[str, Any] | None) -> str:
    """The disk's limit in one sentence: fio's best cases, or that the probe stands in."""
    if not disk or disk.get("tool") != "fio":
        why = (disk or {}).get("reason", "not measured")
        if why == NO_DISK_ROWS:
            return f"Disk limit: not measured ({why})."
        return (f"Disk limit: {machine.PROBE_LABEL} — {why}; the large rows' limit is one "
                "stream of write + fsync (like `dd conv=fsync`) and one read, which a "
                "library can beat.")
    n = len(disk["cases"])
    return (f"Disk limit by {disk.get('fio_version', 'fio')} on the checkpoints' file "
            f"system. A sweep at the start, {n} cases (sequential, "
            f"{fmt_bytes(disk['total_bytes'])} per case, buffered and O_DIRECT, block sizes "
            "and 1–4 jobs as in `results.json`), picks the best case of each side: write "
            f"ending in fsync {disk['write']['case']} "
            f"({disk['write']['bytes_per_s'] / 1e9:.2f} GB/s there), cold read "
            f"{disk['read']['case']} ({disk['read']['bytes_per_s'] / 1e9:.2f} GB/s there). "
            "Each large row then runs that case on its own bytes inside its interleaved "
            "repetitions (minickpt, Orbax, probe, fio, minickpt, …), so that the row and its "
            "limit are sampled at the same moments: the row's limit is fio's median time "
            "there, its \"of limit\" that ÷ minickpt's median, and its note gives fio's "
            "median GB/s with the range of its runs.")


def fmt_load(v: Any) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)


def write_outputs(res: Results, out: str) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "results.json"),
             "markdown": os.path.join(out, "table.md"),
             "readme": os.path.join(out, "readme-section.md")}
    with open(paths["json"], "w") as f:
        json.dump(res.as_dict(), f, indent=1, default=str)
    with open(paths["markdown"], "w") as f:
        f.write(report_markdown(res))
    with open(paths["readme"], "w") as f:
        f.write(report_markdown(res, scaling=False))
    if "plot" in res.extra:
        paths["plot"] = res.extra["plot"]
    return paths


def print_report(res: Results) -> None:
    print(f"\nminickpt benchmarks — {machine.one_line(res.machine)}")
    print(f"page cache: warm = {res.page_cache.get('warm')}; cold = {res.page_cache.get('cold')}")
    print()
    print(text_table(res.rows))
    for r in res.rows:
        if r.note:
            print(f"  note — {r.figure}: {r.note}")
    for s in res.skipped:
        print(f"  not run — {s}")
    missed = [r for r in res.rows if r.all_met() is False]
    met = [r for r in res.rows if r.all_met()]
    print(f"\ngoals: {len(met)} rows met, {len(missed)} missed")
    st = scaling_table(res)
    if st:
        print("\nscaling (medians):\n" + st)
