"""The copy report (:mod:`autograder.similarity`), offline and without grading: the evasions of
issue 38 point 5 are flagged, both parties of a copied pair are named, renaming and
reformatting do not escape, and honest work is not flagged.

The figures (lab 2, minickpt's code of its four tasks, 448 normalised tokens; threshold 80 %
and 200 shared tokens):

* copies score 100 % against minickpt and against the original: renamed and reformatted,
  padded with ten times the copied code appended (issue 38 saw 10 %), a statement that does
  nothing after each statement (issue 38: 32 %; also a call of the student's own no-op
  function, ``assert True``, an empty ``try``/``for``), pasted into an added cell;
* the derivatives of minickpt's code in the example corpus (the ``wrong`` versions, one
  function changed) score 87-100 % against it and 61-100 % against each other, and are
  flagged (a pair from 80 %): their code is minickpt's;
* independent work stays far below: ``natural_a`` / ``natural_b`` (lab 2) score under 30 %
  against each other and 43 % against minickpt with no task at the threshold; each lab's
  ``partial`` (written from the released lab, autograder/lab_examples/independent.py) scores
  36-61 % against minickpt with no task at the threshold and at most 64 % against any other
  submission (lab 1).
"""

from __future__ import annotations

import ast
import csv
import functools
import time
from pathlib import Path

import pytest

from autograder import similarity as S
from autograder.lab_examples.copies import _padding, disguise
from autograder.notebook import assemble, load_lab, read_submission

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "autograder" / "examples"
LAB2 = "lab02_save_policy"
INDEPENDENT = ("blank", "partial", "natural_a", "natural_b")
"""Examples whose code is not minickpt's (nor each other's): never flagged."""

pytestmark = pytest.mark.timeout(120)


@functools.cache
def _lab(name: str):
    return load_lab(ROOT / "solutions" / name / f"{name}.ipynb")


@functools.cache
def _tasks(name: str) -> dict[str, dict[str, str]]:
    return S.lab_tasks(_lab(name))


def _task_ids(name: str) -> list[str]:
    return [t for t in _tasks(name) if S.TASK_CELL.match(t)]


def _copy(name: str = LAB2) -> dict[str, str]:
    """minickpt's code of every task, renamed and reformatted, in its task cell."""
    return {t: disguise(_tasks(name)[t]["reference"]) for t in _task_ids(name)}


def _interleave(code: str, dummy) -> str:
    """``code`` with ``dummy(i)`` (a statement's source) after each statement of every block."""
    n = [0]

    class _T(ast.NodeTransformer):
        def generic_visit(self, node: ast.AST) -> ast.AST:
            super().generic_visit(node)
            for name in ("body", "orelse", "finalbody"):
                stmts = getattr(node, name, None)
                if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt) \
                        and not isinstance(node, ast.Module):
                    out = []
                    for s in stmts:
                        n[0] += 1
                        out += [s, *ast.parse(dummy(n[0])).body]
                    setattr(node, name, out)
            return node

    return ast.unparse(_T().visit(ast.parse(code))) + "\n"


def _flags(matches: list[S.Match], student: str) -> dict[str, S.Match]:
    return {m.other: m for m in matches if m.student == student and m.flagged}


def _assert_copy_flagged(copier: dict[str, str], name: str = LAB2) -> None:
    """Flagged against minickpt, and as a pair with the original: both rows name the other."""
    matches, _ = S.compare(_tasks(name), {"copier": copier, "original": _copy(name)})
    mine, theirs = _flags(matches, "copier"), _flags(matches, "original")
    assert S.MINICKPT in mine, [(m.other, m.score, m.shared) for m in matches]
    assert "original" in mine and "copier" in theirs, \
        [(m.student, m.other, m.score, m.shared) for m in matches]
    assert mine["original"].score == theirs["copier"].score


# ---------------------------------------------------------------------------------------
# copies are flagged
# ---------------------------------------------------------------------------------------
def test_renamed_and_reformatted_copy_is_flagged():
    """Other local names, other docstrings, ``ast.unparse``'s layout: 100 %."""
    _assert_copy_flagged(_copy())


def test_copy_padded_with_an_appended_block_is_flagged():
    """Ten times the copied code appended, in each task cell and a cell of its own (issue 38
    saw 10 %): containment of the smaller side scores it 100 %."""
    code = {t: src + "\n\n" + _padding(12, k) for k, (t, src) in enumerate(_copy().items())}
    code["your cell 30"] = _padding(40, 99)
    _assert_copy_flagged(code)


@pytest.mark.parametrize("dummy", [
    lambda i: "pass", lambda i: "'checked'", lambda i: f"_unused_{i} = {i}",
    lambda i: "if False:\n    raise RuntimeError('never')", lambda i: "_ = abs(7)",
    lambda i: f"_c{i} = 0\n_c{i} += {i}", lambda i: "assert True",
    lambda i: "try:\n    pass\nexcept Exception:\n    pass", lambda i: "for _ in []:\n    pass",
    lambda i: "while 0:\n    pass", lambda i: "_noop()",
], ids=["pass", "string", "unused", "if-false", "pure-call", "unused-aug", "assert-true",
        "empty-try", "empty-for", "while-0", "noop-function"])
def test_copy_with_a_dummy_statement_after_each_statement_is_flagged(dummy):
    """A statement that does nothing after every statement (issue 38 saw 32 %)."""
    code = {t: _interleave(src, dummy) for t, src in _copy().items()}
    code["your cell 1"] = "def _noop(*args):\n    '''Does nothing.'''\n    pass\n    return None\n"
    _assert_copy_flagged(code)


def test_minickpt_pasted_in_added_cells_is_flagged_where_it_is():
    """The task cells as released; minickpt's code (disguised) in cells the student added."""
    code = {t: _tasks(LAB2)[t]["stub"] for t in _task_ids(LAB2)}
    code.update({f"your cell {k}": "# my helpers\n" + src
                 for k, src in enumerate(_copy().values())})
    matches, _ = S.compare(_tasks(LAB2), {"s": code})
    m = _flags(matches, "s")[S.MINICKPT]
    assert m.where == [S.ADDED] and "found in added cells" in m.flag(), m.flag()


def test_every_lab_flags_its_renamed_copy():
    for name in sorted(p.stem.removeprefix("expected-") for p in EXAMPLES.glob("expected-*.csv")):
        _assert_copy_flagged(_copy(name), name)


# ---------------------------------------------------------------------------------------
# the example corpus, offline: the flags the grader would give, lab by lab
# ---------------------------------------------------------------------------------------
def _code_of(lab, path: Path) -> dict[str, str]:
    """What the runner keeps of a submission for the report (runner.py's ``mine``)."""
    asm = assemble(lab, read_submission(path), referee_path="/referee", key_file="/key")
    mine = [(c.grade_id or f"your cell {k}", c.show) for k, c in enumerate(asm.cells)
            if c.role == "student" and c.show.strip()]
    return S.submission_code(mine)


def _labs() -> list[str]:
    return sorted(p.stem.removeprefix("expected-") for p in EXAMPLES.glob("expected-*.csv"))


@pytest.mark.parametrize("name", _labs())
def test_the_examples_are_flagged_as_their_expected_rows_say(name):
    """Every example of the lab compared together, as the corpus run grades them: the
    review flags of expected-<lab>.csv that are similarity flags are given (with the peers a
    row names, :data:`autograder.grade.PEERS_NAMED`), and no independent example is flagged
    nor named by another's flag."""
    lab = _lab(name)
    students = {p.parent.parent.name: _code_of(lab, p)
                for p in sorted(EXAMPLES.glob(f"*/{name}/{name}.ipynb"))}
    matches, _ = S.compare(_tasks(name), students)
    with open(EXAMPLES / f"expected-{name}.csv") as f:
        expected = {r["student"]: r for r in csv.DictReader(f)}
    for s in students:
        flags = S.review_flags(matches, s)
        for want in (expected.get(s, {}).get("review") or "").split(";"):
            if want.startswith(S.SIMILAR):
                assert any(want in f for f in flags), (s, want, flags)
        if s in INDEPENDENT:
            assert not flags, (s, flags)
    assert not [(m.student, m.other) for m in matches
                if m.flagged and m.other in INDEPENDENT], name


def test_independent_pairs_score_low():
    """natural_a and natural_b (the natural short answers of 2.1 and 2.4) share little."""
    lab = _lab(LAB2)
    students = {s: _code_of(lab, EXAMPLES / s / LAB2 / f"{LAB2}.ipynb")
                for s in ("natural_a", "natural_b", "partial")}
    matches, _ = S.compare(_tasks(LAB2), students)
    assert not [m for m in matches if m.flagged]
    assert all(m.score < 0.5 for m in matches if m.other != S.MINICKPT)
    assert all(s < S.THRESHOLD for m in matches if m.other == S.MINICKPT
               for s in m.tasks.values())


def test_a_class_of_100_is_compared_in_seconds(capsys):
    """Not asserted (no timed assertions): prints the time of 100 submissions, 20 of them
    padded or dummied copies of minickpt and the rest independent variations."""
    copy = _copy()
    students = {}
    for i in range(100):
        if i % 5 == 0:
            students[f"s{i:03}"] = {t: _interleave(src, lambda j: f"_u{j} = {j}")
                                    for t, src in copy.items()}
        else:
            students[f"s{i:03}"] = {t: f"def f{i}(x):\n    return x\n\n" + _padding(4, i)
                                    for t in copy}
    t0 = time.perf_counter()
    matches, _ = S.compare(_tasks(LAB2), students)
    with capsys.disabled():
        print(f"\n100 submissions compared in {time.perf_counter() - t0:.1f} s")
    assert len(_flags(matches, "s000")) == 20  # minickpt and the 19 other copies
