"""Grade submitted labs with nbgrader; run through ``bash autograder/grade.sh``.

    grade.sh                           the example submissions in autograder/examples/
    grade.sh SUBMISSIONS               a folder (or .zip) of <student>/<lab>/<lab>.ipynb
    grade.sh ... --lab lab01_basics    only this lab (repeatable)
    grade.sh ... --out DIR             where results go (default grading-out/)

Each submission is graded on its own by :func:`grade_submission`: in its own work folder (a
copy of the gradebook that knows the lab, its notebook, nbgrader's autograded and feedback
output) and in its own process with a wall-clock limit. One submission cannot disturb the
grading of another, and the function is the unit that a sandbox, parallel grading or a batch
system can wrap. The overall steps:

1. ``prepare``: nbgrader generate_assignment of each lab from the source (``--source``,
   default solutions/: point it at a private copy whose hidden tests students never saw) into
   the work folder's gradebook. The committed labs/ is not touched.
2. per submission: the notebook's cell metadata is reset to the released lab's (tampered flags
   would abort nbgrader), then nbgrader autograde (which restores locked and test cells from
   the gradebook and re-adds deleted ones), then the HTML feedback (hidden tests removed).
3. the report: per-lab and overall CSVs, feedback files, ``results.json`` and the table.

A submission that fails is a grade (0 for what did not pass, with the reason), not a crash:
the exit code is 2 only when the grader itself failed.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT, tools_on_path
from .settings import CELL_TIMEOUT, KERNEL

STUDENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
TEST_RE = re.compile(r"^test_(\d+)_(\d+)_")
QUIZ_RE = re.compile(r"^test_quiz_")
MAX_ZIP_BYTES = 2 << 30
MAX_ZIP_FILES = 100_000
WALL_DEFAULT = 1200
REFERENCE_STUDENT = "reference"


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


# ---------------------------------------------------------------------------------------
# the lab's grade cells
# ---------------------------------------------------------------------------------------
@dataclass
class LabInfo:
    """A lab's graded cells in notebook order, their points, and how they group into tasks."""

    name: str
    cells: dict[str, float] = field(default_factory=dict)  # grade_id -> points

    @property
    def max_score(self) -> float:
        return sum(self.cells.values())

    @staticmethod
    def group(grade_id: str) -> str:
        """``test_1_3_leaf`` → ``1.3``; ``test_quiz_q2`` → ``quiz``; else the grade_id."""
        if QUIZ_RE.match(grade_id):
            return "quiz"
        m = TEST_RE.match(grade_id)
        return f"{m.group(1)}.{m.group(2)}" if m else grade_id

    @property
    def groups(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for gid, pts in self.cells.items():
            out[self.group(gid)] = out.get(self.group(gid), 0.0) + pts
        if "quiz" in out:  # the quiz last, after the tasks
            out["quiz"] = out.pop("quiz")
        return out


def lab_info(notebook: Path, name: str) -> LabInfo:
    import nbformat

    info = LabInfo(name)
    for cell in nbformat.read(notebook, as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade"):
            info.cells[meta["grade_id"]] = float(meta.get("points", 0))
    return info


# ---------------------------------------------------------------------------------------
# preparing the gradebook
# ---------------------------------------------------------------------------------------
def nbgrader_api(root: Path, *, work: str, source: Path, release: Path, timeout: int,
                 kernel: str) -> Any:
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    from .settings import configure

    cfg = configure(Config(), root=root, work=work, source=str(source), release=str(release),
                    timeout=timeout, kernel=kernel)
    cfg.Application.log_level = "WARN"
    return NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)


def prepare(base: Path, source: Path, labs: list[str]) -> None:
    """A gradebook that knows every lab (source cells, hidden tests, points, checksums) and
    the released notebooks, in ``base``."""
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    api = nbgrader_api(base, work=".", source=source, release=base / "release",
                       timeout=CELL_TIMEOUT, kernel=KERNEL)
    for lab in labs:
        res = api.generate_assignment(lab, force=True, create=True)
        if not res["success"]:
            raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n"
                               f"{res.get('log', '')}\n{res.get('error', '')}")


# ---------------------------------------------------------------------------------------
# grading one submission
# ---------------------------------------------------------------------------------------
def sanitize(release_nb: Path, submitted: Path) -> None:
    """Reset the nbgrader metadata, cell types and kernelspec of a submission to the release.

    A student who flips ``solution`` or ``grade`` on a test cell (or changes its type) makes
    nbgrader abort with "Inconsistent checksums"; reset, nbgrader then restores the cell's
    source from the gradebook. Cells whose grade_id is unknown or repeated lose their nbgrader
    metadata (nbgrader re-adds missing graded cells itself).
    """
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell

    rel = nbformat.read(release_nb, as_version=4)
    ref = {c.metadata["nbgrader"]["grade_id"]: c for c in rel.cells
           if "grade_id" in c.metadata.get("nbgrader", {})}
    sub = nbformat.read(submitted, as_version=4)
    seen: set[str] = set()
    cells = []
    for c in sub.cells:
        gid = c.metadata.get("nbgrader", {}).get("grade_id")
        if gid is None or gid not in ref or gid in seen:
            c.metadata.pop("nbgrader", None)
            cells.append(c)
            continue
        seen.add(gid)
        r = ref[gid]
        if c.cell_type != r.cell_type:
            c = (new_code_cell if r.cell_type == "code" else new_markdown_cell)(source=c.source)
        c.metadata = copy.deepcopy(r.metadata)
        cells.append(c)
    sub.cells = cells
    sub.metadata["kernelspec"] = copy.deepcopy(rel.metadata.get("kernelspec", {}))
    nbformat.write(sub, submitted)


STUDENT_FAILURES = [  # what autograde failures mean: the submission's doing, not the grader's
    ("DeadKernelError", "the kernel died (the code crashed Python or exited)"),
    ("Kernel died", "the kernel died (the code crashed Python or exited)"),
    ("Timeout waiting for IOPub", "the kernel stopped responding (it ignored the time-out)"),
    ("Inconsistent checksums", "the notebook's cell metadata could not be repaired"),
    ("NotJSONError", "the notebook is not a readable .ipynb file"),
    ("Notebook does not appear to be JSON", "the notebook is not a readable .ipynb file"),
    ("ValidationError", "the notebook is not a valid .ipynb file"),
]


def _classify(text: str) -> str | None:
    for needle, reason in STUDENT_FAILURES:
        if needle in text:
            return reason
    return None


def _scores(db: Path, lab: str, student: str) -> dict[str, float | None]:
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook("sqlite:///" + str(db)) as gb:
        try:
            sub = gb.find_submission(lab, student)
        except MissingEntry:
            return {}
        return {g.name: (None if g.auto_score is None and g.manual_score is None
                         else float(g.score))
                for nb in sub.notebooks for g in nb.grades}


def _cell_report(autograded: Path) -> tuple[dict[str, str], bool]:
    """Per graded cell that failed, its error line; and whether every code cell ran."""
    import nbformat

    nb = nbformat.read(autograded, as_version=4)
    errors: dict[str, str] = {}
    ran_all = True
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.get("execution_count") is None and not cell.get("outputs"):
            ran_all = False
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        for out in cell.get("outputs", []):
            if gid and out.get("output_type") == "error":
                errors[gid] = f"{out.get('ename')}: {out.get('evalue', '')}"[:500]
            elif gid and out.get("output_type") == "stream" and out.get("name") == "stderr":
                errors.setdefault(gid, "wrote to stderr")
    return errors, ran_all


def grade_in_process(sub: Submission, *, base: Path, root: Path, source: Path,
                     timeout: int, kernel: str) -> dict[str, Any]:
    """Autograde one submission in ``root`` (its own folder) and return its result."""
    t0 = time.monotonic()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    shutil.copy2(base / "gradebook.db", root / "gradebook.db")
    submitted = root / "submitted" / sub.student / sub.lab / f"{sub.lab}.ipynb"
    submitted.parent.mkdir(parents=True)
    shutil.copyfile(sub.notebook, submitted)  # the notebook only: no files that shadow imports
    result: dict[str, Any] = {"student": sub.student, "lab": sub.lab, "status": "graded",
                              "reason": "", "scores": {}, "errors": {}, "ran_all_cells": False,
                              "feedback": None, "log": ""}
    release_nb = base / "release" / sub.lab / f"{sub.lab}.ipynb"
    try:
        sanitize(release_nb, submitted)
    except Exception as e:
        reason = _classify(f"{type(e).__name__} {e}") or "the notebook could not be read"
        result.update(status="failed", reason=f"{reason} ({type(e).__name__}: {e})"[:300])
        result["seconds"] = time.monotonic() - t0
        return result
    api = nbgrader_api(root, work=".", source=source, release=base / "release",
                       timeout=timeout, kernel=kernel)
    res = api.autograde(sub.lab, sub.student, force=True, create=True)
    result["log"] = res.get("log", "") + res.get("error", "")
    autograded = root / "autograded" / sub.student / sub.lab / f"{sub.lab}.ipynb"
    if not res["success"]:
        reason = _classify(result["log"])
        if reason is None:
            result.update(status="error", reason="nbgrader autograde failed (see the log)")
        else:
            result.update(status="failed", reason=reason)
    result["scores"] = _scores(root / "gradebook.db", sub.lab, sub.student)
    if autograded.exists():
        result["errors"], result["ran_all_cells"] = _cell_report(autograded)
    if res["success"]:
        fb = api.generate_feedback(sub.lab, sub.student, force=True)
        html = root / "feedback" / sub.student / sub.lab / f"{sub.lab}.html"
        if fb["success"] and html.exists():
            result["feedback"] = str(html)
        else:
            result["log"] += fb.get("log", "") + fb.get("error", "")
    result["seconds"] = time.monotonic() - t0
    return result


def grade_submission(sub: Submission, *, base: Path, root: Path, source: Path, timeout: int,
                     kernel: str, wall: int) -> dict[str, Any]:
    """Grade one submission in a separate process bounded by ``wall`` seconds (the process
    group is killed after it, kernel included). Always returns a result."""
    t0 = time.monotonic()
    job = {"student": sub.student, "lab": sub.lab, "notebook": str(sub.notebook),
           "base": str(base), "root": str(root), "source": str(source), "timeout": timeout,
           "kernel": kernel}
    out = root.parent / f"{root.name}.result.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "autograder.grade", "--worker", json.dumps(job), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=wall)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return {"student": sub.student, "lab": sub.lab, "status": "failed",
                "reason": f"grading took longer than {wall} s and was stopped", "scores": {},
                "errors": {}, "ran_all_cells": False, "feedback": None, "log": log,
                "seconds": time.monotonic() - t0}
    finally:
        try:  # the kernel and anything the student's code started
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.returncode != 0 or not out.exists():
        return {"student": sub.student, "lab": sub.lab, "status": "error",
                "reason": f"the grading process failed (exit {proc.returncode})", "scores": {},
                "errors": {}, "ran_all_cells": False, "feedback": None, "log": log,
                "seconds": time.monotonic() - t0}
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = log + result.get("log", "")
    return result


def worker_main(job_json: str, out: str) -> int:
    job = json.loads(job_json)
    sub = Submission(job["student"], job["lab"], Path(job["notebook"]))
    result = grade_in_process(sub, base=Path(job["base"]), root=Path(job["root"]),
                              source=Path(job["source"]), timeout=int(job["timeout"]),
                              kernel=job["kernel"])
    Path(out).write_text(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:g}"


def summarize(results: list[dict[str, Any]], labs: dict[str, LabInfo]) -> list[dict[str, Any]]:
    """One row per submission: score per task group, total, max, status."""
    rows = []
    for r in results:
        info = labs[r["lab"]]
        groups = {g: 0.0 for g in info.groups}
        for gid, pts in r["scores"].items():
            if gid in info.cells and pts is not None:
                groups[info.group(gid)] += pts
        total = sum(groups.values())
        rows.append({"lab": r["lab"], "student": r["student"], "groups": groups,
                     "total": total, "max": info.max_score, "status": r["status"],
                     "reason": r["reason"], "seconds": r.get("seconds", 0.0)})
    return rows


def table(rows: list[dict[str, Any]], labs: dict[str, LabInfo]) -> str:
    lines = []
    for lab, info in labs.items():
        lab_rows = [r for r in rows if r["lab"] == lab]
        if not lab_rows:
            continue
        heads = list(info.groups)
        header = ["student", *heads, "total", "status"]
        points = ["(points)", *[_fmt(info.groups[g]) for g in heads], _fmt(info.max_score), ""]
        body = [[r["student"], *[_fmt(r["groups"][g]) for g in heads], _fmt(r["total"]),
                 r["status"] + (f": {r['reason']}" if r["reason"] else "")] for r in lab_rows]
        width = [max(len(row[i]) for row in [header, points, *body]) for i in range(len(header))]
        lines.append(f"{lab}: {len(lab_rows)} submission(s)")
        for row in [header, points, *body]:
            cells = [row[0].ljust(width[0])] + [c.rjust(width[i])
                                                for i, c in enumerate(row[1:-1], 1)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
        lines.append("")
    return "\n".join(lines)


MARK = ".minickpt-grading"


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


def write_outputs(out: Path, results: list[dict[str, Any]], rows: list[dict[str, Any]],
                  labs: dict[str, LabInfo]) -> None:
    fresh_dir(out)
    (out / "feedback").mkdir()
    (out / "logs").mkdir()
    for r in results:
        if r.get("feedback"):
            dest = out / "feedback" / r["student"] / f"{r['lab']}.html"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(r["feedback"], dest)
            r["feedback"] = str(dest.relative_to(out))
        log = out / "logs" / r["student"] / f"{r['lab']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(r.pop("log", "") or "")
    for lab, info in labs.items():
        with open(out / f"grades-{lab}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["student", *info.groups, *info.cells, "total", "max_score", "status",
                        "reason"])
            for r, row in zip(results, rows, strict=True):
                if r["lab"] != lab:
                    continue
                w.writerow([r["student"], *[_fmt(row["groups"][g]) for g in info.groups],
                            *[_fmt(r["scores"].get(g)) for g in info.cells],
                            _fmt(row["total"]), _fmt(info.max_score), r["status"], r["reason"]])
    students = sorted({r["student"] for r in results})
    with open(out / "grades.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", *labs, "total", "max_score"])
        for s in students:
            per = {row["lab"]: row["total"] for row in rows if row["student"] == s}
            w.writerow([s, *[_fmt(per.get(lab, 0.0)) for lab in labs],
                        _fmt(sum(per.values())), _fmt(sum(i.max_score for i in labs.values()))])
    (out / "results.json").write_text(json.dumps(
        [{**r, **{"groups": row["groups"], "total": row["total"], "max_score": row["max"]}}
         for r, row in zip(results, rows, strict=True)], indent=1))


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="autograder/grade.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("submissions", nargs="?", default=str(ROOT / "autograder" / "examples"),
                   help="folder or .zip of <student>/<lab>/<lab>.ipynb "
                        "(default: the examples in autograder/examples)")
    p.add_argument("--lab", action="append", help="grade only this lab (repeatable)")
    p.add_argument("--out", default="grading-out", help="results folder (default grading-out/)")
    p.add_argument("--source", default=str(ROOT / "solutions"),
                   help="the labs' source with hidden tests (default solutions/; use a private "
                        "copy so that students never see the hidden tests)")
    p.add_argument("--work", default=str(ROOT / ".grading"),
                   help="nbgrader's work folder (default .grading/, emptied first)")
    p.add_argument("--timeout", type=int, default=CELL_TIMEOUT,
                   help=f"seconds a cell may run (default {CELL_TIMEOUT})")
    p.add_argument("--wall", type=int, default=WALL_DEFAULT,
                   help=f"seconds one submission may take in all (default {WALL_DEFAULT})")
    p.add_argument("--kernel", default=KERNEL, help=f"Jupyter kernel name (default {KERNEL})")
    p.add_argument("--include-solutions", action="store_true",
                   help=f"also grade each lab's source notebook as student "
                        f"'{REFERENCE_STUDENT}' (a self-check: it must score full marks)")
    a = p.parse_args(argv)
    tools_on_path()
    t0 = time.monotonic()
    source, work, out = Path(a.source).resolve(), Path(a.work).resolve(), Path(a.out).resolve()
    known = {d.name for d in source.iterdir() if (d / f"{d.name}.ipynb").is_file()}
    if a.lab:
        unknown = set(a.lab) - known
        if unknown:
            print(f"grade: no lab {sorted(unknown)} in {source}", file=sys.stderr)
            return 2
        known = set(a.lab)
    fresh_dir(work)
    if out.exists() and any(out.iterdir()) and not (out / MARK).exists():
        fresh_dir(out)  # refuses now, before any grading, rather than at the end
    folder = Path(a.submissions).resolve()
    if folder.is_file() and zipfile.is_zipfile(folder):
        folder = unpack_zip(folder, work / "incoming")
    elif not folder.is_dir():
        print(f"grade: {a.submissions} is neither a folder nor a zip file", file=sys.stderr)
        return 2
    subs, warnings = find_submissions(folder, known)
    if a.include_solutions:
        labs_seen = sorted({s.lab for s in subs} or known)
        subs += [Submission(REFERENCE_STUDENT, lab, source / lab / f"{lab}.ipynb")
                 for lab in labs_seen]
    for w in warnings:
        print(f"grade: {w}", file=sys.stderr)
    if not subs:
        print(f"grade: no submissions <student>/<lab>/<lab>.ipynb for labs {sorted(known)} "
              f"in {a.submissions}", file=sys.stderr)
        return 2
    labs = sorted({s.lab for s in subs})
    infos = {lab: lab_info(source / lab / f"{lab}.ipynb", lab) for lab in labs}
    print(f"grade: {len(subs)} submission(s) of {', '.join(labs)}; cells may run {a.timeout} s",
          flush=True)
    try:
        prepare(work / "base", source, labs)
    except Exception as e:
        print(f"grade: could not prepare the gradebook: {e}", file=sys.stderr)
        return 2
    results = []
    for i, sub in enumerate(subs, 1):
        r = grade_submission(sub, base=work / "base", root=work / "subs" / f"{sub.lab}-{sub.student}",
                             source=source, timeout=a.timeout, kernel=a.kernel, wall=a.wall)
        results.append(r)
        total = sum(v for v in r["scores"].values() if v is not None)
        print(f"  [{i}/{len(subs)}] {sub.student}/{sub.lab}: {total:g}/{infos[sub.lab].max_score:g} "
              f"{r['status']} ({r['seconds']:.1f} s)", flush=True)
    rows = summarize(results, infos)
    write_outputs(out, results, rows, infos)
    text = table(rows, infos)
    (out / "summary.txt").write_text(text)
    print()
    print(text)
    errors = [r for r in results if r["status"] == "error"]
    print(f"graded {len(results)} submission(s) in {time.monotonic() - t0:.0f} s; results in {out}"
          f" (grades.csv, grades-<lab>.csv, feedback/, logs/)")
    if errors:
        print(f"grade: grading itself failed for {len(errors)} submission(s): "
              + ", ".join(f"{r['student']}/{r['lab']}" for r in errors)
              + f"; see {out}/logs/", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
