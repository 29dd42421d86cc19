"""What every lab's examples are made from: the reference answers (``perfect``), the blank
release, and small edits of a notebook's cells (``_cell``, ``_replace``, ``_append`` ...)."""

from __future__ import annotations

import copy
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nbformat

from ..notebook_io import BEGIN, END

Edit = Callable[[Any, Any], Any]


def _gid(cell: Any) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


def _cell(nb: Any, grade_id: str) -> Any:
    for c in nb.cells:
        if _gid(c) == grade_id:
            return c
    raise KeyError(f"no cell with grade_id {grade_id!r}")


def _replace(nb: Any, grade_id: str, old: str, new: str) -> None:
    cell = _cell(nb, grade_id)
    if old not in cell.source:
        raise ValueError(f"example edit: {old!r} not found in cell {grade_id}; update "
                         "autograder/make_examples.py to the new reference code")
    cell.source = cell.source.replace(old, new, 1)


def perfect(release: Any, source: Any) -> Any:
    """Every solution cell of the release gets the reference code (markers removed)."""
    nb = copy.deepcopy(release)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            src = _cell(source, meta["grade_id"]).source
            cell.source = "\n".join(line for line in src.split("\n")
                                    if line.strip() not in (BEGIN, END))
    return nb


def _answers(nb: Any, **answers: str) -> None:
    for name, value in answers.items():
        _cell(nb, f"quiz_{name.lower()}").source = f"{name} = {value}"


def blank(release: Any, source: Any) -> Any:
    """The released lab, handed in untouched."""
    return copy.deepcopy(release)


def _append(nb: Any, grade_id: str, code: str) -> None:
    cell = _cell(nb, grade_id)
    cell.source = cell.source.rstrip("\n") + "\n\n\n" + code.strip("\n")


def _after_docstring(nb: Any, grade_id: str, function: str, code: str) -> None:
    """Put ``code`` (indented) first in the body of ``function`` in the cell ``grade_id``."""
    cell = _cell(nb, grade_id)
    head, sep, tail = cell.source.partition(f"def {function}(")
    if not sep:
        raise ValueError(f"example edit: no function {function} in cell {grade_id}")
    end = tail.index('"""', tail.index('"""') + 3) + 3
    body = "\n".join("    " + line if line else "" for line in code.strip("\n").split("\n"))
    cell.source = head + sep + tail[:end] + "\n" + body + tail[end:]


# -- issue 20's classes, as generic edits that work on any lab's release and source --------
def _first(nb: Any, prefix: str) -> Any:
    """The first solution cell whose grade_id starts with ``prefix`` (``task_``, ``quiz_``)."""
    for c in nb.cells:
        if _gid(c).startswith(prefix) and c.metadata.get("nbgrader", {}).get("solution"):
            return c
    raise KeyError(f"no solution cell {prefix}*")


def _insert_after(nb: Any, cell: Any, code: str) -> None:
    """A new cell of the student's own, right after ``cell``."""
    new = nbformat.v4.new_code_cell(code.strip("\n"))
    new["id"] = f"mine-{len(nb.cells)}"
    nb.cells.insert(nb.cells.index(cell) + 1, new)


# -- issue 39: the wrong-solution corpus -------------------------------------------------
@dataclass(frozen=True)
class Wrong:
    """A plausible wrong version of one task: what a capable student might write, breaking
    exactly one clause of the task's contract (a guarantee, or a "raises" clause)."""

    task: str
    """The task ID, as in the lab heading ("2.4")."""
    clause: str
    """The clause it breaks, in a line, as the task's docstring or chapter states it."""
    edit: Callable[[Any], None]
    """Changes the task's cell(s) of a notebook that holds the reference answers."""


def wrong_examples(wrongs: Sequence[Wrong]) -> dict[str, Edit]:
    """``wrong_a`` holds the first wrong version of every task, ``wrong_b`` the second ...

    Each task is scored by its own test cells, so one submission carries one wrong version
    per task, and the corpus costs a few graded submissions a lab, not one per version. Each
    must lose that task's points (expected-<lab>.csv; tests/test_wrong_corpus.py checks the
    rows and the count per task)."""
    by_task: dict[str, list[Wrong]] = {}
    for w in wrongs:
        by_task.setdefault(w.task, []).append(w)
    depth = max((len(v) for v in by_task.values()), default=0)
    out: dict[str, Edit] = {}
    for i in range(depth):
        chosen = tuple(v[i] for v in by_task.values() if i < len(v))

        def make(release: Any, source: Any, chosen: tuple[Wrong, ...] = chosen) -> Any:
            nb = perfect(release, source)
            for w in chosen:
                w.edit(nb)
            return nb

        make.__doc__ = "Wrong versions: " + "; ".join(f"{w.task}: {w.clause}" for w in chosen)
        make.wrongs = chosen  # type: ignore[attr-defined]
        out[f"wrong_{string.ascii_lowercase[i]}"] = make
    return out


def swap(grade_id: str, old: str, new: str) -> Callable[[Any], None]:
    """An edit for :class:`Wrong`: ``old`` -> ``new`` in the cell ``grade_id``."""
    return lambda nb: _replace(nb, grade_id, old, new)
