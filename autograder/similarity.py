"""Copies: every code cell of every submission against minickpt's own code for each task of
the lab and against every other submission of the lab in the run.

The library *is* the reference and it is installed, so a student can paste its source, in a
task cell or in a cell of their own; two students can hand in one notebook, padded or with
dummy statements woven in. None of that shows in a grade, so the comparison is made on what
the code *does*, not how it reads:

* **Normalised tokens.** Each cell is parsed (:mod:`ast`). Statements that do nothing are
  dropped: docstrings and other bare constants, ``pass``, ``x = x``, dead ``if False:`` /
  ``while False:`` blocks, expressions without a call, calls of pure builtins (``len``,
  ``abs`` ...) and ``print``, and assignments to names the submission never reads (their
  value is kept when it calls something). What is left is written as the pre-order sequence of
  its node types: every identifier, literal and comment is gone (``a = b + 1`` and
  ``total = step + 7`` are the same tokens), so renaming, reformatting and rewording change
  nothing.
* **Winnowing per function** (Schleimer, Wilkerson & Aiken, SIGMOD 2003, the method of MOSS):
  each function (and each cell's code outside functions) is a unit of its own; the hashes of
  its k-grams of :data:`K` tokens are kept, and of every window of :data:`WINDOW` of them the
  least is its fingerprint. A k-gram never spans two units, so reordering functions or cells
  and moving code between cells change nothing; a shared run of ``K + WINDOW - 1`` tokens is
  always found.
* **Boilerplate.** What the released lab gives every student (its setup, open and test cells,
  each task's signature) is hashed the same way and removed from every party first, so that
  only what a student wrote counts.

**Scores are containment of the smaller side.** For two parties, the share of the smaller
one's fingerprints (the one with fewer) that the other holds anywhere: a copy scores 1.0
against its original however much the copier adds around it or between its statements, and
both parties get the same score, so both rows are flagged. minickpt is compared task by task:
its code for task X.Y (the functions whose docstrings start "Task X.Y") against the
submission's code in *all* its cells. A pair is flagged in the ``review`` column (``similar to
...``, with the score, the tokens shared and the tasks) when the score is at least
:data:`THRESHOLD` *and* at least :data:`MIN_TOKENS` normalised tokens are shared (for
minickpt: summed over the tasks that reach the threshold): two students who both wrote the
natural short answers of two tasks share well under that. The figures are in
tests/test_similarity.py and in docs/grading.md.

The flag is for a person to read, like every review flag: it never changes a grade.
``similarity-<lab>.html`` shows each flagged pair's cells side by side, the shared lines
highlighted; ``similarity-<lab>.csv`` lists every score of the run from :data:`LISTED` up.
"""

from __future__ import annotations

import ast
import hashlib
import html
import io
import re
import tokenize
from dataclasses import dataclass, field
from typing import Any

TASK_CELL = re.compile(r"^task_\d+_\d+$")
K = 12
"""Tokens in a k-gram. Smaller finds shorter shared runs, and more chance ones."""
WINDOW = 6
"""k-grams in a winnowing window: a shared run of ``K + WINDOW - 1`` tokens is always found."""
THRESHOLD = 0.80
"""The least share of the smaller side's fingerprints that the other holds, for a flag."""
MIN_TOKENS = 200
"""The least number of shared normalised tokens for a flag (a few functions, not a line)."""
LISTED = 0.30
"""similarity-<lab>.csv lists every score from this share up (what a threshold is set from)."""
MAX_CELL_CHARS = 100_000
"""What of one cell is compared (a longer cell is cut: the comparison stays bounded)."""
MAX_SUBMISSION_CHARS = 1_000_000
"""What of one submission is kept for comparing: task cells first, then its other cells from
the shortest up, so that a long cell of padding cannot push a pasted function out."""
MINICKPT = "_minickpt"
"""The party that stands for the library's own code: a name no student id can have (they
begin with a letter or a digit), so a student called ``minickpt`` is compared as a student."""
GIVEN = "_given"
"""The key of :func:`lab_tasks`' entry that holds the code the released lab gives every
student (its boilerplate), beside the task entries."""
SIMILAR = "similar to "
"""How every flag of this report begins."""
PEERS_NAMED = 3
"""Other submissions a flagged row names (the rest are counted; the report lists them)."""
ADDED = "added cells"
"""Where shared code that is in no task cell is said to be."""
PURE_CALLS = frozenset({"abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable",
                        "chr", "complex", "dict", "dir", "divmod", "float", "format",
                        "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass",
                        "len", "list", "max", "min", "oct", "ord", "pow", "print", "range",
                        "repr", "round", "set", "slice", "sorted", "str", "sum", "tuple",
                        "type", "vars", "zip"})
"""Calls that, as a statement of their own, change nothing a test can see (``print`` writes,
but what it writes is no part of a task)."""


# ---------------------------------------------------------------------------------------
# what is compared: a submission's code cells, the lab's given code and its tasks
# ---------------------------------------------------------------------------------------
def submission_code(cells: list[tuple[str, str]]) -> dict[str, str]:
    """What of a submission the similarity report compares (results.json's ``code``): every
    code cell the student wrote, ``(key, source)`` in notebook order, the key being its
    grade id or ``your cell N``. Quiz answers are left out (a literal each). Bounded: each
    cell to :data:`MAX_CELL_CHARS`, the whole to :data:`MAX_SUBMISSION_CHARS`, task cells
    first and then the other cells from the shortest up."""
    mine = [(k, s[:MAX_CELL_CHARS]) for k, s in cells if s.strip() and not k.startswith("quiz_")]
    order = sorted(range(len(mine)), key=lambda i: (not TASK_CELL.match(mine[i][0]),
                                                    len(mine[i][1]), i))
    kept, room = set(), MAX_SUBMISSION_CHARS
    for i in order:
        if len(mine[i][1]) <= room:
            kept.add(i)
            room -= len(mine[i][1])
    return {k: s for i, (k, s) in enumerate(mine) if i in kept}


def stub_of(source: str) -> str:
    """What the released lab's task cell holds: the source cell as the build's nbgrader
    preprocessor (:class:`autograder.preprocessors.TaskStubs`) releases it."""
    from nbformat.v4 import new_code_cell

    from .preprocessors import TaskStubs

    cell = new_code_cell(source)
    try:
        TaskStubs()._replace_solution_region(cell, "python")
    except RuntimeError:  # not a task cell the build would release: nothing is boilerplate
        return ""
    return str(cell.source)


def reference_of(source: str) -> str:
    """The source cell's code: minickpt's functions of the task (the markers dropped)."""
    return "\n".join(line for line in source.split("\n")
                     if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


def lab_tasks(lab: Any) -> dict[str, dict[str, str]]:
    """A lab (:class:`autograder.notebook.Lab`, its source) → what the report needs of it:
    task grade id → ``reference`` (minickpt's code of the task, which the build wrote into
    the source) and ``stub`` (what the release gives); and :data:`GIVEN` → ``code``, every
    other code cell the release gives (setup, open cells, the visible part of each test)."""
    from .notebook import split_hidden

    tasks: dict[str, dict[str, str]] = {}
    given = []
    for c in lab.cells:
        if c.kind != "code":
            continue
        if c.role == "solution" and TASK_CELL.match(c.grade_id):
            tasks[c.grade_id] = {"reference": reference_of(c.source), "stub": stub_of(c.source)}
        elif c.role in ("setup", "locked", "open"):
            given.append(c.source)
        elif c.role in ("test", "quiz"):
            given.append(split_hidden(c.source)[0])
    tasks[GIVEN] = {"code": "\n\n".join(given)}
    return tasks


# ---------------------------------------------------------------------------------------
# normalised tokens
# ---------------------------------------------------------------------------------------
def _parse(code: str) -> ast.Module | None:
    """A cell as a module; IPython's ``%magic`` and ``!shell`` lines blanked (same lines)."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in code.split("\n")]
    try:
        return ast.parse("\n".join(lines))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _is_pure(node: ast.AST, pure: frozenset[str] | set[str] = PURE_CALLS) -> bool:
    """An expression that, evaluated as a statement, does nothing: no call (but of a pure
    builtin, or of a function named in ``pure``), no await, no yield."""
    for n in ast.walk(node):
        if isinstance(n, (ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)):
            return False
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name)
                                            and n.func.id in pure):
            return False
    return True


def _noop_functions(trees: list[ast.Module]) -> set[str]:
    """The functions a party defines (at the top of a cell) whose body, once dead
    statements are dropped, does nothing: at most a ``return`` of a pure value. A call of
    one, as a statement, is dead too (a dummy ``_noop()`` after each statement)."""
    out: set[str] = set()
    for t in trees:
        for node in t.body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list and all(
                    isinstance(s, ast.Return) and (s.value is None or _is_pure(s.value))
                    for s in node.body):
                out.add(node.name)
    return out


def _constant_truth(test: ast.AST) -> bool | None:
    try:
        return bool(ast.literal_eval(test))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


class _Dead(ast.NodeTransformer):
    """Drops what does nothing (see the module doc). ``read``: every name the submission
    reads somewhere; an assignment to names none of which is read is dead."""

    def __init__(self, read: set[str], noops: set[str] | None = None) -> None:
        self.read = read
        self.pure = PURE_CALLS | (noops or set())
        self.dropped = 0

    def _body(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for s in stmts:
            r = self.visit(s)
            if r is not s:
                self.dropped += 1
            if r is None:
                continue
            out.extend(r if isinstance(r, list) else [r])
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and all(isinstance(s, ast.stmt) for s in stmts):
                setattr(node, name, self._body(stmts))
        for h in getattr(node, "handlers", []) or []:
            h.body = self._body(h.body)
        for c in getattr(node, "cases", []) or []:
            c.body = self._body(c.body)
        return node

    def visit_Pass(self, node: ast.Pass) -> None:
        return None

    def visit_Expr(self, node: ast.Expr) -> ast.AST | None:
        return None if _is_pure(node.value, self.pure) else node

    def visit_Assert(self, node: ast.Assert) -> ast.AST | None:
        return None if _constant_truth(node.test) is True else node  # assert True

    def visit_If(self, node: ast.If) -> Any:
        truth = _constant_truth(node.test)
        if truth is not None:
            return self._body(node.body if truth else node.orelse) or None
        self.generic_visit(node)
        if not node.body and not node.orelse and _is_pure(node.test, self.pure):
            return None
        return node

    def visit_While(self, node: ast.While) -> Any:
        if _constant_truth(node.test) is False:
            return self._body(node.orelse) or None
        return self.generic_visit(node)

    def visit_For(self, node: ast.For) -> Any:
        empty = isinstance(node.iter, (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Constant)) \
            and _constant_truth(node.iter) is False  # for _ in []: never runs
        if empty:
            return self._body(node.orelse) or None
        self.generic_visit(node)
        if not node.body and _is_pure(node.iter, self.pure):
            return node.orelse or None  # a loop that does nothing on a pure iterable
        return node

    def visit_Try(self, node: ast.Try) -> Any:
        self.generic_visit(node)
        if not node.body:  # nothing can raise: no handler runs
            return [*node.orelse, *node.finalbody] or None
        return node

    visit_TryStar = visit_Try

    def _targets_dead(self, targets: list[ast.expr]) -> bool:
        names = [n for t in targets for n in ast.walk(t)]
        return all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred, ast.expr_context))
                   for n in names) and not any(isinstance(n, ast.Name) and n.id in self.read
                                               for n in names)

    def _dead_value(self, node: ast.stmt, value: ast.expr | None) -> Any:
        if value is None or _is_pure(value, self.pure):
            return None
        return ast.copy_location(ast.Expr(value), node)

    def visit_Assign(self, node: ast.Assign) -> Any:
        if len(node.targets) == 1 and ast.dump(node.targets[0]).replace("Store", "Load") == \
                ast.dump(node.value):
            return None  # x = x, (a, b) = (a, b)
        if self._targets_dead(node.targets):
            return self._dead_value(node, node.value)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> Any:
        if self._targets_dead([node.target]):
            return self._dead_value(node, node.value)
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> Any:
        if isinstance(node.value, ast.Constant) and (
                (isinstance(node.op, (ast.Add, ast.Sub, ast.BitOr, ast.BitXor, ast.LShift,
                                      ast.RShift)) and node.value.value == 0 and
                 not isinstance(node.value.value, str))
                or (isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv, ast.Pow))
                    and node.value.value == 1 and not isinstance(node.value.value, str))):
            return None  # x += 0, x *= 1
        if self._targets_dead([node.target]):
            return self._dead_value(node, node.value)
        return node


@dataclass
class Unit:
    """A function (or a cell's code outside functions) as normalised tokens."""

    cell: str                        # the key of the cell it is in
    tokens: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)   # each token's line in its cell


def _emit(node: ast.AST, line: int, unit: Unit, units: list[Unit]) -> None:
    if isinstance(node, (ast.expr_context, ast.Load, ast.Store, ast.Del)):
        return
    line = getattr(node, "lineno", line)
    if isinstance(node, ast.Constant):
        unit.tokens.append(f"K{type(node.value).__name__}")
    else:
        unit.tokens.append(type(node).__name__)
    unit.lines.append(line)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and unit.tokens != [
            type(node).__name__]:
        inner = Unit(unit.cell)   # a function in a function or a class: a unit of its own
        units.append(inner)
        _emit(node, line, inner, units)
        return
    for child in ast.iter_child_nodes(node):
        _emit(child, line, unit, units)


def _lexical(code: str, cell: str) -> Unit:
    """A cell that does not parse: Python's tokens, names and literals normalised (a cell
    that cannot run earns nothing, but it is compared)."""
    unit = Unit(cell)
    try:
        for t in tokenize.generate_tokens(io.StringIO(code).readline):
            if t.type == tokenize.NAME:
                unit.tokens.append(t.string if t.string in _KEYWORDS else "Name")
            elif t.type in (tokenize.STRING, tokenize.NUMBER):
                unit.tokens.append("K")
            elif t.type == tokenize.OP:
                unit.tokens.append(t.string)
            else:
                continue
            unit.lines.append(t.start[0])
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return unit


_KEYWORDS = frozenset(__import__("keyword").kwlist)


def _read_names(trees: list[ast.Module]) -> set[str]:
    """Every name read anywhere (and every ``global``/``nonlocal`` one: read elsewhere)."""
    read: set[str] = set()
    for t in trees:
        for n in ast.walk(t):
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
                read.add(n.id)
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                read.update(n.names)
    return read


def units_of(code: dict[str, str]) -> list[Unit]:
    """A party's code (cell key → source) as units of normalised tokens (module doc)."""
    trees = {k: _parse(src[:MAX_CELL_CHARS]) for k, src in code.items()}
    parsed = {k: t for k, t in trees.items() if t is not None}
    try:
        for _ in range(3):  # an assignment read only by a dead one is dead the next time
            dead = _Dead(_read_names(list(parsed.values())),
                         _noop_functions(list(parsed.values())))
            parsed = {k: dead.visit(t) for k, t in parsed.items()}
            if not dead.dropped:
                break
    except RecursionError:
        parsed = {}
    units: list[Unit] = []
    for k in code:
        tree = parsed.get(k)
        if tree is None:
            units.append(_lexical(code[k][:MAX_CELL_CHARS], k))
            continue
        top = Unit(k)
        units.append(top)
        try:
            for stmt in tree.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    unit = Unit(k)
                    units.append(unit)
                    _emit(stmt, stmt.lineno, unit, units)
                else:
                    _emit(stmt, stmt.lineno, top, units)
        except RecursionError:
            units = [u for u in units if u.cell != k] + [_lexical(code[k][:MAX_CELL_CHARS], k)]
    return [u for u in units if u.tokens]


# ---------------------------------------------------------------------------------------
# fingerprints
# ---------------------------------------------------------------------------------------
def _kgrams(tokens: list[str]) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(" ".join(tokens[i:i + K]).encode(),
                                           digest_size=8).digest(), "big")
            for i in range(len(tokens) - K + 1)]


def winnow(hashes: list[int]) -> set[int]:
    """Schleimer et al.'s winnowing: the least hash of every window of :data:`WINDOW`
    consecutive ones (the rightmost when tied); all of them if there are fewer."""
    if len(hashes) <= WINDOW:
        return {min(hashes)} if hashes else set()
    picked, last = set(), -1
    for start in range(len(hashes) - WINDOW + 1):
        window = hashes[start:start + WINDOW]
        low = min(window)
        at = start + WINDOW - 1 - window[::-1].index(low)
        if at != last:
            picked.add(low)
            last = at
    return picked


@dataclass
class Party:
    """A submission, or minickpt's code of one task, fingerprinted."""

    name: str
    code: dict[str, str]
    units: list[tuple[Unit, list[int]]]          # each unit with its k-gram hashes
    prints: set[int]                             # winnowed fingerprints, boilerplate removed
    grams: set[int]                              # every k-gram hash, boilerplate removed
    _own: tuple[int, int] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.prints)

    def covered(self, other: Party, boiler: set[int]) -> tuple[dict[str, set[int]], int, int]:
        """The lines (cell key → line numbers) of this party's code that lie in a k-gram
        the other party holds too; how many tokens do; how many lie in any k-gram that is
        not boilerplate (the party's own code). ``other.grams`` holds no boilerplate."""
        lines: dict[str, set[int]] = {}
        shared = 0
        for unit, hashes in self.units:
            starts = [i for i, h in enumerate(hashes) if h in other.grams]
            if not starts:
                continue
            cell = lines.setdefault(unit.cell, set())
            a = b = starts[0]
            for i in starts:  # the union of the runs [i, i + K), merged: each token once
                if i > b:
                    cell.update(unit.lines[a:b])
                    shared += b - a
                    a = i
                b = i + K
            cell.update(unit.lines[a:b])
            shared += b - a
        return lines, shared, self.own(boiler)

    def own(self, boiler: set[int]) -> int:
        """How many tokens lie in a k-gram that is not boilerplate."""
        key = id(boiler)
        if self._own is None or self._own[0] != key:
            total = 0
            for _unit, hashes in self.units:
                end = -1
                for i, h in enumerate(hashes):
                    if h not in boiler:
                        total += i + K - max(i, end)
                        end = i + K
            self._own = (key, total)
        return self._own[1]


def party(name: str, code: dict[str, str], boiler: set[int]) -> Party:
    units = [(u, _kgrams(u.tokens)) for u in units_of(code)]
    prints = set().union(*(winnow(h) for _, h in units)) - boiler
    grams = {h for _, hs in units for h in hs} - boiler
    return Party(name, code, units, prints, grams)


def boilerplate(code: str) -> set[int]:
    """Every k-gram hash of the given code (a released lab's cells, a task's stub)."""
    return {h for u in units_of({"given": code}) for h in _kgrams(u.tokens)}


# ---------------------------------------------------------------------------------------
# scores
# ---------------------------------------------------------------------------------------
@dataclass
class Match:
    """What ``student`` and ``other`` share: the containment of the smaller side."""

    student: str
    other: str
    score: float = 0.0
    shared: int = 0                 # normalised tokens of the smaller side the other holds
    total: int = 0                  # normalised tokens of the smaller side
    tasks: dict[str, float] = field(default_factory=dict)   # task -> share
    where: list[str] = field(default_factory=list)           # tasks / ADDED holding it
    lines: dict[str, dict[str, set[int]]] = field(default_factory=dict)  # party -> cell -> lines
    prints: int = 0                 # fingerprints of the smaller side

    @property
    def flagged(self) -> bool:
        return self.score >= THRESHOLD and self.shared >= MIN_TOKENS

    def flag(self) -> str:
        where = ", ".join(self.where) or "-"
        if self.other == MINICKPT:
            tasks = ", ".join(_task_name(t) for t, s in sorted(self.tasks.items())
                              if s >= THRESHOLD) or "-"
            return (f"similar to minickpt's own code: {self.score:.0%} of its code for tasks "
                    f"{tasks} ({self.shared} tokens; found in {where}); see similarity report")
        return (f"similar to {self.other}'s submission: {self.score:.0%} of the smaller side's "
                f"code ({self.shared} tokens; tasks {where}); see similarity report")


def _task_name(key: str) -> str:
    return key.removeprefix("task_").replace("_", ".") if TASK_CELL.match(key) else ADDED


def _where(lines: dict[str, set[int]]) -> list[str]:
    names = {_task_name(k) for k, v in lines.items() if k and v}
    return sorted(n for n in names if n != ADDED) + ([ADDED] if ADDED in names else [])


def _contain(small: Party, big: Party) -> float:
    return len(small.prints & big.grams) / small.size if small.size else 0.0


def pair(a: Party, b: Party, boiler: set[int]) -> tuple[float, Match | None]:
    """The score of two parties; with it, when it is at least :data:`LISTED`, what they
    share (tokens of the smaller side, its size, the shared lines of both)."""
    small, big = (a, b) if (a.size, a.name) <= (b.size, b.name) else (b, a)
    score = _contain(small, big)
    if a.size == b.size:
        score = max(score, _contain(big, small))
    if score < LISTED:
        return score, None
    (lines_a, n_a, own_a), (lines_b, n_b, own_b) = a.covered(b, boiler), b.covered(a, boiler)
    shared, total = (n_a, own_a) if small is a else (n_b, own_b)
    return score, Match(a.name, b.name, score, shared, total, prints=small.size,
                        lines={a.name: lines_a, b.name: lines_b})


def compare(tasks: dict[str, dict[str, str]], students: dict[str, dict[str, str]]
            ) -> tuple[list[Match], dict[str, Party]]:
    """``tasks``: :func:`lab_tasks`' dict (task grade id → ``reference``, ``stub``; and
    :data:`GIVEN`); ``students``: student → cell key → code. Returns every match scored at
    least :data:`LISTED` (each student against minickpt, task by task, and against every
    other student; a pair's two matches have the same score), and the parties by name for
    the report (minickpt's as ``_minickpt/<task>``)."""
    given = boilerplate(tasks.get(GIVEN, {}).get("code", ""))
    task_ids = sorted(t for t in tasks if TASK_CELL.match(t))
    stubs = set().union(given, *(boilerplate(tasks[t].get("stub", "")) for t in task_ids))
    parties = {s: party(s, code, stubs) for s, code in sorted(students.items())}
    refs = {t: party(f"{MINICKPT}/{t}", {t: tasks[t]["reference"]}, stubs) for t in task_ids}
    out: list[Match] = []
    names = sorted(parties)
    for s in names:
        m, hits = Match(s, MINICKPT), 0.0
        for t, ref in refs.items():
            score, got = pair(parties[s], ref, stubs)
            m.tasks[t] = score
            if got is None or score < THRESHOLD:
                continue
            m.shared += got.shared
            m.total += got.total
            m.prints += got.prints
            hits += score * got.prints
            for who, lines in got.lines.items():
                mine = m.lines.setdefault(s if who == s else who, {})
                for cell, ls in lines.items():
                    mine.setdefault(cell, set()).update(ls)
        m.score = hits / m.prints if m.prints else max(m.tasks.values(), default=0.0)
        m.where = _where(m.lines.get(s, {}))
        if m.score >= LISTED:
            out.append(m)
    for i, s in enumerate(names):
        for o in names[i + 1:]:
            _, got = pair(parties[s], parties[o], stubs)
            if got is None:
                continue
            for a, b in ((s, o), (o, s)):
                out.append(Match(a, b, got.score, got.shared, got.total,
                                 {k: _cell_share(parties[a], got.lines[a], k)
                                  for k in parties[a].code if TASK_CELL.match(k)},
                                 _where(got.lines[a]), got.lines))
    parties.update((ref.name, ref) for ref in refs.values())
    return out, parties


def review_flags(matches: list[Match], student: str, peers: int = PEERS_NAMED) -> list[str]:
    """The review flags of ``student``'s row: minickpt's first, then the most similar other
    submissions, ``peers + 1`` flags in all, and how many more there are (the report lists
    them all)."""
    mine = sorted((m for m in matches if m.student == student and m.flagged),
                  key=lambda m: (m.other != MINICKPT, -m.score, m.other))
    named = mine[:peers + 1]
    rest = len(mine) - len(named)
    return [m.flag() for m in named] + (
        [f"{SIMILAR}{rest} more submission(s) as well; see similarity report"] if rest else [])


def _cell_share(p: Party, lines: dict[str, set[int]], key: str) -> float:
    """The share of a cell's lines (of those that hold compared code) that are shared."""
    mine = {ln for u, _ in p.units if u.cell == key for ln in u.lines}
    return len(lines.get(key, set()) & mine) / len(mine) if mine else 0.0


def report(lab: str, matches: list[Match], parties: dict[str, Party]) -> str:
    """The HTML page of a lab: every flagged pair, the cells of both sides that hold shared
    code, side by side, the shared lines highlighted (HTML-escaped)."""
    flagged = sorted((m for m in matches if m.flagged), key=lambda m: (-m.score, m.student))
    parts = [f"<!doctype html><meta charset='utf-8'><title>similarity, {html.escape(lab)}"
             "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
             "collapse;width:100%;table-layout:fixed}td{vertical-align:top;border:1px solid "
             "#ccc;padding:4px}pre{white-space:pre-wrap;font-size:12px;margin:0}"
             ".hl{background:#fbb}.hr{background:#bfb}</style>",
             f"<h1>Similarity of the code of every cell, {html.escape(lab)}</h1>",
             f"<p>Normalised tokens (identifiers, literals, comments and statements that do "
             f"nothing removed), winnowed per function (k={K}, window {WINDOW}); the released "
             f"lab's code removed. Score: the share of the smaller side's fingerprints that "
             f"the other holds. Flagged: a score of at least {THRESHOLD:.0%} with at least "
             f"{MIN_TOKENS} tokens shared (minickpt: task by task). A flag is for a person "
             f"to read; it changes no grade.</p>",
             f"<p>{len(flagged)} flagged pair(s).</p>"]
    for m in flagged:
        other = "minickpt" if m.other == MINICKPT else m.other
        parts.append(f"<h2>{html.escape(m.student)} ↔ {html.escape(other)}: {m.score:.0%} "
                     f"({m.shared} of {m.total} tokens)</h2><table>")
        left = parties[m.student]
        rights = ([parties[f"{MINICKPT}/{t}"] for t, s in sorted(m.tasks.items())
                   if s >= THRESHOLD] if m.other == MINICKPT else [parties[m.other]])
        cells_l = _shown(left, m.lines.get(left.name, {}), "hl")
        cells_r = "".join(_shown(r, m.lines.get(r.name, {}), "hr") for r in rights)
        parts.append(f"<tr><td>{cells_l}</td><td>{cells_r}</td></tr></table>")
    return "\n".join(parts) + "\n"


def _shown(p: Party, lines: dict[str, set[int]], cls: str) -> str:
    out = []
    for key, src in p.code.items():
        hit = lines.get(key, set())
        if not hit:
            continue
        rows = [f"<span class='{cls}'>{html.escape(line)}</span>" if n in hit
                else html.escape(line)
                for n, line in enumerate(src[:MAX_CELL_CHARS].split("\n"), 1)]
        out.append(f"<b>{html.escape(key)}</b><pre>{chr(10).join(rows)}</pre>")
    return "".join(out)
