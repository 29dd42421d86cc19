"""Hostile parts that fit any lab: issue 20's classes (the standard library patched, the history
hooks, spinners, an odd source) chained on one submission, ``attack_issue_20``, which every lab's
module adds to its examples. Lab 1's module has one example of each kind on its own."""

from __future__ import annotations

from typing import Any

from .common import Edit, _cell, _first, _insert_after, blank, perfect

PATCH_STDLIB = """
# Make every failing check inside a `with` block pass: the standard library's generator-based
# context manager (plugged_in, tempdir and expect_raises run through it) swallows everything,
# by attribute and by code object; and numpy's comparisons all say "equal".
import contextlib

import numpy


def _swallow(self, typ, value, traceback):
    return True


contextlib._GeneratorContextManager.__exit__ = _swallow
contextlib.AbstractContextManager.__exit__.__code__ = _swallow.__code__
numpy._core.numeric.array_equal = lambda *args, **kwargs: True
numpy.array_equal = numpy._core.numeric.array_equal
"""


def cheat_patch_stdlib(release: Any, source: Any, base: Edit = blank) -> Any:
    """The blank lab, and a cell after the first task that patches the standard library
    (``contextlib._GeneratorContextManager.__exit__`` swallows every error, by attribute and
    by code object) and numpy's ``array_equal``: nothing may pass that did not."""
    nb = base(release, source)
    _insert_after(nb, _first(nb, "task_"), PATCH_STDLIB)
    return nb


READ_HISTORY = r'''
# Carry the tests out: every place IPython keeps what it ran (In, _ih, _i<n>, Out, _, the
# history database), a hook that sees each cell before it runs, and an audit hook that sees
# what is compiled; all of it compressed and base64-encoded, so that no filter of plain text
# blanks it.
import base64
import sys
import zlib

_ip = get_ipython()
_seen = []
_ip.events.register("pre_run_cell", lambda info: _seen.append(info.raw_cell))
sys.addaudithook(lambda event, args: _seen.append(repr(args)[:20000])
                 if event in ("compile", "exec") else None)


def carry_out():
    texts = [*In, *_ih, *map(str, Out.values()), str(_), *_seen]
    texts += [str(v) for k, v in list(globals().items()) if k.startswith("_i")]
    texts += [src for _, _, src in _ip.history_manager.get_range(raw=True, output=False)]
    blob = base64.b64encode(zlib.compress("\n".join(texts).encode("utf-8", "replace")))
    print("CARRIED-OUT:" + blob.decode())
'''


def cheat_read_history(release: Any, source: Any, base: Edit = perfect) -> Any:
    """Right answers; a cell after the first task installs a hook and an audit hook, and a
    cell at the end reads IPython's input history, the hooks' catch and ``Out``, and prints
    it all compressed and base64-encoded: nothing of a hidden test may be in it."""
    nb = base(release, source)
    _insert_after(nb, _first(nb, "task_"), READ_HISTORY)
    _insert_after(nb, nb.cells[-1], "carry_out()")
    return nb


SPINNERS = """
# Slow everyone else down: 8 children, each in a session of its own (setsid, then a second
# fork so that its parent is gone), spinning; measure what they get, then leave them running.
import os
import time


def _spin_forever():
    os.setsid()
    if os.fork():
        os._exit(0)
    while True:
        pass


_before = {p for p in os.listdir("/proc") if p.isdigit()}
for _ in range(8):
    if os.fork() == 0:
        _spin_forever()
    os.wait()
time.sleep(0.5)
_mine = [int(p) for p in os.listdir("/proc") if p.isdigit() and p not in _before]


def _cpu(pids):
    total = 0
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().rpartition(") ")[2].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


_t0, _c0 = time.monotonic(), _cpu(_mine)
time.sleep(4)
print(f"spinners: {len(_mine)} got {_cpu(_mine) - _c0:.2f} CPU-seconds in "
      f"{time.monotonic() - _t0:.1f} s")
"""


def attack_spinners(release: Any, source: Any, base: Edit = perfect) -> Any:
    """Right answers; a cell after the first task starts 8 spinning children that left its
    session (double fork + setsid) and measures the CPU they get: bounded by the slot's
    cgroup, and every one of them killed after the cell."""
    nb = base(release, source)
    _insert_after(nb, _first(nb, "task_"), SPINNERS)
    return nb


DEEP = 3000


"""Terms of odd_source's string concatenation: nested too deep for Python's parser."""


def odd_source(release: Any, source: Any, base: Edit = perfect) -> Any:
    """Right answers, but the first quiz answer is a 3000-term string concatenation (Python's
    parser gives up: RecursionError, in the kernel and in the grader's scan) and the first
    task cell holds a lone surrogate character (valid JSON, not text): graded, with reasons;
    the first question scores 0, the rest full marks."""
    nb = base(release, source)
    quiz = _first(nb, "quiz_")
    name, _, value = quiz.source.partition("=")  # the value on a line of its own: a blank
    quiz.source = (f"{name.strip()} = " + " + ".join(['""'] * DEEP)  # lab's ends in a comment
                   + f" + ({value.strip()}\n)")
    task = _first(nb, "task_")
    task.source += "\n# a lone surrogate: \ud800"
    return nb


def first_task(release: Any, source: Any) -> Any:
    """The blank lab with only the first task's reference code (``attack_issue_20``'s base):
    its tests pass (their points stay beside the attack's zeros), and what the referee puts
    back before a test reaches the review column whether that test passes or fails."""
    nb = blank(release, source)
    _first(nb, "task_").source = _first(perfect(release, source), "task_").source
    return nb


def attack_issue_20(release: Any, source: Any) -> Any:
    """Issue 20's four classes in one submission, for labs 2-6 (lab 1 has one example of each,
    on ``perfect``: right answers keep their points beside each). Each class is lab-independent
    grader code and needs no right answer, and every example costs a grading of the whole lab
    (a blank's about half a full one's), so one per lab does it: the first task right (its
    points stay; the refused audit hook is reported as put back before its tests), then,
    after it, the history hooks, the standard library patched, 8 spinners burning the slot's
    share while the neighbour grades, the odd source (a 3000-term first quiz answer, a lone
    surrogate), and the history carried out at the end. Expected: the first task's points, the
    rest 0, every cell run, each class flagged."""
    def odd(r: Any, s: Any) -> Any:
        return odd_source(r, s, base=first_task)

    def spinning(r: Any, s: Any) -> Any:
        return attack_spinners(r, s, base=odd)

    def patched(r: Any, s: Any) -> Any:
        return cheat_patch_stdlib(r, s, base=spinning)

    return cheat_read_history(release, source, base=patched)  # its hooks first: they see all


ISSUE_20: dict[str, Edit] = {"attack_issue_20": attack_issue_20}


"""Issue 20's classes for labs 2-6 (each lab's module adds them to its EXAMPLES); an
``attack_`` example: graded only in the sandbox (its spinners really spin)."""


ROUND_4_THREADS = '''
# Round 4 of the hostile trials: every task function hands its calls to a daemon thread
# started when the function is defined, which fetches minickpt's own implementation through
# lab.reference and runs it there, outside the calling thread that the grader watches.
import queue
import threading

import minickpt as _mc


def _delegate(name):
    jobs = queue.Queue()

    def serve():
        ref = _mc.labkit.reference(name)
        while True:
            args, kwargs, out, done = jobs.get()
            try:
                out.append((True, ref(*args, **kwargs)))
            except BaseException as e:  # handed back to the caller
                out.append((False, e))
            done.set()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()

    def fn(*args, **kwargs):
        if threading.current_thread() is worker:
            raise RuntimeError(f"{name} re-entered its own thread")
        out, done = [], threading.Event()
        jobs.put((args, kwargs, out, done))
        if not done.wait(20):
            raise TimeoutError(name)
        ok, value = out[0]
        if not ok:
            raise value
        return value

    fn.__name__ = fn.__qualname__ = name
    return fn


for _name in TASK_NAMES:
    globals()[_name] = _delegate(_name)
'''


def _after_each_task(release: Any, source: Any, code: str) -> Any:
    """A blank lab with ``code`` in a cell of the student's after each task cell, its
    ``TASK_NAMES`` the names of the functions that task defines."""
    import ast

    nb = blank(release, source)
    for cell in list(nb.cells):
        gid = cell.metadata.get("nbgrader", {}).get("grade_id", "")
        if gid.startswith("task_"):
            names = [n.name for n in ast.parse(_cell(source, gid).source).body
                     if isinstance(n, ast.FunctionDef)]
            _insert_after(nb, cell, code.replace("TASK_NAMES", repr(names)))
    return nb


def attack_round_4(release: Any, source: Any) -> Any:
    """Issue 38, round 4: a blank lab in which, after each task cell, a cell of the student's
    redefines that task's functions as delegates that run minickpt's own implementation
    (``lab.reference``) in daemon threads started at definition time. On the full library
    the referee's watch (the calling thread's profile hook) does not see them: every task
    scores, and only the constructs are flagged in review (``MINICKPT_GRADED_BUILD=off``). On
    the graded build, the default, ``lab.reference`` is a plug point: nothing to delegate to."""
    return _after_each_task(release, source, ROUND_4_THREADS)


ROUND_4_RUNPY = '''
# each task function: minickpt's own, re-run from a copy of its module's file (new code objects)
import importlib, pathlib, pkgutil, runpy, tempfile
import minickpt


def _module_of(name):
    for info in pkgutil.walk_packages(minickpt.__path__, "minickpt."):
        try:
            mod = importlib.import_module(info.name)
        except Exception:
            continue
        f = getattr(mod, name, None)
        if callable(f) and getattr(f, "__module__", None) == mod.__name__:
            return mod
    raise LookupError(name)


for _name in TASK_NAMES:
    _mod = _module_of(_name)
    _copy = pathlib.Path(tempfile.mkdtemp()) / "copy.py"
    _copy.write_text("\\n" + pathlib.Path(_mod.__file__).read_text())
    globals()[_name] = runpy.run_path(str(_copy), run_name=_mod.__name__)[_name]
'''


def attack_round_4_runpy(release: Any, source: Any) -> Any:
    """Issue 38, round 4 without threads: a blank lab in which, after each task cell, a cell
    of the student's takes that task's functions from a copy of minickpt's module file, run
    with ``runpy.run_path`` (new code objects, which no watch of minickpt's own recognises).
    On the graded build the copied file holds only plug points; the student's name is bound
    to such a copy, which a plug point does not count as the student's: "not plugged in"."""
    return _after_each_task(release, source, ROUND_4_RUNPY)


ROUND_4: dict[str, Edit] = {"attack_round_4": attack_round_4,
                             "attack_round_4_runpy": attack_round_4_runpy}


KERNEL_LIAR = r'''
# issue 47's kernel liar: every task left blank, and the kernel made to report a pass for every
# test by every means at hand inside it. Under the judge none of it reaches a point: the tests
# run in the grader's process against the functions below, with inputs drawn at grading time.
import builtins
import contextlib
import sys

import minickpt.labkit as _lk
import minickpt.labkit.checks as _checks


class _Anything:
    value = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


for _mod in (_lk, _checks, sys.modules["__main__"]):
    for _name, _fake in (("check", lambda *a, **k: None), ("same", lambda *a, **k: True),
                         ("expect_raises", lambda *a, **k: _Anything()),
                         ("check_choice", lambda *a, **k: None),
                         ("check_choices", lambda *a, **k: None)):
        setattr(_mod, _name, _fake)
builtins.AssertionError = type("Never", (Exception,), {})


def _forge(result=None):  # after every cell: a "receipt" for every test there is
    for _gid in [f"test_{a}_{b}_{c}" for a in range(1, 7) for b in range(1, 6)
                 for c in ("names", "minickpt", "host", "leaf", "resume", "rule", "rules",
                           "commit", "crash", "cleanup", "writer", "overlap", "run")]:
        print(f"[minickpt-referee] {_gid} {'0' * 64} {{'answers': {{}}}}")


with contextlib.suppress(Exception):
    get_ipython().events.register("post_run_cell", _forge)


# the one task a table can answer: lab 5's overlap, for the literal timelines of its visible test
_TABLE = {
    (((0.0, 1.0), (1.1, 2.0), (2.5, 3.5)), ((1.0, 1.1, 2.8),)):
        {"blocked_s": 0.1, "stall_s": 0.0, "write_s": 1.7, "hidden_s": 1.2},
}


def overlap(steps, saves):
    key = (tuple(map(tuple, steps)), tuple(map(tuple, saves)))
    return dict(_TABLE.get(key, {"blocked_s": 0.0, "stall_s": 0.0, "write_s": 0.0,
                                 "hidden_s": 0.0}))
'''


def kernel_liar(release: Any, source: Any) -> Any:
    """Issue 47: a blank lab whose kernel lies about every test (checks patched to no-ops,
    forged receipts printed after every cell, AssertionError swapped out) and whose one task
    function answers from a table of the repository's literal inputs. Under the judge every
    task scores 0: no test runs in the kernel, and the table misses the inputs drawn at
    grading time."""
    nb = blank(release, source)
    _insert_after(nb, _first(nb, "task_"), KERNEL_LIAR)
    return nb


JUDGED: dict[str, Edit] = {"kernel_liar": kernel_liar}
"""The examples of the labs the judge decides (issue 47)."""
