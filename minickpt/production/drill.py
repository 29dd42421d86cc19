"""Recovery drills: kill a real training process with SIGKILL, restart it, measure recovery.

A drill answers, with numbers, what a crash costs: how long from the kill until the restarted
job computes again (time to recover), how many steps it had to compute twice (steps lost),
and whether the state it ends with is bit for bit the state of a run that was never
interrupted — which needs the parameters, the optimizer state, the step, the RNG key *and* the
data order to be restored exactly. Kills land at seeded random moments, during steps and
during saves.

    python -m minickpt.production.drill --kills 5 --steps 200 --every 10

The worker is any command that prints the protocol of :func:`minickpt.demo.worker`, one line
per event: ``step N``, ``saving step N`` (optional: lets the drill aim at saves), ``saved
step N`` (optional: a save without it ends when a later step is reported, see
:func:`save_progress`), ``resumed from step N``, ``final <fingerprint>``; ``{dir}`` in the command is replaced by the
checkpoint directory. Bit-identical is the expectation on CPU; on GPUs some reductions are
not deterministic, so compare steps and losses there instead.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..commit import TMP_MARK
from ..fs import DEFAULT_FS
from ..launch import helper_env

_LINE = re.compile(r"^(step|saving step|saved step|resumed from step|preempted at step) (\d+)$")


class DrillError(RuntimeError):
    """The drill could not run as planned (a worker failed, or time ran out)."""


# ---------------------------------------------------------------------------------------
# a worker process, read line by line in the background
# ---------------------------------------------------------------------------------------
class WorkerProcess:
    """A training subprocess whose stdout lines are read, and time-stamped, by a thread.

    ``events`` holds ``(monotonic time, kind, value)``: kind is one of the protocol's
    ``step``, ``saving step``, ``saved step``, ``resumed from step``, ``preempted at step``
    (value: the step) or ``final`` (value: the fingerprint), or ``line`` for anything else.
    """

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str] | None = None,
                 stderr_path: str | None = None, platforms: str = "cpu"):
        self.cmd = list(cmd)
        if stderr_path is None:
            fd, stderr_path = tempfile.mkstemp(prefix="minickpt-drill-", suffix=".err")
            os.close(fd)
        self._stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")  # closed in close()
        self.started = time.monotonic()
        # the worker runs on the CPU (helper_env): on one accelerator the parent may hold it
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                     env=helper_env(env, platforms=platforms))
        self.events: list[tuple[float, str, Any]] = []
        self._q: queue.Queue[tuple[float, str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            t = time.monotonic()
            line = raw.strip()
            m = _LINE.match(line)
            if m:
                ev = (t, m.group(1), int(m.group(2)))
            elif line.startswith("final "):
                ev = (t, "final", line.split()[1])
            else:
                ev = (t, "line", line)
            self._q.put(ev)
        self._q.put(None)

    def next_event(self, deadline: float) -> tuple[float, str, Any] | None:
        """The next event, None at the end of the output; DrillError past ``deadline``."""
        left = deadline - time.monotonic()
        try:
            ev = self._q.get(timeout=max(left, 0.0))
        except queue.Empty:
            raise DrillError(f"the worker (pid {self.pid}) printed nothing new before the "
                             f"deadline; its stderr ends with:\n{self.stderr_tail()}") from None
        if ev is None:
            self._q.put(None)  # stay at the end for later callers
            return None
        self.events.append(ev)
        return ev

    def wait_for(self, kinds: str | tuple[str, ...], deadline: float,
                 at_least: int | None = None) -> tuple[float, str, Any] | None:
        """The first event of one of ``kinds`` (with a step >= ``at_least``), or None if the
        worker's output ended first."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        while True:
            ev = self.next_event(deadline)
            if ev is None:
                return None
            if ev[1] in kinds and (at_least is None or ev[2] >= at_least):
                return ev

    def kill(self) -> float:
        """SIGKILL, like a power cut or the OOM killer: no handler runs. Returns its time."""
        t = time.monotonic()
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return t

    def finish(self, deadline: float) -> int:
        """Read the output to its end and reap the process; its exit code."""
        while self.next_event(deadline) is not None:
            pass
        try:
            return self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise DrillError(f"the worker (pid {self.pid}) did not exit before the "
                             "deadline") from None

    def last(self, kind: str) -> Any:
        vals = [v for _, k, v in self.events if k == kind]
        return vals[-1] if vals else None

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            self._stderr.flush()
            with open(self._stderr_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        try:
            os.unlink(self._stderr_path)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------
# the plan and the report
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KillPlan:
    """One planned kill: ``kind`` "step" (``delay`` seconds after the worker reports step
    ``at`` or a later one) or "save" (``delay`` seconds after the first save at or after step
    ``at`` begins)."""

    kind: str
    at: int
    delay: float = 0.0


def plan_kills(n: int, *, steps: int, seed: int, save_fraction: float = 0.5,
               step_time_s: float = 0.0, save_time_s: float = 0.0) -> list[KillPlan]:
    """``n`` kills drawn from ``seed``, spread over the run: kill i aims at a random step of
    the i-th of n equal stretches of steps 1..steps-1, so the run keeps moving however
    much each kill sets it back. Each aims at a save with probability ``save_fraction`` (at
    least one of each kind when n >= 2), 20-80 % of ``save_time_s`` into the save; the
    others a random part of a step after the step is reported."""
    rng = random.Random(seed)
    kinds = ["save" if rng.random() < save_fraction else "step" for _ in range(n)]
    if n >= 2 and 0 < save_fraction < 1:
        if "save" not in kinds:
            kinds[rng.randrange(n)] = "save"
        elif "step" not in kinds:
            kinds[rng.randrange(n)] = "step"
    out = []
    width = max(steps - 1, 1) / max(n, 1)
    for i, kind in enumerate(kinds):
        lo = 1 + int(i * width)
        hi = max(lo, min(steps - 1, int((i + 1) * width)))
        # a save kill aims at the middle of the expected write, past the short snapshot
        delay = rng.random() * step_time_s if kind == "step" else \
            save_time_s * (0.2 + 0.6 * rng.random())
        out.append(KillPlan(kind, rng.randint(lo, hi), delay))
    return out


@dataclass
class KillRecord:
    """What one kill cost. Times are seconds from the SIGKILL."""

    index: int
    kind: str  # what was aimed at: "step" or "save"
    killed_after_step: int | None  # the last step the killed process had computed
    in_save: bool  # killed between "saving step N" and its end (see save_progress)
    temporary_left: bool  # ... and the write had begun: a temporary directory was left
    last_saved: int | None  # the newest checkpoint the killed process knew to be committed
    resumed_from: int | None  # the step the restarted process restored (0: from scratch)
    steps_lost: int | None  # computed before the kill, to be computed again
    restore_s: float | None  # kill -> "resumed from" (start, imports, restore)
    recover_s: float | None  # kill -> the first step computed after the restart


@dataclass
class DrillReport:
    """A drill's result: every kill, and whether the final state is the uninterrupted one."""

    kills: list[KillRecord]
    total_steps: int
    save_interval_steps: int | None
    seed: int
    identical: bool
    final_fingerprint: str | None
    reference_fingerprint: str | None
    completed: bool
    wall_s: float
    reference_wall_s: float | None
    command: list[str]
    compile_cache: str | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def kills_in_save(self) -> int:
        return sum(k.in_save for k in self.kills)

    def _vals(self, name: str) -> list[float]:
        return [getattr(k, name) for k in self.kills if getattr(k, name) is not None]

    def summary(self) -> dict[str, Any]:
        rec, lost = self._vals("recover_s"), self._vals("steps_lost")
        return {"kills": len(self.kills), "kills_in_save": self.kills_in_save,
                "recover_s_mean": sum(rec) / len(rec) if rec else None,
                "recover_s_max": max(rec) if rec else None,
                "steps_lost_mean": sum(lost) / len(lost) if lost else None,
                "steps_lost_max": max(lost) if lost else None,
                "identical": self.identical, "completed": self.completed}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    def table(self) -> str:
        s = self.summary()
        head = (f"recovery drill: {s['kills']} kill(s) with SIGKILL ({s['kills_in_save']} during "
                f"a save), seed {self.seed}, {self.total_steps} steps"
                + (f", a checkpoint every {self.save_interval_steps}"
                   if self.save_interval_steps else ""))
        hdr = ["#", "aimed at", "killed after step", "in save", "tmp left", "resumed from",
               "steps lost", "restore (s)", "recover (s)"]

        def f(x: Any) -> str:
            if x is None:
                return "-"
            if isinstance(x, bool):
                return "yes" if x else "no"
            return f"{x:.2f}" if isinstance(x, float) else str(x)

        rows = [[str(k.index), k.kind, f(k.killed_after_step), f(k.in_save),
                 f(k.temporary_left), f(k.resumed_from), f(k.steps_lost), f(k.restore_s),
                 f(k.recover_s)]
                for k in self.kills]
        widths = [max(len(r[i]) for r in [hdr, *rows]) for i in range(len(hdr))]
        lines = [head, "  ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        if self.kills:
            lines.append(f"steps lost: mean {f(s['steps_lost_mean'])}, max "
                         f"{f(s['steps_lost_max'])}; time to recover: mean "
                         f"{f(s['recover_s_mean'])} s, max {f(s['recover_s_max'])} s")
        if self.save_interval_steps:
            lines.append(f"(a kill after a uniformly random step loses "
                         f"{(self.save_interval_steps - 1) / 2:.1f} steps on average at this "
                         "interval; one during a save loses a whole interval)")
        verdict = "YES" if self.identical else "NO"
        lines.append(f"final state bit-identical to the uninterrupted run: {verdict} "
                     f"({self.final_fingerprint} vs {self.reference_fingerprint})")
        lines.append(f"drill wall time {self.wall_s:.1f} s"
                     + (f" (uninterrupted run: {self.reference_wall_s:.1f} s)"
                        if self.reference_wall_s is not None else "")
                     + (f"; compilation cache {self.compile_cache}" if self.compile_cache
                        else "; no compilation cache"))
        if self.metrics:
            r = self.metrics.get("restores", {})
            if r.get("time_s"):
                lines.append(f"restores inside the worker: {r['count']}, median "
                             f"{r['time_s']['median'] * 1000:.1f} ms")
        lines += [f"note: {n}" for n in self.notes]
        if self.error:
            lines.append(f"ERROR: {self.error}")
        return "\n".join(lines)


def demo_command(*, steps: int, every: int, sleep: float, slow_fsync: float,
                 monitor: bool = True, forget_rng: bool = False) -> list[str]:
    """The default worker: minickpt.demo's Flax training run (``{dir}`` is filled in)."""
    cmd = [sys.executable, "-m", "minickpt.demo", "--worker", "--dir", "{dir}",
           "--steps", str(steps), "--every", str(every), "--sleep", str(sleep),
           "--slow-fsync", str(slow_fsync)]
    if monitor:
        cmd.append("--monitor")
    if forget_rng:
        cmd.append("--forget-rng")
    return cmd


def compile_cache_env(directory: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which JAX keeps every compiled program in ``directory``.

    Part of every restart's time to recover is recompiling the training step (and, with
    eager code, many small programs); JAX's persistent compilation cache lets a restarted
    process load them instead. The thresholds are lowered to zero so small programs count.
    """
    out = dict(os.environ if env is None else env)
    out.update(JAX_COMPILATION_CACHE_DIR=os.fspath(directory),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return out


def save_progress(events: Sequence[tuple[float, str, Any]], *,
                  announces_saves: bool) -> tuple[bool, int | None]:
    """From a killed worker's events: was a save in progress, and which step was the newest
    one it knew to be committed?

    A save of step N begins at ``saving step N``. It is known to have ended at ``saved step
    N``; a worker that never prints ``saved step`` lines (``announces_saves`` false: no
    process of the drill, the uninterrupted one included, printed one) ends it by reporting a
    later step, since its save returned before that step began (right for a synchronous
    save; a worker that saves asynchronously must print ``saved step N``). Without that rule
    every kill after the first save would count as a kill in a save. ``resumed from step N``
    says that N was committed.
    """
    pending: int | None = None
    known: int | None = None
    for _, kind, value in events:
        if kind == "saving step":
            pending = value
        elif kind == "saved step":
            known = value
            if pending == value:
                pending = None
        elif kind == "resumed from step":
            known = value if known is None else max(known, value)
        elif kind == "step" and not announces_saves and pending is not None \
                and value > pending:
            known, pending = pending, None
    return pending is not None, known


def _temporaries(directory: str) -> list[str]:
    """The temporaries of writes the kill cut (a save's ``.minickpt-tmp-``). Not a delete's
    leftover (``.minickpt-del-``): a kill inside retention, after the save's commit, leaves
    one, and that save's step is committed (counting it, a drill under load reported a cut
    write whose step the restart then resumed from)."""
    try:
        return sorted(n for n in DEFAULT_FS.listdir(directory) if TMP_MARK in n)
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------
# the drill
# ---------------------------------------------------------------------------------------
def run_drill(directory: str | None = None, *, kills: int = 3, steps: int = 60, every: int = 5,
              seed: int = 0, sleep: float = 0.02, slow_fsync: float = 0.02,
              save_fraction: float = 0.5, command: Sequence[str] | None = None,
              reference: str | None = None, timeout_s: float = 300.0,
              env: dict[str, str] | None = None, compile_cache: str | None = None
              ) -> DrillReport:
    """Run a training process, SIGKILL it ``kills`` times, restart it each time, and report
    time to recover, steps lost, and whether it ends bit-identical (each restart read by
    :func:`measure_recovery`, lab 6's task 6.4).

    ``command`` defaults to :func:`demo_command` (``steps``, ``every``, ``sleep`` seconds per
    step, ``slow_fsync`` seconds per fsync so saves are long enough to be hit). Without
    ``reference`` the same command first runs uninterrupted in a scratch directory to get
    the fingerprint to compare against. ``compile_cache`` names a directory for JAX's
    persistent compilation cache (see :func:`compile_cache_env`). Everything is bounded by
    ``timeout_s``.
    """
    if compile_cache is not None:
        env = compile_cache_env(compile_cache, env)
    cmd = list(command) if command is not None else demo_command(
        steps=steps, every=every, sleep=sleep, slow_fsync=slow_fsync)
    if not any("{dir}" in c for c in cmd):
        raise ValueError("the worker command must contain '{dir}', where the drill puts the "
                         "checkpoint directory (the reference run gets a directory of its own)")
    deadline = time.monotonic() + timeout_s
    own_dir = directory is None
    ckpt = directory or tempfile.mkdtemp(prefix="minickpt-drill-")
    fill = lambda d: [c.replace("{dir}", d) for c in cmd]  # noqa: E731
    report = DrillReport([], steps, every if command is None else None, seed, False, None,
                         reference, False, 0.0, None, fill(ckpt), compile_cache)
    procs: list[WorkerProcess] = []

    def start(d: str) -> WorkerProcess:
        p = WorkerProcess(fill(d), env=env)
        procs.append(p)
        return p

    try:
        if reference is None:  # 1. the uninterrupted run
            ref_dir = tempfile.mkdtemp(prefix="minickpt-drill-ref-")
            try:
                t0 = time.monotonic()
                p = start(ref_dir)
                rc = p.finish(deadline)
                report.reference_wall_s = time.monotonic() - t0
                report.reference_fingerprint = p.last("final")
                if rc != 0 or report.reference_fingerprint is None:
                    raise DrillError(f"the uninterrupted run failed (exit {rc}):\n"
                                     f"{p.stderr_tail()}")
            finally:
                shutil.rmtree(ref_dir, ignore_errors=True)

        # 2. the run that is killed and restarted
        t_begin = time.monotonic()
        plan = plan_kills(kills, steps=steps, seed=seed, save_fraction=save_fraction,
                          step_time_s=sleep, save_time_s=5 * slow_fsync)
        proc, resumed_from = start(ckpt), 0
        pending: tuple[KillRecord, float] | None = None
        for i, k in enumerate(plan, 1):
            if pending is not None:  # the previous kill's recovery is measured here
                resumed_from = measure_recovery(proc, *pending, deadline)
            target = max(k.at, resumed_from + 1)
            if k.kind == "save":
                ev = proc.wait_for("saving step", deadline, at_least=target)
            elif (proc.last("step") or 0) >= target:
                ev = proc.events[-1]
            else:
                ev = proc.wait_for("step", deadline, at_least=target)
            if ev is not None and k.delay:
                time.sleep(k.delay)  # somewhere inside the next step
            if ev is None:
                hint = "does the worker print 'saving step N'?" if k.kind == "save" and \
                    proc.last("saving step") is None else "use more --steps"
                report.notes.append(f"the run finished before kill {i} could land; "
                                    f"{i - 1} kill(s) made ({hint})")
                pending = None
                break
            t_kill = proc.kill()
            proc.finish(deadline)
            announces = any(kind == "saved step" for p in procs for _, kind, _ in p.events)
            in_save, known = save_progress(proc.events, announces_saves=announces)
            # a save cut short in its write phase leaves a temporary (removed at the restart)
            rec = KillRecord(i, k.kind, proc.last("step"), in_save,
                             bool(_temporaries(ckpt)), known, None, None, None, None)
            report.kills.append(rec)
            pending = (rec, t_kill)
            proc = start(ckpt)
        if pending is not None:
            measure_recovery(proc, *pending, deadline)
        rc = proc.finish(deadline)
        report.final_fingerprint = proc.last("final")
        if rc != 0 or report.final_fingerprint is None:
            raise DrillError(f"the last restart did not finish (exit {rc}):\n"
                             f"{proc.stderr_tail()}")
        report.completed = True
        report.wall_s = time.monotonic() - t_begin
        report.identical = report.final_fingerprint == report.reference_fingerprint
        try:
            from .monitoring import load_metrics, summarize

            report.metrics = summarize(load_metrics(ckpt))
        except FileNotFoundError:
            pass
    except DrillError as e:
        report.error = str(e)
    finally:
        for p in procs:
            p.close()
        if own_dir:
            shutil.rmtree(ckpt, ignore_errors=True)
    return report


def measure_recovery(proc: WorkerProcess, rec: KillRecord, t_kill: float,
                     deadline: float) -> int:
    """Task 6.4 — read a kill's recovery from the restarted worker; returns the step it resumed
    from.

    ``proc`` is the process started after the SIGKILL at ``t_kill`` (``time.monotonic()``);
    ``rec`` is that kill's record, filled in here: ``resumed_from`` (0 when no checkpoint
    existed and it started from scratch), ``restore_s`` (kill to its "resumed from step N"
    line; None from scratch), ``recover_s`` (kill to the first step it computed: only then is
    the job training again), ``steps_lost`` (steps computed before the kill that must be
    computed again). A restarted worker that ends before computing a step is a failed
    recovery: :class:`DrillError`, with its stderr.
    """
    ev = proc.wait_for(("resumed from step", "step"), deadline)
    if ev is None:
        raise DrillError(f"the restarted worker ended without computing a step:\n"
                         f"{proc.stderr_tail()}")
    if ev[1] == "resumed from step":
        rec.resumed_from, rec.restore_s = ev[2], ev[0] - t_kill
        ev = proc.wait_for("step", deadline)
        if ev is None:
            raise DrillError(f"the restarted worker ended right after resuming:\n"
                             f"{proc.stderr_tail()}")
    else:
        rec.resumed_from = 0  # no checkpoint yet: started from scratch
    rec.recover_s = ev[0] - t_kill
    if rec.killed_after_step is not None:
        rec.steps_lost = rec.killed_after_step - rec.resumed_from
    return rec.resumed_from


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minickpt.production.drill",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="training steps of the demo worker")
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.02, help="extra seconds per step")
    p.add_argument("--slow-fsync", type=float, default=0.02,
                   help="extra seconds per fsync, so saves last long enough to be hit")
    p.add_argument("--save-fraction", type=float, default=0.5,
                   help="share of the kills aimed at a save in progress")
    p.add_argument("--dir", help="checkpoint directory (default: a scratch directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole drill")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="let the workers keep compiled programs in DIR (JAX's persistent "
                        "compilation cache): restarts recompile less")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-': stdout)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="a worker command instead of the demo (after --; '{dir}' is replaced)")
    a = p.parse_args(argv)
    cmd = [c for c in a.command if c != "--"] or None
    # terminated from outside: unwind, so that the workers are killed and reaped
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        report = run_drill(a.dir, kills=a.kills, steps=a.steps, every=a.every, seed=a.seed,
                           sleep=a.sleep, slow_fsync=a.slow_fsync,
                           save_fraction=a.save_fraction, command=cmd, timeout_s=a.timeout,
                           compile_cache=a.compile_cache)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if a.json == "-":
        print(report.to_json())
    else:
        print(report.table())
        if a.json:
            with open(a.json, "w") as f:
                f.write(report.to_json() + "\n")
    return 0 if report.completed and report.identical else 1


if __name__ == "__main__":
    sys.exit(main())
