"""An LMS download turned into one submission per student and lab, every file accounted for.

An instructor hands the grader what their LMS gave them, as it came:

* ``course``: the repository's own layout, ``<student>/<lab>/<lab>.ipynb``;
* ``canvas``: Canvas's "Download Submissions", a flat zip of
  ``<name>[_LATE]_<user id>_<submission id>_<file name>`` (``smithjane_12345_678901_lab01_basics.ipynb``;
  a file uploaded again under the same name becomes ``lab01_basics-1.ipynb``, ``-2`` ...);
* ``moodle``: Moodle's "Download submissions" with "Download submissions in folders", one
  folder per student, ``<Full Name>_<participant id>_assignsubmission_file_/<file name>``
  (also the flat variant without the slash);
* ``pattern``: anything else, through a regular expression with named groups, the way
  nbgrader's ``zip_collect`` reads file names (:class:`nbgrader.plugins.zipcollect.
  FileNameCollectorPlugin`, which this module uses): ``student_id`` and ``file_id`` are
  required; ``name`` (the student's name as the LMS spells it) and ``timestamp`` (any date
  nbgrader's ``parse_utc`` reads) are optional.

Per student and lab the *newest* notebook is graded: the latest ``timestamp`` where the pattern
gives one, else the highest resubmission number (``-2`` over ``-1`` over none), then the
LMS's submission id, then the file's time (a zip's own record of it). The others are
``superseded`` by it, and say so. Everything else is ``refused`` with its reason: a file that is
not a notebook, an autosave copy, a file naming no known lab, one no student can be read from.
A student found only in refused files still gets a row (status ``refused``) in every output:
nobody vanishes.

A student's key (their folder under ``feedback/``, their row's ``student``) is the name itself
when it is a plain id (letters, digits, ``._-``), else a safe ASCII form with the LMS id
(``Jane-Smith_12345``) or, without one, a short hash of the name (``student-3f2a9c1b``): a
name like ``张伟`` or ``Jane Smith`` keeps its row; the CSVs keep the name as given.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

STUDENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
"""What a student key may be (the same rule as autograder.grade.STUDENT_RE)."""
LAYOUTS = ("auto", "course", "canvas", "moodle", "pattern")
PATTERNS = {
    "canvas": r"(?:.*/)?(?P<name>[^/_]+?)_(?:(?P<late>LATE)_)?(?P<student_id>\d+)_"
              r"(?P<submission_id>\d+)_(?P<file_id>[^/]+)$",
    "moodle": r"(?:.*/)?(?P<name>[^/]+?)_(?P<student_id>\d+)_assignsubmission_file_/?"
              r"(?P<file_id>.+)$",
}
"""The named regular expressions of the two LMS downloads (nbgrader's ``named_regexp``)."""
RESUBMISSION = re.compile(r"^(?P<stem>.*?)(?:-(?P<n>\d+)| \((?P<m>\d+)\))$")
"""A file name's resubmission suffix: Canvas's ``-1``, a browser's or Moodle's `` (1)``."""
GRADED, SUPERSEDED, REFUSED = "graded", "superseded", "refused"
MAX_ZIP_BYTES = 2 << 30
MAX_ZIP_FILES = 100_000

_QUIET = logging.getLogger("autograder.lms.intake")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class IntakeError(Exception):
    """The input cannot be read at all (a broken zip, a bad pattern): says what and where."""


@dataclass(frozen=True)
class Student:
    key: str
    name: str
    lms_id: str = ""


@dataclass
class FileRow:
    """One file of the input and what became of it (a row of ``intake.csv``)."""

    file: str
    status: str
    reason: str = ""
    student: str = ""
    name: str = ""
    lms_id: str = ""
    lab: str = ""
    late: bool = False

    def as_row(self) -> dict[str, str]:
        return {"file": self.file, "status": self.status, "student": self.student,
                "name": self.name, "lms_id": self.lms_id, "lab": self.lab,
                "late": "yes" if self.late else "", "reason": self.reason}


INTAKE_COLUMNS = ("file", "status", "student", "name", "lms_id", "lab", "late", "reason")


@dataclass
class Intake:
    """What was found: the notebook to grade per (student key, lab), the students, every file."""

    layout: str
    chosen: dict[tuple[str, str], Path] = field(default_factory=dict)
    refused: dict[tuple[str, str], str] = field(default_factory=dict)
    """(student, lab) with nothing gradable: the reason (a ``refused`` row in every output)."""
    students: dict[str, Student] = field(default_factory=dict)
    files: list[FileRow] = field(default_factory=list)
    notes: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """Per (student, lab): what the feedback page says about the hand-in (late, superseded)."""

    def label(self, results: list[dict[str, Any]]) -> None:
        """Each result gets its student's name as given and LMS id, and the notes about its
        hand-in (late, superseded files) that its feedback page shows."""
        for r in results:
            who = self.students.get(r["student"])
            r.update(name=who.name if who else r["student"], lms_id=who.lms_id if who else "",
                     intake=self.notes.get((r["student"], r["lab"]), []))

    def skip(self, pairs: set[tuple[str, str]], why: str) -> None:
        """These pairs are not graded after all (the attack examples without a sandbox)."""
        for f in self.files:
            if (f.student, f.lab) in pairs and f.status == GRADED:
                f.status, f.reason = REFUSED, why

    def keep(self, pairs: set[tuple[str, str]]) -> None:
        """Only these (student, lab) pairs (a tour, a shard, ``--student``): the rest's files
        leave the report, which then lists what this run took from the input."""
        self.chosen = {k: v for k, v in self.chosen.items() if k in pairs}
        self.refused = {k: v for k, v in self.refused.items() if k in pairs}
        self.files = [f for f in self.files if not f.student or (f.student, f.lab) in pairs
                      or (f.lab == "" and any(s == f.student for s, _ in pairs))]
        used = {s for s, _ in pairs}
        self.students = {k: v for k, v in self.students.items() if k in used}


def student_key(name: str, lms_id: str = "") -> str:
    """A key that can be a folder and a CSV id for a student named ``name`` (see the module)."""
    if STUDENT_RE.match(name) and lms_id in ("", name):
        return name
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", ascii_name).strip("-._")[:60] or "student"
    if lms_id:
        tail = re.sub(r"[^A-Za-z0-9._-]+", "-", lms_id).strip("-._")[:30]
        if tail and tail == lms_id:
            return f"{slug}_{tail}"
    return f"{slug}-{hashlib.sha256(f'{name}|{lms_id}'.encode()).hexdigest()[:8]}"


# ---------------------------------------------------------------------------------------
# unpacking
# ---------------------------------------------------------------------------------------
def unpack(archive: Path, dest: Path) -> Path:
    """Extract an LMS zip, refusing absolute paths, ``..``, links and zip bombs, and keeping
    each file's time from the zip (the newest resubmission may be decided by it)."""
    try:
        zf = zipfile.ZipFile(archive)
    except (OSError, zipfile.BadZipFile) as e:
        raise IntakeError(f"{archive}: not a readable zip file ({e})") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_ZIP_FILES or sum(i.file_size for i in infos) > MAX_ZIP_BYTES:
            raise IntakeError(f"{archive} holds too many or too large files")
        for info in infos:
            name = info.filename
            if name.startswith(("/", "\\")) or ".." in Path(name).parts \
                    or (info.external_attr >> 28) == 0o12:
                raise IntakeError(f"refusing unsafe path {name!r} in {archive}")
        zf.extractall(dest)
        for info in infos:
            if not info.is_dir():
                try:
                    t = time.mktime((*info.date_time, 0, 0, -1))
                    os.utime(dest / info.filename, (t, t))
                except (OSError, OverflowError, ValueError):
                    pass
    return dest


# ---------------------------------------------------------------------------------------
# finding
# ---------------------------------------------------------------------------------------
def _entries(folder: Path) -> list[tuple[str, Path, os.stat_result]]:
    """Every entry of the input that is not a plain folder (files, links, pipes), and
    folders named ``*.ipynb`` (a hand-in that is a folder is graded as a failure, by name),
    as (relative posix path, path, lstat), sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted([*files, *[d for d in dirs if d.endswith(".ipynb")]]):
            p = Path(root) / name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            found.append((p.relative_to(folder).as_posix(), p, st))
        # a folder that is a symbolic link is listed (in dirs) but never entered
        for d in [d for d in dirs if (Path(root) / d).is_symlink()]:
            p = Path(root) / d
            if not d.endswith(".ipynb"):
                found.append((p.relative_to(folder).as_posix(), p, os.lstat(p)))
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()
                   and not d.endswith(".ipynb")]
    return sorted(found, key=lambda e: e[0])


def _junk(rel: str) -> str:
    """Why a file is never a hand-in ("" if it may be one)."""
    parts = PurePosixPath(rel).parts
    if ".ipynb_checkpoints" in parts:
        return "a Jupyter autosave copy (.ipynb_checkpoints), not a hand-in"
    if "__MACOSX" in parts or any(p.startswith(".") for p in parts):
        return "a hidden or system file, not a hand-in"
    return ""


def _split_resubmission(file_id: str) -> tuple[str, str, int]:
    """(stem, suffix, resubmission number) of a file name: ``lab01_basics-2.ipynb`` ->
    (``lab01_basics``, ``.ipynb``, 2)."""
    base = PurePosixPath(file_id).name
    stem, dot, ext = base.rpartition(".")
    if not dot:
        stem, ext = base, ""
    m = RESUBMISSION.match(stem)
    n = 0
    if m and (m.group("n") or m.group("m")):
        stem, n = m.group("stem"), int(m.group("n") or m.group("m"))
    return stem, ("." + ext) if dot else "", n


def _lab_of(stem: str, labs: set[str]) -> str:
    """The lab a file name names: exactly, or as the only known lab inside it; the only lab
    of the run when it names none; "" when it cannot be told."""
    if stem in labs:
        return stem
    inside = [lab for lab in labs if lab.lower() in stem.lower()]
    if len(inside) == 1:
        return inside[0]
    if not inside and len(labs) == 1:
        return next(iter(labs))
    return ""


def detect(entries: list[tuple[str, Path, os.stat_result]], labs: set[str]) -> str:
    """The layout most of the input's files follow (``course`` when nothing matches)."""
    votes = {"course": 0, "canvas": 0, "moodle": 0}
    for rel, _, _ in entries:
        parts = PurePosixPath(rel).parts
        if len(parts) >= 3 and parts[-2] in labs and parts[-1] == f"{parts[-2]}.ipynb":
            votes["course"] += 1
        elif re.match(PATTERNS["moodle"], rel):
            votes["moodle"] += 1
        elif re.match(PATTERNS["canvas"], rel):
            votes["canvas"] += 1
    best = max(votes.values())
    return "course" if best == 0 or votes["course"] == best else \
        ("moodle" if votes["moodle"] == best else "canvas")


@dataclass
class _Candidate:
    rel: str
    path: Path
    student: Student
    lab: str
    order: tuple[Any, ...]
    late: bool = False


def collect(folder: Path, labs: set[str], layout: str = "auto",
            pattern: str | None = None) -> Intake:
    """Read ``folder`` (an unpacked download) into an :class:`Intake` (see the module)."""
    if layout not in LAYOUTS:
        raise IntakeError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if pattern is not None:
        layout = "pattern"
    entries = _entries(folder)
    if layout == "auto":
        layout = detect(entries, labs)
    intake = Intake(layout)
    candidates: list[_Candidate] = []
    by_id: dict[str, Student] = {}  # one student per LMS id, however a file spells the name
    attributed: dict[tuple[str, str], list[str]] = {}  # (student, lab) -> refusal reasons
    if layout in ("canvas", "moodle", "pattern"):
        regexp = pattern if layout == "pattern" else PATTERNS[layout]
        try:
            compiled = re.compile(regexp)
        except re.error as e:
            raise IntakeError(f"--pattern {regexp!r} is not a regular expression: {e}") from None
        need = {"student_id", "file_id"} - set(compiled.groupindex)
        if need:
            raise IntakeError(f"--pattern {regexp!r} lacks the named group(s) "
                              f"{', '.join(sorted(need))} (see docs/grading.md)")
        from nbgrader.plugins.zipcollect import FileNameCollectorPlugin

        plugin = FileNameCollectorPlugin(named_regexp=regexp, valid_ext=[".ipynb"], log=_QUIET)
    for rel, path, st in entries:
        why = _junk(rel)
        if why:
            intake.files.append(FileRow(rel, REFUSED, why))
            continue
        if layout == "course":
            _course(rel, path, labs, intake, candidates, attributed, st)
            continue
        is_nb = rel.endswith(".ipynb")
        got = plugin.collect(rel) if is_nb else None
        m = compiled.match(rel)
        if got is None and m is None:
            intake.files.append(FileRow(rel, REFUSED, f"its name does not follow the {layout} "
                                                      "layout: no student can be read from it"))
            continue
        groups = got if got is not None else m.groupdict()  # type: ignore[union-attr]
        lms_id = (groups.get("student_id") or "").strip()
        name = (groups.get("name") or lms_id).strip()
        student = by_id.setdefault(lms_id, Student(student_key(name, lms_id), name, lms_id))
        intake.students.setdefault(student.key, student)
        stem, ext, resub = _split_resubmission(groups.get("file_id") or "")
        lab = _lab_of(stem, labs)
        late = bool(groups.get("late"))
        row = FileRow(rel, REFUSED, "", student.key, name, lms_id, lab, late)
        intake.files.append(row)
        if not lab:
            row.reason = f"its name {stem!r} names none of the labs {', '.join(sorted(labs))}"
            attributed.setdefault((student.key, ""), []).append(row.reason)
            continue
        if ext != ".ipynb":
            row.reason = f"not a notebook ({ext or 'no extension'}): only .ipynb is graded"
            attributed.setdefault((student.key, lab), []).append(f"{rel}: {row.reason}")
            continue
        when = _timestamp(groups.get("timestamp"), rel)
        if isinstance(when, str):
            row.reason = when
            attributed.setdefault((student.key, lab), []).append(f"{rel}: {when}")
            continue
        order = (when is not None, when or 0.0, resub, int(groups.get("submission_id") or 0),
                 st.st_mtime, rel)
        candidates.append(_Candidate(rel, path, student, lab, order, late))
    _choose(intake, candidates, attributed, labs)
    return intake


def _timestamp(text: str | None, rel: str) -> float | str | None:
    """The pattern's ``timestamp`` as seconds (None without one); a reason if unreadable."""
    if not text:
        return None
    from nbgrader.utils import parse_utc

    try:
        return parse_utc(text).timestamp()
    except (ValueError, OverflowError, TypeError):
        return f"its timestamp {text!r} cannot be read as a date"


def _course(rel: str, path: Path, labs: set[str], intake: Intake,
            candidates: list[_Candidate], attributed: dict[tuple[str, str], list[str]],
            st: os.stat_result) -> None:
    parts = PurePosixPath(rel).parts
    if len(parts) < 3 or parts[-2] not in labs:
        known = len(parts) >= 2 and parts[-1].endswith(".ipynb") and \
            _lab_of(_split_resubmission(parts[-1])[0], labs)
        intake.files.append(FileRow(rel, REFUSED, "not in the layout <student>/<lab>/<lab>.ipynb"
                                    + (" (a notebook outside its lab's folder)" if known else "")))
        return
    name, lab = parts[-3], parts[-2]
    student = Student(student_key(name), name)
    intake.students.setdefault(student.key, student)
    if parts[-1] != f"{lab}.ipynb":
        why = f"beside {lab}.ipynb: only the lab's own notebook is graded"
        intake.files.append(FileRow(rel, REFUSED, why, student.key, name, "", lab))
        attributed.setdefault((student.key, lab), []).append(
            f"{rel}: not {lab}.ipynb (only {student.name}/{lab}/{lab}.ipynb is graded)")
        return
    intake.files.append(FileRow(rel, REFUSED, "", student.key, name, "", lab))
    candidates.append(_Candidate(rel, path, student, lab, (False, 0.0, 0, 0, st.st_mtime, rel)))


def _choose(intake: Intake, candidates: list[_Candidate],
            attributed: dict[tuple[str, str], list[str]], labs: set[str]) -> None:
    """The newest candidate per (student, lab) is graded, the others superseded by it; a
    (student, lab) with refused files only is a refused row; a student whose files name no
    lab at all gets a refused row for every lab of the run."""
    rows = {r.file: r for r in intake.files}
    by_pair: dict[tuple[str, str], list[_Candidate]] = {}
    for c in candidates:
        by_pair.setdefault((c.student.key, c.lab), []).append(c)
    for pair, found in sorted(by_pair.items()):
        found.sort(key=lambda c: c.order)
        newest = found[-1]
        intake.chosen[pair] = newest.path
        rows[newest.rel].status, rows[newest.rel].reason = GRADED, \
            f"the newest of {len(found)}" if len(found) > 1 else ""
        notes = intake.notes.setdefault(pair, [])
        if newest.late:
            notes.append(f"handed in late: {newest.rel} (the LMS marked it LATE)")
        for old in found[:-1]:
            rows[old.rel].status = SUPERSEDED
            rows[old.rel].reason = f"superseded by {newest.rel}"
        if len(found) > 1:
            notes.append(f"graded {newest.rel}, the newest of {len(found)} hand-ins; superseded: "
                         + ", ".join(o.rel for o in reversed(found[:-1])))
        if not notes:
            del intake.notes[pair]
    run_labs = sorted({c.lab for c in candidates} | {lab for _, lab in attributed if lab}
                      or labs)  # a file naming no lab: a row for each lab of the run
    for (key, lab), reasons in sorted(attributed.items(), key=lambda kv: (kv[0][1] == "", kv[0])):
        targets = [lab] if lab else run_labs
        for t in targets:
            if (key, t) in intake.chosen:
                continue
            if not lab and any(k == key for k, _ in [*intake.chosen, *intake.refused]):
                continue  # the student has rows; a stray file is in the intake report
            old = intake.refused.get((key, t))
            text = "; ".join(reasons)
            intake.refused[key, t] = f"{old}; {text}" if old else \
                f"nothing gradable was handed in: {text}"


def refused_result(student: str, lab: str, reason: str, info: Any,
                   folder: Path) -> dict[str, Any]:
    """The row of a student whose hand-in of ``lab`` was refused at intake (nothing gradable),
    with a feedback page that says why: a refused file is a row, never only a line on stderr."""
    from .. import feedback

    r = {"student": student, "lab": lab, "status": "refused", "reason": reason,
         "isolation": "", "ran_all_cells": False, "scores": dict.fromkeys(info.cells, 0.0),
         "messages": {}, "notes": [], "review": []}
    page = feedback.feedback_html({**r, "groups": dict.fromkeys(info.groups, 0.0), "total": 0.0,
                                   "max_score": info.max_score, "points": info.cells,
                                   "group_of": {g: info.group(g) for g in info.cells}},
                                  [], info.groups, set())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "feedback.html").write_text(page, encoding="utf-8")
    return r
