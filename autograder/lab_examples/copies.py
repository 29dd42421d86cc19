"""Copies (issue 31): submissions that hand in minickpt's code, or another student's. Each
function takes the released lab and its source (nbformat notebooks, as ``make_examples`` passes
them) and returns the notebook a student hands in. :data:`EXPECTED` holds, per lab and example, the
expected points per task, total, status and the review flags (texts some flag must contain),
in the columns of ``autograder/examples/expected-<lab>.csv``.

* ``copy_renamed``: minickpt's code of every task, its locals renamed, its docstrings
  rewritten and the whole reformatted (``ast.unparse``): what issue 31 saw score 26/26 on lab 2,
  unflagged. Full marks, and flagged as similar to minickpt's own code and to ``copy_twin``.
* ``copy_twin``: a second student hands in ``copy_renamed``'s notebook, byte for byte.
* ``copy_with_padding``: ``copy_renamed``'s notebook with a long block of other code appended
  to every task cell and in a cell of its own (ten times the copied code: issue 38 saw it
  score 10 % and go unflagged, while the classmate's row named it).
* ``copy_with_dummies``: ``copy_renamed``'s notebook with a statement that does nothing after
  each statement (issue 38: 32 %).
* ``copy_in_added_cells``: the task cells left as released (stubs); minickpt's code of each
  task, disguised, pasted into a cell the student added after it (issue 38: never compared).
* ``natural_a`` / ``natural_b``: two students who both wrote the natural short answers of tasks
  2.1 and 2.4 (and nothing else): they share little code and are never flagged.
"""

from __future__ import annotations

import ast
import builtins
import copy
from typing import Any

from nbformat.v4 import new_code_cell

from .common import _cell, blank, perfect


class _Rename(ast.NodeTransformer):
    """Renames every name a function binds in its body (not its parameters, which the
    signature the release gives fixes) and rewrites its docstring."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        params = {a.arg for a in [*node.args.posonlyargs, *node.args.args,
                                  *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
                  if a is not None}
        bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Store)} | {
            h.name for h in ast.walk(node) if isinstance(h, ast.ExceptHandler) and h.name}
        self.names = {n: f"my_{n}" for n in sorted(bound - params - set(dir(builtins)))}
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body[0].value.value = f"My own {node.name}, written for the lab."
        self.generic_visit(node)
        return node

    def visit_Name(self, node: ast.Name) -> Any:
        node.id = self.names.get(node.id, node.id)
        return node

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> Any:
        if node.name:
            node.name = self.names.get(node.name, node.name)
        self.generic_visit(node)
        return node


def disguise(code: str) -> str:
    """minickpt's code with other local names, other docstrings and another layout."""
    tree = ast.parse(code)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            _Rename().visit(node)
    return ast.unparse(tree) + "\n"


def copy_renamed(release: Any, source: Any) -> Any:
    nb = perfect(release, source)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and str(meta.get("grade_id", "")).startswith("task_"):
            cell.source = disguise(cell.source)
    return nb


def copy_twin(release: Any, source: Any) -> Any:
    return copy.deepcopy(copy_renamed(release, source))


def _padding(n: int, seed: int) -> str:
    """``n`` functions of arithmetic and loops, each its own (a fixed seed: the build is
    byte-reproducible), that nothing calls."""
    import random

    rng = random.Random(seed)
    ops = ["+", "-", "*", "//", "%"]
    out = []
    for i in range(n):
        body = [f"def _helper_{seed}_{i}(values, scale={rng.randint(1, 9)}):", "    acc = 0"]
        for j in range(rng.randint(3, 7)):
            kind = rng.randrange(4)
            if kind == 0:
                body.append(f"    acc = acc {rng.choice(ops)} {rng.randint(1, 99)} * scale")
            elif kind == 1:
                body += [f"    for v{j} in values[:{rng.randint(2, 9)}]:",
                         f"        acc += v{j} {rng.choice(ops)} {rng.randint(1, 9)}"]
            elif kind == 2:
                body += [f"    if acc > {rng.randint(10, 999)}:",
                         f"        acc = acc % {rng.randint(2, 50)}", "    else:",
                         f"        acc = -acc {rng.choice(ops)} scale"]
            else:
                body.append(f"    acc = max(acc, len(values) {rng.choice(ops)} "
                            f"{rng.randint(1, 9)})")
        body.append("    return acc")
        out.append("\n".join(body))
    return "\n\n\n".join(out) + "\n"


def copy_with_padding(release: Any, source: Any) -> Any:
    nb = copy_renamed(release, source)
    for k, cell in enumerate(list(nb.cells)):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and str(meta.get("grade_id", "")).startswith("task_"):
            cell.source = cell.source.rstrip("\n") + "\n\n\n" + _padding(12, k)
    padding = new_code_cell(_padding(40, 999))
    padding["id"] = "my-padding"  # fixed: the build is byte-reproducible
    nb.cells.append(padding)
    return nb


class _Dummies(ast.NodeTransformer):
    """After each statement of every block, one that does nothing (in turn: ``pass``, a
    string, an unused assignment, a dead ``if False:``, an unused call of a builtin, and the
    function's first parameter assigned to itself)."""

    def __init__(self) -> None:
        self.n = 0
        self.param = ""

    def _pad(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for s in stmts:
            out.append(s)
            self.n += 1
            kinds = ["pass", "'checked'", f"_unused_{self.n} = {self.n}",
                     "if False:\n    raise RuntimeError('never')", "_ = abs(7)"]
            if self.param:
                kinds.append(f"{self.param} = {self.param}")
            out += ast.parse(kinds[self.n % len(kinds)]).body
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt) \
                    and not isinstance(node, ast.Module):
                setattr(node, name, self._pad(stmts))
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.param = args[0].arg if args else ""
        return self.generic_visit(node)


def copy_with_dummies(release: Any, source: Any) -> Any:
    nb = copy_renamed(release, source)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and str(meta.get("grade_id", "")).startswith("task_"):
            cell.source = ast.unparse(_Dummies().visit(ast.parse(cell.source))) + "\n"
    return nb


def copy_in_added_cells(release: Any, source: Any) -> Any:
    nb = perfect(release, source)
    for k in range(len(nb.cells) - 1, -1, -1):
        cell = nb.cells[k]
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and str(meta.get("grade_id", "")).startswith("task_"):
            pasted = new_code_cell("# my helpers\n" + disguise(cell.source))
            pasted["id"] = f"my-helpers-{k}"  # fixed: the build is byte-reproducible
            cell.source = _cell(release, meta["grade_id"]).source
            nb.cells.insert(k + 1, pasted)
    return nb


SHOULD_SAVE_A = '''
    if last_saved_step is None:
        return True
    return step > last_saved_step and (step % save_interval_steps == 0 or step in save_on_steps)
'''
SHOULD_SAVE_B = '''
    if last_saved_step is not None and step <= last_saved_step:
        return False
    return last_saved_step is None or step in save_on_steps or not step % save_interval_steps
'''
CLEANUP_A = '''
    if not fs.exists(root):
        return []
    gone = [n for n in sorted(fs.listdir(root)) if is_temporary(n)]
    for n in gone:
        fs.rmtree(os.path.join(root, n))
    if gone:
        fs.fsync_dir(root)
    return gone
'''
CLEANUP_B = '''
    try:
        entries = fs.listdir(root)
    except FileNotFoundError:
        return []
    removed = sorted(e for e in entries if is_temporary(e))
    for e in removed:
        fs.rmtree(f"{root}/{e}")
    if removed:
        fs.fsync_dir(root)
    return removed
'''


def _body(nb: Any, grade_id: str, body: str) -> None:
    """The task's stub (signature and docstring, as released) with ``body`` for its raise."""
    cell = _cell(nb, grade_id)
    head = cell.source.split("    # YOUR CODE HERE")[0].rstrip("\n")
    cell.source = head + "\n" + body.strip("\n") + "\n"


def natural_a(release: Any, source: Any) -> Any:
    nb = blank(release, source)
    _body(nb, "task_2_1", SHOULD_SAVE_A)
    _body(nb, "task_2_4", CLEANUP_A)
    return nb


def natural_b(release: Any, source: Any) -> Any:
    nb = blank(release, source)
    _body(nb, "task_2_1", SHOULD_SAVE_B)
    _body(nb, "task_2_4", CLEANUP_B)
    return nb


EXAMPLES = {"lab02_save_policy": {"copy_renamed": copy_renamed, "copy_twin": copy_twin,
                                  "copy_with_padding": copy_with_padding,
                                  "copy_with_dummies": copy_with_dummies,
                                  "copy_in_added_cells": copy_in_added_cells,
                                  "natural_a": natural_a, "natural_b": natural_b}}
EXPECTED = {"lab02_save_policy": [
    # lab, student, 2.1, 2.2, 2.3, 2.4, quiz, total, status, review (texts some flag contains)
    ["copy_renamed", "4", "4", "4", "4", "10", "26", "graded",
     "similar to minickpt's own code;similar to copy_twin's submission"],
    ["copy_twin", "4", "4", "4", "4", "10", "26", "graded",
     "similar to minickpt's own code;similar to copy_renamed's submission"],
    ["copy_with_padding", "4", "4", "4", "4", "10", "26", "graded",
     "similar to minickpt's own code: 100% of its code for tasks 2.1;"
     "similar to copy_renamed's submission: 100%"],
    ["copy_with_dummies", "4", "4", "4", "4", "10", "26", "graded",
     "similar to minickpt's own code: 100% of its code for tasks 2.1;"
     "similar to copy_renamed's submission: 100%"],
    ["copy_in_added_cells", "4", "4", "4", "4", "10", "26", "graded",
     "similar to minickpt's own code: 100% of its code for tasks 2.1;found in added cells"],
    ["natural_a", "4", "0", "0", "4", "0", "8", "graded", ""],
    ["natural_b", "4", "0", "0", "4", "0", "8", "graded", ""],
]}
"""The rows for ``autograder/examples/expected-lab02_save_policy.csv`` (its columns, with the
optional ``review`` column); a ``review`` of ``""`` means: no similarity flag at all."""
