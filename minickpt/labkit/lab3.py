"""Lab 3 (resume): manifests, a changed model, the loss, and the SIGKILL drill."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .checks import LabCheckError, check, expect_raises, same, tree_diff
from .devices import resume_rtol
from .plugging import plugged_in
from .temporaries import tempdir
from .watch import Reports, without_references


def lab3_manifest(tree: Any, item: str = "state") -> Any:
    """The validated manifest of ``tree`` saved as one item (what task 3.2 compares against)."""
    from ..checkpointer import Checkpointer

    with tempdir() as d:
        path = f"{d}/step_1"
        Checkpointer().save(path, {item: tree}, step=1)
        return Checkpointer().manifest(path, item)


def lab3_new_state(seed: int = 1, *, dtype: Any = None) -> Any:
    """The *new* model's fresh ``TrainState`` for task 3.4: the course's MLP with its layers
    renamed (``Dense_0`` -> ``encoder``, ``Dense_1`` -> ``head``) and a layer added
    (``adapter``, a residual Dense initialised to zero, so the migrated model computes what
    the old one did). ``dtype`` casts the parameters and Adam's moments."""
    import flax.linen as nn
    import optax
    from flax.training import train_state as ts

    from ..demo import HIDDEN, IN_DIM, OUT_DIM

    class NewMLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
            h = nn.relu(nn.Dense(HIDDEN, name="encoder")(x))
            h = h + nn.Dense(HIDDEN, name="adapter", kernel_init=nn.initializers.zeros)(h)
            h = nn.Dropout(0.1, deterministic=not train)(h)
            return nn.Dense(OUT_DIM, name="head")(h)

    model = NewMLP()
    params = model.init(jax.random.key(seed), jax.numpy.ones((1, IN_DIM)), train=False)
    if dtype is not None:
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    state = ts.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    return state.replace(step=jax.numpy.asarray(0, jax.numpy.int32))


def lab3_loss(state: Any, rng: jax.Array, step: int) -> float:
    """The loss of ``state`` on the batch of ``step`` (dropout off): the same scale for the
    old model and a migrated new one."""
    from ..demo import batch

    x, y = batch(step)
    pred = state.apply_fn(state.params, x, train=False)
    return float(jax.numpy.mean((pred - y) ** 2))


_LAB3_DRIVER = """
import sys
from minickpt import demo, labkit
from minickpt.labkit import watch
_w, _plug, _run, _argv = watch.worker(), labkit.plugged_in, demo.worker, list(sys.argv)
ns = _w.namespace(labkit.lab3_namespace())
with open(sys.argv[1]) as f:
    exec(compile(f.read(), "your resume (task 3.3)", "exec"), ns)
with _plug(_w.wrap(ns["resume"])):
    _run(_argv[2], int(_argv[3]), int(_argv[4]), float(_argv[5]))
"""


def lab3_namespace() -> dict[str, Any]:
    """What a student's task 3.3 code sees in the training subprocess: the names the lab's
    setup cell imports (and a few more of the same modules)."""
    import collections.abc
    import typing

    import jax.numpy as jnp

    import minickpt as mc

    from .. import errors, manager, restore, tree

    ns: dict[str, Any] = {"__name__": "lab03_student"}
    for mod in (typing, collections.abc, errors, tree, restore, manager):
        ns.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    ns.update(jax=jax, jnp=jnp, np=np, mc=mc, lab=sys.modules[__name__], check=check,
              same=same, expect_raises=expect_raises, plugged_in=plugged_in)
    return without_references(ns)


def lab3_drill(resume_fn: Callable[..., Any], *, steps: int = 15, every: int = 5,
               kill_after: int | None = None, timeout_s: float = 50.0) -> dict[str, Any]:
    """The crash drill of task 3.3: minickpt.demo's training worker, with ``resume_fn`` in place
    of the library's ``resume``, runs in a subprocess; it is killed with SIGKILL right after
    a step that is not a save step (drawn at random unless ``kill_after``), restarted, and
    left to finish. Returns what happened: the steps each run printed, the checkpoint on
    disk at the restart, the restart's exit code and output, and the difference between
    its final checkpoint and an uninterrupted run (``diff``, None when identical within
    :func:`resume_rtol`)."""
    import os
    import random
    import signal
    import subprocess
    import textwrap

    from ..manager import CheckpointManager, CheckpointManagerOptions

    fn = inspect.unwrap(resume_fn)
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise LabCheckError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} to "
                            f"run it in a training process: {e}") from None
    if getattr(fn, "__name__", None) != "resume":
        raise LabCheckError("the drill runs your function called resume")
    if kill_after is None:
        choices = [s for s in range(every + 1, steps - every) if s % every]  # a save to come
        kill_after = random.Random().choice(choices)
    out: dict[str, Any] = {"kill_after": kill_after}
    with tempdir() as d, Reports([resume_fn]) as reports:
        code = os.path.join(d, "resume_task_3_3.py")
        with open(code, "w") as f:
            f.write(textwrap.dedent(src))
        ckpt = os.path.join(d, "run")
        cmd = [sys.executable, "-c", _LAB3_DRIVER, code, ckpt, str(steps), str(every), "0.02"]
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(d, "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        env = reports.env(env)
        first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, env=env,
                                 pass_fds=reports.pass_fds)
        lines = []
        try:
            assert first.stdout is not None
            for line in first.stdout:
                lines.append(line.strip())
                if line.strip() == f"step {kill_after}":
                    first.send_signal(signal.SIGKILL)
                    break
            else:
                first.wait(timeout=timeout_s)
                err = first.stderr.read() if first.stderr else ""
                out.update(first_failed=True, first_rc=first.returncode, first_out=lines,
                           first_err=err[-3000:])
                return out
            rest, _ = first.communicate(timeout=timeout_s)
            lines += [x.strip() for x in rest.splitlines()]
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        out.update(first_failed=False, first_rc=first.returncode, first_out=lines)
        out["on_disk"] = None
        if os.path.isdir(ckpt):
            with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
                out["on_disk"] = m.latest_step()
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                env=env, pass_fds=reports.pass_fds)
        out.update(second_rc=second.returncode, second_out=second.stdout.splitlines(),
                   second_err=second.stderr[-3000:])
        done = [int(x.split()[1]) for x in out["second_out"] if x.startswith("step ")]
        resumed = [int(x.split()[3]) for x in out["second_out"]
                   if x.startswith("resumed from step ")]
        out.update(second_steps=done, resumed_from=resumed[0] if resumed else 0)
        out["diff"] = "the restarted run did not finish"
        if second.returncode == 0:
            from ..demo import fingerprint, make_state
            from ..demo import train as demo_train

            ref_state, ref_rng, _ = demo_train(make_state(), jax.random.key(42), 0, steps)
            final = [x.split()[1] for x in out["second_out"] if x.startswith("final ")]
            out["identical"] = bool(final) and final[0] == fingerprint((ref_state, ref_rng))
            with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
                if m.latest_step() != steps:
                    out["diff"] = f"the last checkpoint is step {m.latest_step()}, not {steps}"
                else:
                    got = m.restore(target={"state": ref_state, "rng": ref_rng})
                    out["diff"] = tree_diff((got["state"], got["rng"]), (ref_state, ref_rng),
                                            rtol=resume_rtol())
    return out
