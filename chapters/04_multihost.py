# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# <a href="https://colab.research.google.com/github/minickpt-course/checkpointing-in-jax/blob/main/chapters/04_multihost.ipynb" target="_parent"><img src="https://colab.research.google.com/assets/colab-badge.svg" alt="Open In Colab"/></a>

# %%
# Course set-up, the same in every notebook (written by scripts/notebooks.py).
# On Colab it installs the course package; everywhere it asks JAX for 4 CPU devices
# (so that sharding works on a laptop) before JAX is imported. A GPU or TPU is used when present.
import os
import sys

if "google.colab" in sys.modules:
    import subprocess

    package = "minickpt[colab] @ git+https://github.com/minickpt-course/checkpointing-in-jax"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", package], check=True)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

# %% [markdown]
# # Chapter 4 — Multi-host: the convoy waits for everyone
#
# The moving company has grown: one load now travels in a convoy of four trucks, each carrying a
# quarter of the furniture. At every depot the rule is strict. All four trucks must be in the
# yard, the drivers compare their order numbers — same order, same day — and only then does each
# one unload its own part. A truck that drives on alone, or unloads last week's order, leaves a
# depot where the furniture can never be put back together.
#
# Training a large model is that convoy: the state is spread over many devices on many hosts, and
# a checkpoint of it is a *collective* act. This chapter runs it for real on your machine —
# several JAX processes joined by `jax.distributed` on localhost, several devices each — and
# answers, with measurements (the processes' CPU devices exchange data through *gloo*, a library
# of collective operations — all-reduce, all-gather, broadcast — over TCP sockets, which JAX uses
# for collectives between CPU devices of different processes; GPUs use NCCL, TPUs their own
# interconnect):
#
# 1. Who saves when every device holds the whole model (data parallelism), and who when each holds
#    a part (sharded state)?
# 2. What protocol makes a checkpoint written by several processes consistent, and what breaks
#    without it?
# 3. How long does a collective save take when one process is slow (the barrel effect)?
# 4. Can a checkpoint saved by 4 processes be restored by 2, by 1, on another mesh?
#
# **This chapter takes up to about 90 s on a 2-core CPU**: every experiment starts a group of
# fresh Python processes, and each imports JAX. It runs unchanged on Colab: the processes use the
# CPU beside the notebook's GPU or TPU.

# %%
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import minickpt as mc
from minickpt.labkit.claims import claim, verdict
from minickpt.launch import launch

WORK = Path("ch04-work").absolute()
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir()
print(f"this notebook: JAX {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform.upper()} device(s)")

# %% [markdown]
# ## 0. How the experiments run
#
# Each experiment is a small Python script, shown in full, that `minickpt.launch` starts as `n`
# processes of one job on this machine, each with `k` CPU devices. The first lines of every script
# join the job (`minickpt.multihost.process.initialize()` reads the coordinator's address and the process
# id the launcher gave it and calls `jax.distributed.initialize`); afterwards `jax.devices()`
# lists the devices of **all** processes and `jax.local_devices()` this process's own. Each process
# prints `RESULT {...}` lines; `run_job` collects them by process.
#
# The **coordinator** is process 0's *coordination service*: a small server, at a `host:port`
# every process is given, that each process connects to when it starts. It assigns nothing by
# itself — the process ids come from the launcher — but it gathers every process's devices into
# the one global list, and then serves the job's bookkeeping: a key-value store, barriers, and
# heartbeats by which it notices a dead process. (The bulk data — gradients, shards — never goes
# through it: that is gloo's job.) minickpt's barriers and exchanges (`default_sync()`) use its
# key-value store.

# %%
PRELUDE = '''
import json, os, sys, time, zlib
from minickpt.launch import report as _report
from minickpt.multihost.process import hard_exit, initialize
from minickpt.multihost.sync import default_sync
initialize()                          # join the job: before any other JAX call
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import minickpt as mc

ME, N = jax.process_index(), jax.process_count()
DIR = sys.argv[1]
DONE_WAIT = 30.0                         # at the end, wait this long for the others (0: don't)

def report(**values):                    # one JSON line the notebook reads
    _report(values)                      # written in one piece: no log line splits it

def mesh(shape, axes):                   # all devices, process 0's first
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devs).reshape(shape), axes)

def values(name, shape):                 # an array every process (and the notebook) can compute
    base = sum(map(ord, name)) % 17
    return ((np.arange(int(np.prod(shape))) * 3 + base) % 251).reshape(shape).astype(np.float32)

def global_array(name, shape, sharding):
    g = values(name, shape)
    return jax.make_array_from_callback(shape, sharding, lambda index: g[index])
'''


EPILOGUE = '''
if DONE_WAIT:  # process 0 hosts the coordination service: it leaves last
    default_sync().exchange("job-done", None, DONE_WAIT)
time.sleep(0.5 if ME == 0 else 0.0)
hard_exit(0)                          # no jax.distributed.shutdown(): it would wait for the dead
'''


def values(name, shape):
    """The same values as the scripts' ``values``: the notebook can check any restore."""
    base = sum(map(ord, name)) % 17
    return ((np.arange(int(np.prod(shape))) * 3 + base) % 251).reshape(shape).astype(np.float32)


def run_job(name, script, n, k, timeout_s=120):
    """Run ``script`` as ``n`` processes with ``k`` CPU devices each; return what each reported."""
    path = WORK / f"{name}.py"
    path.write_text(PRELUDE + textwrap.dedent(script) + EPILOGUE)
    job_dir = WORK / name
    job_dir.mkdir(exist_ok=True)
    res = launch([str(path), str(job_dir)], n, devices_per_process=k, timeout_s=timeout_s,
                 cwd=str(WORK))
    results = [{} for _ in range(n)]
    for p, reports in enumerate(res.reports()):  # every `report(...)` of process p, in order
        for values in reports:
            results[p].update(values)
    if not all(results):
        print(res.output()[-4000:])
        raise RuntimeError(f"job {name}: {res.describe()}")
    print(f"job {name}: {n} processes x {k} devices, {res.wall_s:.1f} s (most of it starting JAX)")
    JOBS[name] = results
    return results, job_dir


# Can this machine run the jobs at all? jax.distributed joins the processes over TCP on
# 127.0.0.1; a sandbox that refuses every TCP socket (a TPU VM's container, some graders) cannot.
# Then every section that needs the processes says so in one line, and the notebook goes on.
from minickpt.launch import loopback_refused

JOBS = {}                      # the jobs that ran: name -> what each process reported
REFUSED = loopback_refused()   # None, or why no job can start here
if REFUSED:
    print(f"no experiment of this chapter can start its processes: {REFUSED}. "
          "Each section that needs them is skipped, in one line.")
else:
    print(f"the jobs' processes run on CPU devices (JAX_PLATFORMS=cpu), beside this notebook's "
          f"{jax.devices()[0].platform.upper()}")


def ready(part, *jobs):
    """True when ``part`` can run: processes can start here and the jobs it reads ran.
    Otherwise one line that says why not, and False."""
    missing = [j for j in jobs if j not in JOBS]
    if not REFUSED and not missing:
        return True
    print(f"skipped {part}: " + ("no TCP on 127.0.0.1 here, so no job's processes can start"
                                 if REFUSED else f"job {', '.join(missing)} failed above"))
    return False


# %% [markdown]
# ## 1. Two ways to hold a model
#
# ### 1a. Data parallelism: every device holds the whole model
#
# With data parallelism each of the $N$ devices holds a full copy of the parameters $\theta$ and
# computes the gradient $g^{(i)}$ of the loss on its own slice of the batch. An all-reduce averages
# them,
#
# $$\bar g = \frac{1}{N}\sum_{i=1}^{N} g^{(i)}, \qquad \theta_{t+1} = \theta_t - \eta\,\bar g,$$
#
# and every device applies the *same* update to the *same* parameters. By induction the replicas
# stay identical, step after step — so one copy is the checkpoint, and one process may write it.
#
# The job below trains a linear model on 4 processes: the batch is split over the processes
# (`P("data")`), the parameters are replicated (`P()`), and `jax.jit` inserts the all-reduce (here
# through gloo, over localhost). After 20 steps every process prints a checksum of *its own* copy.
# Then it saves with `primary_only=True` — process 0 alone writes — and restores: process 0
# reads, the others receive the bytes (a broadcast), and nobody else touches the disk.

# %%
DP = '''
m = mesh((N,), ("data",))
replicated, split = NamedSharding(m, P()), NamedSharding(m, P("data"))
X = global_array("x", (64, 8), split) / 250.0                  # each process holds 16 rows
y = X @ np.arange(1.0, 9.0, dtype=np.float32) + 0.5
params = {"w": jax.device_put(np.zeros(8, np.float32), replicated),
          "b": jax.device_put(np.zeros((), np.float32), replicated)}

@jax.jit
def step(params, X, y):
    loss = lambda p: jnp.mean((X @ p["w"] + p["b"] - y) ** 2)   # a mean over the *global* batch
    grads = jax.grad(loss)(params)                              # -> an all-reduce across processes
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

for _ in range(20):
    params = step(params, X, y)
local = {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}   # this process's copy
report(crc=f"{zlib.crc32(local['w'].tobytes() + local['b'].tobytes()):08x}", w0=float(local["w"][0]))

opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(primary_only=True))
with mc.CheckpointManager(os.path.join(DIR, "dp"), opts) as mngr:
    mngr.save(20, {"params": params})
    files = sorted(os.listdir(os.path.join(DIR, "dp", "step_20", "params")))
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in params.items()}}
    back = mngr.restore(20, target=target)["params"]
report(files=files, same=all(np.array_equal(np.asarray(back[k].addressable_data(0)), local[k]) for k in local))
'''
if ready("section 1a"):
    dp, _ = run_job("data_parallel", DP, n=4, k=1)
    for p, r in enumerate(dp):
        print(f"process {p}: checksum of its parameters {r['crc']}   w[0] = {r['w0']:.6f}   "
              f"restored == saved: {r['same']}")
    print("files of the checkpoint's params item:", dp[0]["files"])
    claim(len({r["crc"] for r in dp}) == 1, "the four processes' parameters are bit-identical",
          seen=[r["crc"] for r in dp])
    claim(dp[0]["files"] == ["data.bin", "manifest.json"] and all(r["same"] for r in dp),
          "one data.bin and one manifest.json, and every process got its copy back", seen=dp[0]["files"])

# %% [markdown]
# Look at the four checksums: they are equal — the replicas are bit-identical after 20 steps,
# which is what entitles one process to save for all. The item holds one `data.bin` and one
# `manifest.json`, written by process 0 alone, and every process got its copy back; minickpt's
# `primary_only=True` does it with a time-out on every wait.
#
# This is the old Flax recipe, "save if `jax.process_index() == 0`". Do not follow it literally
# today. Flax's `flax.training.checkpoints.save_checkpoint` now saves through Orbax by default
# (`flax_use_orbax_checkpointing=True`), and Orbax's save is *collective*: its barriers wait
# for every process. Called on process 0 alone, it waits for the others forever; when it sees
# several processes, Flax logs "Your devices will HANG if this function is only called on
# process 0!" (flax 0.12, `flax/training/checkpoints.py`). Its docstring says what to call
# instead: `save_checkpoint_multiprocess`, which **every** process calls. Read its Orbax path
# in that file, though: process 0 first removes the old checkpoints (`_remove_invalid_ckpts`)
# and only *then* does the Orbax save begin. That is the order chapter 2 teaches to avoid —
# delete only after the new checkpoint is durable. One process is enough to see it: three
# saves with `keep=2`, then a fourth save that fails (a leaf Orbax cannot store).

# %%
import logging

logging.getLogger("absl").setLevel(logging.CRITICAL)  # Orbax's log lines about the failed save
from flax.training import checkpoints as flax_checkpoints
flax_dir = WORK / "flax-multiprocess"
flax_dir.mkdir()


def flax_steps():
    return sorted(int(n.split("_")[1]) for n in os.listdir(flax_dir) if n.split("_")[-1].isdigit())


after = {}
for step in (10, 20, 30):
    flax_checkpoints.save_checkpoint_multiprocess(
        str(flax_dir), {"w": np.full(2, float(step), np.float32)}, step=step, keep=2)
    after[step] = flax_steps()
try:
    flax_checkpoints.save_checkpoint_multiprocess(
        str(flax_dir), {"w": np.full(2, 40.0, np.float32), "bad": object()}, step=40, keep=2)
except Exception as e:  # Orbax: no type handler for `object`
    print(f"save of step 40 failed: {type(e).__name__}: {str(e)[:70]}")
after[40] = flax_steps()
for step, steps in after.items():
    print(f"after the save of step {step}: checkpoints on disk {steps}")
claim(after[30] == [10, 20, 30] and after[40] == [20, 30],
      "with keep=2 three checkpoints are on disk after step 30, and the failed save of step 40 "
      "has deleted step 10", seen=after)

# %% [markdown]
# Step 10 is gone, and step 40 never came. Flax prunes to `keep` *before* the save, so once
# `keep` checkpoints exist, `keep=2` means three on disk after a successful save (here after
# step 30) and two after a failed one; a
# crash between the deletion and the commit costs a checkpoint the run was entitled to. minickpt
# deletes only after the new checkpoint is committed (chapter 2), on one process or many.
#
# ### 1b. Sharded state: no process holds the whole model
#
# When the model is too big for one device, its arrays are *sharded*: a `jax.Array` with a
# `NamedSharding` over a mesh that spans the processes. `sharding.devices_indices_map(shape)` says
# which piece (a *box* of global indices) each device holds. A mesh axis the `PartitionSpec` does
# not name replicates, so several devices may hold the same piece; it must still be written once.
# The rule, which every process applies alone and identically: of the devices holding a piece,
# the first in the sharding's device order (the one JAX marks `replica_id == 0`) owns it, and its
# process writes it (lab 4, task 4.2).
#
# The next job (4 processes, 2 devices each) builds two arrays on a `(4, 2)` mesh with axes
# `("p", "l")` — a row of the mesh per process — and prints who holds and who writes each piece.
# It then runs the experiments of section 2 on the same arrays.

# %%
SHARDED = '''
from minickpt.multihost.ownership import owned_shards
from minickpt.multihost.sync import default_sync
from minickpt.format.shards import box_of
m = mesh((N, 2), ("p", "l"))
layout = {"A": ((8, 4), P("p", "l")),      # split over processes and over the 2 devices of each
          "B": ((8, 4), P(None, "l"))}     # split over the 2 devices, replicated over the 4 processes
params = {k: global_array(k, s, NamedSharding(m, spec)) for k, (s, spec) in layout.items()}
if ME == 0:
    table = []
    for k, x in params.items():
        imap = x.sharding.devices_indices_map(x.shape)
        writes = {d.id for p in range(N) for _, d in owned_shards(x.shape, imap, p)}
        for d, index in imap.items():
            table.append([k, d.id, d.process_index, [list(b) for b in box_of(index, x.shape)], d.id in writes])
    report(table=table)

opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=20))
with mc.CheckpointManager(os.path.join(DIR, "ckpt"), opts) as mngr:
    mngr.save(1, {"params": params})                               # 2a: the collective save
    if ME == 0:
        report(layout=sorted(os.listdir(os.path.join(DIR, "ckpt", "step_1", "params"))),
               stats={k: round(v, 4) for k, v in vars(mngr.last_save_stats).items() if k.endswith("_s")})
'''
# section 2's experiments, in the same job (they need no new processes)
SHARDED += '''
# 2b: "every process saves its own copy" into one directory, as a single-host program would
naive = os.path.join(DIR, "naive")
os.makedirs(naive, exist_ok=True)
C = global_array("C", (8, 4), NamedSharding(m, P("p", None)))    # rows split over the processes
mine = np.asarray(C.addressable_data(0))                           # this process's 2 rows of C
np.save(os.path.join(naive, "C.npy"), mine)                        # the same file name everywhere
default_sync().exchange("naive-done", None, 20.0)               # (a barrier, to read it after all wrote)
if ME == 0:
    try:
        got = np.load(os.path.join(naive, "C.npy"))
        whole = values("C", (8, 4))
        report(naive={"readable": True, "shape": list(got.shape),
                      "rows": [r for r in range(8) if any(np.array_equal(g, whole[r]) for g in got)]})
    except Exception as e:                                         # interleaved writes: not even readable
        report(naive={"readable": False, "error": f"{type(e).__name__}: {e}"})

# 2c: two rules of any collective publication, on a small object of their own: every process's
# input-pipeline position (how far it has read its share of the data), one file per process, and
# one index that a reader trusts. Process 3's disk is 1 s slow.
sync = default_sync()
POS = os.path.join(DIR, "positions")

def write_position(tag, delay=0.0):                                # this process's part, durable
    os.makedirs(os.path.join(POS, tag), exist_ok=True)
    time.sleep(delay)
    name = f"p{ME}.json"
    with open(os.path.join(POS, tag, name), "w") as f:
        json.dump({"process": ME, "examples_read": 1000 * (ME + 1)}, f)
        f.flush()
        os.fsync(f.fileno())
    return name

def publish_index(tag, parts):                                     # one process: the index, by rename
    d = os.path.join(POS, tag)
    with open(os.path.join(d, "index.tmp"), "w") as f:
        json.dump(parts, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(d, "index.tmp"), os.path.join(d, "index.json"))
    return sorted(n for n in os.listdir(d) if n.startswith("p"))  # what a reader finds right then

sync.exchange("positions-start", None, 20.0)
slow = 1.0 if ME == 3 else 0.0
mine = write_position("hasty", slow)                               # (i) publish when *my* part is done
if ME == 0:
    report(hasty_found=publish_index("hasty", [f"p{p}.json" for p in range(N)]))
sync.exchange("positions-hasty", None, 20.0)
t = time.perf_counter()
mine = write_position("waited", slow)                              # (ii) a barrier before publishing
parts = sync.exchange("positions-written", mine, 20.0)             # returns once every part is durable
if ME == 0:
    report(waited_found=publish_index("waited", parts), waited_listed=parts,
           waited_s=round(time.perf_counter() - t, 2))

FAIL_TIMEOUT = 2.0                                                 # (iii) process 2's write fails
def failing_write(tag):
    if ME == 2:
        raise OSError(5, "Input/output error (injected on process 2)")
    return write_position(tag)

sync.exchange("positions-waited", None, 20.0)
t = time.perf_counter()
try:                                                               # its failure handed in at the barrier
    mine, error = failing_write("handed"), None
except OSError as e:
    mine, error = None, f"{type(e).__name__}: {e}"
said = sync.exchange("positions-handed", {"part": mine, "error": error}, FAIL_TIMEOUT, what="positions written")
failed = [p for p, s in enumerate(said) if s["error"]]
if failed:
    outcome = f"not published: process(es) {failed} failed: {said[failed[0]]['error']}"
else:
    outcome = "published" if ME != 0 else str(publish_index("handed", [s["part"] for s in said]))
report(handed=outcome, handed_s=round(time.perf_counter() - t, 3))

sync.exchange("positions-handed-done", None, 20.0)
t = time.perf_counter()
try:                                                               # the same failure, raised alone
    parts = sync.exchange("positions-alone", failing_write("alone"), FAIL_TIMEOUT, what="positions written")
    outcome = "published" if ME != 0 else str(publish_index("alone", parts))
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
report(alone=outcome, alone_s=round(time.perf_counter() - t, 2))
sync.exchange("positions-done", None, 20.0)                        # process 2 waits here for the others
if ME == 0:
    report(published={tag: os.path.exists(os.path.join(POS, tag, "index.json")) for tag in ("handed", "alone")})

# 2d: two processes that want different steps
with mc.CheckpointManager(os.path.join(DIR, "ckpt"), opts) as mngr:
    try:
        mngr.save(3 if ME != 3 else 4, {"params": params})
        report(disagree="saved")
    except Exception as e:
        report(disagree=f"{type(e).__name__}: {e}")
default_sync().exchange("disagree-done", None, 20.0)
if ME == 0:
    report(after_disagree=sorted(n for n in os.listdir(os.path.join(DIR, "ckpt")) if not n.startswith(".")))

# 2e: which step is the newest? Processes 0-1 look before a commit lands, 2-3 after it
def newest():
    with mc.CheckpointManager(os.path.join(DIR, "ckpt"), mc.CheckpointManagerOptions(read_only=True)) as r:
        return r.latest_step()
seen = newest() if ME < 2 else None
with mc.CheckpointManager(os.path.join(DIR, "ckpt"), opts) as mngr:
    mngr.save(6, {"params": params})                       # the commit lands here
if ME >= 2:
    seen = newest()
everyone = default_sync().exchange("newest", seen, 20.0)  # what each process would restore
agreed = everyone[0]                                      # the primary's choice, for all of them
with mc.CheckpointManager(os.path.join(DIR, "ckpt"), opts) as mngr:
    back = mngr.restore(agreed, target={"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                                                   for k, v in params.items()}})
report(newest_seen=everyone, restored_step=back.step)

# 2f: a process that stops answering (it hangs before writing) with a 3 s time-out
hung = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=3))
if ME == 3:
    def vanish():
        time.sleep(4.5)
        hard_exit(0)                                           # gone, without a word
    sync.faults["before_write"] = vanish
t = time.perf_counter()
with mc.CheckpointManager(os.path.join(DIR, "ckpt"), hung) as mngr:
    try:
        mngr.save(7, {"params": params})
        report(dead="saved")
    except Exception as e:
        report(dead=f"{type(e).__name__}: {e}", dead_after_s=round(time.perf_counter() - t, 1),
               left=sorted(n for n in os.listdir(os.path.join(DIR, "ckpt")) if not n.startswith(".")))
DONE_WAIT = 0                                                      # process 3 is gone: don't wait for it
'''
if ready("section 1b"):
    sh, sh_dir = run_job("sharded", SHARDED, n=4, k=2)
    print(f"{'array':6s}{'device':>7s}{'process':>9s}   {'box (rows, cols)':22s}writes it")
    for k, dev, proc, box, writes in sh[0]["table"]:
        print(f"{k:6s}{dev:>7d}{proc:>9d}   {str(box):22s}{'yes' if writes else '-'}")
    written = {(k, proc) for k, _, proc, _, w in sh[0]["table"] if w}
    claim(sum(w for k, *_, w in sh[0]["table"] if k == "A") == 8 and {p for k, p in written if k == "A"} == {0, 1, 2, 3},
          "A's 8 pieces are written by their own devices, two per process", seen=sorted(written))
    claim(sum(w for k, *_, w in sh[0]["table"] if k == "B") == 2 and {p for k, p in written if k == "B"} == {0},
          "B's 2 pieces are written once each, both by process 0", seen=sorted(written))

# %%
if ready("figure of section 1b", "sharded"):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = plt.cm.tab10.colors
    for ax, name in zip(axes, ["A", "B"]):
        rows = [r for r in sh[0]["table"] if r[0] == name]
        for _, dev, proc, ((r0, r1), (c0, c1)), writes in rows:
            if writes:
                ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, fc=colors[proc], ec="white",
                                           lw=2, alpha=0.75))
                ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"p{proc}\n(dev {dev})", ha="center", va="center",
                        fontsize=8)
        held = {}
        for _, dev, proc, (rb, cb), _w in rows:
            held.setdefault((tuple(rb), tuple(cb)), []).append(proc)
        ax.set_xlim(0, 4), ax.set_ylim(8, 0)
        ax.set_xlabel("column index"), ax.set_ylabel("row index")
        ax.set_title(f"{name}: {len(held)} pieces, each held by {len(next(iter(held.values())))} device(s)")
    fig.suptitle("Who writes which box of an (8, 4) array on a (4, 2) mesh (colour = writing process)")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# *Each box is a piece of the array, coloured by the one process that writes it.* `A` has 8
# pieces, one per device, so every process writes its two. `B` is split only along the mesh's `"l"`
# axis, so each of its 2 pieces is held by 4 devices on 4 processes — and written once, by process
# 0, the process of its first holder. No process writes anything twice, and together they write
# every element exactly once.

# %% [markdown]
# ## 2. The collective protocol
#
# A collective save has to produce what a single process would: one checkpoint of one step,
# complete, or nothing. minickpt's save (lab 4 builds its decisions) has three parts, on every
# process:
#
# 1. **Agree** (task 4.1): publish the step (and the tree's structure); all-gather; every process
#    checks that all are equal. A disagreement is an error on *every* process, naming who said
#    what.
# 2. **Write**: every process writes and fsyncs the shards it owns (task 4.2) into the step's
#    temporary directory.
# 3. **Publish**: one process, the *primary*, writes the manifests (listing every process's shard
#    files) and the metadata, and commits the step as one process would (lab task 2.3): a rename.
#
# Between and around these parts the processes meet at *barriers*, each with a time-out. Where
# the barriers go, what travels through them, and what each process does when something fails
# is the *commit protocol*, lab task 4.3; section 2c shows the two rules it rests on, on a
# smaller object, and sections 2d–2f what goes wrong without agreement, and when a process
# dies. What every survivor sees is the same in every case: a process that never arrives at a
# barrier is named on every survivor after the time-out, and every survivor raises. What is on
# disk depends on when it went missing: before every shard is durable, nothing may be published;
# once every shard is durable and the primary alive, its commit may complete and the step stay,
# while the survivors still report the failed save; if the primary itself dies before its
# rename, a temporary directory is left, which the next primary removes. Lab 4's fault points
# drive these cases.
#
# ### 2a. What a collective save writes

# %%
if ready("section 2a", "sharded"):
    print("files of step_1/params:", sh[0]["layout"])
    print("where process 0's save time went (s):", sh[0]["stats"])
    claim(sh[0]["layout"] == sorted(["manifest.json"] + [f"data.p{i}.bin" for i in range(4)] + [f"manifest.p{i}.json" for i in range(4)]),
          "one manifest.json, and a data.p<i>.bin and a manifest.p<i>.json per process", seen=sh[0]["layout"])

# %% [markdown]
# One `manifest.json` (the primary's: every leaf's global shape and dtype, and the list of shard
# files with their checksums) and, per process `i`, `data.p<i>.bin` with the pieces it owns and
# `manifest.p<i>.json` with their boxes, offsets and CRC-32s. `barrier_s` is the time spent waiting
# for the others.
#
# ### 2b. The seed's misconception: "every process saves its own copy"
#
# A single-host program run on every process writes "its" checkpoint — the part of the state it
# holds — under the same name, into the same directory. Here each of the 4 processes holds 2 of
# the 8 rows of an array `C` (`P("p", None)`) and saves them as `C.npy`:

# %%
if ready("section 2b", "sharded"):
    nv = sh[0]["naive"]
    if nv["readable"]:
        print(f"C.npy holds an array of shape {tuple(nv['shape'])}: rows {nv['rows']} of the 8 rows of C")
    else:
        print("C.npy is not even readable:", nv["error"])
    claim(not nv["readable"] or len(nv["rows"]) <= 2,
          "the file that remains holds at most one process's 2 rows of the 8", seen=nv)

# %% [markdown]
# Four processes wrote `C.npy`; the file that remains is whichever write landed last: one
# process's 2 rows of 8 (which rows depends on timing; if the writes interleaved, the file is
# not even readable). The rest of the model is gone, and nothing said so.
#
# Under data parallelism the same mistake is not merely wasteful. The four files would hold the
# same bytes, but every writer truncates the file when it opens it while the others go on writing
# at their own offsets: until the last writer finishes — and for good, if a process dies meanwhile
# — the file can hold zeros where another writer's bytes were, or the bytes of two writers (a
# *torn* file), and nothing stops a reader from reading it then. (That the replicas' bytes are
# equal — section 1a's checksums, on a GPU as on a CPU, since every replica gets the same
# all-reduced gradient — does not help: the damage is in the moments between the writes.) Under
# sharding it loses the model for certain.
#
# ### 2c. Two rules of a collective publication, on a smaller object
#
# The commit of a checkpoint rests on two rules that hold for anything several processes write and
# one of them publishes. The job above showed them on a smaller object than a checkpoint: the
# *position of every process's input pipeline* (how far it has read its share of the data), one
# small file per process, `p<i>.json`, and one `index.json` that names the parts. A reader trusts
# the index: what it names must be there. Process 0 writes the index (to a temporary name, fsync,
# one rename); process 3's disk is 1 s slow. Three variants:
#
# - **(i)** process 0 publishes the index as soon as *its own* part is written;
# - **(ii)** every process writes its part, then all meet at a barrier (`Sync.exchange`, which
#   returns every process's value once every process has called it), and only then does process 0
#   publish, with the names the barrier brought;
# - **(iii)** process 2's write fails with an `OSError`. Either process 2 hands its failure in at
#   that barrier, as its value, and every process reads it there; or process 2 raises at once,
#   alone, and never comes to the barrier (a 2 s time-out).

# %%
if ready("section 2c", "sharded"):
    print(f"(i)   index.json published by process 0 when its own part was done; parts on disk then: "
          f"{sh[0]['hasty_found']}")
    print(f"(ii)  published after the barrier, {sh[0]['waited_s']} s after the writes began: the index names "
          f"{sh[0]['waited_listed']}; on disk then: {sh[0]['waited_found']}")
    for p, r in enumerate(sh):
        print(f"(iii) process {p}: failure handed in: after {r['handed_s']:.3f} s, {r['handed']}")
    for p, r in enumerate(sh):
        print(f"(iii) process {p}: raised alone:      after {r['alone_s']:.2f} s, {r['alone']}")
    print("index.json published in (iii):", sh[0]["published"])
    claim("p3.json" not in sh[0]["hasty_found"],
          "(i) the index was published while process 3's part was not yet on disk", seen=sh[0]["hasty_found"])
    every = [f"p{p}.json" for p in range(4)]
    claim(sh[0]["waited_listed"] == every and sh[0]["waited_found"] == every,
          "(ii) after the barrier, the index names every process's part and every part is on disk",
          seen=(sh[0]["waited_listed"], sh[0]["waited_found"]))
    claim(all(r["handed"].startswith("not published: process(es) [2] failed: OSError") for r in sh)
          and all(r["handed_s"] < 2.0 for r in sh),
          "(iii) handed in: every process, process 2 included, learned of process 2's OSError at the barrier, "
          "before the 2 s time-out", seen=[r["handed_s"] for r in sh])
    claim(all(sh[p]["alone"].startswith("PeerTimeoutError") and "process(es) 2" in sh[p]["alone"]
              and sh[p]["alone_s"] >= 2.0 for p in (0, 1, 3)) and sh[2]["alone"].startswith("OSError"),
          "(iii) raised alone: process 2 knew its own error, the others only that process 2 did not come, "
          "after the whole 2 s time-out", seen=[(r["alone"][:30], r["alone_s"]) for r in sh])
    claim(sh[0]["published"] == {"handed": False, "alone": False}, "(iii) no index was published after a failure",
          seen=sh[0]["published"])
    handed = max(r["handed_s"] for r in sh)
    verdict(handed < 0.5, "a failure handed in at the barrier reaches everyone in a fraction of a second",
            otherwise="a busy machine delays every process; compare with the time-out, not with zero",
            seen=f"slowest {handed:.3f} s")

# %% [markdown]
# **Rule 1: a barrier before publishing makes "published" mean "complete".** In (i) the index
# named four parts while process 3's was not on disk: a reader at that moment — or after a crash
# at that moment, for good — finds the index promising a part that is not there. Process 0 had no
# way to know better: that another process has finished is something only a meeting of the
# processes tells. In (ii) the barrier returned only once every part was durable, so the index
# was complete when it appeared; the price is that process 0 published about 1 s later, the time
# of the slowest writer (section 3 measures that price).
#
# **Rule 2: a failure is reported at the next barrier, so that nobody waits for a time-out.**
# When process 2 handed its error in, every process read it at the barrier, in a fraction of a
# second, and nobody published. When it raised alone, the three others could not tell a failed
# write from a dead or hung process: they waited for the whole time-out, then knew only that
# process 2 had not come. Here that cost the 2 s time-out and a little more (the times printed);
# with a production time-out (60 s in minickpt, 1200 s in Orbax's background phase) it is a
# stalled job, once per failure.
#
# A checkpoint's commit needs both rules and more than this index did: a temporary directory
# that someone must create before anyone writes into it, a publication (writing the manifests,
# the rename) that can itself fail, processes that must not return before the step is published,
# and a result of the publication that every process has to learn. How to arrange all of it with
# `CollectiveSave`'s parts is lab task 4.3: its contract says what must hold, and its tests inject
# a failure at every phase to check it.
#
# ### 2d. Processes that want different steps

# %%
if ready("section 2d", "sharded"):
    for p, r in enumerate(sh):
        print(f"process {p}: {r['disagree']}")
    print("in the checkpoint directory afterwards:", sh[0]["after_disagree"])
    claim(len({r["disagree"] for r in sh}) == 1 and sh[0]["disagree"].startswith("ProcessDisagreementError"),
          "every process raised the same ProcessDisagreementError", seen=[r["disagree"][:40] for r in sh])
    claim(sh[0]["after_disagree"] == ["step_1"], "nothing of step 3 or step 4 was written",
          seen=sh[0]["after_disagree"])

# %% [markdown]
# All four processes raised the same `ProcessDisagreementError`, naming who wanted which step,
# and nothing of step 3 or step 4 reached the disk: mixing the shards of two steps in one
# checkpoint would restore a model that never existed.
#
# **What Orbax does here.** A seed tutorial says Orbax "agrees on the global step with an
# all-gather before saving". It does not (orbax-checkpoint 0.12.8). The barriers of its
# blocking phase (`CheckpointManager:save_start`, `create_tmp_directory:pre`/`post`) go through
# `multihost.sync_global_processes`, which by default calls JAX's
# `multihost_utils.sync_global_devices(name)`: an all-gather of the CRC-32 of the barrier's
# *name* — and the names carry no step (in `checkpoint_manager.py` the `suffix=str(step)` is
# commented out). The signals that tell the others the directory exists are keyed by an
# operation counter (`OperationIdGenerator`), not by the step. Only the background phase's
# barriers (`async_write_complete.<directory name>`) end with the step directory's name: processes
# that disagree are not stopped before they write; they wait at two different barriers until the
# time-out (`AsyncOptions.timeout_secs`, 1200 s). Agreeing on the step is left to your loop.
#
# ### 2e. Which step is the newest? Agree on restore too
#
# Restoring needs an agreement as well. Each process that asks `latest_step()` lists the
# directory *itself*, at its own moment; while a commit lands, some see the new step and some do
# not. The job made that happen on purpose: processes 0–1 looked before the collective save of
# step 6, processes 2–3 after it. Then they exchanged what they saw and all restored the
# primary's choice. Look at which step that is:

# %%
if ready("section 2e", "sharded"):
    print("the newest step each process saw:", sh[0]["newest_seen"])
    print("the step each restored after agreeing:", [r["restored_step"] for r in sh])
    claim(sh[0]["newest_seen"] == [1, 1, 6, 6], "processes 0-1 saw step 1 as the newest, 2-3 saw step 6",
          seen=sh[0]["newest_seen"])
    claim({r["restored_step"] for r in sh} == {sh[0]["newest_seen"][0]},
          "after agreeing, every process restored the primary's step", seen=[r["restored_step"] for r in sh])

    claim(sh[0]["restored_step"] < max(sh[0]["newest_seen"]),
          "the agreed step is the older one: the primary had looked before step 6 landed",
          seen=(sh[0]["restored_step"], max(sh[0]["newest_seen"])))

# %% [markdown]
# The agreement buys consistency, not recency: step 6 is complete on disk, yet every process
# restored step 1, because the primary's list was taken before the commit. That is the right
# trade — a job restarted a moment later lists again and takes step 6 — but it is why the step
# must be read *once*, after the save that might still be landing has returned everywhere.
#
# Without the exchange, processes 0–1 would have restored step 1 and processes 2–3 step 6: one
# model assembled from two moments, with no error anywhere. So pick the step once — the primary
# lists and broadcasts, or every process publishes its newest and all take the same one — and
# pass it to `restore(step)` explicitly. Orbax offers the first as an option:
# `CheckpointManagerOptions(single_host_load_and_broadcast=True)` makes process 0 list the steps and
# broadcast them; by default (`False`) every process lists on its own, as here.
#
# ### 2f. A process that dies during a save

# %%
if ready("section 2f", "sharded"):
    for p in range(3):
        print(f"process {p}: after {sh[p]['dead_after_s']} s: {sh[p]['dead']}")
    print("left in the checkpoint directory:", sh[0]["left"])
    claim(all(sh[p]["dead"].startswith("PeerTimeoutError") and "process(es) 3" in sh[p]["dead"] for p in range(3)),
          "processes 0-2 raised PeerTimeoutError naming process 3", seen=[sh[p]["dead"][:60] for p in range(3)])
    claim(sh[0]["left"] == ["step_1", "step_6"], "step_7 does not exist and no temporary is left",
          seen=sh[0]["left"])
    waited = [sh[p]["dead_after_s"] for p in range(3)]
    verdict(all(3.0 <= w < 4.5 for w in waited), "they gave up a little after the 3 s time-out "
            "(within 4.5 s of starting the save)",
            otherwise="a busy machine delays the processes that wait too; the time-out is a lower bound",
            seen=f"{waited} s")

# %% [markdown]
# Process 3 stopped answering before writing. The others waited at the barrier for the time-out
# (3 s here; 60 s by default: keep it above your slowest write), then raised `PeerTimeoutError`
# naming process 3 — the printed times say how much longer than 3 s they took on this machine.
# The primary removed the temporary directory: `step_7` does not exist, and `step_6` is still the
# newest checkpoint. JAX has a coarser guard of its own: the coordination service declares a
# process dead when its heartbeats stop (`jax.distributed.initialize(heartbeat_timeout_seconds=100)`
# by default, in `jax/_src/distributed.py`) and brings the job down. (After such an error, leave
# with `minickpt.multihost.process.hard_exit()`: a normal exit would wait for the dead process at
# JAX's shutdown barrier.)

# %% [markdown]
# ## 3. The barrel effect
#
# A barrel holds water only up to its shortest stave; a collective save finishes only when its
# slowest process has written. With $T^{(p)}_{\mathrm{write}}$ the write time of process $p$,
#
# $$T_{\mathrm{save}} \approx \max_p T^{(p)}_{\mathrm{write}} + T_{\mathrm{barriers}} + T_{\mathrm{commit}},$$
#
# *on every process*, however fast its own disk. The job below saves 4 × 4 MiB from 4 processes;
# process 3 is slowed by $d$ seconds before it writes, for several $d$. Each process measures its
# whole `save()` and its own write (from the start of its write to the end of its fsync). The same
# job then saves the same state with Orbax, for section 5.

# %%
DELAYS = [0.0, 0.5, 1.0, 2.0]
BARREL = f'''
from minickpt.multihost.sync import default_sync
import orbax.checkpoint as ocp
m = mesh((N, 2), ("p", "l"))
noise = np.random.default_rng(0).standard_normal((1024, 4096), dtype=np.float32)  # random values
params = {{"w": jax.make_array_from_callback(noise.shape, NamedSharding(m, P(("p", "l"))),
                                             lambda index: noise[index])}}       # 16 MiB in all
sync, marks = default_sync(), {{}}
opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=30))
with mc.CheckpointManager(os.path.join(DIR, "barrel"), opts) as mngr:
    mngr.save(0, {{"params": params}})                              # a warm-up save, not measured
    for i, d in enumerate({DELAYS}):
        def before(d=d):
            marks["w0"] = time.perf_counter()
            if ME == 3:
                time.sleep(d)                                       # a slow disk on process 3
        sync.faults["before_write"] = before
        sync.faults["after_write"] = lambda: marks.update(w1=time.perf_counter())
        t = time.perf_counter()
        mngr.save(i + 1, {{"params": params}})
        report(**{{f"save_{{i}}": time.perf_counter() - t, f"own_{{i}}": marks["w1"] - marks["w0"]}})
    sync.faults.clear()
ck = ocp.StandardCheckpointer()
for i in range(2):                                                  # the first save warms Orbax up
    t = time.perf_counter()
    ck.save(os.path.join(DIR, "orbax", f"step_{{i}}"), {{"params": params}})
    ck.wait_until_finished()
    report(**{{f"orbax_{{i}}": time.perf_counter() - t}})
# a *replicated* array (every device holds all of it): who writes its bytes, in each library?
rep = {{"r": jax.make_array_from_callback((512, 1024), NamedSharding(m, P()), lambda index: noise[:512, :1024][index])}}
ck.save(os.path.join(DIR, "orbax", "replicated"), rep)
ck.wait_until_finished()
ck.close()
with mc.CheckpointManager(os.path.join(DIR, "mini_replicated"), opts) as mngr:
    mngr.save(0, {{"params": rep}})

def tree_bytes(top):
    return {{os.path.relpath(os.path.join(r, f), top): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(top) for f in fs}}
if ME == 0:
    top = os.path.join(DIR, "orbax", "step_1")
    report(orbax_layout=sorted(tree_bytes(top)), orbax_bytes=sum(tree_bytes(top).values()),
           orbax_rep=tree_bytes(os.path.join(DIR, "orbax", "replicated")),
           mini_rep=tree_bytes(os.path.join(DIR, "mini_replicated", "step_0")))
'''
if ready("section 3"):
    barrel, barrel_dir = run_job("barrel", BARREL, n=4, k=2)
    save = np.array([[r[f"save_{i}"] for i in range(len(DELAYS))] for r in barrel])
    own = np.array([[r[f"own_{i}"] for i in range(len(DELAYS))] for r in barrel])
    print("delay of process 3 (s):      ", DELAYS)
    for p in range(4):
        print(f"process {p}: save() took (s) ", np.round(save[p], 2), "  its own write (s)", np.round(own[p], 2))
    slopes = [float(np.polyfit(DELAYS, save[p], 1)[0]) for p in range(4)]
    verdict(all(0.8 <= k <= 1.2 for k in slopes),
            "every process's save() grows by about one second per second of process 3's delay",
            otherwise="a busy machine adds its own delays; read the slope of the medians, not one point",
            seen="slopes " + ", ".join(f"{k:.2f}" for k in slopes))
    verdict(float(own[:3].max()) < 0.25 * max(DELAYS),
            "the fast processes' own writes stay short, whatever process 3's delay",
            otherwise="their writes were slowed by something else on this machine (other programs, a busy disk)",
            seen=f"longest {own[:3].max():.2f} s")

# %%
if ready("figure of section 3", "barrel"):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in range(4):
        ax.plot(DELAYS, save[p], "o-", color=plt.cm.tab10.colors[p], label=f"process {p}: whole save()")
    ax.plot(DELAYS, own[:3].mean(axis=0), "s--", color="gray", label="processes 0-2: their own write")
    ax.plot(DELAYS, np.array(DELAYS) + own[:3].mean(axis=0), ":", color="black",
            label="d + a fast process's write")
    ax.set_xlabel("delay d of process 3 before it writes (s)")
    ax.set_ylabel("time (s)")
    ax.set_title("The barrel effect: a collective save waits for its slowest process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# *Each process's whole `save()` (solid) and the fast processes' own write (gray), against the
# delay of process 3 alone.* What to look for: the four solid lines on top of each other, along
# the dotted line $d + T_{\mathrm{write}}$ (a slope of about 1), and a flat gray line — the three
# fast processes spend the difference waiting at the barrier before the commit. The two verdicts
# above say whether this run shows it. (The absolute times depend on your disk and on how busy the
# machine is.) The cure is never to skip the barrier but to remove the slow stave: balanced shards, a fast local
# disk for the write (chapter 6's tiered storage), and writing in the background (chapter 5).

# %% [markdown]
# ## 4. Restoring elsewhere
#
# A checkpoint stores *global* boxes, not devices. To restore, each process asks, for every device
# it has, for the region that device will hold in the *target* sharding, and cuts it out of
# whichever saved pieces overlap it (lab 4, task 4.4). So the checkpoint of section 1b — saved by
# 4 processes on a `(4, 2)` mesh — restores on 2 processes with a `(2, 2)` mesh and other
# `PartitionSpec`s:

# %%
RESTORE = f'''
m = mesh((N, 2), ("a", "b"))
shapes = {{"A": (8, 4), "B": (8, 4)}}
specs = {{"A": P("b", "a"), "B": P(("a", "b"))}}
target = {{"params": {{k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(m, specs[k])) for k, s in shapes.items()}}}}
with mc.CheckpointManager(os.path.join(os.path.dirname(DIR), "sharded", "ckpt")) as mngr:  # section 1b's
    got = mngr.restore(1, target=target)["params"]
report(identical={{k: all(np.array_equal(np.asarray(s.data), values(k, shapes[k])[s.index])
                         for s in got[k].addressable_shards) for k in shapes}})
'''
if ready("section 4 (2 processes)", "sharded"):
    rs, _ = run_job("restore_on_2", RESTORE, n=2, k=2)
    for p, r in enumerate(rs):
        print(f"process {p} of 2: every local piece identical to the saved values: {r['identical']}")
    claim(all(all(r["identical"].values()) for r in rs), "both processes restored identical values", seen=rs)

# %% [markdown]
# And by this notebook alone — one process — onto its own devices (4 CPU devices locally, the GPU
# or TPU on Colab), or into plain numpy arrays without a target:

# %%
if ready("section 4 (this notebook)", "sharded"):
    here = Mesh(np.array(jax.devices()), ("x",))
    target = {"params": {k: jax.ShapeDtypeStruct((8, 4), np.float32,
                                                 sharding=NamedSharding(here, P(None, "x") if k == "A" else P("x")))
                         for k in ("A", "B")}}
    with mc.CheckpointManager(sh_dir / "ckpt") as mngr:
        one = mngr.restore(1, target=target)["params"]
        plain = mngr.restore(1)["params"]
    for k in ("A", "B"):
        print(f"{k}: restored by 1 process on {one[k].sharding.spec}: identical "
              f"{np.array_equal(np.asarray(one[k]), values(k, (8, 4)))};  as numpy: identical "
              f"{np.array_equal(plain[k], values(k, (8, 4)))}")
    claim(all(np.array_equal(np.asarray(one[k]), values(k, (8, 4))) and np.array_equal(plain[k], values(k, (8, 4)))
              for k in ("A", "B")), "one process restores identical values, onto its devices and as numpy")

# %% [markdown]
# Identical values, from 4 processes to 2 and to 1, across three mesh shapes. Replicated state
# restores the same way, or, as in section 1a, with `primary_only=True`: one reader, a broadcast.

# %% [markdown]
# ## 5. Orbax beside minickpt
#
# Orbax's `StandardCheckpointer` (and `CheckpointManager`) do the same collective job in a
# `jax.distributed` program: every process calls `save`, barriers separate the phases, each
# process writes its part, and the primary process commits. The barrel job above saved the same
# 16 MiB state with both:

# %%
if ready("section 5", "barrel"):
    ox = np.array([[r["orbax_0"], r["orbax_1"]] for r in barrel])
    print(f"16 MiB from 4 processes: minickpt save() {save[:, 0].mean():.2f} s (no delay), "
          f"Orbax {ox[:, 1].mean():.2f} s (its second save; the first took {ox[:, 0].mean():.2f} s)")
    layout = barrel[0]["orbax_layout"]
    print(f"Orbax's checkpoint: {barrel[0]['orbax_bytes']:,} bytes in {len(layout)} files, such as")
    for f in layout[:12]:
        print("   ", f)
    print("minickpt's checkpoint:",
          sorted(str(p.relative_to(barrel_dir / "barrel" / "step_1")) for p in (barrel_dir / "barrel" / "step_1").rglob("*") if p.is_file()))
    raw = 1024 * 4096 * 4
    print(f"the state's raw bytes: {raw:,}; Orbax's files: {barrel[0]['orbax_bytes']:,} "
          f"({barrel[0]['orbax_bytes'] / raw:.0%})")
    claim(barrel[0]["orbax_bytes"] < raw, "Orbax's files are smaller than the raw array: it compresses",
          seen=barrel[0]["orbax_bytes"])
    shrink = 1 - barrel[0]["orbax_bytes"] / raw
    print(f"Orbax's compression spared {100 * shrink:.0f} bytes in each hundred")
    claim(0.01 < shrink < 0.10, "random normal values compress by less than a tenth, not by a "
          "factor", seen=f"{shrink:.1%} saved")

# %% [markdown]
# The layouts differ, the protocol is alike. Orbax writes every array through **TensorStore**,
# Google's library for reading and writing large n-dimensional arrays in chunks, and by default
# into TensorStore's **OCDBT** format (an "optionally-cooperative distributed B+tree"): a
# key-value store that packs many chunks into a few large data files under `d/` and finds them
# through a B+tree of index nodes, with a `manifest.ocdbt` at its root. Orbax gives each process
# its own OCDBT store (`ocdbt.process_<i>/`), which the primary's top-level `manifest.ocdbt`
# ties together, adds `array_metadatas/process_<i>` and the tree's `_METADATA`, and marks
# completion with `commit_success.txt` and a rename; minickpt writes `data.p<i>.bin` and
# `manifest.p<i>.json` per process and one `manifest.json` with every shard file's checksum. Both
# restore onto any mesh. Orbax's files are also *smaller* than the array: it compresses every
# chunk with zstd by default (`PyTreeCheckpointHandler(use_compression=True)` in
# `orbax/checkpoint/_src/handlers/pytree_checkpoint_handler.py`, passed on to `ArrayWriteSpec`,
# whose `_build_zarr2_metadata` in `orbax/checkpoint/_src/serialization/tensorstore_utils.py`
# sets `{'id': 'zstd', 'level': 1}` for the default Zarr v2 format). Even these random normal
# float32 values shrank by the bytes in each hundred printed above: their sign and exponent bits
# repeat, their mantissas do not, so the saving is under a tenth, not a factor. minickpt stores
# the raw bytes.
# (Timings on a busy 2-core machine vary by tens of percent from run to run; the benchmark in
# `benchmarks/multihost_save.py` measures properly.)
#
# **Who writes a replicated array.** The job also saved a replicated `(512, 1024)` float32 array
# (2 MiB, held whole by all 8 devices) with each library. Count each process's bytes:

# %%
def by_process(files, pattern):
    out = {}
    for name, size in files.items():
        for part in name.split("/"):
            if part.startswith(pattern):
                p = int(part[len(pattern):].split(".")[0])
                out[p] = out.get(p, 0) + size
    return dict(sorted(out.items()))


if ready("section 5 (replicated array)", "barrel"):
    orbax_rep = by_process(barrel[0]["orbax_rep"], "ocdbt.process_")
    mini_rep = by_process(barrel[0]["mini_rep"], "data.p")
    mini_rep[0] = mini_rep.get(0, 0) + sum(v for k, v in barrel[0]["mini_rep"].items() if k.endswith("/data.bin"))
    print("Orbax, bytes in each process's ocdbt.process_<i>/:", orbax_rep)
    print("minickpt, bytes in each process's data files:     ", mini_rep)
    claim(len([b for b in orbax_rep.values() if b > 0]) == 4,
          "Orbax split the replicated array over all 4 processes", seen=orbax_rep)
    claim(mini_rep.get(0, 0) >= 2 * 2**20 and all(v == 0 for k, v in mini_rep.items() if k != 0),
          "minickpt's process 0 wrote all of it", seen=mini_rep)

# %% [markdown]
# minickpt's rule — the first holder of a piece writes it — gives all of a replicated array to
# process 0: exactly the imbalance that makes one stave short in section 3. Orbax avoids it: with
# *replica-parallel* saving (`ArrayHandler(use_replica_parallel=...)`, on by default unless the
# environment variable `JAX_PLATFORMS` names `gpu` or `cuda`: `_get_default_use_replica_parallel`
# in `jax_array_handlers.py`), each of the $n$ replicas of a shard writes $1/n$ of it, cut along the
# first axis that $n$ divides (`get_replica_slices` in `replica_slices.py`; it falls back to one
# writer when no axis divides). The bytes above are spread over the four processes for that
# reason. Splitting the write of replicated leaves is a fair exercise after lab 4.

# %% [markdown]
# ### 5b. Who commits, who waits: Orbax's `MultiprocessingOptions`
#
# The barriers and the commit of section 2 are configured in Orbax by
# `ocp.options.MultiprocessingOptions`, passed to `CheckpointManagerOptions`
# (`multiprocessing_options=`) or to a handler:
#
# - `primary_host` (default 0): the process that writes the metadata and commits (the rename);
#   `None` makes every process do the primary's work (for file systems local to each host).
# - `active_processes`: the set of processes that take part; barriers wait for these only, so
#   a subset can save while the others go on (Orbax will not create the directory then: make
#   it first, and pass `create=False`).
# - `barrier_sync_key_prefix`: a prefix for the barriers' names, so that two managers in one
#   job (say, a model's and a data pipeline's) do not meet at each other's barriers.
#
# A job of 2 processes measures the first two. Each process records every rename it makes
# (Orbax's commit on a local disk is a rename of `<step>.orbax-checkpoint-tmp…`); then only
# process 0 saves, with `active_processes={0}`, while process 1 does not call Orbax at all.

# %%
MP_OPTIONS = '''
import orbax.checkpoint as ocp
renames, _rename = [], os.rename
def spy(a, b, *args, **kw):                     # record this process's renames
    renames.append(f"{os.path.basename(str(a))} -> {os.path.basename(str(b))}")
    return _rename(a, b, *args, **kw)
os.rename = spy
x = global_array("x", (8, 4), NamedSharding(mesh((N,), ("x",)), P("x")))
MPO = ocp.options.MultiprocessingOptions
for label, mpo in (("default", MPO()), ("primary_host=1", MPO(primary_host=1, barrier_sync_key_prefix="p1"))):
    renames.clear()
    opts = ocp.CheckpointManagerOptions(multiprocessing_options=mpo, enable_async_checkpointing=False)
    with ocp.CheckpointManager(os.path.join(DIR, label.replace("=", "")), options=opts) as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"x": x}))
    report(**{label: [r for r in renames if "tmp" in r]})
if ME == 0:                                     # a save of process 0 alone: host-local data
    os.makedirs(os.path.join(DIR, "solo"))      # Orbax does not create it with active_processes
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=False,
        multiprocessing_options=MPO(primary_host=0, active_processes={0}, barrier_sync_key_prefix="solo"))
    with ocp.CheckpointManager(os.path.join(DIR, "solo"), options=opts) as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"w": np.arange(4.0, dtype=np.float32)}))
    report(solo=sorted(os.listdir(os.path.join(DIR, "solo"))))
else:
    report(solo="never called Orbax")
'''
if ready("section 5b"):
    mp, _ = run_job("orbax_options", MP_OPTIONS, n=2, k=1)
    for p, r in enumerate(mp):
        print(f"process {p}: commits (renames) with default options {r['default']}; "
              f"with primary_host=1 {r['primary_host=1']}; solo save: {r['solo']}")
    claim(bool(mp[0]["default"]) and not mp[1]["default"] and not mp[0]["primary_host=1"]
          and bool(mp[1]["primary_host=1"]) and mp[0]["solo"] == ["1"],
          "process 0 commits by default, process 1 with primary_host=1, and process 0 saved "
          "step 1 alone with active_processes={0}", seen=mp)

# %% [markdown]
# The renames moved with `primary_host`, and the save of process 0 alone finished without
# process 1 ever reaching a barrier.
#
# **Orbax's two-tier manager.** `orbax.checkpoint.experimental.emergency.checkpoint_manager`
# (experimental: its docstring says not to use it "without specific approval") combines two
# managers: frequent *local* checkpoints (`LocalCheckpointOptions`: a RAM disk or local SSD of
# each host) and rarer *persistent* ones (`PersistentCheckpointOptions`: a bucket). It is built
# for at least two data-parallel replicas (slices) of the model along `replica_axis_index` of the
# mesh: the first replica writes the persistent checkpoint, the others the local ones; a restore
# takes the newest step that some replica still holds complete on its local disks and
# *broadcasts* it to the rest, and falls back to the persistent copy otherwise. Its classes do
# not promise a durable local tier or a mirror of the local checkpoints to the bucket; they count
# on the replicas holding copies of each other. With a single replica it is an ordinary
# `CheckpointManager` of the persistent directory — measured here on this notebook's devices:

# %%
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

import orbax.checkpoint as ocp

tiers = emergency.CheckpointManagerOptions(
    local=emergency.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
    persistent=emergency.PersistentCheckpointOptions(save_interval_steps=10, max_to_keep=3))
one_replica = Mesh(np.array(jax.devices()).reshape(1, -1), ("replica", "model"))
for tier in ("local", "persistent"):
    (WORK / "two-tier" / tier).mkdir(parents=True)
w = jax.device_put(np.arange(8 * jax.device_count(), dtype=np.float32),
                   NamedSharding(one_replica, P("model")))
two_tier = emergency.CheckpointManager(WORK / "two-tier" / "local", WORK / "two-tier" / "persistent",
                                       one_replica, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype)},
                                       options=tiers)
for step in (2, 4, 6, 8, 10):
    two_tier.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"w": w})))
two_tier.wait_until_finished()
two_tier.close()
on_disk = {tier: sorted(os.listdir(WORK / "two-tier" / tier)) for tier in ("local", "persistent")}
print(f"mesh {dict(one_replica.shape)}: after saves at steps 2, 4, 6, 8, 10: {on_disk}")
claim(on_disk["local"] == [] and on_disk["persistent"] == ["10", "2"],
      "with one replica nothing goes to the local tier; the persistent one holds steps 2 and 10",
      seen=on_disk)

# %% [markdown]
# With one replica the local tier never received a file; the persistent directory got its
# interval's steps (and the first step, which Orbax's default save policy always saves: it
# includes an `InitialSavePolicy`, in `orbax/checkpoint/checkpoint_manager.py`). Chapter 6's tiered storage
# is the other way round: minickpt writes every checkpoint durably to the fast disk first and
# mirrors it to the remote store in the background, on one machine or many.

# %% [markdown]
# ## 6. Common misconceptions
#
# **"With 8 devices, let every device save its own checkpoint, to be safe."** (The seed's.) Under
# data parallelism the replicas are identical (section 1a): one copy is the checkpoint, written by
# the primary; eight writers into one directory only race. Under sharding, "its own checkpoint" is
# a part of the model, and eight parts under one name leave one part (section 2b). Either way:
# one checkpoint, written collectively.
#
# **"Each host can save when it reaches the step; they will all get there."** Not at the same
# time, and perhaps not at the same step (section 2d). Without agreement and barriers, a crash
# between two hosts' writes leaves a checkpoint stitched from two moments, or one published
# without a slow host's shards (section 2c showed it on a smaller object). The same holds on
# restore: processes that each take their own `latest_step()` can restore two different steps
# (section 2e).
#
# **"Orbax uses file locks to stop processes from colliding."** (A seed's.) Its commit takes no
# lock: the primary writes `commit_success.txt` into the temporary directory and renames it
# (`AtomicRenameTemporaryPath.finalize` in `orbax/checkpoint/_src/path/atomicity.py`). What keeps
# processes apart is the protocol of this chapter — each piece has its writers, barriers separate
# the phases, one process commits. Locks do appear one level down: TensorStore's `file` key-value
# store, which writes Orbax's chunk files, locks each file it writes (the filesystem's locks,
# used "to safely allow concurrent access from multiple processes", in its documentation), so two
# writers of one key do not tear it. That protects a file, not a checkpoint: it neither makes the
# processes agree on a step nor waits for a slow one.
#
# **"A barrier without a time-out is fine: the processes will come."** A dead process never comes.
# minickpt bounds every barrier and names the missing process (section 2f). JAX's collectives have
# no time-out, which is why minickpt never waits on them; Orbax's blocking-phase barriers are such
# a collective by default (`sync_global_devices`; the flag `experimental_orbax_use_distributed_barrier`
# switches them to the coordination service), while its background barriers are the coordination
# service's `wait_at_barrier`, which does time out (`AsyncOptions.timeout_secs`, 1200 s). Behind
# both, JAX's heartbeats (100 s) detect a dead process and stop the job.
#
# **"A checkpoint saved on 64 hosts needs 64 hosts to restore."** It needs the bytes, not the
# hosts: every restoring device reads the region it needs from whatever pieces overlap it
# (section 4).

# %% [markdown]
# ## Summary
#
# - Data parallelism keeps bit-identical replicas ($\bar g$ is the same everywhere), so the
#   primary may save one copy and broadcast it on restore. Sharded state exists whole nowhere:
#   each process writes the pieces it owns — one replica each, the first in the sharding's order.
# - A collective save agrees on the step, then every process writes its shards and one process
#   publishes. Two rules govern the barriers between them (section 2c): a barrier before
#   publishing makes "published" mean "complete"; a failure handed in at the next barrier reaches
#   every process at once, while one raised alone looks like a dead process, and costs every other
#   the whole time-out. Every barrier has a time-out that names the missing process (section 2f).
# - Without the agreement, steps mix; without a barrier before publishing, an incomplete
#   checkpoint can be published (section 2c's index); "every process saves its own copy" loses a
#   sharded model and can tear a replicated one. Agree on the step to restore as well: processes can list different
#   newest steps while a commit lands.
# - Orbax has no step agreement (its barriers compare names, not steps), splits replicated arrays
#   over their replicas' processes, and compresses with zstd. Its `MultiprocessingOptions` move
#   the commit (`primary_host`), let a subset save (`active_processes`) and keep two managers'
#   barriers apart (`barrier_sync_key_prefix`).
# - Flax's `save_checkpoint_multiprocess` deletes old checkpoints *before* its save: a failed
#   save has already cost one. Orbax's experimental two-tier manager needs two replicas or more;
#   with one it is a plain manager of the persistent directory.
# - The barrel effect: $T_{\mathrm{save}} \approx \max_p T^{(p)}_{\mathrm{write}} + \dots$ on every
#   process; one slow process slows everyone, second for second.
# - A checkpoint of global boxes restores onto any mesh and any number of processes, values
#   identical. Orbax does the same with another layout.
# - The barrel effect has a cause minickpt itself creates: "first holder writes" hands every
#   replicated array to process 0; Orbax's replica-parallel saving spreads it.
#
# ## Lab 4
#
# In [lab 4](../labs/lab04_multihost/lab04_multihost.ipynb) you write the four decisions of this
# protocol and run them inside real multi-process saves: the step agreement (task 4.1), shard
# ownership (4.2), the commit protocol (4.3) and the restore onto another mesh (4.4).
