"""Multi-host figures: 1, 2 and 4 local processes saving the same global state.

Each configuration starts ``n`` copies of :mod:`benchmarks.mh_worker` on localhost with
``4 / n`` CPU devices each, so the global mesh always has 4 devices and the state is the same;
only the number of processes sharing the writing changes. minickpt's figures run once
``minickpt.multihost`` exists (the multi-host save protocol); until then its cells say so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .core import Row, median

DEVICES = 4


def minickpt_available() -> bool:
    """True once the multi-host save protocol (``minickpt.multihost``) is part of minickpt."""
    return importlib.util.find_spec("minickpt.multihost") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


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
         orbax: bool = True, minickpt: bool | None = None) -> tuple[list[Row], list[dict]]:
    """One row per process count: minickpt's and Orbax's median save wall time."""
    minickpt = minickpt_available() if minickpt is None else minickpt
    out, raw = [], []
    base: float | None = None
    for n in procs:
        samples: dict[str, list[float]] = {}
        notes = []
        for lib, wanted in (("minickpt", minickpt), ("orbax", orbax)):
            if not wanted:
                continue
            try:
                rep = run_once(lib, n, nbytes, workdir, reps=reps)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                notes.append(f"{lib} failed: {str(e).splitlines()[0]}")
                continue
            raw.append(rep)
            samples[lib] = rep["times"]
            if rep.get("phases"):
                notes.append(f"{lib} phases per process (median ms): " + phase_text(rep))
        row = Row.from_samples(f"multihost.save.{n}", f"multi-host save, {n} process"
                               f"{'es' if n > 1 else ''} × {DEVICES // n} devices",
                               samples, nbytes=nbytes, section="multihost")
        if n == procs[0]:
            base = row.values.get("minickpt")
        elif base is not None and row.values.get("minickpt"):
            notes.append(f"minickpt {row.values['minickpt'] / base:.2f}× the "
                         f"{procs[0]}-process time")
        if not minickpt:
            notes.append("minickpt: multi-host protocol not available yet")
        row.note = "; ".join(notes)
        out.append(row)
    return out, raw


def phase_text(rep: dict[str, Any]) -> str:
    """``p0 snapshot 3 write 40 fsync 12 barrier 30 commit 5 retention 2; p1 …``."""
    return "; ".join(
        f"p{p['process']} " + " ".join(f"{k[:-2]} {1e3 * v:.0f}" for k, v in p.items()
                                       if k != "process" and v is not None)
        for p in rep["phases"])


def summary(rows_: Sequence[Row]) -> dict[str, Any]:
    return {r.key: {k: median(v) for k, v in r.samples.items()} for r in rows_}
