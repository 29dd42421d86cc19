"""Copies: every task cell of every submission against minickpt's own code for that task and
against the same task of every other submission of the lab in the run.

The library *is* the reference and it is installed, so a student can paste its source; two
students can hand in one notebook. Neither shows in a grade, and renaming the locals or
rewriting the docstring defeats a text diff. So the comparison is copydetect's (winnowing
fingerprints, the method of MOSS: Schleimer, Wilkerson & Aiken, SIGMOD 2003): each cell is
tokenized with Pygments, every name becomes ``V``/``F``, every string ``S``, comments go; the
k-grams of what is left are hashed and winnowed. What the released lab gives every student
(the task's signature, its docstring, the stub) is *boilerplate*: its fingerprints are
removed from every cell first, so that only what the student wrote counts.

**A submission's score against another party** (minickpt, or another student) is the share
of the submission's own task tokens, over all the tasks of the lab, that the other party's
cell of the same task also holds: a copy of the whole lab scores 1.0 however its names were
changed. It is flagged in the ``review`` column (``similar to ...``, with the score, the
tokens shared and the tasks) when the score is at least :data:`THRESHOLD` *and* at least
:data:`MIN_TOKENS` tokens are shared: two students who both wrote the natural three-line answer
of a task share a few dozen tokens at most, far below. The figures behind the threshold are in
the module's test (tests/test_grading_integrity.py) and in issue 31's report.

The flag is for a person to read, like every review flag: it never changes a grade.
``similarity-<lab>.html`` shows each flagged pair's cells side by side, the shared parts
highlighted; ``similarity-<lab>.csv`` lists every score of the run.
"""

from __future__ import annotations

import hashlib
import html
import io
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

TASK_CELL = re.compile(r"^task_\d+_\d+$")
NOISE = 25
"""k: filtered characters in a fingerprint (copydetect's default noise threshold)."""
GUARANTEE = 30
"""A shared run of filtered text this long is always found (copydetect's default)."""
THRESHOLD = 0.80
"""The least share of a submission's task code found in one other party for a flag."""
MIN_TOKENS = 200
"""The least number of shared filtered characters for a flag (a lab's worth, not a line)."""
LISTED = 0.30
"""similarity-<lab>.csv lists every score from this share up (what a threshold is set from)."""
MAX_CELL_CHARS = 100_000
"""What of one cell is compared (a longer cell is cut: the comparison stays bounded)."""
MINICKPT = "_minickpt"
"""The party that stands for the library's own code: a name no student id can have (they
begin with a letter or a digit), so a student called ``minickpt`` is compared as a student."""


def _stable_kgrams(text: str, k: int) -> Any:
    """copydetect hashes k-grams with Python's ``hash``, which differs between processes;
    the same text must give the same report in every run and in a merge."""
    import numpy as np

    return np.array([int.from_bytes(hashlib.blake2b(text[i:i + k].encode("utf-8",
                                                                         "surrogatepass"),
                                                    digest_size=8).digest(), "big", signed=True)
                     for i in range(len(text) - k + 1)], dtype=np.int64)


@contextmanager
def _stable_hashes() -> Iterator[None]:
    import copydetect.utils

    with mock.patch.object(copydetect.utils, "hashed_kgrams", _stable_kgrams):
        yield


def _fingerprint(name: str, code: str, boilerplate: Any) -> Any:
    from copydetect import CodeFingerprint

    return CodeFingerprint(name, NOISE, GUARANTEE - NOISE + 1, boilerplate=boilerplate,
                           language="python", fp=io.StringIO(code[:MAX_CELL_CHARS]))


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


@dataclass
class Match:
    """What of ``student``'s task code ``other`` holds too."""

    student: str
    other: str
    shared: int = 0                 # filtered characters of student's code also in other's
    total: int = 0                  # filtered characters of student's code compared
    tasks: dict[str, float] = field(default_factory=dict)   # task -> share
    slices: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return self.shared / self.total if self.total else 0.0

    @property
    def flagged(self) -> bool:
        return self.score >= THRESHOLD and self.shared >= MIN_TOKENS

    def flag(self) -> str:
        who = "minickpt's own code" if self.other == MINICKPT else f"{self.other}'s submission"
        tasks = ", ".join(t.removeprefix("task_").replace("_", ".")
                          for t, s in sorted(self.tasks.items()) if s >= THRESHOLD)
        return (f"similar to {who}: {self.score:.0%} of the task code ({self.shared} tokens; "
                f"tasks {tasks or '-'}); see similarity report")


def compare(tasks: dict[str, dict[str, str]], students: dict[str, dict[str, str]]
            ) -> tuple[list[Match], dict[tuple[str, str], Any]]:
    """``tasks``: task grade id -> {"reference": minickpt's code, "stub": the release's cell};
    ``students``: student -> task grade id -> their code. Returns every match with anything
    shared (each student against minickpt and against every other student), and the
    fingerprints by (party, task) for the report."""
    with _stable_hashes():
        fps: dict[tuple[str, str], Any] = {}
        for gid, t in sorted(tasks.items()):
            boiler = _fingerprint(f"stub/{gid}", t.get("stub", ""), None).hashes
            bp = sorted(boiler)
            fps[MINICKPT, gid] = _fingerprint(f"{MINICKPT}/{gid}", t["reference"], bp)
            for s, code in students.items():
                if code.get(gid, "").strip():
                    fps[s, gid] = _fingerprint(f"{s}/{gid}", code[gid], bp)
        return _matches(tasks, sorted(students), fps), fps


def _matches(tasks: dict[str, Any], students: list[str], fps: dict[tuple[str, str], Any]
             ) -> list[Match]:
    from copydetect import compare_files

    out = []
    for s in students:
        for other in [MINICKPT, *students]:
            if other == s:
                continue
            m = Match(s, other)
            for gid in sorted(tasks):
                mine, theirs = fps.get((s, gid)), fps.get((other, gid))
                if mine is None or not mine.token_coverage:
                    continue
                m.total += int(mine.token_coverage)
                if theirs is None or not mine.hashes & theirs.hashes:
                    m.tasks[gid] = 0.0
                    continue
                shared, (share, _), slices = compare_files(mine, theirs)
                shared = min(int(shared), int(mine.token_coverage))
                m.shared += shared
                m.tasks[gid] = float(share)
                m.slices[gid] = slices
            if m.shared:
                out.append(m)
    return out


def report(lab: str, matches: list[Match], fps: dict[tuple[str, str], Any]) -> str:
    """The HTML page of a lab: every flagged pair, each task's two cells side by side with
    what they share highlighted (copydetect's highlighting, HTML-escaped)."""
    from copydetect.utils import highlight_overlap

    flagged = sorted((m for m in matches if m.flagged), key=lambda m: (-m.score, m.student))
    parts = [f"<!doctype html><meta charset='utf-8'><title>similarity, {html.escape(lab)}"
             "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
             "collapse;width:100%;table-layout:fixed}td{vertical-align:top;border:1px solid "
             "#ccc;padding:4px}pre{white-space:pre-wrap;font-size:12px;margin:0}"
             ".hl{background:#fbb}.hr{background:#bfb}</style>",
             f"<h1>Similarity of task code, {html.escape(lab)}</h1>",
             f"<p>Winnowing fingerprints (copydetect; k={NOISE}, guarantee {GUARANTEE}); the "
             f"released stub's fingerprints removed. Flagged: a submission of which at least "
             f"{THRESHOLD:.0%} of the task code, and at least {MIN_TOKENS} tokens, is also in "
             f"one other party. A flag is for a person to read; it changes no grade.</p>",
             f"<p>{len(flagged)} flagged pair(s).</p>"]
    for m in flagged:
        parts.append(f"<h2>{html.escape(m.student)} ↔ {html.escape(m.other)}: "
                     f"{m.score:.0%} ({m.shared} of {m.total} tokens)</h2><table>")
        for gid in sorted(m.slices):
            left, right = fps[m.student, gid], fps[m.other, gid]
            a, b = m.slices[gid]
            hl_a, _ = highlight_overlap(left.raw_code, a, "<span class='hl'>", "</span>",
                                        escape_html=True)
            hl_b, _ = highlight_overlap(right.raw_code, b, "<span class='hr'>", "</span>",
                                        escape_html=True)
            parts.append(f"<tr><td colspan=2><b>{html.escape(gid)}</b>: "
                         f"{m.tasks[gid]:.0%}</td></tr><tr><td><pre>{hl_a}</pre></td>"
                         f"<td><pre>{hl_b}</pre></td></tr>")
        parts.append("</table>")
    return "\n".join(parts) + "\n"
