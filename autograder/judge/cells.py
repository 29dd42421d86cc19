"""A lab's test cells, run in this process with the task functions it is given.

The one way a test is run to decide a point: the judge gives it proxies to the student's
worker (:mod:`.session`), the mutation harness gives it the reference with one function
mutated (:mod:`autograder.mutation`). Either way the test cell's whole source (visible,
hidden and grader check) runs here, with the full minickpt, and passes when it runs to its end.

What the graded build does for a kernel is done here in memory: every module attribute of
minickpt that is one of the lab's task functions becomes a plug point that calls the function
given for that name (or raises ``... is not plugged in``), and a ``minickpt._graded`` module
gives :func:`minickpt.labkit.standing_in` and the "this test runs your Task X.Y" notes what
they read there. The references stay reachable through :func:`minickpt.labkit.reference`
(hidden checks compare with them); they are only in this process, never in the student's.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import random
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import ROOT

SOURCE = ROOT / "solutions"


@dataclass
class Verdict:
    grade_id: str
    task: str
    passed: bool
    message: str = ""
    seconds: float = 0.0
    output: str = ""
    """What the test printed (its "Task X.Y: ..." line), for the student's feedback."""


OUTPUT_CHARS = 8000


@dataclass
class TestCell:
    grade_id: str
    task: str
    points: float
    source: str


def lab_cells(lab: str, source: Path | None = None) -> tuple[str, list[TestCell]]:
    """(the setup cell's source, the test cells in notebook order) of ``lab``'s source
    notebook (``solutions/<lab>/<lab>.ipynb``, or ``source/<lab>/<lab>.ipynb``)."""
    from ..notebook import load_lab

    return cells_of(load_lab(Path(source or SOURCE) / lab / f"{lab}.ipynb"))


def cells_of(nb: Any) -> tuple[str, list[TestCell]]:
    """(setup, tests) of a loaded :class:`autograder.notebook.Lab`."""
    from ..notebook import task_of

    setup = "\n\n".join(c.source for c in nb.cells if c.role == "setup")
    tests = [TestCell(c.grade_id, task_of(c.grade_id), c.points, c.source)
             for c in nb.cells if c.role == "test"]
    return setup, tests


def lab_task_names(lab: str) -> dict[str, str]:
    """The lab's task functions: name → task ID (``"1.3"``)."""
    from minickpt.labkit.plugging import reference_functions

    n = lab_number(lab)
    return {fn.__name__: tid for tid, fns in reference_functions().items()
            if tid.split(".")[0] == str(n) for fn in fns}


def lab_number(lab: str) -> int:
    from ..graded_build import lab_number as number

    return number(lab)


GRADED_SHIM = "minickpt._graded"


@contextlib.contextmanager
def plugged(lab: str, functions: Mapping[str, Callable[..., Any]],
            mirror: Callable[[str], Callable[[], None]] | None = None
            ) -> Iterator[types.ModuleType]:
    """minickpt with every task function of ``lab`` replaced by a plug point calling
    ``functions[name]``, and the ``minickpt._graded`` module the graded build would have;
    everything put back when the block ends."""
    from minickpt.labkit.plugging import reference_functions

    from ..graded_build import GRADED_MODULE

    refs = {fn.__name__: (tid, fn) for tid, fns in reference_functions().items()
            if tid.split(".")[0] == str(lab_number(lab)) for fn in fns}
    shim = types.ModuleType(GRADED_SHIM)
    shim.__spec__ = importlib.machinery.ModuleSpec(GRADED_SHIM, loader=None)
    exec(compile(GRADED_MODULE.format(lab=lab_number(lab)), "<graded shim>", "exec"),
         shim.__dict__)
    given = functions  # looked up at each call: a judge that restarts a worker rebinds them

    def plugged_fn(task: str, name: str) -> Callable[..., Any]:
        for ns in reversed(shim.NAMESPACES):
            fn = ns.get(name)
            if callable(fn):
                return fn
        fn = given.get(name)
        if fn is None:
            raise NotImplementedError(f"Task {task}: {name} is not plugged in: define {name} "
                                      f"in task {task}'s cell")
        return fn

    shim.plugged = plugged_fn
    shim.SALT = random.SystemRandom().randrange(1, 2**31)  # the inputs tests draw (labkit.drawn)
    if mirror is not None:  # a test's set-up made in the student's worker too (labkit.mirrored)
        shim.mirror = mirror
    plugs: dict[str, Callable[..., Any]] = {}
    for name, (tid, ref) in refs.items():
        def plug(*args: Any, _t: str = tid, _n: str = name, **kwargs: Any) -> Any:
            return shim.plugged_call(_t, _n, args, kwargs)

        plug.__name__ = plug.__qualname__ = name
        plug.__doc__ = ref.__doc__
        plug._minickpt_plug_point = True  # type: ignore[attr-defined]
        plugs[name] = plug
    patched: list[tuple[Any, str, Any]] = []
    old_shim = sys.modules.get(GRADED_SHIM)
    sys.modules[GRADED_SHIM] = shim
    try:
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "minickpt" or mod_name.startswith("minickpt.")):
                continue
            for attr, value in list(vars(mod).items()):
                for name, (_, ref) in refs.items():
                    if value is ref:
                        patched.append((mod, attr, value))
                        setattr(mod, attr, plugs[name])
        shim._judge_patched = patched  # what :func:`unplugged` puts back for a grader's tool
        yield shim
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)
        if old_shim is None:
            sys.modules.pop(GRADED_SHIM, None)
        else:
            sys.modules[GRADED_SHIM] = old_shim


@contextlib.contextmanager
def unplugged() -> Iterator[None]:
    """For the block, minickpt as the grader's own process has it outside :func:`plugged`:
    the references where the plug points were and no ``minickpt._graded`` (a grader's tool a
    test calls, ``grader_drill``: its drill runs the student's code in its own workers and
    reads their disk with minickpt's own functions, never through the student's)."""
    shim = sys.modules.get(GRADED_SHIM)
    patched = list(getattr(shim, "_judge_patched", ()))
    plugs = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patched]
    for mod, attr, ref in patched:
        setattr(mod, attr, ref)
    if shim is not None:
        sys.modules.pop(GRADED_SHIM, None)
    try:
        yield
    finally:
        for mod, attr, plug in plugs:
            setattr(mod, attr, plug)
        if shim is not None:
            sys.modules[GRADED_SHIM] = shim


def ensure_devices(n: int = 4) -> None:
    """Ask JAX's CPU backend for ``n`` devices, as every lab's setup does, if JAX has not
    started yet (afterwards the flag changes nothing)."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def run_tests(lab: str, functions: Mapping[str, Callable[..., Any]],
              grade_ids: Sequence[str] | None = None, *,
              tools: Mapping[str, Callable[..., Any]] | None = None,
              source: Path | None = None, timeout: float | None = None,
              on_verdict: Callable[[Verdict], None] | None = None,
              cells: tuple[str, list[TestCell]] | None = None,
              mirror: Callable[[str], Callable[[], None]] | None = None,
              before_test: Callable[[], None] | None = None) -> list[Verdict]:
    """Run ``lab``'s test cells (``grade_ids``, default all) in this process, in notebook
    order and in one namespace (as a notebook would), with ``functions`` as the student's
    task functions. A test passes when its code ran to its end; the message of one that did
    not is its error, as the student would read it. ``tools``: names a grader check may call
    (``grader_drill``). ``timeout``: a test still running after it fails (checked between
    calls into the functions; see :mod:`.session` for calls that hang)."""
    import builtins

    setup, tests = cells if cells is not None else lab_cells(lab, source)
    wanted = set(grade_ids) if grade_ids is not None else None
    ensure_devices()
    main = types.ModuleType("__main__")
    ns = main.__dict__
    ns.update(__builtins__=builtins, __name__="__main__")
    old_main = sys.modules.get("__main__")
    verdicts: list[Verdict] = []
    with _cwd_scratch(), plugged(lab, functions, mirror):
        sys.modules["__main__"] = main
        try:
            exec(compile(setup, "<setup>", "exec"), ns)
            ns.update(functions)
            ns.update(tools or {})
            for cell in tests:
                if wanted is not None and cell.grade_id not in wanted:
                    continue
                if before_test is not None:
                    before_test()
                v = _run_one(cell, ns, functions, tools)
                verdicts.append(v)
                if on_verdict is not None:
                    on_verdict(v)
        finally:
            if old_main is not None:
                sys.modules["__main__"] = old_main
    return verdicts


def _run_one(cell: TestCell, ns: dict[str, Any], functions: Mapping[str, Callable[..., Any]],
             tools: Mapping[str, Callable[..., Any]] | None) -> Verdict:
    ns.update(functions)  # a test (or a hidden check) may have rebound a name
    ns.update(tools or {})
    import io

    t0 = time.monotonic()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(cell.source, f"<{cell.grade_id}>", "exec"), ns)
    except BaseException as e:  # whatever the student's code raised, it is this test's failure
        if isinstance(e, (KeyboardInterrupt, SystemExit)) and not _from_student(e):
            raise
        return Verdict(cell.grade_id, cell.task, False, _message(e), time.monotonic() - t0,
                       out.getvalue()[:OUTPUT_CHARS])
    return Verdict(cell.grade_id, cell.task, True, "", time.monotonic() - t0,
                   out.getvalue()[:OUTPUT_CHARS])


def _from_student(e: BaseException) -> bool:
    """A SystemExit or KeyboardInterrupt that crossed the wire (the student's code raised it
    in its worker) fails the test; one of this process's own stops the run."""
    return type(e).__module__ == "__judge_test__" or getattr(e, "_from_worker", False)


def _message(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text[:1000]


@contextlib.contextmanager
def _cwd_scratch() -> Iterator[None]:
    """Tests write under ``lab.tempdir()`` (the system's temporary folder); nothing else of
    this process changes."""
    yield
