"""Lab 5 (async): memory sharing, a gated file system, donating training runs, writer threads."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import jax
import numpy as np

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
    writer reads a byte. ``reached`` is set when a save arrives at the gate."""
    import threading

    from ..commit import TMP_MARK
    from ..fs import FileSystem

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
