"""A task's mutants: each reference function of the task (its ``"Task X.Y"`` docstring) with one
operator applied at one place, named by an id that survives unrelated edits.

The id is ``<task>:<function>:<operator>:<hash>``, the hash taken over the changed line before
and after (not over line numbers), so that ``equivalent.toml`` keeps naming the same mutant when
the function gains a line elsewhere, and stops matching when the line it explains changes.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import inspect
import json
import linecache
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import operators as ops

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"


@dataclass(frozen=True)
class Mutant:
    """One mutated reference function. ``source`` is the whole function, mutated."""

    id: str
    task: str
    function: str
    operator: str
    line: int  # in the function's source file
    before: str
    after: str
    source: str

    def describe(self) -> str:
        return f"{self.function} line {self.line}: `{self.before}` -> `{self.after}` ({self.operator})"


def lab_of(task: str) -> str:
    """The lab folder of a task: ``"1.4"`` -> ``"lab01_basics"``."""
    n = int(task.split(".")[0])
    found = sorted(p.name for p in SOLUTIONS.glob(f"lab{n:02d}_*") if p.is_dir())
    if len(found) != 1:
        raise SystemExit(f"no single lab folder for task {task} under {SOLUTIONS}: {found}")
    return found[0]


def notebook_cells(lab: str) -> dict[str, str]:
    """The source of each code cell of the lab's solutions notebook, by grade id."""
    nb = json.loads((SOLUTIONS / lab / f"{lab}.ipynb").read_text(encoding="utf-8"))
    out = {}
    for cell in nb["cells"]:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if cell["cell_type"] == "code" and gid:
            out[gid] = "".join(cell["source"])
    return out


def test_cells(task: str) -> list[str]:
    """The grade ids of a task's test cells (visible and hidden parts are in the same cell),
    in notebook order: ``test_1_4_*``."""
    prefix = "test_" + task.replace(".", "_") + "_"
    return [g for g in notebook_cells(lab_of(task)) if g.startswith(prefix)]


def task_functions(task: str) -> tuple[Callable[..., Any], ...]:
    """The task's reference functions, as ``minickpt.labkit.plugging`` finds them."""
    from minickpt.labkit.plugging import reference_functions

    return reference_functions().get(task, ())


def lab_functions(lab: str, recompile: bool = True) -> dict[str, Callable[..., Any]]:
    """Every task function of the lab, by name, recompiled (:func:`stand_in`): what
    ``run_tests`` plugs in beside the one mutant (``recompile=False``: the references)."""
    from minickpt.labkit.plugging import reference_functions

    n = str(int(lab[3:5]))
    return {f.__name__: stand_in(f) if recompile else f for tid, fns in reference_functions().items()
            if tid.split(".")[0] == n for f in fns}


def _changed(old: str, new: str) -> tuple[int, str, str]:
    """The first changed line (0-based in ``old``) and its text before and after."""
    a, b = old.splitlines(), new.splitlines()
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            before = " / ".join(s.strip() for s in a[i1:i2]) or "(nothing)"
            after = " / ".join(s.strip() for s in b[j1:j2]) or "(nothing)"
            return i1, before, after
    return 0, "", ""


def _body_start(source: str) -> int:
    """The 0-based line where the function's body starts after its docstring: before it, an
    operator can only touch the signature."""
    fn = ast.parse(source).body[0]
    body = fn.body[1:] if ast.get_docstring(fn) is not None and len(fn.body) > 1 else fn.body
    return body[0].lineno - 1


def mutants_of(task: str, fn: Callable[..., Any]) -> Iterator[Mutant]:
    """Every mutant of one reference function, in a fixed order (operators, then occurrences)."""
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    body = _body_start(source)
    seen: dict[str, int] = {}
    for name, op_cls in ops.operators():
        occurrence = 0
        while True:
            mutated = ops.mutate(source, op_cls(), occurrence)
            occurrence += 1
            if mutated is None:
                break
            if mutated == source:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SyntaxWarning)  # `x is "s"`: a mutant's own
                    compile(mutated, "<mutant>", "exec")
            except SyntaxError:
                continue  # the operator made code Python refuses: not a program, not a mutant
            i, before, after = _changed(source, mutated)
            if before.startswith(('"""', "'''")) or (before == after):
                continue
            if i < body and name.startswith(("ReplaceBinaryOperator", "ReplaceComparison")):
                continue  # an annotation (`int | None`) or the bare `*` of the signature
            digest = hashlib.sha1(f"{before}\n{after}".encode()).hexdigest()[:8]
            base = f"{task}:{fn.__name__}:{name}:{digest}"
            seen[base] = seen.get(base, 0) + 1
            mid = base if seen[base] == 1 else f"{base}~{seen[base]}"
            yield Mutant(mid, task, fn.__name__, name, first + i, before, after, mutated)


def task_mutants(task: str) -> list[Mutant]:
    """Every mutant of every reference function of the task."""
    return [m for fn in task_functions(task) for m in mutants_of(task, fn)]


def _define(source: str, name: str, filename: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    local: dict[str, Any] = {}
    # inspect.getsource must find it: labs 3, 4 and 6 run a task's source in worker processes
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # `x is "s"`: the mutant's own doing
        code = compile(source, filename, "exec")
    exec(code, reference.__globals__, local)
    fn = local[name]
    fn.__module__ = reference.__module__
    fn.__qualname__ = reference.__qualname__
    return fn


def compile_mutant(m: Mutant, reference: Callable[..., Any]) -> Callable[..., Any]:
    """The mutant as a function living in the reference's own module (its globals), under a
    file name of its own: nothing in the module is changed, and nothing that watches the
    reference's code objects mistakes the mutant for it."""
    return _define(m.source, m.function, f"<mutant {m.id}>", reference)


def source_of(fn: Callable[..., Any]) -> str:
    """A function's own source, dedented: what a drill's worker runs as the student's cell."""
    return textwrap.dedent(inspect.getsource(fn))


def stand_in(reference: Callable[..., Any]) -> Callable[..., Any]:
    """The reference recompiled from its own source, defined as a mutant is: what the harness
    plugs in for the lab's other task functions (and for the baseline run). A test cell refuses
    minickpt's own function object as "yours" (``plugged_in``), as it would a student's copy
    of the reference; a recompiled one is a student's correct answer, which is the point."""
    source = textwrap.dedent(inspect.getsource(reference))
    return _define(source, reference.__name__, f"<reference {reference.__name__}>", reference)


def task_digest(task: str) -> dict[str, str]:
    """What a task's report is current for: the reference functions' source, and the lab's
    setup cell with the task's test cells (visible, hidden and grader-check parts)."""
    src = "".join(inspect.getsource(f) for f in task_functions(task))
    cells = notebook_cells(lab_of(task))
    tests = cells.get("setup", "") + "".join(cells[g] for g in test_cells(task))
    return {"source_sha256": hashlib.sha256(src.encode()).hexdigest(),
            "tests_sha256": hashlib.sha256(tests.encode()).hexdigest()}
