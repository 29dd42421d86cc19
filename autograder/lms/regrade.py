"""Regrading some students into a class's results, in place, losing nothing.

``grade.sh RESUBMISSIONS --out CLASS --update`` (or ``--student ID ...``) grades only what it
is given and writes ``CLASS`` again from the class's previous results with those rows
replaced: every other row, feedback page and log is carried over unchanged (the files are
written from the same results by the same code, so they are the same bytes), and each row it
replaced is said on the terminal and appended to ``regrades.csv`` (when, who, the points and
status before and after, the file graded). A regrade never silently replaces a result.

The previous folder is copied aside (into the work folder) before anything is written, so a
regrade that fails half-way leaves the class's files as they were, and the pages of the other
students are copied from that copy.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import safe_text

LOG = "regrades.csv"
LOG_COLUMNS = ("when", "student", "lab", "before", "after", "status_before", "status_after",
               "file")
KEPT = ("overrides.csv", LOG)
"""The files of ``--out`` that are the instructor's, not the grader's: every write keeps them."""


class RegradeError(Exception):
    """The previous results cannot be updated (unreadable, another source): says why."""


@dataclass
class Previous:
    """A class's results as a previous run wrote them, copied aside."""

    folder: Path
    results: list[dict[str, Any]]
    labs: dict[str, dict[str, Any]]
    intake: list[dict[str, str]] = field(default_factory=list)

    def files(self) -> dict[tuple[str, str], dict[str, Path]]:
        """Where each row's page and logs are in the copy (what write_outputs copies)."""
        out = {}
        for r in self.results:
            logs = self.folder / "logs" / r["student"]
            out[r["lab"], r["student"]] = {
                "feedback": self.folder / r["feedback"] if r.get("feedback") else Path("-"),
                **{kind: logs / f"{r['lab']}.{kind}" for kind in ("log", "grader")}}
        return out


def load(out: Path, aside: Path) -> Previous | None:
    """The results in ``out`` (None when it holds none), after copying ``out`` to ``aside``."""
    if not (out / "results.json").exists():
        return None
    try:
        results = json.loads((out / "results.json").read_text())
        run = json.loads((out / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise RegradeError(f"{out}: its results.json or run.json cannot be read ({e}); "
                           "regrade the whole class instead") from None
    if aside.exists():
        shutil.rmtree(aside)
    shutil.copytree(out, aside, symlinks=True)
    intake = []
    if (aside / "intake.csv").exists():
        with open(aside / "intake.csv", newline="", encoding="utf-8") as f:
            intake = list(csv.DictReader(f))
    return Previous(aside, results, run.get("labs", {}), intake)


def check_labs(previous: Previous, fingerprints: dict[str, str]) -> None:
    """A lab graded now from another source than before would mix two gradings in one table."""
    for lab, fp in fingerprints.items():
        old = previous.labs.get(lab, {}).get("fingerprint")
        if old and old != fp:
            raise RegradeError(f"{lab} was graded from another source before (tests or points "
                               "differ): regrade the whole class, or use the same --source")


def combine(previous: Previous, new: list[dict[str, Any]]
            ) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any] | None, dict[str, Any]]]]:
    """The class's rows with ``new`` in place of the rows they regrade; and the pairs
    (before or None, after) for every new row."""
    fresh = {(r["student"], r["lab"]): r for r in new}
    kept = [r for r in previous.results if (r["student"], r["lab"]) not in fresh]
    before = {(r["student"], r["lab"]): r for r in previous.results}
    known = {r["student"]: r for r in previous.results}
    for r in new:  # a resubmission handed over as <student>/<lab>/<lab>.ipynb: the class's
        old = known.get(r["student"])  # name and LMS id stay the student's
        if old and not r.get("lms_id"):
            r.update(name=old.get("name", r["student"]), lms_id=old.get("lms_id", ""))
    changes = [(before.get(k), r) for k, r in sorted(fresh.items())]
    return kept + new, changes


def combine_intake(previous: Previous, rows: list[dict[str, str]],
                   regraded: set[str]) -> list[dict[str, str]]:
    """The previous intake report without the regraded students' files, and this run's."""
    kept = [r for r in previous.intake if r.get("student") not in regraded]
    seen = {tuple(r.values()) for r in kept}  # a file no student owns, read again
    return kept + [r for r in rows if tuple(r.values()) not in seen]


def describe(changes: list[tuple[dict[str, Any] | None, dict[str, Any]]],
             files: dict[tuple[str, str], str]) -> list[dict[str, str]]:
    """One line of regrades.csv per change."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for old, r in changes:
        total = sum(float(v or 0) for v in r.get("scores", {}).values())
        rows.append({"when": when, "student": r["student"], "lab": r["lab"],
                     "before": "" if old is None else f"{old.get('total', 0):g}",
                     "after": f"{total:g}",
                     "status_before": "new" if old is None else old.get("status", ""),
                     "status_after": r.get("status", ""),
                     "file": files.get((r["student"], r["lab"]), "")})
    return rows


def append_log(out: Path, rows: list[dict[str, str]]) -> None:
    path = out / LOG
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = safe_text.dict_writer(f, fieldnames=list(LOG_COLUMNS))
        if new:
            w.writeheader()
        w.writerows(rows)


def save_kept(out: Path) -> dict[str, bytes]:
    """The instructor's files of ``out`` (:data:`KEPT`), read before the folder is emptied."""
    return {name: (out / name).read_bytes() for name in KEPT if (out / name).is_file()}


def restore_kept(out: Path, kept: dict[str, bytes]) -> None:
    for name, data in kept.items():
        (out / name).write_bytes(data)


def into(previous: Previous, results: list[dict[str, Any]],
         files: dict[tuple[str, str], dict[str, Path]], infos: dict[str, Any],
         intake_rows: list[dict[str, str]], graded_files: dict[tuple[str, str], str]
         ) -> tuple[list[dict[str, Any]], dict[tuple[str, str], dict[str, Path]],
                    dict[str, Any], list[dict[str, str]], list[dict[str, str]]]:
    """This run's rows, pages and intake report put into the class's previous ones; each
    replaced row said on the terminal. Returns results, files, labs, intake rows and the lines
    for regrades.csv (appended once the outputs are written)."""
    from ..grade import LabInfo

    results, changes = combine(previous, results)
    files = {**previous.files(), **files}
    for lab, d in previous.labs.items():
        infos.setdefault(lab, LabInfo(lab, d["cells"], d.get("fingerprint", ""),
                                      d.get("questions", {}), d.get("tasks", {})))
    intake_rows = combine_intake(previous, intake_rows, {r["student"] for _, r in changes})
    log = describe(changes, graded_files)
    for row in log:
        print(f"grade: regraded {row['student']}/{row['lab']}: " + (
              f"replaced {row['before']} points ({row['status_before']})" if
              row["status_before"] != "new" else "new in these results")
              + f" with {row['after']} ({row['status_after']}); see regrades.csv", flush=True)
    return results, files, dict(sorted(infos.items())), intake_rows, log


def warn_dropped(out: Path, results: list[dict[str, Any]]) -> None:
    """A plain run into a class's ``out`` replaces its results: say which rows it drops."""
    try:
        before = {(r["student"], r["lab"]) for r in
                  json.loads((out / "results.json").read_text())}
    except (OSError, ValueError):
        return
    dropped = sorted(before - {(r["student"], r["lab"]) for r in results})
    if dropped:
        print(f"grade: REPLACING the results in {out}: {len(dropped)} row(s) of its previous run "
              "are not in this one and are dropped ("
              + ", ".join(f"{s}/{lab}" for s, lab in dropped[:10])
              + (", ..." if len(dropped) > 10 else "")
              + "); to regrade some students into a class's results, use --update or "
              "--student", file=sys.stderr, flush=True)
