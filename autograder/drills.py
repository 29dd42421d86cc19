"""Drills the grader runs itself (issue 38): the student's functions run in worker processes
in the submission's sandbox; the driver, the kill moments, the reading of the disk, the
reference run and the verdict stay in the grader's process, where no student code runs.

A test cell asks for one in its grader check (``failed = grader_drill("3.3")``). The kernel
runs its own drill for the student's feedback too, but that one runs in the student's process
and proves nothing; this one decides. What it judges is what it observes: the steps it chose
to kill at, the checkpoints committed on disk at each start (read by the full library here),
the workers' exit codes, and the final checkpoint restored and compared by trusted code.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import sandbox

SCRATCH_BYTES = 256 << 20
"""What a drill's workers may leave in its folder (a folder of the grading machine, not a
size-capped tmpfs of the sandbox's): past it the workers are killed and the drill fails."""

MEMORY_DIR = "/dev/shm"
"""Where a scratch folder goes when there is room (:func:`scratch_parent`)."""
SCRATCH_PREFIX = "minickpt-judge-"


def scratch_parent(root: str | Path, memory: str = MEMORY_DIR) -> str:
    """The folder a drill's or the judge's scratch folder is made in: ``memory`` (a tmpfs)
    when it is writable and has room for two full scratch folders, else ``root`` (the job's
    folder). Why: the judge's tests create and delete thousands of small files (lab 2 crashes
    a save at each of its calls and writes every state it can leave), and on a disk whose
    journal is busy each of those costs milliseconds (lab 2's crash test took 32-38 s in a
    folder on ext4 beside a running suite, 7-11 s in /dev/shm). The student's kernel ran its
    tests on a tmpfs too (the sandbox's /tmp); durability is modelled, never needed here.
    ``MINICKPT_GRADE_SCRATCH=disk`` keeps every scratch folder in ``root``."""
    if os.environ.get("MINICKPT_GRADE_SCRATCH", "") == "disk":
        return str(root)
    try:
        st = os.statvfs(memory)
        room = st.f_bavail * st.f_frsize
    except OSError:
        return str(root)
    if not os.path.isdir(memory) or not os.access(memory, os.W_OK | os.X_OK) \
            or room < 2 * SCRATCH_BYTES:
        return str(root)
    _sweep(memory)
    return memory


def _sweep(memory: str) -> None:
    """Remove the scratch folders of grading processes that died before removing their own
    (a killed grader leaves them in memory until the machine restarts)."""
    try:
        names = os.listdir(memory)
    except OSError:
        return
    for name in names:
        pid = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if not name.startswith(SCRATCH_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's)
        except PermissionError:
            continue
        except ProcessLookupError:
            shutil.rmtree(os.path.join(memory, name), ignore_errors=True)


def _cells_defining(cells: Sequence[str],
                    names: Iterable[str]) -> Iterator[tuple[str, ast.Module]]:
    """The student's cells (source, tree) that define one of ``names`` at their top level, in
    notebook order; a cell Python cannot parse defines nothing."""
    names = set(names)
    for source in cells:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # nested too deep too
            continue
        if any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name in names
               for n in tree.body):
            yield source, tree


def definitions(cells: Sequence[str], names: Iterable[str]) -> str:
    """The code a worker runs: from every cell of the student's that defines one of ``names``
    at its top level, that cell's imports, definitions (functions, classes) and constants
    written as literals (``PHASES = ("created", "written")``), in notebook order, so the last
    definition of a name is the one that counts, as in the kernel. Nothing else of the cell
    runs (no statement that prints, trains, tests or reads anything): statements beside a task
    function gain nothing from running in a worker (issue 47)."""
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    parts: list[str] = []
    for source, tree in _cells_defining(cells, names):
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, kept) or _literal_constant(node):
                first = min([node.lineno, *(d.lineno for d in
                                            getattr(node, "decorator_list", []))])
                parts.append("".join(lines[first - 1:node.end_lineno]))
    return "\n".join(parts)


def _literal_constant(node: ast.stmt) -> bool:
    """``NAME = <literal>`` (or annotated): a constant that reads nothing when it runs."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return False
    if not all(isinstance(t, ast.Name) for t in targets):
        return False
    try:
        ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _missing(code: str, name: str) -> str | None:
    """Why the drill cannot start when ``code`` defines no function ``name``, else None."""
    if name in {n.name for n in ast.parse(code).body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}:
        return None
    return f"the grader's drill found no function {name} defined in your notebook"


def _in_box(box: Box, run: Callable[[str], Any]) -> tuple[Any, str | None]:
    """``run(scratch)`` inside ``box``: (its result, None), or (None, why the drill stopped:
    the workers left what may not be read here, or wrote too much)."""
    result = None
    with box.scratch() as d:
        try:
            result = run(d)
        except _Refused:
            pass
        if box.over:
            return None, f"the grader's drill stopped: {box.over[0]}"
    return result, None


@dataclass
class Box:
    """How a drill's workers start: in the submission's sandbox, with its limits and the
    minickpt its kernel imported (the graded build), as the slot's uid; ``root`` is the job's
    folder, where each drill gets a scratch folder that only the drill's workers write."""

    iso: sandbox.Isolation
    uid: int
    limits: sandbox.Limits
    extra_ro: dict[str, str]
    root: Path
    cgroup: Any = None
    over: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[str]:
        d = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-",
                             dir=scratch_parent(self.root))
        if self.iso.mode == "bwrap-root" and self.uid:
            os.chown(d, self.uid, self.uid)
        stop = threading.Event()
        guard = threading.Thread(target=self._guard, args=(d, stop), daemon=True)
        guard.start()
        try:
            yield d
        finally:
            stop.set()
            guard.join()
            self.end_workers()
            shutil.rmtree(d, ignore_errors=True)

    def _guard(self, d: str, stop: threading.Event) -> None:
        while not stop.wait(0.25):
            if _size(d) > SCRATCH_BYTES:
                self.over.append(f"the workers wrote more than {SCRATCH_BYTES >> 20} MiB")
                self.end_workers()

    def wrap(self, d: str) -> Callable[[list[str], dict[str, str]], list[str]]:
        """``argv`` (a Python command) → the same run in the sandbox, seeing ``d`` read-write
        at its own path and nothing else of this machine but what its kernel saw. Called once
        the grader has written what the workers start from: the folder is then the slot's."""
        def wrapped(argv: list[str], env: dict[str, str]) -> list[str]:
            if self.iso.mode == "bwrap-root" and self.uid:
                for top, dirs, files in os.walk(d):
                    for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                        os.lchown(name, self.uid, self.uid)
            python = sandbox.sandbox_python(sys.executable) if self.iso.sandboxed else argv[0]
            inner = {k: v for k, v in env.items() if k.startswith(sandbox.PASS_ENV_PREFIXES)}
            return sandbox.kernel_command(
                self.iso, [python, *argv[1:]], uid=self.uid, cwd="/tmp", ipc_dir=d,
                read_only=sandbox.python_paths(sys.executable), limits=self.limits, env=inner,
                extra_ro={**sandbox.package_binds(sys.executable), **self.extra_ro})
        return wrapped

    def end_workers(self) -> None:
        """No process of a worker survives it (a killed worker's children included). Without
        the sandbox as root nothing marks them (the drill has killed its own worker; the
        sandbox's PID namespace takes the rest with it)."""
        if self.cgroup is not None:
            self.cgroup.kill(spare={os.getpid()})
        elif self.iso.mode == "bwrap-root" and self.uid:
            sandbox.kill_uid(self.uid)

    def plain(self, d: str) -> str | None:
        """Why the folder the workers wrote may not be read by the grader (a link, a device,
        a FIFO ...), or None: only folders and regular files are read here."""
        for top, dirs, files in os.walk(d):
            for name in dirs + files:
                path = os.path.join(top, name)
                st = os.lstat(path)
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                    return f"the workers left {os.path.relpath(path, d)}, not a plain file"
        return None


def _size(d: str) -> int:
    total = 0
    for top, _, files in os.walk(d):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def drill_3_3(cells: Sequence[str], box: Box) -> str | None:
    """Task 3.3's crash drill, judged here (None: passed). The worker runs the student's lab 3
    task functions; before its first start the folder already holds a checkpoint of step 5
    from a run of a seed drawn now, so only a resume that restores what is on disk ends where
    this process's own continuation of that run ends."""
    return run_3_3(cells, box)[1]


def run_3_3(cells: Sequence[str], box: Box, *, steps: int = 15, every: int = 5, kills: int = 2,
            timeout_s: float = 50.0) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`drill_3_3`'s run: what happened (:func:`minickpt.labkit.lab3.run_lab3_drill`'s
    dict; None where the drill stopped or the code has no ``resume``) and its verdict."""
    import random

    from minickpt.labkit import lab3

    names = ("resume", "restore_newest_valid", "check_structure", "migrate")
    code = definitions(cells, names)
    if why := _missing(code, "resume"):
        return None, why
    seed = random.SystemRandom().randint(1, 2**31 - 1)
    r, stopped = _in_box(box, lambda d: lab3.run_lab3_drill(
        code, d, steps=steps, every=every, kills=kills, timeout_s=timeout_s, wrap=box.wrap(d),
        env=_worker_env(), plant_seed=seed, after_run=lambda: _after(box, d)))
    if stopped:
        return None, stopped
    failed = lab3.drill_message(r)
    if failed is None and any(run["rc"] != -9 for run in r["runs"][:-1]):
        failed = (f"the killed workers should have died of the SIGKILL (exit -9): "
                  f"{[run['rc'] for run in r['runs']]}")
    return r, None if failed is None else f"the grader's own drill: {failed}"


def judge_launch(box: Box, d: str) -> dict[str, Any]:
    """How the processes a judged test starts on the student's code (lab 3's crash drill, lab
    6's loop processes: :mod:`minickpt.labkit.processes`) run: in the sandbox, seeing the
    judge's folder ``d`` (where the test's folders are), signalled and found there as this
    module's drills do. After each process nothing but plain files may be left for the judge
    to read (a link, a FIFO ... fails the test). The slot's other processes are not ended
    after each (the student's judge worker is one of them): the sandbox's PID namespace takes
    a process's children with it, and the judge ends the slot's processes when it is done."""
    def after_run() -> None:
        why = box.plain(d) or (box.over[0] if box.over else None)
        if why:
            raise _Refused(f"the test's process: {why}")

    return {"wrap": box.wrap(d), "after_run": after_run, "send_signal": _signal_worker(box),
            "locate": _locate_worker(box)}


def _after(box: Box, d: str) -> None:
    """After each run: its processes gone, and nothing but plain files left to read."""
    box.end_workers()
    why = box.plain(d)
    if why:
        box.over.append(why)
    if box.over:
        raise _Refused(box.over[0])


class _Refused(Exception):
    """The workers' folder may not be read here (what :meth:`Box.plain` found, or too big)."""


def _worker_env() -> dict[str, str]:
    """The worker's variables (the sandbox starts from a clean environment and adds these)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(sandbox.PASS_ENV_PREFIXES)}
    return {**env, "JAX_PLATFORMS": "cpu"}


def tool(cells: Sequence[str], box: Box | None) -> Callable[[str], str | None]:
    """``grader_drill(task)`` for a grader check: runs that task's drill on this submission's
    code, in ``box`` (None: no sandbox here, the workers run as plain processes).

    Its ``for_test(task, **params)`` is the same drill as a test's own drill of the task
    becomes under the judge (:data:`minickpt.labkit.processes.DRILL_KEY`): it returns what
    happened, for the test's checks, and a later ``grader_drill(task)`` with the same
    parameters gives that run's verdict instead of running the drill again (lab 3's drill
    test asked for two drills of three processes each; the test's own is a weaker copy of
    the grader's). Lab 3's drill that stopped raises :class:`~minickpt.labkit.LabCheckError`."""
    ran: dict[str, tuple[dict[str, Any], str | None]] = {}

    def grader_drill(task: str) -> str | None:
        if task not in DRILLS:
            raise KeyError(f"no grader drill for task {task}")
        if task in ran and ran[task][0] == RUNS[task][1]:  # that run is this check's
            return ran.pop(task)[1]
        if box is None:
            raise RuntimeError("the grader's drill needs the job's folder")
        return DRILLS[task](cells, box)

    def for_test(task: str, **params: Any) -> Any:
        if task not in RUNS:
            raise KeyError(f"no grader drill for a test of task {task}")
        if box is None:
            raise RuntimeError("the grader's drill needs the job's folder")
        value, failed = RUNS[task][0](cells, box, **params)
        ran[task] = ({k: v for k, v in params.items() if k in RUNS[task][1]}, failed)
        return value

    grader_drill.for_test = for_test  # type: ignore[attr-defined]
    return grader_drill


# lab 6
def drill_6_3(cells: Sequence[str], box: Box) -> str | None:
    """Task 6.3's preemption drill, judged here (None: passed). The student's loop runs in
    the lab's driver in sandboxed workers, one after another on one folder that already holds
    a checkpoint of another run (a step and a carry drawn now). The set-up is drawn now too
    (:func:`minickpt.labkit.lab6.draw_setup`): the interval, the training step's coefficients,
    metrics or not, and per process a sync or async manager, an ``on_step`` or not, the
    notice's signal (SIGTERM or SIGINT) and whether the process ends the moment the loop
    returns. A worker learns it over the channel once the student's code is loaded, never
    from ``argv``, the environment or a file. Each process but the last gets its notice
    from this process right after a step drawn here (the worker waits after each step until
    this process let it go on, so the notice lands inside that step), and the last runs to
    ``stop``. The verdict (:func:`minickpt.labkit.lab6.effects_message`) comes from what
    this process saw: the worker's caught signals read from ``/proc`` (no handler of the
    loop's own), whether it sent each notice it planned, the exit codes, the steps on disk
    when the loop returned (every save it started is there), every checkpoint on disk after
    each process (which steps, carries, metrics) read here and compared with the drawn
    training going on from the planted one, and the ``on_step`` calls as they happened."""
    import random

    import numpy as np

    from minickpt.labkit import lab6

    code = definitions(cells, ("train_until_preempted",))
    if why := _missing(code, "train_until_preempted"):
        return why
    chance = random.SystemRandom()
    rng = np.random.default_rng(chance.randint(1, 2**31 - 1))
    plant = (int(rng.integers(3, 10)), rng.normal(0.0, 100.0, 4))
    setup = lab6.draw_setup(chance, processes=4, start=plant[0])
    r, stopped = _in_box(box, lambda d: lab6.run_preemption_drill(
        code, d, signals=3, setup=setup, chance=chance, plant=plant,
        judge=lab6.effects_message, wrap=box.wrap(d), env=_worker_env(),
        after_run=lambda: _after(box, d), send_signal=_signal_worker(box),
        locate=_locate_worker(box)))
    if stopped:
        return stopped
    return None if r["failed"] is None else f"the grader's own drill: {r['failed']}"


def _locate_worker(box: Box) -> Callable[[Any], int | None]:
    """``locate(proc)``: the pid, on this machine, of the Python worker ``box.wrap`` started
    (in the sandbox the process started is bubblewrap's; the worker is the oldest process
    below it that is not bubblewrap's: a process the worker forks is younger), or None."""
    def locate(proc: Any) -> int | None:
        if not box.iso.sandboxed:
            return proc.pid
        found = []
        for p in sandbox.descendants(proc.pid):
            try:
                with open(f"/proc/{p}/stat") as f:
                    stat = f.read()
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                started = int(stat[stat.rindex(")") + 2:].split()[19])
            except (OSError, ValueError, IndexError):
                continue
            if comm != "bwrap":
                found.append((started, p))
        return min(found)[1] if found else None
    return locate


def _signal_worker(box: Box) -> Callable[[Any, int], bool]:
    """``send_signal(proc, sig)`` for a worker started by ``box.wrap``: the signal goes to
    the Python worker (:func:`_locate_worker`); False when it is gone."""
    locate = _locate_worker(box)

    def send(proc: Any, sig: int) -> bool:
        pid = locate(proc)
        if pid is None:
            return False  # the worker is gone: the drill records no signal sent
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True
    return send



# lab 4
def drill_4_3(cells: Sequence[str], box: Box, plan: dict[str, Any] | None = None) -> str | None:
    """Lab 4's multi-process save, judged here (None: passed): one sandboxed command launches
    4 JAX processes (one network namespace, for their TCP on 127.0.0.1) that load the
    imports, definitions and literal constants of the student's lab 4 cells, then connect to
    this process and are told, save by save, what to save: four saves whose layout, values
    (seeds), primary, slow process and failures (an error of a drawn kind at a point before
    publication, on a process; the primary's commit) are drawn now. Nothing of it is in their
    ``argv``, environment or files. The verdict is read from the disk by this process, after
    each save and at the end: each step appeared when its save returned and only if it
    succeeded, through the student's ``two_barrier_commit`` on every process; a failed save
    left nothing; each good save is a committed step that verifies, every piece written once,
    restored here to the values drawn for it; then the command's exit code. ``plan``: a drawn
    one (tests)."""
    from minickpt.labkit import lab4_drill

    plan = plan or lab4_drill.drill_plan()
    code = definitions(cells, plan["names"])
    if why := _missing(code, "two_barrier_commit"):
        return why
    failed, stopped = _in_box(box, lambda d: lab4_drill.lab4_drill_message(lab4_drill.run_lab4_drill(
        code, d, plan, wrap=box.wrap(d), env=_worker_env(),
        after_run=lambda: _after(box, d)), plan))  # judged before the folder goes
    if stopped:
        return stopped
    return None if failed is None else f"the grader's own drill: {failed}"


DRILLS: dict[str, Callable[..., str | None]] = {"3.3": drill_3_3, "4.3": drill_4_3,
                                               "6.3": drill_6_3}
"""The drills a grader check may ask for, by task."""


def _test_3_3(cells: Sequence[str], box: Box, **params: Any) -> tuple[dict[str, Any], str | None]:
    """Lab 3's drill test under the judge: the grader's drill with the test's steps, interval
    and kills; what happened, for the test's checks (a drill that stopped fails the test)."""
    from minickpt.labkit import LabCheckError

    r, failed = run_3_3(cells, box, **params)
    if r is None:
        raise LabCheckError(failed or "the grader's drill did not run")
    return r, failed


def _test_6_3(cells: Sequence[str], box: Box, **params: Any) -> tuple[str | None, str | None]:
    """Lab 6's drill test of the plain set-up under the judge: the grader's drill, whose
    set-up is drawn (the test's ``signals`` and ``seed`` do not apply); its verdict."""
    failed = DRILLS["6.3"](cells, box)
    return failed, failed


RUNS: dict[str, tuple[Callable[..., tuple[Any, str | None]], dict[str, Any]]] = {
    "3.3": (_test_3_3, {"steps": 15, "every": 5, "kills": 2, "timeout_s": 50.0}),
    "6.3": (_test_6_3, {})}
"""The drills a test's own drill becomes under the judge (``tool(...).for_test``), by task:
how each runs for a test (what the test reads, and the verdict), and the parameters its
grader check runs it with (those that reach the run)."""
