"""Lab 6's preemption drill (task 6.3): the student's loop in real processes that get real
signals, one after another on one checkpoint folder.

One driver serves both drills, the student's practice run (:func:`preemption_drill`, in the
kernel) and the grader's (autograder/drills.py), so that a graded run looks like a practice
run. A worker starts knowing only its folder. It connects to the drill's socket
(:mod:`minickpt.labkit.channel`) and says hello, so that the drill reads which signals the
process catches before any code of the student's runs; it loads the student's definitions;
only then is it told its set-up (sync or async manager, interval, the training step's
coefficients, metrics or not, an ``on_step`` or not, which signal the preemption handler
listens to), and it calls the student's loop with it. After each step it waits for the drill,
which reads the worker's caught signals from ``/proc`` (a handler the loop installed shows
there), sends the notice if this is its step, and lets it go on. When the loop returns, the
worker waits again while the drill reads the disk: every save the loop started must be there.

The grader's verdict (:func:`effects_message`) comes from what it observed itself: the
signals it sent, the exit code, the caught-signal masks, the checkpoints on disk (steps,
carries, metrics, read by the full library) and the calls of ``on_step``, which the driver
reports as they happen.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# channel is imported here, not in the functions: the referee's private copy of the kit
# (autograder/referee.py) has no package to import from once it is loaded
from . import channel
from .checks import LabCheckError
from .processes import DRILL_KEY, LAUNCH_KEYS, launch_options, read_tail, source_of
from .watch import Reports

_LOOP_DRIVER = '''from __future__ import annotations
import os, signal, sys, time
from collections.abc import Callable, Mapping
from typing import Any
import numpy as np
import minickpt as mc
from minickpt.demo import SlowDisk
from minickpt.labkit import channel as _ch
from minickpt.labkit import watch as _watch
from minickpt.production.preemption import LoopResult, PreemptionHandler

_dir = sys.argv[1]
_conn = _ch.connect(_dir)
_ch.send(_conn, {{"hello": os.getpid()}})  # the drill reads the caught signals now
_ch.recv(_conn, 60.0)
_w = _watch.worker()
_mine = _w.namespace({{_k: _v for _k, _v in globals().items() if _k not in ("_conn", "_ch")}})
with open(os.path.join(_dir, {code_name!r}), encoding="utf-8") as _f:
    exec(compile(_f.read(), "<your task cell>", "exec"), _mine)
{name} = _w.wrap(_mine[{name!r}])
_ch.send(_conn, {{"loaded": True}})
_set = _ch.recv(_conn, 60.0)  # only now, with your code loaded: how this process is set up
_handler = PreemptionHandler(signals=(_set["signal"],))
opts = mc.CheckpointManagerOptions(save_interval_steps=_set["every"], max_to_keep=None,
                                   enable_async_checkpointing=_set["async"])
mngr = mc.CheckpointManager(os.path.join(_dir, "ckpt"), opts,
                            fs=SlowDisk(_set["slow"]) if _set["slow"] else None)
_handler.attach(mngr)
start, w = 0, np.zeros(4)
if mngr.latest_step() is not None:
    restored = mngr.restore()
    start, w = restored.step, np.asarray(restored["w"])
_ch.send(_conn, {{"resumed": start}})
_a, _b = float(_set["a"]), float(_set["b"])


def step_fn(w, step):
    time.sleep(0.02)
    w = _a * w + _b * step
    _ch.send(_conn, {{"step": step}})
    _ch.recv(_conn, 120.0)  # the drill signals now, if this is its step, then lets the step end
    return w, ({{"loss": float(w.sum())}} if _set["metrics"] else None)


def on_step(step, carry, metrics):
    try:
        c = np.asarray(carry, np.float64).tobytes().hex()
    except Exception:
        c = None
    _ch.send(_conn, {{"on_step": [step if type(step) is int else repr(step)[:40], c,
                                  metrics if metrics is None or isinstance(metrics, dict)
                                  else repr(metrics)[:80]]}})


_more = {{"on_step": on_step}} if _set["on_step"] else {{}}
res = {name}(mngr, w, step_fn, start=start, stop=_set["stop"], items=lambda w: {{"w": w}}, **_more)
try:
    _carry = np.asarray(getattr(res, "carry", None), np.float64).tobytes().hex()
except Exception:
    _carry = None
_step, _pre = getattr(res, "step", None), getattr(res, "preempted", None)
_ch.send(_conn, {{"returned": [type(res).__name__, _step if type(_step) is int else repr(_step)[:40],
                               _pre if type(_pre) is bool else repr(_pre)[:40], _carry]}})
_ch.recv(_conn, 120.0)  # the drill reads the disk now: the process may be killed the moment
if _set["hard_exit"]:    # the loop returns (hard_exit: nothing else runs)
    os._exit(0)
mngr.close()
'''

KERNEL_SETUP = {"a": 0.5, "b": 1.0, "metrics": True, "on_step": False, "slow": 0.0,
                "signal": 15}
"""The practice drill's set-up (the kernel's): the visible tests' training step and SIGTERM."""


def lab6_carry(step: int, start: int = 0, carry: Any = None, *, a: float = 0.5,
               b: float = 1.0) -> np.ndarray:
    """The carry of the drills' training after ``step`` steps (going on from ``carry`` after
    step ``start``; default: a run from its beginning): ``w = a * w + b * step`` each step."""
    w = np.zeros(4) if carry is None else np.array(carry, np.float64)
    for s in range(start + 1, step + 1):
        w = a * w + b * s
    return w


def caught_signals(pid: int) -> int | None:
    """The signals process ``pid`` has a handler for (``SigCgt`` of ``/proc/<pid>/status``,
    a bit per signal), read from outside the process; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _signals_in(mask: int) -> list[str]:
    import signal

    out = []
    for n in range(1, 65):
        if mask >> (n - 1) & 1:
            try:
                out.append(signal.Signals(n).name)
            except ValueError:
                out.append(f"signal {n}")
    return out


def _committed(ckpt: str) -> list[int]:
    """The steps committed in ``ckpt`` (``step_<N>`` folders), read now."""
    import os

    try:
        names = os.listdir(ckpt)
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())


def run_loop_worker(source: str, directory: str, *, name: str = "train_until_preempted",
                    setup: Mapping[str, Any], signal_after: int | None = None,
                    timeout: float = 40.0, env: Mapping[str, str] | None = None,
                    pass_fds: Sequence[int] = (), python: str = sys.executable,
                    wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
                    after_run: Callable[[], None] | None = None,
                    send_signal: Callable[[Any, int], bool | None] | None = None,
                    locate: Callable[[Any], int | None] | None = None) -> dict[str, Any]:
    """One process of the loop: the code ``source`` (defines ``name``) runs in the driver, a
    fresh Python process training on ``directory``/ckpt with ``setup`` (the keys of
    :data:`KERNEL_SETUP`, and ``stop``, ``every``, ``async``, ``on_step``, ``hard_exit``),
    told over the channel once the code is loaded. The signal ``setup["signal"]`` is sent
    right after step ``signal_after``. ``wrap`` puts the command in the submission's sandbox,
    ``after_run`` ends what is left of the worker, ``send_signal(proc, sig)`` reaches the
    worker inside the sandbox (False: it found none) and ``locate(proc)`` gives its pid on
    this machine (for ``/proc``).

    Returns ``rc``, ``lines`` (what the driver reported, as text), ``err`` (the tail of
    stderr), ``signalled`` (the step after which the signal was sent, or None), ``handlers``
    (signals caught beyond those caught before the student's code and the notice's own),
    ``on_step`` (the calls reported: step, carry, metrics), ``returned`` (what the loop
    returned, or None) and ``at_return`` (the steps committed when it returned)."""
    import os
    import signal as _signal
    import subprocess
    import threading
    import time

    from ..launch import helper_env  # the loop runs on the CPU: see helper_env

    code_name = f"{name}.py"
    with open(os.path.join(directory, code_name), "w", encoding="utf-8") as f:
        f.write(source)
    path = os.path.join(directory, "driver.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(_LOOP_DRIVER.format(code_name=code_name, name=name))
    ckpt = os.path.join(directory, "ckpt")
    env = {**(env if env is not None else helper_env()), "JAX_PLATFORMS": "cpu"}
    listener = channel.Listener(directory)  # before wrap: the folder becomes the worker's
    cmd = [python, path, directory]
    cmd = wrap(cmd, env) if wrap is not None else cmd
    out: dict[str, Any] = {"rc": None, "lines": [], "err": "", "signalled": None,
                           "timeout": timeout, "handlers": [], "on_step": [], "returned": None,
                           "at_return": None}
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL, env=env,
                                pass_fds=tuple(pass_fds), errors="replace")
    except BaseException:
        listener.close()  # no socket left behind in the folder
        raise

    reader = threading.Thread(target=read_tail, args=(proc.stderr, tail), daemon=True)
    reader.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    send = send_signal or (lambda p, s: p.send_signal(s))
    where = locate or (lambda p: p.pid)
    sig = int(_signal.Signals(setup["signal"]))
    conn = None
    try:
        conn = listener.accept(timeout)
        listener.close()
        if conn is not None:
            _converse(conn, proc, setup, signal_after, sig, send, where, ckpt, out,
                      time.monotonic() + timeout)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    finally:
        timer.cancel()
        if conn is not None:
            conn.close()
        listener.close()
        if proc.poll() is None:
            proc.kill()
        out["rc"] = proc.wait()
        reader.join(timeout=5)
        if after_run is not None:
            after_run()
    out["err"] = "".join(tail)[-3000:]
    return out


def _converse(conn: Any, proc: Any, setup: Mapping[str, Any], signal_after: int | None,
              sig: int, send: Callable[[Any, int], bool | None],
              where: Callable[[Any], int | None], ckpt: str, out: dict[str, Any],
              deadline: float) -> None:
    """The drill's side of one worker's run (see :func:`run_loop_worker`)."""
    import time

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    def look(pid: int | None, allowed: int) -> None:
        mask = caught_signals(pid) if pid is not None else None
        if mask is not None and mask & ~allowed:
            for s in _signals_in(mask & ~allowed):
                if s not in out["handlers"]:
                    out["handlers"].append(s)

    try:
        channel.recv(conn, left())  # hello: nothing of the student's has run yet
        pid = where(proc)
        base = caught_signals(pid) if pid is not None else None
        allowed = (base or 0) | 1 << (sig - 1)
        channel.send(conn, "load")
        channel.recv(conn, left())  # loaded
        channel.send(conn, {k: setup[k] for k in ("a", "b", "metrics", "on_step", "slow",
                                                  "signal", "stop", "every", "async",
                                                  "hard_exit")})
        steps = 0
        while True:
            msg = channel.recv(conn, left())
            if not isinstance(msg, dict):
                continue
            if "resumed" in msg:
                if msg["resumed"]:
                    out["lines"].append(f"resumed from step {msg['resumed']}")
            elif "step" in msg:
                out["lines"].append(f"step {msg['step']}")
                look(pid if base is not None else None, allowed)
                if signal_after is not None and msg["step"] == signal_after:
                    if send(proc, sig) is not False:  # False: no worker
                        out["signalled"] = signal_after
                    signal_after = None
                channel.send(conn, "go")
                steps += 1
                if steps > 4 * int(setup["stop"]) + 20:
                    return  # a worker that reports without end
            elif "on_step" in msg and len(out["on_step"]) < 4 * int(setup["stop"]) + 20:
                out["on_step"].append(msg["on_step"])
            elif "returned" in msg:
                out["at_return"] = _committed(ckpt)
                look(pid if base is not None else None, allowed)
                kind, step, preempted, carry = (list(msg["returned"]) + [None] * 4)[:4]
                out["returned"] = {"kind": kind, "step": step, "preempted": preempted,
                                   "carry": carry}
                out["lines"].append(f"carry {carry or '-'}")
                out["lines"].append(f"result {kind} {step} {preempted}")
                channel.send(conn, "go")
                return
    except (channel.ChannelError, OSError):
        return  # the worker is gone or silent: its exit code and the disk say the rest


def _carry_of(run: Mapping[str, Any]) -> np.ndarray | None:
    """The carry the loop returned, or None."""
    hexed = (run.get("returned") or {}).get("carry")
    try:
        return np.frombuffer(bytes.fromhex(hexed), np.float64) if hexed else None
    except (TypeError, ValueError):
        return None


def _source_of(fn: Callable[..., Any]) -> str:
    import textwrap

    try:
        return textwrap.dedent(source_of(fn))  # under the judge: the code its proxy stands for
    except (OSError, TypeError) as e:
        raise LabCheckError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} ({e}): "
                            "define it with def in the task's cell and run that cell") from None


def draw_setup(chance: Any, *, processes: int, start: int) -> dict[str, Any]:
    """What the grader draws for one drill: the interval, the training step's coefficients,
    ``stop`` (a multiple of the interval, past the last signal), and per process metrics or
    not, a sync or an async manager (on a slow disk, so that a save not waited for is
    seen), an ``on_step`` or not, the notice's signal (SIGTERM or SIGINT: a run whose handler
    listens to SIGINT shows a SIGTERM handler of the loop's own), and whether the process
    ends the moment the loop returns. Each kind appears at least once across the processes."""
    import signal

    every = chance.randint(3, 8)
    last = start + processes * 10 + 6
    stop = every * -(-last // every)
    runs = []
    for _ in range(processes):
        runs.append({"async": chance.random() < 0.5, "on_step": chance.random() < 0.5,
                     "metrics": chance.random() < 0.5,
                     "signal": int(chance.choice([signal.SIGTERM, signal.SIGINT])),
                     "hard_exit": chance.random() < 0.5})
    for key, values in (("async", (True, False)), ("on_step", (True, False)),
                        ("metrics", (True, False)),
                        ("signal", (int(signal.SIGTERM), int(signal.SIGINT)))):
        order = chance.sample(range(processes), len(values))
        for i, v in zip(order, values, strict=True):
            runs[i][key] = v
    for r in runs:
        r["slow"] = 0.02 if r["async"] else 0.0
    return {"every": every, "stop": stop, "a": round(chance.uniform(0.3, 0.95), 3),
            "b": round(chance.uniform(0.5, 3.0), 3), "runs": runs}


def run_preemption_drill(source: str, directory: str, *, name: str = "train_until_preempted",
                         signals: int = 3, setup: Mapping[str, Any], chance: Any = None,
                         judge: Callable[[Mapping[str, Any], int], str | None] | None = None,
                         plant: tuple[int, np.ndarray] | None = None, timeout: float = 40.0,
                         **worker: Any) -> dict[str, Any]:
    """The drill itself, on the code ``source`` in the folder ``directory``: processes of the
    loop one after another (:func:`run_loop_worker`, which takes ``worker``'s arguments),
    each sent its notice right after a step drawn by ``chance``, then one that runs to
    ``setup["stop"]``; process ``i`` runs with ``setup`` and ``setup["runs"][i]``. After each
    process, this process reads every checkpoint on disk (steps, carries, metrics);
    ``judge(record, i)`` then says what went wrong in process ``i`` (None: go on), and the
    drill stops at the first failure.

    ``plant``: (step, carry): the folder starts with that checkpoint (another run's), so that
    only a loop that goes on from the carry it is given ends where :func:`lab6_carry` from
    there ends."""
    import os
    import random

    from ..manager import CheckpointManager, CheckpointManagerOptions

    chance = chance if chance is not None else random.Random(0)
    ckpt = os.path.join(directory, "ckpt")
    record: dict[str, Any] = {"setup": dict(setup), "stop": setup["stop"],
                              "every": setup["every"], "start": 0, "carry0": np.zeros(4),
                              "planted": None, "runs": [], "failed": None}
    if plant is not None:  # another run's checkpoint: the loop must go on from *it*
        start, carry0 = plant
        with CheckpointManager(ckpt, CheckpointManagerOptions(max_to_keep=None)) as m:
            m.save(start, {"w": carry0}, force=True)
        record.update(start=start, carry0=carry0, planted=start)
    resumed, plan = record["start"], []
    for _ in range(signals):
        at = resumed + 1 + chance.randrange(0, 9)
        plan.append(at)
        resumed = at + 1  # at the latest
    if plan and plan[-1] + 1 >= setup["stop"]:
        raise ValueError(f"stop={setup['stop']} leaves no room after the last signal "
                         f"(step {plan[-1]})")
    plan.append(None)
    for i, at in enumerate(plan):
        mine = {**{k: v for k, v in setup.items() if k != "runs"}, **setup["runs"][i]}
        run = run_loop_worker(source, directory, name=name, setup=mine, signal_after=at,
                              timeout=timeout, **worker)
        run.update(at=at, setup=mine, newest=None, disk={}, metrics={})
        try:
            with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
                run["newest"] = m.latest_step()
                for s in m.all_steps():
                    run["disk"][s] = np.asarray(m.restore(s)["w"])
                    run["metrics"][s] = m.metadata(s).metrics
        except Exception as e:  # what the worker left is not a checkpoint this library reads
            run["unreadable"] = f"{type(e).__name__}: {e}"[:500]
        record["runs"].append(run)
        failed = judge(record, i) if judge is not None else None
        if failed is not None:
            record["failed"] = failed
            break
    return record


def preemption_drill(fn: Callable[..., Any], directory: str, *, signals: int = 3,
                     stop: int = 40, every: int = 25, seed: int = 0, use_async: bool = False,
                     hard_exit: bool = False) -> str | None:
    """Run the student's loop ``fn`` in real processes, one after another on one checkpoint
    directory, each sent a real SIGTERM right after a step drawn at random (``signals`` of
    them, ``seed``), then one last process that runs to ``stop``.

    What must hold after every SIGTERM (chapter 6, section 4): the process exits 0 after its
    loop returned ``LoopResult(carry, step, True)``; ``step`` is the step it was computing
    when the notice came, or the next one (the manager's decision); it computed no step
    after it; the newest checkpoint is that step, holding exactly the carry after it (no
    step lost); the next process resumes from there and computes the following step. The
    last process ends at ``stop``, not preempted, with the carry of an uninterrupted run.
    ``use_async``: the manager saves asynchronously; ``hard_exit``: the process ends with
    ``os._exit`` right after the loop returns (nothing else runs). Returns None, or what
    went wrong (a message naming the process and the step).

    The grader runs the same driver itself, from its own process, with a set-up it draws, on
    a folder that starts with another run's checkpoint. Under the judge (``autograder.judge``)
    a drill of the plain set-up (a sync manager, no hard exit) *is* that drill: its drawn
    processes include a sync manager, a SIGTERM, no ``on_step`` and no metrics, and the
    test's grader check reads the same run's verdict.
    """
    import random

    from ..launch import helper_env

    graders = launch_options(DRILL_KEY).get(DRILL_KEY)
    if graders is not None and not use_async and not hard_exit \
            and getattr(fn, "__name__", "") == "train_until_preempted":
        return graders("6.3", signals=signals, seed=seed)
    source = _source_of(fn)
    run = {"async": use_async, "on_step": False, "hard_exit": hard_exit, "signal": 15}
    setup = {**KERNEL_SETUP, "stop": stop, "every": every, "runs": [run] * (signals + 1)}
    reports = Reports([fn])
    try:
        r = run_preemption_drill(source, directory, name=fn.__name__, signals=signals,
                                 setup=setup, chance=random.Random(seed), judge=kernel_message,
                                 env=reports.env(helper_env()), pass_fds=reports.pass_fds,
                                 **launch_options(*LAUNCH_KEYS))
    except BaseException:
        reports.close()
        raise
    reports.check()
    return r["failed"]


def run_loop_process(fn: Callable[..., Any], directory: str, *, stop: int, every: int,
                     signal_after: int | None = None, sig: int = 15, hard_exit: bool = False,
                     use_async: bool = False, timeout: float = 40.0
                     ) -> tuple[int, list[str], str]:
    """Run the student's training loop ``fn`` (its source, in a fresh Python process) on a
    numpy training run whose manager has a :class:`PreemptionHandler` attached; send ``sig``
    as soon as the process reports step ``signal_after``. Returns (exit code, the driver's
    lines, stderr)."""
    from ..launch import helper_env

    source = _source_of(fn)
    reports = Reports([fn])
    setup = {**KERNEL_SETUP, "signal": sig, "stop": stop, "every": every, "async": use_async,
             "on_step": False, "hard_exit": hard_exit}
    try:
        r = run_loop_worker(source, directory, name=fn.__name__, setup=setup,
                            signal_after=signal_after, timeout=timeout,
                            env=reports.env(helper_env()), pass_fds=reports.pass_fds,
                            **launch_options(*LAUNCH_KEYS))
    except BaseException:
        reports.close()
        raise
    reports.check()
    return r["rc"], r["lines"], r["err"]


def _label(run: Mapping[str, Any], i: int) -> str:
    at = run["at"]
    return f"process {i + 1} (notice after step {at})" if at else f"process {i + 1} (no notice)"


def kernel_message(record: Mapping[str, Any], i: int) -> str | None:
    """The practice drill's judge of process ``i`` (what :func:`preemption_drill` says): what
    the driver reported, and the checkpoint on disk."""
    runs, stop = record["runs"], record["stop"]
    run = runs[i]
    at, rc, out = run["at"], run["rc"], run["lines"]
    label = _label(run, i).replace("notice", "SIGTERM")
    tail = run["err"].strip()[-1200:]
    done = runs[i - 1]["newest"] if i else 0
    if done:
        if out[:2] != [f"resumed from step {done}", f"step {done + 1}"]:
            return (f"{label} should resume from step {done} (the newest checkpoint) and "
                    f"compute step {done + 1} next; it reported {out[:3]}. {tail}")
    result = [line for line in out if line.startswith("result ")]
    if rc != 0 or len(result) != 1:
        return (f"{label} exited with code {rc} and reported {out[-3:]}: the loop should "
                "return a LoopResult, and the process end normally (exit 0), after a "
                f"SIGTERM as without one"
                + (" (did something end the process before the loop returned: sys.exit "
                   "in a signal handler?)" if rc == 0 else "")
                + f". Its stderr ends with:\n{tail}")
    _, kind, step_s, preempted = (result[0].split() + ["?"] * 4)[:4]
    steps = [int(line.split()[1]) for line in out
             if line.startswith("step ") and line.split()[1].isdigit()]
    last = steps[-1] if steps else done
    if kind != "LoopResult" or not step_s.lstrip("-").isdigit():
        return f"{label}: the loop returned {result[0][7:]!r}, not a LoopResult"
    stopped = int(step_s)
    if at is None:
        carry = _carry_of(run)
        if preempted != "False" or stopped != stop:
            return (f"{label}: without a notice the loop should run to step {stop} and return "
                    f"preempted=False; it returned step {stopped}, preempted={preempted}")
        if carry is None or not np.array_equal(carry, lab6_carry(stop)):
            return (f"{label}: after {len(runs) - 1} preemptions and resumes the final carry "
                    f"is {carry}, not the uninterrupted run's {lab6_carry(stop)}")
        return _extra_saves(record, i, label, stop)
    if preempted != "True":
        return (f"{label}: the loop returned preempted={preempted} at step {stopped}; a "
                "SIGTERM arrived, so it should stop early and say so")
    if stopped not in (at, at + 1):
        return (f"{label}: the SIGTERM came right after step {at} was computed, so the job "
                f"stops at step {at} or {at + 1} (the first step boundary the manager "
                f"names); the loop returned step {stopped}")
    if last != stopped:
        return (f"{label}: the loop returned step {stopped} but computed step {last}: a "
                "step computed after the one the job stopped at is lost")
    newest = run["newest"]
    if newest != stopped:
        lost = stopped - (newest or 0)
        return (f"{label}: the loop stopped after step {stopped}, but the newest checkpoint "
                f"is {newest}: the restart will compute {lost} step(s) again, and a "
                "preemption notice is there so that none is lost. Which step did the "
                "manager decide to save, and did your loop give it the chance?")
    w = run["disk"].get(newest)
    if w is None or not np.array_equal(w, lab6_carry(stopped)):
        return (f"{label}: the checkpoint of step {stopped} holds {w}, not the "
                f"carry after step {stopped} ({lab6_carry(stopped)}): was it saved in the "
                "middle of a step (from a signal handler), under the wrong step number?")
    return _extra_saves(record, i, label, stopped)


def _extra_saves(record: Mapping[str, Any], i: int, label: str, last: int) -> str | None:
    """Steps process ``i`` saved that neither the manager's interval nor the notice named
    (a forced save, or one from a signal handler), or None."""
    runs, every = record["runs"], record["every"]
    run = runs[i]
    had = set(runs[i - 1]["disk"]) if i else ({record["start"]} if record["planted"] else set())
    before = (runs[i - 1]["newest"] if i else record["start"]) or 0
    new = sorted(set(run["disk"]) - had)
    want = sorted({s for s in range(before + 1, last + 1) if s % every == 0}
                  | ({last} if run["at"] is not None else set())
                  | ({before + 1} if not had and last > before else set()))  # a fresh folder's first step
    extra = [s for s in new if s not in want]
    if extra:
        return (f"{label}: step(s) {extra} were saved, but the manager's interval "
                f"(save_interval_steps={every}) and the notice name only {want}: the manager's "
                "policy decides what is saved (save(step, ...) without force; never from a "
                "signal handler)")
    return None


def effects_message(record: Mapping[str, Any], i: int) -> str | None:
    """The grader's judge of process ``i``: only what the drill observed itself — the
    handlers the worker caught signals with (read from ``/proc``), whether it sent the notice
    it planned, the exit code, the checkpoints on disk read by this process (which steps,
    their carries from the drawn training step going on from the planted checkpoint, their
    metrics), the steps on disk when the loop returned, and the ``on_step`` calls the driver
    reported as they happened."""
    runs, stop, every = record["runs"], record["stop"], record["every"]
    start, carry0 = record["start"], record["carry0"]
    run = runs[i]
    mine = run.get("setup") or {}
    a, b = float(mine.get("a", 0.5)), float(mine.get("b", 1.0))
    at, rc, newest = run["at"], run["rc"], run["newest"]
    label = _label(run, i)
    tail = run["err"].strip()[-1200:]
    before = runs[i - 1]["newest"] if i else start
    had = set(runs[i - 1]["disk"]) if i else ({start} if record["planted"] else set())
    if run.get("unreadable"):
        return f"{label}: the checkpoint folder it left cannot be read: {run['unreadable']}"
    if run.get("handlers"):
        return (f"{label}: while the loop ran, the process caught {', '.join(run['handlers'])} "
                "with a handler of its own (read from outside the process): the loop never "
                "installs a signal handler; the PreemptionHandler attached to the manager "
                "is the one that listens")
    if at is not None and run["signalled"] is None:
        return (f"{label}: the drill was to send the notice right after step {at}, but the "
                f"process ended first (exit {rc}), with the newest checkpoint at step {newest} "
                f"(it went on from step {before}): each process computes the steps after the "
                "newest checkpoint, one step_fn call each, until a notice or stop. Its stderr "
                f"ends with:\n{tail}")
    if rc != 0:
        why = (f" (killed: it ran past the drill's {run.get('timeout', 40):.0f} s, or ended "
               "itself so)" if rc == -9 else " (did something end it first: sys.exit in a "
               "signal handler?)")
        return (f"{label} exited with code {rc}: the loop should return, and the process end "
                f"normally (exit 0), after a notice as without one{why}. Its stderr ends "
                f"with:\n{tail}")
    if run.get("returned") is None:
        return f"{label}: the loop never returned to the driver. Its stderr ends with:\n{tail}"
    if at is not None and newest not in (at, at + 1):
        return (f"{label}: the notice came right after step {at} was computed, so the job "
                f"saves and stops at step {at} or {at + 1} (the step the manager names); "
                f"after it the newest checkpoint is step {newest}"
                + (": the restart will compute again what this process computed, and a "
                   "preemption notice is there so that nothing is lost. Did your loop give the "
                   "manager the step it named?" if newest is None or newest < at else ""))
    if at is None and newest != stop:
        return (f"{label}: without a notice the run goes to step {stop}, and with "
                f"save_interval_steps={every} the manager saves step {stop}: the newest "
                f"checkpoint is step {newest}. The manager sees every step (save(step, ...) "
                "each time; its interval decides which are written)")
    last = stop if at is None else newest
    new = sorted(set(run["disk"]) - had)
    if msg := _extra_saves(record, i, label, last):
        return msg
    late = [s for s in new if s not in (run.get("at_return") or [])]
    if late:
        how = "an async manager" if mine.get("async") else "the manager"
        return (f"{label}: when the loop returned, step(s) {late} it had started saving were "
                f"not on disk yet ({how}): every save the loop started is on disk when it "
                "returns, since the process may be killed right then")
    for s in new:
        want_w = lab6_carry(s, start, carry0, a=a, b=b)
        w = run["disk"][s]
        if not np.array_equal(w, want_w):
            story = (f"going on from the checkpoint of step {start} that was on disk (another "
                     "run's: the grader's drill starts so), " if record["planted"] else "")
            return (f"{label}: {story}the checkpoint of step {s} holds {w}, not the carry after "
                    f"step {s} ({want_w}). Each step goes on from the carry the loop was given "
                    "(the restored one) through what step_fn returns, and a step is saved once "
                    "it is computed, under its own number")
        got_m = run["metrics"].get(s)
        want_m = {"loss": float(want_w.sum())} if mine.get("metrics") else None
        if (got_m or None) != want_m:
            return (f"{label}: the checkpoint of step {s} was saved with metrics {got_m!r}; "
                    f"step_fn returned {want_m!r} for it: the step's metrics are saved with it "
                    "(save(..., metrics=metrics))")
    return _on_step_message(run, label, before or 0, last, start, carry0, a, b)


def _on_step_message(run: Mapping[str, Any], label: str, before: int, last: int, start: int,
                     carry0: Any, a: float, b: float) -> str | None:
    """The ``on_step`` calls the driver reported, against the steps the process computed."""
    mine = run.get("setup") or {}
    calls = run.get("on_step") or []
    if not mine.get("on_step"):
        return None
    want = list(range(before + 1, last + 1))
    got = [c[0] if isinstance(c, list) and c else c for c in calls]
    if got != want:
        return (f"{label}: on_step was given, and should have been called after each step it "
                f"computed ({want[:3]}...{want[-1:]}), in order; it was called for {got[:8]}")
    for step, hexed, metrics in calls:
        w = lab6_carry(step, start, carry0, a=a, b=b)
        try:
            carry = np.frombuffer(bytes.fromhex(hexed), np.float64) if hexed else None
        except (TypeError, ValueError):
            carry = None
        want_m = {"loss": float(w.sum())} if mine.get("metrics") else None
        if carry is None or not np.array_equal(carry, w) or (metrics or None) != want_m:
            return (f"{label}: on_step({step}, ...) was called with carry {carry} and metrics "
                    f"{metrics!r}; it is called with the step, the new carry and its metrics "
                    f"({w}, {want_m!r})")
    return None
