"""Wall time of one checkpoint save: 1 process against N processes, same global state.

    python benchmarks/multihost_save.py [--mb 400] [--processes 4] [--devices 4] [--repeats 3]
                                        [--rounds 2]

The state is ``--mb`` megabytes of float32, in four arrays sharded over ``--devices`` CPU
devices in total: once as 1 process holding every device, once as ``--processes``
processes (started with minickpt.launch) holding ``devices / processes`` each. Each run
saves ``--repeats`` times (a new step each time, ``max_to_keep=1``) and reports, per save,
the wall time of ``CheckpointManager.save`` on the slowest process — the time a training
loop would stop. The two configurations alternate ``--rounds`` times, so that a change in
the machine's load hits both; the medians over all saves are compared. Most of a save is
the kernel absorbing the writes, so results swing with other I/O on the machine: run it
on an idle one. It writes ``mb`` at a time to ``--dir`` (default: a temporary directory,
removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("snapshot_s", "write_s", "fsync_s", "barrier_s", "commit_s", "retention_s")


def worker(directory: str, mb: int, repeats: int) -> int:
    import minickpt.multihost as mh

    mh.initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import minickpt as mc

    devs = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    sh = NamedSharding(Mesh(devs, ("d",)), P("d"))
    n = mb * (1 << 20) // 4 // 4  # elements per array, four arrays
    n -= n % len(devs)

    def shard(idx: tuple[slice, ...]) -> np.ndarray:
        start = idx[0].start or 0
        stop = idx[0].stop if idx[0].stop is not None else n
        return np.random.default_rng(start).standard_normal(stop - start, np.float32)

    state = {f"layer{i}": jax.make_array_from_callback((n,), sh, shard) for i in range(4)}
    jax.block_until_ready(state)
    sync = mh.default_sync()
    opts = mc.CheckpointManagerOptions(max_to_keep=1,
                                       multihost=mc.MultiHostOptions(timeout_s=300))
    times, phases = [], []
    with mc.CheckpointManager(directory, opts) as mngr:
        for step in range(repeats):
            sync.exchange(f"bench/{step}", None, 300)  # start together
            t = time.perf_counter()
            mngr.save(step, {"params": state}, force=True)
            times.append(time.perf_counter() - t)
            st = mngr.last_save_stats
            phases.append({k: getattr(st, k) for k in PHASES})
    print("RESULT " + json.dumps({"process": jax.process_index(), "times": times,
                                  "phases": phases,
                                  "bytes": sum(a.nbytes for a in state.values())}), flush=True)
    return 0


def run(processes: int, devices: int, args: argparse.Namespace, directory: str) -> dict:
    from minickpt.launch import launch

    os.makedirs(directory, exist_ok=True)
    r = launch([__file__, "--worker", directory, "--mb", str(args.mb),
                "--repeats", str(args.repeats)], processes,
               devices_per_process=devices // processes, timeout_s=1800)
    if not r.ok:
        sys.exit(f"run with {processes} process(es) failed: {r.describe()}\n{r.output()}")
    res = [json.loads(line[7:]) for out in r.outputs for line in out
           if line.startswith("RESULT ")]
    per_save = [max(p["times"][i] for p in res) for i in range(args.repeats)]
    primary = next(p for p in res if p["process"] == 0)
    phases = {k: statistics.median(ph[k] for ph in primary["phases"]) for k in PHASES}
    return {"processes": processes, "devices_per_process": devices // processes,
            "bytes": res[0]["bytes"], "save_s": per_save, "median_s": statistics.median(per_save),
            "primary_phases_median_s": phases}


def _pool(rs: list[dict]) -> dict:
    out = dict(rs[0])
    out["save_s"] = [t for r in rs for t in r["save_s"]]
    out["median_s"] = statistics.median(out["save_s"])
    out["primary_phases_median_s"] = {
        k: statistics.median(r["primary_phases_median_s"][k] for r in rs) for k in PHASES}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.mb, args.repeats)
    if args.devices % args.processes:
        ap.error("--devices must be a multiple of --processes")
    root = tempfile.mkdtemp(prefix="minickpt-bench-", dir=args.dir)
    runs: dict[int, list[dict]] = {1: [], args.processes: []}
    try:
        for r in range(args.rounds):
            for n in (1, args.processes):
                d = os.path.join(root, f"r{r}-n{n}")
                runs[n].append(run(n, args.devices, args, d))
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, many = (_pool(runs[1]), _pool(runs[args.processes]))
    out = {"state_mb": one["bytes"] / 2**20, "cpus": os.cpu_count(), "one": one,
           "many": many, "ratio_many_over_one": many["median_s"] / one["median_s"]}
    print(json.dumps(out, indent=1))
    print(f"\n{out['state_mb']:.0f} MiB on {os.cpu_count()} CPUs: 1 process "
          f"{one['median_s']:.2f} s, {args.processes} processes {many['median_s']:.2f} s "
          f"(median of {args.repeats * args.rounds} saves each; ratio "
          f"{out['ratio_many_over_one']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
