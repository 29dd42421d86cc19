"""Lab 6 (production): simulated failures, the preemption loop in a real process, drills."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from ..production.drill import WorkerProcess
from .checks import LabCheckError
from .lab6_preemption import (  # noqa: F401 (task 6.3's drill, in its own module; lab6.X)
    KERNEL_SETUP,
    draw_setup,
    effects_message,
    kernel_message,
    lab6_carry,
    preemption_drill,
    run_loop_process,
    run_loop_worker,
    run_preemption_drill,
)


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


def printing_worker(lines: list[tuple[float, str]], *, read_delay: float = 0.0) -> Any:
    """A real process that prints ``lines`` (each after its delay in seconds), for feeding a
    drill's reader exactly the events a test wants. With ``read_delay`` every read of an event
    waits that long first: a reader that comes late, whose times must still be the events' own
    stamps (taken when each line arrived), not the moments they were read."""
    prog = "import time\n" + "".join(f"time.sleep({d!r}); print({s!r}, flush=True)\n"
                                     for d, s in lines)
    return LateReader([sys.executable, "-c", prog], read_delay)


class LateReader(WorkerProcess):
    """A worker whose events are read ``read_delay`` seconds after the reader asks."""

    def __init__(self, cmd: list[str], read_delay: float = 0.0) -> None:
        super().__init__(cmd)
        self.read_delay = read_delay

    def next_event(self, deadline: float) -> tuple[float, str, Any] | None:
        if self.read_delay:
            time.sleep(self.read_delay)
        return super().next_event(deadline)


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
