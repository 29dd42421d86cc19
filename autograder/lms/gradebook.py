"""The LMS's own gradebook file, filled with one lab's points, for the LMS to import.

The instructor exports the gradebook from the LMS and hands it over; the grader writes it back
with the lab's column filled, each student matched by the LMS's own id (the one in the names of
the downloaded files), and nothing else changed:

* **Canvas** (Grades → Export → CSV): columns ``Student, ID, SIS User ID, SIS Login ID,
  Section``, then one column per assignment, ``<name> (<assignment id>)``, then read-only
  totals; its second row, ``Points Possible``, holds each assignment's maximum. ``ID`` is the
  Canvas user id of the download's file names. The lab's column is the one ``--gradebook-column``
  names, else the one whose name holds the lab's name; without one, a new column named after
  the lab is added (Canvas's import then offers to create the assignment), and its maximum goes
  into ``Points Possible``. A cell left empty is "no change" to Canvas's import.
* **Moodle** (the assignment's *Grading worksheet*: Submissions → Download grading worksheet,
  imported with *Upload grading worksheet*): columns ``Identifier, Full name, Email address,
  Status, Grade, Maximum Grade, ...``; ``Identifier`` is ``Participant <id>``, the id of the
  download's folder names. The grade goes into ``Grade`` on Moodle's scale: the lab's points
  times ``Maximum Grade`` / the lab's maximum (the same number when the assignment's maximum
  grade is set to the lab's points, as docs/grading.md advises).

A student whose hand-in failed, was refused, or was not handed in is **not** written as a 0:
their cell is left as the LMS had it and they are listed apart (``gradebook-apart-<lab>.csv``,
with the reason), for the instructor to decide. So is a student of the gradebook the grader has
no result for, and a graded student the gradebook does not list.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import safe_text

CANVAS_FIXED = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
"""The columns Canvas's gradebook export begins with (and its import requires)."""
POINTS_POSSIBLE = "Points Possible"
MOODLE_FIXED = ("Identifier", "Full name", "Email address", "Status", "Grade", "Maximum Grade")
"""The columns of Moodle's grading worksheet that the grader reads or writes."""
PARTICIPANT = re.compile(r"^\s*Participant\s+(\d+)\s*$")
APART_COLUMNS = ("student", "name", "lms_id", "status", "reason")


class GradebookError(Exception):
    """The gradebook file cannot be filled: says which file and why."""


@dataclass
class Filled:
    lms: str
    column: str
    written: int = 0
    apart: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _read(path: Path) -> tuple[list[list[str]], str]:
    """The CSV's rows, and its first line's ending (kept on writing)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GradebookError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise GradebookError(f"{path}: not UTF-8 text (export it as CSV, UTF-8)") from None
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if not rows:
        raise GradebookError(f"{path}: empty")
    return rows, "\r\n" if "\r\n" in text[:4096] else "\n"


def detect(header: list[str]) -> str:
    """``canvas`` or ``moodle`` from the header row; "" when it is neither."""
    names = [h.strip() for h in header]
    if all(c in names for c in ("Student", "ID")):
        return "canvas"
    if all(c in names for c in ("Identifier", "Grade")):
        return "moodle"
    return ""


def _fmt(x: float) -> str:
    return f"{round(x, 2):g}"


def _outcome(results: list[dict[str, Any]], lab: str) -> dict[str, dict[str, Any]]:
    """The lab's rows by LMS id (rows without one cannot be matched and are listed apart)."""
    return {r["lms_id"]: r for r in results if r["lab"] == lab and r.get("lms_id")}


def _apart(r: dict[str, Any], why: str = "") -> dict[str, str]:
    return {"student": r.get("student", ""), "name": r.get("name", ""),
            "lms_id": r.get("lms_id", ""), "status": r.get("status", ""),
            "reason": why or r.get("reason", "")}


def fill(path: Path, dest: Path, results: list[dict[str, Any]], lab: str, max_score: float,
         *, lms: str = "", column: str = "") -> Filled:
    """Write ``path``'s gradebook with ``lab``'s points to ``dest``; see the module."""
    rows, newline = _read(path)
    header = rows[0]
    lms = lms or detect(header)
    if lms not in ("canvas", "moodle"):
        raise GradebookError(f"{path}: neither a Canvas gradebook export (columns "
                             f"{', '.join(CANVAS_FIXED)}) nor a Moodle grading worksheet "
                             f"(columns {', '.join(MOODLE_FIXED)}); its header: {header[:8]}")
    by_id = _outcome(results, lab)
    filler = _canvas if lms == "canvas" else _moodle
    done, matched = filler(path, rows, by_id, lab, max_score, column)
    for r in results:
        if r["lab"] != lab or r["student"].startswith("_"):
            continue
        if not r.get("lms_id"):
            done.apart.append(_apart(r, "no LMS id (not from an LMS download): enter by hand"))
        elif r["lms_id"] not in matched:
            done.apart.append(_apart(r, f"id {r['lms_id']} is not in {path.name}"))
    with open(dest, "w", newline="", encoding="utf-8") as f:
        # not safe_text.writer: the file goes back to the LMS, which must read every cell of
        # its own as it wrote it (Moodle's "-" is "not set", not a formula to defuse); the
        # only cells the grader writes are numbers
        csv.writer(f, lineterminator=newline).writerows(rows)
    return done


def _canvas(path: Path, rows: list[list[str]], by_id: dict[str, dict[str, Any]], lab: str,
            max_score: float, column: str) -> tuple[Filled, set[str]]:
    header = [h.strip() for h in rows[0]]
    missing = [c for c in ("Student", "ID") if c not in header]
    if missing:
        raise GradebookError(f"{path}: a Canvas export has the columns {', '.join(CANVAS_FIXED)}; "
                             f"this one lacks {', '.join(missing)}")
    id_at = header.index("ID")
    if column:
        if column not in header:
            raise GradebookError(f"{path}: no column {column!r} (it has: {', '.join(header)})")
        col = header.index(column)
    else:
        named = [i for i, h in enumerate(header) if lab.lower() in h.lower()]
        if len(named) > 1:
            raise GradebookError(f"{path}: several columns name {lab} "
                                 f"({', '.join(header[i] for i in named)}): choose one with "
                                 "--gradebook-column")
        if named:
            col = named[0]
        else:  # a new assignment, before Canvas's read-only totals
            fixed = max(header.index(c) for c in CANVAS_FIXED if c in header)
            col = fixed + 1
            for row in rows:
                row.insert(col, "")
            rows[0][col] = lab
            header.insert(col, lab)
    done = Filled("canvas", rows[0][col])
    if not any(r and r[0].strip() == POINTS_POSSIBLE for r in rows[1:3]):
        rows.insert(1, ["" for _ in header])
        rows[1][0] = f"    {POINTS_POSSIBLE}"
        done.notes.append("added the Points Possible row Canvas expects under the header")
    matched: set[str] = set()
    for row in rows[1:]:
        row.extend([""] * (len(header) - len(row)))
        if row[0].strip() == POINTS_POSSIBLE:
            row[col] = _fmt(max_score)
            continue
        sid = row[id_at].strip()
        if not sid or not sid.isdigit():
            continue  # Canvas's other non-student rows ("Manual Posting", a test student)
        r = by_id.get(sid)
        if r is None:
            done.apart.append({"student": "", "name": row[header.index("Student")],
                               "lms_id": sid, "status": "no result",
                               "reason": "in the gradebook, but nothing of theirs was graded"})
            continue
        matched.add(sid)
        if r["status"] == "graded":
            row[col] = _fmt(r["total"])
            done.written += 1
        else:
            done.apart.append(_apart(r))
    return done, matched


def _moodle(path: Path, rows: list[list[str]], by_id: dict[str, dict[str, Any]], lab: str,
            max_score: float, column: str) -> tuple[Filled, set[str]]:
    header = [h.strip() for h in rows[0]]
    missing = [c for c in ("Identifier", "Grade") if c not in header]
    if missing:
        raise GradebookError(f"{path}: a Moodle grading worksheet has the columns "
                             f"{', '.join(MOODLE_FIXED)}; this one lacks {', '.join(missing)}")
    ident, col = header.index("Identifier"), header.index(column or "Grade")
    top = header.index("Maximum Grade") if "Maximum Grade" in header else -1
    done = Filled("moodle", header[col])
    matched: set[str] = set()
    scales: set[str] = set()
    for row in rows[1:]:
        row.extend([""] * (len(header) - len(row)))
        m = PARTICIPANT.match(row[ident])
        if not m:
            continue
        sid = m.group(1)
        r = by_id.get(sid)
        if r is None:
            done.apart.append({"student": "", "name": row[header.index("Full name")]
                               if "Full name" in header else "", "lms_id": sid,
                               "status": "no result",
                               "reason": "in the worksheet, but nothing of theirs was graded"})
            continue
        matched.add(sid)
        if r["status"] != "graded":
            done.apart.append(_apart(r))
            continue
        scale = max_score
        if top >= 0 and row[top].strip():
            try:
                scale = float(row[top].strip().replace(",", "."))
            except ValueError:
                raise GradebookError(f"{path}: Maximum Grade {row[top]!r} of {row[ident]} "
                                     "is not a number") from None
        else:
            if top >= 0:
                row[top] = _fmt(max_score)
        if scale != max_score:
            scales.add(_fmt(scale))
        row[col] = _fmt(r["total"] * scale / max_score if max_score else 0.0)
        done.written += 1
    if scales:
        done.notes.append(f"Moodle's Maximum Grade is {', '.join(sorted(scales))}, the lab's "
                          f"{_fmt(max_score)} points: grades were scaled to it")
    return done, matched


def write_apart(dest: Path, apart: list[dict[str, str]]) -> None:
    with open(dest, "w", newline="", encoding="utf-8") as f:
        w = safe_text.dict_writer(f, fieldnames=list(APART_COLUMNS))
        w.writeheader()
        w.writerows(sorted(apart, key=lambda a: (a["status"], a["lms_id"], a["student"])))


def fill_from_results(out: Path, book: Path, column: str, lms: str,
                      labs: list[str] | None) -> str:
    """The LMS's gradebook ``book`` filled from ``out``'s results: gradebook-<lms>-<lab>.csv
    and gradebook-apart-<lab>.csv (the students not written: failed, refused, missing, not in
    the gradebook). Returns what the terminal says."""
    from ..grade import LabInfo, _normalize, missing_results

    results = json.loads((out / "results.json").read_text())
    run = json.loads((out / "run.json").read_text())
    names = labs or sorted(run["labs"])
    if len(names) != 1:
        raise SystemExit(f"grade: --gradebook fills one lab's column; name it with --lab "
                         f"(these results hold {', '.join(names)})")
    lab = names[0]
    if lab not in run["labs"]:
        raise SystemExit(f"grade: {out} holds no results of {lab}")
    rows = results + [_normalize(r, LabInfo(lab, run["labs"][lab]["cells"]))
                      for r in missing_results(results, {lab: LabInfo(lab, {})})]
    top = sum(run["labs"][lab]["cells"].values())
    try:
        if not lms:
            with open(book, newline="", encoding="utf-8-sig") as f:
                lms = detect(next(iter(csv.reader(f)), []))
        done = fill(book, out / f"gradebook-{lms or 'lms'}-{lab}.csv", rows, lab, top,
                              lms=lms, column=column)
    except (GradebookError, OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"grade: gradebook {book}: {e}") from None
    write_apart(out / f"gradebook-apart-{lab}.csv", done.apart)
    return (f"\ngradebook: {done.written} grade(s) of {lab} written into column "
            f"{done.column!r} of gradebook-{done.lms}-{lab}.csv; {len(done.apart)} student(s) "
            f"not written, listed with why in gradebook-apart-{lab}.csv\n"
            + "".join(f"  {n}\n" for n in done.notes))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="autograder/grade.sh gradebook",
        description="Fill the LMS's exported gradebook (Canvas) or grading worksheet (Moodle) "
                    "with one lab's points from a grade.sh --out folder, for the LMS to import.")
    p.add_argument("gradebook", help="the CSV the LMS exported")
    p.add_argument("--out", required=True, help="the grade.sh --out folder (written into)")
    p.add_argument("--lab", action="append", help="the lab (needed when --out holds several)")
    p.add_argument("--gradebook-column", default="", metavar="NAME")
    p.add_argument("--lms", choices=("canvas", "moodle"), default="")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    if not (out / "results.json").exists():
        print(f"grade gradebook: {out} holds no results.json", file=sys.stderr)
        return 2
    try:
        print(fill_from_results(out, Path(a.gradebook), a.gradebook_column, a.lms, a.lab).strip())
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    return 0
