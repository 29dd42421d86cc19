"""The program tests/test_multihost.py runs as several JAX processes (minickpt.launch).

    python -m minickpt.launch -n 4 -k 2 tests/mh_worker.py SCENARIO DIR [DIR2]

Every process prints ``RESULT {json}`` lines the test reads, and exits non-zero if any of
its own checks fails. Values are deterministic functions of the leaf name, so every
process (and the test) knows what each global array holds without communicating.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

from minickpt.launch import report
from minickpt.multihost.ownership import owned_shards
from minickpt.multihost.process import hard_exit, initialize
from minickpt.multihost.save import prepare_save
from minickpt.multihost.sync import default_sync

initialize()  # before any other JAX call; a no-op when not launched

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import minickpt as mc  # noqa: E402
from minickpt.commit import is_temporary  # noqa: E402
from minickpt.errors import PeerTimeoutError, ProcessDisagreementError  # noqa: E402
from minickpt.format.shards import box_of  # noqa: E402

ME, N = jax.process_index(), jax.process_count()

# leaf name -> (shape, dtype); tests/test_multihost.py imports this table too
LEAVES = {
    "w": ((16, 16), np.float32),
    "rows": ((16, 8), ml_dtypes.bfloat16),
    "cols": ((8, 16), np.int32),
    "xproc": ((8, 8), np.float32),
    "rep": ((8,), np.float16),
    "scalar": ((), np.float32),
    "mu": ((16, 16), np.float32),
}


def expected(name: str) -> np.ndarray:
    shape, dtype = LEAVES[name]
    base = sum(map(ord, name)) % 17
    return ((np.arange(int(np.prod(shape))) * 3 + base) % 251).reshape(shape).astype(dtype)


def global_array(name: str, sharding) -> jax.Array:
    g = expected(name)
    return jax.make_array_from_callback(g.shape, sharding, lambda idx: g[idx])


def meshes(k: int) -> tuple[Mesh, Mesh]:
    devs = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    grid = devs.reshape(N, k)
    # the second mesh runs its first axis *across* processes: shards replicated over processes
    return Mesh(grid, ("p", "l")), Mesh(grid.T, ("l", "p"))


def saved_state(k: int) -> dict:
    m, mx = meshes(k)
    ns = lambda spec, mesh=m: NamedSharding(mesh, spec)  # noqa: E731
    return {
        "params": {"w": global_array("w", ns(P("p", "l"))),
                   "rows": global_array("rows", ns(P("p", None))),
                   "cols": global_array("cols", ns(P(None, ("p", "l")))),
                   "xproc": global_array("xproc", ns(P("l"), mx)),
                   "rep": global_array("rep", ns(P())),
                   "scalar": global_array("scalar", ns(P()))},
        "opt": {"mu": global_array("mu", ns(P(None, "p"))), "count": 7,
                "host": np.arange(4, dtype=np.int16)},
        "rng": jax.random.key(42),
    }


def restore_target(mesh: Mesh) -> dict:
    """Other shardings than the saved ones, as ShapeDtypeStructs."""
    a0, a1 = mesh.axis_names
    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    sds = lambda name, spec: jax.ShapeDtypeStruct(LEAVES[name][0], LEAVES[name][1],  # noqa: E731
                                                  sharding=ns(spec))
    return {
        "params": {"w": sds("w", P(None, (a0, a1))), "rows": sds("rows", P(a1, a0)),
                   "cols": sds("cols", P()), "xproc": sds("xproc", P(a0, a1)),
                   "rep": sds("rep", P(a0)), "scalar": sds("scalar", P())},
        "opt": {"mu": sds("mu", P(a1, a0)), "count": 0, "host": np.zeros(4, np.int16)},
        "rng": jax.random.key(0),
    }


def check_restored(r: dict) -> list[str]:
    """Every local shard of every restored array equals the saved value there."""
    bad = []
    for group in ("params", "opt"):
        for name, arr in r[group].items():
            if name not in LEAVES:
                continue
            g = expected(name)
            if arr.dtype != g.dtype or arr.shape != g.shape:
                bad.append(f"{name}: {arr.dtype}{arr.shape} != {g.dtype}{g.shape}")
                continue
            for s in arr.addressable_shards:
                if not np.array_equal(np.asarray(s.data), g[s.index]):
                    bad.append(f"{name} shard {s.index}")
    if r["opt"]["count"] != 7 or not np.array_equal(r["opt"]["host"], np.arange(4)):
        bad.append("opt/count or opt/host")
    want_key = jax.random.key_data(jax.random.key(42))
    if not np.array_equal(jax.random.key_data(r["rng"]), want_key):
        bad.append("rng")
    return bad


def result(**kw) -> None:
    report({"process": ME, **kw})


def opts(timeout_s: float = 30.0, **kw) -> mc.CheckpointManagerOptions:
    primary_only = kw.pop("primary_only", False)
    return mc.CheckpointManagerOptions(
        multihost=mc.MultiHostOptions(timeout_s=timeout_s, primary_only=primary_only), **kw)


def scenario_save(directory: str, single_dir: str) -> int:
    """4 processes: save, restore resharded, verify, disagree; restore a 1-process save."""
    k = jax.local_device_count()
    state = saved_state(k)
    # Task 4.2 — ownership is the replica_id == 0 rule, for every sharded array
    for name, arr in state["params"].items():
        mine = {b for b, _ in owned_shards(arr.shape, arr.sharding.devices_indices_map(
            arr.shape), ME)}
        rep0 = {box_of(s.index, arr.shape) for s in arr.addressable_shards
                if s.replica_id == 0}
        assert mine == rep0, (name, mine, rep0)
    with mc.CheckpointManager(directory, opts()) as mngr:
        t = time.perf_counter()
        assert mngr.save(10, state, metrics={"loss": 0.5})
        save_s = time.perf_counter() - t
        rep = mngr.verify(10)
        m, _ = meshes(k)
        r = mngr.restore(target=restore_target(m))
        plain = mngr.restore(10)  # no target: numpy arrays, the whole state on every process
        plain_ok = all(np.array_equal(plain["params"][n], expected(n))
                       for n in ("w", "rows", "cols", "xproc", "rep", "scalar"))
        # another mesh shape over the same devices: (2N, k/2) when k is even
        other = Mesh(np.array(jax.devices()).reshape(-1, 2), ("a", "b"))
        r2 = mngr.restore(10, target=restore_target(other))
        # Task 4.1 — the last process asks for another step: everybody refuses
        disagreement = None
        try:
            mngr.save(11 if ME != N - 1 else 12, state)
        except ProcessDisagreementError as e:
            disagreement = str(e)
        steps = mngr.all_steps(read=True)
    with mc.CheckpointManager(single_dir, opts(), ) as single:
        r3 = single.restore(target=restore_target(meshes(k)[0]))
    result(saved=True, save_s=save_s, verify_ok=rep.ok, problems=rep.problems,
           restored=check_restored(r), plain_ok=plain_ok, other_mesh=check_restored(r2),
           disagreement=disagreement, steps=steps, from_single=check_restored(r3))
    ok = (rep.ok and not check_restored(r) and plain_ok and not check_restored(r2)
          and disagreement is not None and steps == [10] and not check_restored(r3))
    return 0 if ok else 1


def scenario_restore(directory: str, replicated_dir: str) -> int:
    """2 processes: restore the 4-process save on another mesh; the Flax pattern."""
    k = jax.local_device_count()
    with mc.CheckpointManager(directory, opts()) as mngr:
        r = mngr.restore(target=restore_target(meshes(k)[0]))
        r2 = mngr.restore(target=restore_target(meshes(k)[1]))
    # replicated (data-parallel) state: saved by the primary alone, broadcast on restore
    m, _ = meshes(k)
    rep = NamedSharding(m, P())
    state = {"params": {"w": global_array("w", rep), "rep": global_array("rep", rep)},
             "step": 3, "host": np.arange(5, dtype=np.uint8), "rng": jax.random.key(42)}
    o = opts(primary_only=True)
    default_sync().KV_CHUNK_BYTES = 100  # the broadcast in many chunks
    with mc.CheckpointManager(replicated_dir, o) as mngr:
        assert mngr.save(3, state)
        files = sorted(os.listdir(os.path.join(replicated_dir, "step_3", "params")))
        target = {"params": {"w": jax.ShapeDtypeStruct((16, 16), np.float32,
                                                       sharding=NamedSharding(m, P("p"))),
                             "rep": jax.ShapeDtypeStruct((8,), np.float16, sharding=rep)},
                  "step": 0, "host": np.zeros(5, np.uint8), "rng": jax.random.key(0)}
        b = mngr.restore(target=target)
        nt = mngr.restore()  # no target: numpy on every process
    bcast_ok = (all(np.array_equal(np.asarray(s.data), expected("w")[s.index])
                    for s in b["params"]["w"].addressable_shards)
                and np.array_equal(np.asarray(b["params"]["rep"].addressable_data(0)),
                                   expected("rep"))
                and b["step"] == 3 and np.array_equal(b["host"], np.arange(5))
                and np.array_equal(jax.random.key_data(b["rng"]),
                                   jax.random.key_data(jax.random.key(42)))
                and np.array_equal(nt["params"]["w"], expected("w")) and nt["step"] == 3)
    # the write phase in a background thread while the main thread keeps computing across
    # processes (what the async manager does): barriers from the thread, gloo from main
    sharded = saved_state(k)
    job = prepare_save(mc.Checkpointer(), default_sync(),
                          os.path.join(replicated_dir, "step_7"), sharded, step=7, copy=True)
    errors = []
    writer = threading.Thread(target=lambda: _capture(job.run, errors))
    writer.start()
    total = 0.0
    for _ in range(5):
        total += float(jax.jit(jnp.sum)(sharded["params"]["w"]))
    writer.join(60)
    threaded = mc.Checkpointer().restore(os.path.join(replicated_dir, "step_7"),
                                         target=restore_target(meshes(k)[0]))
    threaded_ok = (not errors and not writer.is_alive() and not check_restored(threaded)
                   and total == 5 * float(expected("w").sum()))
    result(restored=check_restored(r), transposed=check_restored(r2), files=files,
           broadcast_ok=bool(bcast_ok), threaded_ok=threaded_ok, errors=errors)
    return 0 if (not check_restored(r) and not check_restored(r2) and bcast_ok
                 and threaded_ok) else 1


def _capture(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # reported by the main thread
        errors.append(repr(e))


def scenario_kill(directory: str) -> int:
    """A victim dies mid-save (MINICKPT_FAULT); the survivors must name it and leave."""
    state = saved_state(jax.local_device_count())
    mngr = mc.CheckpointManager(directory, opts(timeout_s=float(os.environ["MH_TIMEOUT"])))
    default_sync().exchange("ready", None, 60)  # start together: the time-out is the save's
    t = time.perf_counter()
    try:
        mngr.save(5, state)
    except PeerTimeoutError as e:
        result(missing=e.missing, after_s=time.perf_counter() - t, error=str(e),
               steps=mngr.all_steps(read=True))
        hard_exit(3)  # a normal exit would wait in jax.distributed.shutdown()
    result(saved=True)
    return 0


def scenario_broadcast_kill(directory: str) -> int:
    """A primary_only restore; a peer dies right before the broadcast (MINICKPT_FAULT): the
    survivor must name it within the time-out, not hang in a collective."""
    m, _ = meshes(jax.local_device_count())
    rep = NamedSharding(m, P())
    state = {"params": {"w": global_array("w", rep)}, "step": 3}
    mngr = mc.CheckpointManager(directory, opts(timeout_s=float(os.environ["MH_TIMEOUT"]),
                                                primary_only=True))
    assert mngr.save(3, state)
    default_sync().exchange("ready", None, 60)  # start together: the time-out is the restore's
    t = time.perf_counter()
    try:
        mngr.restore(3)
    except PeerTimeoutError as e:
        result(missing=e.missing, after_s=time.perf_counter() - t, error=str(e))
        hard_exit(3)
    result(restored=True)
    return 0


def _preempt_step(carry: np.ndarray, step: int) -> tuple[np.ndarray, dict]:
    """A deterministic 'training step' (the same on every process), a little slow."""
    time.sleep(0.05)
    return carry * 0.5 + step, {"loss": float(step)}


def scenario_preempt(directory: str) -> int:
    """Only process 1 gets SIGTERM (at step 4); the decision is taken together at the next
    check step (6, with sync_every_steps=3): both save step 6, stop, and exit 0."""
    import signal

    from minickpt.production.preemption import PreemptionHandler, train_until_preempted

    mngr = mc.CheckpointManager(directory, opts(timeout_s=20, save_interval_steps=100))
    handler = PreemptionHandler(sync_every_steps=3).attach(mngr)

    def step_fn(carry, step):
        if ME == 1 and step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this process only
        return _preempt_step(carry, step)

    res = train_until_preempted(mngr, np.zeros(4), step_fn, start=0, stop=30,
                                items=lambda c: {"w": c})
    steps = mngr.all_steps(read=True)
    mngr.close()
    result(step=res.step, preempted=res.preempted, steps=steps, safe_step=handler.safe_step,
           signalled=handler.received == signal.SIGTERM)
    return 0


def scenario_preempt_resume(directory: str) -> int:
    """The restarted job resumes at the saved step and ends as an uninterrupted one."""
    from minickpt.production.preemption import PreemptionHandler, train_until_preempted

    with mc.CheckpointManager(directory, opts(timeout_s=20, save_interval_steps=100)) as mngr:
        PreemptionHandler(sync_every_steps=3).attach(mngr)
        r = mngr.restore()
        res = train_until_preempted(mngr, r["w"], _preempt_step, start=r.step, stop=10,
                                    items=lambda c: {"w": c})
    ref = np.zeros(4)
    for s in range(1, 11):
        ref, _ = _preempt_step(ref, s)
    result(resumed_at=r.step, step=res.step, preempted=res.preempted,
           same=bool(np.array_equal(res.carry, ref)))
    return 0


def scenario_async(directory: str) -> int:
    """Async + multi-host: save() returns after the snapshot; donating and mutating the state
    right after it changes nothing; a background failure on the last process is raised on
    every process; the last save is still in flight when the program ends."""
    k = jax.local_device_count()
    sync = default_sync()
    mngr = mc.CheckpointManager(directory, opts(enable_async_checkpointing=True,
                                                max_to_keep=2))
    # 1. the background write is held at its start until the state has been overwritten
    gate = threading.Event()
    sync.faults["after_create"] = lambda: gate.wait(60)
    state = saved_state(k)
    t = time.perf_counter()
    saved = mngr.save(1, state, metrics={"loss": 0.5})
    blocking_s = time.perf_counter() - t
    in_progress = mngr.is_saving_in_progress()
    counted = mngr.latest_step()
    w = state["params"]["w"]
    new_w = jax.jit(lambda a: a * 0 - 7, donate_argnums=0)(w)  # the next step reuses w's buffer
    new_w.block_until_ready()
    donated = w.is_deleted()
    state["opt"]["host"][:] = -1  # in-place mutation of a numpy leaf
    gate.set()
    del sync.faults["after_create"]
    mngr.wait_until_finished()
    snap = check_restored(mngr.restore(1, target=restore_target(meshes(k)[0])))
    # 2. a write fails in the background on the last process only
    def enospc():
        del sync.faults["after_write"]  # once
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if ME == N - 1:
        sync.faults["after_write"] = enospc
    state = saved_state(k)
    assert mngr.save(2, state)
    failure: dict = {}
    try:
        mngr.save(3, state)
    except Exception as e:
        failure = {"type": type(e).__name__, "errno": getattr(e, "errno", None), "error": str(e),
                   "notes": getattr(e, "__notes__", [])}
    after_failure = mngr.all_steps(read=True)
    leftovers = sorted(n for n in os.listdir(directory) if is_temporary(n))
    assert mngr.save(3, state)  # works again
    mngr.wait_until_finished()  # (before the next hook: it is for the next save only)
    # 3. the last save is still being written when the program ends (no close, no wait):
    #    it must commit before jax.distributed shuts down
    last = threading.Event()
    sync.faults["after_create"] = lambda: last.wait(60)
    assert mngr.save(4, state)
    result(saved=saved, blocking_s=blocking_s, in_progress=in_progress, counted=counted,
           donated=donated, snapshot=snap, failure=failure, after_failure=after_failure,
           leftovers=leftovers, pending_at_exit=mngr.is_saving_in_progress())
    last.set()  # the write goes on while the interpreter exits
    return 0


def scenario_resume(directory: str) -> int:
    """The job restarted on another number of processes: resume from the async saves."""
    k = jax.local_device_count()
    with mc.CheckpointManager(directory, opts(enable_async_checkpointing=True,
                                              max_to_keep=2)) as mngr:
        latest = mngr.latest_step()
        r = mngr.restore(target=restore_target(meshes(k)[0]))
        assert mngr.save(5, saved_state(k))
        steps_in_flight = mngr.all_steps()
    with mc.CheckpointManager(directory, opts(read_only=True)) as again:
        r5 = again.restore(5, target=restore_target(meshes(k)[1]))
        steps = again.all_steps()
    result(latest=latest, step=r.step, restored=check_restored(r), step5=check_restored(r5),
           steps_in_flight=steps_in_flight, steps=steps)
    return 0


def scenario_async_exit(directory: str) -> int:
    """A peer dies during an async save that is still in flight at exit: the survivor's exit
    must not hang in jax.distributed.shutdown()."""
    mngr = mc.CheckpointManager(directory, opts(timeout_s=float(os.environ["MH_TIMEOUT"]),
                                                enable_async_checkpointing=True))
    default_sync().exchange("ready", None, 60)
    assert mngr.save(1, saved_state(jax.local_device_count()))
    result(returned=True, time=time.time())
    return 0  # no wait_until_finished(): the save fails in the background, at exit


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    sys.exit({"save": scenario_save, "restore": scenario_restore, "kill": scenario_kill,
              "broadcast_kill": scenario_broadcast_kill,
              "preempt": scenario_preempt, "preempt_resume": scenario_preempt_resume,
              "async": scenario_async, "resume": scenario_resume,
              "async_exit": scenario_async_exit}[scenario](*args))
