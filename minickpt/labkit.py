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


# ---------------------------------------------------------------------------------------
# lab 4 (multi-host): helpers its tests use
# ---------------------------------------------------------------------------------------


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
