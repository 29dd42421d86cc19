"""One process of a multi-host save benchmark (started N times by :mod:`benchmarks.multihost`).

Every process joins ``jax.distributed`` on localhost (CPU collectives through gloo), builds
the same global state — ``leaves`` float32 arrays sharded over a 1-D mesh of all devices of
all processes — and saves it through the library's ordinary ``CheckpointManager`` code, the
same code a single process runs. Process 0 times each save from a barrier before it to a
barrier after it, and prints the times as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the phases of a minickpt save (CheckpointManager.last_save_stats), timed on every process
PHASES = ("snapshot_s", "write_s", "fsync_s", "barrier_s", "commit_s", "retention_s",
          "total_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True, choices=["minickpt", "orbax"])
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--dir", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{a.port}", a.nproc, a.pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    n = max(a.bytes // a.leaves // 4 // jax.device_count(), 1) * jax.device_count()

    def leaf(i: int) -> jax.Array:
        rng = np.random.default_rng(i)
        full = rng.standard_normal(n, dtype=np.float32)  # the same on every process
        return jax.make_array_from_callback((n,), sharding, lambda idx: full[idx])

    tree = {f"leaf_{i:03d}": leaf(i) for i in range(a.leaves)}
    if a.lib == "minickpt":
        import minickpt

        mngr = minickpt.CheckpointManager(
            a.dir, minickpt.CheckpointManagerOptions(max_to_keep=2))

        def save(step: int) -> None:
            mngr.save(step, {"state": tree}, force=True)
            mngr.wait_until_finished()
    else:
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(a.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False))

        def save(step: int) -> None:
            mngr.save(step, args=ocp.args.StandardSave(tree), force=True)
            mngr.wait_until_finished()

    times, phases, own = [], [], []
    for step in range(a.warmup + a.reps):
        multihost_utils.sync_global_devices(f"before-{step}")
        t0 = time.perf_counter()
        save(step)
        t1 = time.perf_counter()  # this process's save() returned
        multihost_utils.sync_global_devices(f"after-{step}")
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
            own.append(t1 - t0)
            st = getattr(mngr, "last_save_stats", None)  # minickpt: each phase of the save
            if st is not None:
                phases.append({k: getattr(st, k, None) for k in PHASES})
    mngr.close()
    if phases:  # every process its own: where a process's time goes (issue 33)
        med = {k: sorted(v for ph in phases if (v := ph[k]) is not None)
               for k in PHASES}
        med["returned_s"] = sorted(own)  # until this process's save() returned
        sys.stdout.write("MHPHASES " + json.dumps({
            "process": a.pid, **{k: v[len(v) // 2] for k, v in med.items() if v}}) + "\n")
        sys.stdout.flush()
    if a.pid == 0:
        nbytes = n * 4 * a.leaves
        sys.stdout.write("MULTIHOST " + json.dumps({
            "lib": a.lib, "nproc": a.nproc, "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "nbytes": nbytes, "times": times,
            "pid": os.getpid()}) + "\n")
        sys.stdout.flush()
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
