"""Lab 5 (async): memory sharing, a gated file system, donating training runs, writer threads."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

import jax
import numpy as np

from .devices import drawn, shard
from .plugging import reference


def pinning_works() -> bool:
    """Whether this JAX pins a CPU buffer while a numpy view of it lives (then a view is as
    safe a snapshot as a copy; see :func:`minickpt.tree.pinning_works`)."""
    from ..tree import pinning_works as works

    return works()


def shares_memory(a: Any, b: Any) -> bool:
    """Whether two host arrays (or a HostKey's data) overlap in memory."""
    from ..tree import HostKey

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
    writer reads a byte. ``reached`` is set when a save arrives at the gate.
    ``fail_next("fsync")`` makes the next fsync (or ``"write"``) fail with ENOSPC."""
    import errno
    import os
    import threading
    import time

    from ..commit import TMP_MARK
    from ..fs import FileSystem

    class GatedFS(FileSystem):
        def __init__(self) -> None:
            self.gate, self.reached = threading.Event(), threading.Event()
            self.gate.set()
            self.calls: list[tuple[str, str]] = []
            self.armed: dict[str, int] = {}
            self.fsync_delay = 0.0  # seconds added to every fsync (a slow disk)

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

        def fail_next(self, op: str = "fsync", err: int = errno.ENOSPC) -> None:
            """Make the next ``op`` call (``fsync`` or ``write``) raise a fresh
            ``OSError(err)``: a disk that fails while the background writer is at work."""
            self.armed[op] = err

        def _maybe_fail(self, op: str) -> None:
            err = self.armed.pop(op, None)
            if err is not None:
                self.calls.append(("failed " + op, ""))
                raise OSError(err, os.strerror(err))

        def fsync(self, fd: int) -> None:
            self._maybe_fail("fsync")
            if self.fsync_delay:
                time.sleep(self.fsync_delay)
            super().fsync(fd)

        def write(self, fd: int, data: Any) -> int:
            self._maybe_fail("write")
            return super().write(fd, data)

        def writev(self, fd: int, buffers: Any) -> int:
            self._maybe_fail("write")
            return super().writev(fd, buffers)

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
    from ..demo import batch, make_state

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
    from ..demo import train_step

    return jax.jit(train_step.__wrapped__, donate_argnums=0)


def _host_truth(tree: Any) -> Any:
    """An independent copy of every leaf as it is now: lab 1's ``to_host`` with a copy, not
    task 5.1's code (a lab 5 check never runs the reference of a lab 5 task)."""
    from ..tree import to_host

    return jax.tree_util.tree_map(lambda x: to_host(x, copy=True), tree)


def snapshot_cases() -> list[Any]:
    """The leaves task 5.1's hidden test photographs: every kind minickpt stores."""
    import jax.numpy as jnp


    return [np.float64(2.5), np.int8(-3), np.array(7, np.uint16), np.ones((2, 3), jnp.bfloat16),
            shard(jnp.arange(64.0).reshape(8, 8)), jnp.zeros((0, 3)), jax.random.key(1),
            "text", 0, np.zeros((2, 0), np.float32), jnp.asarray(True)]


def describe_leaf(x: Any) -> tuple[Any, ...]:
    """A snapshot as plain values (kind, dtype, shape, bytes in hex), which the kernel can
    report and the grader compare: a test's expected snapshot is never in the kernel."""
    from ..tree import HostKey

    if type(x) is np.ndarray:
        return ("ndarray", str(x.dtype), tuple(int(n) for n in x.shape), x.tobytes().hex())
    if type(x) is HostKey:
        data = np.asarray(x.data)
        return ("HostKey", str(x.impl), str(data.dtype), data.tobytes().hex())
    if type(x) in (bool, int, float, str, type(None)):
        return (type(x).__name__, repr(x))
    return (type(x).__name__, "?")


def random_timelines(n: int, *, seed: int) -> list[tuple[list[tuple[float, float]],
                                                         list[tuple[float, float, float]]]]:
    """``n`` random training timelines for task 5.3: (steps, saves in a shuffled order), one
    save in flight at a time, as a real async run makes them. The same for the same seed
    (under the grader's judge, a seed drawn from it: :func:`minickpt.labkit.devices.drawn`)."""
    rng = np.random.default_rng(drawn(seed))
    out = []
    for _ in range(n):
        t, steps, saves, prev_end = 0.0, [], [], 0.0
        for _i in range(int(rng.integers(1, 15))):
            d = float(rng.uniform(0.01, 0.2))
            steps.append((t, t + d))
            t += d + float(rng.uniform(0, 0.05))
            if rng.random() < 0.4:
                start = t
                unblocked = max(t, prev_end) + float(rng.uniform(0, 0.02))
                end = unblocked + float(rng.uniform(0.01, 0.6))
                saves.append((start, unblocked, end))
                prev_end, t = end, unblocked
        order = rng.permutation(len(saves))
        out.append((steps, [saves[j] for j in order]))
    return out


def async_training_run(directory: str, *, steps: int = 4, every: int = 2,
                       zero_copy: bool | None = None) -> str | None:
    """A real training loop that checkpoints asynchronously and, right after each
    ``save()`` returns, mutates its numpy leaves in place and donates its device buffers to
    the next step — while the background writer is held, so it reads only afterwards.

    Returns None if every checkpoint restores to exactly the state at its ``save()``, or a
    message naming the step and the leaf that changed after ``save()`` returned.
    """
    import os

    from ..asynchronous import SNAPSHOT_ENV
    from ..demo import batch
    from ..manager import CheckpointManager
    from ..options import CheckpointManagerOptions

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


def async_faulty_run(directory: str, *, fail: tuple[str, str] = ("fsync", "write"),
                     fsync_delay: float = 0.02) -> str | None:
    """A real training loop with async saves on a disk that fails in the background.

    The loop saves steps 1 to 5, one save per step, and right after each ``save()`` returns
    it moves its numpy leaves on in place and runs a step that donates the state's buffers,
    while the writer is held at its first file-system call (so it reads only afterwards).
    The disk is slow (every fsync takes ``fsync_delay`` longer). It fails with ENOSPC at
    one ``fail[0]`` call of the save of step 2, which nobody waits for, and at one
    ``fail[1]`` call of the save of step 4, which ``wait_until_finished()`` waits for.

    While the save of step 1 is in flight it also calls the writer's ``start`` once more,
    which must be refused. What must hold (chapter 5, sections 3-5): the failure of step 2 reaches the loop at its
    next ``save()``, as the ``OSError`` it was (errno ENOSPC), with a note naming step 2;
    exactly once, so that saving step 3 again commits; the failure of step 4 is raised by
    ``wait_until_finished()``, once; no save starts while another is in flight; a failed
    save commits nothing, deletes nothing older and leaves no temporary; every committed
    checkpoint holds the state at its ``save()``; ``close()`` raises nothing more and no
    writer thread outlives it. Returns None, or a message saying what went wrong.
    """
    import errno

    from ..commit import is_temporary
    from ..demo import batch
    from ..manager import CheckpointManager, CheckpointManagerOptions

    state, rng = fresh_train_state()
    loader = {"position": np.zeros(4, np.int64), "ema": np.zeros(3, np.float32)}
    fs = gated_fs()
    fs.fsync_delay = fsync_delay
    step_fn = donating_train_step()
    truths: dict[int, Any] = {}
    where = "before the first save"

    def disk_full(e: BaseException) -> bool:
        return isinstance(e, OSError) and e.errno == errno.ENOSPC

    def describe(e: BaseException) -> str:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def overlapped(t: int) -> bool:
        """Whether the save of step t began writing before the save of t - 1 had ended."""
        calls = list(fs.calls)

        def made(k: int) -> int | None:
            return next((i for i, (op, p) in enumerate(calls) if op == "mkdir"
                         and p.rsplit("/", 1)[-1].startswith(f"step_{k}.")), None)

        mine, prev = made(t), made(t - 1)
        if mine is None or prev is None:
            return False
        if t - 1 in (2, 4):  # a failed save ends where its disk call failed
            end = next((i for i in range(prev, len(calls))
                        if calls[i][0].startswith("failed")), None)
        else:
            end = next((i for i in range(prev, len(calls)) if calls[i][0] == "rename"
                        and calls[i][1].endswith(f"step_{t - 1}")), None)
        return end is None or mine < end

    def two_in_flight(t: int) -> str:
        return (f"the save of step {t} began writing while the save of step {t - 1} was still "
                "in flight: two saves at once. The manager waits for the thread the writer "
                "records before it starts the next save, and the writer refuses a second one")

    def body(mngr: Any) -> str | None:
        nonlocal where

        def train(t: int) -> dict[str, Any]:
            nonlocal state, rng
            x, y = batch(t)
            state, rng, loss = step_fn(state, rng, x, y)
            loader["position"] += 1
            loader["ema"] *= 0.9
            loader["ema"] += 0.1 * float(loss)
            return {"state": state, "loader": loader}

        def save(t: int, items: dict[str, Any], arm: str | None = None) -> str | None:
            """save(t); then, while the writer is held, mutate and donate."""
            nonlocal state, rng, where
            where = f"save({t})"
            truth = _host_truth(items)
            fs.shut()
            if mngr.save(t, items, force=True) is not True:
                return f"save({t}, force=True) did not save"
            if not fs.reached.wait(20):
                return (f"the background save of step {t} never reached the disk: does "
                        "start_in_background start a thread that runs the write phase?")
            truths[t] = truth
            if t == 1:  # a second write started while this one is in flight must be refused
                from ..errors import MiniCkptError

                try:
                    mngr._async._writer.start(lambda: None, what="a second save")
                except MiniCkptError:
                    pass
                else:
                    fs.open_gate()
                    return ("while the save of step 1 was in flight, writer.start() accepted a "
                            "second write phase: two saves at once (they compete for the disk, "
                            "may commit out of order, and retention may delete what the other "
                            "counts on). A start while one is in flight must be refused")
            if arm is not None:
                fs.fail_next(arm)
            loader["position"] += 100  # save() returned: the loop goes on at once
            loader["ema"][:] = -1.0
            x, y = batch(1000 + t)
            state, rng, _ = jax.block_until_ready(step_fn(state, rng, x, y))
            fs.open_gate()
            return two_in_flight(t) if overlapped(t) else None

        for t, arm in ((1, None), (2, fail[0])):
            problem = save(t, train(t), arm)
            if problem:
                return problem
        items = train(3)
        where = "save(3) after the failed save of step 2"
        try:
            fs.shut()
            saved = mngr.save(3, items, force=True)
        except BaseException as e:  # what the writer raised
            if not disk_full(e):
                return (f"the save of step 2 failed in the background with OSError(ENOSPC), "
                        f"but the next save() raised {describe(e)} instead of that error: the "
                        "training loop must get the original exception, errno intact, so that "
                        "it can tell a full disk from a bug")
            if not any("step 2" in n for n in getattr(e, "__notes__", [])):
                return ("the OSError(ENOSPC) of step 2 reached the loop, but without a note "
                        "naming the save that raised it (step 2): a loop that saves every few "
                        "steps cannot tell which checkpoint is missing")
        else:
            fs.reached.wait(20)
            fs.open_gate()
            if overlapped(3):
                return two_in_flight(3)
            return (f"the save of step 2 failed in the background with OSError(ENOSPC), and the "
                    f"next save() returned {saved!r} as if nothing had happened: the training "
                    "loop goes on believing step 2 is on disk. A background error must be "
                    "kept and raised at the next call of the loop")
        finally:
            fs.open_gate()
        where = "save(3) once more, after the error of step 2 was raised"
        try:
            problem = save(3, items)
        except BaseException as e:
            return (f"the error of step 2 was raised once; saving step 3 again raised "
                    f"{describe(e)}: a background error is reported once, then forgotten, so "
                    "that the next save can run (collected, but never cleared?)")
        if problem:
            return problem
        problem = save(4, train(4), fail[1])
        if problem:
            return problem
        where = "wait_until_finished() after the save of step 4"
        try:
            mngr.wait_until_finished()
        except BaseException as e:
            if not disk_full(e):
                return (f"the save of step 4 failed in the background with OSError(ENOSPC); "
                        f"wait_until_finished() raised {describe(e)} instead")
        else:
            return ("the save of step 4 failed in the background with OSError(ENOSPC), and "
                    "wait_until_finished() returned without raising it: whoever waits for the "
                    "save must learn that it failed")
        where = "wait_until_finished() once more"
        try:
            mngr.wait_until_finished()
        except BaseException as e:
            return (f"the error of step 4 was raised once; wait_until_finished() raised again, "
                    f"{describe(e)}: once raised, an error must be forgotten")
        return save(5, train(5))

    opts = CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
    mngr = CheckpointManager(directory, opts, fs=fs)
    problem: str | None = None
    try:
        problem = body(mngr)
    except BaseException as e:  # reported, not raised: the message is the verdict
        problem = f"{where} raised {describe(e)}"
    finally:
        fs.open_gate()
        try:
            mngr.close()
        except BaseException as e:
            problem = problem or (f"close() raised {describe(e)}, after every error had been "
                                  "raised once: nothing was left to report")
    if problem:
        return problem
    steps = mngr.all_steps()
    if steps != [1, 3, 5]:
        return (f"the steps on disk are {steps}, expected [1, 3, 5]: the saves of steps 2 and "
                "4 failed and must commit nothing, and no other checkpoint may be lost")
    left = [n for n in os.listdir(directory) if is_temporary(n)]
    if left:
        return f"a failed save left its temporary directory behind: {left}"
    with CheckpointManager(directory, CheckpointManagerOptions(read_only=True)) as reader:
        for t in (1, 3, 5):
            message = _first_changed(t, reader.restore(t), truths[t])
            if message is not None:
                return message
    alive = writer_threads()
    if alive:
        return f"background save threads still running after close(): {alive}"
    return None


def _first_changed(step: int, got: Any, truth: Any) -> str | None:
    """The first leaf (by name) whose restored bytes differ from its value at save()."""
    from ..tree import HostKey, path_str

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

    from ..asynchronous import save_intervals
    from ..demo import SlowDisk, batch
    from ..manager import CheckpointManager
    from ..options import CheckpointManagerOptions

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


def pretend_no_pinning() -> Any:
    """A context manager: inside it, minickpt's probe answers that this JAX does *not* pin a
    CPU buffer while a numpy view of it lives (``pinning_works()`` is False, ``pinned_view``
    returns None), as on a JAX version where donation reuses a viewed buffer. A snapshot
    that trusts a view without asking the probe is then unsafe, whatever this JAX does."""
    import contextlib

    from .. import tree

    @contextlib.contextmanager
    def pretend() -> Any:
        tree.pinning_works()  # the real verdict, cached first, so that it can be put back
        with tree._PIN_LOCK:
            real, tree._pinning = tree._pinning, False
        try:
            with mirrored("pretend_no_pinning"):
                yield
        finally:
            with tree._PIN_LOCK:
                tree._pinning = real

    return pretend()


MIRRORED = ("pretend_no_pinning",)
"""The set-ups a test makes by changing minickpt that the grader's judge makes in the
student's worker process too (:mod:`autograder.judge`): there the student's function runs in
another process, whose minickpt the test's change does not reach."""


def mirrored(name: str) -> Any:
    """Under the grader's judge, the same set-up ``name`` in the student's worker for the
    block; elsewhere (a notebook, a worker) nothing."""
    import contextlib
    import sys

    graded = sys.modules.get("minickpt._graded")
    mirror = getattr(graded, "mirror", None)
    if mirror is None or name not in MIRRORED:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def there() -> Any:
        leave = mirror(name)
        try:
            yield
        finally:
            leave()

    return there()


def start_race(writer_cls: Any, *, patience_s: float = 3.0) -> str | None:
    """Two threads call ``start`` on one writer at once, interleaved at the worst moment, the
    same way every run: the first to read ``writer._thread`` is held there until the other
    has reached that read too (or waits for ``writer._lock``), and, once it has set
    ``writer._thread``, it is held again when it releases the lock, until the other's
    ``start`` has returned. A writer that checks and starts under its lock refuses one of
    the two; one that checks without the lock, or lets the lock go before the new thread has
    started, runs two write phases at once. Returns None, or what went wrong."""
    import threading
    import time

    racers: dict[int, str] = {}  # thread id -> "a" / "b"
    arrived = {"a": threading.Event(), "b": threading.Event()}
    returned = {"a": threading.Event(), "b": threading.Event()}
    state = {"first": None, "setter": None, "held_at_release": False}
    guard = threading.Lock()

    def other(me: str) -> str:
        return "b" if me == "a" else "a"

    class ProbeLock:
        def __init__(self) -> None:
            self._inner = threading.Lock()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            me = racers.get(threading.get_ident())
            if me is not None:
                arrived[me].set()
            return self._inner.acquire(blocking, timeout)

        def release(self) -> None:
            self._inner.release()
            me = racers.get(threading.get_ident())
            with guard:
                hold = me is not None and state["setter"] == me and not state["held_at_release"]
                if hold:
                    state["held_at_release"] = True
            if hold:
                returned[other(me)].wait(patience_s)

        def locked(self) -> bool:
            return self._inner.locked()

        __enter__ = acquire

        def __exit__(self, *exc: Any) -> None:
            self.release()

    class Racing(writer_cls):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            value = super().__getattribute__(name)  # read first: held with what it saw
            if name == "_thread":
                me = racers.get(threading.get_ident())
                if me is not None:
                    arrived[me].set()
                    with guard:
                        if state["first"] is None:
                            state["first"] = me
                        first = state["first"] == me
                    if first:
                        arrived[other(me)].wait(patience_s)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, value)
            me = racers.get(threading.get_ident()) if name == "_thread" else None
            if me is not None:
                with guard:
                    if state["setter"] is None:
                        state["setter"] = me

    w = Racing()
    w._lock = ProbeLock()
    running, most, go = [0], [0], threading.Event()

    def write() -> None:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        go.wait(patience_s)
        with guard:
            running[0] -= 1

    outcome: dict[str, str] = {}

    def racer(me: str) -> None:
        racers[threading.get_ident()] = me
        try:
            w.start(write, what=f"step {1 if me == 'a' else 2}")
            outcome[me] = "started"
        except BaseException as e:
            outcome[me] = type(e).__name__
        finally:
            returned[me].set()

    threads = [threading.Thread(target=racer, args=(me,), name=f"start-race-{me}") for me in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * patience_s + 5)
    time.sleep(0.05)  # a write phase started last has reached its counter
    go.set()
    try:
        w.wait()
    except BaseException as e:
        return f"wait() after the race raised {type(e).__name__}: {e}"
    try:
        w.check_for_errors()
    except BaseException:
        pass
    started = sorted(k for k, v in outcome.items() if v == "started")
    if len(started) == 2 or most[0] > 1:
        return ("two threads called start() at once and both write phases ran, two saves in "
                "flight: check the thread in flight and start the new one under writer._lock, "
                "and let the lock go only once the new thread has started (a thread that is "
                "set in writer._thread but not started yet looks finished to the other caller)")
    if sorted(outcome.values()) != ["MiniCkptError", "started"]:
        return (f"two threads called start() at once: one should start and the other get "
                f"MiniCkptError; got {outcome}")
    return None
