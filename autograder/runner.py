"""Grading submissions: one submission (:func:`grade_one`), the worker processes that grade
them one after another, and the pool that keeps ``-j N`` workers busy.

:func:`grade_one` is the unit: one notebook, its own folder, its own sandboxed kernel; it
always returns a result (a broken notebook is a grade with a reason, a bug of the grader is
status ``error``). A worker is a long-lived Python process (nbclient, the lab's source and the
quiz checker are loaded once, not once per student) that reads jobs on stdin and answers on
its own pipe. The pool gives each worker a parallel *slot* with its own sandbox uid; a worker
that dies or overruns the wall clock is killed with everything of its uid, the submission
gets its reason, and a fresh worker takes the slot. So one submission never stops the others,
and which slot graded a submission changes nothing in its result.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import ROOT, cgroups, drills, judge, sandbox, similarity
from .notebook import (
    MAX_NOTEBOOK_BYTES,
    Assembled,
    Lab,
    SubmissionError,
    assemble,
    grade_cells,
    hidden_lines_of,
    load_lab,
    read_submission,
    reference_use,
    scan,
    strip_receipts,
    task_of,
    task_totals,
    text_only,
)

REFEREE_FILE = Path(__file__).resolve().parent / "referee.py"
REFEREE_IN_SANDBOX = "/opt/minickpt-grader/referee.py"
KERNEL_LOG_BYTES = 1 << 20
"""What of the kernel's own stdout/stderr is kept in kernel.log (the start of it)."""
WORKER_MEMORY = 4 << 30
"""RLIMIT_DATA of a grading worker, a backstop per process: the worker runs inside its slot's
cgroup (whose memory bounds kernel and worker together), and whatever a kernel sends, it keeps
only bounded parts of (execute.py: one output budget per submission)."""
KERNEL_ARGS = ["--HistoryManager.hist_file=:memory:", "--InteractiveShell.xmode=Minimal"]


@dataclass(frozen=True)
class Job:
    id: int
    student: str
    lab: str
    notebook: str
    dir: str
    cache: str = ""
    """The lab's grading compilation cache (a folder; "" for none): read-only to the kernel,
    unless ``fill``: then it is the empty folder the reference's kernel fills."""
    fill: bool = False


def job_from(d: dict[str, Any]) -> Job:
    return Job(int(d["id"]), str(d["student"]), str(d["lab"]), str(d["notebook"]), str(d["dir"]),
               str(d.get("cache", "")), bool(d.get("fill", False)))


# ---------------------------------------------------------------------------------------
# one submission
# ---------------------------------------------------------------------------------------
def _base_result(job: Job, lab: Lab, isolation: str) -> dict[str, Any]:
    return {"student": job.student, "lab": job.lab, "status": "graded", "reason": "",
            "scores": dict.fromkeys(lab.grade_cells, 0.0), "messages": {}, "notes": [],
            "review": [], "isolation": isolation, "ran_all_cells": False}


def _to_notebook(asm: Assembled) -> Any:
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    cells = []
    for c in asm.cells:
        meta = {"minickpt": {"role": c.role, "grade_id": c.grade_id}}
        cells.append(new_markdown_cell(c.show, metadata=meta) if c.kind == "markdown"
                     else new_code_cell(c.run, metadata=meta))
    return new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3",
                                                              "display_name": "Python 3",
                                                              "language": "python"}})


def grade_one(job: Job, cfg: dict[str, Any], labs: dict[str, Lab]) -> dict[str, Any]:
    """Grade one submission in ``job.dir``; write result.json, feedback.html, graded.ipynb
    (the instructor's copy, hidden tests included) and kernel.log there. Never raises."""
    t0 = time.monotonic()
    root = Path(job.dir)
    iso = sandbox.Isolation(**cfg["iso"])
    try:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True, mode=0o700)
        lab = labs.get(job.lab)
        if lab is None:
            lab = labs[job.lab] = load_lab(Path(cfg["source"]) / job.lab / f"{job.lab}.ipynb")
        result = _base_result(job, lab, iso.marker)
        try:
            copy_submission(Path(job.notebook), root / "submitted.ipynb")
            student = read_submission(root / "submitted.ipynb")
        except (SubmissionError, OSError) as e:
            reason = str(e) if isinstance(e, SubmissionError) else f"cannot be read: {e}"
            result.update(status="failed", reason=reason)
            _finish(root, result, lab, None, None, t0)
            return result
        _run(job, cfg, lab, student, iso, result, root, t0)
        return result
    except Exception:
        result = {"student": job.student, "lab": job.lab, "status": "error",
                  "reason": "the grader failed on this submission (see its log)", "scores": {},
                  "messages": {}, "notes": [], "review": [], "isolation": iso.marker,
                  "ran_all_cells": False}
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / "grader.log").write_text(traceback.format_exc())
            (root / "result.json").write_text(json.dumps(result, indent=1))
            (root / "timing.json").write_text(json.dumps({"seconds": time.monotonic() - t0}))
        except OSError:
            pass
        return result


RELEASE = ROOT / "labs"
"""Where the released labs are: a lab's data files are mounted from there, never from
``--source``."""


def data_files(released: Path, cwd: str) -> dict[str, str]:
    """The lab's data files as the kernel sees them in its working folder: those of the
    *released* lab (what every student downloaded), regular files only (never a link), no
    notebook, no hidden file. Nothing of ``--source`` is ever mounted: its notebook is read
    by the grader (tests go to the kernel sealed), and whatever lies beside it (an editor's
    backup, the instructor's notes) stays out of the kernel's reach."""
    found = {}
    try:
        entries = sorted(os.scandir(released), key=lambda e: e.name)
    except OSError:
        return {}
    for e in entries:
        if e.is_file(follow_symlinks=False) and not e.name.endswith(".ipynb") \
                and not e.name.startswith("."):
            found[e.path] = f"{cwd}/{e.name}"
    return found


KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket",
         stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def copy_submission(src: Path, dest: Path) -> None:
    """Copy the handed-in notebook into the submission's folder, only if it is a regular
    file: a symbolic link (to the solutions, to ``/dev/zero``) is never followed, a pipe or a
    device never opened for reading; each is a :class:`SubmissionError` that names it (the
    grade row's reason). ``lstat`` decides, ``O_NOFOLLOW`` and ``fstat`` on what was opened
    close the race with a file swapped in between; at most
    :data:`~autograder.notebook.MAX_NOTEBOOK_BYTES` (and one more) are read."""
    try:
        st = os.lstat(src)
    except OSError as e:
        raise SubmissionError(f"the notebook cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(src)
        except OSError:
            target = "?"
        raise SubmissionError(f"the notebook is a symbolic link (to {target[:200]!r}), not a "
                              "file: only a regular file is graded, a link is never followed")
    if not stat.S_ISREG(st.st_mode):
        kind = KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
        raise SubmissionError(f"the notebook is not a regular file ({kind}): only a regular "
                              "file is graded")
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # ELOOP: it became a link after the lstat
        raise SubmissionError(f"the notebook cannot be read ({e.strerror}): only a regular "
                              "file is graded") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SubmissionError("the notebook is not a regular file: only a regular file "
                                  "is graded")
        data = f.read(MAX_NOTEBOOK_BYTES + 1)
    if len(data) > MAX_NOTEBOOK_BYTES:
        raise SubmissionError(f"the notebook is more than {MAX_NOTEBOOK_BYTES >> 20} MiB; that "
                              "is not a lab (clear its outputs)")
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(out, "wb") as f:
        f.write(data)


def _run(job: Job, cfg: dict[str, Any], lab: Lab, student: list[Any], iso: sandbox.Isolation,
         result: dict[str, Any], root: Path, t0: float) -> None:
    from . import execute
    from .execute import GradingClient

    uid = cfg.get("uid")
    limits = sandbox.Limits(**cfg["limits"])
    ipc = Path(cfg["ipc"])
    sandbox.prepare_ipc_dir(ipc, iso, uid or 0)
    graded = (cfg.get("graded") or {}).get(lab.name) if iso.sandboxed else None
    if iso.sandboxed:
        referee_path, cwd = REFEREE_IN_SANDBOX, f"/home/student/{lab.name}"
        key_file = str(ipc / "referee.key")
        extra_ro = {str(REFEREE_FILE): REFEREE_IN_SANDBOX,
                    **data_files(Path(cfg.get("release") or RELEASE) / lab.name, cwd)}
        if graded:  # issue 38: the lab's tasks are absent from the minickpt the kernel imports
            extra_ro[graded] = sandbox.env_package() or sandbox.grader_package() or ""
    else:
        scratch = root / "scratch"
        (scratch / "tmp").mkdir(parents=True)
        referee_path, cwd, key_file, extra_ro = str(REFEREE_FILE), str(scratch), \
            str(scratch / "referee.key"), {}
    refereed = os.environ.get("MINICKPT_REFEREE", "").lower() not in ("off", "0", "no")
    judged = judge.judges(lab.name)
    asm = assemble(lab, student, referee_path=referee_path, key_file=key_file, refereed=refereed,
                   hoist=bool(graded), judged=judged)
    for c in asm.cells:
        if c.role == "student":
            c.run = _compilable(c.run)
    if not refereed:
        result["isolation"] += " + NO REFEREE (MINICKPT_REFEREE=off)"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(asm.key)
    if iso.mode == "bwrap-root" and uid:
        os.chown(key_file, uid, uid)
    nb = _to_notebook(asm)
    reap = uid if iso.mode == "bwrap-root" else None

    def lock_ipc() -> None:
        """The kernel has bound its sockets: from now on it may not create files in the ipc
        folder (a real folder of the grading machine, not a size-capped tmpfs)."""
        if iso.mode == "bwrap-root":
            os.chown(ipc, 0, 0)
            os.chmod(ipc, 0o755)
            conn = ipc / "connection.json"
            if conn.exists():
                os.chown(conn, 0, 0)

    def drop_key() -> None:
        """The referee has read its key in the first cell; no student code has run yet."""
        Path(key_file).unlink(missing_ok=True)

    slot_cgroup = cgroups.from_list(cfg.get("cgroup"))
    cache, cache_vars = _compile_cache(job, cfg, iso, uid, root)
    km = sandbox.make_kernel_manager(iso, uid=uid or 0, ipc_dir=str(ipc), cwd=cwd,
                                     limits=limits, extra_ro=extra_ro, kernel_args=KERNEL_ARGS,
                                     max_message_bytes=int(cfg["max_message"]),
                                     cgroup=slot_cgroup, cache=cache)
    client = GradingClient(nb, km, timeout=int(cfg["timeout"]),
                           setup_timeout=int(cfg["setup_timeout"]),
                           keep_output_bytes=int(cfg["keep_output"]),
                           max_output_bytes=int(cfg["max_output"]),
                           budget_chars=int(cfg.get("keep_output_total",
                                                    execute.SUBMISSION_KEEP_CHARS)),
                           budget_outputs=int(cfg.get("keep_outputs", execute.SUBMISSION_OUTPUTS)),
                           interrupt_grace=int(cfg["grace"]), reap_uid=reap,
                           deadline=t0 + int(cfg["wall"]), on_ready=lock_ipc,
                           after_first_cell=drop_key)
    env = None if iso.sandboxed else {**sandbox.without_shared_caches(dict(os.environ)),
                                      **cache_vars,
                                      "IPYTHONDIR": str(root / "scratch" / ".ipython"),
                                      "TMPDIR": str(root / "scratch" / "tmp")}
    t_run = time.monotonic()
    try:
        report = run_client(client, root / "kernel.log", env=env,
                            cwd=cwd if not iso.sandboxed else None)
    finally:
        if reap:
            sandbox.kill_uid(reap)
        if slot_cgroup is not None:
            slot_cgroup.kill(spare={os.getpid()})  # this worker runs in it too
        km.context.destroy(linger=0)
    _write_phases(root / "phases.json", asm, nb, report, t0, t_run)
    executed = [[_text_only(o) for o in c.get("outputs", [])] if c.cell_type == "code" else []
                for c in nb.cells]
    notes = {i: msg for i, msg in report.not_run.items()}
    box = drills.Box(iso, uid or 0, limits, {graded: extra_ro[graded]} if graded else {},
                     root, slot_cgroup)
    tools = {"grader_drill": drills.tool([c.run for c in asm.cells if c.role == "student"], box)}
    for g in grade_cells(asm, executed, notes, lab.grade_cells, tools):
        if judged and g.grade_id not in lab.quiz_cells:
            continue  # the judge decides it, below
        result["scores"][g.grade_id] = g.score
        if g.message:
            result["messages"][g.grade_id] = g.message
        for what in g.restored:
            result["review"].append(f"{what[len('watch: '):]} (in {g.grade_id})"
                                    if what.startswith("watch: ") else
                                    f"changed {what} (put back before {g.grade_id})")
    if judged:
        slowest = _judge(lab, asm, box, tools, result, executed)
        _add_phases(root / "phases.json", {"judge": result["judge_seconds"],
                                           "slowest_test": slowest[0],
                                           "slowest_test_seconds": round(slowest[1], 2)})
    result["notes"] = [*asm.notes, *result.get("notes", [])]
    if report.fate:
        result["reason"] = f"{report.fate}: the cells after it were not run (0 points)"
    if report.output_budget:
        result["reason"] = "; ".join(filter(None, [result["reason"], report.output_budget]))
    result["ran_all_cells"] = not report.not_run and not report.fate
    mine = [(c.grade_id or f"your cell {k}", c.show) for k, c in enumerate(asm.cells)
            if c.role == "student" and c.show.strip()]  # what the student wrote, not what ran
    result["review"] = sorted(set(result["review"]) | set(scan(mine))
                              | set(reference_use(mine, lab)))
    result["code"] = similarity.submission_code(mine)  # every cell the student wrote
    if report.strays_killed:
        result["killed_processes"] = report.strays_killed
    _finish(root, result, lab, asm, executed, t0)


def _judge(lab: Lab, asm: Assembled, box: drills.Box, tools: dict[str, Any],
           result: dict[str, Any], executed: list[list[Any]]) -> tuple[str, float]:
    """Every test of ``lab`` decided by the judge (:mod:`autograder.judge`): the tests run in
    this process, the student's functions in a worker in the sandbox; the kernel's run above
    was the student's feedback and earned nothing. Returns the slowest test and its seconds
    ("", 0 for none)."""
    t = time.monotonic()
    student = [c.run for c in asm.cells if c.role == "student"]
    with box.scratch() as d:
        verdicts, problems = judge.judge_lab(
            lab.name, student, d, wrap=box.wrap(d) if box.iso.sandboxed else None,
            uid=box.uid if box.iso.mode == "bwrap-root" else None, tools=tools,
            cells=judge.cells_of(lab), end_workers=box.end_workers,
            launch=drills.judge_launch(box, d) if box.iso.sandboxed else None)
    where = {c.grade_id: i for i, c in enumerate(asm.cells) if c.role == "test"}
    for v in verdicts:
        if v.grade_id in where:  # what the test printed here, shown in its place
            outs = [{"output_type": "stream", "name": "stdout", "text": v.output}] \
                if v.output else []
            if not v.passed:
                outs.append({"output_type": "error", "ename": "Failed", "evalue": v.message,
                             "traceback": []})
            executed[where[v.grade_id]] = outs
        result["scores"][v.grade_id] = lab.grade_cells[v.grade_id] if v.passed else 0.0
        if v.passed:
            result["messages"].pop(v.grade_id, None)
        else:
            result["messages"][v.grade_id] = v.message
    result["notes"] = [*result.get("notes", []), *(f"judge: {p}" for p in problems)]
    from .judge.worker import REACHED

    result["review"] = [*result.get("review", []),  # what the kernel's watch flagged before
                        *(p for p in problems if p.startswith(REACHED))]
    result["judge_seconds"] = round(time.monotonic() - t, 2)
    slow = max(verdicts, key=lambda v: v.seconds, default=None)
    return (slow.grade_id, slow.seconds) if slow is not None else ("", 0.0)


def _slot_cpu(slot: cgroups.SlotCgroup | None) -> dict[str, float]:
    """The slot cgroup's CPU counters in seconds: ``cpu`` (used; v2's usage_usec, or v1's
    cpuacct.usage where cpuacct shares the cpu folder) and ``throttled`` (time its processes
    wanted a core but the slot's cpu.max share was spent)."""
    out: dict[str, float] = {}
    for folder in slot.paths if slot is not None else ():
        try:
            with open(os.path.join(folder, "cpu.stat")) as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
        except (OSError, ValueError):
            stat = {}
        if "usage_usec" in stat:
            out["cpu"] = int(stat["usage_usec"]) / 1e6
        if "throttled_usec" in stat:
            out["throttled"] = int(stat["throttled_usec"]) / 1e6
        elif "throttled_time" in stat:  # v1: nanoseconds
            out["throttled"] = int(stat["throttled_time"]) / 1e9
        try:
            with open(os.path.join(folder, "cpuacct.usage")) as f:
                out["cpu"] = int(f.read()) / 1e9
        except (OSError, ValueError):
            pass
    return out


def _write_phases(path: Path, asm: Assembled, nb: Any, report: Any, t0: float, t_run: float
                  ) -> None:
    """Where one submission's wall time went (timings.csv's columns, the slowest list):
    ``prepare`` (copy, assemble; the private cache copy), ``kernel`` (its start and stop: the
    run less its cells), ``setup`` (the referee's and the lab's setup cells), ``cells`` (the
    rest), the slowest other cell and the cells stopped at their time-out (:func:`worker_main`
    adds the slot's CPU seconds)."""
    seconds = {int(k): float(v) for k, v in report.seconds.items()}
    roles = {k: (c.role, c.grade_id or f"{c.role} cell {k}") for k, c in enumerate(asm.cells)}
    setup = sum(s for k, s in seconds.items() if roles[k][0] in ("setup", "referee"))
    rest = {k: s for k, s in seconds.items() if roles[k][0] not in ("setup", "referee")}
    slow = max(rest, key=rest.get, default=None)
    run = time.monotonic() - t_run
    phases = {"prepare": t_run - t0, "kernel": max(0.0, run - sum(seconds.values())),
              "setup": setup, "cells": sum(rest.values()),
              "slowest_cell": roles[slow][1] if slow is not None else "",
              "slowest_cell_seconds": rest.get(slow, 0.0) if slow is not None else 0.0,
              "timed_out": [roles[k][1] for k, c in enumerate(nb.cells) if k in roles
                            and any(o.get("ename") in ("CellTimeoutError", "KernelUnresponsive")
                                    for o in c.get("outputs", []))]}
    try:
        path.write_text(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                    for k, v in phases.items()}))
    except OSError:  # a measurement only
        pass


def _add_cpu(path: Path, before: dict[str, float], after: dict[str, float]) -> None:
    """The slot's CPU counters over one submission into its phases.json (:func:`_slot_cpu`):
    a submission that only waits uses little CPU; one that its share throttles, much."""
    _add_phases(path, {k: round(max(0.0, after[k] - before[k]), 2)
                       for k in ("cpu", "throttled") if k in before and k in after})


def _add_phases(path: Path, more: dict[str, Any]) -> None:
    """``more`` into a submission's phases.json (a measurement only: no kernel, no phases)."""
    try:
        phases = json.loads(path.read_text())
        phases.update(more)
        path.write_text(json.dumps(phases))
    except (OSError, ValueError):
        pass


def run_client(client: Any, log: Path, *, env: dict[str, str] | None, cwd: str | None) -> Any:
    """Run the kernel's notebook. Its stdout and stderr (and every process's it starts) are a
    pipe that the grader drains, never a file: what reaches ``log`` is at most
    :data:`KERNEL_LOG_BYTES` (the start), then a line that counts the rest. A file descriptor
    of the grading machine's disk in the kernel's hands would be a write channel that no
    output limit sees (up to RLIMIT_FSIZE, then copied into --out)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    stop = threading.Event()
    counted = [0]

    def drain() -> None:
        with open(log, "wb") as out:
            while True:
                ready, _, _ = select.select([r], [], [], 0.2)
                try:
                    chunk = os.read(r, 1 << 16) if ready else b""
                except BlockingIOError:
                    chunk = b""
                if ready and not chunk:
                    break  # every writer is gone
                if not chunk and stop.is_set():
                    break
                keep = max(0, KERNEL_LOG_BYTES - counted[0])
                out.write(chunk[:keep])
                counted[0] += len(chunk)
            if counted[0] > KERNEL_LOG_BYTES:
                out.write(f"\n[grader] {counted[0] - KERNEL_LOG_BYTES} more bytes the kernel "
                          "wrote to its stdout/stderr were not kept\n".encode())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        return asyncio.run(client.run(stdout=w, stderr=w, env=env, cwd=cwd))
    finally:
        os.close(w)
        stop.set()  # a straggler still holding the pipe does not keep the reader
        reader.join(timeout=10)
        os.close(r)


def _compile_cache(job: Job, cfg: dict[str, Any], iso: sandbox.Isolation, uid: int | None,
                   root: Path) -> tuple[tuple[str, bool] | None, dict[str, str]]:
    """The grading compilation cache of this kernel (:mod:`autograder.compile_cache`): for a
    sandboxed kernel the folder and whether it may write (only the reference's fill); for an
    unsandboxed one, which has the grader's rights, the variables pointing at the fill folder
    or at a private copy made from the digests the grader checked (none if they differ)."""
    from .compile_cache import cache_env, private_copy

    if not job.cache:
        return None, {}
    if job.fill and iso.mode == "bwrap-root" and uid:
        os.chown(job.cache, uid, uid)  # the reference's kernel runs as the slot's uid
    if iso.sandboxed:
        return (job.cache, job.fill), {}
    if job.fill:
        return None, cache_env(job.cache, fill=True)
    copy = root / "scratch" / "jax-cache"
    try:
        digests = json.loads(Path(cfg["cache_digests"]).read_text())[job.cache]
    except (KeyError, OSError, ValueError):
        digests = None
    if digests is None or not private_copy(job.cache, digests, copy):
        (root / "grader.log").write_text(f"the compilation cache {job.cache} no longer matches "
                                         "its digests: graded without it\n")
        return None, {}
    return None, cache_env(str(copy), fill=False)


def _compilable(source: str) -> str:
    """A student's cell that Python cannot even compile for a reason other than its syntax
    (nested too deep: a 3000-term string concatenation) breaks ipykernel's own handler, which
    compiles it before running it, and the kernel never answers again; it is sent as a
    ``raise`` of that error instead, so the cell fails and the rest is graded."""
    try:
        compile(source, "<student cell>", "exec", dont_inherit=True)
    except SyntaxError:
        pass  # IPython's own syntax (%magic, !shell) or a real mistake: the kernel says which
    except (RecursionError, MemoryError, ValueError) as e:
        why = f"this cell cannot be compiled ({type(e).__name__}: {e}); nothing in it ran"
        return f"raise {type(e).__name__}({why!r})"
    return source


def _text_only(value: Any) -> Any:
    """An output with every string made encodable (a kernel can print a lone surrogate)."""
    if isinstance(value, str):
        return text_only(value)
    if isinstance(value, dict):
        return {text_only(str(k)): _text_only(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text_only(v) for v in value]
    return value


def _finish(root: Path, result: dict[str, Any], lab: Lab, asm: Assembled | None,
            executed: list[list[Any]] | None, t0: float) -> None:
    """Write the feedback page, the instructor's copy and the result."""
    from . import feedback

    points = lab.grade_cells
    group_of = {gid: task_of(gid) for gid in points}
    result["groups"] = task_totals(result["scores"])
    result["total"] = sum(result["scores"].values())
    result["max_score"] = lab.max_score
    cells: list[dict[str, Any]] = []
    secrets: set[str] = set()
    if asm is not None and executed is not None:
        secrets = hidden_lines_of(asm)
        for c, outs in zip(asm.cells, executed, strict=True):
            if c.role == "referee":
                continue
            cells.append({"kind": c.kind, "role": c.role, "grade_id": c.grade_id,
                          "show": c.show, "outputs": strip_receipts([dict(o) for o in outs])})
        _write_graded(root / "graded.ipynb", asm, executed)
    page = feedback.feedback_html({**result, "points": points, "group_of": group_of},
                                  cells, lab.groups, secrets)
    (root / "feedback.html").write_text(page, encoding="utf-8")
    (root / "result.json").write_text(json.dumps(result, indent=1))
    (root / "timing.json").write_text(json.dumps({"seconds": time.monotonic() - t0}))


def _write_graded(path: Path, asm: Assembled, executed: list[list[Any]]) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    cells = []
    for c, outs in zip(asm.cells, executed, strict=True):
        if c.role == "referee":
            continue
        if c.kind == "markdown":
            cells.append(new_markdown_cell(c.show))
            continue
        cell = new_code_cell(c.full or c.run, metadata={"minickpt": {"role": c.role,
                                                                      "grade_id": c.grade_id}})
        cell.outputs = [nbformat.from_dict(o) for o in strip_receipts([dict(o) for o in outs])]
        cells.append(cell)
    nb = new_notebook(cells=cells)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # hidden tests inside
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(nbformat.writes(nb))


# ---------------------------------------------------------------------------------------
# the worker process
# ---------------------------------------------------------------------------------------
def keep_jax_on_cpu() -> None:
    """This process's own JAX (grader checks, the reference runs of the grader's drills) runs
    on the CPU: an accelerator belongs to the kernels, and on a TPU only one process may hold
    it. Set in JAX's config, not the environment, which the kernels inherit JAX_* from."""
    import jax

    jax.config.update("jax_platforms", "cpu")


def worker_main(cfg_json: str) -> int:
    """Grade jobs read from stdin (one JSON per line); answer ``done <id>`` on the original
    stdout, which nothing else writes to (stdout is redirected to the log)."""
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_DATA, (WORKER_MEMORY, WORKER_MEMORY))
    except (ValueError, OSError):  # pragma: no cover - a lower hard limit already
        pass
    try:  # in its slot's cgroup with the kernel: under memory pressure the kernel goes first
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-500")
    except OSError:
        pass
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    cfg = json.loads(cfg_json)
    labs: dict[str, Lab] = {}
    from . import notebook  # noqa: F401  (loads nbformat & co before the first job)

    judge.ensure_devices()  # the judge runs the labs' tests here, on JAX's CPU devices
    keep_jax_on_cpu()

    sandbox.become_subreaper()  # what a submission double-forks away still comes back here
    for line in sys.stdin:
        if not line.strip():
            continue
        job = job_from(json.loads(line))
        slot_cgroup = cgroups.from_list(cfg.get("cgroup"))
        cpu = _slot_cpu(slot_cgroup)
        grade_one(job, cfg, labs)
        sandbox.kill_descendants()  # sandboxed or not: nothing it started outlives its grading
        if slot_cgroup is not None:
            slot_cgroup.kill(spare={os.getpid()})
        _add_cpu(Path(job.dir) / "phases.json", cpu, _slot_cpu(slot_cgroup))
        proto.write(f"done {job.id}\n")
    return 0


# ---------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------
_SLOTS: list[Slot] = []
_SLOTS_LOCK = threading.Lock()


class Slot:
    """One parallel slot: a worker process and the sandbox uid it grades under."""

    def __init__(self, k: int, uid: int | None, cfg: dict[str, Any], logs: Path,
                 cgroup: cgroups.SlotCgroup | None = None) -> None:
        _SLOTS.append(self)
        self.k, self.uid, self.cgroup, self.closed = k, uid, cgroup, False
        self.ipc = Path(tempfile.mkdtemp(prefix=f"minickpt-grade-{k}-"))
        self.cfg = {**cfg, "uid": uid, "ipc": str(self.ipc / "ipc"),
                    "cgroup": cgroup.as_list() if cgroup else None}
        self.log_path = logs / f"worker-{k}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = b""

    def start(self) -> None:
        log = open(self.log_path, "ab")
        with _SLOTS_LOCK:  # never half-started while another slot cleans up
            if not self.closed:  # (nor started again by its thread once the run is over)
                self._start(log)
        log.close()
        self._buf = b""

    def _start(self, log: Any) -> None:
        argv = [sys.executable, "-m", "autograder.grade", "--worker", json.dumps(self.cfg)]
        self.proc = subprocess.Popen(  # inside the slot's cgroup: its limits bound it too
            self.cgroup.join_command(argv) if self.cgroup is not None else argv,
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.proc = None
            # what the dead worker's submission left is handed to us (a subreaper): kill all
            # but the other slots' workers and what is theirs
            with _SLOTS_LOCK:
                sandbox.kill_descendants(spare={s.proc.pid for s in _SLOTS
                                                if s is not self and s.proc is not None})
        if self.uid:
            sandbox.kill_uid(self.uid)
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> None:
        with _SLOTS_LOCK:
            self.closed = True
        self.stop()
        shutil.rmtree(self.ipc, ignore_errors=True)
        if self in _SLOTS:
            _SLOTS.remove(self)

    def grade(self, job: Job, wall: float) -> str:
        """Send one job; ``"done"``, ``"timeout"`` or ``"died"``."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        if self.proc is None:  # the run is over
            return "died"
        assert self.proc.stdin is not None and self.proc.stdout
        try:
            self.proc.stdin.write((json.dumps(job.__dict__) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            return "died"
        deadline = time.monotonic() + wall
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.stop()
                    return "died"
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return "done" if line.strip() == f"done {job.id}".encode() else "died"


def run_pool(jobs: list[Job], cfg: dict[str, Any], n: int, logs: Path,
             on_result: Callable[[Job, dict[str, Any], float], None]) -> None:
    """Grade ``jobs`` with ``n`` workers; ``on_result`` is called (in the main thread) with
    each job's result as it comes."""
    iso = sandbox.Isolation(**cfg["iso"])
    uids_cm = sandbox.SlotUids(n, base=int(cfg.get("uid_base", sandbox.UID_BASE))) \
        if iso.mode == "bwrap-root" else None
    uids = uids_cm.__enter__().uids if uids_cm else [None] * n
    todo: queue.Queue[Job | None] = queue.Queue()
    done: queue.Queue[tuple[Job, dict[str, Any], float]] = queue.Queue()
    for j in jobs:
        todo.put(j)
    limits = sandbox.Limits(**cfg["limits"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    slot_cgroups, _ = cgroups.make_slot_cgroups(  # the probe said already when there are none
        n, cpus=limits.cpus or max(0.05, (cores or 1) / n), memory=limits.slot_memory_bytes,
        processes=limits.slot_processes)
    slots = [Slot(k, uids[k], cfg, logs, slot_cgroups[k] if slot_cgroups else None)
             for k in range(n)]
    wall = float(cfg["wall"]) + 120.0

    def serve(slot: Slot) -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.monotonic()
            outcome = slot.grade(job, wall)
            result = _read_result(job, outcome, wall)
            done.put((job, result, time.monotonic() - t0))

    sandbox.become_subreaper()  # a dead worker's orphans come here, and are killed
    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in slots]
    try:
        for t in threads:
            t.start()
        for _ in range(len(jobs)):
            job, result, seconds = done.get()
            on_result(job, result, seconds)
        for t in threads:
            t.join()
    finally:
        for s in slots:
            s.close()
        cgroups.remove_all(slot_cgroups)
        if uids_cm:
            uids_cm.__exit__()


def _read_result(job: Job, outcome: str, wall: float) -> dict[str, Any]:
    path = Path(job.dir) / "result.json"
    if outcome == "done" and path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass
    reason = {"timeout": f"grading took longer than {wall:.0f} s and was stopped",
              "died": "the grading process died (see logs/worker-*.log)"}.get(
        outcome, "the grading process gave no result")
    return {"student": job.student, "lab": job.lab, "status": "error", "reason": reason,
            "scores": {}, "messages": {}, "notes": [], "review": [], "isolation": "",
            "ran_all_cells": False}
