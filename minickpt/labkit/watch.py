"""The reference reached: during a task's tests, minickpt's own implementation of that task must
never run while the student's code runs, however the student's code reaches it (a default
argument ``_r=mc.restore.__dict__["resume"]``, a walrus, a module's ``__dict__``, a thread,
``importlib.reload``, a code object taken from it ...).

:class:`Watch` holds the reference functions of the task under test (``reference_functions()
[task]``) and wraps the student's callables: while one of them is on the stack of a thread (a
thread it starts included), a profile hook (``sys.setprofile`` / ``threading.setprofile``, on
only then) records every call of a watched code object, or of one compiled from the same
place in minickpt's files. The library's *other* functions are fine, and so is the reference
when no student code runs (a test comparing against it). The same watch runs in the kernel
(``autograder/referee.py`` makes one per test) and in every worker process the labs start
(:func:`worker`, :class:`Reports`): a worker writes each hit at once, into a pipe its parent
gave it, checked to be that pipe before each write (the process kills itself otherwise), so
what is written cannot be taken back; the parent fails the test on any byte in it and names
the task and the reference (``REACHED``, which the referee reads into the review column).

A worker also runs the student's cell in a namespace of its own, without the task's
reference under its name, so that a default argument or a walrus rebinds nothing of the
harness, and checks that minickpt's modules, functions and classes are what they were before
the cell ran (apart from ``plugged_in``'s swaps): the referee's rules, in the worker.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# at import, not in a function: the referee's private copy of the kit is not in sys.modules
# once loaded, so a relative import at run time would not find its modules
from .checks import LabCheckError
from .plugging import reference_functions

ENV_FD = "MINICKPT_WATCH_FD"
ENV_TASKS = "MINICKPT_WATCH_TASKS"
MARK = b"[minickpt-reached] "
CURRENT: list[str | None] = [None]
"""The task under test, set by the referee on its private copy of the kit (workers watch
that task); None outside the referee: the tasks of the functions given."""
REACHED: list[str] = []
"""What workers reported (``"reached minickpt's own resume (task 3.3)"``), for the referee."""

_setprofile, _getprofile, _settrace = sys.setprofile, sys.getprofile, sys.settrace
_thread_setprofile = threading.setprofile
_get_ident = threading.get_ident
_threading_file = threading.__file__
_start_thread = getattr(sys.modules.get("_thread"), "start_new_thread", None)
_bootstrap = threading.Thread._bootstrap_inner.__code__  # sets threading's profile hook
_getframe = sys._getframe


def _task_refs(tasks: Iterable[str]) -> dict[str, tuple[Callable[..., Any], ...]]:
    refs = reference_functions()
    return {t: refs[t] for t in tasks if t in refs}


class Watch:
    """Wraps the student's callables; records each call of a watched reference made while
    one runs (see the module doc). ``on_hit(text)`` hears of each hit once."""

    def __init__(self, refs: Mapping[str, Iterable[Callable[..., Any]]],
                 on_hit: Callable[[str], None] | None = None) -> None:
        codes: dict[Any, str] = {}
        places: dict[tuple[str, int], str] = {}
        for task, fns in refs.items():
            for fn in fns:
                code = getattr(fn, "__code__", None)
                if code is None:
                    continue
                what = f"reached minickpt's own {fn.__name__} (task {task})"
                codes[code] = what
                places[(code.co_filename, code.co_firstlineno)] = what
        self.hits: list[str] = []
        self.wrappers: set[int] = set()
        self._on_hit = on_hit
        depth: dict[int, int] = {}
        saved: dict[int, Any] = {}
        active = [0]
        self._own = [False]  # the watch's own setprofile calls (the audit hook allows them)
        own, hits = self._own, self.hits
        threading_hook: list[Any] = [None]

        def hit(what: str) -> None:
            if what not in hits:
                hits.append(what)
                if on_hit is not None:
                    on_hit(what)

        in_c: dict[int, Any] = {}   # the C function each thread is calling, as the watch saw
        lost: set[int] = set()      # threads whose watch an exception inside it dropped

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call":
                in_c[_get_ident()] = arg
            if not active[0]:  # a thread the student's code started, after the test
                own[0] = True
                try:
                    _setprofile(None)
                finally:
                    own[0] = False
                return
            if event == "call":
                code = frame.f_code
                what = codes.get(code) or places.get((code.co_filename, code.co_firstlineno))
                if what is not None:
                    hit(what)
            elif event == "c_call" and arg is _start_thread and \
                    (frame.f_code.co_filename != _threading_file
                     or threading.__dict__.get("_profile_hook") is not profile):
                hit("started a thread around the grader's watch (_thread, or "
                    "threading.setprofile changed)")

        def enter() -> None:
            me = _get_ident()
            d = depth.get(me, 0)
            depth[me] = d + 1
            active[0] += 1
            if d == 0:
                saved[me] = _getprofile()
                own[0] = True
                try:
                    if active[0] == 1:
                        threading_hook[0] = threading.__dict__.get("_profile_hook")
                        _thread_setprofile(profile)
                    _setprofile(profile)
                finally:
                    own[0] = False

        def leave(failed: bool = False) -> None:
            me = _get_ident()
            if me in lost and not failed:  # the call went on, unwatched, after an exception
                lost.discard(me)           # raised inside the watch (a signal handler's)
                hit("went on after the grader's watch was dropped (an exception raised "
                    "inside it, by a signal handler?)")
            elif failed:
                lost.discard(me)
            d = depth.get(me, 1) - 1
            active[0] -= 1
            if d:
                depth[me] = d
                return
            depth.pop(me, None)
            own[0] = True
            try:
                _setprofile(saved.pop(me, None))
                if active[0] == 0:
                    _thread_setprofile(threading_hook[0])
            finally:
                own[0] = False

        self.profile, self._enter, self._leave, self._active = profile, enter, leave, active
        self._in_c, self._lost = in_c, lost
        self._hit = hit

    def active(self) -> bool:
        """Some student code runs, in some thread."""
        return self._active[0] > 0

    def audit(self, event: str, args: tuple) -> str | None:
        """For an audit hook: a profile or trace function set (or removed) by anything but the
        watch while the student's code runs is a hit; the hook refuses it (raise)."""
        if (event == "sys.setprofile" or event == "sys.settrace") and not self._own[0] \
                and self._active[0]:
            me = _get_ident()
            calling = self._in_c.get(me)
            if event == "sys.setprofile" and _getprofile() is self.profile and \
                    calling is not _setprofile and calling is not _settrace and \
                    type(getattr(calling, "__self__", None)).__module__ != "_lsprof" and \
                    "ctypes" not in str(type(calling).__module__):
                self._lost.add(me)  # Python drops a profile function that raised: a signal
                return None         # handler's exception inside it (see leave)
            f = _getframe(1)
            while f is not None and f.f_code.co_name in ("audit", "_audit"):
                f = f.f_back  # the audit hooks calling this
            if event == "sys.setprofile" and f is not None and f.f_code is _bootstrap and \
                    threading.__dict__.get("_profile_hook") is self.profile:
                return None  # a thread started inside the student's call gets the watch
            what = f"called {event} while the grader watched the task"
            self._hit(what)
            return what
        return None

    def wrap(self, fn: Callable[..., Any], before: Callable[[], None] | None = None,
             after: Callable[[], None] | None = None) -> Callable[..., Any]:
        """``fn``, run under the watch (``__wrapped__`` is ``fn``; its name and doc are
        ``fn``'s, for :func:`~minickpt.labkit.plugged_in`)."""
        enter, leave = self._enter, self._leave

        def watched(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            enter()
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                leave(True)
                if after is not None:
                    after()
                raise
            leave()
            if after is not None:
                after()
            return result

        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(watched, attr, getattr(fn, attr))
            except (AttributeError, TypeError):
                pass
        watched.__wrapped__ = fn  # type: ignore[attr-defined]
        self.wrappers.add(id(watched))
        return watched


def without_references(ns: dict[str, Any], lab: str | None = None) -> dict[str, Any]:
    """``ns`` without any task's reference function (under any name), or only lab ``lab``'s
    tasks' (``"3"``: the kernel of lab 3 imports lab 1's ``flatten_with_names``, which a
    student's lab 3 code may call): a worker's namespace before the student's cell runs."""
    refs = {id(f) for tid, fns in reference_functions().items()
            if lab is None or tid.split(".")[0] == lab for f in fns}
    for k in [k for k, v in ns.items() if id(v) in refs]:
        del ns[k]
    return ns


def watched_tasks(fns: Iterable[Any]) -> list[str]:
    """The tasks a worker watches: the referee's task under test, or else the tasks of
    ``fns`` (by name)."""
    if CURRENT[0] is not None:
        return [CURRENT[0]]
    names = {getattr(inspect_unwrap(f), "__name__", None) for f in fns}
    return [t for t, refs in reference_functions().items()
            if any(r.__name__ in names for r in refs)]


def inspect_unwrap(fn: Any) -> Any:
    import inspect

    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def is_reference(fn: Any) -> str | None:
    """Under the referee, ``fn`` (unwrapped) being a reference function of the task under
    test, handed to a worker as the student's: what a worker would run is minickpt's own
    code. Returns the hit's text (also in :data:`REACHED`), or None."""
    if CURRENT[0] is None:
        return None
    fn = inspect_unwrap(fn)
    for task, refs in _task_refs([CURRENT[0]]).items():
        for r in refs:
            if fn is r or getattr(fn, "__code__", None) is r.__code__:
                what = f"reached minickpt's own {r.__name__} (task {task})"
                REACHED.append(what)
                return what
    return None


class Reports:
    """The parent's end of the workers' channel: a pipe whose write end each worker inherits
    (``env()``, ``pass_fds``); :meth:`check` (after the workers ended) raises
    :class:`~minickpt.labkit.LabCheckError` naming what any of them reached."""

    def __init__(self, fns: Iterable[Any]) -> None:
        fns = list(fns)
        for fn in fns:
            what = is_reference(fn)
            if what is not None:
                raise LabCheckError(f"the function given to the worker {what}: minickpt's "
                                    "own implementation of the task under test is not yours, "
                                    "so this test does not count")
        self.tasks = watched_tasks(fns)
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self._w,)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**(base or {}), ENV_FD: str(self._w), ENV_TASKS: ",".join(self.tasks)}

    def read(self) -> list[str]:
        data = b""
        while True:
            try:
                chunk = os.read(self._r, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
            if len(data) > 1 << 20:
                break
        found = [line[len(MARK):].decode("utf-8", "replace") for line in data.split(b"\n")
                 if line.startswith(MARK)]
        if data and not found:
            found = ["wrote into the grader's report channel"]
        return list(dict.fromkeys(found))

    def check(self) -> None:
        found = self.read()
        self.close()
        if found:
            REACHED.extend(found)
            raise LabCheckError(f"while your code ran in the worker process it {found[0]}: "
                                "minickpt's own implementation of the task under test must "
                                "not run inside yours, so this test does not count")

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    def __enter__(self) -> Reports:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.check()
        else:
            self.close()


# ---------------------------------------------------------------------------------------
# the worker's side
# ---------------------------------------------------------------------------------------
def _snapshot() -> tuple[list, list, list]:
    """minickpt's module attributes (callables, classes, modules), its functions' code and
    defaults and its classes' methods, as they are now."""
    import types

    mods, funcs, classes = [], [], []
    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType) or not (name == "minickpt"
                                                         or name.startswith("minickpt.")):
            continue
        d = vars(mod)
        items = {k: v for k, v in d.items() if callable(v) or isinstance(v, types.ModuleType)}
        mods.append((name, d, items))
        for v in items.values():
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, types.FunctionType) and str(v.__module__).startswith("minickpt"):
                funcs.append((v, v.__code__, v.__defaults__, v.__kwdefaults__))
            elif isinstance(v, type) and str(v.__module__).startswith("minickpt"):
                cd = vars(v)
                classes.append((v, cd, {k: a for k, a in cd.items() if callable(a)
                                        or isinstance(a, (property, staticmethod, classmethod))}))
    return mods, funcs, classes


class WorkerWatch:
    """What a worker process runs the student's code under (see :func:`worker`)."""

    def __init__(self, fd: int | None, tasks: list[str]) -> None:
        _write, _fstat, _kill, _getpid = os.write, os.fstat, os.kill, os.getpid
        ident = None
        if fd is not None:
            try:
                st = _fstat(fd)
                ident = (st.st_dev, st.st_ino)
            except OSError:
                fd = None

        def report(what: str) -> None:
            if fd is None:
                return
            try:
                st = _fstat(fd)
                if (st.st_dev, st.st_ino) != ident:
                    raise OSError("not the grader's pipe")
                _write(fd, MARK + what.encode("utf-8", "replace")[:500] + b"\n")
            except OSError:  # closed, replaced: nothing may go unreported
                _kill(_getpid(), 9)

        self._report = report
        self.refs = _task_refs(tasks)
        self.watch = Watch(self.refs, on_hit=report)
        self._snap: tuple[list, list, list] | None = None
        ref_ids = {id(f) for fns in self.refs.values() for f in fns}
        self._ref_ids = ref_ids
        watch = self.watch

        def audit(event: str, args: tuple) -> None:
            if event == "sys.addaudithook":
                report("added an audit hook in the worker")
                raise RuntimeError("the grader allows no audit hooks")
            if watch.audit(event, args) is not None:
                raise RuntimeError("the grader's watch allows no profile or trace function "
                                   "while your code runs")

        sys.addaudithook(audit)

    def namespace(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """``base`` without the watched references (under any name) and without dunders but
        ``__name__``: the namespace the student's cell runs in. Takes the snapshot the later
        checks compare with (every module of minickpt is imported by now)."""
        ns = {k: v for k, v in base.items()
              if id(v) not in self._ref_ids and (not k.startswith("__") or k in
                                                 ("__name__", "__builtins__"))}
        ns.setdefault("__name__", "lab_student")
        self._snap = _snapshot()
        try:  # the graded build: its plug points call the student's functions defined here
            from minickpt import _graded  # type: ignore[attr-defined]
        except ImportError:
            pass
        else:
            _graded.register(ns)
        return ns

    def unchanged(self) -> None:
        """Report what of minickpt changed since :meth:`namespace` (plugged_in's swaps to the
        watch's wrappers aside)."""
        if self._snap is None:
            return
        allowed = self.watch.wrappers
        mods, funcs, classes = self._snap
        for name, d, items in mods:
            for k, v in items.items():
                now = d.get(k)
                if now is not v and id(now) not in allowed:
                    self._report(f"changed {name}.{k}")
                    return
        for f, code, defaults, kw in funcs:
            if f.__code__ is not code or f.__defaults__ is not defaults or \
                    f.__kwdefaults__ is not kw:
                self._report(f"changed {f.__module__}.{f.__qualname__}.__code__")
                return
        for cls, d, items in classes:
            for k, v in items.items():
                if d.get(k) is not v:
                    self._report(f"changed {cls.__module__}.{cls.__qualname__}.{k}")
                    return

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The student's ``fn`` under the watch, minickpt checked before and after each call."""
        return self.watch.wrap(fn, before=self.unchanged, after=self.unchanged)

    def test_namespace(self, mine: Mapping[str, Any], harness: Mapping[str, Any],
                       task_names: Iterable[str] = ()) -> dict[str, Any]:
        """The student's names, each callable of theirs watched, then the harness's names
        (as they were before the cell ran) on top: a test body's namespace."""
        import types

        names = set(task_names)
        out: dict[str, Any] = {}
        for k, v in mine.items():
            if harness.get(k, _NONE) is v:
                continue
            if callable(v) and not isinstance(v, types.ModuleType) and \
                    (not isinstance(v, type) or k in names):
                v = self.wrap(v)
            out[k] = v
        out.update((k, v) for k, v in harness.items() if id(v) not in self._ref_ids)
        self.unchanged()
        return out


_NONE = object()
_WORKER: list[WorkerWatch] = []


def worker() -> WorkerWatch:
    """In a worker process, before the student's code: the watch its parent asked for
    (:class:`Reports` sets the environment), its audit hook installed. Without a parent's
    channel (a student's own run), the same rules, with nothing to report to."""
    if _WORKER:
        return _WORKER[0]
    fd = os.environ.get(ENV_FD)
    tasks = [t for t in os.environ.get(ENV_TASKS, "").split(",") if t]
    w = WorkerWatch(int(fd) if fd and fd.isdigit() else None, tasks)
    _WORKER.append(w)
    return w
