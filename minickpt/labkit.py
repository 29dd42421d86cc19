"""What the labs use from minickpt: each task's reference function, a way to plug a student's
function into the library, a real training state on the devices JAX sees, and checks whose
messages teach.

A lab task is one or more functions of minickpt whose docstrings start with ``"Task 1.3 —"``
(see CONTRIBUTING.md). A student writes functions of the same names in the lab notebook; a
test cell then runs the real library with them in place::

    with plugged_in(plan_leaf, decode_leaf):          # minickpt now calls the student's code
        mc.Checkpointer().save(path, {"state": state})
        check(..., "the bytes of Dense_0's kernel in data.bin ...")

:func:`plugged_in` replaces every reference to the reference function inside minickpt's
modules (``format.plan_leaf``, ``checkpointer``'s imported name, ``minickpt.restore_checkpoint``
...) for the duration of the ``with`` block, so the library needs no hooks and the student's
function is exercised exactly where the library's own would be.

Checks raise :class:`LabCheckError` with a message meant for the student, never a bare
``assert``. Comparisons check types first, because an object whose ``==`` is always ``True``
must not pass a test.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import jax
import numpy as np

TASK_RE = re.compile(r"^Task (\d+\.\d+)\b")


class LabCheckError(AssertionError):
    """A lab test failed; the message says what was expected and what to look at."""


# ---------------------------------------------------------------------------------------
# tasks and their reference functions
# ---------------------------------------------------------------------------------------
def task_id(fn: Any) -> str | None:
    """The task a function belongs to, from its docstring (``"Task 1.3 (read) — ..."``)."""
    m = TASK_RE.match(inspect.getdoc(fn) or "") if callable(fn) else None
    return m.group(1) if m else None


@cache
def reference_functions() -> dict[str, tuple[Callable[..., Any], ...]]:
    """Every task of every lab: task ID → its reference functions, in source order.

    Found by scanning minickpt's modules for functions whose docstring starts with
    ``"Task X.Y"``, so adding a task to the library is all it takes.
    """
    import minickpt

    found: dict[str, list[tuple[str, int, Callable[..., Any]]]] = {}
    for info in pkgutil.iter_modules(minickpt.__path__, "minickpt."):
        if info.name in ("minickpt.__main__",):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as e:  # a module needing an optional extra (fsspec ...)
            if (e.name or "").split(".")[0] == "minickpt":
                raise
            continue
        for name, obj in vars(mod).items():
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__ and \
                    name == obj.__name__:
                tid = task_id(obj)
                if tid is not None:
                    line = obj.__code__.co_firstlineno
                    found.setdefault(tid, []).append((mod.__name__, line, obj))
    return {tid: tuple(f for _, _, f in sorted(fns, key=lambda t: (t[0], t[1])))
            for tid, fns in sorted(found.items(), key=lambda kv: _task_key(kv[0]))}


def _task_key(tid: str) -> tuple[int, ...]:
    return tuple(int(p) for p in tid.split("."))


def reference(name: str) -> Callable[..., Any]:
    """The reference function called ``name`` (any task)."""
    for fns in reference_functions().values():
        for fn in fns:
            if fn.__name__ == name:
                return fn
    known = sorted(f.__name__ for fns in reference_functions().values() for f in fns)
    raise LabCheckError(f"no lab task has a function called {name!r}; keep the names the lab "
                        f"gives you (one of {known})")


@contextlib.contextmanager
def plugged_in(*fns: Callable[..., Any]) -> Iterator[None]:
    """Run minickpt with the student's functions in place of the reference ones (by name).

    Every module attribute in ``minickpt.*`` that *is* the reference function is replaced,
    and put back when the block ends, even after an error.
    """
    swaps: list[tuple[Callable[..., Any], Callable[..., Any]]] = []
    for fn in fns:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or name is None:
            raise LabCheckError(f"expected one of your functions, got {fn!r}")
        ref = reference(name)
        if fn is ref:
            raise LabCheckError(f"{name} is minickpt's own function, not yours: define "
                                f"{name} in the task's cell (and run that cell)")
        swaps.append((ref, fn))
    patched: list[tuple[Any, str, Any]] = []
    try:
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "minickpt" or mod_name.startswith("minickpt.")):
                continue
            for attr, value in list(vars(mod).items()):
                for ref, fn in swaps:
                    if value is ref:
                        patched.append((mod, attr, value))
                        setattr(mod, attr, fn)
        yield
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)


# ---------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------
def check(ok: Any, message: str) -> None:
    """Fail with ``message`` unless ``ok`` is exactly ``True`` (not merely truthy)."""
    if ok is not True and not (isinstance(ok, (bool, np.bool_)) and bool(ok)):
        raise LabCheckError(message)


class Raised:
    """What :func:`expect_raises` caught (``value``), once the block has ended."""

    value: BaseException | None = None


@contextlib.contextmanager
def expect_raises(exc_type: type[BaseException] | tuple[type[BaseException], ...],
                  message: str) -> Iterator[Raised]:
    """The block must raise ``exc_type``; anything else fails with ``message`` and what
    happened instead."""
    caught = Raised()
    try:
        yield caught
    except exc_type as e:
        caught.value = e
        return
    except Exception as e:
        raise LabCheckError(f"{message} (it raised {type(e).__name__}: {e})") from None
    raise LabCheckError(f"{message} (nothing was raised)")


def same(value: Any, expected: Any) -> bool:
    """Equality that also requires the same types, recursively (sets, lists, tuples, dicts),
    so an object that claims to equal everything does not pass."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, (set, frozenset)):
        return all(any(same(v, e) for e in expected) for v in value) and \
            len(value) == len(expected)
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(
            same(v, e) for v, e in zip(value, expected, strict=True))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k])
                                                       for k in expected)
    if isinstance(expected, float):
        return bool(value == expected or (value != value and expected != expected))
    return bool(value == expected)


def close_to(value: Any, expected: float, rel: float) -> bool:
    """A number (int or float, not a bool or an imposter) within ``rel`` of ``expected``."""
    if type(value) not in (int, float):
        return False
    return abs(float(value) - expected) <= rel * abs(expected)


def check_choice(name: str, value: Any, options: str) -> None:
    """A quiz answer that is one letter among ``options``."""
    check(type(value) is str and len(value) == 1 and value in options,
          f"{name} should be one letter among {', '.join(repr(o) for o in options)} "
          f"(a str), got {value!r}")


def check_choices(name: str, value: Any, options: str) -> None:
    """A quiz answer that is a set of letters among ``options``."""
    check(type(value) in (set, frozenset) and len(value) > 0 and
          all(type(v) is str and len(v) == 1 and v in options for v in value),
          f"{name} should be a non-empty set of letters among "
          f"{', '.join(repr(o) for o in options)}, such as {{'A', 'C'}}; got {value!r}")


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def tree_diff(got: Any, want: Any, *, rtol: float = 0.0) -> str | None:
    """The first difference between two trees, said for a person, or ``None`` if they are
    identical: same structure and containers, same leaf types, dtypes and shapes, and the
    same bytes (or, with ``rtol``, values that close)."""
    from .tree import path_str

    ref_flat = reference("flatten_with_names")  # the library's own, even while a student's is in
    try:
        g, w = ref_flat(got), ref_flat(want)
    except Exception as e:  # a structure that is not even a pytree
        return f"cannot compare: {type(e).__name__}: {e}"
    gn, wn = [n for n, _ in g], [n for n, _ in w]
    if gn != wn:
        missing = [path_str(n) for n in wn if n not in set(gn)]
        extra = [path_str(n) for n in gn if n not in set(wn)]
        return (f"the leaves differ: missing {missing[:3]}, unexpected {extra[:3]}"
                if missing or extra else "the leaves come in a different order")
    kinds_got = _kinds(jax.tree_util.tree_structure(got))
    kinds_want = _kinds(jax.tree_util.tree_structure(want))
    if kinds_got != kinds_want:
        return f"the containers differ: got {kinds_got}, expected {kinds_want}"
    for (names, a), (_, b) in zip(g, w, strict=True):
        where = path_str(names)
        if is_key(b):
            if not is_key(a):
                return f"{where}: expected a typed PRNG key, got {type(a).__name__}"
            if str(jax.random.key_impl(a)) != str(jax.random.key_impl(b)):
                return f"{where}: key implementation differs"
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(b, (bool, int, float, complex, str)) and not hasattr(b, "dtype"):
            if not same(a, b):
                return f"{where}: expected {b!r} ({type(b).__name__}), got {a!r}"
            continue
        if isinstance(b, jax.Array) and not isinstance(a, jax.Array):
            return f"{where}: expected a jax.Array, got {type(a).__name__}"
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            return f"{where}: expected an array, got {type(a).__name__}"
        x, y = np.asarray(a), np.asarray(b)
        if x.dtype != y.dtype:
            return f"{where}: dtype {x.dtype}, expected {y.dtype}"
        if x.shape != y.shape:
            return f"{where}: shape {x.shape}, expected {y.shape}"
        if rtol == 0.0 or not np.issubdtype(y.dtype, np.inexact):
            if x.tobytes() != y.tobytes():
                return f"{where}: the values differ (not bit for bit identical)"
        elif not np.allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=0,
                             equal_nan=True):
            return f"{where}: the values differ by more than {rtol:g} relative"
    return None


def _kinds(td: Any) -> Any:
    """The container types of a tree structure, without the static data (a TrainState's
    apply_fn and tx differ between two models, yet their states compare)."""
    data = td.node_data()
    if data is None:
        return "*"
    return (data[0].__name__, tuple(_kinds(c) for c in td.children()))


# ---------------------------------------------------------------------------------------
# devices and a real training state
# ---------------------------------------------------------------------------------------
def devices() -> list[jax.Device]:
    """The devices of the default backend: the GPU/TPU on Colab, several CPUs locally."""
    return list(jax.devices())


def describe_devices() -> str:
    ds = devices()
    return f"JAX {jax.__version__} on {len(ds)} {ds[0].platform.upper()} device(s): " + \
        ", ".join(str(d) for d in ds)


def mesh() -> jax.sharding.Mesh:
    """A one-axis mesh (``"data"``) over every device."""
    return jax.sharding.Mesh(np.array(devices()), ("data",))


def shard(tree: Any) -> Any:
    """Place every array of ``tree`` on all devices: split along its first axis where that
    axis divides evenly, replicated otherwise. Keys and Python values stay as they are."""
    m = mesh()
    n = m.devices.size
    P = jax.sharding.PartitionSpec

    def place(x: Any) -> Any:
        if not isinstance(x, jax.Array) or is_key(x):
            return x
        spec = P("data") if x.ndim >= 1 and x.shape[0] % n == 0 and x.shape[0] >= n else P()
        return jax.device_put(x, jax.sharding.NamedSharding(m, spec))

    return jax.tree_util.tree_map(place, tree)


def train_state(steps: int = 3, *, seed: int = 0, dtype: Any = None, sharded: bool = False
                ) -> tuple[Any, jax.Array]:
    """A real Flax ``TrainState`` (MLP + Adam, see :mod:`minickpt.demo`) after ``steps``
    training steps, and the dropout key that comes next.

    ``dtype`` casts the parameters and Adam's moments (e.g. ``jnp.bfloat16``); ``sharded``
    spreads the arrays over every device (:func:`shard`).
    """
    from .demo import make_state, train

    state, rng = make_state(seed), jax.random.key(42 + seed)
    state = state.replace(step=jax.numpy.asarray(state.step, jax.numpy.int32))  # as after a step
    if steps:
        state, rng, _ = train(state, rng, 0, steps)
    if dtype is not None:
        def cast(x: Any) -> Any:
            if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
                return x.astype(dtype)
            return x
        state = state.replace(params=jax.tree_util.tree_map(cast, state.params),
                              opt_state=jax.tree_util.tree_map(cast, state.opt_state))
    if sharded:
        state = shard(state)
    return state, rng


def train(state: Any, rng: jax.Array, start: int, stop: int) -> tuple[Any, jax.Array]:
    """Steps ``start+1 .. stop`` of the lab's training run (the batch is a function of the
    step, so a resumed run sees the same data as an uninterrupted one)."""
    from .demo import train as demo_train

    state, rng, _ = demo_train(state, rng, start, stop)
    return state, rng


def resume_rtol() -> float:
    """How closely a resumed run must match an uninterrupted one: bit for bit on CPU; on
    GPU/TPU reductions may run in another order, so a tiny relative difference is allowed."""
    return 0.0 if jax.default_backend() == "cpu" else 1e-5


# ---------------------------------------------------------------------------------------
# small conveniences for test cells
# ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def tempdir() -> Iterator[str]:
    """A fresh directory, removed afterwards."""
    d = tempfile.mkdtemp(prefix="minickpt-lab-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def flip_byte(path: str, offset: int) -> None:
    """Damage one byte of a file, the way a bad disk or a bad copy would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def quiet_stderr() -> None:
    """Send what would go to stderr (warnings, log messages) to stdout from now on.

    nbgrader scores a test cell 0 when it writes anything to stderr, and JAX warns on
    stderr; a warning must not cost a student points. The text stays visible.
    """
    sys.stderr = sys.stdout


# ---------------------------------------------------------------------------------------
# lab 2 (save policy): helpers its tests use
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# lab 3 (resume): helpers its tests use
# ---------------------------------------------------------------------------------------
def lab3_manifest(tree: Any, item: str = "state") -> Any:
    """The validated manifest of ``tree`` saved as one item (what task 3.2 compares against)."""
    from .checkpointer import Checkpointer

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

    from .demo import HIDDEN, IN_DIM, OUT_DIM

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
    from .demo import batch

    x, y = batch(step)
    pred = state.apply_fn(state.params, x, train=False)
    return float(jax.numpy.mean((pred - y) ** 2))


_LAB3_DRIVER = """
import sys
from minickpt import demo, labkit
ns = labkit.lab3_namespace()
with open(sys.argv[1]) as f:
    exec(compile(f.read(), "your resume (task 3.3)", "exec"), ns)
with labkit.plugged_in(ns["resume"]):
    demo.worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
"""


def lab3_namespace() -> dict[str, Any]:
    """What a student's task 3.3 code sees in the training subprocess: the names the lab's
    setup cell imports (and a few more of the same modules)."""
    import collections.abc
    import typing

    import jax.numpy as jnp

    import minickpt as mc

    from . import errors, manager, restore, tree

    ns: dict[str, Any] = {"__name__": "lab03_student"}
    for mod in (typing, collections.abc, errors, tree, restore, manager):
        ns.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    ns.update(jax=jax, jnp=jnp, np=np, mc=mc, lab=sys.modules[__name__], check=check,
              same=same, expect_raises=expect_raises, plugged_in=plugged_in)
    return ns


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

    from .manager import CheckpointManager, CheckpointManagerOptions

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
    with tempdir() as d:
        code = os.path.join(d, "resume_task_3_3.py")
        with open(code, "w") as f:
            f.write(textwrap.dedent(src))
        ckpt = os.path.join(d, "run")
        cmd = [sys.executable, "-c", _LAB3_DRIVER, code, ckpt, str(steps), str(every), "0.02"]
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(d, "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, env=env)
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
                                env=env)
        out.update(second_rc=second.returncode, second_out=second.stdout.splitlines(),
                   second_err=second.stderr[-3000:])
        done = [int(x.split()[1]) for x in out["second_out"] if x.startswith("step ")]
        resumed = [int(x.split()[3]) for x in out["second_out"]
                   if x.startswith("resumed from step ")]
        out.update(second_steps=done, resumed_from=resumed[0] if resumed else 0)
        out["diff"] = "the restarted run did not finish"
        if second.returncode == 0:
            from .demo import fingerprint, make_state
            from .demo import train as demo_train

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




# ---------------------------------------------------------------------------------------
# lab 4 (multi-host): helpers its tests use
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# lab 5 (async): helpers its tests use
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# lab 6 (production): helpers its tests use
# ---------------------------------------------------------------------------------------
