"""An instructor's decisions, kept across regrades: points and a comment per student and test.

After a review flag, or a test that judged an unusual but right answer wrongly, the instructor
writes ``overrides.csv`` in the ``--out`` folder::

    student,lab,test,points,comment
    alice,lab01_basics,test_1_3_roundtrip,4,"read by hand: right, the test missed a dtype"

``student`` is the row's key, the name as the LMS gave it, or the LMS id. Every later write of
that folder (a run, a regrade of anyone, a merge) applies the file again to the results as
graded: the grader's points are kept beside the instructor's (``overrides`` in results.json),
the totals and every CSV use the instructor's, and the student's feedback page shows both and
the comment. So a decision costs no regrade, and a regrade never loses one.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = "overrides.csv"
COLUMNS = ("student", "lab", "test", "points", "comment")


class OverrideError(Exception):
    """overrides.csv cannot be used as written: says which line and why."""


@dataclass(frozen=True)
class Override:
    line: int
    student: str
    lab: str
    test: str
    points: float
    comment: str


def load(path: Path, cells: dict[str, dict[str, float]]) -> list[Override]:
    """The overrides of ``path`` ([] when there is none), checked against the labs' tests
    (``cells``: lab -> test -> points): an unknown lab or test, or points outside
    0..the test's points, is an :class:`OverrideError` naming the line."""
    if not path.exists():
        return []
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = set(COLUMNS[:4]) - set(reader.fieldnames or ())
            if missing:
                raise OverrideError(f"{path}: the header lacks {', '.join(sorted(missing))} "
                                    f"(want {','.join(COLUMNS)})")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise OverrideError(f"{path}: cannot be read ({e})") from None
    out = []
    for n, row in enumerate(rows, start=2):
        student, lab, test = ((row.get(k) or "").strip() for k in ("student", "lab", "test"))
        if not (student or lab or test):
            continue  # a blank line
        where = f"{path}, line {n}"
        if lab not in cells:
            raise OverrideError(f"{where}: no lab {lab!r} in these results "
                                f"({', '.join(sorted(cells))})")
        if test not in cells[lab]:
            raise OverrideError(f"{where}: {lab} has no test {test!r}")
        try:
            points = float((row.get("points") or "").strip())
        except ValueError:
            raise OverrideError(f"{where}: points {row.get('points')!r} is not a number") from None
        if not (math.isfinite(points) and 0 <= points <= cells[lab][test]):
            raise OverrideError(f"{where}: points {points:g} outside 0..{cells[lab][test]:g} "
                                f"for {test}")
        out.append(Override(n, student, lab, test, points, (row.get("comment") or "").strip()))
    return out


def _who(r: dict[str, Any]) -> set[str]:
    return {x for x in (r.get("student"), r.get("name"), r.get("lms_id")) if x}


def apply(results: list[dict[str, Any]], overrides: list[Override]) -> list[str]:
    """Set every result's scores to the grader's, then to the overrides that name it
    (the last line for a test wins); record them in ``result["overrides"]``. Idempotent, so
    results read back from results.json take them again unchanged. Returns a warning per
    override that names no student of the results."""
    used: set[int] = set()
    for r in results:
        graded = {o["test"]: o["graded"] for o in r.get("overrides", [])}
        scores = dict(r.get("scores", {}))
        scores.update(graded)
        mine: dict[str, Override] = {}
        for o in overrides:
            if o.lab == r["lab"] and o.student in _who(r):
                mine[o.test] = o
                used.add(o.line)
        r["overrides"] = [{"test": t, "graded": scores.get(t, 0.0), "points": o.points,
                           "comment": o.comment, "line": o.line} for t, o in sorted(mine.items())]
        for t, o in mine.items():
            scores[t] = o.points
        r["scores"] = scores
    return [f"{FILE}, line {o.line}: no student {o.student!r} has {o.lab} in these results; "
            "not applied" for o in overrides if o.line not in used]
