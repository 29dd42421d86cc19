"""Multi-host figures: 1, 2 and 4 local processes saving the same global state.

Each configuration starts ``n`` copies of :mod:`benchmarks.mh_worker` on localhost with
``4 / n`` CPU devices each, so the global mesh always has 4 devices and the state is the same;
only the number of processes sharing the writing changes. minickpt's figures run once
``minickpt.multihost`` exists (the multi-host save protocol); until then its cells say so.

Each row's floor (:func:`independent_saves`) is what the machine does with no coordination
at all: ``n`` plain processes, each saving its share of the bytes with a single-process
``Checkpointer`` at the same moment; the slowest one's time. What a collective save adds to
it is the protocol (the step agreement, three barriers, the primary's manifests and commit)
and the JAX runtime of each process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .core import Goal, Row, median

DEVICES = 4


def minickpt_available() -> bool:
    """True once the multi-host save protocol (``minickpt.multihost``) is part of minickpt."""
    return importlib.util.find_spec("minickpt.multihost") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _independent_worker(nbytes: int, leaves: int, root: str, reps: int, bar: Any,
                        q: Any) -> None:
    import numpy as np

    import minickpt
    from minickpt.format.buffers import aligned_empty

    tree = {}
    for i in range(leaves):
        a = aligned_empty((max(nbytes // leaves // 4, 1),), np.float32)
        a[:] = np.random.default_rng(i).standard_normal(a.size, np.float32)
        tree[f"leaf_{i:03d}"] = a
    ck, times = minickpt.Checkpointer(), []
    for r in range(reps + 1):  # the first one warms up
        d = os.path.join(root, f"{os.getpid()}-{r}")
        bar.wait()
        t = time.perf_counter()
        ck.save(d, {"state": tree})
        times.append(time.perf_counter() - t)
        bar.wait()
    q.put(times[1:])


def independent_saves(nproc: int, nbytes: int, workdir: str, *, reps: int = 3,
                      leaves: int = 16) -> list[float]:
    """The floor of an ``nproc``-process save of ``nbytes``: ``nproc`` processes with no
    coordination, each saving ``nbytes / nproc`` at once; the slowest one's time, per
    repetition."""
    import multiprocessing as mp
    import shutil

    ctx = mp.get_context("spawn")
    root = tempfile.mkdtemp(prefix=f"mh-floor-{nproc}-", dir=workdir)
    bar, q = ctx.Barrier(nproc, timeout=300), ctx.Queue()
    procs = [ctx.Process(target=_independent_worker,
                         args=(nbytes // nproc, leaves, root, reps, bar, q))
             for _ in range(nproc)]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    return [max(ts[i] for ts in got) for i in range(reps)]


def run_once(lib: str, nproc: int, nbytes: int, workdir: str, *, reps: int = 3,
             leaves: int = 16, timeout: float = 600) -> dict[str, Any]:
    """Start ``nproc`` workers, wait for all of them, return process 0's report."""
    port = _free_port()
    ckpt = tempfile.mkdtemp(prefix=f"mh-{lib}-{nproc}-", dir=workdir)
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count="
                                         f"{DEVICES // nproc}"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    procs = []
    try:
        for pid in range(nproc):
            cmd = [sys.executable, "-m", "benchmarks.mh_worker", "--lib", lib, "--nproc",
                   str(nproc), "--pid", str(pid), "--port", str(port), "--bytes", str(nbytes),
                   "--leaves", str(leaves), "--dir", ckpt, "--reps", str(reps)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, cwd=root))
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            outs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    for rc, _out, err in outs:
        if rc != 0:
            raise RuntimeError(f"multi-host {lib} save with {nproc} processes failed "
                               f"(exit {rc}):\n{err[-3000:]}")
    phases = [json.loads(line[len("MHPHASES "):]) for _rc, out, _err in outs
              for line in out.splitlines() if line.startswith("MHPHASES ")]
    for line in outs[0][1].splitlines():
        if line.startswith("MULTIHOST "):
            rep = json.loads(line[len("MULTIHOST "):])
            rep["phases"] = sorted(phases, key=lambda p: p["process"])
            return rep
    raise RuntimeError(f"process 0 of the {lib} run reported nothing:\n{outs[0][2][-3000:]}")


def rows(nbytes: int, workdir: str, *, procs: Sequence[int] = (1, 2, 4), reps: int = 3,
         rounds: int = 1, orbax: bool = True, minickpt: bool | None = None
         ) -> tuple[list[Row], list[dict]]:
    """One row per process count: each library's median save wall time, held to the floor
    of :func:`independent_saves`; and one row of each library's time at the most processes
    ÷ its time at one, held to the issue's goals (≤ 1.5×, and ≤ Orbax's ratio).

    The configurations run ``rounds`` times in turn (1, 2, 4 processes, both libraries and
    the floor each time), so that a change in the machine's load falls on all of them."""
    minickpt = minickpt_available() if minickpt is None else minickpt
    libs = [lib for lib, wanted in (("minickpt", minickpt), ("orbax", orbax)) if wanted]
    samples: dict[int, dict[str, list[float]]] = {n: {} for n in procs}
    phases: dict[int, dict[str, list[dict]]] = {n: {} for n in procs}
    notes: dict[int, list[str]] = {n: [] for n in procs}
    raw: list[dict] = []
    for _ in range(rounds):
        for n in procs:
            for lib in libs:
                try:
                    rep = run_once(lib, n, nbytes, workdir, reps=reps)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    notes[n].append(f"{lib} failed: {str(e).splitlines()[0]}")
                    continue
                raw.append(rep)
                samples[n].setdefault(lib, []).extend(rep["times"])
                if rep.get("phases"):
                    phases[n].setdefault(lib, []).append(rep)
            try:
                floor_times = independent_saves(n, nbytes, workdir, reps=reps)
            except Exception as e:  # the floor explains the row; its failure does not stop it
                notes[n].append(f"floor failed: {type(e).__name__}: {e}")
                continue
            raw.append({"lib": "independent saves (floor)", "nproc": n, "nbytes": nbytes,
                        "times": floor_times})
            samples[n].setdefault("limit", []).extend(floor_times)
    out = []
    for n in procs:
        row = Row.from_samples(f"multihost.save.{n}", f"multi-host save, {n} process"
                               f"{'es' if n > 1 else ''} × {DEVICES // n} devices",
                               samples[n], nbytes=nbytes, section="multihost",
                               limit_name=f"{n} independent saves")
        for lib, reps_ in phases[n].items():
            notes[n].append(f"{lib} phases per process (median ms over the rounds' "
                            "medians): " + phase_text(_merge_phases(reps_)))
        if "limit" in samples[n]:
            notes[n].append(f"limit: {n} plain processes (no JAX, no coordination) each "
                            f"saving its 1/{n} of the bytes with a single-process "
                            "Checkpointer at the same moment, the slowest one's time")
        if not minickpt:
            notes[n].append("minickpt: multi-host protocol not available yet")
        row.note = "; ".join(notes[n])
        out.append(row)
    if len(procs) > 1:
        lo, hi = out[0], out[-1]
        ratio = {lib: (hi.values[lib] / lo.values[lib]
                       if hi.values.get(lib) and lo.values.get(lib) else None)
                 for lib in ("minickpt", "orbax")}
        floor_ratio = (hi.values["limit"] / lo.values["limit"]
                       if hi.values.get("limit") and lo.values.get("limit") else None)
        r = Row(f"multihost.ratio.{procs[-1]}", f"multi-host save, {procs[-1]} processes ÷ "
                f"{procs[0]}", unit="r", values={**ratio, "limit": floor_ratio},
                goals=[Goal("max", 1.5), Goal("max_x_orbax", 1.0)], section="multihost",
                limit_name="the floors' ratio")
        r.note = ("the same ratio for the limit column: the machine's own cost of "
                  f"{procs[-1]} processes writing at once instead of {procs[0]}")
        out.append(r)
        for mid in out[1:-2]:  # the processes between: their ratios in their notes
            if mid.values.get("minickpt") and lo.values.get("minickpt"):
                mid.note += (f"; minickpt {mid.values['minickpt'] / lo.values['minickpt']:.2f}×"
                             f" the {procs[0]}-process time")
    return out, raw


def _merge_phases(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every process's phases as the median over several runs' per-run medians."""
    by_proc: dict[int, dict[str, list[float]]] = {}
    for rep in reps:
        for p in rep["phases"]:
            d = by_proc.setdefault(p["process"], {})
            for k, v in p.items():
                if k != "process" and v is not None:
                    d.setdefault(k, []).append(v)
    return {"phases": [{"process": p, **{k: median(v) for k, v in d.items()}}
                       for p, d in sorted(by_proc.items())]}


def phase_text(rep: dict[str, Any]) -> str:
    """``p0 snapshot 3 write 40 fsync 12 barrier 30 commit 5 retention 2; p1 …``."""
    return "; ".join(
        f"p{p['process']} " + " ".join(f"{k[:-2]} {1e3 * v:.0f}" for k, v in p.items()
                                       if k != "process" and v is not None)
        for p in rep["phases"])


def summary(rows_: Sequence[Row]) -> dict[str, Any]:
    return {r.key: {k: median(v) for k, v in r.samples.items()} for r in rows_}
