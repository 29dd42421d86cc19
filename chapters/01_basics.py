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
# <a href="https://colab.research.google.com/github/minickpt-course/checkpointing-in-jax/blob/main/chapters/01_basics.ipynb" target="_parent"><img src="https://colab.research.google.com/assets/colab-badge.svg" alt="Open In Colab"/></a>

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
# # Chapter 1 — What a checkpoint is
#
# A moving company driving a truck full of furniture across the mountains for three weeks does
# not wait until the last town to unload. It stops at depots along the road, leaves a copy of the
# load and writes it in the ledger. If the truck goes off the road, a new truck starts from the
# last depot, not from the first town. A video game does the same with save points: when your
# character dies you continue from the last save, with your level, your inventory and your place
# on the map — not from the first village.
#
# A long training run is that journey. A **checkpoint** is a depot: a copy of *everything* the
# run needs to carry on, written to storage that survives the crash. This chapter answers four
# questions, each with a measurement on your own machine:
#
# 1. What does "everything" mean, and what happens if you save only the weights?
# 2. How does JAX describe the state (pytrees, key paths), and what part of a Flax `TrainState` is
#    data rather than code?
# 3. Which bytes should go to disk — msgpack, npy, pickle — and how do arrays get from the
#    accelerator to the file?
# 4. What does a checkpoint look like on disk, with `minickpt`, with Flax's legacy API and with
#    Orbax?
#
# The whole notebook runs in well under a minute on a laptop CPU, and unchanged on a Colab GPU
# or TPU.

# %%
import dataclasses
import io
import json
import logging
import os
import pickle
import pickletools
import shutil
import time
from pathlib import Path

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's note that TensorFlow is absent

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax.training import train_state
from jax.flatten_util import ravel_pytree

import minickpt as mc
from minickpt import cli
from minickpt import tree as mtree
from minickpt.labkit.claims import claim, verdict

devices = jax.devices()
print(f"JAX {jax.__version__} sees {len(devices)} {devices[0].platform.upper()} device(s): "
      f"{devices}")

WORK = Path("ch01-work")  # everything this notebook writes goes here; it starts empty
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir()

# %% [markdown]
# ## 1. The training state
#
# At step $t$ a training run is fully described by
#
# $$\mathcal{S}_t = (\theta_t,\; m_t,\; t,\; r_t)$$
#
# - $\theta_t$ — the **parameters** (the weights): what the model has learned so far.
# - $m_t$ — the **optimizer state**: for Adam, the two running averages $m_t$ and $v_t$ below
#   (two numbers per parameter) and Adam's own step count.
# - $t$ — the **step**. It exists twice: Flax's `TrainState.step` counts the updates for *your*
#   code (logging, when to save), and the optimizer keeps its own counts inside its state. optax
#   reads only its own: Adam's bias correction uses `ScaleByAdamState.count`, a learning-rate
#   schedule `ScaleByScheduleState.count`. Neither looks at `TrainState.step`, so restoring the
#   step without the optimizer state does not put the schedule back where it was (section 2
#   measures it).
# - $r_t$ — the **random key**: in JAX randomness is an explicit value, so dropout masks and the
#   order of the data come from a key that is part of the state.
#
# Adam keeps, for every parameter, an average of the gradients $m_t$ and of their squares $v_t$
# (optax calls them `mu` and `nu`, and keeps its step in `count`):
#
# $$g_t = \nabla L(\theta_{t-1}),\qquad m_t = \beta_1 m_{t-1} + (1-\beta_1)\,g_t,\qquad
#   v_t = \beta_2 v_{t-1} + (1-\beta_2)\,g_t^2$$
#
# $$\hat m_t = \frac{m_t}{1-\beta_1^t},\qquad \hat v_t = \frac{v_t}{1-\beta_2^t},\qquad
#   \theta_t = \theta_{t-1} - \eta\,\frac{\hat m_t}{\sqrt{\hat v_t}+\epsilon}$$
#
# with $\beta_1 = 0.9$, $\beta_2 = 0.999$. With $\beta_2 = 0.999$, $v_t$ averages over roughly
# the last thousand steps: it *remembers* how large the gradients have been. Now suppose a run
# restarts with the right weights but a fresh optimizer ($m = v = 0$, $t = 0$). Its first step has
# $\hat m_1 = g_1$ and $\hat v_1 = g_1^2$, so every parameter moves by
# $\eta\, g_1/|g_1| = \pm\eta$ — the full learning rate, in the direction of one noisy gradient,
# however small that gradient is. The next experiment measures what that does.

# %% [markdown]
# ## 2. Experiment: resume with and without the optimizer state
#
# The model is a small MLP (one hidden layer of 64 units) that learns to imitate a fixed random
# "teacher" network of the same kind. Because a perfect fit exists, the loss keeps falling by
# orders of magnitude, and any damage is visible on a logarithmic axis. Every step draws a fresh
# batch of 128 inputs from the random key $r_t$, so the key is part of the state. After each step
# we measure the loss on a fixed set of 1024 held-out inputs, and how far the step moved the
# weights (the mean of $|\theta_t - \theta_{t-1}|$ over all parameters).

# %%
D_IN, HIDDEN, BATCH = 8, 64, 128
LR = 0.03            # Adam's learning rate eta
K, T = 200, 300      # save at step K, train to step T


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden)(x))  # Dense_0
        return nn.Dense(1)(h)                  # Dense_1


teacher, student = MLP(16), MLP(HIDDEN)
teacher_vars = teacher.init(jax.random.key(100), jnp.ones((1, D_IN)))
x_eval = jax.random.normal(jax.random.key(999), (1024, D_IN))
y_eval = teacher.apply(teacher_vars, x_eval)


def fresh_state(seed=0, tx=None):
    """A new TrainState, built from code: the model, its initial weights, the optimizer."""
    params = student.init(jax.random.key(seed), jnp.ones((1, D_IN)))["params"]
    return train_state.TrainState.create(apply_fn=student.apply, params=params,
                                         tx=tx or optax.adam(LR))


def raw(leaf):
    """A leaf as plain numbers (a typed random key as its key data), for comparing."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def same_leaves(a, b):
    """True if two pytrees have bit-identical leaves, in the same order."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(raw(x), raw(y)) for x, y in zip(la, lb))


@jax.jit
def train_step(state, rng):
    rng, data_key = jax.random.split(rng)  # the batch comes from the key: r_t is state
    x = jax.random.normal(data_key, (BATCH, D_IN))
    y = teacher.apply(teacher_vars, x)

    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    new = state.apply_gradients(grads=jax.grad(loss_fn)(state.params))
    eval_loss = jnp.mean((new.apply_fn({"params": new.params}, x_eval) - y_eval) ** 2)
    moved = jnp.mean(jnp.abs(ravel_pytree(new.params)[0] - ravel_pytree(state.params)[0]))
    return new, rng, eval_loss, moved


def train(state, rng, steps):
    """Run `steps` steps; returns the state, the key and per step (eval loss, mean |update|)."""
    history = []
    for _ in range(steps):
        state, rng, loss, moved = train_step(state, rng)
        history.append((loss, moved))
    return state, rng, np.array(jax.device_get(history))  # one transfer at the end


# %% [markdown]
# Train to step $K$, save a checkpoint with `minickpt` — parameters, optimizer state and key as
# three items, the step in the directory name — then keep going without interruption to step $T$.
# That uninterrupted run is the reference.

# %%
run_dir = WORK / "run"
mngr = mc.CheckpointManager(run_dir)

t0 = time.perf_counter()
state, rng = fresh_state(), jax.random.key(1)
state, rng, hist_before = train(state, rng, K)
mngr.save(K, {"params": state.params, "opt_state": state.opt_state, "rng": rng},
          metrics={"eval_loss": float(hist_before[-1, 0])})
state_ref, _, hist_ref = train(state, rng, T - K)
print(f"trained {T} steps in {time.perf_counter() - t0:.1f} s; saved step {K}: "
      f"{mngr.all_steps()} in {run_dir}")

# %% [markdown]
# Now pretend the process died right after saving. A new process builds a fresh state from code
# (the same model and optimizer) and restores into it — once **everything**, once **only the
# weights** (and the key). Both resumed runs then see exactly the same batches, so the only
# difference between them is Adam's $m$, $v$ and step count.
#
# **How this course checks its own sentences.** Under many cells you will find lines that start
# with `claim:` or `verdict:`. A `claim:` line is a sentence of the text that must hold on every
# machine (a count, an equality, an error raised): the cell *asserts* it, prints it with
# `[holds]`, and stops the notebook with the sentence and what your run showed instead if it
# ever fails. A `verdict:` line is about a measurement that varies with the machine (a time, a
# ratio, a jump of the loss): it never stops the notebook, but says whether *your* run agrees
# with the text, and if not, what that means. The text around a verdict tells you what to look
# for; the verdict tells you what your run showed.

# %%
target = fresh_state(seed=7)  # any state of the right structure: its values get replaced

full = mngr.restore(target={"params": target.params, "opt_state": target.opt_state,
                            "rng": jax.random.key(0)})
resumed_full = target.replace(step=full.step, params=full["params"],
                              opt_state=full["opt_state"])
state_full, _, hist_full = train(resumed_full, full["rng"], T - K)

weights = mngr.restore(target={"params": target.params, "rng": jax.random.key(0)})
resumed_weights = target.replace(step=weights.step, params=weights["params"])  # m = v = 0, t = 0
_, _, hist_weights = train(resumed_weights, weights["rng"], T - K)

print("optimizer count after restoring everything:", int(resumed_full.opt_state[0].count))
print("optimizer count after restoring weights only:", int(resumed_weights.opt_state[0].count))
claim(int(resumed_full.opt_state[0].count) == K and int(resumed_weights.opt_state[0].count) == 0,
      f"restoring everything brings back Adam's count {K}; the weights-only resume starts at 0")

# %%
steps_before = np.arange(1, K + 1)
steps_after = np.arange(K + 1, T + 1)
fig, (ax_loss, ax_move) = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, col in ((ax_loss, 0), (ax_move, 1)):
    ax.plot(steps_before, hist_before[:, col], color="0.3", label="before the checkpoint")
    ax.plot(steps_after, hist_ref[:, col], color="0.3", lw=3, alpha=0.35,
            label="uninterrupted")
    ax.plot(steps_after, hist_full[:, col], color="tab:blue", ls="--",
            label="resumed: full state")
    ax.plot(steps_after, hist_weights[:, col], color="tab:red", label="resumed: weights only")
    ax.axvline(K, color="k", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
ax_loss.set_ylabel("held-out loss (MSE)")
ax_loss.set_title(f"Loss; checkpoint at step {K}")
ax_move.axhline(LR, color="tab:red", ls=":", lw=1)
ax_move.text(K + 8, LR * 0.8, "η, the learning rate", color="tab:red", va="top")
ax_move.set_ylabel(r"mean $|\theta_t - \theta_{t-1}|$")
ax_move.set_title("How far each step moves the weights")
ax_loss.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: held-out loss (left) and mean size of each step's change to the weights (right) of one
# run, resumed at step 200 from the full training state (blue, dashed, lying on the uninterrupted
# run in grey) and from the weights alone (red). A fresh Adam moves almost every weight by η — at
# step 1, and again right after the weights-only resume. Measured on this machine's devices.*

# %%
loss_at_k = hist_before[-1, 0]
first = slice(0, 30)  # the 30 steps after the resume


def steps_back(hist, level):
    """Steps after the resume until the held-out loss is back at `level` (None: never)."""
    hit = np.nonzero(hist[:, 0] <= level)[0]
    return int(hit[0]) + 1 if hit.size else None


print(f"held-out loss at the checkpoint (step {K}): {loss_at_k:.2e}")
print(f"highest loss in the 30 steps after step {K}:")
print(f"  uninterrupted run:    {hist_ref[first, 0].max():.2e}  "
      f"({hist_ref[first, 0].max() / loss_at_k:.1f}x: the ordinary noise of fresh batches)")
print(f"  resumed, full state:  {hist_full[first, 0].max():.2e}  "
      f"(the same curve: largest difference from the uninterrupted run "
      f"{np.abs(hist_full[:, 0] - hist_ref[:, 0]).max():.1e})")
print(f"  resumed, weights only: {hist_weights[first, 0].max():.2e}  "
      f"({hist_weights[first, 0].max() / loss_at_k:.0f}x)")
print(f"mean |update| of the first step after the resume: full state {hist_full[0, 1]:.1e}, "
      f"weights only {hist_weights[0, 1]:.1e} (eta = {LR}; the warm Adam of step {K} moved "
      f"{hist_before[-1, 1]:.1e})")
back = steps_back(hist_weights, loss_at_k)
print("steps until the weights-only run is back at the checkpoint's loss: "
      + (f"{back} of {T - K}" if back else f"more than {T - K}"))
print(f"held-out loss at step {T}: uninterrupted {hist_ref[-1, 0]:.2e}, "
      f"weights only {hist_weights[-1, 0]:.2e}")
same = bool(np.array_equal(hist_full, hist_ref) and same_leaves(state_full, state_ref))
print(f"full-state resume identical to the uninterrupted run, bit for bit: {same}")
if devices[0].platform == "cpu":
    claim(same, "on a CPU the full-state resume is the uninterrupted run, bit for bit")
else:
    verdict(same, "the full-state resume is the uninterrupted run, bit for bit",
            otherwise="this accelerator summed something in another order (chapter 3): compare "
                      "the two curves' scale, not their last digits", seen=devices[0].platform)
first_move = np.abs(ravel_pytree(train_step(resumed_weights, weights["rng"])[0].params)[0]
                    - ravel_pytree(resumed_weights.params)[0])  # that first step, weight by weight
near_eta = float(np.mean(np.abs(first_move / LR - 1) < 0.01))
print(f"weights that this first step moved by eta to within 1%: {near_eta:.1%} of {first_move.size}")
_ = verdict(near_eta > 0.9,
            "the weights-only resume's first step moves almost every weight (over 90%) by eta, "
            "to within 1%", otherwise="Adam's first step is eta * sign(g) only where |g| >> eps; "
            "tiny gradients move less", seen=f"{near_eta:.1%}")
_ = verdict(hist_weights[first, 0].max() / loss_at_k >= 10,
            "the weights-only resume's loss jumps by more than 10x",
            otherwise="a smaller jump: the run was not yet far enough into training for a fresh "
                      "Adam's full-size steps to do much damage",
            seen=f"{hist_weights[first, 0].max() / loss_at_k:.0f}x")

# %% [markdown]
# One run can mislead: the loss at step 300, in particular, depends on the batches the run
# happened to draw after the resume, and in one run the weights-only resume can end a little
# *below* the uninterrupted one (read the last line above for yours). So we repeat the
# weights-only resume with four more seeds (other initial weights, other batches), this time in
# memory, and look at what is lost in each of them: the size of the first update, the jump of
# the loss, the steps spent getting back to where the checkpoint was — compute paid for twice —
# and, last, the loss at step 300.

# %%
rows = []
for seed in range(5):
    st, key = fresh_state(seed), jax.random.key(1 + seed)
    st, key, h_before = train(st, key, K)
    _, _, h_ref = train(st, key, T - K)                               # uninterrupted
    w_only = fresh_state(seed=7).replace(step=st.step, params=st.params)  # m = v = 0
    _, _, h_w = train(w_only, key, T - K)                             # same batches
    level = h_before[-1, 0]
    rows.append((h_w[0, 1] / h_before[-1, 1], h_w[first, 0].max() / level,
                 steps_back(h_w, level) or T - K + 1, h_w[-1, 0] / h_ref[-1, 0]))
rows = np.array(rows)
print("seed  first update / warm update  loss jump  steps to get back  loss at T / uninterrupted")
for seed, (upd, jump, steps, end) in enumerate(rows):
    print(f"{seed:4d}  {upd:24.0f}x  {jump:8.0f}x  {steps:17.0f}  {end:25.2f}")
lo, hi = rows.min(axis=0), rows.max(axis=0)
print(f"\nin every seed: the first update is {lo[0]:.0f}-{hi[0]:.0f}x the warm one, the loss jumps "
      f"{lo[1]:.0f}-{hi[1]:.0f}x, and {lo[2]:.0f}-{hi[2]:.0f} of the {T - K} steps after the "
      f"resume ({lo[2] / K:.0%}-{hi[2] / K:.0%} of the {K} steps before it) only win back what the "
      f"checkpoint held")
worse = int((rows[:, 3] > 1.05).sum())
print(f"the loss at step {T} relative to the uninterrupted run: {lo[3]:.2f}-{hi[3]:.2f} "
      f"({worse} of {len(rows)} seeds more than 5% worse, {(rows[:, 3] < 1).sum()} below 1)")
_ = verdict(bool(lo[0] > 10 and lo[1] > 10), "in every seed the first update is more than 10x the "
            "warm one and the loss jumps more than 10x", otherwise="a seed where the fresh Adam did "
            "less damage: the point is the detour, read its 'steps to get back'",
            seen=f"{lo[0]:.0f}x, {lo[1]:.0f}x at least")
_ = verdict(bool(lo[2] >= 10), "in every seed tens of steps go to winning back the checkpoint's loss",
            otherwise="a seed that got back within a few steps", seen=f"{lo[2]:.0f}-{hi[2]:.0f} steps")
_ = verdict(worse > len(rows) / 2, f"in most seeds the weights-only run still ends worse at step {T}",
            otherwise="on this machine most seeds recovered fully within 100 steps: the end point "
                      "depends on the batches drawn, the detour does not",
            seen=f"{worse} of {len(rows)} more than 5% worse")

# %% [markdown]
# What the numbers say:
#
# - **Restoring the full state continues the run as if nothing had happened.** Its curve *is* the
#   uninterrupted run's: the loss wanders up and down a little after step 200 in both (that is the
#   noise of fresh batches, not damage), and on a CPU the two runs are identical, bit for bit. (On
#   a GPU some reductions are not deterministic, so the last digits may differ; chapter 3 shows
#   what to check instead.)
# - **Restoring only the weights throws away the optimizer's memory.** Adam's first step moves
#   almost every weight by $\eta$, to within 1 % (the share is printed above; the red curve on
#   the right, their mean, jumps to the dotted line),
#   tens of times more than the warm optimizer was moving them, and the loss jumps by a factor
#   of tens to a few hundred. Look at the table and the verdicts under it: whether that holds
#   for every seed on your machine.
# - **What is lost is the detour, not (necessarily) the destination.** The weights-only run needs
#   tens of steps just to get back to the checkpoint's loss: those steps are compute paid twice.
#   Where it ends up after 100 steps varies from seed to seed. Look at the last column: a value
#   above 1 means the damage outlasted the 100 steps, a value at or below 1 that the run caught
#   up. The count of seeds on each side, and the verdict under the table, are your machine's
#   (another machine draws other batches and can tip a seed either way) — which is also why a
#   single run's end point proves nothing either way. In a long run with a learning-rate
#   schedule the detour costs hours, and the large first steps can push a big model into a
#   region it never recovers from (a loss spike that diverges), which no small experiment can
#   promise to show.
# - The damage grows with the learning rate and with how far training has come: a warm $v_t$
#   remembers larger gradients from earlier in the run, which is what kept the late steps small.
#
# So a checkpoint holds the whole $\mathcal{S}_t$. Here is its bill of materials, from the
# checkpoint's own metadata:

# %%
meta = mngr.metadata(K)
for item, rec in sorted(meta.items.items()):
    print(f"{item:10s} {rec['num_leaves']:3d} leaves  {rec['data_bytes']:7,d} bytes")
print(f"Adam's state is {meta.items['opt_state']['data_bytes'] / meta.items['params']['data_bytes']:.2f}"
      " times the size of the weights (m and v, one value each per weight, plus the count)")
claim(meta.items["opt_state"]["num_leaves"] == 2 * meta.items["params"]["num_leaves"] + 1,
      "Adam's state has two leaves per weight leaf (m and v) plus the count",
      seen=(meta.items["opt_state"]["num_leaves"], meta.items["params"]["num_leaves"]))

# %% [markdown]
# ### Which step does the optimizer read?
#
# Both resumes above restored `step=200` into the `TrainState`, yet the weights-only run's Adam
# started again at `count` 0: optax never looks at `TrainState.step`. The same goes for a
# learning-rate schedule. Real runs usually **warm up**: the learning rate rises from 0 to
# $\eta$ over the first steps, here over `WARMUP` = 100 steps with `optax.linear_schedule`.
# `optax.adam(schedule)` keeps the schedule's position in its own counter,
# `ScaleByScheduleState.count`, the second entry of `opt_state`. We train to step 200 (past the
# warm-up), save everything with `minickpt`, and resume twice: both times with the weights, the
# key and the step, once *with* `opt_state` and once without. Before every step we read the
# learning rate the optimizer is about to use, `schedule(opt_state[1].count)`.

# %%
WARMUP = 100
schedule = optax.linear_schedule(init_value=0.0, end_value=LR, transition_steps=WARMUP)
tx_warm = optax.adam(schedule)  # opt_state = (ScaleByAdamState, ScaleByScheduleState)


def train_lr(state, rng, steps):
    """Like train(), but records (held-out loss, learning rate this step used) per step."""
    history = []
    for _ in range(steps):
        lr = schedule(state.opt_state[1].count)  # optax's own counter, not state.step
        state, rng, loss, _ = train_step(state, rng)
        history.append((loss, lr))
    return state, rng, np.array(jax.device_get(history))


with mc.CheckpointManager(WORK / "warmup") as wm:
    st, key = fresh_state(tx=tx_warm), jax.random.key(1)
    st, key, warm_before = train_lr(st, key, K)
    wm.save(K, {"params": st.params, "opt_state": st.opt_state, "rng": key})
    blank = fresh_state(seed=7, tx=tx_warm)
    r = wm.restore(target={"params": blank.params, "opt_state": blank.opt_state,
                           "rng": jax.random.key(0)})
with_opt = blank.replace(step=r.step, params=r["params"], opt_state=r["opt_state"])
without_opt = blank.replace(step=r.step, params=r["params"])  # opt_state as tx.init made it
for name, s_ in (("with opt_state", with_opt), ("without opt_state", without_opt)):
    print(f"resumed {name:18s}: TrainState.step {int(s_.step)}, Adam's count "
          f"{int(s_.opt_state[0].count)}, schedule's count {int(s_.opt_state[1].count)}")
_, _, warm_with = train_lr(with_opt, r["rng"], T - K)
_, _, warm_without = train_lr(without_opt, r["rng"], T - K)
print(f"learning rate of the first step after the resume: with opt_state {warm_with[0, 1]:.4f}, "
      f"without {warm_without[0, 1]:.4f}; of the last (step {T}): {warm_with[-1, 1]:.4f} and "
      f"{warm_without[-1, 1]:.4f}")
claim(int(without_opt.step) == K and int(without_opt.opt_state[1].count) == 0
      and warm_without[0, 1] == 0.0 and warm_with[0, 1] == np.float32(LR),
      f"without opt_state the resumed run has step {K} but the schedule's count 0: its first "
      "step uses learning rate 0 and the warm-up starts again",
      seen=(int(without_opt.opt_state[1].count), float(warm_without[0, 1])))
_ = verdict(bool(warm_without[-1, 0] > warm_with[-1, 0]),
            f"at step {T} the run resumed without opt_state has a higher held-out loss",
            otherwise="here the slower, re-warmed steps happened to land as low: the schedule "
                      "is still wrong, which the learning-rate line above shows either way",
            seen=f"{warm_without[-1, 0]:.2e} vs {warm_with[-1, 0]:.2e}")

# %%
fig, (ax_lr, ax_l) = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, col in ((ax_lr, 1), (ax_l, 0)):
    ax.plot(steps_before, warm_before[:, col], color="0.3", label="before the checkpoint")
    ax.plot(steps_after, warm_with[:, col], color="tab:blue", ls="--",
            label="resumed with opt_state")
    ax.plot(steps_after, warm_without[:, col], color="tab:red",
            label="resumed without opt_state")
    ax.axvline(K, color="k", ls=":", lw=1)
    ax.set_xlabel("training step (TrainState.step)")
ax_lr.set_ylabel("learning rate used by the step")
ax_lr.set_title(f"Warm-up over {WARMUP} steps, checkpoint at step {K}")
ax_l.set_yscale("log")
ax_l.set_ylabel("held-out loss (MSE)")
ax_l.set_title("Loss")
ax_lr.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: the learning rate each step used (left) and the held-out loss (right), for a run
# with a 100-step linear warm-up, resumed at step 200 with its optimizer state (blue, dashed) and
# without it (red); both resumes restored the weights, the key and `TrainState.step`.*
#
# Without `opt_state` the schedule's clock is back at 0: the warm-up starts again at step 200
# and the run spends the next 100 steps at a learning rate it had already left behind. (The
# restarted warm-up even hides the fresh Adam's full-size first steps of the experiment above:
# the learning rate is 0 when they happen.) A schedule that decays after its warm-up would, in
# the same way, start its whole course again. The step that matters for training is the one in
# `opt_state`; `TrainState.step` only tells *you* where you are.

# %% [markdown]
# ## 3. Pytrees and key paths
#
# JAX calls any nest of dicts, lists, tuples, named tuples and registered classes a **pytree**;
# the arrays at the ends are its **leaves**. A checkpoint stores a pytree as a flat list of
# leaves, each named by its **key path**: the dict keys, sequence indices and attribute names
# that lead from the root to the leaf. `jax.tree_util.tree_flatten_with_path` gives both:

# %%
leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
print(f"a TrainState has {len(leaves_with_paths)} leaves; the first five:")
for path, leaf in leaves_with_paths[:5]:
    print(f"  {jax.tree_util.keystr(path):50s} {str(leaf.dtype):8s} {leaf.shape}")
mu_path = next(p for p, _ in leaves_with_paths if ".mu" in jax.tree_util.keystr(p))
print(f"\nthe path of Adam's m for one layer, {jax.tree_util.keystr(mu_path)}, is made of:")
for key in mu_path:
    print("  ", repr(key))

# %% [markdown]
# The path mixes three kinds of keys: `GetAttrKey` (a field of the `TrainState` or of optax's
# named tuple), `SequenceKey` (position 0 of optax's tuple of states) and `DictKey` (Flax's
# parameter dicts). A file cannot hold Python key objects, so `minickpt` names every leaf by the
# *strings* of its path. The same names then match whether the container is a `TrainState`, a
# named tuple or a plain dict — which is what lets you restore a `TrainState` checkpoint into a
# dict, or the other way round.
#
# (Lab 1's state, `lab.train_state()`, keeps Flax's whole variables dict `{"params": ...}` in
# its `params` field, so its paths have one `params` more: the leaf above is
# `opt_state/0/mu/params/Dense_0/bias` there. Print the paths of whatever state you checkpoint.)

# %%
named = mtree.flatten_with_names(state)
for names, leaf in named[:5]:
    print(f"  {mtree.path_str(names):45s} {names}")
print("leaves whose path starts with apply_fn or tx:",
      [n for n, _ in named if n[0] in ("apply_fn", "tx")])

# the names are enough to put the leaves back into any tree of the same shape
values = {names: leaf for names, leaf in named}
rebuilt = mtree.unflatten_like(fresh_state(seed=3), values)
print("rebuilt a TrainState from the named leaves, every leaf identical:",
      same_leaves(rebuilt, state))
claim(same_leaves(rebuilt, state) and not [n for n, _ in named if n[0] in ("apply_fn", "tx")],
      "no leaf is named apply_fn or tx, and the named leaves rebuild the TrainState exactly")
as_dicts = mtree.nest((n, np.asarray(v).shape) for n, v in named)
print("the same names as nested dicts:", json.dumps(as_dicts["opt_state"]["0"]["mu"]))

# %% [markdown]
# ## 4. Flax `TrainState`: data and code
#
# `TrainState` bundles the step, the parameters and the optimizer state — and also `apply_fn`
# (the model's forward function) and `tx` (the optax optimizer). The last two are **code**:
# Flax marks them `pytree_node=False`, so they are not leaves, and no checkpoint contains them.

# %%
for f in dataclasses.fields(train_state.TrainState):
    is_data = f.metadata.get("pytree_node", True)
    print(f"  {f.name:10s} {'data (saved)' if is_data else 'code (not saved: rebuilt by your program)'}")
code_fields = {f.name for f in dataclasses.fields(train_state.TrainState)
               if not f.metadata.get("pytree_node", True)}
claim(code_fields == {"apply_fn", "tx"}, "apply_fn and tx are marked pytree_node=False",
      seen=code_fields)

# %% [markdown]
# Because the optimizer is code, restoring needs a target built by the *same* code. If the code
# changed — here, SGD with momentum instead of Adam — the saved optimizer state no longer fits,
# and a strict restore says exactly where, before reading any data:

# %%
sgd_target = fresh_state(tx=optax.sgd(LR, momentum=0.9))
mismatch = None
try:
    mngr.restore(K, target={"opt_state": sgd_target.opt_state})
except mc.StructureMismatchError as e:
    mismatch = e
    lines = str(e).splitlines()
    print("\n".join(lines[:5] + ["  ..."] + lines[-3:]))
claim(mismatch is not None, "the strict restore into an SGD state raises StructureMismatchError")
mngr.close()  # done with this run directory (the manager held a lock on it)

# %% [markdown]
# ## 5. Which bytes: msgpack, npy — and why never pickle
#
# **msgpack** is a compact binary format for dicts, lists, numbers and bytes. It does not know
# JAX arrays. Several tutorials (including one this course started from) call `msgpack.dumps` on
# a tree of JAX arrays; it fails:

# %%
import msgpack

failed = False
try:
    msgpack.dumps({"kernel": jnp.ones((3, 2))})
except TypeError as e:
    failed = True
    print("TypeError:", e)
claim(failed, "msgpack.dumps of a JAX array raises TypeError")

# %% [markdown]
# Flax's `flax.serialization` adds what is missing: it turns the state into a tree of plain
# dicts (`to_state_dict`), encodes each array as msgpack bytes with its dtype and shape, and on
# the way back fills the values into a target of the right structure (`from_bytes`).

# %%
from flax import serialization

blob = serialization.to_bytes(state)
back = serialization.from_bytes(fresh_state(seed=5), blob)
print(f"to_bytes: {len(blob):,} bytes; round trip into a TrainState exact:",
      same_leaves(back, state))

state_dict = serialization.to_state_dict(state)  # the same thing in two explicit steps
packed = serialization.msgpack_serialize(state_dict)
print("state dict keys:", list(state_dict), "| msgpack_serialize:", len(packed), "bytes")
print("restored without a target:", type(serialization.msgpack_restore(packed)["opt_state"]),
      "— the named tuples came back as dicts, and apply_fn and tx are not there at all")

key_failed = False
try:
    serialization.to_bytes({"rng": rng})
except (TypeError, ValueError) as e:  # which one depends on the Flax version
    key_failed = True
    print("\na typed PRNG key:", str(e).split(".")[0])
claim(same_leaves(back, state) and key_failed,
      "flax.serialization round-trips the TrainState exactly and refuses a typed PRNG key")

# %% [markdown]
# So msgpack via Flax works for parameters and optimizer state, but one file holds the whole
# tree (no reading of a single leaf, no checksum), and a typed random key must first be turned
# into its raw `key_data`.
#
# **npy** (`np.save`) stores one array with its shape and dtype in a small header. It is as
# simple as a format gets — but the header only knows NumPy's own dtypes:

# %%
buf = io.BytesIO()
np.save(buf, np.asarray(jnp.arange(3.0, dtype=jnp.bfloat16)))
buf.seek(0)
loaded = np.load(buf)
print("saved bfloat16, np.load gives dtype", loaded.dtype, "->", loaded)

buf = io.BytesIO()
np.save(buf, np.array([{"lr": 0.1}], dtype=object))  # an object array goes through pickle...
buf.seek(0)
refused = False
try:
    np.load(buf)  # ...so np.load refuses it unless you pass allow_pickle=True
except ValueError as e:
    refused = True
    print("object array:", e)
claim(loaded.dtype.kind == "V" and refused,
      "np.load gives bfloat16 back as anonymous void bytes, and refuses an object array")

# %% [markdown]
# `bfloat16`, the everyday dtype of accelerator training, comes back as anonymous two-byte
# blobs (`|V2`): the numbers survive, their meaning does not. And note the door `np.load` keeps
# shut by default: `allow_pickle`.
#
# **pickle** can store anything, because loading a pickle *runs code*: the file names a function
# and its arguments, and `pickle.load` calls it. Here is a harmless "checkpoint" that creates a
# file when it is loaded. A real attacker would name `os.system` instead.

# %%
class Surprise:
    def __reduce__(self):  # pickle asks the object how to rebuild it: "call this function"
        return (Path.write_text, (WORK / "written-by-unpickling.txt",
                                  "pickle ran this code while loading a checkpoint\n"))


evil = pickle.dumps({"params": np.ones(3), "note": Surprise()})
named_in_file = [arg for _, arg, _ in pickletools.genops(evil)
                 if isinstance(arg, str) and ("pathlib" in arg or "write_text" in arg)]
print("what the file tells pickle to import and call:", named_in_file)
marker = WORK / "written-by-unpickling.txt"
print("file exists before loading:", marker.exists())
pickle.loads(evil)
print("file exists after loading: ", marker.exists(), "->", marker.read_text().strip())
claim(marker.exists(), "pickle.loads ran the code the file named: the file now exists")

# %% [markdown]
# A checkpoint is something you download, share and restore on shared machines; it must be
# *data only*. `minickpt` never uses pickle: an item is a `data.bin` of raw array bytes plus a
# JSON `manifest.json` (key path, dtype, shape, offset, CRC-32 per leaf). What cannot be described
# that way — an object array, a function — is refused at save time with the path of the leaf:

# %%
unsupported = False
try:
    mc.Checkpointer().save(WORK / "objects", {"state": {"params": np.ones(3),
                                                          "extra": np.array([{}], dtype=object)}})
except mc.UnsupportedLeafError as e:
    unsupported = True
    print("UnsupportedLeafError:", e)
print("anything left on disk:", (WORK / "objects").exists())
claim(unsupported and not (WORK / "objects").exists(),
      "minickpt refuses an object array at save time and leaves nothing on disk")

# %% [markdown]
# | | msgpack (`flax.serialization`) | npy | pickle | `minickpt` |
# |---|---|---|---|---|
# | keeps the tree structure | yes (as dicts) | no (one array) | yes | yes (key paths) |
# | `bfloat16`, typed keys | yes, no | no (`\|V2`), no | yes, yes | yes, yes |
# | runs code when loading | no | only with `allow_pickle=True` | **yes** | no |
# | checksum per leaf, read one leaf | no, no | no, yes | no, no | yes, yes |

# %% [markdown]
# ## 6. From the device to the host
#
# Arrays live in the memory of a device — a GPU, a TPU, or the CPU. A file is written from host
# (CPU) memory, so every save starts by bringing the arrays to the host: `jax.device_get(tree)`,
# or `np.asarray(x)` for one array. What that costs depends on where the array is:

# %%
x = jnp.arange(8 * 1024 * 1024, dtype=jnp.float32)  # 32 MiB
print("x lives on", x.devices())
x.block_until_ready()
t0 = time.perf_counter()
host = jax.device_get(x)
dt = time.perf_counter() - t0
try:
    zero_copy = host.__array_interface__["data"][0] == x.unsafe_buffer_pointer()
except Exception:  # some backends do not expose their buffer pointers
    zero_copy = False
print(f"device_get of {x.nbytes / 2**20:.0f} MiB took {dt * 1e3:.2f} ms; "
      f"host array shares the device buffer (zero-copy): {zero_copy}; writeable: "
      f"{host.flags.writeable}")
if devices[0].platform == "cpu":
    claim(bool(zero_copy) and not host.flags.writeable,
          "on a CPU device_get returns a read-only view of the device buffer (no copy)")
else:
    print(f"on {devices[0].platform.upper()} the host array is a copy: the time above is a "
          "transfer")

# %% [markdown]
# On a CPU the "device" memory *is* host memory, so `np.asarray` and `jax.device_get` return a
# read-only view of the same buffer: no copy at all. On a GPU or TPU the same call copies the bytes
# over the interconnect (PCIe or similar) into a new host buffer; the time printed above is then the
# real transfer time, and a save waits for it. `minickpt` starts the transfers of all leaves at
# once (`copy_to_host_async`) before waiting for any, so they overlap.
#
# An array can also be **sharded**: split across several devices, each holding a piece. Here it
# is split across every device JAX sees (several CPU devices locally, one GPU on Colab), and
# `np.asarray` assembles the pieces into one host array:

# %%
from jax.sharding import Mesh, NamedSharding, PartitionSpec

split_over = devices
if len(devices) == 1:  # one GPU or TPU: a "split" into one piece shows nothing, so split
    try:               # over the host's CPU devices (the set-up cell asked JAX for 4)
        split_over = jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS names the accelerator alone: no CPU devices here
        pass
    print(f"JAX sees one {devices[0].platform.upper()} device: an array on it is one piece. "
          + (f"The same split over the host's {len(split_over)} CPU devices:"
             if len(split_over) > 1 else "No CPU devices to split over either:"))
mesh = Mesh(np.array(split_over), ("d",))
sharded = jax.device_put(jnp.arange(len(split_over) * 4.0).reshape(len(split_over), 4),
                         NamedSharding(mesh, PartitionSpec("d")))
for shard in sharded.addressable_shards:
    rows = shard.index[0]
    print(f"  {shard.device}: rows {rows.start}:{rows.stop} = {np.asarray(shard.data).tolist()}")
print(f"assembled on the host from {len(sharded.addressable_shards)} piece(s):",
      np.asarray(sharded).shape)

# %% [markdown]
# A host copy must also keep each leaf's exact type. `minickpt.tree.to_host` (you write it in
# lab 1) keeps `bfloat16` as `bfloat16` and turns a typed random key into its raw data plus the
# name of its generator, so it can be rebuilt on restore:

# %%
for leaf in (jnp.ones(2, jnp.bfloat16), rng):
    h = mtree.to_host(leaf)
    print(f"  {str(leaf.dtype):10s} -> {type(h).__name__}: {h!r}"[:120])

# %% [markdown]
# ## 7. One checkpoint on disk
#
# The checkpoint saved at step 200 is a directory named after its step, with one sub-directory per
# item and a metadata file:

# %%
def show_tree(root):
    """List a directory tree with file sizes, like `tree -s`."""
    root = Path(root)
    lines = [f"{root.name}/"]
    for path in sorted(root.rglob("*")):
        depth = len(path.relative_to(root).parts)
        size = "" if path.is_dir() else f"  ({path.stat().st_size:,} B)"
        lines.append("  " * depth + path.name + ("/" if path.is_dir() else "") + size)
    return lines


print("\n".join(show_tree(run_dir / f"step_{K}")))

# %% [markdown]
# The `minickpt` command line reads it without restoring anything. In a terminal you would type
# `minickpt inspect ch01-work/run`; here we call the same function in-process, which works the
# same locally and on Colab:

# %%
cli.main(["inspect", str(run_dir), "--item", "opt_state"])

# %%
cli.main(["ls", str(run_dir)])

# %% [markdown]
# The manifest is plain JSON, one line per leaf — a person can read it, and nothing in it can
# make the reader run code:

# %%
for line in (run_dir / f"step_{K}" / "params" / "manifest.json").read_text().splitlines()[:9]:
    print(line if len(line) <= 110 else line[:107] + "...")

# %% [markdown]
# ## 8. Flax's legacy API: `save_checkpoint` / `restore_checkpoint`
#
# Much existing code (and many tutorials) uses `flax.training.checkpoints`. Its semantics are
# worth knowing, and `minickpt` keeps them in `mc.save_checkpoint` / `mc.restore_checkpoint`:
#
# - the step is part of the name: `checkpoint_<step>`;
# - `keep=n` keeps the newest `n` checkpoints (the default is 1: the previous one is deleted!);
# - `restore_checkpoint` with nothing to restore **returns the target unchanged**, so "resume if
#   possible, else start fresh" needs no `if`;
# - saving a step that is not newer than the latest is refused unless `overwrite=True`. That is
#   what Flax's docstring promises, and what its *legacy* implementation (which `minickpt`
#   follows) does. Flax's current default is another implementation, backed by Orbax, and it
#   does not refuse (measured below).

# %%
legacy_dir = WORK / "legacy"
start = fresh_state()
print("restore from an empty directory returns the target itself:",
      mc.restore_checkpoint(legacy_dir, start) is start)
claim(mc.restore_checkpoint(legacy_dir, start) is start,
      "restore_checkpoint with nothing saved returns the target itself")

s, key = resumed_full, full["rng"]
for _ in range(3):
    s, key, _ = train(s, key, 10)
    mc.save_checkpoint(legacy_dir, s, step=int(s.step), keep=2)
print("on disk:", sorted(os.listdir(legacy_dir)))
print("restored step:", int(mc.restore_checkpoint(legacy_dir, start).step))
claim(sorted(os.listdir(legacy_dir)) == [f"checkpoint_{K + 20}", f"checkpoint_{K + 30}"],
      "keep=2 leaves the two newest checkpoints, the step in each name")
outdated = False
try:
    mc.save_checkpoint(legacy_dir, s, step=K + 10)
except ValueError as e:
    outdated = True
    print(type(e).__name__ + ":", e)
claim(outdated, "saving a step older than the latest is refused without overwrite=True")
with mc.CheckpointManager(WORK / "manager-order") as m:
    saved = [m.save(step, {"w": {"w": np.full(2, float(step))}}) for step in (30, 40, 35)]
    print("CheckpointManager.save at steps 30, 40, 35 returned", saved, "-> on disk:",
          m.all_steps())
    claim(saved == [True, True, False] and m.all_steps() == [30, 40],
          "CheckpointManager.save skips step 35 after 40 (returns False)", seen=saved)

# %% [markdown]
# Flax's own functions are on their way out: the legacy path warns that "Flax Checkpointing
# will soon be deprecated in favor of Orbax" (a `DeprecationWarning`, `flax/training/checkpoints.py`),
# and a later Flax may not have them, so the next cell checks first. Since Flax 0.7 `save_checkpoint` hands the work to
# Orbax when the flag `flax_use_orbax_checkpointing` is on (the default) *or* when it is passed
# an `orbax_checkpointer`; only the flag off and no checkpointer give the legacy implementation.
# The cell runs the same story with each, and once more with the flag off and a checkpointer
# passed: steps 30 and 40 with `keep=2`, then an *older* step, 35, then 35 again with
# `overwrite=True`.

# %%
try:
    import flax
    from flax.training import checkpoints as flax_checkpoints
except ImportError:
    flax_checkpoints = None
    print("this Flax no longer has flax.training.checkpoints; mc.save_checkpoint and "
          "mc.restore_checkpoint above keep its legacy semantics")


def flax_story(folder, **extra):
    """Save steps 30, 40 (keep=2), then 35, then 35 with overwrite=True; say what happened
    (and return it, step numbers on disk after each stage). ``extra`` goes to every save."""
    def save(step, **kw):
        flax_checkpoints.save_checkpoint(folder, {"w": jnp.full(2, float(step))}, step=step,
                                         keep=2, **extra, **kw)
        return sorted(os.listdir(folder))

    seen = {}
    seen["30, 40"] = save(30) and save(40)
    print("  after 30, 40:           ", seen["30, 40"])
    try:
        seen["35"] = save(35)
        print("  then 35:                ", seen["35"])
    except Exception as e:  # the legacy implementation refuses
        seen["35"] = ["refused"] + sorted(os.listdir(folder))
        print(f"  then 35:                 refused ({type(e).__name__})", sorted(os.listdir(folder)))
    seen["latest"] = Path(flax_checkpoints.latest_checkpoint(folder)).name
    print("  latest_checkpoint:      ", seen["latest"])
    seen["35, overwrite"] = save(35, overwrite=True)
    print("  then 35, overwrite=True:", seen["35, overwrite"])
    return {k: [int(n.split("_")[1]) if n != "refused" else n for n in v]
            if isinstance(v, list) else int(v.split("_")[1]) for k, v in seen.items()}


# What the next cell's text says Flax 0.12 does: the steps on disk after each stage.
FLAX_012 = {True: {"30, 40": [30, 40], "35": [35, 40], "latest": 40, "35, overwrite": [35]},
            False: {"30, 40": [30, 40], "35": ["refused", 30, 40], "latest": 40,
                    "35, overwrite": [30, 35]}}
stories = {}


if flax_checkpoints is not None:
    print("Flax restore from an empty directory returns the target itself:",
          flax_checkpoints.restore_checkpoint((WORK / "flax-empty").absolute(), target=start)
          is start)
    doc = " ".join(flax_checkpoints.save_checkpoint.__doc__.split())  # the docstring, one line
    promise = doc[doc.find("overwrite:"):doc.find("keep_every_n_steps:")].strip()
    print("Flax's docstring of save_checkpoint:", promise)
    if flax.__version__.startswith("0.12."):
        claim("current or a later step" in promise, "Flax 0.12 documents overwrite=False as "
              "refusing a save when a checkpoint at this or a later step exists", seen=promise)
    default = getattr(flax.config, "flax_use_orbax_checkpointing", None)
    for use_orbax in (True, False):
        name = "default, Orbax-backed" if use_orbax else "legacy"
        print(f"Flax {flax.__version__}, {name}{' (this Flax default)' if use_orbax == default else ''}:")
        try:
            flax.config.update("flax_use_orbax_checkpointing", use_orbax)
            stories[use_orbax] = flax_story(
                str((WORK / f"flax-{'orbax' if use_orbax else 'legacy'}").absolute()))
        except Exception as e:  # a deprecated API may change under us; say so and move on
            print(f"  failed here ({type(e).__name__}: {str(e)[:120]})")
    forced = None
    print(f"Flax {flax.__version__}, flag off, an orbax_checkpointer passed:")
    try:
        import orbax.checkpoint as ocp
        flax.config.update("flax_use_orbax_checkpointing", False)
        forced = flax_story(str((WORK / "flax-forced").absolute()),
                            orbax_checkpointer=ocp.Checkpointer(ocp.PyTreeCheckpointHandler()))
    except Exception as e:
        print(f"  failed here ({type(e).__name__}: {str(e)[:120]})")
    if default is not None:
        flax.config.update("flax_use_orbax_checkpointing", default)
    if flax.__version__.startswith("0.12."):
        claim(forced == FLAX_012[True], "with the flag off, passing an orbax_checkpointer still "
              "takes the Orbax-backed path: the same story as the default", seen=forced)
    for use_orbax, story in stories.items():
        words = (f"{'Orbax-backed' if use_orbax else 'legacy'} Flax keeps, after each stage, "
                 f"{FLAX_012[use_orbax]}")
        if flax.__version__.startswith("0.12."):
            claim(story == FLAX_012[use_orbax], words, seen=story)
        else:
            verdict(story == FLAX_012[use_orbax], words, seen=story,
                    otherwise=f"Flax {flax.__version__} behaves differently from the 0.12 this "
                              "text describes: read its own lines above")

# %% [markdown]
# What to read in that output (it depends on the Flax you have; this is what Flax 0.12 does):
#
# - **Legacy** refuses step 35 (`InvalidCheckpointError`) and leaves 30 and 40. With
#   `overwrite=True` it writes 35 and deletes every *newer* checkpoint, 40: "overwrite" means
#   "go back in time".
# - **Orbax-backed** accepts step 35 without a word and then applies `keep=2` by step number, so
#   30 is deleted and 35 and 40 remain; `latest_checkpoint` still answers 40, so a restart
#   ignores the step you just saved. With `overwrite=True` it too deletes 40 — and 30: only 35
#   is left.
#
# Only the legacy implementation keeps the promise printed from Flax's own docstring: with the
# default `overwrite=False`, a save when "a checkpoint at the current or a later step already
# exists" is an error. In Flax 0.12's source (`flax/training/checkpoints.py`) the check that
# raises it, `_check_overwrite_error`, is called on the legacy path only; the Orbax-backed path
# hands `overwrite` to Orbax as `force`, and Orbax refuses only a directory of the *same* step.
# So the default implementation breaks its documented contract for an older step, and code
# written for the documented behaviour can silently lose checkpoints under it. `minickpt` keeps
# the documented rule (refuse, or replace and drop the newer ones); its `CheckpointManager`
# skips a step that is not newer than the latest (`save` returns `False`, measured at the end of
# the first cell of this section).

# %% [markdown]
# ## 9. Orbax `StandardCheckpointer` beside `minickpt`
#
# Orbax is the checkpoint library of the JAX ecosystem; `StandardCheckpointer` saves one pytree
# into one directory. Here both libraries save the same three items of the step-200 state once,
# and we time each save (the first save of a process includes some one-off set-up; chapter 2's
# benchmark measures properly).

# %%
import orbax.checkpoint as ocp

items = {"params": resumed_full.params, "opt_state": resumed_full.opt_state, "rng": full["rng"]}
jax.block_until_ready(items)

orbax_dir = (WORK / "orbax" / f"step_{K}").absolute()  # Orbax wants an absolute path
ocp_ckptr = ocp.StandardCheckpointer()
t0 = time.perf_counter()
try:
    ocp_ckptr.save(orbax_dir, items)
except TypeError as e:  # older Orbax (0.5) cannot store a typed key: give it the raw data
    print(f"this Orbax ({ocp.__version__}) refuses the typed key ({e}); saving key_data instead")
    shutil.rmtree(orbax_dir, ignore_errors=True)
    items["rng"] = jax.random.key_data(items["rng"])
    ocp_ckptr.save(orbax_dir, items)
if hasattr(ocp_ckptr, "wait_until_finished"):  # Orbax saves in the background: wait for it
    ocp_ckptr.wait_until_finished()
t_orbax = time.perf_counter() - t0

mini_dir = WORK / "minickpt" / f"step_{K}"
mini_dir.parent.mkdir()
t0 = time.perf_counter()
mc.Checkpointer().save(mini_dir, items, step=K)
t_mini = time.perf_counter() - t0
print(f"one save of {meta.bytes:,} bytes of arrays: Orbax {t_orbax * 1e3:.0f} ms, "
      f"minickpt {t_mini * 1e3:.0f} ms")

restored_orbax = ocp_ckptr.restore(orbax_dir, items)
restored_mini = mc.Checkpointer().restore(mini_dir, items)
print("Orbax and minickpt restore the same values:",
      same_leaves(restored_orbax, items) and same_leaves(restored_mini, items))
claim(same_leaves(restored_orbax, items) and same_leaves(restored_mini, items),
      "Orbax and minickpt both restore exactly the values saved")

# %%
left, right = show_tree(orbax_dir), show_tree(mini_dir)
width = max(map(len, left)) + 4
print(f"{'Orbax StandardCheckpointer':{width}s}minickpt Checkpointer")
for a, b in zip(left + [""] * (len(right) - len(left)), right + [""] * (len(left) - len(right))):
    print(f"{a:{width}s}{b}")

# %% [markdown]
# The same state, two layouts:
#
# Two names first. **TensorStore** is Google's C++ library (with a Python API) for reading and
# writing large multi-dimensional arrays in chunks, on local disks and cloud object stores;
# Orbax hands it the array bytes. **OCDBT** ("optionally-cooperative distributed B+tree") is one
# of TensorStore's storage formats: a key-value store kept in a few large files plus a small
# B+tree index (the manifest), so that thousands of arrays need not become thousands of files.
#
# - **Orbax** stores all arrays of the tree in one OCDBT key-value store (`manifest.ocdbt` and the
#   content-addressed files under `d/`), written through TensorStore; `_METADATA` describes the
#   tree, `_CHECKPOINT_METADATA` the checkpoint. On a local disk it writes into a temporary
#   directory, adds `commit_success.txt` and renames the directory to its final name
#   (`AtomicRenameTemporaryPath.finalize` in `orbax/checkpoint/_src/path/atomicity.py`). For
#   `gs://` paths, and only for those, its default is `CommitFileTemporaryPath` instead
#   (`get_default_temporary_path_class` in `_src/path/atomicity_defaults.py` tests
#   `gcs_utils.is_gcs_path`): it writes *directly under the final name*, and only the
#   `commit_success.txt` written last marks the checkpoint as complete. Every other path —
#   `s3://` included — gets the rename. On S3 a "rename" is a copy of every object followed by
#   a delete (Orbax's paths are `etils.epath` paths, which send `s3://` to fsspec, whose `mv`
#   is `copy` then `rm`: `fsspec/spec.py`): not atomic, so a crash in the middle leaves part of
#   a checkpoint under its final name. On S3, ask for the commit file yourself (Orbax 0.12: `atomicity_options` of
#   `CheckpointManagerOptions`, with `AtomicityMode.COMMIT_FILE`). TensorStore fsyncs the
#   array files it writes; Orbax 0.12.8 itself fsyncs neither `commit_success.txt`,
#   `_CHECKPOINT_METADATA` and `_METADATA` (plain `Path.write_text`) nor the rename's directory.
# - **minickpt** keeps one directory per item with a raw `data.bin` and a readable
#   `manifest.json`, and `_CHECKPOINT_METADATA` with the checksum of every manifest. It also
#   writes into a temporary directory, fsyncs every file and directory, renames, and fsyncs
#   the parent, so that the rename itself is durable.
#
# The next cell asks Orbax which temporary path it would use for step 200 of a local run, of
# a `gs://` run and of an `s3://` run:

# %%
from etils import epath  # the path type Orbax uses, local or gs://

where = {}
for run in ("/tmp/run", "gs://bucket/run", "s3://bucket/run"):  # only asks: nothing written
    cls = ocp.path.atomicity_defaults.get_default_temporary_path_class(epath.Path(run))
    tmp = cls.from_final(epath.Path(run) / f"step_{K}")
    where[run] = (cls.__name__, str(tmp.get()), str(tmp.get_final()))
    print(f"{run:16s} {cls.__name__:26s} writes into {tmp.get()}")
ok = (where["gs://bucket/run"][1] == where["gs://bucket/run"][2]
      and where["/tmp/run"][1] != where["/tmp/run"][2]
      and where["s3://bucket/run"][0] == "AtomicRenameTemporaryPath")
text = ("on gs:// Orbax writes under the step's final name; on a local disk and on s3:// under "
        "a temporary one that it renames")
if ocp.__version__ == "0.12.8":  # the Orbax whose source this text was checked against
    claim(ok, text, seen=where)
else:
    verdict(ok, text, seen=where, otherwise=f"Orbax {ocp.__version__} chooses differently")

# %% [markdown]
# So with minickpt, and with Orbax on a local disk, a reader never sees a half-written directory
# under a step's name while the machine stays up, and a killed process leaves a complete
# checkpoint or none. With Orbax on `gs://` a half-written checkpoint *does* carry the
# step's name: a reader must look for `commit_success.txt` (Orbax's step listing does) and
# treat a directory without it as unfinished. On `s3://` the default rename is a copy: a
# crash during it leaves part of the checkpoint under the final name, with no marker telling
# a reader that it is unfinished. A *power cut* is another matter again: what was not
# fsynced can vanish. Chapter 2 crashes both libraries' saves on a local disk and counts what
# each can leave; the save times above are therefore not for the same guarantee.

# %% [markdown]
# ### 9b. Orbax's checkpointers, and checkpoints of several items
#
# Orbax has several names for "save this tree", and code you read will use all of them. A
# **checkpointer** does the directory work (temporary name, commit, metadata); a **handler**
# decides how the item's bytes are laid out; the **args** (`ocp.args.StandardSave(tree)`,
# `ocp.args.PyTreeSave(tree)`, `ocp.args.JsonSave(dict)`) say which handler an item takes.
#
# - `StandardCheckpointer` = an `AsyncCheckpointer` with the `StandardCheckpointHandler`: a
#   tree of arrays and numbers only; it writes in the background (hence its
#   `wait_until_finished`).
# - `PyTreeCheckpointer` = a synchronous `Checkpointer` with the `PyTreeCheckpointHandler`
#   (`args.PyTreeSave`): also leaves that are not arrays, such as strings.
# - `Checkpointer(PyTreeCheckpointHandler())` is the same thing spelled out — and it is what
#   Flax's `save_checkpoint` builds when you give it no checkpointer
#   (`flax/training/checkpoints.py`). So a Flax checkpoint *is* an Orbax PyTree checkpoint.
#
# The cell saves the same small tree three ways, and once more with a string leaf:

# %%
small = {"params": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, "step": jnp.asarray(7)}


def standard(path, tree):
    ck = ocp.StandardCheckpointer()
    ck.save(path, tree)
    ck.wait_until_finished()  # it writes in the background


ways = {
    "StandardCheckpointer": standard,
    "PyTreeCheckpointer, PyTreeSave": lambda path, tree: ocp.PyTreeCheckpointer().save(
        path, args=ocp.args.PyTreeSave(tree)),
    "Checkpointer(PyTreeCheckpointHandler())": lambda path, tree: ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler()).save(path, tree),
}
files, takes_str = {}, {}
for k, (name, save) in enumerate(ways.items()):
    save((WORK / "ways" / f"{k}-arrays").absolute(), small)  # Orbax wants absolute paths
    files[name] = sorted(os.listdir(WORK / "ways" / f"{k}-arrays"))
    try:
        save((WORK / "ways" / f"{k}-str").absolute(), {**small, "note": "lr=1e-3"})
        takes_str[name] = "_strings.json" in os.listdir(WORK / "ways" / f"{k}-str")
    except (TypeError, ValueError) as e:
        takes_str[name] = False
        print(f"{name} refuses the str leaf: {type(e).__name__}: {str(e)[:60]}")
    print(f"{name:40s} str leaf in _strings.json: {takes_str[name]!s:5s} arrays: {files[name]}")
print("classes:", [c.__name__ for c in ocp.StandardCheckpointer.__mro__[:3]],
      [c.__name__ for c in ocp.PyTreeCheckpointer.__mro__[:2]])
claim(len({tuple(v) for v in files.values()}) == 1
      and takes_str == {"StandardCheckpointer": False, "PyTreeCheckpointer, PyTreeSave": True,
                        "Checkpointer(PyTreeCheckpointHandler())": True},
      "the three write the same files for arrays; only StandardCheckpointer refuses a str "
      "leaf, the other two put it in _strings.json",
      seen=takes_str)

# %% [markdown]
# Same files for the same arrays: the three are one format. The difference is what they
# accept (the `str` leaf goes to `_strings.json` in the PyTree handler) and whether the save
# returns before the bytes are written.
#
# A training checkpoint is usually several **items**: the state, a config, the data loader's
# position. Orbax's `CheckpointManager` takes them as `ocp.args.Composite(name=args, ...)`;
# each name becomes a directory of the step, each with its own handler, and a restore can ask
# for some items by name only. A single item without `Composite` is called `default`.
# minickpt's items are the keys of the dictionary you save.

# %%
config = {"lr": 1e-3, "layers": 2}
with ocp.CheckpointManager((WORK / "orbax-items").absolute()) as m:
    m.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(small),
                                      config=ocp.args.JsonSave(config)))
    m.wait_until_finished()
    just_config = m.restore(5, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
with ocp.CheckpointManager((WORK / "orbax-single").absolute()) as m:
    m.save(5, args=ocp.args.StandardSave(small))
    m.wait_until_finished()
with mc.CheckpointManager(WORK / "mini-items") as m:
    m.save(5, {"state": small, "config": {"lr": np.float32(1e-3), "layers": np.int32(2)}})
orbax_step = [n for n in sorted(os.listdir(WORK / "orbax-items" / "5")) if not n.startswith("_")]
single = [n for n in sorted(os.listdir(WORK / "orbax-single" / "5")) if not n.startswith("_")]
mini_step = [n for n in sorted(os.listdir(WORK / "mini-items" / "step_5")) if not n.startswith("_")]
print("Orbax, Composite(state=..., config=...):", orbax_step)
print("Orbax, one item without Composite:      ", single)
print("minickpt, save(5, {'state', 'config'}): ", mini_step)
print("Orbax restore of the item 'config' only:", dict(just_config.items()))
claim({"state", "config"} <= set(orbax_step) and "default" in single
      and mini_step == ["config", "state"] and list(just_config.keys()) == ["config"]
      and just_config["config"] == config,
      "Composite items become directories named state and config (a lone item: default), "
      "and a restore by name returns that item only")

# %% [markdown]
# ## 10. Common misconceptions
#
# **"The weights are all I need to continue training."** The weights are what the model knows;
# the optimizer state is how it is learning. Section 2 measured it: restoring only the weights
# made Adam's next step move every weight by about the full learning rate, the loss jumped by a
# factor of tens to hundreds (the table), and tens of steps went to getting back where the
# checkpoint was. Save $\theta$, $m$ (and $v$), $t$ and $r$ — the whole `TrainState` plus the key.
#
# **"Restoring when nothing is saved crashes, so guard it with `os.path.exists`."** Flax's
# `restore_checkpoint` (and `mc.restore_checkpoint`) return the target unchanged when there is
# nothing to restore, so the same code starts fresh or resumes. `CheckpointManager.restore` is
# stricter on purpose and raises `CheckpointNotFoundError`; ask `latest_step()` first.
#
# **"A resumed loss that differs in the last digits means the checkpoint is broken."** On a CPU
# the resume above was identical bit for bit (a claim the notebook checks). On GPUs a restarted
# process may pick other kernels (autotuning) and some reductions use atomics, so the last digits
# may differ even from a perfect checkpoint unless determinism is switched on: check that the step
# continues where it should and that the loss stays on the same scale (chapter 3).
#
# **"JAX arrays are just arrays: `msgpack.dumps` or `np.save` will do."** `msgpack.dumps` fails
# on JAX arrays, `np.save` loses `bfloat16`, and neither stores a typed random key. Bring the tree
# to the host and store each leaf with its path, dtype and shape.
#
# **"Pickle is fine for my own files."** Loading a pickle runs whatever function the file names.
# Files travel: between people, from the internet, into shared storage. A checkpoint format
# must be data only.
#
# **"`np.asarray` on a JAX array always copies."** On a CPU it is a zero-copy, read-only view of
# the device buffer; on a GPU or TPU it is a copy over the interconnect that the save has to wait
# for.
#
# Two more from the same list belong to later chapters: saving at *every* step (chapter 2:
# how often and how many) and letting *every* device write its own copy (chapter 4: multi-host).

# %% [markdown]
# ## Summary
#
# - A checkpoint is the whole training state $\mathcal{S}_t = (\theta_t, m_t, t, r_t)$. Without
#   Adam's $m$, $v$ and step, a resumed run takes full-size steps, its loss jumps, and tens of
#   steps go to winning back what the checkpoint already held (compute paid twice). optax counts
#   its steps inside `opt_state` (Adam's `count`, the schedule's `count`) and never reads
#   `TrainState.step`: restoring the step without `opt_state` restarts a warm-up schedule.
# - JAX states are pytrees; a checkpoint stores their leaves under key paths, as strings, so they
#   fit back into any container of the same shape. `apply_fn` and `tx` are code, not data: your
#   program rebuilds them and restores the data into them.
# - `msgpack.dumps` cannot store JAX arrays; `flax.serialization` can (but not typed keys); npy
#   loses `bfloat16`; pickle runs code on load and is never used for checkpoints.
# - Saving starts with a device-to-host copy: free on a CPU, a real transfer on a GPU or TPU.
# - On disk a checkpoint is `step_<N>/` with one directory per item and its metadata;
#   `minickpt inspect` and `minickpt ls` show it. Flax's legacy API puts the step in the name,
#   keeps `keep` checkpoints and returns the target when there is nothing to restore; Orbax's
#   `StandardCheckpointer` does the same job with another layout. `PyTreeCheckpointer` and
#   Flax's `Checkpointer(PyTreeCheckpointHandler())` write the same format and also take
#   non-array leaves; `ocp.args.Composite` makes a step of several named items.
#
# ## Lab 1
#
# In [lab 1](../labs/lab01_basics/lab01_basics.ipynb) you write these pieces of `minickpt`
# yourself and plug them into the library: key-path flattening and its inverse (task 1.1), the
# host snapshot that keeps dtypes (1.2), writing and reading one item (1.3), and a restore that
# returns the target when nothing is saved (1.4).
