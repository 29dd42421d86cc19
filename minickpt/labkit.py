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
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from typing import Any, NamedTuple

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
    # walk_packages, not iter_modules: lab 6's tasks live in the subpackage minickpt.production
    for info in pkgutil.walk_packages(minickpt.__path__, "minickpt."):
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
def tempdir(parent: str | None = None) -> Iterator[str]:
    """A fresh directory (in ``parent``, else the system's temporary folder), removed
    afterwards."""
    d = tempfile.mkdtemp(prefix="minickpt-lab-", dir=parent)
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
def retention_cases(n: int, seed: int = 0) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """``n`` random retention problems: (saved checkpoints, options of ``steps_to_keep``).

    Seeded, so a failure names a case that comes back on every run. The checkpoints come in
    any order, with repeated and non-finite losses, metrics that lack the key ``best_fn``
    reads, and no metrics at all — the cases a rule can get wrong.
    """
    import math
    import random

    from .policy import StepInfo

    rng = random.Random(seed)
    losses = [0.1, 0.2, 0.2, 0.5, 0.9, math.nan, math.inf, -math.inf]
    for _ in range(n):
        steps = rng.sample(range(0, 61), rng.randint(0, 9))
        infos = []
        for s in steps:
            r = rng.random()
            metrics = (None if r < 0.15 else {"acc": 0.5} if r < 0.22 else
                       {"loss": rng.choice(losses)})
            infos.append(StepInfo(s, metrics))
        use_metric = rng.random() < 0.5
        opts = {"max_to_keep": rng.choice([None, 1, 2, 3, 5]),
                "keep_period": rng.choice([None, None, 2, 3, 7]),
                "best_fn": (lambda m: m["loss"]) if use_metric else None,
                "best_mode": rng.choice(["min", "max"]),
                "keep_checkpoints_without_metrics": rng.random() < 0.5}
        yield infos, opts


def describe_retention(infos: Any, opts: dict[str, Any]) -> str:
    """A retention problem said for a person (best_fn shown as what it reads)."""
    shown = {k: ("lambda m: m['loss']" if k == "best_fn" and v is not None else v)
             for k, v in opts.items()}
    saved = ", ".join(f"{i.step}: {i.metrics}" for i in infos) or "nothing"
    return f"saved {{{saved}}} with {shown}"


def lab2_items(step: int) -> dict[str, Any]:
    """What the crash tests save at ``step`` (values a function of the step)."""
    return {"params": {"w": np.arange(40, dtype=np.float32) + step,
                       "b": np.full(3, step, np.int32)}}


@contextlib.contextmanager
def _same_names() -> Iterator[None]:
    """The same 'random' temporary names on every run of a scenario, so that identical
    crash states are checked once (only ``secrets.token_hex``, never a protected module)."""
    import itertools
    from unittest import mock

    counter = itertools.count()
    with mock.patch("secrets.token_hex", lambda n=4: f"{next(counter):0{2 * (n or 4)}x}"):
        yield


class CrashReport:
    """What :func:`crash_every_call` found: how many crash points and states it checked,
    and every problem, each naming its crash point."""

    def __init__(self) -> None:
        self.points = 0
        self.states = 0
        self.problems: list[str] = []

    def first(self) -> str:
        return self.problems[0] if self.problems else ""


LOOKALIKES = ("notes.txt", "step_9.tmp")
"""Files of the user's that live beside the checkpoints and that no cleanup may remove."""


def crash_every_call(*fns: Callable[..., Any], before: tuple[int, ...] = (1, 2), step: int = 3,
                     max_to_keep: int | None = 2, leftovers: bool = False,
                     random_states: int = 1) -> CrashReport:
    """Save ``step`` with a ``CheckpointManager`` (``max_to_keep``) into a run that holds
    ``before``, with the student's ``fns`` plugged in, and crash it before every one of its
    file-system calls (:mod:`minickpt.crashsim`). Every state a power cut there can leave is
    opened by a fresh manager, each listed step verified and restored.

    With ``leftovers`` the run also holds what crashed saves and deletes leave (a temporary
    of ``step``, a half-removed deleted checkpoint) and two files of the user's. A problem
    says where the crash was and what was lost or damaged.
    """
    import os
    import warnings

    from .commit import DELETE_MARK, TMP_MARK, is_temporary
    from .crashsim import AssertionFailure, explore
    from .fs import FileSystem
    from .manager import CheckpointManager, CheckpointManagerOptions

    class _NoSync(FileSystem):  # setting up and checking: durability is modelled, not needed
        def fsync(self, fd: int) -> None:
            return None

    fast = _NoSync()
    opts = CheckpointManagerOptions(max_to_keep=max_to_keep)
    report = CrashReport()
    # the states are a model: thousands of tiny directories, in memory where there is a tmpfs
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempdir(shm) as work:
        template = os.path.join(work, "template")
        run = os.path.join(template, "run")
        with CheckpointManager(run, opts, fs=fast) as m:
            for s in before:
                m.save(s, lab2_items(s), force=True)
        if leftovers:
            junk = os.path.join(run, f"step_{step}{TMP_MARK}0badc0de", "params")
            os.makedirs(junk)
            with open(os.path.join(junk, "data.bin"), "wb") as f:
                f.write(b"half a save")
            os.makedirs(os.path.join(run, f"step_0{DELETE_MARK}0badc0de", "params"))
            for name in LOOKALIKES:
                os.makedirs(os.path.join(run, name)) if name.endswith(".tmp") else \
                    open(os.path.join(run, name), "w").close()
        new = tuple(sorted({*before, step}))
        kept = new if max_to_keep is None else new[-max_to_keep:]
        doomed = [s for s in new if s not in kept]
        allowed = {tuple(before), new} | {tuple(s for s in new if s not in doomed[:j])
                                          for j in range(1, len(doomed) + 1)}

        def scenario(fs: FileSystem, world: str) -> None:
            with _same_names():
                mngr = None
                try:
                    mngr = CheckpointManager(os.path.join(world, "run"), opts, fs=fs)
                    mngr.save(step, lab2_items(step))
                    mngr.close()
                finally:
                    if mngr is not None:
                        mngr._lock_fd = None  # the "dead" process's descriptors are closed

        def observe(world: str) -> tuple[int, ...]:
            d = os.path.join(world, "run")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with CheckpointManager(d, CheckpointManagerOptions(fallback_on_damage=False),
                                       fs=fast) as m:
                    steps = tuple(m.all_steps())
                    for s in steps:
                        rep = m.verify(s)
                        if not rep.ok:
                            raise AssertionError(f"step {s} is listed but damaged "
                                                 f"({'; '.join(rep.problems)[:160]})")
                        got = m.restore(s)
                        if tree_diff(dict(got), lab2_items(s)) is not None:
                            raise AssertionError(f"step {s} restores wrong values")
            names = os.listdir(d)
            left = [n for n in names if is_temporary(n)]
            if left:
                raise AssertionError(f"a manager opened the run but left {left} behind")
            gone = [n for n in LOOKALIKES if leftovers and n not in names]
            if gone:
                raise AssertionError(f"{gone} was removed, but it is not a minickpt temporary")
            missing = [s for s in before if s not in steps and s not in doomed]
            if missing:
                raise AssertionError(f"committed step {missing} was removed")
            return steps

        seen: set[str] = set()
        durable_from: int | None = None
        with plugged_in(*fns) if fns else contextlib.nullcontext():
            points = list(explore(template, scenario, observe, fidelity=False,
                                  workdir=os.path.join(work, "x"), random_states=random_states))
        for pt in points:
            report.points += 1
            report.states += len(pt.states)
            bad = []
            for st, out in zip(pt.states, pt.outcomes, strict=True):
                if isinstance(out, AssertionFailure):
                    bad.append(f"{st.label}: {out.message}")
                elif out not in allowed:
                    bad.append(f"{st.label}: a fresh manager found steps {list(out)}; after a "
                               f"crash it should find one of {sorted(map(list, allowed))}")
            good = [o for o in pt.outcomes if not isinstance(o, AssertionFailure)]
            if good and all(step in o for o in good):
                durable_from = pt.index if durable_from is None else durable_from
            elif durable_from is not None:
                bad.append(f"step {step} was safe from crash point {durable_from} on, but a "
                           "power cut here loses it")
            if pt.call == "end" and not all(step in o for o in good):
                bad.append(f"save({step}) returned, but a power cut right after it can lose "
                           f"step {step}")
            for b in bad:
                msg = re.sub(r"\S*/(state|point)\d+", "<world>",
                             f"crash before call {pt.index} ({pt.call}) — {b}")
                if msg not in seen:
                    seen.add(msg)
                    pending = re.sub(r"\S*/point\d+", "<world>",
                                     "; ".join(pt.pending[:3]) or "nothing")
                    report.problems.append(f"{msg} [not yet durable then: {pending}]")
    return report




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
# What every process launched by run_processes imports before the student's code: the names
# of lab 4's setup cell (tests/test_lab04_multihost.py checks that the two agree).
LAB4_IMPORTS = """\
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import minickpt as mc
from minickpt import labkit as lab
from minickpt.labkit import check, expect_raises, plugged_in, same
from minickpt.errors import MultiHostError, PeerTimeoutError, ProcessDisagreementError
from minickpt.format.shards import Box, box_of, box_shape, box_slices
from minickpt.format.buffers import aligned_empty
from minickpt.multihost.save import CollectiveSave
from minickpt.multihost.sync import default_sync
"""

_WORKER = '''\
import json, os, sys
_me = int(os.environ.get("MINICKPT_PROCESS_ID", "0"))
try:  # at most 2 CPUs each, so that JAX's thread pools stay small on a many-core machine
    _cpus = sorted(os.sched_getaffinity(0))
    if len(_cpus) > 2:
        _start = (2 * _me) % len(_cpus)
        os.sched_setaffinity(0, (_cpus[_start:] + _cpus)[:2])
except (AttributeError, OSError):
    pass
import minickpt.multihost.process as _mhp
import minickpt.multihost.sync as _mhs
_mhp.initialize()
{imports}
ME, N = jax.process_index(), jax.process_count()
directory = sys.argv[1]
_results = {{}}


def report(**values):
    """Send values (JSON) back to the test cell, which reads them per process."""
    _results.update(values)


_error = None
try:
    exec(compile({source!r}, "<your task cell>", "exec"), globals())
    with plugged_in(*[globals()[_n] for _n in {names!r}]):
        exec(compile({body!r}, "<the test>", "exec"), globals())
except BaseException as _e:
    _error = {{"type": type(_e).__name__, "message": str(_e),
              "kinds": [_c.__name__ for _c in type(_e).__mro__]}}
print("RESULT " + json.dumps({{"results": _results, "error": _error}}, default=repr), flush=True)
try:  # process 0 hosts the coordination service: nobody leaves before everybody is done
    _mhs.default_sync().exchange("lab4-done", None, 20.0, "the end of the test")
    if ME == 0:
        time.sleep(0.5)  # while the others read the barrier's values
except Exception:
    pass
_mhp.hard_exit(0)  # no jax.distributed.shutdown(): a failed peer would make it wait
'''


class ProcessesRun:
    """What the processes of one :func:`run_processes` job reported."""

    def __init__(self, n: int, launched: Any):
        self.n = n
        self.launched = launched
        self.results: list[dict[str, Any]] = [{} for _ in range(n)]
        self.errors: list[dict[str, Any] | None] = [None] * n
        self.reported = [False] * n
        for p in range(n):
            for line in launched.outputs[p]:
                if line.startswith("RESULT "):
                    import json

                    got = json.loads(line[len("RESULT "):])
                    self.results[p], self.errors[p] = got["results"], got["error"]
                    self.reported[p] = True

    def output_tail(self, process: int, lines: int = 8) -> str:
        out = [x for x in self.launched.outputs[process] if not x.startswith("RESULT ")]
        return "".join(out[-lines:]).strip()

    def check_reported(self) -> None:
        """Every process ran to its end (a process that died or hung is named)."""
        for p in range(self.n):
            if not self.reported[p]:
                rc = self.launched.returncodes[p]
                why = ("it was still running at the time limit" if self.launched.timed_out
                       else f"it exited with code {rc}")
                raise LabCheckError(f"process {p} of {self.n} never reported ({why}); its last "
                                    f"output:\n{self.output_tail(p)}")

    def error_of(self, p: int) -> str | None:
        e = self.errors[p]
        return None if e is None else f"{e['type']}: {e['message']}"

    def raised(self, p: int, kind: str) -> bool:
        e = self.errors[p]
        return e is not None and kind in e["kinds"]

    def check_no_errors(self, what: str) -> None:
        self.check_reported()
        bad = [p for p in range(self.n) if self.errors[p] is not None]
        if bad:
            raise LabCheckError(f"{what} failed on process{'es' if len(bad) > 1 else ''} "
                                f"{', '.join(map(str, bad))}: {self.error_of(bad[0])}")


def _task_source(fns: Sequence[Callable[..., Any]]) -> str:
    """The code that defines ``fns``: the whole notebook cell each comes from (so helpers
    defined beside it come too), or the function's own source for one defined in a file."""
    import linecache
    import os
    import textwrap

    parts: list[str] = []
    seen: set[str] = set()
    for fn in fns:
        code = getattr(fn, "__code__", None)
        filename = getattr(code, "co_filename", "")
        if filename in seen:
            continue
        seen.add(filename)
        cell = linecache.getlines(filename)
        if cell and not os.path.exists(filename):  # a notebook cell (IPython keeps its text)
            parts.append("".join(cell))
        else:
            parts.append(textwrap.dedent(inspect.getsource(fn)))
    return "\n\n".join(parts)


def run_processes(body: str, *, processes: int = 4, devices: int = 2,
                  functions: Sequence[Callable[..., Any]] = (), directory: str | None = None,
                  timeout_s: float = 50.0) -> ProcessesRun:
    """Run ``body`` in ``processes`` JAX processes of one ``jax.distributed`` job on this
    machine (``devices`` CPU devices each), with ``functions`` — yours — plugged into
    minickpt in every process.

    ``body`` sees lab 4's setup names, ``ME`` and ``N`` (this process, how many),
    ``directory`` (one folder shared by the job) and ``report(**values)``, which sends JSON
    values back. An exception in ``body`` is caught and reported, never fatal; every process
    is killed when the job ends or after ``timeout_s``.
    """
    import os

    from .launch import launch

    names = [getattr(fn, "__name__", "") for fn in functions]
    for fn in functions:
        reference(fn.__name__)  # a name no task has fails here, not in every process
    source = _task_source(functions)
    with tempdir() as work:
        script = os.path.join(work, "lab4_process.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(_WORKER.format(imports=LAB4_IMPORTS, source=source, names=names,
                                   body=body))
        shared = directory or os.path.join(work, "shared")
        os.makedirs(shared, exist_ok=True)
        res = launch([script, shared], processes, devices_per_process=devices,
                     timeout_s=timeout_s, grace_s=timeout_s, cwd=work,
                     env={"JAX_PLATFORMS": "cpu"})
    return ProcessesRun(processes, res)


def global_array(name: str, shape: Sequence[int], sharding: Any,
                 dtype: Any = np.float32) -> jax.Array:
    """An array spread over ``sharding`` (possibly over several processes) whose values every
    process, and the test, can compute alone: :func:`lab4_values`."""
    g = lab4_values(name, shape, dtype)
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: g[idx])


def lab4_values(name: str, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """The values of the lab's array ``name``: a function of its name and shape alone."""
    n = int(np.prod(shape))
    base = sum(map(ord, name)) % 17
    return ((np.arange(n) * 3 + base) % 251).reshape(tuple(shape)).astype(dtype)


def process_mesh(shape: Sequence[int], axes: Sequence[str]) -> jax.sharding.Mesh:
    """A mesh over every device of the job, process by process (process 0's devices first)."""
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devs).reshape(tuple(shape)), tuple(axes))


def distinct_boxes(shape: Sequence[int], sharding: Any) -> list[list[list[int]]]:
    """The pieces of an array on ``sharding``, each once (JSON: ``[[start, stop], ...]``)."""
    from .format.shards import box_of

    out: list[list[list[int]]] = []
    for index in sharding.devices_indices_map(tuple(shape)).values():
        box = [list(b) for b in box_of(index, tuple(shape))]
        if box not in out:
            out.append(box)
    return out


def shard_boxes(step_dir: str, item: str) -> dict[str, dict[tuple[tuple[int, int], ...],
                                                          list[int]]]:
    """Leaf path -> box -> the processes that wrote it, read from the item's per-process
    shard manifests (``manifest.p<i>.json``) as they are on disk."""
    import json
    import os

    out: dict[str, dict[tuple[tuple[int, int], ...], list[int]]] = {}
    item_dir = os.path.join(step_dir, item)
    for name in sorted(os.listdir(item_dir)):
        m = re.fullmatch(r"manifest\.p(\d+)\.json", name)
        if not m:
            continue
        with open(os.path.join(item_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        for s in doc.get("shards", []):
            box = tuple((int(a), int(b)) for a, b in s["index"])
            out.setdefault("/".join(s["path"]), {}).setdefault(box, []).append(int(m.group(1)))
    return out


def coverage_message(step_dir: str, item: str,
                     expected: Mapping[str, Sequence[Sequence[Sequence[int]]]]) -> str | None:
    """None if every expected box of every leaf was written by exactly one process, else what
    is wrong, naming the leaf, the box and the processes."""
    got = shard_boxes(step_dir, item)
    for leaf, boxes in expected.items():
        have = got.get(leaf, {})
        for b in boxes:
            box = tuple((int(x), int(y)) for x, y in b)
            who = have.get(box, [])
            if not who:
                return (f"leaf {leaf}: box {[list(x) for x in box]} was written by no process "
                        "(every piece must have an owner)")
            if len(who) > 1:
                return (f"leaf {leaf}: box {[list(x) for x in box]} was written "
                        f"{len(who)} times, by processes {sorted(who)} (one replica each: "
                        "only the process of its first device writes it)")
        extra = [b for b in have if [list(x) for x in b] not in [list(map(list, e))
                                                                 for e in boxes]]
        if extra:
            return f"leaf {leaf}: box {[list(x) for x in extra[0]]} is not a piece of its sharding"
    return None


def listing(path: str) -> list[str]:
    """The names in a directory, sorted, without hidden ones (such as the manager's lock)."""
    import os

    return sorted(n for n in os.listdir(path) if not n.startswith("."))


class FakeDevice(NamedTuple):
    """A stand-in for a ``jax.Device`` in pure tests: an id and the process it belongs to."""

    id: int
    process_index: int


def fake_devices_indices_map(shape: Sequence[int], mesh_ids: Any, axes: Sequence[str],
                             spec: Sequence[Any], owner: Mapping[int, int]
                             ) -> dict[FakeDevice, tuple[slice, ...]]:
    """What ``NamedSharding(Mesh(devices, axes), P(*spec)).devices_indices_map(shape)`` gives
    for a mesh of fake devices (``mesh_ids``: their ids, laid out as the mesh), in the
    sharding's device order; ``owner`` maps a device id to its process."""
    ids = np.asarray(mesh_ids)
    sizes = dict(zip(axes, ids.shape, strict=True))
    out: dict[FakeDevice, tuple[slice, ...]] = {}
    for coord in np.ndindex(*ids.shape):
        at = dict(zip(axes, coord, strict=True))
        index = []
        for k, n in enumerate(shape):
            entry = spec[k] if k < len(spec) else None
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if not names:
                index.append(slice(None))
                continue
            pieces = int(np.prod([sizes[a] for a in names]))
            i = int(np.ravel_multi_index([at[a] for a in names], [sizes[a] for a in names]))
            size = n // pieces
            index.append(slice(i * size, (i + 1) * size))
        dev_id = int(ids[coord])
        out[FakeDevice(dev_id, owner[dev_id])] = tuple(index)
    return out


def ownership_message(shape: Sequence[int], devices_indices_map: Mapping[Any, Sequence[slice]],
                      got: Mapping[int, Any], process_of: Callable[[Any], int]) -> str | None:
    """None if ``got`` (process -> what ``owned_shards`` returned for it) gives every piece of
    the array to exactly one process — the one of its first device in the sharding's order,
    with that device — else what is wrong, naming the box."""
    from .format.shards import box_of

    first: dict[Any, Any] = {}
    for device, index in devices_indices_map.items():
        first.setdefault(box_of(index, tuple(shape)), device)
    writers: dict[Any, list[tuple[int, Any]]] = {}
    for p, pairs in got.items():
        if type(pairs) is not list:
            return f"process {p}: owned_shards should return a list, got {type(pairs).__name__}"
        for pair in pairs:
            if type(pair) is not tuple or len(pair) != 2:
                return (f"process {p}: each item should be a (box, device) tuple, got "
                        f"{pair!r}")
            box, device = pair
            if type(box) is not tuple or not all(
                    type(b) is tuple and len(b) == 2 and all(type(x) is int for x in b)
                    for b in box):
                return (f"process {p}: a box should be a tuple of (start, stop) int pairs such "
                        f"as ((0, 4), (0, 8)); got {box!r} (box_of(index, shape) makes one)")
            if box not in first:
                return f"process {p}: box {box} is not a piece of this sharding"
            writers.setdefault(box, []).append((p, device))
    for box, device in first.items():
        who = writers.get(box, [])
        want = process_of(device)
        if not who:
            return (f"box {box} is written by no process: process {want} should own it (its "
                    f"first holder, device {device.id}, is on process {want})")
        if len(who) > 1:
            return (f"box {box} is written {len(who)} times (by processes "
                    f"{[q for q, _ in who]}, devices {[d.id for _, d in who]}): one replica only, "
                    f"that of its first holder, device {device.id} on process {want}")
        (q, dev), = who
        if q != want:
            return (f"box {box} is written by process {q}, but its first holder, device "
                    f"{device.id}, is on process {want} (as process_of says)")
        if dev != device:
            return (f"box {box}: process {q} says device {dev.id} writes it, but the first "
                    f"device holding it in the sharding's order is device {device.id}")
    return None


class RecordingSave:
    """A stand-in for a ``CollectiveSave`` that records what a ``two_barrier_commit`` calls,
    in order, to test the protocol alone: no processes, no files. ``fail`` names the step
    (``"create"``, ``"write"``, ``"commit"``) that raises ``OSError`` here; a barrier given an
    error raises, as the real one does on every process."""

    def __init__(self, primary: bool, *, processes: int = 4, fail: str | None = None):
        self.primary, self.processes, self.fail = primary, processes, fail
        self.calls: list[tuple[Any, ...]] = []
        self.files = {"params": {"process": "this one", "data_file": "data.p1.bin"}}

    def _step(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if self.fail == name:
            raise OSError(5, f"Input/output error (injected in {name})")

    def create(self) -> None:
        self._step("create")

    def write(self) -> dict[str, Any]:
        self._step("write")
        return self.files

    def commit(self, files: Any) -> dict[str, Any]:
        self._step("commit", "every process's files" if files == [self.files] * self.processes
                   else f"files={files!r}")
        return {"committed": True}

    def barrier(self, phase: str, error: BaseException | None = None,
                value: Any = None) -> list[Any] | None:
        self.calls.append(("barrier", phase, None if error is None else type(error).__name__))
        if error is not None:
            from .errors import MultiHostError

            raise MultiHostError(f"the save failed at barrier {phase!r}: {error}")
        return None if phase == "committed" else [value] * self.processes


def _expected_calls(primary: bool, fail: str | None) -> list[tuple[Any, ...]]:
    seq: list[tuple[Any, ...]] = []
    for phase, mine, who in (("created", "create", primary), ("written", "write", True),
                             ("committed", "commit", primary)):
        failed = None
        if who:
            seq.append(("commit", "every process's files") if mine == "commit" else (mine,))
            failed = "OSError" if fail == mine else None
        seq.append(("barrier", phase, failed))
        if failed:
            break
    return seq


def _said(call: tuple[Any, ...]) -> str:
    if call[0] == "barrier":
        return f"barrier({call[1]!r}" + (f", <{call[2]}>)" if call[2] else ")")
    if call[0] == "commit":
        return f"commit({call[1]})"
    return f"{call[0]}()"


def protocol_message(fn: Callable[[Any], Any], primary: bool,
                     fail: str | None = None) -> str | None:
    """None if ``fn`` (a ``two_barrier_commit``) makes the calls the protocol prescribes, in
    order, on a primary or another process, when step ``fail`` fails there (or none); else
    what it did instead."""
    save = RecordingSave(primary, fail=fail)
    raised: BaseException | None = None
    try:
        fn(save)
    except Exception as e:
        raised = e
    if isinstance(raised, NotImplementedError):  # the task is still to do: say which
        return f"{type(raised).__name__}: {raised}"
    want = _expected_calls(primary, fail)
    who = "the primary" if primary else "a process that is not the primary"
    when = f" when its {fail}() fails" if fail else ""
    got = save.calls
    for i, w in enumerate(want):
        if i >= len(got):
            hint = ""
            if raised is not None and fail and w[0] == "barrier":
                hint = (f" — it raised {type(raised).__name__} at once: a process whose step "
                        "fails must still go to the next barrier, with the error, so that the "
                        "others learn it instead of waiting for the time-out")
            elif raised is not None:
                hint = f" — it raised {type(raised).__name__}: {raised}"
            return (f"on {who}{when}, call {i + 1} should be save.{_said(w)}, but "
                    f"two_barrier_commit stopped after {[_said(c) for c in got]}{hint}")
        if got[i] != w:
            return (f"on {who}{when}, call {i + 1} should be save.{_said(w)}, got "
                    f"save.{_said(got[i])} (the calls so far: {[_said(c) for c in got[:i + 1]]})")
    if len(got) > len(want):
        return (f"on {who}{when}, the protocol ends with save.{_said(want[-1])}, but "
                f"two_barrier_commit went on with save.{_said(got[len(want)])}")
    if fail and raised is None:
        return f"on {who}{when}, two_barrier_commit returned: the save's failure must be raised"
    if not fail and raised is not None:
        return f"on {who}, two_barrier_commit raised {type(raised).__name__}: {raised}"
    return None


# ---------------------------------------------------------------------------------------
# lab 5 (async): helpers its tests use
# ---------------------------------------------------------------------------------------
def pinning_works() -> bool:
    """Whether this JAX pins a CPU buffer while a numpy view of it lives (then a view is as
    safe a snapshot as a copy; see :func:`minickpt.tree.pinning_works`)."""
    from .tree import pinning_works as works

    return works()


def shares_memory(a: Any, b: Any) -> bool:
    """Whether two host arrays (or a HostKey's data) overlap in memory."""
    from .tree import HostKey

    a, b = (x.data if isinstance(x, HostKey) else x for x in (a, b))
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or not a.nbytes or \
            not b.nbytes:
        return False
    try:
        return bool(np.shares_memory(a, b))
    except (TypeError, ValueError):  # a dtype numpy cannot reason about (bfloat16): bounds
        from numpy.lib.array_utils import byte_bounds

        (a0, a1), (b0, b1) = byte_bounds(a), byte_bounds(b)
        return a0 < b1 and b0 < a1


def gated_fs() -> Any:
    """A real file system that records its calls (``calls``: ``(op, path)``) and can hold a
    save at the creation of its temporary directory (``shut()``, then ``open_gate()``), so
    that what a test does after ``save()`` returns certainly happens before the background
    writer reads a byte. ``reached`` is set when a save arrives at the gate."""
    import threading

    from .commit import TMP_MARK
    from .fs import FileSystem

    class GatedFS(FileSystem):
        def __init__(self) -> None:
            self.gate, self.reached = threading.Event(), threading.Event()
            self.gate.set()
            self.calls: list[tuple[str, str]] = []

        def shut(self) -> None:
            self.gate.clear()
            self.reached.clear()

        def open_gate(self) -> None:
            self.gate.set()

        def lstat(self, path: str) -> Any:
            self.calls.append(("lstat", path))
            return super().lstat(path)

        def rename(self, src: str, dst: str) -> None:
            self.calls.append(("rename", dst))
            super().rename(src, dst)

        def mkdir(self, path: str, mode: int = 0o755) -> None:
            self.calls.append(("mkdir", path))
            if TMP_MARK in path.rsplit("/", 1)[-1]:
                self.reached.set()
                if not self.gate.wait(20):
                    raise TimeoutError("the test never opened the gate")
            super().mkdir(path, mode)

    return GatedFS()


@cache
def _lab5_base_state() -> tuple[Any, jax.Array]:
    """The course's state after 3 steps of the donating step (one compilation serves all)."""
    from .demo import batch, make_state

    state, rng = make_state(0), jax.random.key(42)
    state = state.replace(step=jax.numpy.asarray(state.step, jax.numpy.int32))
    step = donating_train_step()
    for t in range(1, 4):
        state, rng, _ = step(state, rng, *batch(t))
    return state, rng


def fresh_train_state() -> tuple[Any, jax.Array]:
    """The course's training state after 3 steps, as new arrays every call, but always with
    the same model and optimizer objects, so that jitted steps compile once per process
    (a new ``TrainState`` carries new ``apply_fn``/``tx`` objects: a new compilation)."""
    state, rng = _lab5_base_state()
    return jax.tree_util.tree_map(lambda x: x.copy(), (state, rng))


@cache
def donating_train_step() -> Callable[..., Any]:
    """The course's training step jitted with ``donate_argnums=0``: XLA may write the new
    state into the old state's buffers, as large training runs do to save memory."""
    from .demo import train_step

    return jax.jit(train_step.__wrapped__, donate_argnums=0)


def _host_truth(tree: Any) -> Any:
    """An independent copy of every leaf as it is now (the reference snapshot)."""
    fn = reference("snapshot_leaf")
    return jax.tree_util.tree_map(lambda x: fn(x), tree)


def async_training_run(directory: str, *, steps: int = 4, every: int = 2,
                       zero_copy: bool | None = None) -> str | None:
    """A real training loop that checkpoints asynchronously and, right after each
    ``save()`` returns, mutates its numpy leaves in place and donates its device buffers to
    the next step — while the background writer is held, so it reads only afterwards.

    Returns None if every checkpoint restores to exactly the state at its ``save()``, or a
    message naming the step and the leaf that changed after ``save()`` returned.
    """
    import os

    from .asynchronous import SNAPSHOT_ENV
    from .demo import batch
    from .manager import CheckpointManager, CheckpointManagerOptions

    state, rng = fresh_train_state()
    loader = {"position": np.zeros(4, np.int64), "ema": np.zeros(3, np.float32)}
    fs = gated_fs()
    truths: dict[int, Any] = {}
    step_fn = donating_train_step()
    before = os.environ.get(SNAPSHOT_ENV)
    if zero_copy is not None:
        os.environ[SNAPSHOT_ENV] = "pin" if zero_copy else "copy"
    try:
        opts = CheckpointManagerOptions(save_interval_steps=every,
                                        enable_async_checkpointing=True)
        with CheckpointManager(directory, opts, fs=fs) as mngr:
            for t in range(1, steps + 1):
                x, y = batch(t)
                state, rng, loss = step_fn(state, rng, x, y)
                loader["position"] += 1  # numpy leaves, updated in place
                loader["ema"] *= 0.9
                loader["ema"] += 0.1 * float(loss)
                items = {"state": state, "loader": loader}
                if mngr.should_save(t):
                    truths[t] = _host_truth(items)
                    fs.shut()
                    mngr.save(t, items)
                    if not fs.reached.wait(20):
                        return f"the save of step {t} never reached the disk"
                    # save() returned: the loop goes on at once, the writer is held
                    loader["position"] += 100
                    loader["ema"][:] = -1.0
                    x, y = batch(1000 + t)  # one more step, donating `state`'s buffers
                    state, rng, _ = jax.block_until_ready(step_fn(state, rng, x, y))
                    fs.open_gate()
                    mngr.wait_until_finished()
            for t, truth in truths.items():
                got = mngr.restore(t)
                message = _first_changed(t, got, truth)
                if message is not None:
                    return message
    finally:
        fs.open_gate()
        if zero_copy is not None:
            if before is None:
                os.environ.pop(SNAPSHOT_ENV, None)
            else:
                os.environ[SNAPSHOT_ENV] = before
    return None


def _first_changed(step: int, got: Any, truth: Any) -> str | None:
    """The first leaf (by name) whose restored bytes differ from its value at save()."""
    from .tree import HostKey, path_str

    flat = reference("flatten_with_names")
    for item in ("loader", "state"):
        have = dict(flat(got[item]))
        for names, want in flat(truth[item]):
            a, b = (np.asarray(x.data if isinstance(x, HostKey) else x)
                    for x in (have.get(names), want))
            if a.tobytes() != b.tobytes():
                return (f"the checkpoint of step {step} holds, for {item}/{path_str(names)}, "
                        f"{a.ravel()[:3]} instead of its value at save(), {b.ravel()[:3]}: "
                        "the training loop changed that leaf after save() returned, and the "
                        "background writer saw the change (a snapshot must not share memory "
                        "with the live state)")
    return None


def writer_threads() -> list[Any]:
    """The background save threads alive now (minickpt names them minickpt-async-save:...)."""
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("minickpt-async-save")]


def record_async_run(directory: str, *, steps: int = 12, every: int = 2,
                     fsync_delay: float = 0.04, pause_s: float = 0.05
                     ) -> tuple[list[tuple[float, float]], list[tuple[float, float, float]],
                                list[Any]]:
    """Run a real async training loop and return what Task 5.3 reads: each step's compute
    span ``(start, end)``, each save's ``(start, unblocked, end)`` and the manager's
    ``SaveStats`` history, all on the wall clock (``time.time()``).

    Every fsync takes ``fsync_delay`` longer (a slow disk, so the writes last), and after
    every save the loop pauses ``pause_s`` without computing (an evaluation, say): time a
    write spends there is *not* hidden behind compute.
    """
    import time

    from .asynchronous import save_intervals
    from .demo import SlowDisk, batch
    from .manager import CheckpointManager, CheckpointManagerOptions

    state, rng = fresh_train_state()
    train_step = donating_train_step()
    spans: list[tuple[float, float]] = []
    opts = CheckpointManagerOptions(save_interval_steps=every, enable_async_checkpointing=True)
    with CheckpointManager(directory, opts, fs=SlowDisk(fsync_delay)) as mngr:
        for t in range(1, steps + 1):
            x, y = batch(t)
            t0 = time.time()
            state, rng, _ = jax.block_until_ready(train_step(state, rng, x, y))
            time.sleep(0.004)  # a step long enough to be seen (the model is tiny)
            spans.append((t0, time.time()))
            if mngr.save(t, {"state": state, "rng": rng}):
                time.sleep(pause_s)
        mngr.wait_until_finished()
        history = list(mngr.save_history)
    return spans, save_intervals(history), history


# ---------------------------------------------------------------------------------------
# lab 6 (production): helpers its tests use
# ---------------------------------------------------------------------------------------
def simulate_waste(interval: float, save_cost: float, mtbf: float, *, segments: int = 200,
                   runs: int = 400, seed: int = 0) -> float:
    """Monte-Carlo estimate of a run's waste (wall time / useful compute − 1) under Poisson
    failures: ``segments`` segments of ``interval`` compute + ``save_cost`` save, each retried
    from its start after every failure that strikes inside it. Vectorised with numpy: the
    failures of a run are a negative binomial draw, their lost times truncated exponentials."""
    rng = np.random.default_rng(seed)
    seg = float(interval) + float(save_cost)
    ok = np.exp(-seg / mtbf)  # a segment's chance to finish without a failure
    fails = rng.negative_binomial(segments, ok, size=runs)
    u = rng.random(int(fails.sum()))
    lost = -mtbf * np.log1p(-u * -np.expm1(-seg / mtbf))  # exponential, conditioned < seg
    per_run = np.bincount(np.repeat(np.arange(runs), fails), weights=lost, minlength=runs)
    wall = segments * seg + per_run
    return float(np.mean(wall) / (segments * interval) - 1.0)


def simulate_lost_per_failure(interval: float, save_cost: float, mtbf: float, *,
                              n: int = 200_000, seed: int = 0) -> float:
    """Monte-Carlo mean of the time a failure throws away (work since the segment began, save
    included), for failures drawn exponentially and conditioned to fall inside a segment.

    Drawn from the conditioned distribution itself (inverse CDF of the truncated exponential),
    not by rejection: with a segment much shorter than the MTBF, rejection keeps a handful of
    the ``n`` draws and the mean is noise."""
    rng = np.random.default_rng(seed)
    seg = float(interval) + float(save_cost)
    if seg <= 0:
        return 0.0
    u = rng.random(n)
    t = -mtbf * np.log1p(-u * -np.expm1(-seg / mtbf))
    return float(t.mean())


def simulate_p_fail(p: float, total: float, interval: float, *, runs: int = 200_000,
                    seed: int = 0) -> float:
    """Monte-Carlo share of runs of ⌊total/interval⌋ intervals, each interrupted with
    probability ``p``, that meet at least one interruption."""
    n = int(total // interval)
    rng = np.random.default_rng(seed)
    return float(np.mean(rng.binomial(n, p, size=runs) > 0))


_LOOP_DRIVER = '''from __future__ import annotations
import os, signal, sys, time
from collections.abc import Callable, Mapping
from typing import Any
import numpy as np
import minickpt as mc
from minickpt.production.preemption import LoopResult, PreemptionHandler
{source}
directory, stop, every, hard_exit, use_async = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                sys.argv[4] == "1", sys.argv[5] == "1")
opts = mc.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=None,
                                   enable_async_checkpointing=use_async)
mngr = mc.CheckpointManager(directory, opts)
PreemptionHandler().attach(mngr)
start, w = 0, np.zeros(4)
if mngr.latest_step() is not None:
    restored = mngr.restore()
    start, w = restored.step, restored["w"]
    print(f"resumed from step {{start}}", flush=True)

def step_fn(w, step):
    time.sleep(0.02)  # a step long enough for a signal to land inside it
    w = 0.5 * w + step
    print(f"step {{step}}", flush=True)
    return w, {{"loss": float(w.sum())}}

res = {name}(mngr, w, step_fn, start=start, stop=stop, items=lambda w: {{"w": w}})
print(f"result {{type(res).__name__}} {{getattr(res, 'step', None)}} "
      f"{{getattr(res, 'preempted', None)}}", flush=True)
if hard_exit:  # the grace period ends the moment the loop returns: nothing else runs
    sys.stdout.flush()
    os._exit(0)
mngr.close()
'''


def lab6_carry(step: int) -> np.ndarray:
    """The carry of :func:`run_loop_process`'s training after ``step`` steps."""
    w = np.zeros(4)
    for s in range(1, step + 1):
        w = 0.5 * w + s
    return w


def run_loop_process(fn: Callable[..., Any], directory: str, *, stop: int, every: int,
                     signal_after: int | None = None, sig: int = 15, hard_exit: bool = False,
                     use_async: bool = False, timeout: float = 40.0
                     ) -> tuple[int, list[str], str]:
    """Run the student's training loop ``fn`` (its source, in a fresh Python process) on a
    numpy training run whose manager has a :class:`PreemptionHandler` attached; send ``sig``
    as soon as the process reports step ``signal_after``. Returns (exit code, stdout lines,
    stderr)."""
    import os
    import signal as _signal
    import subprocess
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError) as e:
        raise LabCheckError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} ({e}): "
                            "define it with def in the task's cell and run that cell") from None
    script = _LOOP_DRIVER.format(source=source, name=fn.__name__)
    path = os.path.join(directory, "driver.py")
    with open(path, "w") as f:
        f.write(script)
    ckpt = os.path.join(directory, "ckpt")
    cmd = [sys.executable, path, ckpt, str(stop), str(every), "1" if hard_exit else "0",
           "1" if use_async else "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    import threading

    def kill_later() -> None:
        proc.kill()

    timer = threading.Timer(timeout, kill_later)
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.strip()
            lines.append(line)
            if signal_after is not None and line == f"step {signal_after}":
                proc.send_signal(_signal.Signals(sig))
                signal_after = None
        err = proc.stderr.read() if proc.stderr is not None else ""
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, lines, err[-3000:]


_DRILL_WORKER = '''
import hashlib, sys, time
import numpy as np
import minickpt as mc
directory, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with mc.CheckpointManager(directory, mc.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=3)) as m:
    start, w = 0, np.zeros(8)
    if m.latest_step() is not None:
        r = m.restore()
        start, w = r.step, r["w"]
        print(f"resumed from step {start}", flush=True)
    for step in range(start + 1, total + 1):
        w = w - 0.1 * (w - np.sin(np.arange(8.0) * step))
        time.sleep(0.02)
        print(f"step {step}", flush=True)
        if step % every == 0:  # no first-step save: a kill before step `every` restarts from 0
            print(f"saving step {step}", flush=True)
            m.save(step, {"w": w}, force=True)
            print(f"saved step {step}", flush=True)
print("final " + hashlib.sha256(w.tobytes()).hexdigest()[:16], flush=True)
'''


def drill_worker_fingerprint(total: int, every: int) -> str:
    """The ``final`` fingerprint :func:`drill_worker`'s script prints after an uninterrupted
    run of ``total`` steps (computed here, so a drill needs no reference run)."""
    import hashlib

    w = np.zeros(8)
    for step in range(1, total + 1):
        w = w - 0.1 * (w - np.sin(np.arange(8.0) * step))
    return hashlib.sha256(w.tobytes()).hexdigest()[:16]


def drill_worker(directory: str) -> list[str]:
    """A small numpy training script that speaks the drill's protocol (written into
    ``directory``); its command line, with ``{dir}`` for the drill to fill in. Arguments
    after it: total steps and the save interval."""
    import os

    path = os.path.join(directory, "worker.py")
    with open(path, "w") as f:
        f.write(_DRILL_WORKER)
    return [sys.executable, path, "{dir}"]


def printing_worker(lines: list[tuple[float, str]]) -> Any:
    """A real process that prints ``lines`` (each after its delay in seconds), for feeding a
    drill's reader exactly the events a test wants."""
    from .production.drill import WorkerProcess

    prog = "import time\n" + "".join(f"time.sleep({d!r}); print({s!r}, flush=True)\n"
                                     for d, s in lines)
    return WorkerProcess([sys.executable, "-c", prog])


def no_array_reads() -> Any:
    """A file system that fails any opening of an array data file (``data*.bin``) and
    records every path opened, to prove that a choice was made from metadata only."""
    import os

    from .fs import FileSystem

    class NoArrayReads(FileSystem):
        opened: list[str]

        def __init__(self) -> None:
            self.opened = []

        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            self.opened.append(path)
            name = os.path.basename(path)
            if name.startswith("data") and name.endswith(".bin") and not flags & os.O_WRONLY:
                raise LabCheckError(f"read the array data file {path}: the best version must "
                                    "be chosen from each checkpoint's metadata alone, without "
                                    "restoring (or opening) any array")
            return super().open(path, flags, mode)

    return NoArrayReads()
