"""Lab 3 (resume): manifests, a changed model, the loss, and the SIGKILL drill."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..launch import helper_env
from .checks import LabCheckError, check, expect_raises, same, tree_diff
from .devices import resume_rtol
from .plugging import graded_build, own_task_functions, plugged_in, task_sources
from .processes import DRILL_KEY, launch_options, read_tail, source_of
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
    from flax.training import train_state as ts

    from ..demo import IN_DIM, make_optimizer

    model = _new_model()
    params = model.init(jax.random.key(seed), jax.numpy.ones((1, IN_DIM)), train=False)
    if dtype is not None:
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    state = ts.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=make_optimizer("adam", 1e-2))
    return state.replace(step=jax.numpy.asarray(0, jax.numpy.int32))


@functools.cache
def _new_model() -> Any:
    """The new model of task 3.4, one per process (as :func:`minickpt.demo.make_model`: a
    jitted step compiles once for all its states)."""
    import flax.linen as nn

    from ..demo import HIDDEN, OUT_DIM

    class NewMLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
            h = nn.relu(nn.Dense(HIDDEN, name="encoder")(x))
            h = h + nn.Dense(HIDDEN, name="adapter", kernel_init=nn.initializers.zeros)(h)
            h = nn.Dropout(0.1, deterministic=not train)(h)
            return nn.Dense(OUT_DIM, name="head")(h)

    return NewMLP()


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
    _run(_argv[2], int(_argv[3]), int(_argv[4]), float(_argv[5]), lockstep=True)
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
    # on the graded build the student's other lab 3 cells run here too, and may call lab 1's
    # functions the lab's setup imports (flatten_with_names): only lab 3's are left out there
    return without_references(ns, lab="3" if graded_build() else None)


def lab3_drill(resume_fn: Callable[..., Any], *, steps: int = 15, every: int = 5,
               kills: int = 2, kill_after: Sequence[int] | int | None = None,
               timeout_s: float = 50.0) -> dict[str, Any]:
    """The crash drill of task 3.3: minickpt.demo's training worker, with ``resume_fn`` in place
    of the library's ``resume``, runs in a subprocess; it is killed with SIGKILL right after
    a step drawn at random once the run is under way (``kills`` times, each time after the
    step it resumed from; ``kill_after`` fixes the steps instead, for tests), restarted each
    time, and the last run is left to finish.

    Returns what happened (:func:`run_lab3_drill`). Read it with :func:`drill_message`.

    Under the judge (``autograder.judge``) the drill the test asks for is the grader's own
    (``autograder.drills``): the student's lab 3 code in sandboxed workers, from a checkpoint
    of a run of a seed drawn at grading time, judged in the grader's process; the test's
    checks read what it returns, and the test's grader check reads that same run's verdict."""
    import textwrap

    graders = launch_options(DRILL_KEY).get(DRILL_KEY)
    if graders is not None and kill_after is None and getattr(resume_fn, "__name__", "") == \
            "resume":
        return graders("3.3", steps=steps, every=every, kills=kills, timeout_s=timeout_s)
    fn = inspect.unwrap(resume_fn)
    try:
        src = source_of(fn)  # under the judge: the student's code its proxy stands for
    except (OSError, TypeError) as e:
        raise LabCheckError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} to "
                            f"run it in a training process: {e}") from None
    if getattr(fn, "__name__", None) != "resume":
        raise LabCheckError("the drill runs your function called resume")
    if graded_build():  # minickpt calls the student's other lab 3 tasks there: ship them too
        others = [f for f in own_task_functions("3") if f.__name__ != "resume"]
        src = (task_sources(others) + "\n\n" if others else "") + textwrap.dedent(src)
    with tempdir() as d, Reports([resume_fn]) as reports:
        return run_lab3_drill(textwrap.dedent(src), d, steps=steps, every=every, kills=kills,
                              kill_after=kill_after, timeout_s=timeout_s,
                              env=reports.env(helper_env()), pass_fds=reports.pass_fds,
                              **launch_options("wrap", "after_run"))


def run_lab3_drill(src: str, d: str, *, steps: int = 15, every: int = 5, kills: int = 2,
                   kill_after: Sequence[int] | int | None = None, timeout_s: float = 50.0,
                   env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = (),
                   python: str = sys.executable,
                   wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
                   plant_seed: int | None = None, after_run: Callable[[], None] | None = None
                   ) -> dict[str, Any]:
    """The drill itself, on the code ``src`` (defines ``resume``) in the folder ``d``. The
    grader runs it from its own process (autograder/drills.py): ``wrap`` puts the workers'
    command (and its environment) in the submission's sandbox, ``after_run`` makes sure a killed worker's processes
    are gone, and ``plant_seed`` leaves a checkpoint of step ``every`` from a run of another
    seed in the folder before the first start, so that only a resume that restores what is on
    disk ends where the reference does.

    Returns ``runs``, one dict per process started (``steps`` it computed and ``resumed_from``
    as it printed them, 0 for none; ``on_disk``, the newest committed step when it started, as
    this process read it; ``killed_after``, ``rc``, ``err``), ``planted`` (the planted step or
    None) and ``diff``, the difference between the final checkpoint and the uninterrupted run
    (None when identical within :func:`resume_rtol`), ``identical`` (the final fingerprints are
    equal)."""
    import os
    import random
    import signal
    import subprocess
    import threading

    from ..manager import CheckpointManager
    from ..options import CheckpointManagerOptions

    fixed = [kill_after] if isinstance(kill_after, int) else list(kill_after or [])
    if fixed:
        kills = len(fixed)
    chance = random.SystemRandom()  # the kill steps: chosen by nobody
    out: dict[str, Any] = {"steps": steps, "every": every, "runs": [], "planted": None,
                           "kills": kills}

    def go_on(proc: subprocess.Popen[str]) -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        except OSError:
            pass  # it died: what it printed says how

    def latest(ckpt: str) -> int | None:
        if not os.path.isdir(ckpt):
            return None
        with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
            return m.latest_step()

    from ..demo import fingerprint, helper_device, make_state
    from ..demo import train as demo_train

    cpu = helper_device()  # the uninterrupted run on the worker's platform: same bits
    ckpt = os.path.join(d, "run")
    with jax.default_device(cpu):
        if plant_seed is None:
            start = (make_state(), jax.random.key(42), 0)
        else:  # another run's checkpoint: the worker must go on from *it*
            planted = demo_train(make_state(seed=plant_seed), jax.random.key(plant_seed), 0,
                                 every)
            start = (planted[0], planted[1], every)
            opts = CheckpointManagerOptions(save_interval_steps=every, max_to_keep=3)
            with CheckpointManager(ckpt, opts) as m:
                m.save(every, {"state": planted[0], "rng": planted[1]})
            out["planted"] = every
    code = os.path.join(d, "resume_task_3_3.py")
    with open(code, "w") as f:
        f.write(src)
    # the worker trains on the CPU (JAX_PLATFORMS=cpu): on one accelerator this notebook
    # holds the device, and a second process cannot open it
    env = {**(env if env is not None else helper_env()), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(d, "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    cmd = [python, "-c", _LAB3_DRIVER, code, ckpt, str(steps), str(every), "0.02"]
    cmd = wrap(cmd, env) if wrap is not None else cmd
    for i in range(kills + 1):
        run: dict[str, Any] = {"on_disk": latest(ckpt), "killed_after": None,
                               "resumed_from": 0, "steps": []}
        out["runs"].append(run)
        # lockstep: the worker waits for our line after each step, so the kill lands
        # right after the step we chose even when this process runs behind
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE, text=True, env=env,
                                pass_fds=tuple(pass_fds))
        watchdog = threading.Timer(2 * timeout_s, proc.kill)  # a worker that hangs or babbles
        watchdog.start()
        tail: list[str] = []  # its stderr, read as it comes: a traceback of a thousand frames
        reader = threading.Thread(target=read_tail, args=(proc.stderr, tail), daemon=True)
        reader.start()  # would fill the pipe, and the worker would wait on it for the watchdog
        proc.stderr = None  # (the reader's alone: communicate below reads stdout only)
        target = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.strip()
                if line.startswith("resumed from step "):
                    run["resumed_from"] = _number(line.split()[3])
                elif line.startswith("step "):
                    step = _number(line.split()[1])
                    run["steps"].append(step)
                    if i < kills and target is None:
                        first = run["resumed_from"] + 1
                        if fixed:
                            target = fixed[i]
                        elif first + 1 <= steps - 1:  # one step done, one still to do
                            target = chance.randint(first + 1, steps - 1)
                    if target is not None and step >= target:
                        proc.send_signal(signal.SIGKILL)
                        run["killed_after"] = step
                        break
                    go_on(proc)
                elif line.startswith("final "):
                    run["final"] = line.split()[1]
                if len(run["steps"]) > 4 * steps:
                    break  # a worker that prints without end
            rest, _ = proc.communicate(timeout=timeout_s)
            for line in rest.splitlines()[:4 * steps]:  # what it printed before it died
                if line.startswith("step "):
                    run["steps"].append(_number(line.split()[1]))
                elif line.startswith("final "):
                    run["final"] = line.split()[1]
            reader.join(timeout=5)
            run["err"] = "".join(tail)[-3000:]
        except subprocess.TimeoutExpired:
            run["err"] = f"still running after {timeout_s:.0f} s"
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if after_run is not None:
                after_run()
        run["rc"] = proc.returncode
        if run["killed_after"] is None:
            break  # it ended by itself (finished or failed): no restart
    out["diff"] = "the last run did not finish"
    last = out["runs"][-1]
    if last["rc"] == 0:
        with jax.default_device(cpu):
            ref_state, ref_rng, _ = demo_train(start[0], start[1], start[2], steps)
            out["identical"] = last.get("final") == fingerprint((ref_state, ref_rng))
            with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
                if m.latest_step() != steps:
                    out["diff"] = (f"the last checkpoint is step {m.latest_step()}, "
                                   f"not {steps}")
                else:
                    got = m.restore(target={"state": ref_state, "rng": ref_rng})
                    out["diff"] = tree_diff({"state": got["state"], "rng": got["rng"]},
                                            {"state": ref_state, "rng": ref_rng},
                                            rtol=0.0 if cpu is not None else resume_rtol())
    return out


def _number(text: str) -> int:
    """A step number a worker printed (-1 for anything else: it matches no step)."""
    return int(text) if text.isdigit() and len(text) < 10 else -1


def drill_message(r: Mapping[str, Any]) -> str | None:
    """None if the drill ``r`` (from :func:`lab3_drill`) went as a correct resume makes it
    go — every restart resumed from the newest committed checkpoint, computed each later step
    once and in order, and the run ended where the uninterrupted run ends — else what went
    wrong first, said for the student."""
    runs = r["runs"]
    for i, run in enumerate(runs):
        what = "the first run" if i == 0 else f"restart {i}"
        killed = run["killed_after"] is not None
        if not killed and run["rc"] != 0:
            err = run.get("err", "")
            hint = ""
            if "StepAlreadyExistsError" in err:
                hint = ("\n(StepAlreadyExistsError: the worker saved a step that is already "
                        "committed — it computed the checkpoint's own step again: the first "
                        "step to compute is t_ckpt + 1)")
            return (f"{what} of the training worker failed (exit {run['rc']}) after computing "
                    f"steps {run['steps']}:\n{err[-1500:]}{hint}")
        disk = run["on_disk"] or 0
        if i == 0:
            if not r.get("planted"):
                continue
            story = (f"the first run: a checkpoint of step {run['on_disk']} was already on disk "
                     "(from another run, with another seed: the grader's drill starts so); ")
        else:
            prev = runs[i - 1]
            story = (f"{what}: the worker was killed right after step {prev['killed_after']}, "
                     f"when the newest committed checkpoint was step {run['on_disk']}; ")
            if prev["killed_after"] is not None and disk > prev["killed_after"]:
                return story + ("a step the killed worker had not computed yet was committed: "
                                "a checkpoint holds the state after its step, saved once that "
                                "step is computed")
        if run["resumed_from"] != disk:
            said = (f"it resumed from step {run['resumed_from']}" if run["resumed_from"]
                    else "it started from scratch (resume returned first step 1)")
            return story + (f"{said}. resume should restore the newest checkpoint and return "
                            "t_ckpt + 1 as the first step")
        want = list(range(disk + 1, disk + 1 + len(run["steps"])))
        if run["steps"] != want or (not run["steps"] and disk < r["steps"]):
            return story + (f"it computed steps {run['steps'][:6]}..., expected "
                            f"{want[:6] or [disk + 1]}... (each step once, from t_ckpt + 1)")
    last = runs[-1]
    killed = sum(run["killed_after"] is not None for run in runs)
    room = (last["on_disk"] or 0) + 2 <= r["steps"] - 1  # a right resume leaves steps to kill at
    if killed < r.get("kills", 0) and room:
        return (f"the worker finished after {killed} of the drill's {r['kills']} kills: the "
                f"{'first run' if len(runs) == 1 else f'restart {len(runs) - 1}'} resumed from "
                f"step {last['resumed_from']} and computed steps {last['steps'][:6]}, though "
                f"the newest checkpoint on disk was step {last['on_disk']}: each run computes "
                "the steps after the newest checkpoint, one at a time")
    if last["steps"] and last["steps"][-1] != r["steps"]:
        return f"the last run stopped at step {last['steps'][-1]}, not {r['steps']}"
    if r["diff"] is not None:
        kills = [run["killed_after"] for run in runs if run["killed_after"] is not None]
        start = (f"going on from the checkpoint of step {r['planted']} that was on disk, "
                 if r.get("planted") else "")
        return (f"{start}killed after steps {kills} and restarted, the run ended elsewhere than "
                f"the uninterrupted one: {r['diff']}. Every step after a restart used what resume "
                "returned: did it bring back the whole state — parameters, Adam's moments, the "
                "step counter — and the saved RNG key, restored into the fresh ones?")
    return None
