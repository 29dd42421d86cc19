"""A tiny restore before and after a change: minickpt at a git revision beside this tree's.

    .venv/bin/python -m benchmarks.tiny_restore_ab --base main            # 10 rounds
    .venv/bin/python -m benchmarks.tiny_restore_ab --base 1f9f725 --rounds 6 --n 1000 --dir /dev/shm

The tiny rows move by tens of percent with the load of a shared machine, so a change to the
tiny restore is measured here against the revision before it in the same run: ``--base``'s
``minickpt`` (``git archive`` into a temporary folder) and this tree's alternate, one process
each, ``--rounds`` times. Every process restores the suite's tiny state (4 leaves, 88 bytes)
from a checkpoint in ``--dir``: ``--n`` restores back to back (hot), then 300 restores each
after a ``gc.collect()`` as in the suite (cold), then 300 cold ``CheckpointManager.restore``s.
Printed: the medians over the rounds of each process's medians, in µs, and with ``strace`` on
the machine, each side's system calls per restore (100 restores of each kind).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one round, in a process whose PYTHONPATH holds only the minickpt being measured
_ROUND = r"""
import gc, os, shutil, statistics, sys, tempfile, time
import jax.numpy as jnp, numpy as np
import minickpt
assert os.path.realpath(minickpt.__file__).startswith(os.path.realpath(sys.argv[1])), minickpt.__file__
rng = np.random.default_rng(0)
tree = {"w": jnp.asarray(rng.standard_normal((4, 4), np.float32)),
        "b": jnp.asarray(rng.standard_normal((4,), np.float32)),
        "step": jnp.asarray(7, jnp.int32), "lr": jnp.asarray(1e-3, jnp.float32)}
d = tempfile.mkdtemp(dir=sys.argv[3])
ck, target = minickpt.Checkpointer(), {"state": tree}
path = os.path.join(d, "ck")
ck.save(path, {"state": tree})
m = minickpt.CheckpointManager(os.path.join(d, "mgr"),
                               minickpt.CheckpointManagerOptions(max_to_keep=2))
m.save(1, {"state": tree}, force=True)
m.wait_until_finished()
for _ in range(300):
    ck.restore(path, dict(target)); m.restore(1, target=dict(target))
def timed(fn, n, cold):
    out = []
    for _ in range(n):
        if cold:
            gc.collect()
        t = time.perf_counter_ns(); fn(); out.append(time.perf_counter_ns() - t)
    return statistics.median(out) / 1e3
if sys.argv[4] == "strace":  # the calls of 100 restores of each kind, between two markers
    os.access("/tiny_restore_ab/ck", 0)
    for _ in range(100): ck.restore(path, dict(target))
    os.access("/tiny_restore_ab/mgr", 0)
    for _ in range(100): m.restore(1, target=dict(target))
    os.access("/tiny_restore_ab/end", 0)
else:
    print(timed(lambda: ck.restore(path, dict(target)), int(sys.argv[2]), False),
          timed(lambda: ck.restore(path, dict(target)), 300, True),
          timed(lambda: m.restore(1, target=dict(target)), 300, True))
m.close()
shutil.rmtree(d)
"""

KINDS = ("hot", "cold", "manager_cold")


def _run(src: str, n: int, workdir: str, mode: str, prefix: list[str] | None = None) -> str:
    # the platform this run was given (CPU unless JAX_PLATFORMS says otherwise): both sides alike
    env = {**os.environ, "PYTHONPATH": src,
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run([*(prefix or []), sys.executable, "-c", _ROUND, src, str(n),
                           workdir, mode], env=env, cwd=workdir, check=True,
                          capture_output=True, text=True).stdout


def _syscalls(src: str, workdir: str) -> dict[str, collections.Counter[str]]:
    trace = os.path.join(workdir, "trace.txt")
    _run(src, 0, workdir, "strace", ["strace", "-f", "-o", trace])
    out: dict[str, collections.Counter[str]] = {"ck": collections.Counter(),
                                                "mgr": collections.Counter()}
    part = None
    with open(trace) as f:
        for line in f:
            if 'access("/tiny_restore_ab/' in line:
                part = line.split('access("/tiny_restore_ab/')[1].split('"')[0]
                continue
            if part in out:
                call = line.split(None, 1)[1].split("(", 1)[0]
                out[part][call] += 1
    os.unlink(trace)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--n", type=int, default=2000, help="hot restores per round")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="tiny-ab-base-")
    work = tempfile.mkdtemp(dir=a.dir)
    try:
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.base, "minickpt"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        sides = {"base": base, "this tree": ROOT}
        got: dict[str, list[list[float]]] = {k: [] for k in sides}
        for r in range(a.rounds):
            for side, src in sides.items():
                got[side].append([float(x) for x in _run(src, a.n, work, "time").split()])
            print(f"round {r + 1}: " + "  ".join(f"{side} {got[side][-1]}" for side in sides),
                  flush=True)
        med = {side: [statistics.median(c) for c in zip(*rows, strict=True)]
               for side, rows in got.items()}
        print(f"\nmedians of {a.rounds} rounds, µs ({a.base} vs this tree):")
        for side in sides:
            print(f"  {side:10s} " + "  ".join(f"{k} {v:7.1f}"
                                                for k, v in zip(KINDS, med[side], strict=True)))
        print("  ratio      " + "  ".join(
            f"{k} {t / b:7.3f}" for k, b, t in zip(KINDS, med["base"], med["this tree"],
                                                   strict=True)))
        if shutil.which("strace"):
            print("\nsystem calls per restore (strace -f, 100 restores):")
            for side, src in sides.items():
                for part, calls in _syscalls(src, work).items():
                    what = "Checkpointer" if part == "ck" else "manager"
                    print(f"  {side:10s} {what:12s} {sum(calls.values()) / 100:5.1f}: "
                          + ", ".join(f"{c} {v / 100:g}" for c, v in sorted(calls.items())))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
