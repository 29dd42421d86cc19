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


# ---------------------------------------------------------------------------------------
# lab 4 (multi-host): helpers its tests use
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# lab 5 (async): helpers its tests use
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# lab 6 (production): helpers its tests use
# ---------------------------------------------------------------------------------------
