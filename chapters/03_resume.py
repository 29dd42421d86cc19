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
# <a href="https://colab.research.google.com/github/minickpt-course/checkpointing-in-jax/blob/main/chapters/03_resume.ipynb" target="_parent"><img src="https://colab.research.google.com/assets/colab-badge.svg" alt="Open In Colab"/></a>

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
# # Chapter 3 — Resume: back on the road
#
# The truck of chapter 1 went off the road. A new truck drives to the last depot, checks the
# load against the ledger — is everything there, is nothing broken? — and only then drives on,
# from that depot, not from the first town and not from the spot of the accident. If the load
# in the last depot turns out to be broken, it drives back to the depot before. A game does the
# same when you load a save: it checks the file, puts back your level, your inventory *and*
# your place on the map, and lets you play on from the save point.
#
# Resuming a training run is that, in four steps, each measured on your machine here:
#
# 1. **find and verify** the newest checkpoint, and **fall back** to the one before when it is
#    damaged;
# 2. **restore the whole state** and continue at step $t_{\text{ckpt}} + 1$ — bit for bit the
#    uninterrupted run on a CPU, and what to check instead on a GPU;
# 3. survive a **real crash**: a training process killed with `SIGKILL` several times (the
#    death of a process; chapter 2 covers what a power cut adds);
# 4. cope when the **model changed**: strict restores and migrations.

# %%
import copy
import errno
import glob
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's note that TensorFlow is absent

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax.training import train_state

import minickpt as mc
from minickpt import cli
from minickpt.demo import batch, fingerprint, make_state, train, train_step
from minickpt.faults import FaultyFileSystem
from minickpt.fs import FileSystem
from minickpt.labkit import flip_byte, tree_diff
from minickpt.labkit.claims import claim, verdict
from minickpt.restore import migrate, resume

devices = jax.devices()
print(f"JAX {jax.__version__} sees {len(devices)} {devices[0].platform.upper()} device(s): "
      f"{devices}")

WORK = Path("ch03-work").absolute()  # everything this notebook writes goes here
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir()

# %% [markdown]
# ## 1. The run, and its checkpoints
#
# The model is the course's small MLP (`minickpt.demo`): one hidden layer with dropout, trained
# with Adam on a regression task. The batch of step $t$ is a pure function of $t$ — the data
# loader's position is part of the state, and here it *is* the step (section 3b saves a real
# loader's position, and forgets it) — and dropout takes its masks from the RNG key, which is
# part of the state too. We train 40 steps and save every 10,
# keeping three checkpoints.

# %%
T_SAVE, KEEP = 10, 3
fresh, key0 = make_state(), jax.random.key(42)


def run_with_checkpoints(directory, stop, keep=KEEP):
    """Train from scratch to ``stop``, saving every T_SAVE steps; the loss of every step."""
    opts = mc.CheckpointManagerOptions(save_interval_steps=T_SAVE, max_to_keep=keep)
    with mc.CheckpointManager(directory, opts) as mngr:
        def save(step, state, rng, loss):
            mngr.save(step, {"state": state, "rng": rng}, metrics={"loss": loss})
        return train(fresh, key0, 0, stop, callback=save)


_, _, losses_40 = run_with_checkpoints(WORK / "run", 40)
print("steps on disk:", sorted(int(p.name.split("_")[1]) for p in (WORK / "run").glob("step_*")))
code = cli.main(["ls", str(WORK / "run"), "--deep"])  # exit code 0: every step valid
claim(code == 0 and sorted(int(p.name.split("_")[1]) for p in (WORK / "run").glob("step_*"))
      == [20, 30, 40], "three checkpoints, steps 20, 30 and 40, all valid")

# %% [markdown]
# ## 2. Find, verify, fall back
#
# *Find*: the newest checkpoint is the directory `step_<N>` with the largest $N$ — compared as
# numbers (`step_9` is older than `step_10`, though it sorts after it as text). Only committed
# names count: a save in progress lives under a temporary name (chapter 2).
#
# *Verify*: the step's `_CHECKPOINT_METADATA` must be there and intact (it carries its own
# checksum), it must list every item, each item's `manifest.json` must match the checksum the
# metadata recorded, must name every leaf, and the bytes of every leaf must match their CRC-32.
# `verify(step)` does all of it without restoring; a restore does it as it reads.
#
# *Fall back*: if the newest is damaged, the next older one is tried — and the warning says
# which step was skipped and why. We damage step 40 in three ways, each in a fresh copy of the
# run: one flipped byte in the data, a data file cut short, a missing manifest.

# %%
def damaged_copy(name, damage):
    """A copy of the run whose newest step (40) has been damaged by ``damage(step_dir)``."""
    run = WORK / name
    shutil.copytree(WORK / "run", run)
    damage(run / "step_40")
    return run


def flip(step_dir):
    flip_byte(glob.glob(str(step_dir / "state" / "data*.bin"))[0], 200)


def truncate(step_dir):
    path = glob.glob(str(step_dir / "state" / "data*.bin"))[0]
    os.truncate(path, os.path.getsize(path) // 2)


def no_manifest(step_dir):
    os.remove(step_dir / "state" / "manifest.json")


target = {"state": fresh, "rng": key0}
for name, damage in (("flipped-byte", flip), ("truncated", truncate),
                     ("no-manifest", no_manifest)):
    run = damaged_copy(name, damage)
    with mc.CheckpointManager(run, mc.CheckpointManagerOptions(read_only=True)) as mngr:
        report = mngr.verify(40)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = mngr.restore(target=target)
    print(f"{name:13s} verify(40).ok={report.ok}: {report.problems[0][:90]}...")
    print(f"{'':13s} restore() -> step {restored.step}; warning: "
          f"{str(caught[0].message)[:75]}...")
    claim(not report.ok and restored.step == 30 and "step 40" in str(caught[0].message)
          and (WORK / name / "step_40").exists(),
          f"{name}: verify(40) fails, restore() falls back to step 30 with a warning naming "
          "step 40, and the read-only manager leaves step 40 where it is")

# %% [markdown]
# Each damage is caught, named (the file, and for the flipped byte the leaf), and the run comes
# back at step 30: one interval of work lost, not the whole run. A *read-only* manager, as here,
# leaves the damaged step where it is. A writable manager (the one a resumed run uses) also
# moves it aside, to `step_40.minickpt-damaged-<hex>`: kept for a person to look at (and shown
# by `minickpt ls`), never counted as a checkpoint, so that the resumed run can save step 40
# again.
#
# Only *verified* damage is a reason to fall back. An I/O error (`EIO`) while reading says
# that the disk could not deliver the bytes, not that the bytes are wrong. On network storage it
# can be a passing fault; on a local disk it is usually persistent (a bad sector stays bad until
# it is remapped). Either way, falling back past it by itself would quietly throw an interval
# away and hide a failing disk, so minickpt raises it. First, one failed read:

# %%
data_40 = glob.glob(str(WORK / "run" / "step_40" / "state" / "data*.bin"))[0]
opened = []


def first_read_of_step_40(op, args):
    if op == "open" and str(args[0]) == data_40:
        opened.append(1)
    return op == "preadv" and len(opened) == 1


eio_once = FaultyFileSystem(0, ops=("open", "preadv"), when=first_read_of_step_40)
with mc.CheckpointManager(WORK / "run", mc.CheckpointManagerOptions(read_only=True),
                          fs=eio_once) as mngr:
    eio = None
    try:
        mngr.restore(target=target)
    except OSError as e:
        eio = e
        print(f"restore() raised {type(e).__name__}: {e} (no fallback)")
    again = mngr.restore(target=target).step
    print("right after, verify(40).ok =", mngr.verify(40).ok, "and restore() gives step", again)
claim(eio is not None and again == 40,
      "one failed read raises OSError (no fallback); the next restore reads step 40")

# %% [markdown]
# What the caller does with it is policy, and belongs in the training script: retry a *bounded*
# number of times with a pause (a passing fault clears), then stop with the error, and let a
# person decide. Restoring an older step past an unreadable one is then an explicit override —
# here a flag that names the step it gives up — not something a library does silently:

# %%
def restore_with_retries(mngr, target, tries=3, pause_s=0.05, skip_unreadable=False):
    """Restore the latest step; retry an OSError `tries` times; with `skip_unreadable` (an
    operator's explicit choice) go on to the next older step after the last try."""
    for step in sorted(mngr.all_steps(), reverse=True):
        for attempt in range(1, tries + 1):
            try:
                return mngr.restore(step, target=target)
            except OSError as e:
                print(f"  step {step}, try {attempt}/{tries}: {type(e).__name__}: {e}")
                time.sleep(pause_s)
        if not skip_unreadable:
            raise OSError(f"step {step} unreadable after {tries} tries; pass "
                          "skip_unreadable=True to restore an older step on purpose")
        warnings.warn(f"step {step} is unreadable: restoring an older step, as asked")
    raise OSError("no step readable")


class BadSector(FileSystem):
    """Every read of one file fails with EIO, the way a bad sector on a local disk does."""

    def __init__(self, path):
        super().__init__()
        self.path, self.fds = path, set()

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        if str(path) == self.path:
            self.fds.add(fd)
        return fd

    def preadv(self, fd, buffers, offset):
        if fd in self.fds:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)

    def close(self, fd):
        self.fds.discard(fd)
        return super().close(fd)


eio_always = BadSector(data_40)
with mc.CheckpointManager(WORK / "run", mc.CheckpointManagerOptions(read_only=True),
                          fs=eio_always) as mngr:
    stopped = None
    try:
        restore_with_retries(mngr, target)
    except OSError as e:
        stopped = e
        print("stopped:", e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overridden = restore_with_retries(mngr, target, skip_unreadable=True)
    print("with skip_unreadable=True: step", overridden.step, "|", caught[0].message)
claim(stopped is not None and overridden.step == 30,
      "a persistent EIO stops the restore after three tries; only the explicit override "
      "restores step 30")

# %% [markdown]
# **Why keep at least two checkpoints.** With `max_to_keep=1` there is nothing to fall back to:

# %%
run_with_checkpoints(WORK / "keep1", 40, keep=1)
flip(WORK / "keep1" / "step_40")
with mc.CheckpointManager(WORK / "keep1", mc.CheckpointManagerOptions(read_only=True)) as mngr:
    print("steps on disk with max_to_keep=1:", mngr.all_steps())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mngr.restore(target=target)
    except mc.CheckpointCorruptedError as e:
        print(f"restore() raised CheckpointCorruptedError: {str(e)[:110]}...")
    claim(mngr.all_steps() == [40], "with max_to_keep=1 only step 40 is on disk")

# %% [markdown]
# The same flipped byte that cost 10 steps with three checkpoints costs all 40 with one. Two
# adjacent checkpoints are the minimum; retention (chapter 2) deletes an old checkpoint only
# after the new one is durable, so there is never a moment with none.

# %% [markdown]
# ## 3. Restore the whole state, continue at $t_{\text{ckpt}} + 1$
#
# The checkpoint of step $t_{\text{ckpt}}$ holds the state *after* that step. The next step to
# compute is therefore
#
# $$t' = t_{\text{ckpt}} + 1,\qquad \theta_{t'} = \theta_{t'-1} - \eta\,
#   \frac{\hat m_{t'}}{\sqrt{\hat v_{t'}}+\epsilon},\quad
#   \hat m_{t'}, \hat v_{t'} \text{ computed from } m_{t_\text{ckpt}}, v_{t_\text{ckpt}}
#   \text{ and the gradient on the batch of step } t'.$$
#
# Everything in that update must be the uninterrupted run's: $\theta$, both of Adam's moments,
# its step count (bias correction), the batch of step $t'$ (the data order), and the dropout mask
# (the key). `minickpt.restore.resume(mngr, state, rng)` — task 3.3 of the lab — returns the
# restored state and key and $t'$, or the fresh ones and step 1 when nothing is saved; it
# restores *into* the fresh state and key, so shapes, dtypes and device placement are checked.
#
# The experiment: an uninterrupted run of 60 steps; a run that "crashes" after step 37 (last
# checkpoint: 30) and resumes; and the same resume with a new RNG key instead of the saved one.

# %%
T = 60
ref_state, ref_rng, ref_losses = train(fresh, key0, 0, T)

_, _, _ = run_with_checkpoints(WORK / "crash", 37)  # steps 31-37 are lost in the "crash"
with mc.CheckpointManager(WORK / "crash") as mngr:
    state, rng, first = resume(mngr, fresh, key0)
print(f"resumed: first step to compute {first} (t_ckpt = {first - 1}); "
      f"state.step = {int(state.step)}")
res_state, res_rng, res_losses = train(state, rng, first - 1, T)
_, _, nokey_losses = train(state, jax.random.key(first - 1), first - 1, T)  # a new key

print("every leaf of the resumed run vs the uninterrupted one:",
      tree_diff((res_state, res_rng), (ref_state, ref_rng)) or "bit for bit identical")
print("fingerprints:", fingerprint((res_state, res_rng)), fingerprint((ref_state, ref_rng)))
print("loss history of steps 31-60 identical:", res_losses == ref_losses[first - 1:])
parted = next((t for t, (a, b) in enumerate(zip(nokey_losses, ref_losses[first - 1:]), first)
               if a != b), None)
print(f"without the saved key the losses part at step {parted}")
claim(first == 31 and int(state.step) == 30, "the resume continues at step 31 from state.step 30")
identical = tree_diff((res_state, res_rng), (ref_state, ref_rng)) is None \
    and res_losses == ref_losses[first - 1:]
if devices[0].platform == "cpu":
    claim(identical, "on a CPU the resumed run is the uninterrupted run, bit for bit")
else:
    verdict(identical, "the resumed run is the uninterrupted run, bit for bit",
            otherwise="this accelerator reduced in another order: see section 4")
claim(parted == first, "without the saved key the losses part at the first resumed step",
      seen=parted)

# %%
steps = np.arange(first, T + 1)
fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
ax[0].plot(np.arange(1, T + 1), ref_losses, "k-", lw=2, label="uninterrupted")
ax[0].plot(steps, res_losses, "C0--", label="resumed from step 30")
ax[0].plot(steps, nokey_losses, "C3:", lw=2, label="resumed with a new RNG key")
ax[0].axvline(first - 1, color="grey", lw=0.8)
ax[0].set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
ax[0].legend()
ref_tail = np.array(ref_losses[first - 1:])
gap_res = np.abs(np.array(res_losses) - ref_tail) / ref_tail
gap_nokey = np.abs(np.array(nokey_losses) - ref_tail) / ref_tail
ax[1].semilogy(steps, np.maximum(gap_res, 1e-12), "C0o-", ms=3, label="resumed")
ax[1].semilogy(steps, np.maximum(gap_nokey, 1e-12), "C3s-", ms=3, label="new RNG key")
ax[1].set(xlabel="step", ylabel="|loss − uninterrupted| / loss  (floor 1e-12)",
          title="distance from the uninterrupted run")
ax[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure 1.* Left: the loss of the uninterrupted run, of the run resumed from step 30, and of
# the same resume with a new RNG key. Right: how far each resumed loss is from the
# uninterrupted one, relative (points at the $10^{-12}$ floor are identical). Read off the
# printout above whether the resumed run is identical on your device (on a CPU the claim above
# checks it); the run
# with a new key leaves the uninterrupted run at the step printed above — its dropout masks are
# different from the first resumed step on. It still trains (the loss keeps its scale), which is
# exactly why a forgotten key goes unnoticed without a comparison like this one.

# %% [markdown]
# ### 3b. The data loader's position
#
# Here the batch of step $t$ is a function of $t$, so restoring the step restores the data order.
# A real loader is not like that: it shuffles the data set anew every epoch and walks through
# it, and where it stands is state of its own — the shuffle's seed, the epoch, the position in
# the epoch. Below, a small numpy loader over 192 examples (6 batches of 32 per epoch) that
# keeps those three integers and can hand them out (`state()`) and take them back (`load()`).
# We train 30 steps on its batches, uninterrupted; then again with a checkpoint at step 15 that
# holds the train state, the key *and* the loader's state, a crash after step 17, and two
# resumes from step 15: one that loads the loader's state, one that builds a fresh loader.

# %%
class ShuffledLoader:
    """Batches of a fixed data set, reshuffled every epoch. Its position is three integers —
    the seed, the epoch and the position in the epoch — which `state()` and `load()` carry."""

    def __init__(self, x, y, batch_size=32, seed=0):
        self.x, self.y, self.bs = x, y, batch_size
        self.seed, self.epoch, self.pos = seed, 0, 0

    def state(self):
        return {"seed": np.int64(self.seed), "epoch": np.int64(self.epoch),
                "pos": np.int64(self.pos)}

    def load(self, saved):
        self.seed, self.epoch, self.pos = (int(saved[k]) for k in ("seed", "epoch", "pos"))

    def next(self):
        """The next batch, and the indices of its examples."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))
        idx = order[self.pos:self.pos + self.bs]
        self.pos += self.bs
        if self.pos >= len(self.x):  # the epoch is over: the next one reshuffles
            self.epoch, self.pos = self.epoch + 1, 0
        return (self.x[idx], self.y[idx]), idx


data_rng = np.random.default_rng(3)
X = data_rng.normal(size=(192, 8)).astype(np.float32)
Y = (np.sin(X @ np.linspace(-1, 1, 8))[:, None] + 0.1 * np.cos(3 * X[:, :1])).astype(np.float32)


def run_loader(state, rng, loader, first, last, mngr=None):
    """Steps first..last on the loader's batches (a checkpoint at step 15 when given a manager);
    returns the state, the key and the indices each step saw."""
    seen = {}
    for step in range(first, last + 1):
        (x, y), seen[step] = loader.next()
        state, rng, _ = train_step(state, rng, x, y)
        if mngr is not None and step == 15:
            mngr.save(step, {"state": state, "rng": rng, "loader": loader.state()})
    return state, rng, seen


N_STEPS = 30
ref_run = run_loader(fresh, key0, ShuffledLoader(X, Y), 1, N_STEPS)
with mc.CheckpointManager(WORK / "loader") as mngr:
    run_loader(fresh, key0, ShuffledLoader(X, Y), 1, 17, mngr)  # crash after step 17
    saved = mngr.restore(15, target={"state": fresh, "rng": key0,
                                     "loader": ShuffledLoader(X, Y).state()})
print("the loader's state in the checkpoint of step 15:",
      {k: int(v) for k, v in saved["loader"].items()}, "(epoch 2, 3 batches into it)")
loaded = ShuffledLoader(X, Y)
loaded.load(saved["loader"])
resumes = {"resumed with the loader's state": loaded, "resumed with a fresh loader":
           ShuffledLoader(X, Y)}
outcome = {}
for name, loader in resumes.items():
    st, r, seen = run_loader(saved["state"], saved["rng"], loader, 16, N_STEPS)
    same = sum(np.array_equal(seen[t], ref_run[2][t]) for t in range(16, N_STEPS + 1))
    uses = np.bincount(np.concatenate([ref_run[2][t] for t in range(1, 16)]
                                      + [seen[t] for t in range(16, N_STEPS + 1)]),
                       minlength=len(X))  # how often each example was used over the 30 steps
    outcome[name] = (same, int(uses.min()), int(uses.max()),
                     fingerprint((st, r)) == fingerprint(ref_run[:2]))
    print(f"{name:32s} batches 16-30 equal to the uninterrupted run's: {same:2d} of 15; "
          f"each example used {uses.min()} to {uses.max()} times; final state identical: "
          f"{outcome[name][3]}")
claim(outcome["resumed with the loader's state"][:3] == (15, 5, 5),
      "with the loader's state, all 15 resumed batches are the uninterrupted run's, and every "
      "example is used 5 times in 30 steps, as uninterrupted", seen=outcome)
claim(outcome["resumed with a fresh loader"][0] == 0
      and outcome["resumed with a fresh loader"][1:3] != (5, 5),
      "with a fresh loader, none of the 15 resumed batches is the uninterrupted run's, and "
      "some examples are used more often than others", seen=outcome)
if devices[0].platform == "cpu":
    claim(outcome["resumed with the loader's state"][3], "on a CPU the resume with the loader's "
          "state ends bit for bit where the uninterrupted run ends")

# %% [markdown]
# Read the two lines. With the loader's state, the resumed run reads the very batches of the
# uninterrupted run and ends where it ends. With a fresh loader it starts epoch 0 again: none of
# the 15 resumed batches is the one the uninterrupted run read, the epoch the crash cut is
# never finished, and over the 30 steps some examples were used more often than others (the
# range printed above; uninterrupted, every example is used exactly 5 times). Nothing fails and
# the loss keeps its scale: it is simply another run, trained on another mix of the data. The
# loader's state is three integers; save it in the same checkpoint as the train state, so that
# the two can never come from different steps. (A loader that prefetches must save the position
# of the batch the *model* consumed last, not of the batch its background thread read last.)
#
# ### 3c. The same with Flax NNX
#
# Flax's newer API, NNX, keeps parameters inside the module objects instead of in a separate
# tree; `nnx.state(obj)` takes the state out as a pytree, `nnx.update(obj, state)` puts one
# back (`nnx.split` gives the graph and the state at once). That state is a pytree like any
# other, so the same minickpt save and restore work on it: the course's MLP written with NNX,
# its Adam optimizer (`nnx.Optimizer`), trained 10 steps, saved, and restored *into* a new
# model and optimizer built with other initial values — then both pairs train 5 more steps.
# The code is Flax 0.11's optimizer API (`nnx.Optimizer(model, tx, wrt=nnx.Param)`,
# `optimizer.update(model, grads)`); Flax 0.10's `update(grads)` raises a `TypeError` on it,
# so the course asks for `flax>=0.11`.

# %%
from flax import nnx


class NNXMLP(nnx.Module):
    """The course's MLP in Flax NNX: the module object holds its parameters and its RNG."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


@nnx.jit
def nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def build(seed):
    model = NNXMLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


model, optimizer = build(0)
for step in range(1, 11):
    nnx_step(model, optimizer, *batch(step))
with mc.CheckpointManager(WORK / "nnx") as mngr:
    mngr.save(10, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    model2, optimizer2 = build(1)  # a new program: other initial values
    got = mngr.restore(10, target={"model": nnx.state(model2),
                                   "optimizer": nnx.state(optimizer2)})
nnx.update(model2, got["model"])
nnx.update(optimizer2, got["optimizer"])
print("saved: the model's", sorted(nnx.state(model).keys()), "(with the dropout's RNG) and the "
      "optimizer's", sorted(nnx.state(optimizer).keys()))
more = [[float(nnx_step(m, o, *batch(step))) for step in range(11, 16)]
        for m, o in ((model, optimizer), (model2, optimizer2))]
print("losses of steps 11-15, the objects that trained:  ", np.round(more[0], 6))
print("losses of steps 11-15, restored into new objects: ", np.round(more[1], 6))
if devices[0].platform == "cpu":
    claim(more[0] == more[1], "on a CPU the NNX model restored into new objects trains on bit "
          "for bit like the one that was saved")
else:
    verdict(more[0] == more[1], "the NNX model restored into new objects trains on bit for bit "
            "like the one that was saved", otherwise="this accelerator reduced in another order: "
            "see section 4")

# %% [markdown]
# The losses agree (on a CPU bit for bit): parameters, both Adam moments, the optimizer's step
# *and* the dropout's RNG state, which NNX keeps inside the `Dropout` module (`nnx.state(model)`
# includes it), all came back. Nothing in minickpt knows about NNX: its state is a pytree of
# arrays, as a Linen `TrainState` is — restored into a target, leaf by leaf, shapes and dtypes
# checked. Orbax works the same way (`StandardSave(nnx.state(model))`, restored into the state
# of `nnx.eval_shape(...)`, which spends no memory), as Flax's checkpointing guide shows.

# %% [markdown]
# ## 4. Why a GPU may differ in the last digits — and what to check instead
#
# Floating-point addition is not associative: every sum is rounded to the nearest float32, and
# where the rounding happens depends on the order. In float32, numbers near $10^8$ are 8 apart,
# so:

# %%
a, b, c = np.float32(1e8), np.float32(-1e8), np.float32(1.0)
print(f"(a + b) + c = {(a + b) + c}    a + (b + c) = {a + (b + c)}")

x = jax.random.normal(jax.random.key(0), (1 << 20,), jnp.float32) * 100 + 1
perm = jax.random.permutation(jax.random.key(1), x.shape[0])
sums = {
    "jnp.sum(x)": jnp.sum(x),
    "jnp.sum(x[perm])": jnp.sum(x[perm]),
    "rows, then total": jnp.sum(jnp.sum(x.reshape(1024, 1024), axis=1)),
    "sequential (np.cumsum)": np.cumsum(np.asarray(x))[-1],
}
exact = np.sum(np.asarray(x, np.float64))
for name, s in sums.items():
    print(f"{name:24s} {float(s):.9g}   relative to the float64 sum: "
          f"{(float(s) - exact) / exact:+.2e}")
distinct = len({float(s) for s in sums.values()})
print(f"on {devices[0].platform.upper()}: the same 2^20 numbers give "
      f"{distinct} different float32 sums in 4 orders")
print("jnp.sum of the permuted array equals jnp.sum(x):",
      float(sums["jnp.sum(x[perm])"]) == float(sums["jnp.sum(x)"]))
claim(float((a + b) + c) == 1.0 and float(a + (b + c)) == 0.0,
      "(a + b) + c = 1 but a + (b + c) = 0 in float32")
errors = {k: abs(float(v) - exact) for k, v in sums.items()}
_ = verdict(distinct >= 2 and max(errors, key=errors.get) == "sequential (np.cumsum)",
            "other orders give other sums, and the sequential sum is the furthest from float64",
            otherwise="this device's reductions landed on fewer distinct values",
            seen=f"{distinct} distinct")

# %% [markdown]
# The same numbers, summed in another order, can give sums that differ in their last digits:
# read how many distinct sums your device printed. Not every reordering shows it: on the CPU
# this chapter was written on, `jnp.sum` of the *permuted* array printed exactly the same value
# as `jnp.sum(x)` (both within one float32 step of the float64 sum, so both rounded to the same
# number), while summing rows first and the sequential sum each gave another value. The
# sequential sum — a million roundings of a growing total — is the furthest from the float64
# value; tree-shaped reductions, which is what `jnp.sum` does, stay within a few float32 steps
# of it. A CPU runs the same program in
# the same order every time, so a resumed run repeats the uninterrupted one exactly. A GPU's
# reductions (matrix products, `sum`, and above all atomics in the backward pass) may split the
# work differently from one run to the next; a resumed run is then a *slightly different*
# run, and its loss drifts apart in the last digits even though every byte of the state was
# restored. A restarted process also re-runs XLA's *autotuning*, which times several kernels for
# each matrix product and convolution and keeps the fastest: on a busy GPU the winner can change
# from one process to the next, and with it the order of the additions. Section 5b shows the
# flags that make most GPU resumes bit-reproducible.
#
# So on an accelerator, check what a broken resume breaks and rounding does not:
#
# - **step continuity**: the first step after the restart is $t_{\text{ckpt}} + 1$, the steps run
#   on without a gap or a repeat, and the restored state's own step counter is $t_{\text{ckpt}}$;
# - **loss scale**: the resumed loss stays on the uninterrupted run's scale — within a few per
#   cent, not equal. A wrong data position or a stale checkpoint shows up as a loss from another
#   part of the curve. A forgotten optimizer state *can* make it jump — chapter 1 measured jumps
#   of tens to hundreds of times — but only where a fresh Adam's full-size first steps do
#   damage; whether it shows here is what the table below measures.
#
# The check, small enough to reuse:

# %%
def check_resume(ref_losses, steps_after, losses_after, t_ckpt, state_step, rel=0.05):
    """Step continuity and loss scale of a resumed run against a reference loss curve
    (``ref_losses[t - 1]`` is the loss of step t). Returns a list of problems (empty: fine)."""
    problems = []
    if int(state_step) != t_ckpt:
        problems.append(f"the restored state's step counter is {int(state_step)}, not {t_ckpt}")
    if list(steps_after) != list(range(t_ckpt + 1, t_ckpt + 1 + len(steps_after))):
        problems.append(f"steps after the restart are {list(steps_after)[:3]}..., expected "
                        f"{t_ckpt + 1}, {t_ckpt + 2}, ...")
    ratio = np.mean(losses_after) / np.mean([ref_losses[t - 1] for t in steps_after])
    if abs(ratio - 1) > rel:  # the mean over the steps: one step's loss is noisy (dropout)
        problems.append(f"the mean loss is {ratio:.3f} x the reference's: another scale")
    return problems, ratio


cold = state.replace(opt_state=state.tx.init(state.params))  # Adam forgotten
_, _, cold_losses = train(cold, rng, first - 1, T)
_, _, scratch_losses = train(fresh, key0, 0, T - first + 1)  # "resumed" from nothing at all
cases = {"resumed run": (res_losses, state.step), "with a new RNG key": (nokey_losses, state.step),
         "without Adam's moments": (cold_losses, state.step),
         "from scratch, numbered 31..": (scratch_losses, fresh.step),
         "state.step 21, t_ckpt 30": (res_losses, first - 10)}
found = {}
for name, (losses, counter) in cases.items():
    problems, ratio = check_resume(ref_losses, steps, losses, first - 1, counter)
    found[name] = (problems, ratio)
    print(f"{name:28s} loss ratio {ratio:.3f}: {'; '.join(problems) or 'OK'}")
claim(not found["resumed run"][0], "the resumed run passes the check")
claim(any("scale" in p for p in found["from scratch, numbered 31.."][0])
      and any("counter" in p for p in found["state.step 21, t_ckpt 30"][0]),
      "the run from scratch is caught by the loss scale, the wrong step counter by continuity")
subtle = {k: round(found[k][1], 3) for k in ("with a new RNG key", "without Adam's moments")}
_ = verdict(all(not found[k][0] for k in subtle), "the new key and the forgotten Adam state both "
            "pass the loss-scale check here", seen=subtle,
            otherwise="on this machine one of them moved the loss by more than 5%: the check caught "
                      "it this time, which it cannot promise")

# %% [markdown]
# Read the five lines. The resumed run passes, as it must. A run restarted from scratch while
# counting on from step 31 is caught by the loss scale, and a state whose own step counter is
# not the checkpoint's step (the seeds' bug of section 7) by step continuity. The run with a new
# RNG key and the run without Adam's moments are the subtle ones: look at their ratios. On the
# CPU this chapter was checked on both passed (ratios 0.998 and 1.026): a forgotten optimizer
# state did *not* make this small model's loss jump, unlike chapter 1's, and the check cannot
# tell either mistake from rounding. That is why bit-identity on a CPU is the stronger test,
# worth running wherever
# you can (the lab runs it); step continuity and loss scale are a net for gross mistakes on an
# accelerator, not a proof.

# %% [markdown]
# ## 5. A real crash drill
#
# Killing a Python function is not a crash. Here a training *script* runs as a separate process;
# the notebook kills it with `SIGKILL` (no handler runs, no `finally`, no flush of Python's
# buffers — what an out-of-memory kill does) at moments drawn from the operating system's
# randomness, restarts it, and lets it resume. What this drill does *not* test: a killed
# process leaves the kernel's page cache intact, so every byte it wrote survives whether or not
# it was fsynced. A lost machine (a power cut, a kernel panic, a VM reset) loses what was not
# made durable; that half of crash safety is chapter 2's crash model, which counts the states a
# power cut can leave at every call of a save. The script is the whole of what a training
# program needs:

# %%
TRAIN_PY = '''
import sys, time
import jax
import minickpt as mc
from minickpt.demo import batch, fingerprint, make_state, train_step
from minickpt.restore import resume

ckpt_dir, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opts = mc.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=2)
with mc.CheckpointManager(ckpt_dir, opts) as mngr:
    state, rng, first = resume(mngr, make_state(), jax.random.key(42))
    print("resumed", first - 1, flush=True)
    for step in range(first, total + 1):
        state, rng, loss = train_step(state, rng, *batch(step))
        print("step", step, float(loss), flush=True)
        if mngr.save(step, {"state": state, "rng": rng}):
            print("saved", step, flush=True)
        time.sleep(0.03)  # stands for a longer step
print("final", fingerprint((state, rng)), flush=True)
'''
_ = (WORK / "train.py").write_text(TRAIN_PY)

# %%
from minickpt.demo import helper_device
from minickpt.launch import helper_env

TOTAL, EVERY, KILLS = 90, 10, 3
drill_dir = WORK / "drill"
# The training processes run on the CPU (JAX_PLATFORMS=cpu, set by helper_env): on a GPU or
# TPU this notebook already holds the accelerator, and a TPU lets only one process open it.
env = helper_env(JAX_COMPILATION_CACHE_DIR=str(WORK / "jax-cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
print(f"the training script runs on the CPU (JAX_PLATFORMS={env['JAX_PLATFORMS']}); this "
      f"notebook runs on {devices[0].platform.upper()}")
chance = random.SystemRandom()  # the kill moments: not chosen by the notebook
events = []  # (time since the drill began, kind, step, loss)
t_begin = time.monotonic()
stderr_file = WORK / "train-stderr.txt"  # what the script says when it fails: shown below


def start():
    with open(stderr_file, "a") as err:
        return subprocess.Popen([sys.executable, str(WORK / "train.py"), str(drill_dir),
                                 str(TOTAL), str(EVERY)], stdout=subprocess.PIPE, text=True,
                                stderr=err, env=env)


def read(proc, until=None):
    """Read the script's lines into ``events``; stop after a line for which ``until`` is true.
    A script that ends without that line failed: raise with the end of its stderr."""
    for line in proc.stdout:
        kind, *rest = line.split()
        step = int(rest[0]) if kind != "final" else None
        loss = float(rest[1]) if kind == "step" else None
        events.append((time.monotonic() - t_begin, kind, step if step is not None else rest[0],
                       loss))
        if until is not None and until(kind):
            return
    if until is not None and proc.wait() != -signal.SIGKILL:
        raise RuntimeError(f"the training script exited with {proc.returncode} before it "
                           f"printed what the drill waits for; its stderr ends with:\n"
                           f"{stderr_file.read_text()[-3000:]}")


kills = []
proc = start()
for _ in range(KILLS):
    read(proc, until=lambda kind: kind == "step")  # running (again)
    time.sleep(chance.uniform(0.2, 0.9))            # ... for a while nobody chose
    proc.send_signal(signal.SIGKILL)
    t_kill = time.monotonic() - t_begin
    read(proc)                                     # what it printed before it died
    exit_code = proc.wait()
    last_step = max(e[2] for e in events if e[1] == "step")
    proc = start()
    read(proc, until=lambda kind: kind == "resumed")
    resumed_at = time.monotonic() - t_begin
    resumed_from = events[-1][2]
    read(proc, until=lambda kind: kind == "step")
    kills.append({"killed after step": last_step, "exit code": exit_code,
                  "resumed from": resumed_from, "steps lost": last_step - resumed_from,
                  "restore (s)": resumed_at - t_kill,
                  "recover (s)": events[-1][0] - t_kill, "t_kill": t_kill})
read(proc)
if proc.wait() != 0:
    raise RuntimeError(f"the last training run failed (exit {proc.returncode}); its stderr ends "
                       f"with:\n{stderr_file.read_text()[-3000:]}")
final = next(e[2] for e in events if e[1] == "final")
print(f"{'kill':>4}  " + "  ".join(f"{k:>17s}" for k in list(kills[0])[:-1]))
for i, row in enumerate(kills, 1):
    print(f"{i:>4}  " + "  ".join(f"{v:>17.2f}" if isinstance(v, float) else f"{v:>17}"
                                 for v in list(row.values())[:-1]))
cpu = helper_device()  # the uninterrupted run on the script's platform, the CPU: same bits
with jax.default_device(cpu):  # from a state initialised there too, as the script does: an
    # initialisation on a TPU rounds differently, and moving its result would not undo that
    uninterrupted = fingerprint(train(make_state(), jax.random.key(42), 0, TOTAL)[:2])
print(f"final fingerprint {final}; uninterrupted run (on the CPU too) {uninterrupted}")
claim(all(r["exit code"] == -signal.SIGKILL for r in kills), "each process died of SIGKILL")
claim(all(r["resumed from"] % EVERY == 0 or r["resumed from"] == 1 for r in kills)
      and all(0 <= r["steps lost"] <= EVERY for r in kills),
      f"each restart resumed from a committed checkpoint (a multiple of {EVERY}, or step 1) "
      f"and lost at most {EVERY} steps", seen=[(r["resumed from"], r["steps lost"]) for r in kills])
claim(final == uninterrupted, "on a CPU (where the script runs) the killed and restarted run "
      "ends bit for bit where the uninterrupted run ends")

# %% [markdown]
# Each row is one kill: the last step the killed process had printed, the step it resumed from
# (the newest committed checkpoint: a multiple of 10, or step 1, which `should_save` saves
# first because nothing is saved yet; a kill just after a multiple of 10 was printed may
# land before that save committed), the steps computed twice, and the
# time from the kill until the restarted process had restored (`restore`) and had computed its
# first new step (`recover`: starting Python, importing JAX, compiling — the compilation cache
# in `ch03-work/jax-cache` shortens the second and later starts — and restoring); the times are
# this machine's and vary from run to run. The script and the uninterrupted run it is compared
# with both compute on the CPU, even where this notebook holds a GPU or TPU, so the two
# fingerprints are equal (checked above): three crashes, and the run ends bit for bit where the
# uninterrupted one ends. (Both start from a state *initialised* on the CPU: a TPU rounds an
# initialisation differently, and a state moved to the CPU afterwards keeps those bits.) For a
# training run on the GPU itself, see 5b.
#
# `minickpt.production.drill` is the same experiment made into a tool (random kills *during*
# saves too, a table, a JSON report): `python -m minickpt.production.drill --kills 5`;
# chapter 6 uses it.

# %%
steps_seen = [(e[2], e[3]) for e in events if e[1] == "step"]
fig, ax = plt.subplots(figsize=(11, 3.8))
ax.plot([s for s, _ in steps_seen], [v for _, v in steps_seen], ".", color="C0", ms=4,
        label="loss of each computed step (repeats after a kill)")
ax.plot(np.arange(1, TOTAL + 1), train(fresh, key0, 0, TOTAL)[2], "k-", lw=0.8,
        label="uninterrupted run")
saved = sorted({e[2] for e in events if e[1] == "saved"})
ax.vlines(saved, 0, 1, transform=ax.get_xaxis_transform(), colors="C2", lw=0.6,
          label="checkpoint saved")
for i, row in enumerate(kills):
    ax.axvline(row["killed after step"], color="C3", lw=1.5,
               label="SIGKILL" if i == 0 else None)
    ax.annotate("", xy=(row["resumed from"], 0.9), xytext=(row["killed after step"], 0.9),
                xycoords=("data", "axes fraction"),
                arrowprops={"arrowstyle": "->", "color": "C3"})
ax.set(xlabel="step", ylabel="training loss", yscale="log",
       title="a training process killed with SIGKILL and restarted")
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure 2.* The loss of every step the script computed, over the uninterrupted run's curve;
# green lines are committed checkpoints, red lines the kills, and each arrow goes back from the
# kill to the checkpoint the restart resumed from. The steps between the arrow's ends were
# computed twice: that is the work a crash costs, at most one interval when the kill misses a
# save.

# %% [markdown]
# ### 5b. Bit-reproducible resumes on a GPU
#
# A resumed GPU run differs from the uninterrupted one for two reasons: kernels that add in a
# different order each run (atomics in scatter and in some backward passes), and autotuning,
# which the new process runs again and which may choose other kernels. XLA has a flag for each:
# `--xla_gpu_deterministic_ops=true` replaces the non-deterministic kernels by deterministic ones
# (at some cost in speed), and `--xla_gpu_autotune_level=0` turns autotuning off, so that
# every process picks the same kernels. With both, most GPU resumes are bit for bit the
# uninterrupted run. The flags must be in `XLA_FLAGS` before the process initialises its GPU,
# so the cell runs the script of section 5 in fresh processes: once uninterrupted to step 40,
# once to step 20 and resumed to 40 — with and without the flags. It needs a GPU.

# %%
def fingerprint_of(directory, total, flags):
    # the point here is the GPU: the script runs on it (JAX_PLATFORMS=cuda) and allocates
    # only what it needs, beside this notebook (a GPU, unlike a TPU, lets several processes in)
    out = subprocess.run([sys.executable, str(WORK / "train.py"), str(directory), str(total),
                          "10"], capture_output=True, text=True, timeout=300,
                         env=dict(env, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                                  XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + flags)))
    if out.returncode != 0:
        raise RuntimeError(f"the training script failed (exit {out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return out.stdout.split()[-1]


if devices[0].platform != "gpu":
    print(f"skipped: this cell needs a GPU and JAX runs on {devices[0].platform.upper()} here "
          "(a CPU is bit-reproducible without any flag: section 3)")
else:
    for label, flags in (("default flags", ""), ("deterministic ops, no autotuning",
                         " --xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0")):
        tag = "det" if flags else "default"
        whole = fingerprint_of(WORK / f"gpu-{tag}-whole", 40, flags)
        fingerprint_of(WORK / f"gpu-{tag}-resumed", 20, flags)
        resumed = fingerprint_of(WORK / f"gpu-{tag}-resumed", 40, flags)
        print(f"{label:34s} uninterrupted {whole}  resumed {resumed}  identical: "
              f"{whole == resumed}")
        if flags:
            verdict(whole == resumed, "with deterministic ops and no autotuning the resumed "
                    "GPU run is bit for bit the uninterrupted one", otherwise="some kernel of "
                    "this model is still not reproducible on this GPU: compare with check_resume")

# %% [markdown]
# Read the two lines on a GPU: without the flags the small MLP here may well resume bit for bit
# too (it has few reductions that use atomics); the flags are what makes that a property you
# can rely on rather than luck. They cost speed: measure it before leaving them on for a long
# run.

# %% [markdown]
# ## 6. When the model changes: strict restores and migration
#
# A restore *into a target* compares the checkpoint with the target leaf by leaf before reading
# a byte, and reports **every** difference at once: a missing leaf, an unexpected one, a shape, a
# dtype. One run, one error, the whole list — fixing one difference per run is slow and painful.
# Here the model changed in three ways at once: its hidden layer `Dense_0` grew from 32 to 64
# units, a residual `adapter` layer was added, and the output layer `Dense_1` was renamed
# `head`:

# %%
class NewMLP(nn.Module):
    """The course's MLP, grown: a wider hidden layer, a residual adapter, the output renamed."""
    hidden: int = 64

    @nn.compact
    def __call__(self, x, train=True):
        h = nn.relu(nn.Dense(self.hidden)(x))  # still Dense_0, now 64 wide
        h = h + nn.Dense(self.hidden, name="adapter", kernel_init=nn.initializers.zeros)(h)
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(1, name="head")(h)  # was Dense_1


def new_state(hidden=64, dtype=jnp.float32):
    model = NewMLP(hidden)
    params = model.init(jax.random.key(1), jnp.ones((1, 8)), train=False)
    params = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-2))


old_model_run = WORK / "run"  # section 1's run; its step 30 and 40 are intact there
strict, text = None, []
with mc.CheckpointManager(old_model_run) as mngr:
    try:
        mngr.restore(target={"state": new_state()})
    except mc.StructureMismatchError as e:
        strict = e
        text = str(e).splitlines()
        print("\n".join(text[:9]), f"\n  ... {len(text) - 10} more lines ...\n", text[-1])
kinds = [line.split(": ", 1)[1].split(" (")[0] for line in text[1:-1]]
print({kind: kinds.count(kind) for kind in sorted(set(kinds))})
claim(strict is not None and kinds.count("shape differs") == 6
      and kinds.count("in the target but not in the checkpoint") == 12
      and kinds.count("in the checkpoint but not in the target") == 6,
      "one error lists all 24 differences: 6 shapes (Dense_0's kernel and bias, in the "
      "parameters and both Adam moments), 12 leaves missing (adapter, head), 6 unexpected "
      "(Dense_1)", seen=kinds)

# %% [markdown]
# Sometimes taking only some leaves is the point — evaluation needs the parameters and no
# optimizer. Then say so: `partial=True` restores the target's leaves and ignores the rest.

# %%
with mc.CheckpointManager(old_model_run) as mngr:
    params_only = mngr.restore(target={"state": {"params": fresh.params}}, partial=True)
print("partial restore:", list(params_only["state"]), "— step", params_only.step)

# %% [markdown]
# **Migration.** The new model should keep what the old one learned. `minickpt.restore.migrate`
# (task 3.4) maps the old tree onto the new structure with rename rules — for *every* part of
# the state, since Adam's moments carry the layer names too — fills what is new from the new
# model's initial values, and reports what it renamed, filled fresh, dropped and converted.
# A rename cannot change a shape, though. Renaming `Dense_1` to `head` alone still leaves 9
# shape differences, and `migrate` refuses them:

# %%
with mc.CheckpointManager(old_model_run) as mngr:
    raw = mngr.restore()  # no target: nested dicts of numpy arrays, as saved
print("the old checkpoint, step", raw.step, ":", sorted(raw["state"]["params"]["params"]))
rules = {"(.*)/Dense_1": r"\1/head"}
refused = None
try:
    migrate(raw["state"], new_state(), rename=rules)
except mc.StructureMismatchError as e:
    refused = e
    print("\n".join(str(e).splitlines()[:4]), "\n  ...")
claim(refused is not None and str(refused).count("shape differs") == 9,
      "migrate with the rename alone refuses 9 shape differences (Dense_0's kernel and bias, "
      "head's kernel; each in the parameters and both moments)", seen=refused)

# %% [markdown]
# Widening a layer is a decision about values that no rule can take for you, so it is a step of
# your own, before `migrate`: put each old array into the corner of the new shape, and choose
# what fills the rest. The choice here keeps the new model's output exactly the old one's. The
# 32 new hidden units get fresh incoming weights (the new model's initial values, columns 32–63
# of `Dense_0`'s kernel) but **zero outgoing weights** (rows 32–63 of `head`'s kernel), so at
# first they add nothing to the output. Their Adam moments start at zero, as a fresh Adam's do.
# The new `adapter` starts at zero too (its initial value), so at first it adds nothing either.
# They still learn: the gradient of an outgoing weight is the unit's activation times the
# output's error, and the activation is not zero.

# %%
fresh_new = new_state()


def grow(old, shape, fill=None):
    """``old`` in the leading corner of an array of ``shape``; the rest from ``fill`` (zeros)."""
    out = np.zeros(shape, old.dtype) if fill is None else np.array(fill, old.dtype)
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


grown = copy.deepcopy(raw["state"])
adam = grown["opt_state"][0]
for layers, fill in ((grown["params"]["params"], fresh_new.params["params"]["Dense_0"]["kernel"]),
                     (adam["mu"]["params"], None), (adam["nu"]["params"], None)):
    layers["Dense_0"]["kernel"] = grow(layers["Dense_0"]["kernel"], (8, 64), fill)
    layers["Dense_0"]["bias"] = grow(layers["Dense_0"]["bias"], (64,))
    layers["Dense_1"]["kernel"] = grow(layers["Dense_1"]["kernel"], (64, 1))  # new rows: zero
migrated, report = migrate(grown, fresh_new, rename=rules)
print(report)
claim(len(report.renamed) == 6 and len(report.filled) == 6
      and not report.dropped and not report.converted,
      "6 leaves renamed (Dense_1's, in the parameters and both moments), the adapter's 6 "
      "filled fresh, none dropped or converted")

# %%
old_state = ref_state if raw.step == T else train(fresh, key0, 0, raw.step)[0]
x, y = batch(raw.step + 1)


def loss_of(st):
    return float(jnp.mean((st.apply_fn(st.params, x, train=False) - y) ** 2))


print(f"loss on the batch of step {raw.step + 1}: old model {loss_of(old_state):.7f}, "
      f"migrated new model {loss_of(migrated):.7f} (equal: "
      f"{loss_of(migrated) == loss_of(old_state)}), untrained new model "
      f"{loss_of(new_state()):.7f}")
claim(abs(loss_of(migrated) - loss_of(old_state)) <= 1e-6 * loss_of(old_state),
      "the widened, migrated model computes the old model's loss (to 1e-6): the new units' "
      "outgoing weights and the adapter start at zero")
rng = jax.random.wrap_key_data(raw["rng"].data, impl=raw["rng"].impl)
cont, _, cont_losses = train(migrated, rng, raw.step, raw.step + 10)
print(f"10 more steps in the new model: step {int(cont.step)}, mean loss "
      f"{np.mean(cont_losses):.4f}; the old model's run over the same steps: "
      f"{np.mean(ref_losses[raw.step:raw.step + 10]):.4f}")

# %%
as_bf16, _ = migrate(grown, new_state(dtype=jnp.bfloat16), rename=rules, allow_cast=True)
nu32 = jnp.concatenate([v.ravel() for v in jax.tree_util.tree_leaves(migrated.opt_state[0].nu)])
nu16 = jnp.concatenate([v.ravel() for v in jax.tree_util.tree_leaves(as_bf16.opt_state[0].nu)])
rel = (jnp.abs(nu16.astype(jnp.float32) - nu32) / nu32)[nu32 > 0]  # the new units' zeros aside
one32 = train_step(migrated, rng, *batch(raw.step + 1))[0]
one16 = train_step(as_bf16, rng, *batch(raw.step + 1))[0]


def leaves(st):
    """The parameters by name ('Dense_0/kernel' ...), as float32 numpy arrays."""
    return {"/".join(k.key for k in path[1:]): np.asarray(v, np.float32)
            for path, v in jax.tree_util.tree_leaves_with_path(st.params)}


b32, a32, b16, a16 = (leaves(st) for st in (migrated, one32, as_bf16, one16))
still = {k: a32[k] == b32[k] for k in b32}  # where one more float32 step changed nothing
moved32 = np.concatenate([~m.ravel() for m in still.values()])
kept16 = np.concatenate([(a16[k] == b16[k]).ravel() for k in b32])
lost16 = float(kept16[moved32].mean())
print(f"Adam's v cast to bfloat16: median relative error {float(jnp.median(rel)):.1e}, "
      f"largest {float(jnp.max(rel)):.1e}")
print(f"parameters that one more float32 Adam step leaves unchanged: {(~moved32).sum()} of "
      f"{moved32.size}, {({k: int(m.sum()) for k, m in still.items() if m.any()})}")
new_units = {"Dense_0/kernel", "Dense_0/bias", "adapter/kernel", "adapter/bias"}
claim(all(np.array_equal(m, np.broadcast_to((np.arange(m.shape[-1]) >= 32) & (k in new_units),
                                            m.shape)) for k, m in still.items()),
      "float32's step leaves unchanged exactly the new units' incoming weights and biases "
      "(Dense_0's columns 32-63) and the adapter's outputs to them (its columns 32-63)")
print(f"of the {moved32.sum()} parameters float32's step moves, bfloat16's step leaves "
      f"{lost16:.1%} unchanged")
_ = verdict(lost16 > 0.01, "in bfloat16 more than 1% of the updates that float32 applies round "
            "away to nothing", seen=f"{lost16:.1%}",
            otherwise="this step's updates were large enough to survive bfloat16's rounding: "
                      "the relative error of v above is the loss that remains")

# %% [markdown]
# The widened, migrated model computes what the old one did (the claim above; the printout
# says whether to the last bit on your device), far from the untrained new model; the step
# count and Adam's moments carried over, and training continues on the old run's scale (the
# last line compares the mean loss of the next ten steps with the old model's own run; they
# differ because the new model has new units and an adapter to train). The report
# is for a person to read before trusting the result: a rename rule that matched nothing shows
# up as *filled* leaves that should have been *renamed*.
#
# **Why not migrate to `bfloat16` at the same time.** `bfloat16` keeps 8 bits of precision (7
# stored): a value is rounded to about 3 significant digits. Adam's $v$ and small updates do not
# survive that. The count above compares only the parameters that float32's step moves: the
# others (the claim names them) have zero Adam moments and a zero gradient, because every path
# from them to the loss passes through a weight that is still zero (`head`'s new rows, the fresh
# adapter), so no precision moves them. Keep float32 *master* weights and moments in the
# checkpoint and in the optimizer, and cast to `bfloat16` only inside the forward pass; if a
# migration must cast, `allow_cast=True` is the explicit request, and its cost is the one
# measured above.

# %% [markdown]
# ## 7. The seeds' resume demo, and the bug that looks right
#
# The course's source material resumes a Flax run like this (its stage 4):
#
# ```python
# restored = checkpoints.restore_checkpoint(ckpt_dir, target=state)   # step 10
# for _ in range(10):
#     state = train_step(restored, batch)          # <- always starts again from `restored`
# checkpoints.save_checkpoint(ckpt_dir, state, step=20, keep=2)
# print("loss at step 20:", float(loss_fn(state.params, batch)))
# ```
#
# Each iteration starts from `restored`, so after the loop `state` is *one* step past the
# checkpoint, not ten — and it is saved as step 20. Below, the seed's own program — its
# two-layer `SimpleNet`, Adam at 0.01, one fixed batch for every step, Flax's
# `save_checkpoint`/`restore_checkpoint` — run as written, next to the same program with the
# loop fixed (`state = train_step(state, batch)`). One fixed batch and no dropout make the
# losses comparable: each is the loss of that one batch at the state the program holds.

# %%
from flax.training import checkpoints as flax_checkpoints


class SimpleNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(features=1)(nn.relu(nn.Dense(features=16)(x)))


def seed_loss(params, b):
    x, y = b
    return jnp.mean((SimpleNet().apply({"params": params}, x) - y) ** 2)


@jax.jit
def seed_step(st, b):
    return st.apply_gradients(grads=jax.grad(seed_loss)(st.params, b))


def seed_program(ckpt_dir, fixed):
    """The seed's main(), stages 1-4; `fixed` repairs the stage-4 loop. Returns the losses."""
    params = SimpleNet().init(jax.random.PRNGKey(42), jnp.ones((4, 8)))["params"]
    st = train_state.TrainState.create(apply_fn=SimpleNet().apply, params=params,
                                       tx=optax.adam(0.01))
    b = (jax.random.normal(jax.random.PRNGKey(7), (32, 8)),
         jax.random.normal(jax.random.PRNGKey(8), (32, 1)))
    for _ in range(10):
        st = seed_step(st, b)
    out = {"step 10": float(seed_loss(st.params, b))}
    flax_checkpoints.save_checkpoint(ckpt_dir, st, step=10, keep=2)
    for _ in range(3):  # the crash at step 13: these steps are lost
        st = seed_step(st, b)
    restored = flax_checkpoints.restore_checkpoint(ckpt_dir, target=st)
    if fixed:
        st = restored
    for _ in range(10):
        st = seed_step(st if fixed else restored, b)
    flax_checkpoints.save_checkpoint(ckpt_dir, st, step=20, keep=2)
    out["step 20"] = float(seed_loss(st.params, b))
    out["state.step"] = int(st.step)
    out["files"] = sorted(os.listdir(ckpt_dir))
    return out


seed_runs = {name: seed_program(str(WORK / f"seed-flax-{name}"), fixed)
             for name, fixed in (("as written", False), ("fixed", True))}
for name, r in seed_runs.items():
    print(f"{name:10s} loss at step 10 {r['step 10']:.4f}, 'loss at step 20' {r['step 20']:.4f}, "
          f"state.step saved as 20: {r['state.step']}, files {r['files']}")
w, f = seed_runs["as written"], seed_runs["fixed"]
claim(w["state.step"] == 11 and f["state.step"] == 20,
      "the seed's loop saves, as step 20, a state whose step counter is 11", seen=w["state.step"])
_ = verdict(w["step 20"] < w["step 10"], "the seed's printed 'loss at step 20' is lower than at "
            "step 10, so nothing looks wrong", otherwise="here the buggy state's loss did not even "
            "fall", seen=f"{w['step 20']:.4f} < {w['step 10']:.4f}")
_ = verdict(f["step 20"] < w["step 20"], "the fixed loop's loss at step 20 is lower than the seed's",
            otherwise="on this machine the two losses came out in the other order",
            seen=f"{f['step 20']:.4f} vs {w['step 20']:.4f}")

# %% [markdown]
# Read the two lines: the seed's program prints a loss at "step 20" that is lower than at step
# 10 — one Adam step lower — so a reader sees training going on and suspects nothing; the fixed
# loop, ten steps on, is lower still. The number that gives the bug away is the step counter.
#
# The same mistake in this chapter's own run (resume step 30, ten steps "to step 40") prints
# losses that are *not* comparable: each `train_step` reports the loss of one batch with one
# dropout mask, and the buggy loop's last loss is step 40's batch at the state of step 30 with
# another key than the correct loop's. Such a loss can come out lower than the correct one by
# chance, which says nothing about which state is better. So this cell prints only what is meaningful, the step counter:

# %%
with mc.CheckpointManager(WORK / "crash") as mngr:  # step 30 of the crashed run
    restored = mngr.restore(target={"state": fresh, "rng": key0})
t0 = restored.step
buggy = restored["state"]
for step in range(t0 + 1, t0 + 11):
    buggy, _, loss_b = train_step(restored["state"], restored["rng"], *batch(step))
print(f"the state the buggy loop saves as step {t0 + 10} has state.step = {int(buggy.step)}")
claim(int(buggy.step) == t0 + 1, f"the buggy loop's state is one step past {t0}")

# %% [markdown]
# Step continuity breaks: the state's own step counter says 31 where the name says 40. Saved
# under the wrong number, that checkpoint would poison the next resume — and `resume` refuses
# it, naming both numbers:

# %%
with mc.CheckpointManager(WORK / "seed-bug") as mngr:
    mngr.save(t0 + 10, {"state": buggy, "rng": restored["rng"]})
    refusal = None
    try:
        resume(mngr, fresh, key0)
    except ValueError as e:
        refusal = e
        print("resume:", e)
claim(refusal is not None and "31" in str(refusal) and "40" in str(refusal),
      "resume refuses the checkpoint, naming step 40 and the counter 31")

# %% [markdown]
# ## 8. Orbax `CheckpointManager.restore` beside minickpt
#
# Orbax finds the latest step the same way, and restores into an *abstract* target — a tree of
# `jax.ShapeDtypeStruct`s saying shape, dtype and sharding, so no memory is spent on a
# throw-away model. minickpt takes the same targets. We save steps 10, 20, 30 with both, flip a
# byte in the newest step's files with both, and restore the latest.
#
# Two names first. Orbax writes every array through **TensorStore**, Google's library for
# reading and writing large n-dimensional arrays in chunks. By default it writes them into
# TensorStore's **OCDBT** format (an "optionally-cooperative distributed B+tree"): a key-value
# store that packs many small values into a few data files under `d/` and finds them through a
# B+tree of index nodes, stored in those same files, with a `manifest.ocdbt` at its root.
# Orbax stores the arrays' metadata (`.zarray`) *inside* the B+tree's nodes, and small arrays
# too: every value up to 1 KiB (`max_inline_value_bytes`, in
# `orbax/checkpoint/_src/serialization/tensorstore_utils.py`). Only larger chunks are stored
# apart, in the data files. For minickpt, the flip lands in array data (`data.bin`); for Orbax,
# where it lands is what the experiment below finds out.

# %%
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN


def items_of(st, key):
    return {"params": st.params, "opt_state": st.opt_state, "step": st.step,
            "rng": jax.random.key_data(key)}


run_states = {}
s, k = fresh, key0
for step in (10, 20, 30):
    s, k, _ = train(s, k, step - 10, step)
    run_states[step] = items_of(s, k)

orbax_dir = WORK / "orbax"
omngr = ocp.CheckpointManager(orbax_dir, options=ocp.CheckpointManagerOptions(
    preservation_policy=LatestN(n=3)))  # Orbax 0.12's name for the deprecated max_to_keep=3
mini = mc.CheckpointManager(WORK / "mini", mc.CheckpointManagerOptions(max_to_keep=3))
for step, its in run_states.items():
    omngr.save(step, args=ocp.args.StandardSave(its))
    mini.save(step, {"s": its})
omngr.wait_until_finished()
abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, run_states[30])
print("latest step: Orbax", omngr.latest_step(), "| minickpt", mini.latest_step())
got_o = omngr.restore(omngr.latest_step(), args=ocp.args.StandardRestore(abstract))
got_m = mini.restore(target={"s": abstract})
print("restored into ShapeDtypeStructs, identical to the saved state: Orbax",
      tree_diff(got_o, run_states[30]) is None, "| minickpt",
      tree_diff(got_m["s"], run_states[30]) is None)

# %%
def flip_largest_file(step_dir):
    """Flip a byte in the middle of the largest file holding array data."""
    files = [p for p in Path(step_dir).rglob("*")
             if p.is_file() and (p.parent.name == "d" or p.name.startswith("data"))]
    big = max(files, key=lambda p: p.stat().st_size)
    flip_byte(str(big), big.stat().st_size // 2)
    return big.relative_to(step_dir)


print("minickpt: flipped a byte in", flip_largest_file(WORK / "mini" / "step_30"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = mini.restore(target={"s": abstract})
print(f"minickpt restore(): step {got.step}, "
      f"{'identical to step 20' if tree_diff(got['s'], run_states[20]) is None else 'WRONG'}; "
      f"warning: {str(caught[0].message)[:70]}..." if caught else "no warning")
claim(got.step == 20 and tree_diff(got["s"], run_states[20]) is None and bool(caught),
      "minickpt detects the flipped byte and falls back to step 20, with a warning")
omngr.close()
mini.close()

# %% [markdown]
# For Orbax the experiment has to be done with care to mean anything. A restore in *this*
# process may be served from what TensorStore already read (the notebook restored step 30
# above), and a byte flipped where no restore reads proves nothing. So: byte-identical copies
# of Orbax's run; a fresh process restores the first under `strace` (where it is installed) to
# learn which byte ranges of which data files a restore reads; one copy gets a byte flipped in
# the middle of the largest range read, another a byte flipped in the largest data file that is
# *not* read; a second fresh process restores all of them and compares each with the intact
# copy. Each outcome is one of three: **detected** (the restore raised), **corrupted** (it
# returned other values without a word), or **not read** (nothing changed).

# %%
ORBAX_READ_PY = """
import json, sys, logging
logging.getLogger("absl").setLevel(logging.CRITICAL)
import numpy as np, jax, orbax.checkpoint as ocp

def load(path):
    # step 30 onto this process's own device (the CPU here): a checkpoint saved on an
    # accelerator records its devices, and a restore without a target would ask for them.
    # metadata(path) is a StepMetadata whose .item_metadata is the tree's metadata in
    # orbax-checkpoint 0.12; 0.11 returns the tree's metadata itself
    m = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        meta = ocp.StandardCheckpointer().metadata(f"{path}/30/default")
        meta = getattr(meta, "item_metadata", meta)
        here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), meta)
        return m.restore(30, args=ocp.args.StandardRestore(target))
    finally:
        m.close()

good = load(sys.argv[1])
for path in sys.argv[2:]:
    try:
        bad = load(path)
    except Exception as e:
        print(json.dumps({"outcome": "detected", "how": f"{type(e).__name__}: {str(e)[:110]}"}))
    else:
        a, b = jax.tree_util.tree_leaves(good), jax.tree_util.tree_leaves(bad)
        n = sum(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
        print(json.dumps({"outcome": "corrupted" if n else "not read",
                          "how": f"{n} of {len(a)} leaves differ, no error"}))
"""
_ = (WORK / "orbax_read.py").write_text(ORBAX_READ_PY)
copies = {name: WORK / f"orbax-copy-{name}" for name in ("intact", "read", "unread")}
for c in copies.values():
    shutil.copytree(orbax_dir, c)
read_env = dict(os.environ, JAX_PLATFORMS="cpu")  # reading files: no accelerator needed
data_files = sorted(str(p.relative_to(copies["intact"] / "30"))
                    for p in (copies["intact"] / "30").rglob("*")
                    if p.is_file() and p.parent.name == "d")
strace = shutil.which("strace")
ranges = []  # (data file relative to the step, offset, length) of every read
if strace:
    import re
    trace = WORK / "orbax-read.strace"  # one file per thread (-ff): no interleaved lines
    traced = subprocess.run([strace, "-ff", "-qq", "-y", "-s", "0", "-e",
                             "trace=pread64,preadv,read", "-e", "signal=none", "-o", str(trace),
                             sys.executable, str(WORK / "orbax_read.py"), str(copies["intact"])],
                            env=read_env, capture_output=True, text=True, timeout=300)
    if traced.returncode != 0:  # e.g. a sandbox that forbids ptrace; the restore is run untraced below
        print(f"strace could not trace the restore here (exit {traced.returncode}): "
              f"{(traced.stderr.strip().splitlines() or ['no message'])[-1][:200]}")
    step_dir = str(copies["intact"] / "30") + "/"
    for part in WORK.glob("orbax-read.strace.*"):
        for line in part.read_text().splitlines():
            m_ = re.search(r"pread64\(\d+<([^>]+)>, .*, (\d+), (\d+)\) = (\d+)", line)
            if m_ and m_.group(1).startswith(step_dir) and "/d/" in m_.group(1):
                ranges.append((m_.group(1)[len(step_dir):], int(m_.group(3)), int(m_.group(4))))
flips = {}
if ranges:
    rel, offset, length = max(ranges, key=lambda r: r[2])
    flips["read"] = (rel, offset + length // 2)
    read_files = {r[0] for r in ranges}
    unread = [f for f in data_files if f not in read_files]
    print(f"a restore reads {len(ranges)} ranges, in {len(read_files)} of the {len(data_files)} "
          f"data files: {sorted(read_files)}")
    if unread:
        big = max(unread, key=lambda f: (copies["unread"] / "30" / f).stat().st_size)
        flips["unread"] = (big, (copies["unread"] / "30" / big).stat().st_size // 2)
else:
    big = max(data_files, key=lambda f: (copies["read"] / "30" / f).stat().st_size)
    flips["read"] = (big, (copies["read"] / "30" / big).stat().st_size // 2)
    print("no usable strace here: one byte flipped in the middle of the largest data file; whether a "
          "restore reads it cannot be told")
for name, (rel, where) in flips.items():
    flip_byte(str(copies[name] / "30" / rel), where)
done = subprocess.run([sys.executable, str(WORK / "orbax_read.py"), str(copies["intact"])]
                      + [str(copies[name]) for name in flips], env=read_env,
                      capture_output=True, text=True, timeout=300)
said = [x for x in done.stdout.splitlines() if x.startswith("{")]
if done.returncode != 0 or len(said) != len(flips):  # never a silent nothing: say why
    raise RuntimeError(f"the Orbax reader failed (exit {done.returncode}, {len(said)} of "
                       f"{len(flips)} outcomes); its stderr ends with:\n{done.stderr[-3000:]}")
results = dict(zip(flips, (json.loads(x) for x in said)))
for name, r in results.items():
    print(f"Orbax {ocp.__version__}, fresh process, byte {flips[name][1]} of {flips[name][0]} "
          f"flipped ({'inside a range read' if ranges and name == 'read' else name}): "
          f"{r['outcome']} — {r['how']}")
if ranges:
    _ = verdict(results["read"]["outcome"] in ("detected", "corrupted"), "a byte flipped inside "
                "a range the restore reads is detected or changes the values",
                seen=results["read"]["outcome"], otherwise="the byte Orbax read changed no "
                "value (padding?): flip another one to learn more")
    if "unread" in results:
        claim(results["unread"]["outcome"] == "not read", "a byte flipped in a data file the "
              "restore never opens changes nothing", seen=results["unread"])

# %% [markdown]
# Read the outcomes your run printed. On the machine this chapter was checked on, the restore of
# this small state read a single data file, under `default/d/` (two ranges); the files the save
# wrote under `ocdbt.process_0/d/` were never opened. That file is a B+tree **node** of the
# OCDBT database: every array of this state is at most 1 KiB, so all of them are stored inline in
# the node, next to their `.zarray` metadata. So what the flip damaged is the node, not a
# separate chunk of array data, and what was *detected* is a node that no longer decodes:
# TensorStore raised `DATA_LOSS` on the first key the restore asked for, an array's `.zarray`
# (its metadata; which array's comes first varies), and no array was read at all. This experiment says nothing about a byte flipped in
# a large array's chunk, stored apart from the nodes; it never damages one. A byte flipped in an
# unread file changed nothing: a flipped byte followed by "no
# error, values identical" proves nothing until you know the byte was read, and a restore in
# the process that already read the checkpoint may not read the file again. Orbax never falls
# back by itself:
# `CheckpointManager.restore` with no step takes `latest_step()`, the newest directory
# (`orbax/checkpoint/checkpoint_manager.py`), and choosing an older step after an error is left
# to your code. minickpt verifies a CRC-32 per leaf and falls back on verified damage, with a
# warning.

# %% [markdown]
# ### 8b. Restoring onto other devices
#
# The everyday case: a run saved on a Colab GPU, opened later on a laptop with a CPU. Orbax
# records each array's sharding in the checkpoint — the device it was on (`cuda:0`), or the
# mesh of devices it was split over — and a restore *without* a target puts every array back
# there. On a machine without those devices that fails with a `ValueError`, worded by the
# Orbax you have: orbax-checkpoint 0.12 says "Topology mismatch detected"
# (`_src/handlers/standard_checkpoint_handler.py`), 0.11.16, the course's floor, "Device
# TFRT_CPU_3 was not found in jax.local_devices()" (`_src/metadata/sharding.py`). The cure is the abstract
# target of section 8, with shardings for the devices *at hand*: Orbax reads the saved
# shapes and dtypes from the checkpoint's metadata without reading an array, you add the
# sharding, and every device reads the part it will hold.
#
# Here the notebook saves two arrays, `w` split by rows over a mesh of all its devices and `b`
# on its last device, with Orbax and with minickpt. Then a fresh process that has a single CPU
# device — the "other machine" — opens both checkpoints: without a target, and with an
# abstract target on its one device.

# %%
from jax.sharding import Mesh, NamedSharding, PartitionSpec

mesh = Mesh(np.array(devices), ("x",))
rows = 8 * len(devices)
on_devices = {
    "w": jax.device_put(np.arange(rows * 4, dtype=np.float32).reshape(rows, 4),
                        NamedSharding(mesh, PartitionSpec("x"))),  # rows over all devices
    "b": jax.device_put(np.float32([0.5, -1.0]), devices[-1]),   # on the last device
}
for k, v in on_devices.items():
    print(f"saved {k}: {v.sharding}")
with ocp.StandardCheckpointer() as ck:
    ck.save(WORK / "elsewhere" / "orbax", on_devices)
with mc.CheckpointManager(WORK / "elsewhere" / "mini") as mngr:
    mngr.save(0, on_devices)
np.savez(WORK / "elsewhere" / "expected.npz", **{k: np.asarray(v) for k, v in on_devices.items()})

OPEN_ELSEWHERE_PY = """
import json, logging, sys
logging.getLogger("absl").setLevel(logging.CRITICAL)
import jax, numpy as np, orbax.checkpoint as ocp
import minickpt as mc
top, expected = sys.argv[1], np.load(sys.argv[1] + "/expected.npz")
here = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # the one device of this machine
out = {"devices": [str(d) for d in jax.devices()]}

def same(tree):
    return all(np.array_equal(np.asarray(tree[k]), expected[k]) for k in expected.files)

with ocp.StandardCheckpointer() as ck:
    try:
        out["orbax, no target"] = f"restored, values equal: {same(ck.restore(top + '/orbax'))}"
    except ValueError as e:
        out["orbax, no target"] = f"ValueError: {str(e)[:70]}..."
    meta = ck.metadata(top + "/orbax")  # shapes and dtypes, no array read
    meta = getattr(meta, "item_metadata", meta)  # 0.12: inside a StepMetadata; 0.11: itself
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), meta)
    got = ck.restore(top + "/orbax", abstract)
    out["orbax, abstract target"] = f"on {got['w'].sharding.device_set}, values equal: {same(got)}"
with mc.CheckpointManager(top + "/mini", mc.CheckpointManagerOptions(read_only=True)) as m:
    plain = m.restore(0)
    out["minickpt, no target"] = f"{type(plain['w']).__name__}s, values equal: {same(plain)}"
    got = m.restore(0, target=abstract)
    out["minickpt, abstract target"] = f"on {got['w'].sharding.device_set}, values equal: {same(got)}"
print(json.dumps(out))
"""
_ = (WORK / "open_elsewhere.py").write_text(OPEN_ELSEWHERE_PY)
one_cpu = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
done = subprocess.run([sys.executable, str(WORK / "open_elsewhere.py"), str(WORK / "elsewhere")],
                      env=one_cpu, capture_output=True, text=True, timeout=300)
elsewhere = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
for k, v in elsewhere.items():
    print(f"other machine, {k}: {v}")
no_target = elsewhere.get("orbax, no target", "")
claim(done.returncode == 0 and no_target.startswith("ValueError: ")
      and ("Topology mismatch" in no_target or "not found in jax.local_devices" in no_target)
      and elsewhere["orbax, abstract target"].endswith("values equal: True")
      and elsewhere["minickpt, abstract target"].endswith("values equal: True"),
      "on one CPU, Orbax without a target raises a ValueError about the devices (0.12: a "
      "topology mismatch; 0.11: a device not found); with an abstract target both libraries "
      "restore the saved values onto that CPU", seen=elsewhere or done.stderr[-300:])

# %% [markdown]
# On the machine with one CPU, Orbax's restore without a target raised a `ValueError` (its
# first line is printed above): the checkpoint names devices that machine does not have. With
# the abstract target — built from `ck.metadata(path).item_metadata` (in Orbax 0.11,
# `ck.metadata(path)` itself), so without the model's code — it restored the same values
# onto the CPU. To restore onto another mesh, put a `NamedSharding` of *that* mesh in the target:
# each device then reads only its own rows. minickpt's checkpoint holds global boxes, not
# devices (chapter 4): without a target it returns numpy arrays wherever it runs, and with a
# target it places each array as the target says. The rule for both: **when the devices may
# differ, restore into a target that names the devices you have.** In a training script that is
# the abstract state of your own model, as in section 8, with the shardings of today's mesh.

# %% [markdown]
# ## 9. Common misconceptions
#
# **"A small difference in the loss after resuming means the checkpoint is broken."** On a GPU
# the last digits move even when every byte was restored (section 4): sums in another order.
# A broken checkpoint is *detected* (a checksum, a missing file) or changes the loss's *scale*.
# Check step continuity and loss scale; on a CPU, expect bit-identity.
#
# **"If the loss looks right, the resume worked."** The seeds' demo printed a plausible loss for
# a state one step past its checkpoint, saved under the wrong step (section 7). Compare the
# state's own step with the step you think you are at.
#
# **"The newest checkpoint is the one to load."** The newest *valid* one is (section 2); and keep
# at least two, or a damaged newest one leaves nothing.
#
# **"Any error while reading means the checkpoint is damaged."** An I/O error says the disk
# could not read, not that the bytes are wrong; falling back past it by itself hides a failing
# disk. Retry a bounded number of times, then stop, and restore an older step only as an explicit
# decision (section 2).
#
# **"A changed data order after a resume is normal."** Seed 001 says so in its answer to the
# quiz question on small loss differences (its Q7: GPU non-determinism *and* a data order that
# "may change"). The course says the opposite: the data position is part of the state. Here the
# batch is a function of the step (section 1); a real loader's position (seed, epoch, position)
# is saved with the checkpoint (section 3b: with it the resumed run read the uninterrupted
# run's batches; without it, none of them). A resumed run that reads other batches is another
# run, and its loss differs in more than the last digits. Last-digit differences on a GPU come from
# the order of additions inside kernels (sections 4 and 5b), never from the data.
#
# **"A killed-and-restarted drill proves the checkpoints survive a crash."** It proves they
# survive the death of the process (section 5). A lost machine also loses the page cache;
# chapter 2 counts what a power cut can leave.
#
# **"Resume at the checkpoint's step."** The checkpoint of step $t_{\text{ckpt}}$ already holds
# that step's result: continue at $t_{\text{ckpt}} + 1$, or the batch of $t_{\text{ckpt}}$ is
# applied twice (and minickpt's first save then finds its step already committed).
#
# **"The parameters are the model, so a migration maps the parameters."** Adam's moments are
# named after the same layers; migrate them with the same rules (section 6), and keep them (and
# the master weights) in float32: a cast to `bfloat16` loses precision that Adam needs.
#
# Two more statements of seed 001 belong to chapter 4 but are often met at resume time.
# **"Data-parallel replicas are identical once training has stabilised."** They are identical
# at *every* step, by construction — the same initial values, the same averaged gradient (an
# all-reduce hands every replica the same bytes), the same update — on a GPU as on a CPU; that
# is why one process may save for all, and a replica that differs is a bug. What a GPU may
# change is another thing: two *runs* of the same job, or a run and its resume, may part in the
# last digits (section 4), but within one run its replicas do not.
# **"Use `pmap`, and save where `host_id() == 0`."** The seed's API is dated: in JAX 0.10,
# `jax.pmap`'s own docstring says to use `jax.shard_map` instead (today's code is `jax.jit` with
# shardings, `shard_map` for per-device code), and `jax.host_id()` is a deprecated alias of
# `jax.process_index()`: it warns that the alias "will eventually be removed"
# (`jax/_src/xla_bridge.py`).
#
# ## Summary
#
# - Resume = find the newest checkpoint, **verify** it (metadata, every key, checksums), **fall
#   back** on verified damage only, restore **the whole state** (θ, Adam's moments, step, RNG key)
#   into the program's state, continue at $t_{\text{ckpt}} + 1$.
# - On a CPU a resumed run is **bit-identical** to the uninterrupted one — every leaf, every
#   loss. On a GPU/TPU reductions may add in another order: check **step continuity** and **loss
#   scale** (`check_resume`).
# - On a GPU, `--xla_gpu_deterministic_ops=true` and `--xla_gpu_autotune_level=0` make most
#   resumes bit-reproducible too (section 5b).
# - Verified damage falls back; an I/O error is retried a bounded number of times and then
#   raised — an older step past it is an explicit decision.
# - A real crash drill — `SIGKILL`, restart, resume — measures steps lost (at most an interval)
#   and time to recover (process start, compilation, restore). It tests process death only; a
#   power cut is chapter 2's crash model.
# - Save the data loader's position (seed, epoch, position) in the same checkpoint: without it
#   a resumed run reads other batches, and nothing fails (section 3b). Flax NNX's state
#   (`nnx.state`) saves and restores like a Linen `TrainState` (section 3c).
# - When the model changes, a strict restore names **every** mismatch at once — shapes as well
#   as names; `partial=True` is a choice; a migration with rename rules carries the parameters
#   *and* the optimizer state over (in float32) and reports what it did; a shape change (a wider
#   layer) is a step of your own before it, chosen so the new model starts where the old one was.
# - On other devices (saved on a GPU, opened on a CPU), restore into an abstract target that
#   carries today's shardings: without one, Orbax raises a `ValueError` about the devices
#   (section 8b).
#
# ## Lab 3
#
# In [lab 3](../labs/lab03_resume/lab03_resume.ipynb) you write these pieces of `minickpt`: the
# choice of the newest valid checkpoint with its fallback (3.1), the strict structure check that
# lists every mismatch (3.2), `resume` — which the lab runs in a real training process that it
# kills with `SIGKILL` and restarts (3.3) — and the migration to a new model (3.4).
