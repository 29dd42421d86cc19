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
    included), for failures drawn exponentially and kept when they fall inside a segment."""
    rng = np.random.default_rng(seed)
    t = rng.exponential(mtbf, size=n)
    seg = float(interval) + float(save_cost)
    t = t[t < seg]
    return float(t.mean()) if t.size else seg / 2


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
