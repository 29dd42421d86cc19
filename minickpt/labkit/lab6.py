"""Lab 6 (production): simulated failures, the preemption loop in a real process, drills."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import LabCheckError
from .watch import Reports


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
from minickpt.launch import signer as _signer
from minickpt.production.preemption import LoopResult, PreemptionHandler
from minickpt.labkit import watch as _watch


_send, _permit = _signer({key_env!r}, {tag!r})  # before the student's cell: see minickpt.launch.signer
del _signer
_w = _watch.worker()
_mine = _w.namespace({{_k: _v for _k, _v in globals().items() if _k not in ("_send", "_permit")}})
exec(compile({source!r}, "<your task cell>", "exec"), _mine)
{name} = _w.wrap(_mine[{name!r}])
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
    _send({{"line": f"resumed from step {{start}}"}})

def step_fn(w, step):
    time.sleep(0.02)  # a step long enough for a signal to land inside it
    w = 0.5 * w + step
    _send({{"line": f"step {{step}}"}})
    return w, {{"loss": float(w.sum())}}


_permit(step_fn.__code__)
del _permit

res = {name}(mngr, w, step_fn, start=start, stop=stop, items=lambda w: {{"w": w}})
carry = getattr(res, "carry", None)
_send({{"line": "carry " + (np.asarray(carry, np.float64).tobytes().hex()
                            if carry is not None else "-")}})
_send({{"line": f"result {{type(res).__name__}} {{getattr(res, 'step', None)}} "
                f"{{getattr(res, 'preempted', None)}}"}})
if hard_exit:  # the grace period ends the moment the loop returns: nothing else runs
    sys.stdout.flush()
    os._exit(0)
mngr.close()
'''


_KEY_ENV = "MINICKPT_LAB6_REPORT_KEY_FD"
_TAG = "LAB6"
"""The driver's lines travel signed (HMAC-SHA256, a key the parent sends down a pipe the
driver reads and closes before the student's cell runs): a line the student's loop prints
itself, then ``os._exit``, is not taken for the driver's. Code that digs the key out of the
driver's memory could sign too; the class closed is the printed or written line."""


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
    import secrets

    from ..launch import helper_env, read_signed  # the loop runs on the CPU: see helper_env

    script = _LOOP_DRIVER.format(source=source, name=fn.__name__, key_env=_KEY_ENV, tag=_TAG)
    key = secrets.token_bytes(32)
    path = os.path.join(directory, "driver.py")
    with open(path, "w") as f:
        f.write(script)
    ckpt = os.path.join(directory, "ckpt")
    cmd = [sys.executable, path, ckpt, str(stop), str(every), "1" if hard_exit else "0",
           "1" if use_async else "0"]
    reports = Reports([fn])
    r, w = os.pipe()
    try:
        os.write(w, key)
        os.close(w)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL,
                                env={**reports.env(helper_env()), _KEY_ENV: str(r)},
                                pass_fds=(*reports.pass_fds, r))
    finally:
        os.close(r)
    forged = 0
    lines: list[str] = []
    import threading

    def kill_later() -> None:
        proc.kill()

    timer = threading.Timer(timeout, kill_later)
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            said, bad = read_signed([raw], key, _TAG)
            forged += bad
            if not said:
                continue  # the student's own output: never taken for the driver's
            line = str(said[0].get("line", "")).strip()
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
    reports.check()
    if forged:
        err += (f"\n[the drill ignored {forged} {_TAG} line(s) not signed by its driver: "
                "only the driver reports the loop's steps and result]")
    return rc, lines, err[-3000:]


def _carry_of(lines: list[str]) -> np.ndarray | None:
    """The carry the driver printed (``carry <hex of float64 bytes>``), or None."""
    for line in lines:
        if line.startswith("carry ") and line != "carry -":
            try:
                return np.frombuffer(bytes.fromhex(line.split()[1]), np.float64)
            except ValueError:
                return None
    return None


def preemption_drill(fn: Callable[..., Any], directory: str, *, signals: int = 3,
                     stop: int = 40, every: int = 25, seed: int = 0, use_async: bool = False,
                     hard_exit: bool = False) -> str | None:
    """Run the student's loop ``fn`` in real processes, one after another on one checkpoint
    directory, each sent a real SIGTERM right after it reports a step drawn at random
    (``signals`` of them, ``seed``), then one last process that runs to ``stop``.

    What must hold after every SIGTERM (chapter 6, section 4): the process exits 0 after its
    loop returned ``LoopResult(carry, step, True)``; ``step`` is the step it was computing
    when the notice came, or the next one (the manager's decision); it computed no step
    after it; the newest checkpoint is that step, holding exactly the carry after it (no
    step lost); the next process resumes from there and computes the following step. The
    last process ends at ``stop``, not preempted, with the carry of an uninterrupted run.
    ``use_async``: the manager saves asynchronously; ``hard_exit``: the process ends with
    ``os._exit`` right after the loop returns (nothing else runs). Returns None, or what
    went wrong (a message naming the process and the step).
    """
    import os
    import random

    from ..manager import CheckpointManager, CheckpointManagerOptions

    rnd = random.Random(seed)
    ckpt = os.path.join(directory, "ckpt")
    resumed, plan = 0, []
    for _ in range(signals):
        at = resumed + 1 + rnd.randrange(0, 9)
        plan.append(at)
        resumed = at + 1  # at the latest
    plan.append(None)
    done = 0
    for i, at in enumerate(plan, 1):
        run = f"process {i} (SIGTERM after step {at})" if at else f"process {i} (no signal)"
        rc, out, err = run_loop_process(fn, directory, stop=stop, every=every, signal_after=at,
                                        hard_exit=hard_exit, use_async=use_async)
        tail = err.strip()[-1200:]
        if done:
            if out[:2] != [f"resumed from step {done}", f"step {done + 1}"]:
                return (f"{run} should resume from step {done} (the newest checkpoint) and "
                        f"compute step {done + 1} next; it printed {out[:3]}. {tail}")
        result = [line for line in out if line.startswith("result ")]
        if rc != 0 or len(result) != 1:
            return (f"{run} exited with code {rc} and printed {out[-3:]}: the loop should "
                    "return a LoopResult, and the process end normally (exit 0), after a "
                    f"SIGTERM as without one"
                    + (" (did something end the process before the loop returned: sys.exit "
                       "in a signal handler?)" if rc == 0 else "")
                    + f". Its stderr ends with:\n{tail}")
        _, kind, step_s, preempted = (result[0].split() + ["?"] * 4)[:4]
        steps = [int(line.split()[1]) for line in out if line.startswith("step ")]
        last = steps[-1] if steps else done
        if kind != "LoopResult" or not step_s.lstrip("-").isdigit():
            return f"{run}: the loop returned {result[0][7:]!r}, not a LoopResult"
        stopped = int(step_s)
        if at is None:
            carry = _carry_of(out)
            if preempted != "False" or stopped != stop:
                return (f"{run}: without a notice the loop should run to step {stop} and return "
                        f"preempted=False; it returned step {stopped}, preempted={preempted}")
            if carry is None or not np.array_equal(carry, lab6_carry(stop)):
                return (f"{run}: after {len(plan) - 1} preemptions and resumes the final carry "
                        f"is {carry}, not the uninterrupted run's {lab6_carry(stop)}")
            return None
        if preempted != "True":
            return (f"{run}: the loop returned preempted={preempted} at step {stopped}; a "
                    "SIGTERM arrived, so it should stop early and say so")
        if stopped not in (at, at + 1):
            return (f"{run}: the SIGTERM came right after step {at} was computed, so the job "
                    f"stops at step {at} or {at + 1} (the first step boundary the manager "
                    f"names); the loop returned step {stopped}")
        if last != stopped:
            return (f"{run}: the loop returned step {stopped} but computed step {last}: a "
                    "step computed after the one the job stopped at is lost")
        with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
            newest = m.latest_step()
            w = m.restore(newest)["w"] if newest is not None else None
        if newest != stopped:
            lost = stopped - (newest or 0)
            return (f"{run}: the loop stopped after step {stopped}, but the newest checkpoint "
                    f"is {newest}: the restart will compute {lost} step(s) again, and a "
                    "preemption notice is there so that none is lost. Which step did the "
                    "manager decide to save, and did your loop give it the chance?")
        if not np.array_equal(np.asarray(w), lab6_carry(stopped)):
            return (f"{run}: the checkpoint of step {stopped} holds {np.asarray(w)}, not the "
                    f"carry after step {stopped} ({lab6_carry(stopped)}): was it saved in the "
                    "middle of a step (from a signal handler), under the wrong step number?")
        done = stopped
    return None


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
    from ..production.drill import WorkerProcess

    prog = "import time\n" + "".join(f"time.sleep({d!r}); print({s!r}, flush=True)\n"
                                     for d, s in lines)
    return WorkerProcess([sys.executable, "-c", prog])


def no_array_reads() -> Any:
    """A file system that fails any opening of an array data file (``data*.bin``) and
    records every path opened, to prove that a choice was made from metadata only."""
    import os

    from ..fs import FileSystem

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
