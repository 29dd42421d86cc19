"""Lab 6 (production): simulated failures, the preemption loop in a real process, drills."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
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
_go = sys.stdin.readline if sys.argv[6] == "1" else None  # lockstep: wait for the drill
_w = _watch.worker()
_mine = _w.namespace({{_k: _v for _k, _v in globals().items()
                      if _k not in ("_send", "_permit", "_go")}})
with open({source_path!r}) as _f:
    exec(compile(_f.read(), "<your task cell>", "exec"), _mine)
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
    if _go is not None:  # the drill signals now, if this is its step, then lets the step end
        _go()
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
driver's memory could sign too; the class closed is the printed or written line. The
grader's own drill (autograder/drills.py) passes no key: there the lines only say when to
send the signal, and the verdict comes from the disk."""


def lab6_carry(step: int, start: int = 0, carry: Any = None) -> np.ndarray:
    """The carry of :func:`run_loop_process`'s training after ``step`` steps (going on from
    ``carry`` after step ``start``; default: a run from its beginning)."""
    w = np.zeros(4) if carry is None else np.array(carry, np.float64)
    for s in range(start + 1, step + 1):
        w = 0.5 * w + s
    return w


def run_loop_worker(source: str, directory: str, *, name: str = "train_until_preempted",
                    stop: int, every: int, signal_after: int | None = None, sig: int = 15,
                    hard_exit: bool = False, use_async: bool = False, timeout: float = 40.0,
                    env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = (),
                    key: bytes | None = None, python: str = sys.executable,
                    wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
                    after_run: Callable[[], None] | None = None, lockstep: bool = False,
                    send_signal: Callable[[Any, int], bool | None] | None = None
                    ) -> dict[str, Any]:
    """One process of the loop: the code ``source`` (defines ``name``) runs in the driver, a
    fresh Python process training on the checkpoint folder ``directory``/ckpt; ``sig`` is
    sent once it reports step ``signal_after``. No state of the calling process goes in: the
    grader runs it from its own process (autograder/drills.py), with ``wrap`` putting the
    command and its environment in the submission's sandbox, ``after_run`` ending what is left
    of the worker once it exited, and ``send_signal(proc, sig)`` reaching the worker inside
    the sandbox (False: it found none). ``key``: the driver signs its lines with it (None: the lines are not signed,
    and only steer the signal). ``lockstep``: the worker waits for this process after each
    step, so that the signal lands inside the step it follows, however slow this process is.

    Returns ``rc``, ``lines`` (the driver's), ``err`` (the tail of stderr), ``signalled``
    (the step after which the signal was sent, or None) and ``forged`` (lines of the driver's
    tag that were not signed by it)."""
    import os
    import signal as _signal
    import subprocess
    import threading

    from ..launch import helper_env, read_signed  # the loop runs on the CPU: see helper_env

    code = os.path.join(directory, f"{name}.py")
    with open(code, "w") as f:
        f.write(source)
    path = os.path.join(directory, "driver.py")
    with open(path, "w") as f:
        f.write(_LOOP_DRIVER.format(source_path=code, name=name, key_env=_KEY_ENV, tag=_TAG))
    ckpt = os.path.join(directory, "ckpt")
    cmd = [python, path, ckpt, str(stop), str(every), "1" if hard_exit else "0",
           "1" if use_async else "0", "1" if lockstep else "0"]
    env = {**(env if env is not None else helper_env()), "JAX_PLATFORMS": "cpu"}
    fds = tuple(pass_fds)
    r = w = -1
    if key is not None:
        r, w = os.pipe()
        os.write(w, key)
        os.close(w)
        env[_KEY_ENV] = str(r)
        fds = (*fds, r)
    cmd = wrap(cmd, env) if wrap is not None else cmd
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.PIPE if lockstep else subprocess.DEVNULL,
                                env=env, pass_fds=fds)
    finally:
        if r >= 0:
            os.close(r)
    out: dict[str, Any] = {"rc": None, "lines": [], "err": "", "signalled": None, "forged": 0,
                           "timeout": timeout}
    tail: list[str] = []

    def drain() -> None:  # stderr, read as it comes (a full pipe would stop the worker)
        assert proc.stderr is not None
        for chunk in iter(lambda: proc.stderr.read(4096), ""):
            tail.append(chunk)
            if len(tail) > 8:
                del tail[:-4]

    def go_on() -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    send = send_signal or (lambda p, s: p.send_signal(s))
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in iter(lambda: proc.stdout.readline(1 << 16), ""):  # a line without end: cut
            said, bad = read_signed([raw], key if key is not None else b"", _TAG)
            out["forged"] += bad
            value = said[0] if said else None
            if not isinstance(value, dict):
                continue  # the student's own output: never taken for the driver's
            line = str(value.get("line", "")).strip()[:200]
            out["lines"].append(line)
            if signal_after is not None and line == f"step {signal_after}":
                if send(proc, int(_signal.Signals(sig))) is not False:  # False: no worker
                    out["signalled"] = signal_after
                signal_after = None
            if lockstep and line.startswith("step "):
                go_on()
            if len(out["lines"]) > 4 * stop + 20:
                break  # a worker that reports without end
        if proc.poll() is None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        out["rc"] = proc.wait()
        reader.join(timeout=5)
        if after_run is not None:
            after_run()
    out["err"] = "".join(tail)[-3000:]
    return out


def run_loop_process(fn: Callable[..., Any], directory: str, *, stop: int, every: int,
                     signal_after: int | None = None, sig: int = 15, hard_exit: bool = False,
                     use_async: bool = False, timeout: float = 40.0
                     ) -> tuple[int, list[str], str]:
    """Run the student's training loop ``fn`` (its source, in a fresh Python process) on a
    numpy training run whose manager has a :class:`PreemptionHandler` attached; send ``sig``
    as soon as the process reports step ``signal_after``. Returns (exit code, stdout lines,
    stderr)."""
    import secrets

    from ..launch import helper_env

    source = _source_of(fn)
    reports = Reports([fn])
    try:
        r = run_loop_worker(source, directory, name=fn.__name__, stop=stop, every=every,
                            signal_after=signal_after, sig=sig, hard_exit=hard_exit,
                            use_async=use_async, timeout=timeout,
                            env=reports.env(helper_env()), pass_fds=reports.pass_fds,
                            key=secrets.token_bytes(32))
    except BaseException:
        reports.close()
        raise
    reports.check()
    return r["rc"], r["lines"], _with_forged(r)


def _source_of(fn: Callable[..., Any]) -> str:
    import textwrap

    try:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError) as e:
        raise LabCheckError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} ({e}): "
                            "define it with def in the task's cell and run that cell") from None


def _with_forged(r: Mapping[str, Any]) -> str:
    err = r["err"]
    if r["forged"]:
        err += (f"\n[the drill ignored {r['forged']} {_TAG} line(s) not signed by its driver: "
                "only the driver reports the loop's steps and result]")
    return err[-3000:]


def _carry_of(lines: list[str]) -> np.ndarray | None:
    """The carry the driver printed (``carry <hex of float64 bytes>``), or None."""
    for line in lines:
        if line.startswith("carry ") and line != "carry -":
            try:
                return np.frombuffer(bytes.fromhex(line.split()[1]), np.float64)
            except ValueError:
                return None
    return None


def run_preemption_drill(source: str, directory: str, *, name: str = "train_until_preempted",
                         signals: int = 3, stop: int = 40, every: int = 25,
                         chance: Any = None, use_async: bool = False, hard_exit: bool = False,
                         judge: Callable[[Mapping[str, Any], int], str | None] | None = None,
                         plant_seed: int | None = None, timeout: float = 40.0,
                         **worker: Any) -> dict[str, Any]:
    """The drill itself, on the code ``source`` in the folder ``directory``: processes of the
    loop one after another (:func:`run_loop_worker`, which takes ``worker``'s arguments:
    ``wrap``, ``after_run``, ``env``, ``key``, ``lockstep``, ``send_signal`` ...), each sent a
    SIGTERM right after a step drawn by ``chance`` (a :class:`random.Random`), then one that
    runs to ``stop``. After each process, this process reads every checkpoint on disk;
    ``judge(record, i)`` then says what went wrong in process ``i`` (None: go on), and the
    drill stops at the first failure.

    ``plant_seed``: the folder starts with a checkpoint of step 3..9 holding a carry drawn
    from that seed (another run's), so that only a loop that goes on from the carry it is
    given ends where :func:`lab6_carry` from that start ends.

    Returns ``runs``, one dict per process (:func:`run_loop_worker`'s, with ``at`` the step
    planned for the signal or None, ``newest`` the newest step on disk after it and ``disk``
    step -> saved ``w`` of every checkpoint, or ``unreadable``), ``start`` and ``carry0`` (what
    the run goes on from: 0 and zeros, or the planted checkpoint), ``planted``, ``failed`` (the
    judge's message, or None)."""
    import os
    import random

    from ..manager import CheckpointManager, CheckpointManagerOptions

    chance = chance if chance is not None else random.Random(0)
    ckpt = os.path.join(directory, "ckpt")
    record: dict[str, Any] = {"stop": stop, "every": every, "start": 0,
                              "carry0": np.zeros(4), "planted": None, "runs": [],
                              "failed": None}
    if plant_seed is not None:  # another run's checkpoint: the loop must go on from *it*
        rng = np.random.default_rng(plant_seed)
        start, carry0 = int(rng.integers(3, 10)), rng.normal(0.0, 100.0, 4)
        opts = CheckpointManagerOptions(save_interval_steps=every, max_to_keep=None)
        with CheckpointManager(ckpt, opts) as m:
            m.save(start, {"w": carry0}, force=True)
        record.update(start=start, carry0=carry0, planted=start)
    resumed, plan = record["start"], []
    for _ in range(signals):
        at = resumed + 1 + chance.randrange(0, 9)
        plan.append(at)
        resumed = at + 1  # at the latest
    if plan and plan[-1] + 1 >= stop:
        raise ValueError(f"stop={stop} leaves no room after the last signal (step {plan[-1]})")
    plan.append(None)
    for i, at in enumerate(plan):
        run = run_loop_worker(source, directory, name=name, stop=stop, every=every,
                              signal_after=at, hard_exit=hard_exit, use_async=use_async,
                              timeout=timeout, **worker)
        run["at"] = at
        run["newest"], run["disk"] = None, {}
        try:
            with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
                run["newest"] = m.latest_step()
                for s in m.all_steps():
                    run["disk"][s] = np.asarray(m.restore(s)["w"])
        except Exception as e:  # what the worker left is not a checkpoint this library reads
            run["unreadable"] = f"{type(e).__name__}: {e}"[:500]
        record["runs"].append(run)
        failed = judge(record, i) if judge is not None else None
        if failed is not None:
            record["failed"] = failed
            break
    return record


def _label(run: Mapping[str, Any], i: int) -> str:
    at = run["at"]
    return f"process {i + 1} (SIGTERM after step {at})" if at else f"process {i + 1} (no signal)"


def kernel_message(record: Mapping[str, Any], i: int) -> str | None:
    """The in-kernel drill's judge of process ``i`` (what :func:`preemption_drill` says): the
    driver's signed lines, and the checkpoint on disk."""
    runs, stop = record["runs"], record["stop"]
    run = runs[i]
    at, rc, out = run["at"], run["rc"], run["lines"]
    label = _label(run, i)
    tail = _with_forged(run).strip()[-1200:]
    done = runs[i - 1]["newest"] if i else 0
    if done:
        if out[:2] != [f"resumed from step {done}", f"step {done + 1}"]:
            return (f"{label} should resume from step {done} (the newest checkpoint) and "
                    f"compute step {done + 1} next; it printed {out[:3]}. {tail}")
    result = [line for line in out if line.startswith("result ")]
    if rc != 0 or len(result) != 1:
        return (f"{label} exited with code {rc} and printed {out[-3:]}: the loop should "
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
        carry = _carry_of(out)
        if preempted != "False" or stopped != stop:
            return (f"{label}: without a notice the loop should run to step {stop} and return "
                    f"preempted=False; it returned step {stopped}, preempted={preempted}")
        if carry is None or not np.array_equal(carry, lab6_carry(stop)):
            return (f"{label}: after {len(runs) - 1} preemptions and resumes the final carry "
                    f"is {carry}, not the uninterrupted run's {lab6_carry(stop)}")
        return None
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
    return None


def effects_message(record: Mapping[str, Any], i: int) -> str | None:
    """The grader's judge of process ``i``: only what the drill observed itself — whether it
    sent the SIGTERM it planned (after the step it drew), the worker's exit code, and the
    checkpoints on disk read by this process, compared with :func:`lab6_carry` going on from
    the run's start (the planted checkpoint). Nothing the worker printed passes it."""
    runs, stop, every = record["runs"], record["stop"], record["every"]
    start, carry0 = record["start"], record["carry0"]
    run = runs[i]
    at, rc, newest = run["at"], run["rc"], run["newest"]
    label = _label(run, i)
    tail = run["err"].strip()[-1200:]
    before = runs[i - 1]["newest"] if i else start
    if run.get("unreadable"):
        return (f"{label}: the checkpoint folder it left cannot be read: "
                f"{run['unreadable']}")
    if at is not None and run["signalled"] is None:
        return (f"{label}: the drill was to send SIGTERM right after step {at}, but the "
                f"process ended first (exit {rc}), with the newest checkpoint at step {newest} "
                f"(it went on from step {before}): each process computes the steps after the "
                "newest checkpoint, one step_fn call each, until a notice or stop. Its stderr "
                f"ends with:\n{tail}")
    if rc != 0:
        why = (f" (killed: it ran past the drill's {run.get('timeout', 40):.0f} s, or ended "
               "itself so)" if rc == -9 else " (did something end it first: sys.exit in a "
               "signal handler?)")
        return (f"{label} exited with code {rc}: the loop should return, and the process end "
                f"normally (exit 0), after a SIGTERM as without one{why}. Its stderr ends "
                f"with:\n{tail}")
    if at is not None and newest not in (at, at + 1):
        return (f"{label}: the SIGTERM came right after step {at} was computed, so the job "
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
    for s, w in sorted(run["disk"].items()):
        if s < start:
            return (f"{label}: a checkpoint of step {s} appeared, before step {start} that the "
                    "run went on from")
        want = lab6_carry(s, start, carry0)
        if not np.array_equal(w, want):
            story = (f"going on from the checkpoint of step {start} that was on disk (another "
                     "run's: the grader's drill starts so), " if record["planted"] else "")
            return (f"{label}: {story}the checkpoint of step {s} holds {w}, not the carry after "
                    f"step {s} ({want}). Each step goes on from the carry the loop was given "
                    "(the restored one), and a step is saved once it is computed, under its "
                    "own number")
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

    The drill itself is :func:`run_preemption_drill` (the grader runs it too, from its own
    process, on a folder that starts with another run's checkpoint).
    """
    import random
    import secrets

    from ..launch import helper_env

    source = _source_of(fn)
    reports = Reports([fn])
    try:
        r = run_preemption_drill(source, directory, name=fn.__name__, signals=signals,
                                 stop=stop, every=every, chance=random.Random(seed),
                                 use_async=use_async, hard_exit=hard_exit,
                                 judge=kernel_message, env=reports.env(helper_env()),
                                 pass_fds=reports.pass_fds, key=secrets.token_bytes(32))
    except BaseException:
        reports.close()
        raise
    reports.check()
    return r["failed"]


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
