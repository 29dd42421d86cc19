"""A submitted lab notebook made gradable, and its grades read from what ran.

The grader never trusts the submitted file beyond the student's own code:

* :func:`read_submission` reads it as plain JSON (no nbformat upgrade that could fail on junk),
  with size limits; anything unreadable is a reason, not a crash.
* :func:`assemble` builds the notebook that runs: **the lab's cells in the lab's order**, the
  locked and test cells taken from the source (hidden tests included), the student's code only
  in the cells that are theirs (the solution cells, found by ``grade_id`` or cell id, and any
  cells they added, kept after the lab cell they followed). Deleted, reordered, duplicated or
  edited cells and edited metadata therefore change nothing; each is noted. No student code
  runs before the setup cell: cells placed above it move below it.
* It wraps every test cell for the referee (:mod:`autograder.referee`), with a MAC over the
  test's text, and keeps the hidden part of every quiz test out of the kernel: the kernel only
  reports the answer's value; :func:`judge_quiz` checks it here.
* :func:`scan` flags constructs that can tamper with a test from inside the process (frames,
  ``gc``, ``ctypes``, the IPython kernel, patched modules) for a person to review.
* :func:`grade_cells` reads the executed notebook: a test scores only when its own output
  holds no error and ends with a valid receipt for it (and, for the quiz, an answer the hidden
  check accepts).
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
import secrets
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .referee import RECEIPT

HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CHECK_BEGIN, CHECK_END = "### BEGIN GRADER CHECK", "### END GRADER CHECK"
"""Inside a test's hidden part: code the grader runs in its own process, never the kernel, on
the values the kernel reports (the names the block reads that it does not define). Where a
test compares with minickpt's own result, that comparison lives here: neither the reference
nor the expected values are ever in the student's process."""
SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"
TEST_RE = re.compile(r"^test_(\d+)_(\d+)_")
QUIZ_RE = re.compile(r"^test_quiz_")
MAX_NOTEBOOK_BYTES = 128 << 20
"""The largest hand-in read at all (a notebook with big outputs: they are cleared)."""
MAX_CODE_BYTES = 20 << 20
"""The most a notebook may hold once its outputs are cleared: more is not a lab."""
MAX_CELLS = 2000
MAX_CELL_CHARS = 1_000_000
HOST_QUIZ_NAMES = ("check", "same", "close_to", "check_choice", "check_choices",
                   "expect_raises", "LabCheckError")
"""What a quiz's hidden check may use in the grader (plus ``lab``, ``np``, ``math``, the
builtins and :data:`GRADER_TOOLS`); every other name it reads is an answer the kernel reports."""
GRADER_TOOLS = ("grader_drill",)
"""What the grader lends a grader check for this submission: ``grader_drill(task)`` runs the
task's drill itself, with the student's code in sandboxed workers (:mod:`autograder.drills`)."""


class SubmissionError(Exception):
    """The submitted file cannot be graded (not JSON, not a notebook, too large)."""


def _text(source: Any) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, list) and all(isinstance(s, str) for s in source):
        return "".join(source)
    return ""


def _split(source: str, begin: str, end: str) -> tuple[list[str], list[str]]:
    """The lines outside / inside the ``begin`` … ``end`` markers (the markers dropped)."""
    outside, inside_lines, inside = [], [], False
    for line in source.split("\n"):
        if begin in line:
            inside = True
        elif end in line:
            inside = False
        else:
            (inside_lines if inside else outside).append(line)
    return outside, inside_lines


def split_grader_check(source: str) -> tuple[str, str]:
    """(what the kernel runs, what the grader runs) of a test cell: the cell without its
    grader-check blocks, and those blocks' lines, dedented. ("", "") parts where none."""
    kernel, check = _split(source, CHECK_BEGIN, CHECK_END)
    return "\n".join(kernel), textwrap.dedent("\n".join(check)).strip("\n")


def split_hidden(source: str) -> tuple[str, str]:
    """(visible part, hidden part) of a test cell: the lines outside / inside the markers."""
    visible, hidden = _split(source, HIDDEN_BEGIN, HIDDEN_END)
    return "\n".join(visible).rstrip("\n"), textwrap.dedent("\n".join(hidden)).strip("\n")


# ---------------------------------------------------------------------------------------
# the lab, from its source notebook
# ---------------------------------------------------------------------------------------
def task_of(grade_id: str) -> str:
    """``test_1_3_leaf`` → ``1.3``; ``test_quiz_q2`` → ``quiz``; else the grade_id."""
    if QUIZ_RE.match(grade_id):
        return "quiz"
    m = TEST_RE.match(grade_id)
    return f"{m.group(1)}.{m.group(2)}" if m else grade_id


def task_totals(per_cell: dict[str, float]) -> dict[str, float]:
    """Points (or scores) per graded cell summed per task, in notebook order, the quiz last."""
    out: dict[str, float] = {}
    for gid, pts in per_cell.items():
        out[task_of(gid)] = out.get(task_of(gid), 0.0) + pts
    if "quiz" in out:  # the quiz last, after the tasks
        out["quiz"] = out.pop("quiz")
    return out


@dataclass
class LabCell:
    """One cell of the lab's source notebook and what it is for the grader."""

    kind: str                 # "markdown" or "code"
    source: str
    role: str                 # "text", "setup", "locked", "test", "quiz", "solution", "open"
    grade_id: str = ""
    cell_id: str = ""
    points: float = 0.0

    @property
    def visible(self) -> str:
        return split_hidden(self.source)[0] if self.role in ("test", "quiz") else self.source


@dataclass
class Lab:
    """A lab as the grader sees it: its cells in order, its graded cells and their points."""

    name: str
    cells: list[LabCell]
    fingerprint: str = ""

    @property
    def grade_cells(self) -> dict[str, float]:
        return {c.grade_id: c.points for c in self.cells if c.role in ("test", "quiz")}

    @property
    def quiz_cells(self) -> dict[str, float]:
        return {c.grade_id: c.points for c in self.cells if c.role == "quiz"}

    @property
    def max_score(self) -> float:
        return sum(self.grade_cells.values())

    @property
    def groups(self) -> dict[str, float]:
        return task_totals(self.grade_cells)

    def info(self) -> dict[str, Any]:
        """What merge and the reports need, without the source (no hidden tests in it)."""
        return {"name": self.name, "cells": self.grade_cells, "fingerprint": self.fingerprint,
                "questions": {c.grade_id: _question_title(self, c.grade_id)
                              for c in self.cells if c.role == "quiz"}}


def _question_title(lab: Lab, grade_id: str) -> str:
    """The first bold phrase of the markdown cell before a quiz answer: ``Q3`` → its text."""
    text = ""
    for c in lab.cells:
        if c.kind == "markdown":
            text = c.source
        if c.grade_id == grade_id:
            break
    m = re.search(r"\*\*(Q\d+)\.\*\*\s*(.*)", text)
    return f"{m.group(1)}. {m.group(2).strip()}"[:120] if m else grade_id


def load_lab(path: Path) -> Lab:
    """The lab's source notebook (solutions and hidden tests) → :class:`Lab`."""
    raw = path.read_bytes()
    nb = json.loads(raw)
    cells = []
    for cell in nb.get("cells", []):
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        gid = str(meta.get("grade_id", ""))
        kind = cell.get("cell_type", "code")
        source = _text(cell.get("source"))
        if kind != "code":
            role = "text"
        elif meta.get("grade") and not meta.get("solution"):
            role = "quiz" if QUIZ_RE.match(gid) else "test"
        elif meta.get("solution"):
            role = "solution"
        elif gid.startswith("setup"):
            role = "setup"
        elif meta.get("locked"):
            role = "locked"
        else:
            role = "open"
        lab_cell = LabCell("code" if kind == "code" else "markdown", source, role, gid,
                           str(cell.get("id", "")), float(meta.get("points", 0)))
        if role == "quiz":
            _must_compile(split_hidden(source)[1], f"<{gid} hidden>",
                          f"{path}: the hidden part of quiz test {gid} must be code that runs "
                          "on its own (it is checked outside the kernel)")
        elif role == "test" and CHECK_BEGIN in source:
            _check_block(path, gid, source)
        cells.append(lab_cell)
    if not any(c.role == "setup" for c in cells):
        raise ValueError(f"{path}: the lab has no setup cell (grade_id 'setup...', locked)")
    name = path.stem
    return Lab(name, cells, hashlib.sha256(raw).hexdigest()[:16])


# ---------------------------------------------------------------------------------------
# the submission
# ---------------------------------------------------------------------------------------
@dataclass
class StudentCell:
    kind: str
    source: str
    grade_id: str = ""
    cell_id: str = ""
    note: str = ""


SURROGATE = re.compile("[\ud800-\udfff]")


def text_only(value: str) -> str:
    """``value`` with lone surrogates (valid in JSON, not text: nothing can encode them)
    replaced by U+FFFD, so that a notebook or an output holding one is still graded."""
    return SURROGATE.sub("\ufffd", value)


def read_submission(path: Path) -> list[StudentCell]:
    """The cells of a submitted notebook, read as plain JSON (never executed, never pickled).

    What can be repaired is, and said in the first cell's note (the feedback page shows it):
    a notebook over :data:`MAX_CODE_BYTES` because of its outputs has them cleared (the grader
    runs every cell again; nbgrader clears outputs too), and an nbformat 3 notebook (its cells
    in ``worksheets``) is upgraded by nbformat's own converter, from the JSON read here."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise SubmissionError(f"the notebook cannot be read ({e.strerror})") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise SubmissionError(f"the notebook is {size >> 20} MiB; more than "
                              f"{MAX_NOTEBOOK_BYTES >> 20} MiB is not a lab (clear its outputs)")
    try:
        nb = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SubmissionError("the notebook is not a readable .ipynb file (not JSON)") from None
    repairs = []
    old = nb.get("nbformat") if isinstance(nb, dict) else None
    if old in (1, 2, 3) and "cells" not in nb:
        nb = _upgraded(nb, old)
        repairs.append(f"the notebook was in nbformat {old}: upgraded to nbformat 4 by "
                       "nbformat's converter before grading")
    if size > MAX_CODE_BYTES and isinstance(nb, dict) and isinstance(nb.get("cells"), list):
        for cell in nb["cells"]:
            if isinstance(cell, dict) and "outputs" in cell:
                cell["outputs"] = []
        left = len(json.dumps(nb))
        if left > MAX_CODE_BYTES:
            raise SubmissionError(f"the notebook is {left >> 20} MiB even without its outputs; "
                                  f"more than {MAX_CODE_BYTES >> 20} MiB is not a lab")
        repairs.append(f"the notebook was {size / (1 << 20):.0f} MiB, almost all of it outputs: "
                       "its outputs were cleared before grading (every cell runs again)")
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise SubmissionError("the notebook is not a readable .ipynb file (no list of cells)")
    if len(cells) > MAX_CELLS:
        raise SubmissionError(f"the notebook has {len(cells)} cells; at most {MAX_CELLS}")
    out = []
    for cell in cells:
        if not isinstance(cell, dict):
            continue
        kind = cell.get("cell_type")
        if kind not in ("code", "markdown", "raw"):
            continue
        meta = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        nbg = meta.get("nbgrader") if isinstance(meta.get("nbgrader"), dict) else {}
        gid = nbg.get("grade_id", "")
        cid = cell.get("id", "")
        source = _text(cell.get("source"))
        if len(source) > MAX_CELL_CHARS:
            raise SubmissionError(f"a cell holds {len(source)} characters; at most {MAX_CELL_CHARS}")
        note = ""
        if SURROGATE.search(source):
            source = text_only(source)
            note = ("a cell held characters that are not text (lone surrogates): they were "
                    "replaced by U+FFFD")
        out.append(StudentCell(kind, source, text_only(gid) if isinstance(gid, str) else "",
                               text_only(cid) if isinstance(cid, str) else "", note))
    if repairs and out:
        out[0].note = "; ".join([*repairs, *([out[0].note] if out[0].note else [])])
    return out


def _upgraded(nb: dict[str, Any], version: int) -> dict[str, Any]:
    """An nbformat 1-3 notebook (plain JSON, read here) as nbformat 4, by nbformat's
    converter; never validated against a schema that junk could fail in another way."""
    import nbformat
    from nbformat.converter import convert

    try:
        new = convert(nbformat.from_dict(nb), 4)
    except Exception as e:  # junk inside an old notebook's shell: a reason, not a crash
        raise SubmissionError(f"the notebook is nbformat {version} and cannot be upgraded "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    return json.loads(json.dumps(new))


# ---------------------------------------------------------------------------------------
# the notebook that runs
# ---------------------------------------------------------------------------------------
@dataclass
class RunCell:
    """A cell of the notebook that runs: what the kernel executes, what a reader is shown."""

    kind: str                       # "markdown" or "code"
    run: str                        # the code sent to the kernel ("" for markdown)
    show: str                       # what the feedback shows (visible tests only)
    role: str                       # lab roles, "student", "referee"
    grade_id: str = ""
    report: tuple[str, ...] = ()    # a quiz test: the answer names the kernel reports
    hidden: str = ""                # a quiz test: its hidden check, run in the grader
    full: str = ""                  # a test: its whole text (for the instructor's copy)


@dataclass
class Assembled:
    cells: list[RunCell]
    key: bytes
    nonce: str
    notes: list[str] = field(default_factory=list)
    refereed: bool = True


def _quiz_names(hidden: str) -> tuple[str, ...]:
    """The names a quiz's hidden check (or a test's grader check) reads that the grader does
    not provide and the check does not define: the values the kernel reports."""
    import builtins

    provided = set(HOST_QUIZ_NAMES) | set(GRADER_TOOLS) | {"lab", "np", "math"} \
        | set(vars(builtins))
    tree = ast.parse(hidden)
    assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Store | ast.Del)}
    assigned |= {n.name for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    assigned |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    assigned |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                         and isinstance(n.ctx, ast.Load)} - provided - assigned))


def _check_block(path: Path, gid: str, source: str) -> None:
    """A test's grader check must lie inside its hidden part and compile on its own."""
    visible, hidden = split_hidden(source)
    if CHECK_BEGIN in visible or CHECK_BEGIN not in hidden or CHECK_END not in hidden:
        raise ValueError(f"{path}: test {gid}: a '{CHECK_BEGIN}' block must open and close "
                         "inside the hidden tests (students never see it)")
    _must_compile(split_grader_check(source)[1], f"<{gid} grader check>",
                  f"{path}: test {gid}: its grader check must be code that runs on its own "
                  "(it runs in the grader, not the kernel)")


def _must_compile(code: str, name: str, why: str) -> None:
    """Code the grader runs in its own process: a SyntaxError is the lab's, said at load."""
    try:
        compile(code, name, "exec")
    except SyntaxError as e:
        raise ValueError(f"{why}: {e}") from e


def sign(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode("utf-8"), "sha256").hexdigest()


def seal_text(key: bytes, nonce: str, grade_id: str, text: str) -> str:
    """A test's text as the kernel receives it: XOR with an HMAC-SHA256 keystream, in hex.
    Only the referee (the key is in its closure) reads it back; the kernel's input history,
    hooks and transformers see ciphertext (``referee.boot``'s ``unseal``)."""
    data = text.encode("utf-8")
    stream = b"".join(bytes.fromhex(sign(key, f"{nonce}|text|{grade_id}|{block}"))
                      for block in range((len(data) + 31) // 32))
    return bytes(a ^ b for a, b in zip(data, stream, strict=False)).hex()


def assemble(lab: Lab, student: list[StudentCell], *, referee_path: str, key_file: str,
             key: bytes | None = None, nonce: str | None = None,
             refereed: bool = True, hoist: bool = False, judged: bool = False) -> Assembled:
    """The notebook to run for one submission (see the module doc). ``refereed=False`` runs
    the tests as plain cells, the way nbgrader does: only to show what the referee stops.
    ``judged``: the judge decides every test of this lab (:mod:`autograder.judge`) and runs
    it in its own process, so the kernel runs no test at all (the judge's output of each
    test is shown in its place): no test text, hidden or not, enters the sandbox."""
    key = key if key is not None else secrets.token_bytes(32)
    nonce = nonce if nonce is not None else secrets.token_hex(8)
    notes: list[str] = sorted({c.note for c in student if c.note})
    by_gid: dict[str, int] = {}
    by_id: dict[str, int] = {}
    for i, c in enumerate(student):
        if c.kind == "code" and c.grade_id and c.grade_id not in by_gid:
            by_gid[c.grade_id] = i
    ids = [c.cell_id for c in student if c.cell_id]
    for i, c in enumerate(student):
        if c.cell_id and ids.count(c.cell_id) == 1:
            by_id[c.cell_id] = i
    # which student cell stands for which lab cell
    claimed: dict[int, int] = {}   # student index -> lab index
    for j, lc in enumerate(lab.cells):
        i = by_gid.get(lc.grade_id) if lc.grade_id else None
        if i is None and lc.cell_id and lc.cell_id in by_id:
            i = by_id[lc.cell_id]
        if i is not None and i not in claimed and student[i].kind == "code" == lc.kind:
            claimed[i] = j
        elif lc.role in ("test", "quiz", "setup", "locked", "solution"):
            notes.append(f"{lc.grade_id or 'a lab cell'} is missing from the submission: "
                         + ("the lab's cell was run" if lc.role != "solution"
                            else "nothing to grade for it"))
    # the student's own cells: code cells that stand for no lab cell, after the lab cell before
    extras: dict[int, list[int]] = {}
    anchor = -1
    setup_last = max(j for j, lc in enumerate(lab.cells) if lc.role == "setup")
    moved = False
    for i, c in enumerate(student):
        if i in claimed:
            anchor = claimed[i]
            continue
        if c.kind != "code" or not c.source.strip():
            continue
        if c.grade_id and any(lc.grade_id == c.grade_id for lc in lab.cells):
            notes.append(f"a second copy of {c.grade_id} was run as the student's own code")
        place = max(anchor, setup_last)
        moved |= place != anchor
        extras.setdefault(place, []).append(i)
    if moved:
        notes.append("code above the setup cell was run after it (no student code runs first)")
    order = [claimed[i] for i in sorted(claimed)]
    if order != sorted(order):
        notes.append("cells were out of the lab's order: graded in the lab's order")
    for i, j in claimed.items():
        lc = lab.cells[j]
        if lc.role in ("test", "quiz") and _norm(student[i].source) not in (
                _norm(lc.visible), _norm(lc.source)):
            notes.append(f"{lc.grade_id} was edited: the lab's test was run")
        elif lc.role in ("setup", "locked") and _norm(student[i].source) != _norm(lc.source):
            notes.append(f"{lc.grade_id} (locked) was edited: the lab's cell was run")

    cells: list[RunCell] = [RunCell("code", _boot_source(referee_path, key_file, nonce), "",
                                    "referee")]
    deferred: list[RunCell] = []   # the student's cells that stand above the setup cell
    for j, lc in enumerate(lab.cells):
        out = cells if j >= setup_last else deferred
        if lc.kind == "markdown":
            cells.append(RunCell("markdown", "", lc.source, "text"))
        elif lc.role in ("setup", "locked"):
            cells.append(RunCell("code", lc.source, lc.source, lc.role, lc.grade_id))
        elif lc.role == "test" and judged:
            cells.append(RunCell("code", "", split_hidden(lc.source)[0], lc.role, lc.grade_id,
                                 full=lc.source))
        elif lc.role in ("test", "quiz") and not refereed:
            cells.append(RunCell("code", lc.source, split_hidden(lc.source)[0], lc.role,
                                 lc.grade_id, full=lc.source))
        elif lc.role in ("test", "quiz"):
            visible, hidden = split_hidden(lc.source)
            if lc.role == "quiz":
                report = _quiz_names(hidden)
                text = visible
            else:  # the grader check (if any) stays here; the kernel reports what it reads
                text, hidden = split_grader_check(lc.source)
                report = _quiz_names(hidden) if hidden else ()
            mac = sign(key, f"{nonce}|test|{lc.grade_id}|{report!r}|{text}")
            sealed = seal_text(key, nonce, lc.grade_id, text)
            run = f"__referee__.test({lc.grade_id!r}, {sealed!r}, {mac!r}, {report!r})"
            cells.append(RunCell("code", run, visible, lc.role, lc.grade_id, report, hidden,
                                 lc.source))
        else:  # solution and open cells: the student's version (or nothing)
            mine = next((i for i, k in claimed.items() if k == j), None)
            if mine is not None:
                out.append(RunCell("code", student[mine].source, student[mine].source,
                                   "student", lc.grade_id))
            elif lc.role == "solution":
                out.append(RunCell("code", "", "", "student", lc.grade_id))
        if j == setup_last:
            if refereed:
                cells.append(RunCell("code", "__referee__.seal(globals())", "", "referee"))
            cells.extend(deferred)
        for i in extras.get(j, []):
            cells.append(RunCell("code", student[i].source, student[i].source, "student"))
    if hoist:  # the graded build: every cell of the student's before the first test
        cells = _hoisted(cells)
    if not refereed:
        cells = cells[1:]
    return Assembled(cells, key, nonce, notes, refereed)


def _hoisted(cells: list[RunCell]) -> list[RunCell]:
    """The student's cells moved up, in their order, to just before the first test or quiz
    cell. On the graded build minickpt calls the student's function for every task of the
    lab; a test of task 1 that saves through the library then needs task 3's code, which the
    lab places after that test."""
    first = next((i for i, c in enumerate(cells) if c.role in ("test", "quiz")), len(cells))
    moved = [c for c in cells[first:] if c.role == "student"]
    return cells[:first] + moved + [c for c in cells[first:] if c.role != "student"]


def hidden_lines_of(asm: Assembled) -> set[str]:
    """Lines of this lab's hidden tests that no visible part shows, to blank wherever an
    output repeats them."""
    from .feedback import hidden_lines

    tests = [c for c in asm.cells if c.role in ("test", "quiz")]
    shown = {line.strip() for c in asm.cells for line in c.show.split("\n")}
    return hidden_lines([split_hidden(c.full)[1] for c in tests]) - shown


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().split("\n"))


def _boot_source(referee_path: str, key_file: str, nonce: str) -> str:
    """The first cell: load the referee from its file (no sys.modules entry), with a copy of
    the pristine builtins as its own."""
    return textwrap.dedent(f"""\
        def __minickpt_referee_boot():
            import builtins, importlib.util
            spec = importlib.util.spec_from_file_location("minickpt_referee", {referee_path!r})
            module = importlib.util.module_from_spec(spec)
            module.__dict__["__builtins__"] = dict(vars(builtins))
            spec.loader.exec_module(module)
            return module.boot({key_file!r}, {nonce!r}, get_ipython())
        __referee__ = __minickpt_referee_boot()
        del __minickpt_referee_boot""")


# ---------------------------------------------------------------------------------------
# the static scan
# ---------------------------------------------------------------------------------------
SUSPICIOUS_NAMES = {"get_ipython", "__referee__", "__builtins__", "exec", "eval", "compile",
                    "__import__", "globals", "breakpoint", "vars", "attrgetter",
                    "In", "Out", "_ih", "_oh"}
SUSPICIOUS_ATTRS = {"_getframe", "currentframe", "stack", "f_back", "f_globals", "f_locals",
                    "f_trace", "f_builtins", "f_code", "settrace", "setprofile", "__code__",
                    "__closure__", "cell_contents", "__globals__", "__builtins__",
                    "__kwdefaults__", "__defaults__", "__self__", "__func__", "__wrapped__",
                    "__traceback__", "tb_frame", "tb_next", "gi_frame", "cr_frame", "ag_frame",
                    "_current_frames", "walk_stack", "walk_tb", "__getattribute__", "modules",
                    "_exit", "kill", "killpg", "user_ns", "user_global_ns",
                    "input_transformers_post", "input_transformers_cleanup", "ast_transformers",
                    "showtraceback", "set_custom_exc", "events", "meta_path", "path_hooks",
                    "__subclasses__", "get_objects", "get_referrers", "get_referents",
                    "cache_clear", "attrgetter", "_sign", "_hmac", "history_manager",
                    "addaudithook"}
SUSPICIOUS_MODULES = {"gc", "ctypes", "builtins", "IPython", "ipykernel", "importlib",
                      "jupyter_client", "zmq", "inspect", "pty", "resource", "socket", "_ctypes",
                      "runpy", "marshal", "pickle", "code", "codeop"}
RUNS_CODE_ATTRS = {"run_path", "run_module", "exec_module", "spec_from_file_location",
                   "module_from_spec", "load_module", "source_to_code", "run_cell",
                   "run_code", "ex", "ev"}
"""Calls that run code a program built or wrote at run time (a solution kept in a string and
run from a file): flagged with their cell, whatever module they are reached through."""
PLAIN_DUNDERS = {"__name__", "__doc__", "__len__", "__iter__", "__class__", "__module__",
                 "__qualname__", "__dict__"}
"""Dunder names whose ``getattr`` is ordinary introspection, not a way into the referee."""
ONLY_ON = {"kill": {"os"}, "killpg": {"os"}, "_exit": {"os"}, "stack": {"inspect"},
           "events": {"get_ipython", "shell", "ip"}, "cache_clear": {"lab", "labkit"},
           "modules": {"sys"}}
"""Attributes that are suspicious only on these bases (``proc.kill()`` is fine); a base is
the module an alias stands for (``import sys as s``: ``s.modules`` is ``sys.modules``)."""
TAMPER_TARGETS = {"lab", "labkit", "mc", "minickpt", "np", "numpy", "jnp", "jax", "builtins",
                  "sys", "os", "json", "zlib", "re", "hmac"}
SUSPICIOUS_STRINGS = re.compile(
    r"referee|^__(closure|globals|code|self|func|builtins|traceback|subclasses|dict|wrapped)__$|"
    r"^(f|tb|gi|cr|ag)_(back|frame|globals|locals|next|code|builtins)$|^(_getframe|cell_contents|"
    r"gc|ctypes|_ctypes|_sign|_hmac|get_objects|get_referrers|get_referents|modules)$",
    re.IGNORECASE)
"""Text that names the referee or a way into it: ``"__" "referee__"``, ``getattr(f,
"__closure__")``, ``sys.modules["gc"]``. A string written in pieces (``"__clo" + "sure__"``)
is read whole when its pieces are literals."""


def _literal_text(node: ast.AST) -> str | None:
    """The value of a string written as literals joined by ``+`` (or None)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_text(node.left), _literal_text(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in node.values):
        return "".join(str(v.value) for v in node.values)  # type: ignore[attr-defined]
    return None


def scan(cells: list[tuple[str, str]]) -> list[str]:
    """:func:`scan_cells` one cell at a time: a cell that cannot be read (nested too deep for
    the parser: a 3000-term string concatenation; a null byte) is flagged for a person to
    read, never a failure of the grading."""
    found: set[str] = set()
    for where, source in cells:
        python = as_ipython_runs(source)
        try:
            ast.parse(python)
        except SyntaxError:
            found.add(f"does not parse as Python, even as IPython runs it: read {where} yourself")
            continue
        except (RecursionError, MemoryError, ValueError) as e:
            found.add(f"cannot be scanned ({type(e).__name__}): read {where} yourself")
            continue
        try:
            flags = scan_cells([(where, python)])
            if "get_ipython" not in source:  # what IPython wrote for a magic line
                flags = [f for f in flags if f != f"get_ipython in {where}"]
            found.update(flags)
        except (RecursionError, MemoryError, ValueError) as e:
            found.add(f"cannot be scanned ({type(e).__name__}): read {where} yourself")
    return sorted(found)


def as_ipython_runs(source: str) -> str:
    """A cell's code as IPython runs it: ``%magic`` and ``!shell`` lines become the Python
    IPython executes for them, so a magic line cannot hide the rest of a cell from a scan."""
    from .judge.worker import ipython_python

    return ipython_python(source)


def scan_cells(cells: list[tuple[str, str]]) -> list[str]:
    """Constructs in the student's code that can reach into a test (or the referee) from
    inside the kernel, one line each (``"sys._getframe in task_1_2"``), for a person to
    review. Advisory: the grade does not depend on it, and code can hide from any static
    scan (see docs/LABS.md); it catches what ordinary code, and the known tricks, look like."""
    found: set[str] = set()
    for where, source in cells:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        modules: set[str] = set()
        alias: dict[str, str] = {}
        tested: set[int] = set()  # `"google.colab" in sys.modules` only asks
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and all(
                    isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                tested.update(id(c) for c in node.comparators)
            if isinstance(node, ast.Import):
                for a in node.names:
                    modules.add(a.asname or a.name.split(".")[0])
                    alias[a.asname or a.name.split(".")[0]] = a.name.split(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""]
                for name in names:
                    if name.split(".")[0] in SUSPICIOUS_MODULES:
                        found.add(f"imports {name.split('.')[0]} in {where}")
                if isinstance(node, ast.ImportFrom) and any(
                        a.name in SUSPICIOUS_ATTRS | SUSPICIOUS_NAMES for a in node.names):
                    found.add(f"imports {node.module}.{node.names[0].name} in {where}")
            elif isinstance(node, ast.Name) and node.id in SUSPICIOUS_NAMES:
                found.add(f"{node.id} in {where}")
            elif isinstance(node, ast.Attribute):
                need = ONLY_ON.get(node.attr)
                base = _base_name(node.value)
                if node.attr in SUSPICIOUS_ATTRS and id(node) not in tested and (
                        need is None or alias.get(base, base) in need):
                    found.add(f"{_dotted(node)} in {where}")
                if isinstance(node.ctx, ast.Store | ast.Del) and (
                        base in TAMPER_TARGETS | modules or node.attr.startswith("__")):
                    found.add(f"assigns {_dotted(node)} in {where}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and node.args and \
                    _base_name(node.args[0]) in TAMPER_TARGETS | modules:
                found.add(f"{node.func.id}({_dotted(node.args[0])}, ...) in {where}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "setattr", "delattr", "hasattr") and \
                    len(node.args) >= 2:
                name = _literal_text(node.args[1])
                if name is None:
                    found.add(f"{node.func.id} with a computed name in {where}")
                elif name.startswith("_") and not (name.startswith("__") and name.endswith("__")
                                                    and name in PLAIN_DUNDERS):
                    found.add(f"{node.func.id}({_dotted(node.args[0])}, {name!r}) reaches a "
                              f"private name in {where}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in RUNS_CODE_ATTRS:
                found.add(f"{_dotted(node.func)} runs code built at run time in {where}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "setattr", "delattr", "hasattr") and \
                    len(node.args) >= 2 and \
                    (named := _literal_text(node.args[1])) in SUSPICIOUS_ATTRS:
                # getattr(os, "_exit") is os._exit spelled so that no attribute shows
                need, base = ONLY_ON.get(named), _base_name(node.args[0])
                if need is None or alias.get(base, base) in need:
                    found.add(f"{_dotted(node)} in {where}")
            if isinstance(node, ast.Constant | ast.BinOp | ast.JoinedStr):
                text = _literal_text(node)
                if text and len(text) < 200 and SUSPICIOUS_STRINGS.search(text.strip()):
                    found.add(f"the text {text.strip()[:40]!r} in {where}")
    return sorted(found)


def _base_name(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    if isinstance(node, ast.Call):
        return _base_name(node.func)
    return node.id if isinstance(node, ast.Name) else ""


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)[:60]
    except Exception:  # pragma: no cover
        return "?"


# ---------------------------------------------------------------------------------------
# reading the grades from what ran
# ---------------------------------------------------------------------------------------
class Unreadable:
    """A quiz answer the kernel could not report as a plain value: it matches nothing."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<unreadable: {self.what}>"

    __hash__ = object.__hash__


def decode_answer(tree: Any) -> Any:
    """The referee's tagged literal (:func:`autograder.referee._literal`) → the value."""
    if not (isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], str)):
        return Unreadable("malformed")
    tag, v = tree
    simple = {"bool": bool, "int": int, "str": str, "NoneType": type(None)}
    if tag in simple:
        return v if type(v) is simple[tag] else Unreadable("malformed")
    if tag == "float" and isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return Unreadable("malformed")
    if tag in ("list", "tuple", "set", "frozenset") and isinstance(v, list):
        items = [decode_answer(x) for x in v]
        try:
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError:
            return Unreadable(f"a {tag} of unhashable items")
    if tag == "dict" and isinstance(v, list):
        try:
            return {decode_answer(k): decode_answer(x) for k, x in v}
        except (TypeError, ValueError):
            return Unreadable("malformed")
    if tag == "undefined":
        return Unreadable("not defined")
    return Unreadable(str(v))


def judge_quiz(hidden: str, answers: dict[str, Any],
               tools: dict[str, Any] | None = None) -> str | None:
    """Run a quiz's hidden check (or a test's grader check) in the grader on the reported
    values: None if it passes, else the message the student reads. A value the kernel could
    not report as a plain literal is :class:`Unreadable`: it matches nothing. ``tools``: the
    :data:`GRADER_TOOLS` bound to this submission (a check that uses one without them fails)."""
    import math

    import numpy as np

    from minickpt import labkit

    ns: dict[str, Any] = {name: getattr(labkit, name) for name in HOST_QUIZ_NAMES}
    ns.update(lab=labkit, np=np, math=math, __name__="__quiz__")
    ns.update(answers)
    for name in GRADER_TOOLS:
        ns[name] = (tools or {}).get(name, _no_tool(name))
    try:
        exec(compile(hidden, "<hidden quiz check>", "exec"), ns)
    except labkit.LabCheckError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _no_tool(name: str) -> Any:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this check needs the grader's {name}, which this run has not")
    return missing


@dataclass
class CellGrade:
    grade_id: str
    points: float
    score: float
    message: str = ""           # why it failed; "" when it passed
    restored: tuple[str, ...] = ()


RECEIPT_LINE = re.compile(re.escape(RECEIPT) + r" (\S+) ([0-9a-f]{64}) (.*)$")


def receipts(outputs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Every receipt-looking line in a cell's stdout: (grade id, mac, payload)."""
    found = []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            for line in _text(out.get("text")).split("\n"):
                m = RECEIPT_LINE.match(line)
                if m:
                    found.append((m.group(1), m.group(2), m.group(3)))
    return found


def strip_receipts(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outputs without receipt lines (genuine or forged): readers never see them."""
    kept = []
    for out in outputs:
        if out.get("output_type") == "stream":
            text = "\n".join(line for line in _text(out.get("text")).split("\n")
                             if RECEIPT not in line)
            if not text.strip():
                continue
            out = {**out, "text": text}
        kept.append(out)
    return kept


def error_message(outputs: list[dict[str, Any]]) -> str:
    """The last error of a cell as ``Name: message`` (the check's teaching message)."""
    for out in reversed(outputs):
        if out.get("output_type") == "error":
            ename, evalue = str(out.get("ename", "")), str(out.get("evalue", ""))
            return f"{ename}: {evalue}".strip()[:1000]
    return ""


GRADER_NOTE = "[grader] "
"""What the executor's own notes in a cell's output start with (``execute._note``)."""


def _verdict(asm: Assembled, gid: str, outputs: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(the receipt's payload, "") when the cell passed: no error output at all, and the last
    thing the kernel showed (stderr and the executor's notes aside) is a valid receipt for
    this test. Else (None, why). A receipt that student code printed before the test went on
    to fail therefore earns nothing, whatever printed it."""
    if any(o.get("output_type") == "error" for o in outputs):
        return None, "the test raised an error"
    last = ""
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            lines = [line for line in _text(out.get("text")).split("\n")
                     if line.strip() and not line.startswith(GRADER_NOTE)]
            last = lines[-1] if lines else last
        elif kind in ("display_data", "execute_result", "update_display_data"):
            last = "(a display)"
    for got_gid, mac, payload in receipts([{"output_type": "stream", "name": "stdout",
                                            "text": last}]):
        if got_gid == gid and hmac.compare_digest(sign(asm.key, f"{asm.nonce}|pass|{gid}|{payload}"),
                                                  mac):
            return payload, ""
    signed = any(got == gid and hmac.compare_digest(
        sign(asm.key, f"{asm.nonce}|pass|{gid}|{payload}"), mac)
        for got, mac, payload in receipts(outputs))
    return None, ("the referee's sign was not the test's last output" if signed
                  else "the test did not run to its end (no sign from the referee)")


def _restored_before_failure(asm: Assembled, gid: str,
                             outputs: list[dict[str, Any]]) -> tuple[str, ...]:
    """What the referee put back before test ``gid`` that then failed: its signed
    ``restored`` line (never worth points; only for the review column), or nothing."""
    for got_gid, mac, payload in receipts(outputs):
        if got_gid != gid or not hmac.compare_digest(
                sign(asm.key, f"{asm.nonce}|restored|{gid}|{payload}"), mac):
            continue
        try:
            what = ast.literal_eval(payload)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return ()
        if isinstance(what, list) and all(isinstance(w, str) for w in what):
            return tuple(what)
    return ()


def grade_cells(asm: Assembled, executed: list[list[dict[str, Any]]],
                notes_by_cell: dict[int, str], points: dict[str, float],
                tools: dict[str, Any] | None = None) -> list[CellGrade]:
    """Scores of the graded cells from the executed outputs (one list per RunCell); ``tools``
    for the grader checks (:data:`GRADER_TOOLS`)."""
    grades = []
    for index, cell in enumerate(asm.cells):
        if cell.role not in ("test", "quiz"):
            continue
        outputs = executed[index]
        gid = cell.grade_id
        if not asm.refereed:  # nbgrader's rule: no error and no stderr is a pass
            g = CellGrade(gid, points[gid], 0.0, error_message(outputs) or notes_by_cell.get(index, ""))
            if not g.message and any(o.get("name") == "stderr" for o in outputs):
                g.message = "wrote to stderr"
            g.score = 0.0 if g.message else g.points
            grades.append(g)
            continue
        valid, why = _verdict(asm, gid, outputs)
        g = CellGrade(gid, points[gid], 0.0)
        if valid is None:
            g.message = (error_message(outputs) or notes_by_cell.get(index) or why)
            g.restored = _restored_before_failure(asm, gid, outputs)
            grades.append(g)
            continue
        try:
            data = ast.literal_eval(valid)
            answers = {k: decode_answer(v) for k, v in data.get("answers", {}).items()}
            g.restored = tuple(data.get("restored", ()))
        except (ValueError, SyntaxError, AttributeError, TypeError):
            g.message = "the referee's report could not be read"
            grades.append(g)
            continue
        if cell.hidden:  # the quiz's check, or the test's grader check: run here
            failed = judge_quiz(cell.hidden, answers, tools)
            if failed:
                g.message = failed
                grades.append(g)
                continue
        g.score = g.points
        grades.append(g)
    return grades


# ---------------------------------------------------------------------------------------
# the reference handed in as one's own
# ---------------------------------------------------------------------------------------
TASK_CELL_RE = re.compile(r"^task_(\d+)_(\d+)$")


def task_functions(lab: Lab) -> dict[str, str]:
    """The functions each task cell of the lab's source defines: name -> task ID (``"1.2"``).
    These are the names of minickpt's reference functions (the build writes the cells from
    them), found from the lab itself, so every lab gets the check."""
    found: dict[str, str] = {}
    for c in lab.cells:
        m = TASK_CELL_RE.match(c.grade_id)
        if c.role != "solution" or not m:
            continue
        try:
            tree = ast.parse(c.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found[node.name] = f"{m.group(1)}.{m.group(2)}"
    return found


def _minickpt_names(tree: ast.AST) -> set[str]:
    """Names an import binds to minickpt or a part of it (``mc``, ``lab``, ``T``...)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "minickpt":
                    names.add(a.asname or "minickpt")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minickpt":
            names.update(a.asname or a.name for a in node.names)
    return names


def reference_use(cells: list[tuple[str, str]], lab: Lab) -> list[str]:
    """Where the student's code reaches for minickpt's own version of one of this lab's task
    functions, one line each, naming the task: ``from minickpt.tree import to_host as _h``, an
    attribute ``mc.tree.to_host`` or ``lab.reference("to_host")`` inside the task's own cell, or
    a name bound to one of them anywhere. A one-line wrapper around the reference passes every
    test (students may read minickpt); an instructor should see who handed it in as their own.
    Advisory, like :func:`scan`. Using *another* task's reference inside a task cell (calling
    the library, as the lab's own reference code may) is not flagged."""
    tasks = task_functions(lab)
    if not tasks:
        return []
    parsed: list[tuple[str, ast.AST]] = []
    for where, source in cells:
        try:
            parsed.append((where, ast.parse(as_ipython_runs(source))))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # unparsable: scan() flags it ("cannot be scanned"), the kernel says why
    bases = set().union(*(_minickpt_names(ast.parse(c.source)) for c in lab.cells
                          if c.role == "setup" and c.kind == "code"),
                        *(_minickpt_names(t) for _, t in parsed))
    found: set[str] = set()

    def note(name: str, where: str, detail: str, *, bound: bool = False) -> None:
        m = TASK_CELL_RE.match(where)
        if m and f"{m.group(1)}.{m.group(2)}" != tasks[name] and not bound:
            return  # another task's cell calling the library
        found.add(f"minickpt's reference {name} (task {tasks[name]}) in {where}: {detail}")

    for where, tree in parsed:
        own_cell = bool(TASK_CELL_RE.match(where))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and \
                    (node.module or "").split(".")[0] == "minickpt":
                for a in node.names:
                    if a.name in tasks:  # binding a task's own name: flagged in any cell
                        note(a.name, where, f"from {node.module} import {a.name}"
                             + (f" as {a.asname}" if a.asname else ""),
                             bound=(a.asname or a.name) in tasks)
            elif isinstance(node, ast.Attribute) and node.attr in tasks and \
                    _base_name(node.value) in bases and isinstance(node.ctx, ast.Load):
                if own_cell or _is_bound(tree, node):
                    note(node.attr, where, _dotted(node))
            elif isinstance(node, ast.Call) and node.args:
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else \
                    fn.id if isinstance(fn, ast.Name) else ""
                text = _literal_text(node.args[0])
                if called == "reference" and text in tasks:
                    note(text, where, _dotted(node))
                elif called == "getattr" and len(node.args) >= 2 and \
                        _base_name(node.args[0]) in bases:
                    text = _literal_text(node.args[1])
                    if text in tasks:
                        note(text, where, _dotted(node))
    return sorted(found)


def _is_bound(tree: ast.AST, attr: ast.Attribute) -> bool:
    """Whether ``attr`` is kept for later: the value of an assignment or a default argument
    (``_h = mc.to_host``, ``def f(x, _h=mc.to_host)``), not a plain call in passing."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and \
                node.value is attr:
            return True
        if isinstance(node, ast.arguments) and any(d is attr for d in
                                                   [*node.defaults, *node.kw_defaults]):
            return True
        if isinstance(node, ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body if isinstance(node.body, list) else [node.body]
            if any(isinstance(b, ast.Return) and b.value is attr for b in body):
                return True
    return False
