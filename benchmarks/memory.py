"""Peak host memory of a save and of a restore, measured in a fresh process.

It also times that first large save and restore of the process: what a job pays when it
starts, before any memory of that size has been handed to it (repetitions in one process
hide this). The measure is the process's resident-set high-water mark (``VmHWM``), reset just before the
operation (``echo 5 > /proc/self/clear_refs``), minus the resident set just before it: the
host memory the operation itself added at its peak, divided by the state's size. On a CPU
backend the state's own buffers are host memory too; they were resident before the save and
are not counted, while a restore's result is new memory and is counted (so a restore costs
at least 1.0× — the result itself). Page cache is not part of the resident set. The restore
reads a checkpoint whose files were read once, untimed, after the save (as the suite's warm
rows do): the first-touch cost of the result is measured, not the disk.

Run as ``python -m benchmarks.memory --lib minickpt --bytes N --dir D``; it prints one JSON
object. Each library gets its own process, so that nothing one of them cached or allocated
earlier hides in the other's numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def reset_peak() -> bool:
    """Reset the resident-set high-water mark (Linux ≥ 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(fn: Any) -> tuple[int | None, float, Any]:
    """(peak bytes added, seconds, result) of ``fn()``."""
    import time

    gc.collect()
    ok = reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status("VmHWM")
    if not ok or base is None or peak is None:
        return None, dt, out
    return max(peak - base, 0), dt, out


def run(lib: str, nbytes: int, leaves: int, workdir: str,
        many_leaves: int | None = None) -> dict[str, Any]:
    """``many_leaves``: measure :func:`states.many_leaves` instead of ``nbytes`` in
    ``leaves``; either way ``state_resident_bytes`` is what the state itself added to the
    resident set when it was made (for tiny leaves, far more than their bytes)."""
    import jax

    from . import machine, states

    jax.block_until_ready(jax.numpy.zeros(1))  # the backend's own memory is no state
    gc.collect()
    before = _status("VmRSS")
    tree = jax.block_until_ready(states.many_leaves(many_leaves) if many_leaves
                                 else states.uniform(nbytes, leaves))
    gc.collect()
    after = _status("VmRSS")
    resident = None if before is None or after is None else max(after - before, 1)
    size = states.nbytes(tree)
    target = states.abstract(tree)
    small = jax.block_until_ready(states.uniform(4096, 4, seed=9))
    d = tempfile.mkdtemp(prefix=f"mem-{lib}-", dir=workdir)
    try:
        if lib == "minickpt":
            import minickpt

            ck = minickpt.Checkpointer()

            def save(path: str, t: Any) -> None:
                ck.save(path, {"state": t})

            def restore(path: str, t: Any) -> Any:
                return jax.block_until_ready(ck.restore(path, {"state": t}))
        elif lib == "orbax":
            import orbax.checkpoint as ocp

            ock = ocp.StandardCheckpointer()

            def save(path: str, t: Any) -> None:
                ock.save(path, t)
                ock.wait_until_finished()

            def restore(path: str, t: Any) -> Any:
                return jax.block_until_ready(ock.restore(path, t))
        else:
            raise SystemExit(f"unknown library {lib!r}")
        # warm up the code paths (imports, thread pools) on a small tree first
        save(os.path.join(d, "warm"), small)
        restore(os.path.join(d, "warm"), states.abstract(small))
        path = os.path.join(d, "big")
        save_extra, save_s, _ = _measure(lambda: save(path, tree))
        # the restore reads from the page cache, for both libraries: a save written with
        # O_DIRECT (minickpt's) leaves nothing there, a buffered one (Orbax's) leaves it all,
        # and a first restore timed straight after would compare a disk read with a memcpy
        machine.read_whole(path)
        # the state stays alive: memory it frees could otherwise be reused by the restore
        # and hide part of the restore's cost from the resident-set figures
        restore_extra, restore_s, out = _measure(lambda: restore(path, target))
        del out
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"lib": lib, "state_bytes": size, "state_resident_bytes": resident,
            "save_resident_ratio": _ratio(save_extra, resident),
            "restore_resident_ratio": _ratio(restore_extra, resident),
            "save_extra_bytes": save_extra,
            "restore_extra_bytes": restore_extra, "save_s": save_s, "restore_s": restore_s,
            "save_ratio": None if save_extra is None else save_extra / size,
            "restore_ratio": None if restore_extra is None else restore_extra / size}


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or not b else a / b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, choices=["minickpt", "orbax"])
    p.add_argument("--bytes", type=int, default=0)
    p.add_argument("--many-leaves", type=int, default=None,
                   help="measure states.many_leaves(N) instead of --bytes in --leaves")
    p.add_argument("--leaves", type=int, default=50)
    p.add_argument("--dir", default=None)
    a = p.parse_args(argv)
    if not a.bytes and not a.many_leaves:
        p.error("give --bytes (with --leaves) or --many-leaves")
    if a.dir and not os.path.isdir(a.dir):
        p.error(f"--dir {a.dir}: no such folder (the checkpoints go in a new folder inside it)")
    out = run(a.lib, a.bytes, a.leaves, a.dir or tempfile.gettempdir(), a.many_leaves)
    sys.stdout.write("MEMORY " + json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
