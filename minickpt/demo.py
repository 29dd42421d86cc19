"""A tiny, fully deterministic Flax/Optax training run — and a crash-and-resume demo.

The chapters, labs, tests and drills all need "a real training run" that is small enough for a
2-core laptop. This module is that run: a two-layer MLP regressing a fixed random function,
trained with Adam, with dropout so that the RNG key is part of the state that must be saved.
Every batch is a pure function of the step number, so a resumed run sees exactly the data the
uninterrupted run saw, and (on CPU) ends bit-for-bit identical.

``python -m minickpt.demo`` trains uninterrupted, then trains again in a subprocess that is
killed with SIGKILL mid-run, restarts it, and checks that the resumed run ends identical.
It needs the course extras (flax, optax).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .fs import FileSystem
from .launch import helper_env
from .restore import resume

IN_DIM, HIDDEN, OUT_DIM, BATCH = 8, 32, 1, 32


def _flax() -> tuple[Any, Any, Any]:
    import flax.linen as nn
    import optax
    from flax.training import train_state

    return nn, optax, train_state


@functools.cache
def make_model() -> Any:
    """The model: one instance per process. A state's ``apply_fn`` and ``tx`` are static
    parts of its tree, so a model (or an optimizer) made afresh for each state made
    :func:`train_step` compile again for each (about a CPU-second: a test that trains ten
    states spent most of its time compiling)."""
    nn, _, _ = _flax()

    class MLP(nn.Module):
        hidden: int = HIDDEN

        @nn.compact
        def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
            x = nn.relu(nn.Dense(self.hidden)(x))
            x = nn.Dropout(0.1, deterministic=not train)(x)
            return nn.Dense(OUT_DIM)(x)

    return MLP()


def make_state(seed: int = 0, learning_rate: float = 1e-2, optimizer: str = "adam") -> Any:
    """A fresh ``TrainState`` (params, Adam's moments, step) plus its dropout key."""
    _, _, train_state = _flax()
    model = make_model()
    params = model.init(jax.random.key(seed), jnp.ones((1, IN_DIM)), train=False)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=make_optimizer(optimizer, learning_rate))


@functools.cache
def make_optimizer(name: str, learning_rate: float) -> Any:
    """One optimizer per setting (see :func:`make_model`)."""
    _, optax, _ = _flax()
    return optax.adam(learning_rate) if name == "adam" else optax.sgd(learning_rate)


def batch(step: int, data_seed: int = 1234) -> tuple[jax.Array, jax.Array]:
    """The batch of ``step``: a pure function of the step, so a resumed run sees the same data."""
    k = jax.random.fold_in(jax.random.key(data_seed), step)
    x = jax.random.normal(k, (BATCH, IN_DIM))
    w = jnp.linspace(-1.0, 1.0, IN_DIM)[:, None]
    y = jnp.sin(x @ w) + 0.1 * jnp.cos(3.0 * x[:, :1])
    return x, y


@jax.jit
def train_step(state: Any, rng: jax.Array, x: jax.Array, y: jax.Array
               ) -> tuple[Any, jax.Array, jax.Array]:
    """One Adam step with dropout; returns the new state, the next key and the loss."""
    rng, dropout_key = jax.random.split(rng)

    def loss_fn(params: Any) -> jax.Array:
        pred = state.apply_fn(params, x, train=True, rngs={"dropout": dropout_key})
        return jnp.mean((pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), rng, loss


def train(state: Any, rng: jax.Array, start: int, stop: int, *, callback: Any = None
          ) -> tuple[Any, jax.Array, list[float]]:
    """Steps ``start+1 .. stop``; ``callback(step, state, rng, loss)`` after each."""
    losses = []
    for step in range(start + 1, stop + 1):
        x, y = batch(step)
        state, rng, loss = train_step(state, rng, x, y)
        losses.append(float(loss))
        if callback is not None:
            callback(step, state, rng, float(loss))
    return state, rng, losses


def helper_device() -> Any:
    """The device a helper process started with :func:`minickpt.launch.helper_env` computes
    on: the CPU. A parent that compares its own run with a helper's (bit for bit) computes
    under ``jax.default_device(helper_device())``: the same platform, the same bits. None
    where this process has no CPU backend (``JAX_PLATFORMS`` names only an accelerator)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def fingerprint(tree: Any) -> str:
    """A SHA-256 of every leaf's bytes: equal fingerprints mean bit-identical states."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# the worker: a training process that checkpoints and resumes
# ---------------------------------------------------------------------------------------
class SlowDisk(FileSystem):
    """A disk whose every fsync takes ``delay`` seconds longer, like a busy network disk:
    it makes a save last long enough for a recovery drill to kill the process inside it."""

    def __init__(self, delay: float):
        self.delay = delay

    def fsync(self, fd: int) -> None:
        time.sleep(self.delay)
        super().fsync(fd)

    def fsync_all(self, fds: Sequence[int] = (), dirs: Sequence[str] = ()) -> None:
        """One fsync at a time (this disk gathers none into a group commit), so that a save
        stays as long as its number of fsyncs says."""
        for fd in fds:
            self.fsync(fd)
        for d in dirs:
            self.fsync_dir(d)


def worker(ckpt_dir: str, total: int, every: int, sleep: float, *, preemptible: bool = False,
           slow_fsync: float = 0.0, monitor: bool = False, forget_rng: bool = False,
           lockstep: bool = False) -> None:
    """Train to ``total`` steps, saving every ``every``, resuming from the latest checkpoint.

    Prints one line per event, the protocol :mod:`minickpt.production.drill` reads:
    ``resumed from step N``, ``step N`` (step N computed), ``saving step N`` (a save begins),
    ``saved step N``, then ``final <fingerprint>`` or ``preempted at step N``.
    ``forget_rng`` resumes with a fresh dropout key instead of the saved one: the mistake a
    drill must catch. ``lockstep`` waits for a line on stdin after each ``step N`` line, so a
    reader that kills the worker after step N does so before step N + 1 begins, however far
    behind the reader runs on a loaded machine.
    """
    from . import CheckpointManager, CheckpointManagerOptions
    from .production.preemption import PreemptionHandler, train_until_preempted

    state, rng = make_state(), jax.random.key(42)
    opts = CheckpointManagerOptions(save_interval_steps=every, max_to_keep=3)
    fs = SlowDisk(slow_fsync) if slow_fsync > 0 else None
    with CheckpointManager(ckpt_dir, opts, fs=fs) as mngr:
        if preemptible:
            PreemptionHandler().attach(mngr)
        if monitor:
            from .production.monitoring import attach_monitor

            attach_monitor(mngr)

        def announce(event: str, rec: dict[str, Any]) -> None:
            if event == "save" and rec.get("ok"):
                print(f"saved step {rec['step']}", flush=True)

        mngr.listeners.append(announce)
        state, rng, first = resume(mngr, state, rng)  # task 3.3
        start = first - 1  # the last step already done
        if start > 0:
            if forget_rng:
                rng = jax.random.key(start)
            print(f"resumed from step {start}", flush=True)

        def step_fn(carry: Any, step: int) -> tuple[Any, dict[str, float]]:
            st, key = carry
            st, key, loss = train_step(st, key, *batch(step))
            loss = float(loss)
            time.sleep(sleep)  # stands for a longer step
            return (st, key), {"loss": loss}

        def on_step(step: int, carry: Any, metrics: Any) -> None:
            print(f"step {step}", flush=True)
            if lockstep and not sys.stdin.readline():
                raise SystemExit(f"the drill went away after step {step}")
            if mngr.should_save(step):
                print(f"saving step {step}", flush=True)

        res = train_until_preempted(mngr, (state, rng), step_fn, start=start, stop=total,
                                    items=lambda c: {"state": c[0], "rng": c[1]},
                                    on_step=on_step)
    if res.preempted:
        print(f"preempted at step {res.step}", flush=True)
        return
    print(f"final {fingerprint(res.carry)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=37, help="kill the first run after this step")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--preemptible", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--slow-fsync", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--monitor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--forget-rng", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.dir, a.steps, a.every, a.sleep, preemptible=a.preemptible,
               slow_fsync=a.slow_fsync, monitor=a.monitor, forget_rng=a.forget_rng,
               lockstep=a.lockstep)
        return 0

    ckpt_dir = a.dir or tempfile.mkdtemp(prefix="minickpt-demo-")
    cpu = helper_device()  # the worker runs on the CPU (helper_env): so does its reference
    print(f"1. uninterrupted run of {a.steps} steps (on {cpu or jax.devices()[0]})")
    with jax.default_device(cpu):
        state, rng, losses = train(make_state(), jax.random.key(42), 0, a.steps)
        reference = fingerprint((state, rng))
    print(f"   final loss {losses[-1]:.5f}, state fingerprint {reference}")

    cmd = [sys.executable, "-m", "minickpt.demo", "--worker", "--dir", ckpt_dir,
           "--steps", str(a.steps), "--every", str(a.every)]
    print(f"2. the same run in a subprocess, saving every {a.every} steps into {ckpt_dir}")
    env = helper_env()  # JAX_PLATFORMS=cpu: this process may hold the only accelerator
    # lockstep: the worker waits for a line from us after each step, so the kill lands right
    # after step kill_at, not wherever the worker had got to by the time we read its line
    proc = subprocess.Popen([*cmd, "--sleep", "0.02", "--lockstep"], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, env=env)
    killed_at = None
    assert proc.stdout is not None and proc.stdin is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= a.kill_at:
            proc.send_signal(signal.SIGKILL)
            killed_at = int(line.split()[1])
            break
        if time.monotonic() > deadline:
            proc.kill()
            break
        if line.startswith("step "):
            proc.stdin.write("\n")
            proc.stdin.flush()
    proc.wait(timeout=60)
    print(f"   killed with SIGKILL after step {killed_at} (exit code {proc.returncode})")
    print("3. restarting it: it finds the latest checkpoint and resumes")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        print(f"   the restarted worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return 1
    out = done.stdout
    resumed = next(line for line in out.splitlines() if line.startswith("resumed"))
    final = next(line for line in out.splitlines() if line.startswith("final")).split()[1]
    print(f"   {resumed}; final state fingerprint {final}")
    same = final == reference
    print(f"4. resumed run identical to the uninterrupted one: {'YES' if same else 'NO'}")
    print(f"\n$ minickpt ls {ckpt_dir}")
    from .cli import main as cli_main

    cli_main(["ls", ckpt_dir])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
