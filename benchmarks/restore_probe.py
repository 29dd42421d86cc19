"""The 400 MB restore, call by call: ``Checkpointer.restore`` and the manager's, interleaved.

    JAX_PLATFORMS= python -m benchmarks.restore_probe [--mb 400]

Written for the TPU machine, where the suite's restore rows moved by 100 ms between two
libraries' runs of the same code: each call's time is printed (not a median), for a restore
onto the device, without checksums, and to host memory, so that a bimodal machine shows as
such; then a profile of one restore of each kind.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

import minickpt

from . import states


def _times(f: Callable[[], Any], n: int = 5) -> str:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        out.append(f"{(time.perf_counter() - t0) * 1e3:.0f}")
    return " ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    a = ap.parse_args()
    tree = states.uniform(a.mb * 1_000_000)
    target = {"s": states.abstract(tree)}
    work = tempfile.mkdtemp(dir=a.dir, prefix="restore-probe-")
    try:
        ck = minickpt.Checkpointer()
        path = os.path.join(work, "ck")
        ck.save(path, {"s": tree})
        opts = minickpt.CheckpointManagerOptions(max_to_keep=2)
        with minickpt.CheckpointManager(os.path.join(work, "m"), opts) as m:
            m.save(0, {"s": tree}, force=True)
            kinds = {"checkpointer": lambda: ck.restore(path, target),
                     "manager": lambda: m.restore(0, target=target),
                     "checkpointer, no checksums": lambda: ck.restore(path, target,
                                                                      verify=False),
                     "checkpointer, to host": lambda: ck.restore(path)}
            for _ in range(2):
                for name, f in kinds.items():
                    print(f"{name:28s} ms: {_times(f)}", flush=True)
            for name in ("checkpointer", "manager"):
                prof = cProfile.Profile()
                prof.enable()
                jax.block_until_ready(kinds[name]())
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(12)
                print(name, text.getvalue())
    finally:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
