"""Grade submitted labs, each in its own sandboxed kernel; run through ``bash autograder/grade.sh``.

    grade.sh                              a tour of the example submissions of every lab
    grade.sh SUBMISSIONS                  a folder (or .zip) of <student>/<lab>/<lab>.ipynb
    grade.sh ... -j 4                     four submissions at once
    grade.sh ... --shard 3/8              the third of eight slices of the class (a job array)
    grade.sh merge OUT1 OUT2 ... --out ALL    one set of results from the slices' folders
    grade.sh ... --lab lab01_basics       only this lab (repeatable)
    grade.sh ... --out DIR                where results go (default grading-out/)
    grade.sh DOWNLOAD.zip --lab L         a Canvas or Moodle download as it came (--pattern: any)
    grade.sh ... --student ID / --update  regrade some students into --out's results, in place
    grade.sh gradebook EXPORT.csv --out DIR   the LMS's gradebook filled with a lab's points

**From an LMS** (:mod:`autograder.lms`): the input is read by :mod:`autograder.lms.intake`
(the newest hand-in per student and lab; every file in ``intake.csv``; a refused hand-in is a
row and a page, any name a key); ``--student``/``--update`` regrade into the class's results
(:mod:`autograder.lms.regrade`); ``overrides.csv`` in ``--out`` is applied at every write
(:mod:`autograder.lms.overrides`); ``gradebook`` fills the LMS's own file
(:mod:`autograder.lms.gradebook`). docs/grading.md, *From your LMS to grades*.

Every submission is graded on its own (:func:`autograder.runner.grade_one`): the lab's cells in
the lab's order with the tests from the source (``--source``, default solutions/; point it at a
private copy whose hidden tests students never saw), run in a fresh kernel in a sandbox
(:mod:`autograder.sandbox`) under the referee (:mod:`autograder.referee`), which signs each test
that ran to its end; the grade is read from those signatures. ``-j N`` runs N such kernels at
once; the results do not depend on N, nor on the order, nor on the slot.

**A compilation cache no submission can write to** (:mod:`autograder.compile_cache`): most
of a grading is JAX compiling the training steps every submission compiles. Before a lab's
submissions, grade.sh grades the lab's source notebook (student ``_reference``, its row with
``--include-solutions``) with a JAX compilation cache that only this kernel may write; every
submission then gets it read-only (a read-only mount in the sandbox; a private copy without
one) and never writes. The cache lives in ``.cache/grading-jax/``, one folder per lab keyed by
the lab's files, ``minickpt/``, the JAX packages and the kernel's environment, so later runs
reuse it; a folder that fails its check is filled again. ``--compile-cache off`` (or
``MINICKPT_GRADE_CACHE=off``) grades without it: slower, the same grades.

A student's broken notebook is a grade (0 for what did not pass, and why), never a crash:
the exit code is 2 only when grading itself failed for some submission.

**With no argument** grade.sh grades a *tour* of autograder/examples/ (:func:`example_tour`):
in every lab the three examples every lab has, ``perfect``, ``partial`` (the typical mistakes)
and ``blank``, and the few more its examples module lists in ``TOUR`` (lab 1 lists one of each
kind of attack on the grader, so the hostile corpus is graded once, on one lab). Three per lab
plus lab 1's eight keep the run of six labs, set-up included, within about ten minutes on a
2-core laptop; ``-j`` defaults to the cores present. CI (tests/test_grading_hardening.py)
grades the whole corpus: ``grade.sh autograder/examples`` does the same.

**A course, not a lab.** The labs of a run are those named with ``--lab``, else every lab
anyone handed in. A student who handed in some of them gets 0 for each other one, with the
reason (``grades.csv``'s ``missing`` column, a ``missing`` row in ``grades-<lab>.csv``), never an
error; the terminal shows one table per lab, then the course: every student's points per lab
and in total.

Outputs in ``--out``: ``grades.csv`` (one row per student, one column per lab, for an LMS),
``grades-<lab>.csv`` (per task and per test, status, reason, review flags, isolation),
``class-summary-<lab>.csv`` and ``class-summary.html`` (per task and per quiz question: who got
full marks, the most common failure), ``summary.txt`` (what the terminal shows),
``feedback/<student>/<lab>.html``, ``results.json`` (everything above, for merge), ``run.json``
(the settings and what isolated the kernels), ``timings.csv`` and ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT, safe_text, tools_on_path
from .notebook import load_lab, task_of, task_totals
from .settings import CELL_TIMEOUT, SETUP_TIMEOUT

STUDENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_ZIP_BYTES = 2 << 30
MAX_ZIP_FILES = 100_000
WALL_DEFAULT = 1200
GRACE = 10
GRADER_PREFIX = "_"
"""The grader's own rows (each lab's source notebook, graded to fill the compilation cache and,
with ``--include-solutions``, as a self-check) are named with a prefix that no student id can
have (:data:`STUDENT_RE` wants a letter or a digit first). So no submission can take one: a
student whose folder is called ``reference`` is graded as themselves, never handed the
source's grade, and no two jobs share a work folder or a row."""
REFERENCE_STUDENT = GRADER_PREFIX + "reference"
assert not STUDENT_RE.match(REFERENCE_STUDENT), "the grader's rows must be out of students' reach"
MARK = ".minickpt-grading"
ATTACK_PREFIX = "attack_"
"""Example submissions that attack the machine: never graded without a sandbox."""
CSV_STATIC = ("total", "max_score", "status", "reason", "review", "isolation")
HOSTILE_PREFIXES = ("attack_", "cheat_")
TOUR_EVERY_LAB = ("perfect", "partial", "blank")
"""The examples of every lab that grade.sh grades with no argument (see example_tour)."""
LOG_COPY_BYTES = 4 << 20
"""The most of each log of a submission that reaches ``--out/logs`` (its head and its tail)."""
SIMILAR = "similar to "
"""How every flag of the similarity report begins (:func:`similarity_report`)."""
PEERS_NAMED = 3
"""Other submissions a flagged row names (the rest are counted; the report lists them)."""
MISSING = "missing"
"""The status of a lab a student did not hand in (0 points, not an error)."""


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def memory_for_slots() -> int:
    """The memory the slots may share: the machine's, or this process's cgroup limit if lower
    (a container, a Slurm job)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        memory = 1 << 40
    limits = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if names == "":
                    limits.append(f"/sys/fs/cgroup{path}/memory.max")
                elif "memory" in names.split(","):
                    limits.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    for path in limits:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def default_jobs(*, cores: int | None = None, memory: int | None = None,
                 slot_memory: int | None = None) -> int:
    """``-j`` when none is given: one slot per usable core (a kernel keeps about one core
    busy), and no more slots than the memory holds slots' allowances: each slot's cgroup
    may use ``Limits.slot_memory_bytes`` (6 GiB: its kernel, everything the kernel starts,
    and its grading worker), so ``memory // slot_memory``, at least 1."""
    from .sandbox import Limits

    cores = usable_cores() if cores is None else cores
    memory = memory_for_slots() if memory is None else memory
    slot_memory = Limits().slot_memory_bytes if slot_memory is None else slot_memory
    return max(1, min(cores, memory // slot_memory))


def example_tour(labs: set[str]) -> set[tuple[str, str]]:
    """The (student, lab) pairs grade.sh grades with no argument. The rule, per lab: the
    examples :data:`TOUR_EVERY_LAB` (``perfect``, ``partial``, ``blank``: every lab has them),
    and those its examples module lists in ``TOUR`` (a few: lab 1's attacks, one of each
    kind; the whole corpus is for CI). So the no-argument run grows by three submissions a
    lab, whatever else a lab brings."""
    from .make_examples import EXAMPLES, TOUR

    tour = set()
    for lab, examples in EXAMPLES.items():
        if lab not in labs:
            continue
        chosen = set(TOUR.get(lab, ()))
        unknown = chosen - set(examples)
        if unknown:
            raise SystemExit(f"grade: TOUR of {lab} names examples it does not have: "
                             f"{sorted(unknown)}")
        tour |= {(s, lab) for s in examples if s in TOUR_EVERY_LAB or s in chosen}
    return tour


# ---------------------------------------------------------------------------------------
# finding submissions
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submission:
    student: str
    lab: str
    notebook: Path


def unpack_zip(archive: Path, dest: Path) -> Path:
    """Extract a zip of submissions, refusing absolute paths, ``..``, links and zip bombs."""
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        if len(infos) > MAX_ZIP_FILES or sum(i.file_size for i in infos) > MAX_ZIP_BYTES:
            raise SystemExit(f"grade: {archive} holds too many or too large files")
        for info in infos:
            name = info.filename
            parts = Path(name).parts
            if name.startswith(("/", "\\")) or ".." in parts or (info.external_attr >> 28) == 0o12:
                raise SystemExit(f"grade: refusing unsafe path {name!r} in {archive}")
        zf.extractall(dest)
    return dest


def find_submissions(folder: Path, labs: set[str]) -> tuple[list[Submission], list[str]]:
    """Every ``<student>/<lab>/<lab>.ipynb`` below ``folder`` for a known lab; and warnings."""
    subs: dict[tuple[str, str], Submission] = {}
    warnings: list[str] = []
    for nb in sorted(folder.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in nb.parts or nb.parent.name != nb.stem or nb.stem not in labs:
            continue
        student, lab = nb.parent.parent.name, nb.stem
        if not STUDENT_RE.match(student):
            warnings.append(f"skipped {nb}: {student!r} is not a usable student id")
            continue
        if (student, lab) in subs:
            warnings.append(f"skipped {nb}: {student} already has {subs[student, lab].notebook}")
            continue
        subs[student, lab] = Submission(student, lab, nb)
    return sorted(subs.values(), key=lambda s: (s.lab, s.student)), warnings


def shard_of(student: str, n: int) -> int:
    """The slice (1..n) a student belongs to: a hash of the name, so the same on every machine
    and for every lab, whatever else is in the class."""
    return int.from_bytes(hashlib.sha256(student.encode()).digest()[:8], "big") % n + 1


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"--shard wants i/n with 1 <= i <= n, got {text!r}")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------
# the lab's grade cells
# ---------------------------------------------------------------------------------------
@dataclass
class LabInfo:
    """A lab's graded cells in notebook order, their points, and how they group into tasks."""

    name: str
    cells: dict[str, float] = field(default_factory=dict)  # grade_id -> points
    fingerprint: str = ""
    questions: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, dict[str, str]] = field(default_factory=dict)
    """Task cell grade id -> ``reference`` (minickpt's code of the task, which the build
    wrote into the source) and ``stub`` (what the release gives), and ``similarity.GIVEN``
    -> ``code`` (what the release gives in its other cells): for the similarity report."""

    @property
    def max_score(self) -> float:
        return sum(self.cells.values())

    group = staticmethod(task_of)

    @property
    def groups(self) -> dict[str, float]:
        return task_totals(self.cells)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cells": self.cells, "fingerprint": self.fingerprint,
                "questions": self.questions, "tasks": self.tasks}


def lab_info(notebook: Path, name: str) -> LabInfo:
    from . import similarity

    lab = load_lab(notebook)
    info = lab.info()
    tasks = similarity.lab_tasks(lab)
    return LabInfo(name, info["cells"], info["fingerprint"], info["questions"], tasks)


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def table(results: list[dict[str, Any]], labs: dict[str, LabInfo]) -> str:
    """The grade table the terminal shows, one block per lab."""
    lines = []
    for lab, info in labs.items():
        rows = [r for r in results if r["lab"] == lab]
        if not rows:
            continue
        heads = list(info.groups)
        header = ["student", *heads, "total", "status"]
        points = ["(points)", *[_fmt(info.groups[g]) for g in heads], _fmt(info.max_score), ""]
        body = [[r["student"], *[_fmt(r.get("groups", {}).get(g, 0.0)) for g in heads],
                 _fmt(r.get("total", 0.0)),
                 r["status"] + (f": {r['reason']}" if r["reason"] else "")] for r in rows
                if r["status"] != MISSING]
        width = [max(len(row[i]) for row in [header, points, *body]) for i in range(len(header))]
        lines.append(f"{lab}: {len(body)} submission(s)")
        for row in [header, points, *body]:
            cells = [row[0].ljust(width[0])] + [c.rjust(width[i])
                                                for i, c in enumerate(row[1:-1], 1)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
        missing = [r["student"] for r in rows if r["status"] == MISSING]
        if missing:
            lines.append(f"  not handed in (0 points): {', '.join(missing)}")
        flagged = [r for r in rows if r.get("review")]
        if flagged:
            lines.append(f"  review: {len(flagged)} submission(s) hold code that can reach into "
                         f"a test, hand in minickpt's own function for a task or are similar "
                         f"to minickpt's code or another submission (similarity-{lab}.html) "
                         f"({', '.join(r['student'] for r in flagged)}); see grades-{lab}.csv")
        lines.append("")
    return "\n".join(lines)


def course_table(results: list[dict[str, Any]], labs: dict[str, LabInfo]) -> str:
    """The course: every student's points per lab and in all (what grades.csv holds)."""
    students = sorted({r["student"] for r in results})
    per = {(r["student"], r["lab"]): r for r in results}
    header = ["student", *labs, "total"]
    points = ["(points)", *[_fmt(i.max_score) for i in labs.values()],
              _fmt(sum(i.max_score for i in labs.values()))]
    body = []
    for s in students:
        got = [per[s, lab]["total"] if (s, lab) in per else 0.0 for lab in labs]
        body.append([s, *[_fmt(g) if per.get((s, lab), {}).get("status") != MISSING else "-"
                          for g, lab in zip(got, labs, strict=True)], _fmt(sum(got))])
    width = [max(len(row[i]) for row in [header, points, *body]) for i in range(len(header))]
    lines = [f"course: {len(students)} student(s), {len(labs)} lab(s) ('-': not handed in, 0)"]
    for row in [header, points, *body]:
        lines.append("  ".join([row[0].ljust(width[0])]
                               + [c.rjust(width[i]) for i, c in enumerate(row[1:], 1)]).rstrip())
    return "\n".join(lines) + "\n"


def missing_results(results: list[dict[str, Any]], labs: dict[str, LabInfo]) -> list[dict[str, Any]]:
    """A row for every lab of the run that a student who handed in another one did not: 0
    points and the reason. Derived from the results, so a merge of slices derives the same."""
    have = {(r["student"], r["lab"]) for r in results}
    who = {r["student"]: {"name": r.get("name", ""), "lms_id": r.get("lms_id", "")}
           for r in results}
    out = []
    for student in sorted({r["student"] for r in results}):
        for lab in labs:
            if (student, lab) not in have:
                out.append({**who[student], "student": student, "lab": lab, "status": MISSING,
                            "reason": f"no {student}/{lab}/{lab}.ipynb was handed in",
                            "isolation": "", "ran_all_cells": False, "scores": {}})
    return out


def row_status(rows: list[dict[str, Any]]) -> str:
    """A student's status in grades.csv: ``graded`` when every lab was, else each lab that was
    not, with its status (``failed``, ``refused``, ``missing``, ``error``): an LMS must never
    take those for a plain 0."""
    bad = [r for r in sorted(rows, key=lambda r: r["lab"]) if r["status"] != "graded"]
    if not bad:
        return "graded"
    if len(rows) == 1:
        return bad[0]["status"]
    return "; ".join(f"{r['lab']}: {r['status']}" for r in bad)


_HELD: list[int] = []
"""The lock files of the folders this run holds (open until the run ends)."""
_BESIDE: list[Path] = []
"""The work folders this run made beside a busy one (removed at its end)."""


def release_folders() -> None:
    """End this run's hold on its folders (the process's end does it too, however it ends),
    and remove a work folder it made beside a busy one."""
    for path in _BESIDE:
        shutil.rmtree(path, ignore_errors=True)
        lock_file(path).unlink(missing_ok=True)
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()
    _BESIDE.clear()


def hold_folder(path: Path) -> int | None:
    """Hold ``path`` for this run: an exclusive ``flock`` on a lock file beside it
    (:func:`lock_file`), held until :func:`release_folders` or the process's end, however it
    ends. None when another run holds it (two runs on one folder: the second would empty the
    first's as it starts)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _HELD.append(fd)
    return fd


def lock_file(path: Path) -> Path:
    """``path``'s lock file: beside it, since a run empties the folder itself."""
    return path.parent / f".{path.name.lstrip('.')}.lock"


def holder(path: Path) -> str:
    """Who holds ``path`` (what its lock file says), for a message."""
    try:
        return lock_file(path).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def fresh_dir(path: Path) -> None:
    """Empty ``path`` for a new run, but only if it is new, empty, or one of ours (it holds
    :data:`MARK`): a mistyped ``--out`` must never delete someone's files."""
    if path.exists() and any(path.iterdir()) and not (path / MARK).exists():
        raise SystemExit(f"grade: {path} is not empty and was not written by grade.sh; "
                         "choose another folder")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARK).write_text("written by autograder/grade.sh; emptied by its next run\n")


def _normalize(result: dict[str, Any], info: LabInfo) -> dict[str, Any]:
    """A result with every field the reports read, in a fixed key order (results.json is
    compared across runs)."""
    scores = {gid: float(result.get("scores", {}).get(gid, 0.0) or 0.0) for gid in info.cells}
    keys = ("student", "lab", "status", "reason", "isolation", "ran_all_cells")
    out = {k: result.get(k, "" if k != "ran_all_cells" else False) for k in keys}
    out.update(scores=scores, groups=task_totals(scores), total=sum(scores.values()),
               max_score=info.max_score,
               messages={k: v for k, v in sorted(result.get("messages", {}).items())},
               notes=list(result.get("notes", [])),
               review=sorted(f for f in result.get("review", [])
                             if not f.startswith(SIMILAR)),  # made again from "code"
               code={str(k): str(v) for k, v in sorted((result.get("code") or {}).items())},
               feedback=f"feedback/{result['student']}/{result['lab']}.html",
               name=str(result.get("name") or result["student"]),
               lms_id=str(result.get("lms_id") or ""),
               intake=[str(n) for n in result.get("intake", [])],
               overrides=list(result.get("overrides", [])))
    return out


def similarity_report(out: Path, results: list[dict[str, Any]], labs: dict[str, LabInfo]
                      ) -> None:
    """Every lab's submissions, all their code cells, against minickpt's code of each task
    and against each other (:mod:`autograder.similarity`): flags into ``review`` (both
    parties of a similar pair are flagged, each naming the other), ``similarity-<lab>.html``
    and ``.csv``. From the results alone, so that a merge of slices compares the whole class."""
    from . import similarity

    for lab, info in labs.items():
        rows = {r["student"]: r for r in results if r["lab"] == lab
                and not r["student"].startswith(GRADER_PREFIX)}  # the source is minickpt's
        tasks = [t for t in info.tasks if similarity.TASK_CELL.match(t)]
        if not rows or not tasks:
            continue
        matches, parties = similarity.compare(info.tasks, {s: r.get("code", {})
                                                           for s, r in rows.items()})
        shown = []
        for s, r in rows.items():
            mine = sorted((m for m in matches if m.student == s and m.flagged),
                          key=lambda m: (m.other != similarity.MINICKPT, -m.score, m.other))
            r["review"] = sorted([*r["review"],
                                  *similarity.review_flags(matches, s, PEERS_NAMED)])
            shown += mine[:PEERS_NAMED + 1]
        pairs, seen = [], set()
        for m in shown:  # a pair once on the page (both rows name it)
            if frozenset((m.student, m.other)) not in seen:
                seen.add(frozenset((m.student, m.other)))
                pairs.append(m)
        (out / f"similarity-{lab}.html").write_text(similarity.report(lab, pairs, parties),
                                                    encoding="utf-8")
        with open(out / f"similarity-{lab}.csv", "w", newline="") as f:
            w = safe_text.writer(f)
            w.writerow(["student", "other", "score", "shared_tokens", "tokens", "flagged",
                        "found_in", *tasks])
            for m in sorted(matches, key=lambda m: (m.student, -m.score, m.other)):
                if m.score >= similarity.LISTED:
                    w.writerow([m.student, m.other.replace(similarity.MINICKPT, "minickpt"),
                                f"{m.score:.3f}", m.shared, m.total, int(m.flagged),
                                "; ".join(m.where),
                                *[f"{m.tasks[t]:.3f}" if t in m.tasks else "" for t in tasks]])


def write_outputs(out: Path, results: list[dict[str, Any]], labs: dict[str, LabInfo],
                  files: dict[tuple[str, str], dict[str, Path]], meta: dict[str, Any],
                  intake_rows: list[dict[str, str]] | None = None) -> str:
    """Every output file from the results (a single run and a merge call this alike, so they
    write the same bytes); ``files`` maps (lab, student) to its feedback page and logs.
    The instructor's files of ``out`` (overrides.csv, regrades.csv) are kept, and the
    overrides applied (:mod:`autograder.lms.overrides`); ``intake_rows`` is intake.csv
    (every file of the input and what became of it). Returns the text of summary.txt."""
    from . import feedback
    from .lms import overrides, regrade

    kept = regrade.save_kept(out) if out.exists() and (out / MARK).exists() else {}
    fresh_dir(out)
    regrade.restore_kept(out, kept)
    (out / "feedback").mkdir()
    (out / "logs").mkdir()
    try:
        chosen = overrides.load(out / overrides.FILE,
                                {lab: info.cells for lab, info in labs.items()})
    except overrides.OverrideError as e:
        raise SystemExit(f"grade: {e}") from None
    results = [dict(r) for r in results]
    for w in overrides.apply(results, chosen):
        print(f"grade: {w}", file=sys.stderr)
    results = sorted((_normalize(r, labs[r["lab"]]) for r in results),
                     key=lambda r: (r["lab"], r["student"]))
    absent = [_normalize(r, labs[r["lab"]]) for r in missing_results(results, labs)]
    for r in absent:
        r["feedback"] = ""
    similarity_report(out, results, labs)
    for r in results:
        src = files.get((r["lab"], r["student"]), {})
        dest = out / r["feedback"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.get("feedback") and src["feedback"].exists():
            page = src["feedback"].read_text(encoding="utf-8")
            dest.write_text(feedback.annotate(page, r), encoding="utf-8")
        else:
            r["feedback"] = ""
        for kind, path in src.items():
            if kind != "feedback" and path.exists():
                log = out / "logs" / r["student"] / f"{r['lab']}.{kind}"
                log.parent.mkdir(parents=True, exist_ok=True)
                safe_text.copy_capped(path, log, LOG_COPY_BYTES)
    summaries = []
    per_lab_rows = {}
    for lab, info in labs.items():
        rows = [r for r in results if r["lab"] == lab]
        away = [r for r in absent if r["lab"] == lab]
        if not rows and not away:
            continue
        with open(out / f"grades-{lab}.csv", "w", newline="") as f:
            w = safe_text.writer(f)
            w.writerow(["student", *info.groups, *info.cells, *CSV_STATIC])
            for r in sorted(rows + away, key=lambda r: r["student"]):
                w.writerow([r["student"], *[_fmt(r["groups"][g]) for g in info.groups],
                            *[_fmt(r["scores"][g]) for g in info.cells], _fmt(r["total"]),
                            _fmt(info.max_score), r["status"], r["reason"],
                            "; ".join(r["review"]), r["isolation"]])
        if not rows:  # nobody handed this lab in: no class summary to make
            continue
        group_of = {gid: info.group(gid) for gid in info.cells}
        summary = feedback.class_summary(rows, info.cells, info.groups, group_of, info.questions)
        per_lab_rows[lab] = summary
        with open(out / f"class-summary-{lab}.csv", "w", newline="") as f:
            w = safe_text.dict_writer(f, fieldnames=list(summary[0]))
            w.writeheader()
            for row in summary:
                w.writerow({**row, "mean": f"{row['mean']:.3f}", "pct_full": f"{row['pct_full']:.1f}",
                            "points": _fmt(row["points"])})
        summaries.append(feedback.summary_text(lab, summary))
    (out / "class-summary.html").write_text(feedback.summary_html(per_lab_rows), encoding="utf-8")
    students = sorted({r["student"] for r in results})
    with open(out / "grades.csv", "w", newline="") as f:
        w = safe_text.writer(f)
        w.writerow(["student", "name", "lms_id", *labs, "total", "max_score", "status", MISSING])
        for s in students:
            mine = [r for r in results + absent if r["student"] == s]
            per = {r["lab"]: r["total"] for r in mine if r["status"] != MISSING}
            w.writerow([s, mine[0]["name"], mine[0]["lms_id"],
                        *[_fmt(per.get(lab, 0.0)) for lab in labs],
                        _fmt(sum(per.values())), _fmt(sum(i.max_score for i in labs.values())),
                        row_status(mine),
                        "; ".join(f"{r['lab']}: {r['reason']}" for r in absent
                                  if r["student"] == s)])
    if intake_rows is not None:
        from .lms.intake import INTAKE_COLUMNS

        with open(out / "intake.csv", "w", newline="", encoding="utf-8") as f:
            w = safe_text.dict_writer(f, fieldnames=list(INTAKE_COLUMNS))
            w.writeheader()
            w.writerows(sorted(intake_rows, key=lambda r: (r["file"], r["status"])))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "run.json").write_text(json.dumps({**meta, "labs": {k: v.as_dict()
                                                                for k, v in labs.items()}},
                                             indent=1) + "\n")
    isolation = sorted({r["isolation"] for r in results  # "": refused at intake, never run
                        if r["isolation"] not in ("sandbox", "")})
    text = table(results + absent, labs) + "\n".join(summaries)
    if len(labs) > 1 or absent:
        text += "\n" + course_table(results + absent, labs)
    if isolation:
        text += ("\n!! NOT FULLY ISOLATED: " + " | ".join(i for i in isolation if i) + "\n")
    text = safe_text.printable(text)  # messages are the student's text: no escape sequences
    (out / "summary.txt").write_text(text)
    return text


# ---------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------
class Progress:
    """Counts graded, failed and remaining; a bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.graded, self.failed = total, 0, 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="sub", dynamic_ncols=True,  # its own \r
                                file=safe_text.unwrapped(sys.stderr))
            except ImportError:  # pragma: no cover - tqdm is in the course extra
                self.bar = None

    def update(self, result: dict[str, Any], seconds: float) -> None:
        ok = result["status"] == "graded"
        self.graded += ok
        self.failed += not ok
        left = self.total - self.graded - self.failed
        total = sum(v for v in result.get("scores", {}).values() if v is not None)
        what = safe_text.printable(f"{result['student']}/{result['lab']}: {total:g} "
                                   f"{result['status']} ({seconds:.1f} s)")
        if self.bar is not None:
            self.bar.set_postfix_str(f"graded {self.graded}, failed {self.failed}, left {left}")
            self.bar.write(f"  {what}")
            self.bar.update(1)
        else:
            n = self.graded + self.failed
            print(f"  [{n:>{len(str(self.total))}}/{self.total}] {what} · graded {self.graded},"
                  f" failed {self.failed}, left {left}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def refuse_unsandboxed(iso: Any, folder: Path) -> str | None:
    """Fail closed: without a working sandbox, submissions are graded only when asked for
    explicitly (``--unsandboxed`` or ``MINICKPT_SANDBOX=off``); the bundled examples are the
    one exception (a demonstration of the grader, without its attack_* examples)."""
    if iso.sandboxed or iso.requested:
        return None
    if folder == (ROOT / "autograder" / "examples").resolve():
        print("grade: NO SANDBOX: grading the bundled examples only to demonstrate the grader, "
              f"without the {ATTACK_PREFIX}* ones; real submissions would be refused here",
              file=sys.stderr)
        return None
    return (f"grade: REFUSED: the sandbox cannot be used here, and student code is not run "
            f"without it.\n  why: {iso.detail}\n  fix: {iso.fix}\n  to grade anyway, "
            "without isolation (student code runs with your rights; every result is marked): "
            "add --unsandboxed, or set MINICKPT_SANDBOX=off")


TIMING_PHASES = ("prepare", "kernel", "setup", "cells", "cpu", "throttled", "slowest_cell",
                 "slowest_cell_seconds", "timed_out", "judge", "slowest_test",
                 "slowest_test_seconds")
"""timings.csv's columns after ``seconds`` (autograder.runner._write_phases writes them; the
judge's, of a judged lab, its ``_judge``: its seconds and its slowest test's)."""


def write_timings(path: Path, timings: list[tuple[str, str, float]],
                  dirs: dict[tuple[str, str], Path], durations: int) -> str:
    """``timings.csv``: per submission its seconds in its slot and where they went (each
    job's ``phases.json``; empty for a submission that never reached its kernel). Returns
    the ``durations`` slowest as text (like pytest's ``--durations``; "" for 0)."""
    rows = []
    for student, lab, seconds in sorted(timings):
        try:
            phases = json.loads((dirs[student, lab] / "phases.json").read_text())
        except (KeyError, OSError, ValueError):
            phases = {}
        rows.append({"student": student, "lab": lab, "seconds": f"{seconds:.1f}",
                     **{k: _phase(phases.get(k)) for k in TIMING_PHASES}})
    with open(path, "w", newline="") as f:
        w = safe_text.dict_writer(f, fieldnames=["student", "lab", "seconds", *TIMING_PHASES])
        w.writeheader()
        w.writerows(rows)
    if durations <= 0 or not rows:
        return ""
    total = sum(float(r["seconds"]) for r in rows)
    cpu = sum(float(r["cpu"] or 0) for r in rows)  # 0 where the slots have no cgroup
    lines = [f"slowest {min(durations, len(rows))} of {len(rows)} submission(s) ({total:.0f} s "
             f"of slot time, {cpu:.0f} s of CPU in the kernels):"]
    for r in sorted(rows, key=lambda r: -float(r["seconds"]))[:durations]:
        lines.append(f"  {float(r['seconds']):7.1f}s {r['student']}/{r['lab']}: kernel "
                     f"{r['kernel'] or '-'} s, setup {r['setup'] or '-'} s, cells "
                     f"{r['cells'] or '-'} s (slowest {r['slowest_cell'] or '-'} "
                     f"{r['slowest_cell_seconds'] or '-'} s), cpu {r['cpu'] or '-'} s"
                     + (f" (throttled {r['throttled']} s)" if r["throttled"] not in ("", "0",
                                                                                   "0.0") else "")
                     + (f", timed out: {r['timed_out']}" if r["timed_out"] else "")
                     + (f"; judge {r['judge']} s (slowest {r['slowest_test'] or '-'} "
                        f"{r['slowest_test_seconds'] or '-'} s)" if r["judge"] else ""))
    return safe_text.printable("\n".join(lines))


def _phase(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "" if value is None else str(value)


def _check_caches(root: Path, keys: set[str], ready: dict[str, dict[str, str]]) -> None:
    """Into ``ready``: the entries of every folder of ``keys`` that exists and passes its
    check; one that fails it is removed (to be filled again). Under the root's lock."""
    from . import compile_cache as cc

    for key in sorted(keys):
        folder = root / key
        if not folder.exists():
            continue
        try:
            ready[key] = cc.check(folder)
        except (ValueError, OSError) as e:
            print(f"grade: compilation cache {folder} fails its check ({e}); filling it "
                  "again", file=sys.stderr)
            cc.discard(folder)


def _fill_caches(missing: list[str], keys: dict[str, str], root: Path, source: Path, work: Path,
                 cfg: dict[str, Any], jobs: int, wanted: set[tuple[str, str]],
                 done: set[tuple[str, str]], on_result: Any, ready: dict[str, dict[str, str]],
                 out: dict[str, dict[str, Any]]) -> None:
    """Fill the ``missing`` keys (their locks held) by grading one lab's source notebook per
    key, ``jobs`` at once; install each under the root's lock."""
    from . import compile_cache as cc
    from .runner import Job, run_pool

    fills: list[Job] = []
    for key in missing:
        lab = min(lab for lab in keys if keys[lab] == key)
        fills.append(Job(len(fills), REFERENCE_STUDENT, lab, str(source / lab / f"{lab}.ipynb"),
                         str(work / "subs" / lab / REFERENCE_STUDENT),
                         cache=str(cc.fill_folder(work, key)), fill=True))
    filled: dict[str, tuple[dict[str, Any], float]] = {}

    def on_fill(job: Job, result: dict[str, Any], seconds: float) -> None:
        filled[job.lab] = (result, seconds)
        if (job.student, job.lab) in wanted:
            done.add((job.student, job.lab))
            on_result(job, result, seconds)

    if fills:
        print(f"grade: compilation cache: filling it for {', '.join(j.lab for j in fills)} "
              "by grading each lab's source notebook (once; later runs reuse it)", flush=True)
        run_pool(fills, cfg, min(jobs, len(fills)), work / "logs", on_fill)
    for job in fills:
        key = keys[job.lab]
        result, seconds = filled.get(job.lab, ({}, 0.0))
        if result.get("status") != "graded" or not result.get("ran_all_cells"):
            print(f"grade: compilation cache of {job.lab} not kept: grading its source "
                  f"notebook did not run to the end ({result.get('reason') or 'no result'})",
                  file=sys.stderr)
            continue
        try:
            with cc.Lock(root):
                cc.install(Path(job.cache), root / key, lab=job.lab,
                           source=source / job.lab / f"{job.lab}.ipynb")
                ready[key] = cc.check(root / key)
        except (OSError, ValueError) as e:
            print(f"grade: compilation cache of {job.lab} not kept: {e}", file=sys.stderr)
            continue
        out[job.lab]["fill_seconds"] = round(seconds, 1)
        shutil.rmtree(job.cache, ignore_errors=True)


def prepare_caches(labs: list[str], source: Path, work: Path, cfg: dict[str, Any],
                   jobs: int, option: str | None, wanted: set[tuple[str, str]],
                   done: set[tuple[str, str]], on_result: Any) -> dict[str, dict[str, Any]]:
    """Every lab's grading compilation cache (:mod:`autograder.compile_cache`), checked, and
    filled first where it is missing: by grading the lab's source notebook as student
    ``_reference`` (:data:`REFERENCE_STUDENT`) with the cache writable for that one kernel.
    Returns per lab what run.json records (``folder``, ``state``, ``entries``: name -> digest, absent when there is none).
    A fill *is* the reference's grading: with ``--include-solutions`` its result is the
    reference's row (``on_result`` gets it, and the pair goes into ``done``)."""
    from . import compile_cache as cc
    from . import sandbox

    root = cc.where(option)
    if root is None:
        return {lab: {"state": "off"} for lab in labs}
    why = cc.prepare_root(root)
    if why:
        print(f"grade: compilation cache unusable, grading without it: {why}", file=sys.stderr)
        return {lab: {"state": f"off: {why}"} for lab in labs}
    env = sandbox.kernel_env()
    keys = {lab: cc.cache_key(source / lab, env) for lab in labs}
    out: dict[str, dict[str, Any]] = {lab: {"folder": str(root / keys[lab]), "key": keys[lab]}
                                      for lab in labs}
    ready: dict[str, dict[str, str]] = {}
    with cc.Lock(root) as held:
        if not held:
            print("grade: another grade.sh holds the compilation cache for too long; "
                  "grading without it", file=sys.stderr)
            return {lab: {"state": "off: lock not free"} for lab in labs}
        cc.tidy(root, set(keys.values()))
        _check_caches(root, set(keys.values()), ready)
    missing = sorted(set(keys.values()) - set(ready))
    with contextlib.ExitStack() as stack:  # each missing key's own lock, in one order: other
        for key in missing:                # labs' fills (another grade.sh) go on meanwhile
            if not stack.enter_context(cc.key_lock(root, key)):
                print(f"grade: another grade.sh is filling the compilation cache {key} for too "
                      "long; grading without it", file=sys.stderr)
                return {lab: {"state": "off: lock not free"} for lab in labs}
        with cc.Lock(root):  # filled by another grade.sh while this one waited?
            _check_caches(root, set(missing), ready)
        _fill_caches(sorted(set(missing) - set(ready)), keys, root, source, work, cfg, jobs,
                     wanted, done, on_result, ready, out)
    for lab in labs:
        key = keys[lab]
        if key in ready:
            out[lab]["entries"] = ready[key]
            out[lab]["state"] = "filled" if "fill_seconds" in out[lab] else "reused"
        else:
            out[lab]["state"] = "none (its fill failed)"
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autograder/grade.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="grade.sh merge --help: combining the slices of a class")
    p.add_argument("submissions", nargs="?", default=None,
                   help="folder or .zip of <student>/<lab>/<lab>.ipynb (default: a tour of "
                        "the examples in autograder/examples: perfect, partial and blank of "
                        "every lab, and one of each kind of attack in lab 1; pass "
                        "autograder/examples for all of them)")
    p.add_argument("--lab", action="append", help="grade only this lab (repeatable)")
    p.add_argument("--out", default="grading-out", help="results folder (default grading-out/)")
    p.add_argument("--source", default=str(ROOT / "solutions"),
                   help="the labs' source with hidden tests (default solutions/; use a private "
                        "copy so that students never see the hidden tests)")
    p.add_argument("--work", default=None,
                   help="work folder: each submission's graded notebook (hidden tests "
                        "included), feedback and logs (default .grading/, emptied first; "
                        "while another run uses .grading/, a folder beside it of this run's "
                        "own, removed at its end)")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="submissions graded at once (default: one per usable core, at most one "
                        "per 6 GiB of memory, what a slot's cgroup allows its kernel and "
                        "worker; each takes about one core)")
    p.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                   help="grade only the I-th of N slices of the class (by student name); "
                        "combine the slices' --out folders with `grade.sh merge`")
    p.add_argument("--timeout", type=int, default=CELL_TIMEOUT,
                   help=f"seconds a cell may run (default {CELL_TIMEOUT}; setup cells "
                        f"{SETUP_TIMEOUT})")
    p.add_argument("--wall", type=int, default=WALL_DEFAULT,
                   help=f"seconds one submission may take in all (default {WALL_DEFAULT})")
    p.add_argument("--memory", type=float, default=4.0,
                   help="GiB of address space per process of a kernel (default 4)")
    p.add_argument("--sandbox-uid", type=int, default=None,
                   help="first uid of the range the sandboxes run as (default 64200)")
    p.add_argument("--unsandboxed", action="store_true",
                   help="grade even where the sandbox cannot be used (student code then runs "
                        "with your rights; results are marked). Same as MINICKPT_SANDBOX=off")
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="the JAX compilation cache of the grading (default .cache/grading-jax/, "
                        "or $MINICKPT_GRADE_CACHE): filled once per lab by grading the lab's "
                        "source notebook, read-only to every submission, reused by later runs; "
                        "'off' grades without it (slower, same grades)")
    p.add_argument("--durations", type=int, default=0, metavar="N",
                   help="print the N slowest submissions and where their time went (kernel "
                        "start, setup cells, other cells, CPU); timings.csv has every one")
    p.add_argument("--include-solutions", action="store_true",
                   help=f"also grade each lab's source notebook as student "
                        f"'{REFERENCE_STUDENT}' (a self-check: it must score full marks)")
    p.add_argument("--layout", choices=("auto", "course", "canvas", "moodle"), default="auto",
                   help="how the submissions are named (default: told from the files): "
                        "<student>/<lab>/<lab>.ipynb, a Canvas download, a Moodle download; "
                        "every file is accounted for in intake.csv")
    p.add_argument("--pattern", default=None, metavar="REGEX",
                   help="any other layout: a regular expression over each file's path in the "
                        "input with the named groups student_id and file_id, optionally name "
                        "and timestamp (as nbgrader's zip_collect)")
    p.add_argument("--student", nargs="+", default=None, metavar="ID",
                   help="grade only these students (key, name or LMS id) and update the "
                        "class's results in --out in place; the other rows are kept")
    p.add_argument("--update", action="store_true",
                   help="update the class's results in --out with what this run grades (a "
                        "folder of resubmissions) instead of replacing them")
    p.add_argument("--gradebook", default=None, metavar="CSV",
                   help="the LMS's exported gradebook (Canvas) or grading worksheet (Moodle): "
                        "written back to --out with this lab's points filled")
    p.add_argument("--gradebook-column", default="", metavar="NAME",
                   help="the gradebook's column for this lab (default: the one naming the lab)")
    p.add_argument("--lms", choices=("canvas", "moodle"), default="",
                   help="the gradebook's LMS (default: told from its columns)")
    return p


def graded_build_on() -> bool:
    """Sandboxed kernels import the graded build of minickpt (issue 38) unless
    ``MINICKPT_GRADED_BUILD=off`` (an instructor's override: the full library, reference
    included). On the graded build minickpt holds none of the lab's tasks and calls the
    student's function wherever it needs one, so a test of one task may run the student's
    code of an earlier one (docs/grading.md, *The trust model*)."""
    return os.environ.get("MINICKPT_GRADED_BUILD", "on").lower() not in ("off", "0", "no")


def build_graded_labs(labs: list[str], work: Path) -> dict[str, str]:
    """{lab: its graded build of minickpt}, built afresh under ``work/graded`` from the
    grader's own minickpt, readable by the sandbox's uids (bound read-only in the kernel).
    A lab none of whose tasks minickpt holds (an instructor's own lab, ``Task N.Y`` in no
    docstring) has nothing to take out: it is graded on the full library, and said so."""
    from . import sandbox
    from .graded_build import build_graded, holds_tasks

    package = Path(sandbox.grader_package() or "")
    out = {}
    for lab in labs:
        if not holds_tasks(package, lab):
            print(f"grade: {lab}: minickpt holds none of its tasks; graded on the full library",
                  flush=True)
            continue
        folder, _ = build_graded(lab, package, work / "graded" / lab)
        for p in [folder.parent.parent, folder.parent, *folder.rglob("*"), folder]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        out[lab] = str(folder)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        from .runner import worker_main

        return worker_main(argv[1])
    with safe_text.safe_terminal():  # reasons, messages, paths: a submission's text
        if argv[:1] == ["merge"]:
            return merge_main(argv[1:])
        if argv[:1] == ["gradebook"]:
            from .lms.gradebook import main as gradebook_main

            return gradebook_main(argv[1:])
        try:
            return grade_main(argv)
        finally:
            release_folders()


def grade_main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    tools_on_path()
    from . import sandbox
    from .execute import SUBMISSION_KEEP_CHARS, SUBMISSION_OUTPUTS
    from .runner import Job, run_pool

    t0 = time.monotonic()
    source, out = Path(a.source).resolve(), Path(a.out).resolve()
    work = Path(a.work or ROOT / ".grading").resolve()
    if hold_folder(work) is None:  # another run works there: emptying it would wreck its run
        if a.work is not None:
            print(f"grade: --work {work} is in use by another grade.sh run ({holder(work)}); "
                  "wait for it to end, or pass another --work", file=sys.stderr)
            return 2
        busy, work = work, work.with_name(f"{work.name}-{os.getpid()}")
        if hold_folder(work) is None:  # (a pid reused while a killed run's folder stayed)
            print(f"grade: {busy} and {work} are in use by other grade.sh runs; pass --work",
                  file=sys.stderr)
            return 2
        _BESIDE.append(work)
        print(f"grade: {busy} is in use by another grade.sh run ({holder(busy)}): this run "
              f"works in {work} (removed at its end)", file=sys.stderr, flush=True)
    if hold_folder(out) is None:
        print(f"grade: --out {out} is in use by another grade.sh run ({holder(out)}); wait for "
              "it to end, or pass another --out", file=sys.stderr)
        return 2
    known = {d.name for d in source.iterdir() if (d / f"{d.name}.ipynb").is_file()}
    if a.lab:
        unknown = set(a.lab) - known
        if unknown:
            print(f"grade: no lab {sorted(unknown)} in {source}", file=sys.stderr)
            return 2
        known = set(a.lab)
    if a.jobs is None:
        a.jobs = default_jobs()
    if a.jobs < 1:
        print("grade: -j wants at least 1", file=sys.stderr)
        return 2
    fresh_dir(work)
    if out.exists() and any(out.iterdir()) and not (out / MARK).exists():
        fresh_dir(out)  # refuses now, before any grading, rather than at the end
    tour = None
    if a.submissions is None:
        a.submissions = str(ROOT / "autograder" / "examples")
        tour = example_tour(known)
    folder = Path(a.submissions).resolve()
    from .lms import intake as lms_intake
    from .lms import regrade

    try:
        if folder.is_file() and zipfile.is_zipfile(folder):
            folder = lms_intake.unpack(folder, work / "incoming")
        elif not folder.is_dir():
            print(f"grade: {a.submissions} is neither a folder nor a zip file", file=sys.stderr)
            return 2
        intake = lms_intake.collect(folder, known, a.layout, a.pattern)
    except lms_intake.IntakeError as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2
    pairs = set(intake.chosen) | set(intake.refused)
    if tour is not None:
        pairs &= tour
    if a.student:
        wanted_ids = set(a.student)
        named = {k for k, s in intake.students.items() if {k, s.name, s.lms_id} & wanted_ids}
        unknown = wanted_ids - {x for k in named for x in (k, intake.students[k].name,
                                                            intake.students[k].lms_id)}
        if unknown:
            print(f"grade: --student {' '.join(sorted(unknown))}: not in {a.submissions} "
                  f"(its students: {', '.join(sorted(intake.students)) or 'none'})",
                  file=sys.stderr)
            return 2
        pairs = {(s, lab) for s, lab in pairs if s in named}
    if a.shard:
        i, n = a.shard
        everyone = len(pairs)
        pairs = {(s, lab) for s, lab in pairs if shard_of(s, n) == i}
    intake.keep(pairs)
    subs = [Submission(s, lab, p) for (s, lab), p in sorted(intake.chosen.items())]
    graded_files = {(f.student, f.lab): f.file for f in intake.files if f.status == "graded"}
    counts = {st: sum(f.status == st for f in intake.files) for st in ("graded", "superseded",
                                                                        "refused")}
    print(f"grade: intake ({intake.layout} layout): {len(intake.files)} file(s): "
          + ", ".join(f"{v} {k}" for k, v in counts.items()) + "; every one in intake.csv",
          flush=True)
    if a.include_solutions:
        labs_seen = sorted({s.lab for s in subs} or known)
        subs += [Submission(REFERENCE_STUDENT, lab, source / lab / f"{lab}.ipynb")
                 for lab in labs_seen]
    if not subs and not intake.refused:
        print(f"grade: no submissions for labs {sorted(known)} in {a.submissions} (layout "
              f"{intake.layout}: <student>/<lab>/<lab>.ipynb, a Canvas or Moodle download, or "
              "--pattern; see docs/grading.md)", file=sys.stderr)
        for f in intake.files[:20]:
            print(f"grade:   {f.file}: {f.status}: {f.reason}", file=sys.stderr)
        return 2
    labs = sorted({s.lab for s in subs} | {lab for _, lab in intake.refused}
                  | set(a.lab or ()))  # the labs of this run
    infos = {lab: lab_info(source / lab / f"{lab}.ipynb", lab) for lab in labs}
    if not a.shard:
        everyone = len(subs)
    previous = None
    if a.update or a.student:
        try:
            previous = regrade.load(out, work / "previous")
            if previous is not None:
                regrade.check_labs(previous, {lab: i.fingerprint for lab, i in infos.items()})
        except regrade.RegradeError as e:
            print(f"grade: {e}", file=sys.stderr)
            return 2
    subs.sort(key=lambda s: (s.lab, s.student))
    iso = sandbox.unsandboxed("--unsandboxed") if a.unsandboxed else sandbox.probe()
    limits = sandbox.Limits(memory_bytes=int(a.memory * (1 << 30)))
    if iso.warning():
        print(iso.warning(), file=sys.stderr, flush=True)
    refusal = refuse_unsandboxed(iso, folder)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if not iso.sandboxed:
        unsafe = [s for s in subs if s.student.startswith(ATTACK_PREFIX)]
        if unsafe:
            print(f"grade: SKIPPED {len(unsafe)} submission(s) named {ATTACK_PREFIX}* (they "
                  "fork, allocate, flood or write for real; they are graded only in a "
                  f"sandbox): {', '.join(s.student for s in unsafe)}", file=sys.stderr)
            subs = [s for s in subs if not s.student.startswith(ATTACK_PREFIX)]
            intake.skip({(s.student, s.lab) for s in unsafe}, "an attack example: graded only "
                        "in a sandbox")
    shard = f"shard {a.shard[0]}/{a.shard[1]}: {len(subs)} of {everyone}; " if a.shard else ""
    print(f"grade: {shard}{len(subs)} submission(s) of {', '.join(labs)}; {a.jobs} at once; "
          f"cells may run {a.timeout} s; kernels: {iso.marker}", flush=True)
    cfg = {"source": str(source), "timeout": a.timeout, "setup_timeout": SETUP_TIMEOUT,
           "wall": a.wall, "grace": GRACE, "iso": {
               "mode": iso.mode, "bwrap": iso.bwrap, "setpriv": iso.setpriv,
               "prlimit": iso.prlimit, "lost": list(iso.lost), "detail": iso.detail},
           "limits": limits.as_dict(), "keep_output": 1 << 20, "max_output": 64 << 20,
           "keep_output_total": SUBMISSION_KEEP_CHARS, "keep_outputs": SUBMISSION_OUTPUTS,
           "max_message": 32 << 20, "uid_base": a.sandbox_uid or sandbox.UID_BASE}
    if iso.sandboxed and graded_build_on():
        cfg["graded"] = build_graded_labs(sorted({s.lab for s in subs}), work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    timings: list[tuple[str, str, float]] = []
    progress = Progress(len(subs))

    def on_result(job: Job, result: dict[str, Any], seconds: float) -> None:
        results.append(result)
        timings.append((job.student, job.lab, seconds))
        progress.update(result, seconds)

    wanted, done = {(s.student, s.lab) for s in subs}, set()
    try:
        try:
            caches = prepare_caches(sorted({s.lab for s in subs}), source, work, cfg,
                                    a.jobs, a.compile_cache, wanted, done, on_result)
        except Exception as e:  # a cache only makes grading faster: never a reason to fail
            print(f"grade: compilation cache failed, grading without it: {type(e).__name__}: "
                  f"{e}", file=sys.stderr)
            caches = {s.lab: {"state": f"off: {type(e).__name__}: {e}"} for s in subs}
        if not iso.sandboxed:  # the digests an unsandboxed kernel's private copy is made from
            digests = work / "compile-cache" / "digests.json"
            digests.parent.mkdir(parents=True, exist_ok=True)
            digests.write_text(json.dumps({c["folder"]: c["entries"] for c in caches.values()
                                           if c.get("entries")}))
            cfg["cache_digests"] = str(digests)
        readable = {lab: c["folder"] for lab, c in caches.items() if c.get("entries") is not None}
        jobs = [Job(k, s.student, s.lab, str(s.notebook), str(work / "subs" / s.lab / s.student),
                    cache=readable.get(s.lab, ""))
                for k, s in enumerate(subs) if (s.student, s.lab) not in done]
        if jobs:
            run_pool(jobs, cfg, min(a.jobs, len(jobs)), work / "logs", on_result)
    finally:
        progress.close()
    jobs = [Job(k, s.student, s.lab, str(s.notebook), str(work / "subs" / s.lab / s.student))
            for k, s in enumerate(subs)]
    files = {}
    for job in jobs:
        d = Path(job.dir)
        files[job.lab, job.student] = {"feedback": d / "feedback.html", "log": d / "kernel.log",
                                       "grader": d / "grader.log"}
    for (student, lab), reason in sorted(intake.refused.items()):
        results.append(lms_intake.refused_result(student, lab, reason, infos[lab],
                                                 work / "subs" / lab / student))
        files[lab, student] = {"feedback": work / "subs" / lab / student / "feedback.html"}
    intake.label(results)
    intake_rows = [f.as_row() for f in intake.files]
    if previous is not None:
        results, files, infos, intake_rows, log = regrade.into(
            previous, results, files, infos, intake_rows, graded_files)
    else:
        regrade.warn_dropped(out, results)
    meta = {"shard": list(a.shard) if a.shard else None, "timeout": a.timeout, "wall": a.wall,
            "source": str(source), "isolation": sandbox.describe(iso, limits),
            "compile_cache": {lab: {k: v for k, v in c.items() if k != "entries"}
                              | {"entries": len(c.get("entries") or {})}
                              for lab, c in caches.items()}}
    text = write_outputs(out, results, infos, files, meta, intake_rows)
    if previous is not None:
        regrade.append_log(out, log)
    if a.gradebook:
        try:
            from .lms.gradebook import fill_from_results

            text += fill_from_results(out, Path(a.gradebook), a.gradebook_column, a.lms, a.lab)
        except SystemExit as e:
            print(e, file=sys.stderr)
            return 2
    slowest = write_timings(out / "timings.csv", timings,
                            {(j.student, j.lab): Path(j.dir) for j in jobs}, a.durations)
    print()
    print(text)
    if slowest:
        print(slowest)
    errors = [r for r in results if r["status"] == "error"]
    print(f"graded {len(results)} submission(s) in {time.monotonic() - t0:.0f} s with -j {a.jobs};"
          f" results in {out} (grades.csv, grades-<lab>.csv, class-summary.html, feedback/)")
    if iso.warning():
        print(iso.warning(), file=sys.stderr)
    if errors:
        print(f"grade: grading itself failed for {len(errors)} submission(s): "
              + ", ".join(f"{r['student']}/{r['lab']}" for r in errors)
              + f"; see {out}/logs/ and {work}/logs/", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------
def merge_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="autograder/grade.sh merge",
        description="Combine the --out folders of `grade.sh --shard i/n` runs (from several "
                    "machines) into the outputs one run over the whole class writes.")
    p.add_argument("folders", nargs="+", help="the --out folders of the slices")
    p.add_argument("--out", required=True, help="where the combined results go")
    p.add_argument("--allow-missing", action="store_true",
                   help="merge even when some slices of an i/n set are absent")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    results: list[dict[str, Any]] = []
    files: dict[tuple[str, str], dict[str, Path]] = {}
    labs: dict[str, LabInfo] = {}
    shards: set[tuple[int, int]] = set()
    seen: dict[tuple[str, str], Path] = {}
    isolation: list[Any] = []
    intake_rows: dict[tuple[str, ...], dict[str, str]] | None = None
    for folder in map(lambda f: Path(f).resolve(), a.folders):
        if folder == out:
            print(f"grade merge: --out {out} is one of the inputs", file=sys.stderr)
            return 2
        try:
            run = json.loads((folder / "run.json").read_text())
            rows = json.loads((folder / "results.json").read_text())
        except (OSError, ValueError) as e:
            print(f"grade merge: {folder} is not a grade.sh --out folder ({e})", file=sys.stderr)
            return 2
        for name, d in run["labs"].items():
            info = LabInfo(name, d["cells"], d.get("fingerprint", ""), d.get("questions", {}),
                           d.get("tasks", {}))
            if name in labs and (labs[name].cells, labs[name].fingerprint) != \
                    (info.cells, info.fingerprint):
                print(f"grade merge: {folder} graded {name} from another source than the "
                      "folders before it (different tests or points)", file=sys.stderr)
                return 2
            labs[name] = info
        if run.get("shard"):
            shards.add(tuple(run["shard"]))
        if (folder / "intake.csv").exists():  # a file no student owns is in every slice's
            with open(folder / "intake.csv", newline="", encoding="utf-8") as f:
                intake_rows = intake_rows or {}
                intake_rows.update({tuple(row.values()): row for row in csv.DictReader(f)})
        isolation.append(run.get("isolation"))
        for r in rows:
            key = (r["lab"], r["student"])
            if key in seen:
                print(f"grade merge: {r['student']}/{r['lab']} is in both {seen[key]} and "
                      f"{folder}", file=sys.stderr)
                return 2
            seen[key] = folder
            results.append(r)
            logs = folder / "logs" / r["student"]
            files[key] = {"feedback": folder / r["feedback"] if r.get("feedback") else Path("-"),
                          **{kind: logs / f"{r['lab']}.{kind}" for kind in ("log", "grader")}}
    ns = {n for _, n in shards}
    if shards and not a.allow_missing:
        missing = [f"{i}/{n}" for n in ns for i in range(1, n + 1) if (i, n) not in shards]
        if len(ns) > 1 or missing:
            print(f"grade merge: slices missing or mixed: have {sorted(shards)}, missing "
                  f"{missing} (use --allow-missing to merge anyway)", file=sys.stderr)
            return 2
    labs = dict(sorted(labs.items()))
    meta = {"shard": None, "merged_from": [str(Path(f).resolve()) for f in a.folders],
            "isolation": isolation[0] if len({json.dumps(i) for i in isolation}) == 1
            else isolation}
    text = write_outputs(out, results, labs, files, meta,
                         None if intake_rows is None else list(intake_rows.values()))
    print(text)
    print(f"merged {len(results)} submission(s) from {len(a.folders)} folder(s) into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
