"""On an accelerator: a donating step right after an async save changes nothing it writes.

    JAX_PLATFORMS= python -m benchmarks.donation_check [--mb 400]

Saves a state of one array with ``AsyncCheckpointer`` (device-side snapshot automatic, then
ruled out, twice each), donates the array to a jitted step as soon as ``save()`` returns, and
prints how long ``save()`` blocked, whether the array was really donated, and whether the
checkpoint holds the values it had at ``save()`` (read back with the library).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import numpy as np

import minickpt as mc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    a = ap.parse_args()
    print(jax.devices())
    work = tempfile.mkdtemp(dir=a.dir, prefix="donation-")
    step = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)
    ok = True
    try:
        for i, mode in enumerate((None, False, None, False)):
            x = jax.random.normal(jax.random.key(i), (a.mb * (1 << 20) // 4,))
            want = np.asarray(x + 0)  # another buffer's host copy: x's own is never fetched
            with mc.AsyncCheckpointer(device_snapshot=mode) as ck:
                path = os.path.join(work, f"c{i}")
                t0 = time.perf_counter()
                ck.save(path, {"s": {"x": x}})
                t1 = time.perf_counter()
                step(x).block_until_ready()  # donates x's buffer at once
                t2 = time.perf_counter()
                ck.wait_until_finished()
                t3 = time.perf_counter()
                same = np.array_equal(np.asarray(ck.restore(path)["s"]["x"]), want)
            ok &= same
            print(f"device_snapshot={mode}: save() {1e3 * (t1 - t0):.1f} ms, donating step "
                  f"{1e3 * (t2 - t1):.1f} ms, write done {1e3 * (t3 - t0):.0f} ms; donated: "
                  f"{x.is_deleted()}; written == value at save(): {same}", flush=True)
    finally:
        shutil.rmtree(work)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
