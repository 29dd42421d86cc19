"""Wall time of one checkpoint save: 1 process against N processes, same global state.

    python benchmarks/multihost_save.py [--mb 400] [--processes 4] [--devices 4] [--repeats 3]
                                        [--rounds 2] [--async]

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

``--async`` adds a third configuration: the N processes with
``enable_async_checkpointing=True``. Its *blocking* time (``save()`` on the slowest
process: the step agreement and the snapshot of each process's shards) is compared with a
plain host copy of those shards (``np.array(shard, copy=True)``, the slowest process), and
its total (until ``wait_until_finished()`` returns) with the synchronous save.
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


def worker(directory: str, mb: int, repeats: int, is_async: bool = False) -> int:
    from minickpt.multihost.process import initialize
    from minickpt.multihost.sync import default_sync

    initialize()
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
    sync = default_sync()
    opts = mc.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=is_async,
                                       multihost=mc.MultiHostOptions(timeout_s=300))
    times, blocking, copies, phases = [], [], [], []
    with mc.CheckpointManager(directory, opts) as mngr:
        for step in range(repeats):
            sync.exchange(f"bench/{step}/copy", None, 300)
            t = time.perf_counter()
            copy = [np.array(s.data, copy=True) for a in state.values()
                    for s in a.addressable_shards if s.replica_id == 0]
            copies.append(time.perf_counter() - t)
            del copy
            sync.exchange(f"bench/{step}", None, 300)  # start together
            t = time.perf_counter()
            mngr.save(step, {"params": state}, force=True)
            blocking.append(time.perf_counter() - t)
            mngr.wait_until_finished()  # (returns at once after a sync save)
            times.append(time.perf_counter() - t)
            st = mngr.last_save_stats
            phases.append({k: getattr(st, k) for k in PHASES})
    print("RESULT " + json.dumps({"process": jax.process_index(), "times": times,
                                  "blocking": blocking, "copies": copies, "phases": phases,
                                  "bytes": sum(a.nbytes for a in state.values())}), flush=True)
    return 0


def run(processes: int, devices: int, args: argparse.Namespace, directory: str,
        is_async: bool = False) -> dict:
    from minickpt.launch import launch

    os.makedirs(directory, exist_ok=True)
    r = launch([__file__, "--worker", directory, "--mb", str(args.mb),
                "--repeats", str(args.repeats), *(["--async"] if is_async else [])], processes,
               devices_per_process=devices // processes, timeout_s=1800)
    if not r.ok:
        sys.exit(f"run with {processes} process(es) failed: {r.describe()}\n{r.output()}")
    res = [json.loads(line[7:]) for out in r.outputs for line in out
           if line.startswith("RESULT ")]

    def slowest(key: str) -> list[float]:
        return [max(p[key][i] for p in res) for i in range(args.repeats)]

    per_save = slowest("times")
    primary = next(p for p in res if p["process"] == 0)
    phases = {k: statistics.median(ph[k] for ph in primary["phases"]) for k in PHASES}
    return {"processes": processes, "devices_per_process": devices // processes,
            "async": is_async, "bytes": res[0]["bytes"], "save_s": per_save,
            "median_s": statistics.median(per_save), "blocking_s": slowest("blocking"),
            "copy_s": slowest("copies"), "primary_phases_median_s": phases}


def _pool(rs: list[dict]) -> dict:
    out = dict(rs[0])
    for key in ("save_s", "blocking_s", "copy_s"):
        out[key] = [t for r in rs for t in r[key]]
    out["median_s"] = statistics.median(out["save_s"])
    out["blocking_median_s"] = statistics.median(out["blocking_s"])
    out["copy_median_s"] = statistics.median(out["copy_s"])
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
    ap.add_argument("--async", dest="is_async", action="store_true",
                    help="also run the N processes with async saves")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.mb, args.repeats, args.is_async)
    if args.devices % args.processes:
        ap.error("--devices must be a multiple of --processes")
    root = tempfile.mkdtemp(prefix="minickpt-bench-", dir=args.dir)
    configs = [(1, False), (args.processes, False)] + ([(args.processes, True)]
                                                       if args.is_async else [])
    runs: dict[tuple[int, bool], list[dict]] = {c: [] for c in configs}
    try:
        for r in range(args.rounds):
            for n, is_async in configs:
                d = os.path.join(root, f"r{r}-n{n}{'-async' if is_async else ''}")
                runs[(n, is_async)].append(run(n, args.devices, args, d, is_async))
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, many = (_pool(runs[(1, False)]), _pool(runs[(args.processes, False)]))
    out = {"state_mb": one["bytes"] / 2**20, "cpus": os.cpu_count(), "one": one,
           "many": many, "ratio_many_over_one": many["median_s"] / one["median_s"]}
    if args.is_async:
        a = out["many_async"] = _pool(runs[(args.processes, True)])
        out["async_blocking_over_copy"] = a["blocking_median_s"] / a["copy_median_s"]
        out["async_blocking_over_sync_save"] = a["blocking_median_s"] / many["median_s"]
    print(json.dumps(out, indent=1))
    saves = args.repeats * args.rounds
    print(f"\n{out['state_mb']:.0f} MiB on {os.cpu_count()} CPUs: 1 process "
          f"{one['median_s']:.2f} s, {args.processes} processes {many['median_s']:.2f} s "
          f"(median of {saves} saves each; ratio {out['ratio_many_over_one']:.2f})")
    if args.is_async:
        print(f"{args.processes} processes, async: save() blocks {a['blocking_median_s']:.3f} s "
              f"(slowest process; a plain host copy of its shards: {a['copy_median_s']:.3f} s, "
              f"ratio {out['async_blocking_over_copy']:.2f}); until committed "
              f"{a['median_s']:.2f} s; blocking / sync {args.processes}-process save "
              f"{out['async_blocking_over_sync_save']:.3f} (median of {saves} saves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
