"""The graded build of minickpt: the library with one lab's task implementations absent.

A graded kernel imports this copy instead of minickpt (the sandbox binds it where the
kernel's environment imports minickpt from), so no thread, default argument, copy of a
module file, compiled cache or worker process the student's code starts can reach an
implementation of the lab's tasks: the bytes are not there. Every function whose docstring
starts ``Task N.Y`` (lab N) becomes a plug point with the same name and docstring that calls
the student's function of that name (from the notebook's ``__main__``, or a namespace a lab's
worker process registers) and, when there is none, raises ``NotImplementedError("Task N.Y:
... is not plugged in")``. The rest of the library (other labs' tasks included, which this
lab does not grade) is copied unchanged. Built from the same source, once per grading run.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

TASK_DOC = re.compile(r"Task (\d+)\.(\d+)\b")

GRADED_MODULE = '''"""Plug points of the graded build (written by autograder.graded_build; not in the library)."""

import sys

LAB = {lab}
NAMESPACES: list = []
"""Namespaces a lab's worker process registers: where the student's functions live there."""


def register(namespace: dict) -> None:
    NAMESPACES.append(namespace)


def plugged(task: str, name: str):
    """The student's function ``name`` for ``task``: from a registered namespace, else the
    notebook's ``__main__``; a plug point itself (nothing defined) is not one."""
    main = sys.modules.get("__main__")
    for ns in [*reversed(NAMESPACES), getattr(main, "__dict__", {{}})]:
        fn = ns.get(name)
        if callable(fn) and not getattr(fn, "_minickpt_plug_point", False):
            return fn
    raise NotImplementedError(
        f"Task {{task}}: {{name}} is not plugged in. This is the graded build of minickpt: it "
        f"holds no implementation of lab {{LAB}}'s tasks, so minickpt calls yours: define "
        f"{{name}} in task {{task}}'s cell and run that cell")


CALLED: list = []
"""(test, task, name): the student's functions minickpt called while a test ran (``test`` its
grade id); a failing check of that test names those of other tasks (minickpt.labkit.checks)."""


def current_test():
    """The grade id of the test cell running in this thread (``test_2_1_minickpt``), from the
    name the grader compiles it under; None outside one."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<test_") and name.endswith(">"):
            return name[1:-1]
        f = f.f_back
    return None


def ran(task: str, name: str) -> None:
    """Note that the test running now ran the student's ``name`` (task ``task``)."""
    entry = (current_test(), task, name)
    if entry[0] is not None and entry not in CALLED:
        CALLED.append(entry)


def plugged_call(task: str, name: str, args: tuple, kwargs: dict):
    """Call the student's ``name`` for ``task``; what it raises says that this test ran it,
    the same exception (its type, and its message after that line), so that a test of one
    task that fails in another of the student's tasks says which."""
    fn = plugged(task, name)
    if getattr(fn, "_minickpt_stand_in", False):  # a test's stand-in (labkit.standing_in)
        return fn(*args, **kwargs)
    ran(task, name)
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        _say_whose(e, task, name)
        raise


def _say_whose(e: BaseException, task: str, name: str) -> None:
    if getattr(e, "_minickpt_whose", None):  # raised in a task that one of theirs called
        return
    try:
        e._minickpt_whose = task
    except AttributeError:
        return
    said = f"this test runs your Task {{task}} {{name}}, which raised {{type(e).__name__}}: "
    if isinstance(e, OSError) and e.strerror is not None:
        e.strerror = said + str(e.strerror)
    elif len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (said + e.args[0],)
    elif not e.args:
        e.args = (said.rstrip(": "),)
'''


def lab_number(lab: str) -> int:
    """``"lab05_async"`` → 5."""
    m = re.match(r"lab(\d+)_", lab)
    if not m:
        raise ValueError(f"not a lab name: {lab!r} (expected labNN_name)")
    return int(m.group(1))


def stub_module(source: str, lab: int) -> tuple[str, list[str]]:
    """``source`` with every module-level function of a lab-``lab`` task replaced by its plug
    point; returns (new source, the task IDs replaced, as ``"5.2 start_in_background"``)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    done: list[str] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        m = TASK_DOC.match((doc or "").lstrip())
        if not m or int(m.group(1)) != lab:
            continue
        task = f"{m.group(1)}.{m.group(2)}"
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        stub = (f"def {node.name}(*args, **kwargs):\n"
                f"    {ast.unparse(ast.Constant(doc))}\n"
                f"    from minickpt._graded import plugged_call\n"
                f"    return plugged_call({task!r}, {node.name!r}, args, kwargs)\n\n\n"
                f"{node.name}._minickpt_plug_point = True\n")
        edits.append((first, node.end_lineno or node.lineno, stub))
        done.append(f"{task} {node.name}")
    for first, last, stub in sorted(edits, reverse=True):
        lines[first:last] = [stub]
    return "".join(lines), done


def holds_tasks(package: Path, lab: str) -> bool:
    """Whether ``package`` (minickpt's folder) has a function of a task of ``lab``."""
    try:
        n = lab_number(lab)
    except ValueError:
        return False
    return any(stub_module(src.read_text(encoding="utf-8"), n)[1]
               for src in sorted(package.rglob("*.py")) if "__pycache__" not in src.parts)


def build_graded(lab: str, package: Path, dest: Path) -> tuple[Path, list[str]]:
    """The graded build of ``package`` (minickpt's folder) for ``lab``, at ``dest/minickpt``
    (made afresh): the package's ``.py`` files, the lab's tasks stubbed, and no compiled
    cache. Returns (that folder, the tasks replaced)."""
    n = lab_number(lab)
    out = dest / "minickpt"
    if out.exists():
        shutil.rmtree(out)
    replaced: list[str] = []
    for src in sorted(package.rglob("*")):
        rel = src.relative_to(package)
        if "__pycache__" in rel.parts or src.suffix in (".pyc", ".pyo"):
            continue
        target = out / rel
        if src.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".py":
            text, done = stub_module(src.read_text(encoding="utf-8"), n)
            replaced += done
            target.write_text(text, encoding="utf-8")
        else:
            shutil.copyfile(src, target)
    (out / "_graded.py").write_text(GRADED_MODULE.format(lab=n), encoding="utf-8")
    if not replaced:
        raise ValueError(f"{lab}: no function of {package} is a task of lab {n} (docstrings "
                         f"'Task {n}.Y ...')")
    return out, replaced

