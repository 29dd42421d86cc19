"""Restores with a restore buffer's huge-page advice taken back and with numpy's left as it is,
interleaved in one process (issue 51: the first restore in a fresh process).

    python -m benchmarks.huge_pages_ab [--mb 400] [--leaves 50] [--reps 12] [--dir D]

numpy advises huge pages for allocations from 4 MiB; where the kernel compacts memory for
advised pages on first touch, a restore into fresh memory can wait for it. minickpt takes the
advice back (``minickpt.format.buffers._plain_pages``) where the kernel's ``defrag`` setting
would stall. Printed: the median and the worst restore of each way, and that setting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax

from . import states


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: $TMPDIR)")
    a = p.parse_args(argv)
    import minickpt
    from minickpt.format import buffers

    if buffers._MADVISE is None:
        print("huge-page advice is not taken back here (no Linux, or the kernel's THP defrag "
              "does not stall for advised memory): nothing to compare")
        return 0
    tree = jax.block_until_ready(states.uniform(a.mb * 10**6, a.leaves))
    target = {"s": states.abstract(tree)}
    d = tempfile.mkdtemp(prefix="hp-ab-", dir=a.dir)
    try:
        ck = minickpt.Checkpointer()
        path = os.path.join(d, "c")
        ck.save(path, {"s": tree})
        times: dict[str, list[float]] = {"plain pages": [], "numpy's advice": []}
        advise = buffers._MADVISE
        try:
            for _ in range(a.reps):
                for way in times:
                    buffers._MADVISE = advise if way == "plain pages" else None
                    t = time.perf_counter()
                    out = jax.block_until_ready(ck.restore(path, target))
                    times[way].append(time.perf_counter() - t)
                    del out
        finally:
            buffers._MADVISE = advise
    finally:
        shutil.rmtree(d, ignore_errors=True)
    with open(buffers.THP_DEFRAG) as f:
        print(f"{a.mb} MB in {a.leaves} leaves, {a.reps} restores each way, interleaved; "
              f"THP defrag: {f.read().strip()}")
    for way, ts in times.items():
        print(f"{way:>15}: median {statistics.median(ts) * 1e3:7.1f} ms, "
              f"worst {max(ts) * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
