"""Lab 2 (save policy): retention cases, and crashing the commit at every file-system call."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .checks import tree_diff
from .devices import (
    drawn,  # module level: the referee's private copy of the kit cannot import later
)
from .plugging import plugged_in
from .temporaries import tempdir


def retention_cases(n: int, seed: int = 0) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """``n`` random retention problems: (saved checkpoints, options of ``steps_to_keep``).

    Seeded, so a failure names a case that comes back on every run. The checkpoints come in
    any order, with repeated and non-finite losses, metrics that lack the key ``best_fn``
    reads, and no metrics at all — the cases a rule can get wrong.
    """
    import math
    import random

    from ..policy import StepInfo
    rng = random.Random(drawn(seed))
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
                     retired: tuple[int, ...] = (), random_states: int = 1) -> CrashReport:
    """Save ``step`` with a ``CheckpointManager`` (``max_to_keep``) into a run that holds
    ``before``, with the student's ``fns`` plugged in, and crash it before every one of its
    file-system calls (:mod:`minickpt.crashsim`). Every state a power cut there can leave is
    opened by a fresh manager, each listed step verified and restored.

    With ``leftovers`` the run also holds what crashed saves and deletes leave (a temporary
    of ``step``, a half-removed deleted checkpoint) and two files of the user's. The steps in
    ``retired`` (of ``before``) are renamed for deletion first, in the same scenario, with
    nothing fsynced: a background delete whose process was killed before its run directory's
    fsync, so the page cache holds the rename and the disk may not; a cleanup that removes
    their files before making that rename durable lets a power cut bring the step back
    torn. A problem says where the crash was and what was lost or damaged.
    """
    import os
    import warnings

    from ..commit import DELETE_MARK, TMP_MARK, is_temporary
    from ..crashsim import AssertionFailure, explore
    from ..fs import FileSystem
    from ..manager import CheckpointManager
    from ..options import CheckpointManagerOptions

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
        if retired:  # a retired step may be back (whole) or gone, with any of these
            if not set(retired) <= set(before):
                raise ValueError(f"retired={retired} must be steps of before={before}")
            allowed |= {tuple(s for s in a if s not in retired) for a in allowed}
            doomed += [s for s in retired if s not in doomed]

        def scenario(fs: FileSystem, world: str) -> None:
            with _same_names():
                mngr = None
                try:
                    for s in retired:  # a killed delete's rename: in the page cache only
                        path = os.path.join(world, "run", f"step_{s}")
                        fs.rename(path, f"{path}{DELETE_MARK}0dead0de")
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
            _note(report, seen, pt, bad)
    return report


def _note(report: Any, seen: set[str], pt: Any, bad: list[str]) -> None:
    """Add each problem found at crash point ``pt`` once, with what was not yet durable then
    (the temporary worlds' paths hidden, so that the same problem reads the same)."""
    for b in bad:
        msg = re.sub(r"\S*/(state|point)\d+", "<world>",
                     f"crash before call {pt.index} ({pt.call}) — {b}")
        if msg not in seen:
            seen.add(msg)
            pending = re.sub(r"\S*/point\d+", "<world>", "; ".join(pt.pending[:3]) or "nothing")
            report.problems.append(f"{msg} [not yet durable then: {pending}]")


def _files_of(root: str) -> dict[str, bytes | None]:
    """Every directory (``None``) and file (its bytes) under ``root``, by relative path."""
    import os

    out: dict[str, bytes | None] = {}
    for d, _subdirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel != ".":
            out[rel] = None
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.normpath(os.path.join(rel, name))] = f.read()
    return out


def crash_commit(commit: Callable[..., Any], *, subdirs: tuple[str, ...] = ("params", "params/mu"),
                 caller_batch: bool = True, existing: bool = False,
                 random_states: int = 1) -> CrashReport:
    """Crash a hand-made save at every file-system call: write a temporary tree of ``subdirs``
    (one ``data.bin`` in each directory, not yet fsynced when ``caller_batch``: handed over in
    a :class:`~minickpt.fs.SyncBatch`; fsynced by the writer otherwise), then call
    ``commit(fs, tmp_dir, final_dir, subdirs=..., sync=...)``. Every state a power cut can
    leave is read back: ``final_dir`` must be absent or complete (every directory, every
    byte), and present for good once ``commit`` has returned.

    With ``existing`` the run already holds a committed ``final_dir`` (other bytes): the
    commit must raise :class:`~minickpt.errors.StepAlreadyExistsError`, and no crash state may
    hold anything but the old checkpoint under that name.
    """
    import os

    from ..crashsim import AssertionFailure, explore
    from ..errors import StepAlreadyExistsError
    from ..faults import SimulatedCrash
    from ..fs import FileSystem, SyncBatch

    tmp_name, final_name = "step_7.minickpt-tmp-0000abcd", "step_7"
    dirs = ["", *subdirs]
    new = {**{s: None for s in subdirs},
           **{os.path.join(s, "data.bin"): f"step 7, {s or 'top'}: ".encode() * 40 for s in dirs}}
    old = {"params": None, "params/data.bin": b"step 7, committed long ago"}
    report = CrashReport()
    raised: list[str] = []
    bypassed: list[str] = []  # the directory appeared, but no rename went through fs
    with tempdir("/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as work:
        template = os.path.join(work, "template")
        os.makedirs(os.path.join(template, "run"))
        if existing:
            os.makedirs(os.path.join(template, "run", final_name, "params"))
            with open(os.path.join(template, "run", final_name, "params", "data.bin"), "wb") as f:
                f.write(old["params/data.bin"])

        def scenario(fs: FileSystem, world: str) -> None:
            run = os.path.join(world, "run")
            tmp, final = os.path.join(run, tmp_name), os.path.join(run, final_name)
            batch = SyncBatch(fs) if caller_batch else None
            try:
                fs.mkdir(tmp)
                for s in dirs:
                    if s:
                        fs.mkdir(os.path.join(tmp, s))
                    fd = fs.open(os.path.join(tmp, s, "data.bin"),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                    fs.write(fd, new[os.path.join(s, "data.bin")])
                    if batch is not None:
                        batch.add_file(fd)
                    else:
                        fs.fsync(fd)
                        fs.close(fd)
                try:
                    commit(fs, tmp, final, subdirs=list(subdirs), sync=batch)
                    raised.append("")
                    calls = getattr(fs, "calls", None)
                    if calls is not None and os.path.isdir(final) and not existing \
                            and not any(op == "rename" for op, _ in calls):
                        bypassed.append(final_name)
                except SimulatedCrash:
                    raise
                except Exception as e:  # what the commit raised, judged below
                    raised.append(f"{type(e).__name__}: {e}"[:200]
                                  if not isinstance(e, StepAlreadyExistsError) else "exists")
            finally:
                if batch is not None:
                    batch.close()  # the caller's batch: the caller closes it

        def observe(world: str) -> str:
            final = os.path.join(world, "run", final_name)
            if not os.path.isdir(final):
                if existing:
                    raise AssertionError(f"{final_name} is gone: the committed checkpoint was "
                                         "removed (a commit must never replace one)")
                return "absent"
            got = _files_of(final)
            if existing:
                if got != old:
                    raise AssertionError(f"{final_name} no longer holds the committed checkpoint "
                                         f"(it holds {sorted(got)}): it was replaced or changed")
                return "old"
            if got != new:
                missing = sorted(k for k in new if k not in got)
                torn = sorted(k for k in new if k in got and got[k] != new[k])
                what = (f"missing {missing}" if missing else "") + \
                       ("; " if missing and torn else "") + \
                       (f"{torn} empty or cut short" if torn else "")
                raise AssertionError(f"{final_name} exists but is torn: {what or 'extra entries'}")
            return "new"

        durable_from: int | None = None
        seen: set[str] = set()
        for pt in explore(template, scenario, observe, fidelity=False,
                          workdir=os.path.join(work, "x"), random_states=random_states):
            report.points += 1
            report.states += len(pt.states)
            bad = [f"{st.label}: {out.message}" for st, out in zip(pt.states, pt.outcomes,
                                                                  strict=True)
                   if isinstance(out, AssertionFailure)]
            if not existing:
                good = [o for o in pt.outcomes if not isinstance(o, AssertionFailure)]
                if good and all(o == "new" for o in good):
                    durable_from = pt.index if durable_from is None else durable_from
                elif durable_from is not None:
                    bad.append(f"{final_name} was safe from crash point {durable_from} on, but "
                               "a power cut here loses it")
                if pt.call == "end" and not all(o == "new" for o in good):
                    bad.append(f"commit returned, but a power cut right after it can lose "
                               f"{final_name}: its rename is not durable yet")
            _note(report, seen, pt, bad)
    outcome = raised[-1] if raised else ""  # the run that was not crashed
    outcome = re.sub(r"\S*/point\d+/run/", "<run>/", outcome)
    if existing and outcome != "exists":
        lost = (f"; and {len(report.problems)} crash states lost the old checkpoint, the first: "
                f"{report.first()}") if report.problems else ""
        report.problems.insert(0, f"committing onto the existing {final_name} should raise "
                               "StepAlreadyExistsError; it " +
                               ("returned normally" if not outcome else f"raised {outcome}") + lost)
    elif not existing and outcome:
        report.problems.insert(0, f"commit raised {outcome} on a plain first commit")
    if bypassed:
        report.problems.insert(0, f"{final_name} appeared, but no rename went through the fs "
                               "the commit was given (os.rename, shutil.move?): every "
                               "file-system call of a commit goes through fs (fs.rename, "
                               "fs.fsync_dir, ...), or this test cannot crash it, and the "
                               "problems below describe a commit that never renamed")
    return report
