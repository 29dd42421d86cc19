"""Plugging a student's function into minickpt: each task's reference functions (found by
their ``"Task X.Y —"`` docstrings) and :func:`plugged_in`, which swaps them for the student's."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from .checks import LabCheckError
from .processes import given_source

TASK_RE = re.compile(r"^Task (\d+\.\d+)\b")



def task_id(fn: Any) -> str | None:
    """The task a function belongs to, from its docstring (``"Task 1.3 (read) — ..."``)."""
    m = TASK_RE.match(inspect.getdoc(fn) or "") if callable(fn) else None
    return m.group(1) if m else None


@cache
def reference_functions() -> dict[str, tuple[Callable[..., Any], ...]]:
    """Every task of every lab: task ID → its reference functions, in source order.

    Found by scanning minickpt's modules for functions whose docstring starts with
    ``"Task X.Y"``, so adding a task to the library is all it takes.
    """
    import minickpt

    found: dict[str, list[tuple[str, int, Callable[..., Any]]]] = {}
    # walk_packages, not iter_modules: lab 6's tasks live in the subpackage minickpt.production
    for info in pkgutil.walk_packages(minickpt.__path__, "minickpt."):
        if info.name in ("minickpt.__main__",):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as e:  # a module needing an optional extra (fsspec ...)
            if (e.name or "").split(".")[0] == "minickpt":
                raise
            continue
        for name, obj in vars(mod).items():
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__ and \
                    name == obj.__name__:
                tid = task_id(obj)
                if tid is not None:
                    line = obj.__code__.co_firstlineno
                    found.setdefault(tid, []).append((mod.__name__, line, obj))
    return {tid: tuple(f for _, _, f in sorted(fns, key=lambda t: (t[0], t[1])))
            for tid, fns in sorted(found.items(), key=lambda kv: _task_key(kv[0]))}


def _task_key(tid: str) -> tuple[int, ...]:
    return tuple(int(p) for p in tid.split("."))


def reference(name: str) -> Callable[..., Any]:
    """The reference function called ``name`` (any task): minickpt's own implementation, the
    oracle the hidden tests compare a student's results with. It is not the student's to call:
    under the grader, a task whose code reaches it while the task's tests run (directly, through
    the library, a default argument, a thread ...) scores 0 and is flagged (:mod:`.watch`);
    every lab says so in its introduction."""
    for fns in reference_functions().values():
        for fn in fns:
            if fn.__name__ == name:
                return fn
    known = sorted(f.__name__ for fns in reference_functions().values() for f in fns)
    raise LabCheckError(f"no lab task has a function called {name!r}; keep the names the lab "
                        f"gives you (one of {known})")


@contextlib.contextmanager
def plugged_in(*fns: Callable[..., Any]) -> Iterator[None]:
    """Run minickpt with the student's functions in place of the reference ones (by name).

    Every module attribute in ``minickpt.*`` that *is* the reference function is replaced,
    and put back when the block ends, even after an error.
    """
    swaps: list[tuple[Callable[..., Any], Callable[..., Any]]] = []
    for fn in fns:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or name is None:
            raise LabCheckError(f"expected one of your functions, got {fn!r}")
        ref = reference(name)
        if fn is ref:
            raise LabCheckError(f"{name} is minickpt's own function, not yours: define "
                                f"{name} in the task's cell (and run that cell)")
        swaps.append((ref, fn))
    patched: list[tuple[Any, str, Any]] = []
    try:
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "minickpt" or mod_name.startswith("minickpt.")):
                continue
            for attr, value in list(vars(mod).items()):
                for ref, fn in swaps:
                    if value is ref:
                        patched.append((mod, attr, value))
                        setattr(mod, attr, fn)
        yield
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)


@contextlib.contextmanager
def standing_in(**stand_ins: Callable[..., Any]) -> Iterator[None]:
    """Trivial stand-ins (not implementations) for task functions, by name, for the block: a
    test of one task that runs minickpt uses them for *later* tasks, so that it judges that
    task alone. Under the grader, on the graded build, minickpt holds none of the lab's tasks
    and calls the student's function wherever it needs one; there it calls these instead (a
    namespace registered with ``minickpt._graded``: no module is patched). On the full
    library minickpt has its own, and this changes nothing."""
    for name in stand_ins:
        reference(name)  # a name no task has fails here
    graded = sys.modules.get("minickpt._graded")
    if graded is None:
        yield
        return
    ns = {}
    for name, fn in stand_ins.items():
        def standing_in(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            return _fn(*args, **kwargs)

        standing_in.__name__ = standing_in.__qualname__ = name
        standing_in._minickpt_stand_in = True  # type: ignore[attr-defined]
        ns[name] = standing_in
    graded.register(ns)
    try:
        yield
    finally:
        graded.NAMESPACES[:] = [n for n in graded.NAMESPACES if n is not ns]


def graded_build() -> bool:
    """Whether this process runs the graded build of minickpt (``autograder.graded_build``):
    the graded lab's tasks are plug points there, with no implementation behind them."""
    import importlib.util

    return importlib.util.find_spec("minickpt._graded") is not None


def own_task_functions(lab: str) -> list[Callable[..., Any]]:
    """The student's functions for every task of lab ``lab`` (``"3"``) that the notebook defines:
    on the graded build a worker process needs them all (minickpt calls the student's other
    tasks there, not its own), not only the task under test."""
    main = sys.modules.get("__main__")
    graded = sys.modules.get("minickpt._graded")
    out = []
    for tid, fns in reference_functions().items():
        if tid.split(".")[0] != lab:
            continue
        for ref in fns:
            fn = getattr(main, ref.__name__, None)
            if callable(fn) and fn is not ref and getattr(fn, "__code__", None) is not None \
                    and not getattr(fn, "_minickpt_plug_point", False):
                out.append(fn)
                if graded is not None:  # they run there: a failing check says so
                    graded.ran(tid, ref.__name__)
    return out


def task_sources(fns: Sequence[Callable[..., Any]]) -> str:
    """The code that defines ``fns``: the whole notebook cell each comes from (so helpers
    defined beside it come too), or the function's own source for one defined in a file;
    under the judge, the code it gave the proxy (:mod:`.processes`)."""
    import linecache
    import os
    import textwrap

    parts: list[str] = []
    seen: set[str] = set()
    for fn in fns:
        given = given_source(fn)  # under the judge: the student's code the proxy stands for
        if given is not None:
            if given not in parts:
                parts.append(given)
            continue
        code = getattr(fn, "__code__", None)
        filename = getattr(code, "co_filename", "")
        if filename in seen:
            continue
        seen.add(filename)
        cell = linecache.getlines(filename)
        if cell and not os.path.exists(filename):  # a notebook cell (IPython keeps its text)
            parts.append("".join(cell))
        else:
            parts.append(textwrap.dedent(inspect.getsource(fn)))
    return "\n\n".join(parts)
