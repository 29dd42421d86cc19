"""Grading untrusted notebooks: the sandbox, the referee, the hostile corpus, -j and shards.

The expensive part is the graded corpus: every example submission (the hostile corpus
included) and each lab's source notebook (student ``_reference``), graded by grade.sh in
*groups* (:data:`GROUPS`): one grade.sh run per lab, and the examples that only wait out a
cell's time-out in a run of their own with a short cell limit. Each ``TestCorpus*`` class
grades its groups once (its ``corpus`` fixture) while a TCP listener waits on the port the
network attack aims at, then checks them; pytest-xdist hands each class to one worker, the
costliest first (tests/conftest.py), so both workers grade from the start. A small extra run
(``sliced``, lab 1's class) grades a few of lab 1's examples sequentially (-j 1), in two
shards, and merges them: its CSV must equal the corpus rows for those students.

Without a working sandbox (no bubblewrap, not root) the attack_* examples are skipped by
grade.sh and the tests here that need the sandbox skip too, unless MINICKPT_REQUIRE_SANDBOX=1
(set by scripts/test.sh, as CI runs it) makes that a failure.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autograder import ROOT, build, compile_cache, judge, sandbox
from autograder.grade import REFERENCE_STUDENT, LabInfo, shard_of, write_outputs
from autograder.lab_examples.common import _first, _gid
from autograder.lab_examples.lab01_basics import NETWORK_PORTS
from autograder.make_examples import EXAMPLES
from autograder.notebook import (
    assemble,
    decode_answer,
    grade_cells,
    load_lab,
    read_submission,
    reference_use,
    scan,
    split_hidden,
)
from autograder.referee import RECEIPT
from autograder.referee import _literal as referee_literal
from minickpt import labkit

SOLUTIONS, LABS, EXAMPLES_DIR = ROOT / "solutions", ROOT / "labs", ROOT / "autograder" / "examples"
LAB_NAMES = build.lab_names(SOLUTIONS)
GRADE_SH = ROOT / "autograder" / "grade.sh"
CI_TIMEOUT = 60  # seconds a cell may run in the corpus runs (the default); the multi-process
# cells of labs 3, 4 and 6 take 10-30 s while the other test worker runs too
WAIT_TIMEOUT = 20
"""The cell limit of the ``timeouts`` group: its examples' other cells take a few seconds, so
each waits out 20 s instead of 60 (the same grades, with this limit in the message)."""
WAITS_OUT = (("lab01_basics", "attack_ignore_interrupt"), ("lab01_basics", "never_finishes"))
"""The examples whose grading is mostly waiting out a cell's time-out: graded apart, with
:data:`WAIT_TIMEOUT`. An example that only waits for its time-out belongs here."""
CORPUS_JOBS = int(os.environ.get("MINICKPT_CORPUS_JOBS", "2"))
"""-j of each lab's run (two classes grade at once: four kernels on two cores, which keeps
the cores busy while kernels wait for their processes; MINICKPT_CORPUS_JOBS to measure)."""
SECONDS_PER_SUBMISSION = {"lab04_multihost": 62, "lab03_resume": 46, "lab02_save_policy": 28,
                          "lab06_production": 18, "lab01_basics": 16, "lab05_async": 10}
"""Slot seconds one submission of a lab takes (timings.csv of a corpus run, -j 2): the order
in which the classes start, costliest first. A lab not listed counts as the costliest."""
GRADING = pytest.mark.timeout(3600)  # a class's first test waits for its groups' runs
SLICE = {"blank": 1, "cheat_os_exit": 1, "partial": 2, "cheat_kernel_lie": 2,
         "never_finishes": 2, "cheat_kill_kernel": 2}
if sandbox.probe().mode == "bwrap-root":  # its children are killed by the slot's uid
    SLICE["attack_fork_bomb"] = 1
"""The examples graded again one at a time, in two shards (their shard by name) run side by
side: kernels that die, time out or fork, under other slots' uids than in the -j 2 run."""
ISOLATION = sandbox.probe()
REQUIRE = os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1"


def need_sandbox() -> None:
    if ISOLATION.mode == "bwrap-root":
        return
    why = f"needs the sandbox as root (have {ISOLATION.mode}: {ISOLATION.detail})"
    if REQUIRE:
        pytest.fail(why + "; MINICKPT_REQUIRE_SANDBOX=1: install bubblewrap "
                          "(scripts/install-sandbox.sh) and run as root")
    pytest.skip(why)


def test_probes_run_side_by_side_all_find_the_sandbox():
    """Shards of a job array start on one machine at once: each grade.sh probes the sandbox,
    and one probe's clean-up must never kill another's (which then graded unsandboxed)."""
    need_sandbox()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        modes = list(pool.map(lambda _: sandbox.probe().mode, range(8)))
    assert modes == ["bwrap-root"] * 8


def _env() -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # the notebooks choose their devices themselves
    return env


def _grade(*args: str, timeout: int = 3000) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(GRADE_SH), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _notebooks(folder: Path) -> dict[str, str]:
    return {k: v for k, v in _tree(folder).items() if k.endswith(".ipynb")}


class Listener:
    """A localhost TCP server on one of the ports attack_network tries; it records whoever
    connects (nobody must)."""

    def __init__(self) -> None:
        self.connections: list[bytes] = []
        for port in NETWORK_PORTS:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen(8)
            s.settimeout(0.2)
            self.sock, self.port = s, port
            break
        else:  # pragma: no cover - every port taken
            raise RuntimeError(f"no free port in {NETWORK_PORTS}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.connections.append(conn.recv(1024) or b"<connected>")
                except OSError:
                    self.connections.append(b"<connected>")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


# ---------------------------------------------------------------------------------------
# the corpus: groups, each one grade.sh run
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """One grade.sh run of the corpus: its examples (lab, student), the cell limit, -j, and
    whether it grades the labs' source notebooks (``--include-solutions``: the fill of the
    lab's compilation cache is that grading, so each source runs once). A group without
    sources grades without the cache: it never fills one that a lab's group would fill again."""

    name: str
    examples: tuple[tuple[str, str], ...]
    timeout: int = CI_TIMEOUT
    jobs: int = CORPUS_JOBS
    sources: bool = True

    @property
    def labs(self) -> list[str]:
        return sorted({lab for lab, _ in self.examples})

    def cost(self) -> float:
        """Seconds of wall time it is expected to take (how the classes are ordered)."""
        if self.timeout < CI_TIMEOUT:
            return len(self.examples) * (self.timeout + 20) / self.jobs
        most = max(SECONDS_PER_SUBMISSION.values())
        return sum(SECONDS_PER_SUBMISSION.get(lab, most) for lab, _ in self.examples) / self.jobs


def corpus_groups() -> dict[str, Group]:
    """A group per lab (its examples but those of :data:`WAITS_OUT`, and its source), and
    ``timeouts`` (those, with :data:`WAIT_TIMEOUT`). A new example goes to its lab's group by
    itself; a new lab brings its group (and its class below)."""
    groups = {lab: Group(lab, tuple((lab, s) for s in sorted(EXAMPLES[lab])
                                    if (lab, s) not in WAITS_OUT)) for lab in LAB_NAMES}
    groups["timeouts"] = Group("timeouts", WAITS_OUT, timeout=WAIT_TIMEOUT, jobs=1,
                               sources=False)
    return groups


GROUPS = corpus_groups()


def _start(group: Group, tmp: Path) -> dict:
    """Copy the group's examples (and a lab's untouched release where no example is one) and
    start its grade.sh."""
    subs = tmp / "subs"
    for lab, student in group.examples:
        shutil.copytree(EXAMPLES_DIR / student / lab, subs / student / lab)
    for lab in group.labs if group.sources else ():
        release = (LABS / lab / f"{lab}.ipynb").read_bytes()
        if not any(p.read_bytes() == release for p in subs.glob(f"*/{lab}/{lab}.ipynb")):
            (subs / "released" / lab).mkdir(parents=True)
            (subs / "released" / lab / f"{lab}.ipynb").write_bytes(release)
    args = [str(subs), "-j", str(group.jobs), "--timeout", str(group.timeout), "--out",
            str(tmp / "out"), "--work", str(tmp / "work"), "--durations", "10",
            *(["--include-solutions"] if group.sources else ["--compile-cache", "off"]),
            *[a for lab in group.labs for a in ("--lab", lab)]]
    return {"group": group, "tmp": tmp, "subs": subs, "before": _tree(subs),
            "t0": time.monotonic(),
            "popen": subprocess.Popen(["bash", str(GRADE_SH), *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=_env())}


def _wait(run: dict) -> dict:
    p = run.pop("popen")
    try:
        out, err = p.communicate(timeout=3000)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    run["proc"] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    took = re.search(r"^graded \d+ submission\(s\) in (\d+) s", out, re.M)  # its own wall
    run["seconds"] = float(took[1]) if took else time.monotonic() - run["t0"]  # (side by side)
    run["out"], run["work"] = run["tmp"] / "out", run["tmp"] / "work"
    path = run["out"] / "results.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    run["results"] = {(r["lab"], r["student"]): r for r in rows}
    _publish(run)
    return run


def _publish(run: dict) -> None:
    """The run's timings.csv and seconds where the terminal summary finds them (the ten
    slowest submissions of the whole corpus, tests/conftest.py)."""
    folder = os.environ.get("MINICKPT_CORPUS_TIMINGS")
    if not folder or not (run["out"] / "timings.csv").exists():
        return
    name = run["group"].name
    shutil.copyfile(run["out"] / "timings.csv", Path(folder) / f"{name}.csv")
    (Path(folder) / f"{name}.json").write_text(json.dumps(
        {"group": name, "seconds": round(run["seconds"], 1), "jobs": run["group"].jobs,
         "timeout": run["group"].timeout, "submissions": len(run["results"])}))


@pytest.fixture(scope="class")
def corpus(request, tmp_path_factory):
    """The class's groups, graded side by side: ``runs`` (name -> run), ``results`` and
    ``run_of`` ((lab, student) -> its result, its run), and the listener they all faced."""
    listener = Listener()
    try:
        started = [_start(GROUPS[name], tmp_path_factory.mktemp(f"corpus-{name}"))
                   for name in request.cls.GROUPS]
        runs = {run["group"].name: _wait(run) for run in started}
    finally:
        listener.close()
    return {"runs": runs, "listener": listener,
            "results": {k: r for run in runs.values() for k, r in run["results"].items()},
            "run_of": {k: run for run in runs.values() for k in run["results"]}}


@pytest.fixture(scope="class")
def sliced(corpus, tmp_path_factory):
    """A few of lab 1's examples again: shard 1/2 then shard 2/2, each with -j 1, then merged."""
    tmp = tmp_path_factory.mktemp("sliced")
    subs = tmp / "subs"
    for student in SLICE:
        shutil.copytree(EXAMPLES_DIR / student / "lab01_basics",  # lab 1's: the slice's kinds
                        subs / student / "lab01_basics")
    running = [subprocess.Popen(  # side by side: each run locks its own uid; shard 1 without
        ["bash", str(GRADE_SH), str(subs), "--shard", f"{i}/2", "-j", "1", "--timeout",  # the
         str(WAIT_TIMEOUT), "--out", str(tmp / f"out{i}"), "--work", str(tmp / f"work{i}"),
         *(["--compile-cache", "off"] if i == 1 else [])],  # cache
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for i in (1, 2)]
    procs = []
    for p in running:
        out, err = p.communicate(timeout=1200)
        procs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    procs.append(_grade("merge", str(tmp / "out1"), str(tmp / "out2"), "--out",
                        str(tmp / "merged"), timeout=300))
    return {"procs": procs, "tmp": tmp}


def _result(corpus, student, lab="lab01_basics"):
    return corpus["results"][lab, student]


def _feedback(corpus, student, lab="lab01_basics") -> str:
    return (corpus["run_of"][lab, student]["out"] / "feedback" / student / f"{lab}.html").read_text()


def _graded_outputs(corpus, student, lab="lab01_basics") -> str:
    """All text the student's kernel printed (the instructor's copy of the notebook)."""
    work = corpus["run_of"][lab, student]["work"]
    nb = json.loads((work / "subs" / lab / student / "graded.ipynb").read_text())
    texts = []
    for c in nb["cells"]:
        for o in c.get("outputs", []):
            t = o.get("text", "")
            texts.append("".join(t) if isinstance(t, list) else t)
            if o.get("output_type") == "error":
                texts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(texts)


def _expected() -> dict[tuple[str, str], dict[str, str]]:
    """expected-<lab>.csv, written by hand: per task, total, status, and optionally ``review``."""
    rows = {}
    for path in sorted(EXAMPLES_DIR.glob("expected-*.csv")):  # one file per lab
        with open(path) as f:
            for e in csv.DictReader(f):
                assert e["lab"] == path.stem.removeprefix("expected-"), path
                rows[e["lab"], e["student"]] = e
    return rows


def test_the_groups_grade_every_example_and_every_source_once():
    """What the classes grade: every example of every lab in exactly one group, each with an
    expected row, each lab's source in one group, and every group in one class."""
    pairs = [p for g in GROUPS.values() for p in g.examples]
    assert sorted(pairs) == sorted({(lab, s) for lab, exs in EXAMPLES.items() for s in exs})
    assert set(_expected()) == set(pairs)
    assert sorted(lab for g in GROUPS.values() if g.sources for lab in g.labs) == sorted(LAB_NAMES)
    classed = [name for cls in CORPUS_CLASSES for name in cls.GROUPS]
    assert sorted(classed) == sorted(GROUPS)


# ---------------------------------------------------------------------------------------
# the corpus grades as expected: the checks of every class, on its groups
# ---------------------------------------------------------------------------------------
class _Corpus:
    """The checks every group passes; each ``TestCorpus*`` class below names its groups."""

    GROUPS: tuple[str, ...] = ()

    @classmethod
    def examples(cls) -> list[tuple[str, str]]:
        return [p for name in cls.GROUPS for p in GROUPS[name].examples]

    @classmethod
    def sourced_labs(cls) -> list[str]:
        return [lab for name in cls.GROUPS if GROUPS[name].sources for lab in GROUPS[name].labs]

    @GRADING
    def test_grading_itself_succeeds(self, corpus):
        for run in corpus["runs"].values():
            proc = run["proc"]
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert "kernels: " in proc.stdout

    @GRADING
    def test_every_example_grades_as_expected(self, corpus):
        """For the hostile examples: the hostile part gains nothing, the honest parts keep
        their points. The printed table shows each row."""
        expected = _expected()
        graded_attacks = ISOLATION.sandboxed
        for lab, student in self.examples():
            e = expected[lab, student]
            if student.startswith("attack_") and not graded_attacks:
                continue
            r = _result(corpus, student, lab)
            got = {g: f"{v:g}" for g, v in r["groups"].items()}
            want = {k: v for k, v in e.items()
                    if k not in ("lab", "student", "total", "status", "review")}
            # "2|4": either (a row that races: on the graded build a test runs the student's
            # other tasks, and a wrong one of those can race, as commit_before_barrier's commit)
            same = set(got) == set(want) and all(got[k] in want[k].split("|") for k in want) \
                and f"{r['total']:g}" in e["total"].split("|") and r["status"] == e["status"]
            assert same, (got, f"{r['total']:g}", r["status"], want, e["total"], e["status"],
                          f"{student}: {r['messages']} {r['reason']}")
            for flag in filter(None, (e.get("review") or "").split(";")):  # optional column:
                assert any(flag in f for f in r["review"]), (student, flag, r["review"])
            row = r"\s+".join([student, *(f"(?:{v})" for v in want.values()),
                               f"(?:{e['total']})", e["status"]])
            assert re.search(rf"^{row}\b", corpus["run_of"][lab, student]["proc"].stdout, re.M), \
                f"the printed table lacks the row of {student}"
        if not graded_attacks:
            need_sandbox()  # the attack_* rows were skipped: say so (or fail in CI)

    @GRADING
    def test_every_solution_notebook_scores_full_marks(self, corpus):
        for lab in self.sourced_labs():
            r = _result(corpus, REFERENCE_STUDENT, lab)
            assert r["status"] == "graded" and r["total"] == r["max_score"] > 0, r["messages"]
            assert not r["messages"] and not r["review"] and r["ran_all_cells"]

    @GRADING
    def test_every_released_lab_scores_zero_and_runs_to_the_end(self, corpus):
        for lab in self.sourced_labs():
            release = (LABS / lab / f"{lab}.ipynb").read_bytes()
            students = [p.parent.parent.name for p in EXAMPLES_DIR.glob(f"*/{lab}/{lab}.ipynb")
                        if p.read_bytes() == release] or ["released"]
            r = _result(corpus, students[0], lab)
            assert r["status"] == "graded" and r["ran_all_cells"], r
            assert r["total"] == 0 and all(v == 0 for v in r["groups"].values()), r["groups"]
            for gid, err in r["messages"].items():
                m = re.match(r"test_(\d+)_(\d+)_", gid)
                if m:  # an unfinished task fails with its own ID, or names the other task
                    # of the student's that minickpt ran first (the graded build calls theirs)
                    assert f"Task {m.group(1)}.{m.group(2)}" in err or \
                        re.search(r"this test runs your Task \d+\.\d+ \w+", err), (gid, err)

    @GRADING
    def test_the_kernels_were_sandboxed_and_changed_nothing(self, corpus):
        need_sandbox()
        assert corpus["listener"].connections == [], "a submission reached a localhost server"
        for run in corpus["runs"].values():
            assert _tree(run["subs"]) == run["before"], "a submission was changed"
        for r in corpus["results"].values():
            assert r["isolation"] == "sandbox"

    @GRADING
    def test_feedback_shows_messages_but_never_hidden_tests_or_receipts(self, corpus):
        hidden: dict[str, set[str]] = {}
        for lab in {lab for lab, _ in corpus["results"]}:  # hidden test lines no visible
            cells = load_lab(SOLUTIONS / lab / f"{lab}.ipynb").cells  # part of the lab shows
            shown = {s.strip() for c in cells for s in split_hidden(c.source)[0].split("\n")}
            hidden[lab] = set()
            for c in cells:
                hidden[lab] |= {s.strip() for s in split_hidden(c.source)[1].split("\n")
                                if len(s.strip()) >= 20 and not s.strip().startswith("#")} - shown
        assert all(hidden.values())
        for run in corpus["runs"].values():
            out = run["out"]
            with open(out / "grades.csv") as f:
                overall = {row["student"]: row for row in csv.DictReader(f)}
            for (lab, student), r in run["results"].items():
                assert float(overall[student][lab]) == r["total"]
                page = html.unescape((out / r["feedback"]).read_text())
                if judge.judges(lab):  # no referee where the tests run: the name is shown
                    # only in the student's own code's error, looking it up (cheat_forge_receipt)
                    page = re.sub(r"KeyError: '?__referee__'?", "", page)
                assert "__referee__" not in page  # only cheat_fake_output's own code forges:
                assert set(re.findall(re.escape(RECEIPT) + r" \S+ ([0-9a-f]{64})", page)) \
                    <= {"0" * 64}
                leaked = [s for s in hidden[lab] if s in page]
                assert not leaked, f"{student}: hidden test lines in the feedback: {leaked[:3]}"
            for lab in run["group"].labs:
                with open(out / f"grades-{lab}.csv") as f:
                    assert "seconds" not in next(csv.reader(f))  # nothing that varies
            assert (out / "summary.txt").read_text().strip() in run["proc"].stdout

    @GRADING
    def test_the_compilation_cache_holds_what_the_references_wrote_and_no_submission_changed_it(
            self, corpus):
        """Every lab's cache was filled by grading its source notebook (here or in an earlier
        run: the manifest names the source's digest) and still matches the digests recorded
        at the fill after every example, the hostile ones included, ran with it mounted
        read-only. Each source is graded once: the fill is its grading."""
        for run in corpus["runs"].values():
            proc, group = run["proc"], run["group"]
            caches = json.loads((run["out"] / "run.json").read_text())["compile_cache"]
            assert set(caches) == set(group.labs)
            if not group.sources:
                assert {c["state"] for c in caches.values()} == {"off"}
                continue
            for lab, c in caches.items():
                assert c["state"] in ("filled", "reused"), (lab, c)
                # a judged lab's kernel runs no test: it may compile nothing worth caching
                assert c["entries"] > 0 or judge.judges(lab), (lab, c)
                folder = Path(c["folder"])
                entries = compile_cache.check(folder)  # ours, not writable by others, unchanged
                assert len(entries) == c["entries"] or c["state"] == "reused"
                manifest = json.loads((folder / compile_cache.MANIFEST).read_text())
                source = SOLUTIONS / lab / f"{lab}.ipynb"
                assert manifest["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
                assert Path(manifest["filled_from"]).name == source.name or \
                    manifest["lab"] != lab  # (a lab with the same files shares the folder)
                if c["state"] == "filled":  # the fill was the reference's grading: once
                    assert c["fill_seconds"] > 0 and lab in proc.stdout.split("filling it for")[1]
            graded = re.findall(r"^\s*\[\s*\d+/\d+\] " + re.escape(REFERENCE_STUDENT)
                                + r"/(\w+): ", proc.stdout, re.M)
            assert sorted(graded) == group.labs  # each source graded once, fill or not

    @GRADING
    def test_the_classes_of_issue_20_gain_nothing_and_are_flagged(self, corpus):
        """The corpus's examples of each class of issue 20 in the labs here: the standard
        library patched (nothing earned beyond what is right, flagged), the kernel's history
        carried out (no hidden line of the lab in what it printed, however encoded; the audit
        hook refused), spinners beside the others (bounded by their slot: every other row of
        their run is as expected), and odd source (a grade with reasons). Lab 1 has one
        example of each on ``perfect`` (right answers keep their points); labs 2-6 one
        ``attack_issue_20`` each, all four classes on the lab with only its first task
        right (a grading costs the whole lab: one per lab keeps CI's corpus short)."""
        labs = self.sourced_labs()
        for lab in labs:
            for kind in ISSUE_20_CLASSES:
                student = _issue_20_example(lab, kind)
                assert student in EXAMPLES[lab], (lab, kind)
                if ISOLATION.sandboxed or not student.startswith("attack_"):
                    assert (lab, student) in corpus["results"], (lab, student)
            check_issue_20(corpus, [lab], slots=GROUPS[lab].jobs)
        if not ISOLATION.sandboxed:
            need_sandbox()  # the attack_* examples were skipped: say so (or fail in CI)


class TestCorpusLab01(_Corpus):
    """Lab 1: its examples (the hostile corpus) and, beside them, the examples that only wait
    out a time-out; then the sliced run, compared with both."""

    GROUPS = ("lab01_basics", "timeouts")

    @GRADING
    def test_a_process_that_dies_costs_the_tests_it_was_running_and_says_why(self, corpus):
        """cheat_os_exit's decode_leaf (1.3) exits its process; cheat_kill_kernel's
        restore_checkpoint (1.4) SIGKILLs it. Judged (issue 47): the process is the student's
        worker, not the grading: each test that called it fails saying the worker has gone, the
        next test gets a new worker, and the tests after it still run and score (cheat_os_exit's
        1.2 host test, the quiz). Graded by the kernel (``MINICKPT_JUDGE=off``): the kernel dies
        in the first test that runs it (on the graded build 1.1's, which saves through
        minickpt), keeps the points before it and says why; the rest is not run."""
        cases = (("cheat_os_exit", "test_1_1_minickpt"), ("cheat_kill_kernel", "test_1_4_resume"))
        for student, cell in cases:
            r = _result(corpus, student)
            later = [g for g in r["scores"]
                     if list(r["scores"]).index(g) > list(r["scores"]).index(cell)]
            assert later
            if not judge.judges("lab01_basics"):
                assert r["status"] == "graded" and not r["ran_all_cells"]
                assert "kernel died" in r["reason"] and cell in r["reason"], r["reason"]
                assert "KernelDied" in r["messages"][cell]
                assert all(r["scores"][g] == 0 and "not run" in r["messages"][g] for g in later)
                assert "kernel died" in _feedback(corpus, student)
                continue
            assert r["status"] == "graded" and r["ran_all_cells"] and not r["reason"], r
            assert r["scores"][cell] == 0 and "the worker has gone" in r["messages"][cell], \
                r["messages"]
            assert r["groups"]["quiz"] == 11 and any(r["scores"][g] > 0 for g in later), r
            assert "the worker has gone" in html.unescape(_feedback(corpus, student))
        dead = _result(corpus, "cheat_os_exit")  # every test that calls decode_leaf: 1.3, 1.4
        assert dead["scores"]["test_1_2_host"] > 0 and dead["groups"]["1.3"] == 0 and \
            dead["groups"]["1.4"] == 0, dead["groups"]
        assert any("ended its worker process; the next test got a new one" in n
                   for n in dead["notes"]), dead["notes"]

    @GRADING
    def test_cells_that_do_not_stop_are_stopped(self, corpus):
        """never_finishes's restore_checkpoint loops; attack_ignore_interrupt's also ignores
        SIGINT. Judged (issue 47): the call into the worker that does not answer fails its
        test at the judge's call time-out, and the rest is graded (a handler set in a call
        fails: the worker calls from a thread). Graded by the kernel (``MINICKPT_JUDGE=off``):
        the cell is interrupted at the time-out and the rest runs; a kernel that ignores the
        interrupt is stopped, and the rest is 0."""
        r = _result(corpus, "never_finishes")
        if judge.judges("lab01_basics"):
            assert r["ran_all_cells"] and not r["reason"] and list(r["messages"]) == \
                ["test_1_4_resume"], r["messages"]
            assert r["messages"]["test_1_4_resume"].startswith("RemoteTimeout: this test runs "
                                                               "your Task 1.4 restore_checkpoint")
            assert "did not answer within" in r["messages"]["test_1_4_resume"]
            if ISOLATION.sandboxed:
                r = _result(corpus, "attack_ignore_interrupt")
                assert r["ran_all_cells"] and not r["reason"] and r["groups"]["1.4"] == 0 \
                    and r["total"] == 23, r
            return
        assert r["ran_all_cells"] and r["messages"] == {
            "test_1_4_resume": f"CellTimeoutError: the cell ran longer than {WAIT_TIMEOUT} s "
                               "and was interrupted"}
        if ISOLATION.sandboxed:  # ignores the interrupt: the kernel is stopped, the rest is 0
            r = _result(corpus, "attack_ignore_interrupt")
            assert "did not stop when interrupted" in r["reason"] and not r["ran_all_cells"]
            assert r["messages"]["test_1_4_resume"].startswith("KernelUnresponsive")

    @GRADING
    def test_attacks_on_the_machine_are_contained(self, corpus):
        need_sandbox()
        assert "reached nothing" in _graded_outputs(corpus, "attack_network")
        assert "answers found: none" in _graded_outputs(corpus, "attack_read_solutions")
        assert "marked 0 folder(s); could write 0 notebook(s)" in \
            _graded_outputs(corpus, "attack_write_others")
        tmps = [run["tmp"] for run in corpus["runs"].values()]
        pwned = [p for base in (*tmps, ROOT) for p in base.rglob("PWNED*")]
        assert not pwned, pwned
        assert _notebooks(EXAMPLES_DIR) == _BEFORE_ROOT
        forked = int(re.search(r"forked (\d+) children",
                               _graded_outputs(corpus, "attack_fork_bomb"))[1])
        assert 0 < forked < sandbox.Limits().processes
        hog = _graded_outputs(corpus, "attack_memory_hog")
        assert int(re.search(r"MemoryError after (\d+) MiB", hog)[1]) * 2**20 \
            < sandbox.Limits().memory_bytes
        flood = _graded_outputs(corpus, "attack_huge_output")
        assert "OutputLimitExceeded" in flood and len(flood) < 2 * 2**20
        assert len(_feedback(corpus, "attack_huge_output")) < 500_000

    @GRADING
    def test_the_feedback_teaches(self, corpus):
        page = _feedback(corpus, "partial")  # the teaching message is there
        assert "newest means the largest" in page and "13 / 26 points" in page
        out = corpus["runs"]["lab01_basics"]["out"]
        with open(out / "grades-lab01_basics.csv") as f:
            rows = {row["student"]: row for row in csv.DictReader(f)}
        assert rows["partial"]["test_1_4_resume"] == "0"
        assert rows["perfect"]["test_1_4_resume"] == "3"

    @GRADING
    def test_forged_receipts_and_peeking_earn_nothing_and_tampering_is_flagged(self, corpus):
        r = _result(corpus, "cheat_fake_output")
        assert r["scores"]["test_1_2_host"] == 0  # its to_host printed a receipt-like line
        lie = _result(corpus, "cheat_kernel_lie")
        judged = judge.judges("lab01_basics")  # the tests ran outside its kernel: their own
        assert lie["messages"]["test_1_2_host"].startswith("LabCheckError: to_host(") if judged \
            else "no sign from the referee" in lie["messages"]["test_1_2_host"]  # failure
        assert any("get_ipython" in f for f in lie["review"])
        assert any("builtins.type" in f for f in _result(corpus, "cheat_patch_builtins")["review"])
        forged = _result(corpus, "cheat_forge_receipt")  # the audit's forgery: nothing to sign
        # (its 1.3 is the forgery: 1.1 and 1.2's tests that save through minickpt run it too)
        assert forged["groups"]["1.3"] == 0 and forged["total"] == 15, forged["messages"]
        # judged: its worker has no referee to reach, and its lookup fails the tests that call it
        assert all(forged["messages"][g].startswith("KeyError" if judged else "LabCheckError")
                   for g in ("test_1_3_leaf", "test_1_3_minickpt")), forged["messages"]
        assert {"sys.modules in task_1_3", "the text '__referee__' in task_1_3",
                "vars in task_1_3"} <= set(forged["review"])
        assert judged or "nested run: TamperedError" in \
            _graded_outputs(corpus, "cheat_forge_receipt")
        assert all(f.startswith("similar to ") for f in _result(corpus, "perfect")["review"])
        # (the similarity report flags it: it is minickpt's code)
        notes = " ".join(_result(corpus, "cheat_reordered")["notes"])
        assert "lab's order" in notes
        assert "test_1_9_bonus" not in _result(corpus, "cheat_metadata")["scores"]
        assert _result(corpus, "cheat_metadata")["max_score"] == 26

    @GRADING
    def test_class_summary_says_which_tasks_most_students_failed(self, corpus):
        run = corpus["runs"]["lab01_basics"]
        with open(run["out"] / "class-summary-lab01_basics.csv") as f:
            rows = list(csv.DictReader(f))
        by = {r["name"]: r for r in rows}
        info = load_lab(SOLUTIONS / "lab01_basics" / "lab01_basics.ipynb")
        assert set(by) == {*info.groups, *info.grade_cells}
        lab1 = [r for (lab, _), r in run["results"].items() if lab == "lab01_basics"]
        full_14 = sum(1 for r in lab1 if r["groups"]["1.4"] == 3)
        assert by["1.4"]["full_marks"] == str(full_14) and by["1.4"]["submissions"] == str(len(lab1))
        assert by["test_quiz_q3"]["title"].startswith("Q3.")
        assert "most common failure" in run["proc"].stdout
        assert "Class summary" in (run["out"] / "class-summary.html").read_text()

    @GRADING
    def test_one_at_a_time_in_two_shards_gives_the_same_grades_as_two_at_a_time(
            self, corpus, sliced):
        """What is compared: the merged --out of `--shard 1/2 -j 1` (without the compilation
        cache) and `--shard 2/2 -j 1` (with it) over a few examples, against the corpus runs
        (-j 2 and the cache; the time-out group -j 1 without it): grades-<lab>.csv must hold
        byte for byte the corpus runs' header and rows for those students; results.json the
        same entries; class-summary-<lab>.csv and grades.csv what the merged results make
        (write_outputs, the code every run ends in): those results equal the corpus runs',
        checked above, but for the detail of a message that a test's drawn inputs make (a
        summary counts two messages the same only if they are, so it is not compared with
        the corpus's: two of its students once got "11 of 117 leaves" and "10 of 117")."""
        for proc in sliced["procs"]:
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        merged, tmp = sliced["tmp"] / "merged", sliced["tmp"]
        cache = {i: json.loads((tmp / f"out{i}" / "run.json").read_text())["compile_cache"]
                 for i in (1, 2)}
        assert cache[1]["lab01_basics"]["state"] == "off"
        assert cache[2]["lab01_basics"]["state"] in ("reused", "filled")
        for i in (1, 2):
            graded = json.loads((tmp / f"out{i}" / "results.json").read_text())
            assert sorted(r["student"] for r in graded) == \
                sorted(s for s, k in SLICE.items() if k == i)
            assert all(shard_of(r["student"], 2) == i for r in graded)
        # Similarity to *other students* depends on who is in the class: the merge compares
        # the slice's among themselves, the corpus runs theirs. Everything else is the same.
        header, lines = None, {}
        for run in corpus["runs"].values():
            whole = (run["out"] / "grades-lab01_basics.csv").read_text().splitlines()
            assert header in (None, whole[0])
            header = whole[0]
            lines |= {line.split(",")[0]: line for line in whole[1:]}
        want = [header] + [lines[s] for s in sorted(SLICE)]
        got = (merged / "grades-lab01_basics.csv").read_text().splitlines()
        assert [_no_peer_flags(line) for line in got] == [_no_peer_flags(line) for line in want]
        corpus_rows = [r for run in corpus["runs"].values()
                       for r in json.loads((run["out"] / "results.json").read_text())]
        subset = sorted((r for r in corpus_rows if r["student"] in SLICE
                         and r["lab"] == "lab01_basics"), key=lambda r: r["student"])
        assert [_no_peer_results(r) for r in json.loads((merged / "results.json").read_text())] \
            == [_no_peer_results(r) for r in subset]
        again = tmp / "rewritten"
        labs = {name: LabInfo(name, d["cells"], d.get("fingerprint", ""), d.get("questions", {}))
                for name, d in json.loads((merged / "run.json").read_text())["labs"].items()}
        write_outputs(again, json.loads((merged / "results.json").read_text()), labs, {}, {})
        for name in ("class-summary-lab01_basics.csv", "grades.csv"):
            assert (merged / name).read_bytes() == (again / name).read_bytes(), name
        for student in SLICE:
            assert (merged / "feedback" / student / "lab01_basics.html").exists()


_BEFORE_ROOT = _notebooks(EXAMPLES_DIR)
"""The example notebooks as collection found them: no grading may change one."""
CORPUS_CLASSES = [TestCorpusLab01]
for _lab in LAB_NAMES:  # every other lab: its own class, the common checks on its group
    if _lab != "lab01_basics":
        _cls = type(f"TestCorpus_{_lab}", (_Corpus,), {"GROUPS": (_lab,), "__doc__":
                                                         f"{_lab}: its examples and source."})
        globals()[_cls.__name__] = _cls
        CORPUS_CLASSES.append(_cls)
for _cls in CORPUS_CLASSES:  # tests/conftest.py starts the costliest first (its groups
    _cls.CORPUS_COST = max(GROUPS[g].cost() for g in _cls.GROUPS) + \
        (150 if _cls is TestCorpusLab01 else 0)  # run side by side; lab 1's sliced run after)


_PEER_FLAG = re.compile(r"(?:; )?similar to (?:(?:(?!minickpt's own code)[^:])+'s submission: "
                        r"[^)]*\)|\d+ more submission\(s\) as well); see similarity report")


def _no_peer_flags(text: str) -> str:
    """A review flag, or a CSV line's every cell, without the flags naming another student."""
    cells = next(csv.reader([text]))
    return ",".join(_PEER_FLAG.sub("", c).removeprefix("; ") for c in cells)


def _no_peer_results(result: dict) -> dict:
    """A results.json entry without what depends on the other students graded with it."""
    out = dict(result)
    out["review"] = [f for f in result.get("review", []) if not _PEER_FLAG.fullmatch(f)]
    out.pop("similarity", None)
    # a test's inputs are drawn afresh at each grading (labkit.drawn, issue 47): how many of
    # them a wrong answer gets wrong, and which, may differ between two gradings; whether the
    # test failed, and with which error, may not
    out["messages"] = {k: str(v).split(":", 1)[0] for k, v in
                       (result.get("messages") or {}).items()}
    return out


def _info() -> LabInfo:
    info = load_lab(SOLUTIONS / "lab01_basics" / "lab01_basics.ipynb").info()
    return LabInfo("lab01_basics", info["cells"], info["fingerprint"], info["questions"])


# ---------------------------------------------------------------------------------------
# the pieces, fast
# ---------------------------------------------------------------------------------------
def _lab():
    return load_lab(SOLUTIONS / "lab01_basics" / "lab01_basics.ipynb")


def test_assembly_runs_the_labs_cells_in_order_with_only_the_students_code(tmp_path):
    lab = _lab()
    nb = json.loads((EXAMPLES_DIR / "perfect" / "lab01_basics" / "lab01_basics.ipynb").read_text())
    cells = nb["cells"]
    test = next(c for c in cells if c["metadata"].get("nbgrader", {}).get("grade_id") == "test_1_3_leaf")
    test["source"] = "pass"                                          # an edited test
    test["metadata"]["nbgrader"]["points"] = 100                     # edited metadata
    cells.remove(next(c for c in cells if c["metadata"].get("nbgrader", {}).get("grade_id")
                      == "test_quiz_q5"))                             # a deleted test
    cells.insert(0, {"cell_type": "code", "metadata": {}, "source": "print('first!')",
                     "outputs": [], "execution_count": None, "id": "mine"})  # above the setup
    nb["cells"] = list(reversed(cells))                              # and all reversed
    path = tmp_path / "sub.ipynb"
    path.write_text(json.dumps(nb))
    asm = assemble(lab, read_submission(path), referee_path="/r.py", key_file="/k")
    roles = [c.role for c in asm.cells]
    assert roles[0] == "referee" and "__referee__ = " in asm.cells[0].run
    assert roles.index("setup") < roles.index("referee", 1) < roles.index("student")
    gids = [c.grade_id for c in asm.cells if c.grade_id]
    assert gids == [c.grade_id for c in lab.cells if c.grade_id]    # the lab's order, all of it
    leaf = next(c for c in asm.cells if c.grade_id == "test_1_3_leaf")
    assert "### BEGIN HIDDEN TESTS" in leaf.full  # the lab's test, sealed: no text of it runs
    assert not any(line.strip() in leaf.run for line in leaf.full.split("\n") if len(line.strip()) > 8)
    quiz = next(c for c in asm.cells if c.grade_id == "test_quiz_q5")
    assert quiz.report == ("Q5",) and "same(Q5" in quiz.hidden and "same(Q5" not in quiz.run
    mine = next(i for i, c in enumerate(asm.cells) if "first!" in c.run)
    assert mine > roles.index("referee", 1)                            # after the seal
    notes = " ".join(asm.notes)
    assert "test_1_3_leaf was edited" in notes and "test_quiz_q5 is missing" in notes
    assert "lab's order" in notes and "above the setup cell" in notes


def test_a_test_scores_only_with_its_own_valid_receipt():
    lab = _lab()
    asm = assemble(lab, [], referee_path="/r.py", key_file="/k", key=b"k" * 32, nonce="n1")
    idx = {c.grade_id: i for i, c in enumerate(asm.cells) if c.role in ("test", "quiz")}
    executed: list[list] = [[] for _ in asm.cells]

    def receipt(gid, key=asm.key, answers=None):
        from autograder.notebook import sign

        payload = repr({"answers": answers or {}, "restored": []})
        mac = sign(key, f"{asm.nonce}|pass|{gid}|{payload}")
        return {"output_type": "stream", "name": "stdout", "text": f"{RECEIPT} {gid} {mac} {payload}\n"}

    names = [[("a", "first"), ("a", "second"), ("b", "0"), ("b", "1", "0")],
             [("3", "x"), ("10", "0"), ("10", "1")], [()], []]  # what flatten_with_names gives
    executed[idx["test_1_1_names"]] = [receipt("test_1_1_names",
                                               answers={"names": referee_literal(names)})]
    executed[idx["test_1_1_minickpt"]] = [receipt("test_1_1_minickpt", key=b"x" * 32)]  # forged
    executed[idx["test_1_2_host"]] = [receipt("test_1_1_names")]                        # replayed
    executed[idx["test_quiz_q1"]] = [receipt("test_quiz_q1", answers={"Q1": ("str", "B")})]
    executed[idx["test_quiz_q2"]] = [receipt("test_quiz_q2", answers={"Q2": ("str", "A")})]
    error = {"output_type": "error", "ename": "LabCheckError", "evalue": "plan_leaf is wrong",
             "traceback": []}
    executed[idx["test_1_3_leaf"]] = [receipt("test_1_3_leaf"), error]    # forged, then failed
    executed[idx["test_1_3_minickpt"]] = [receipt("test_1_3_minickpt"),  # not last
                                          {"output_type": "stream", "name": "stdout",
                                           "text": "Task 1.3: looks right\n"}]
    executed[idx["test_1_2_minickpt"]] = [  # last, then only stderr and the grader's own note
        {"output_type": "stream", "name": "stdout", "text": "Task 1.2: ok\n"},
        receipt("test_1_2_minickpt"), {"output_type": "stream", "name": "stderr", "text": "warn"},
        {"output_type": "stream", "name": "stdout", "text": "[grader] stopped 1 process(es)\n"}]
    grades = {g.grade_id: g for g in grade_cells(asm, executed, {}, lab.grade_cells)}
    assert grades["test_1_1_names"].score == 2 and grades["test_1_2_minickpt"].score == 2
    assert grades["test_1_3_leaf"].score == 0
    assert grades["test_1_3_leaf"].message == "LabCheckError: plan_leaf is wrong"
    assert grades["test_1_3_minickpt"].score == 0
    assert "not the test's last output" in grades["test_1_3_minickpt"].message
    assert grades["test_1_1_minickpt"].score == 0 and grades["test_1_2_host"].score == 0
    assert grades["test_quiz_q1"].score == 1
    assert grades["test_quiz_q2"].score == 0 and "save_checkpoint" in grades["test_quiz_q2"].message
    wrong = [list(reversed(n)) for n in names]  # a signed receipt cannot carry a wrong answer in
    executed[idx["test_1_1_names"]] = [receipt("test_1_1_names",
                                               answers={"names": referee_literal(wrong)})]
    grades = {g.grade_id: g for g in grade_cells(asm, executed, {}, lab.grade_cells)}
    assert grades["test_1_1_names"].score == 0 and "should give the names" in \
        grades["test_1_1_names"].message


def test_what_was_put_back_before_a_failing_test_reaches_review_and_earns_nothing():
    """The referee signs, for a failing test, what it had to put back before it: that goes
    to the review column; a ``restored`` line forged with another key, or for another test,
    or signed as ``restored`` but offered as a pass, goes nowhere and earns nothing."""
    from autograder.notebook import sign

    lab = _lab()
    asm = assemble(lab, [], referee_path="/r.py", key_file="/k", key=b"k" * 32, nonce="n1")
    idx = {c.grade_id: i for i, c in enumerate(asm.cells) if c.role in ("test", "quiz")}
    executed: list[list] = [[] for _ in asm.cells]
    error = {"output_type": "error", "ename": "LabCheckError", "evalue": "wrong", "traceback": []}

    def put_back(gid, what, key=asm.key, signed_gid=None):
        note = repr(what)
        mac = sign(key, f"{asm.nonce}|restored|{signed_gid or gid}|{note}")
        return {"output_type": "stream", "name": "stdout", "text": f"{RECEIPT} {gid} {mac} {note}\n"}

    executed[idx["test_1_1_names"]] = [put_back("test_1_1_names", ["numpy.isclose"]), error]
    executed[idx["test_1_1_minickpt"]] = [put_back("test_1_1_minickpt", ["x"], key=b"y" * 32),
                                          error]
    executed[idx["test_1_2_host"]] = [put_back("test_1_2_host", ["y"],
                                               signed_gid="test_1_1_names"), error]
    executed[idx["test_1_3_leaf"]] = [put_back("test_1_3_leaf", ["z"])]  # no error: no pass
    grades = {g.grade_id: g for g in grade_cells(asm, executed, {}, lab.grade_cells)}
    assert grades["test_1_1_names"].restored == ("numpy.isclose",)
    assert grades["test_1_1_names"].score == 0 and grades["test_1_1_names"].message
    assert grades["test_1_1_minickpt"].restored == () and grades["test_1_2_host"].restored == ()
    assert grades["test_1_3_leaf"].score == 0  # a restored line is never a pass
    assert grades["test_1_3_leaf"].restored == ("z",)


answers = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.frozensets(st.integers() | st.text(max_size=5), max_size=4)
    | st.sets(st.text(max_size=5), max_size=4)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)


@given(answers)
def test_quiz_answers_cross_the_kernel_boundary_as_plain_literals(value):
    back = decode_answer(ast.literal_eval(repr(referee_literal(value))))
    assert labkit.same(back, value)


def test_answers_that_are_not_plain_values_match_nothing():
    class Liar(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    for odd in (Liar("B"), object(), [1, Liar("x")], "x" * 20_000):
        back = decode_answer(ast.literal_eval(repr(referee_literal(odd))))
        assert not labkit.same(back, "B") and not labkit.same(back, [1, "x"])


def test_the_scan_flags_reaching_into_the_kernel_but_not_ordinary_code():
    flags = scan([("task_1_1", "import sys\nf = sys._getframe(1)\nget_ipython().events.register('x', f)"),
                  ("task_1_2", "import minickpt.labkit as L\nL.check = print\nbuiltins.type = 3"),
                  ("task_1_3", "import subprocess\np = subprocess.Popen(['x'])\np.kill()\n"
                               "import os\nos.makedirs('d', exist_ok=True)")])
    text = " | ".join(flags)
    assert "sys._getframe in task_1_1" in text and "get_ipython in task_1_1" in text
    assert "assigns L.check in task_1_2" in text and "assigns builtins.type in task_1_2" in text
    assert "task_1_3" not in text
    forge = scan([("task_1_3", FORGE), ("task_1_4", "import sys as s\nm = s.modules\n"
                                                    "c = getattr(f, '__clo' + 'sure__')\n"
                                                    "x = e.__traceback__.tb_frame\n")])
    assert set(forge) == {"R._sign in task_1_3", "e.__traceback__ in task_1_4",
                          "e.__traceback__.tb_frame in task_1_4", "s.modules in task_1_4",
                          "sys.modules in task_1_3", "the text '__closure__' in task_1_4",
                          "the text '__referee__' in task_1_3", "vars in task_1_3",
                          # issue 47: a private name reached by getattr, however spelled
                          "getattr(f, '__clo' + 'sure__') in task_1_4",
                          "getattr(f, '__closure__') reaches a private name in task_1_4"}
    assert scan([("setup", 'import sys\nif "google.colab" in sys.modules:\n    pass')]) == []



def test_handing_in_the_reference_is_flagged_naming_the_task():
    """A one-line wrapper around minickpt's own function passes every test; the review column
    must name the task, however the reference was reached, in every lab; calling the library
    in passing, or another task's function inside a task, is not flagged."""
    from autograder.notebook import reference_use, task_functions

    for lab_name in LAB_NAMES:  # every lab's reference notebook is clean
        lab = load_lab(SOLUTIONS / lab_name / f"{lab_name}.ipynb")
        assert task_functions(lab), lab_name
        mine = [(c.grade_id, c.source) for c in lab.cells if c.role == "solution"]
        assert reference_use(mine, lab) == [], lab_name
    lab = load_lab(SOLUTIONS / "lab01_basics" / "lab01_basics.ipynb")
    flags = reference_use([
        ("task_1_2", "from minickpt.tree import to_host as _h\n"
                     "def to_host(x, **k):\n    return _h(x, **k)"),
        ("task_1_1", "def flatten_with_names(t):\n    return mc.tree.flatten_with_names(t)\n"
                     "def unflatten_like(t, v, _f=mc.unflatten_like):\n    return _f(t, v)"),
        ("your cell 3", "_p = lab.reference('plan_leaf')\nprint(mc.to_host(1))\n"
                        "import minickpt.legacy as L\n_r = L.restore_checkpoint"),
        ("task_1_3", "def decode_leaf(e, r, **k):\n"
                     "    return getattr(mc, 'decode_' + 'leaf')(e, r, **k)"),
        ("task_1_4", "def restore_checkpoint(*a, **k):\n    x = mc.to_host(1)\n"
                     "    return _r(*a, **k)")], lab)
    text = " | ".join(flags)
    for task, where in (("1.1", "task_1_1"), ("1.2", "task_1_2"), ("1.3", "task_1_3"),
                        ("1.3", "your cell 3"), ("1.4", "your cell 3")):
        assert f"(task {task}) in {where}" in text, (task, where, flags)
    assert "to_host (task 1.2) in your cell 3" not in text  # a call in passing
    assert "in task_1_4" not in text  # another task's function, used inside task 1.4


FORGE = '''
import sys


def plan_leaf(names, host):
    R = vars(sys.modules["__main__"])["__" "referee__"]
    print(R._sign("..."))
    return ("wrong", None)
'''


def test_the_referee_restores_what_student_code_patched_and_signs_only_passing_tests(tmp_path):
    """In a fresh Python (the referee rewires sys.stdout and restores modules): a patched
    labkit.check, builtins and reference do not make a wrong function pass; a function that
    patches while under test fails; a test whose text was changed is refused; and a student
    function cannot sign: ``__referee__`` has nothing to sign with, a test started inside a
    test and a test run twice are refused. A failing test still reports, signed, what the
    referee put back before it (for the review column; it earns nothing)."""
    script = tmp_path / "run.py"
    script.write_text(REFEREE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "autograder" / "referee.py"),
                           str(tmp_path / "key")], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["right"].startswith("receipt") and "minickpt.labkit.check" in lines["right"]
    # a failing test earns nothing, but what was put back before it still reaches review
    assert lines["wrong"] == "LabCheckError: plan_leaf is wrong (printed: no receipt) " \
        "(put back: ['minickpt.labkit.check', 'minickpt.labkit.reference'])"
    assert lines["patches while tested"].startswith("TamperedError: plan_leaf changed")
    assert lines["changed text"].startswith("TamperedError: the text of test t4 was changed")
    assert lines["builtins in test"] == "receipt ['builtins.isinstance']}"
    assert lines["facade"] == "['seal', 'test']"
    assert lines["forge by name"] == "AttributeError: 'types.SimpleNamespace' object has no " \
                                     "attribute '_sign' (printed: no receipt)"
    assert lines["nested test"].startswith("TamperedError: a test cannot be started from inside")
    assert lines["nested test"].endswith("(printed: no receipt)")
    assert lines["run twice"] == "TamperedError: test t2 already ran once: it is not run " \
                                 "again (printed: no receipt)"


REFEREE_SCRIPT = r'''
import hmac, importlib.util, builtins, sys
import minickpt.labkit as lab
from minickpt.labkit import check

spec = importlib.util.spec_from_file_location("referee", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
mod.__dict__["__builtins__"] = dict(vars(builtins))
spec.loader.exec_module(mod)
with open(sys.argv[2], "wb") as f:
    f.write(b"k" * 32)
out = sys.stdout
captured = []
class Grab:
    def write(self, t): captured.append(t)
    def flush(self): pass
sys.stdout = Grab()  # the referee caps it and puts it back before each test
ref = mod.boot(sys.argv[2], "n")
__referee__ = ref  # where the kernel's user namespace holds it
ns = {"lab": lab, "check": check}
ref.seal(ns)
import minickpt.format.read as fmt_read
from minickpt.format.encode import plan_leaf as real_plan

def sign(gid, src, report=()):
    return hmac.new(b"k" * 32, f"n|test|{gid}|{report!r}|{src}".encode(), "sha256").hexdigest()

def sealed(gid, src):
    data = src.encode()
    stream = b"".join(bytes.fromhex(hmac.new(b"k" * 32, f"n|text|{gid}|{i}".encode(), "sha256").hexdigest())
                      for i in range((len(data) + 31) // 32))
    return bytes(a ^ b for a, b in zip(data, stream)).hex()

def put_back(text, gid):
    """The text without the referee's signed "put back before a failing test" line, and
    that line's list (or None)."""
    kept, what = [], None
    for line in text.split("\n"):
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == mod.RECEIPT and parts[1] == gid and hmac.compare_digest(
                parts[2], hmac.new(b"k" * 32, f"n|restored|{gid}|{parts[3]}".encode(),
                                   "sha256").hexdigest()):
            what = parts[3]
            continue
        kept.append(line)
    return "\n".join(kept), what

def run(label, gid, src, mac=None):
    captured.clear()
    try:
        ref.test(gid, sealed(gid, src), mac or sign(gid, src))
        text = "".join(captured)
        result = "receipt" + (" " + text.split("'restored': ")[1] if mod.RECEIPT in text else " MISSING")
    except BaseException as e:
        text, what = put_back("".join(captured), gid)
        result = f"{type(e).__name__}: {e}" + (" (printed: a receipt)" if mod.RECEIPT in text
                                               else " (printed: no receipt)")
        if what is not None:
            result += f" (put back: {what})"
    print(f"{label}: {result.strip()}", file=out)

# the student's cells: a wrong plan_leaf, and patches that would make any check pass
def plan_leaf(names, host):
    return ("wrong", None)
ns["plan_leaf"] = plan_leaf
lab.check = lambda ok, message: None
ns["check"] = lambda ok, message: None
lab.reference = lambda name: ns[name]
TEST = 'check(plan_leaf(("a",), 1) == lab.reference("plan_leaf")(("a",), 1), "plan_leaf is wrong")'
run("wrong", "t1", TEST)
def plan_leaf(names, host):
    return real_plan(names, host)
ns["plan_leaf"] = plan_leaf
lab.check = lambda ok, message: None
run("right", "t2", TEST)
run("run twice", "t2", TEST)
def plan_leaf(names, host):
    fmt_read.read_leaves = lambda *a, **k: None
    return real_plan(names, host)
ns["plan_leaf"] = plan_leaf
run("patches while tested", "t3", TEST)
run("changed text", "t4", "pass", sign("t4", TEST))
builtins.isinstance = lambda *a: True
run("builtins in test", "t5", 'check(isinstance(1, str) is False, "builtins are the real ones")')
print("facade:", sorted(vars(ref)), file=out)
# the audit's forgery (/tmp/audit578/forge.py): reach the referee by name and sign
def plan_leaf(names, host):
    R = vars(sys.modules["__main__"])["__" "referee__"]
    R._sign("n|pass|t6|" + repr({"answers": {}, "restored": []}))
    return ("wrong", None)
ns["plan_leaf"] = plan_leaf
run("forge by name", "t6", TEST)
def plan_leaf(names, host):  # get a receipt for this very test from a nested run
    vars(sys.modules["__main__"])["__referee__"].test("t7", sealed("t7", TEST), sign("t7", TEST))
    return ("wrong", None)
ns["plan_leaf"] = plan_leaf
run("nested test", "t7", TEST)
'''


def test_a_file_that_is_not_a_notebook_is_a_grade_not_a_crash(tmp_path):
    """No kernel starts: status failed, 0 points, the reason, and a feedback page."""
    for student, content in (("garbage", b"\x00\xffnot json"), ("listless", b'{"cells": 3}')):
        d = tmp_path / "subs" / student / "lab01_basics"
        d.mkdir(parents=True)
        (d / "lab01_basics.ipynb").write_bytes(content)
    proc = _grade(str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--work",
                  str(tmp_path / "work"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["student"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    for student in ("garbage", "listless"):
        r = results[student]
        assert (r["status"], r["total"]) == ("failed", 0) and "not a readable .ipynb" in r["reason"]
        assert "not a readable .ipynb" in (tmp_path / "out" / r["feedback"]).read_text()


def test_shards_partition_a_class_by_name():
    names = [f"student{k:03d}" for k in range(300)]
    for n in (1, 2, 7):
        slices = [{s for s in names if shard_of(s, n) == i} for i in range(1, n + 1)]
        assert set().union(*slices) == set(names) and sum(map(len, slices)) == len(names)
        assert all(slices) or n > len(names)
    assert shard_of("alice", 5) == shard_of("alice", 5)


def test_merge_refuses_overlapping_or_missing_slices(tmp_path):
    info = _info()

    def fake(name, shard, students):
        d = tmp_path / name
        results = [{"student": s, "lab": "lab01_basics", "status": "graded", "reason": "",
                    "scores": dict.fromkeys(info.cells, 0.0)} for s in students]
        write_outputs(d, results, {"lab01_basics": info}, {}, {"shard": shard})
        return str(d)

    a, b = fake("a", [1, 3], ["ann"]), fake("b", [2, 3], ["bob", "ann"])
    c = fake("c", [2, 3], ["bob"])
    proc = _grade("merge", a, b, "--out", str(tmp_path / "m1"), timeout=120)
    assert proc.returncode == 2 and "ann/lab01_basics is in both" in proc.stderr
    proc = _grade("merge", a, c, "--out", str(tmp_path / "m2"), timeout=120)
    assert proc.returncode == 2 and "missing ['3/3']" in proc.stderr
    proc = _grade("merge", a, c, "--out", str(tmp_path / "m3"), "--allow-missing", timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "m3" / "grades.csv") as f:
        assert [r["student"] for r in csv.DictReader(f)] == ["ann", "bob"]


def test_the_sandbox_hides_the_machine_and_bounds_the_process(tmp_path):
    """The isolation mechanisms one by one, on a plain Python in the sandbox."""
    need_sandbox()
    secret = tmp_path / "secret.txt"
    secret.write_text("the hidden tests")
    ipc = tmp_path / "ipc"
    listener = Listener()
    with sandbox.SlotUids(1) as uids:
        uid = uids.uids[0]
        sandbox.prepare_ipc_dir(ipc, ISOLATION, uid)
        code = SANDBOX_PROBE.format(secret=str(secret), outside=str(tmp_path / "outside.txt"),
                                    port=listener.port)
        cmd = sandbox.kernel_command(
            ISOLATION, [sandbox.sandbox_python(), "-c", code], uid=uid, cwd="/home/student/x",
            ipc_dir=str(ipc), read_only=sandbox.python_paths(),
            limits=sandbox.Limits(memory_bytes=1 << 30, processes=64), env={})
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        finally:
            listener.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = dict(line.split("=", 1) for line in proc.stdout.split())
    assert got.pop("write") in ("FileNotFoundError", "PermissionError")  # not there, or not ours
    assert got == {"read": "FileNotFoundError",
                   "init": "PermissionError", "uid": str(uid), "caps": "0000000000000000",
                   "net": "ConnectionRefusedError", "forks": "lessthan64",
                   "memory": "MemoryError", "scratch": "ok", "ro": "OSError"}, proc.stdout
    assert listener.connections == [] and not (tmp_path / "outside.txt").exists()


SANDBOX_PROBE = '''
import os, socket, sys, time
def attempt(f):
    try:
        f()
        return "ok"
    except Exception as e:
        return type(e).__name__
print("read=" + attempt(lambda: open({secret!r}).read()))
print("write=" + attempt(lambda: open({outside!r}, "w").write("x")))
print("init=" + attempt(lambda: open("/proc/1/environ").read()))
print("uid=" + str(os.getuid()))
print("caps=" + [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0])
print("net=" + attempt(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)))
kids = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids += 1
print("forks=" + ("lessthan64" if kids < 64 else str(kids)))
print("memory=" + attempt(lambda: bytearray(2 << 30)))
print("scratch=" + attempt(lambda: open("/tmp/mine", "w").write("x")))
print("ro=" + attempt(lambda: open(os.path.join(os.path.dirname(os.__file__), "x"), "w")))
sys.stdout.flush()
os._exit(0)
'''


@pytest.mark.timeout(600)
def test_a_zip_for_one_lab_without_sandbox_says_so_counts_and_fails_with_2(tmp_path):
    """grade.sh on a .zip with --lab and MINICKPT_SANDBOX=off: only that lab's notebooks are
    graded; the loud warning and the isolation column say there was no sandbox; the progress
    lines count graded, failed and left; and a submission whose grading itself fails (a kernel
    that cannot start under a 10 MiB memory limit: the grader's fault, not the student's)
    makes the exit code 2 and is named. No kernel ever runs student code here."""
    archive = tmp_path / "class.zip"
    release = (LABS / "lab01_basics" / "lab01_basics.ipynb").read_bytes()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("class/garbage/lab01_basics/lab01_basics.ipynb", b"\x00not json")
        zf.writestr("class/listless/lab01_basics/lab01_basics.ipynb", b'{"cells": 3}')
        zf.writestr("class/blank/lab01_basics/lab01_basics.ipynb", release)
        zf.writestr("class/other/lab99_other/lab99_other.ipynb", release)
    env = {**_env(), "MINICKPT_SANDBOX": "off"}
    proc = subprocess.run(["bash", str(GRADE_SH), str(archive), "--lab", "lab01_basics",
                           "--memory", "0.01", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "STUDENT CODE IS NOT FULLY ISOLATED" in proc.stderr and "MINICKPT_SANDBOX=off" in proc.stderr
    assert "grading itself failed for 1 submission(s): blank/lab01_basics" in proc.stderr
    assert "3 submission(s) of lab01_basics" in proc.stdout and "lab99" not in proc.stdout
    steps = re.findall(r"\[(\d)/3\] (\w+)/lab01_basics: 0 (\w+) .*· graded (\d), failed (\d), "
                       r"left (\d)", proc.stdout)
    assert [(n, left) for n, _, _, _, _, left in steps] == [("1", "2"), ("2", "1"), ("3", "0")]
    assert {(s, status) for _, s, status, *_ in steps} == {
        ("blank", "error"), ("garbage", "failed"), ("listless", "failed")}
    assert steps[-1][3:5] == ("0", "3")  # nothing graded: two unreadable, one the grader's fault
    with open(tmp_path / "out" / "grades-lab01_basics.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"blank", "garbage", "listless"}
    assert rows["blank"]["status"] == "error" and rows["garbage"]["status"] == "failed"
    assert all(r["isolation"].startswith("NONE") for r in rows.values()), rows
    assert "!! NOT FULLY ISOLATED: NONE" in (tmp_path / "out" / "summary.txt").read_text()


# ---------------------------------------------------------------------------------------
# issue 20: the standard library, the kernel's history, the neighbours, odd source
# ---------------------------------------------------------------------------------------
def test_patching_the_standard_library_silences_no_check(tmp_path):
    """Whatever student code did to Python's own machinery (a class of the standard library
    the helpers run through, by attribute or by code object; a module function deep in
    numpy; an audit hook), a test scores only if every check in it ran and held."""
    script = tmp_path / "run.py"
    script.write_text(REFEREE_SCRIPT.split("# the student's cells")[0] + STDLIB_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "autograder" / "referee.py"),
                           str(tmp_path / "key")], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    for case, what in (("exit patched", "contextlib._GeneratorContextManager.__exit__"),
                       ("exit's code patched", "_GeneratorContextManager.__exit__.__code__")):
        assert lines[case].startswith("LabCheckError: must raise (nothing was raised) "
                                      "(printed: no receipt) (put back: ["), lines[case]
        assert what in lines[case], lines[case]
    assert "contextlib._GeneratorContextManager.__exit__" in lines["put back"]
    assert "_GeneratorContextManager.__exit__.__code__" in lines["put back"]
    assert "numpy._core.numeric.isclose" in lines["put back"]
    assert "TamperedError: plan_leaf changed contextlib._GeneratorContextManager.__exit__" in \
        lines["patched while tested"] and lines["patched while tested"].endswith("no receipt)")
    assert lines["left patched"].startswith("TamperedError: the test left numpy._core.numeric")
    assert lines["swallowed"].startswith("TamperedError: the check (this check failed, and the "
                                         "failure was swallowed")
    assert "sys.addaudithook (refused)" in lines["audit hook"] and lines["hook saw"] == "[]"


STDLIB_SCRIPT = r'''
import contextlib
import numpy._core.numeric as numeric
from minickpt.labkit import expect_raises, same
ns.update(expect_raises=expect_raises, same=same, np=__import__("numpy"))
real_exit, real_isclose = contextlib._GeneratorContextManager.__exit__, numeric.isclose
MUST = 'with expect_raises(ValueError, "must raise"):\n    pass'

def swallow(self, typ, value, tb):
    return True

contextlib._GeneratorContextManager.__exit__ = swallow          # between cells
run("exit patched", "s1", MUST)
real_exit.__code__, saved = swallow.__code__, real_exit.__code__  # the code object itself
run("exit's code patched", "s2", MUST)
numeric.isclose = lambda *a, **k: True
real_exit.__code__ = swallow.__code__
contextlib._GeneratorContextManager.__exit__ = swallow
captured.clear()
ref.test("s3", sealed("s3", "check(True, 'ok')"), sign("s3", "check(True, 'ok')"))
print("put back:", "".join(captured).split("'restored': ")[-1].strip(), file=out)
def plan_leaf(names, host):                                    # while the test runs
    contextlib._GeneratorContextManager.__exit__ = swallow
    return ("wrong", None)
ns["plan_leaf"] = plan_leaf
run("patched while tested", "s4", 'with expect_raises(ValueError, "must raise"):\n    plan_leaf(("a",), 1)')
def plan_leaf(names, host):
    numeric.isclose = lambda *a, **k: True                     # deep in numpy: seen at the end
    return ("wrong", None)
ns["plan_leaf"] = plan_leaf
run("left patched", "s5", 'x = plan_leaf(("a",), 1)')
run("swallowed", "s6", 'try:\n    check(False, "the check")\nexcept BaseException:\n    pass')
seen = []
sys.addaudithook(lambda event, args: seen.append(event) if event in ("compile", "exec") else None)
run("audit hook", "s7", "check(True, 'ok')")
print("hook saw:", seen, file=out)
'''


def test_hidden_tests_never_enter_the_kernel_as_text():
    """What the kernel receives for a test (and so its input history, ``In``, ``_ih``,
    ``_i<n>``, the history database, input transformers and pre_run_cell hooks) holds no line
    of the test, hidden or visible: only ciphertext, which the referee alone reads back."""
    from autograder.notebook import seal_text

    for lab_name in LAB_NAMES:
        lab = load_lab(SOLUTIONS / lab_name / f"{lab_name}.ipynb")
        asm = assemble(lab, [], referee_path="/r.py", key_file="/k")
        tests = [c for c in asm.cells if c.role in ("test", "quiz")]
        assert tests
        for c in tests:
            lines = [s.strip() for s in c.full.split("\n") if len(s.strip()) >= 10]
            assert not [s for s in lines if s in c.run], (lab_name, c.grade_id)
    sealed = seal_text(b"k" * 32, "n", "g", "check(x)\n" * 20)
    assert "check" not in sealed and len(sealed) == 2 * len("check(x)\n" * 20)


def test_odd_source_is_a_grade_with_a_reason(tmp_path):
    """A 3000-term string concatenation (too deep for Python's parser) and a lone surrogate
    (valid JSON, not text), in the submission and in what the kernel printed: read,
    assembled, scanned (flagged for a person), and written out, without an exception."""
    from autograder import runner

    lab = _lab()
    nb = json.loads((EXAMPLES_DIR / "perfect" / "lab01_basics" / "lab01_basics.ipynb").read_text())
    for c in nb["cells"]:
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid == "quiz_q1":
            c["source"] = "Q1 = " + " + ".join(['""'] * 3000) + ' + "B"'
        elif gid == "task_1_1":
            c["source"] = "".join(c["source"]) + "\n# \ud800"
    path = tmp_path / "sub.ipynb"
    path.write_text(json.dumps(nb, ensure_ascii=True))
    cells = read_submission(path)
    asm = assemble(lab, cells, referee_path="/r.py", key_file="/k")
    assert any("lone surrogates" in n for n in asm.notes)
    mine = [(c.grade_id, c.run) for c in asm.cells if c.role == "student"]
    assert "cannot be scanned (RecursionError): read quiz_q1 yourself" in scan(mine)
    assert reference_use(mine, lab) == []  # the same cell through the reference check
    executed = [[{"output_type": "stream", "name": "stdout", "text": "odd \ud800 output\n"}]
                if c.kind == "code" else [] for c in asm.cells]
    result = {"student": "odd", "lab": lab.name, "status": "graded", "reason": "",
              "scores": dict.fromkeys(lab.grade_cells, 0.0), "messages": {}, "notes": asm.notes,
              "review": [], "isolation": "sandbox"}
    runner._finish(tmp_path, result, lab, asm, [[runner._text_only(o) for o in outs]
                                                for outs in executed], time.monotonic())
    assert "odd \ufffd output" in (tmp_path / "feedback.html").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------
# issue 22: fail closed, the real cause, the environment where it lives, nothing left running
# ---------------------------------------------------------------------------------------
def test_an_environment_outside_the_repository_is_sandboxed(tmp_path):
    """``.venv`` a link to an environment elsewhere: the sandbox shows the environment at its
    real place and runs its own ``bin/python`` (the probe imports what the kernel needs)."""
    need_sandbox()
    link = tmp_path / "course-env"
    link.symlink_to(Path(sys.prefix).resolve())
    python = str(link / "bin" / "python")
    found = sandbox.probe(python)
    assert found.mode == "bwrap-root" and not found.detail, found.detail
    assert sandbox.sandbox_python(python) == str(Path(sys.prefix).resolve() / "bin" / "python")
    hidden = sandbox.probe("/nowhere/env/bin/python")  # the real cause, not "install bwrap"
    assert "/nowhere/env/bin/python is not visible inside the sandbox" in hidden.detail
    assert "install" not in hidden.fix and not hidden.sandboxed


def test_without_a_working_sandbox_submissions_are_refused_unless_asked(tmp_path):
    """A bubblewrap that fails (MINICKPT_BWRAP=/bin/false): grade.sh refuses with exit 2, the
    cause and the fix, before any kernel; the bundled examples may still be demonstrated;
    --unsandboxed and MINICKPT_SANDBOX=off are explicit and marked."""
    from autograder.grade import refuse_unsandboxed

    d = tmp_path / "subs" / "ann" / "lab01_basics"
    d.mkdir(parents=True)
    shutil.copyfile(LABS / "lab01_basics" / "lab01_basics.ipynb", d / "lab01_basics.ipynb")
    proc = subprocess.run(["bash", str(GRADE_SH), str(tmp_path / "subs"), "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300,
                          env={**_env(), "MINICKPT_BWRAP": "/bin/false"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "REFUSED" in proc.stderr and "why: bubblewrap does not work here" in proc.stderr
    assert "--unsandboxed" in proc.stderr and "MINICKPT_SANDBOX=off" in proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()
    failing = sandbox.Isolation("none", detail="bubblewrap does not work here: exit 1")
    assert refuse_unsandboxed(failing, tmp_path) and refuse_unsandboxed(failing, EXAMPLES_DIR) is None
    for asked in (sandbox.unsandboxed("--unsandboxed"), sandbox.unsandboxed("MINICKPT_SANDBOX=off")):
        assert refuse_unsandboxed(asked, tmp_path) is None
        assert asked.marker.startswith("NONE (unsandboxed on request: ")


ESCAPEES = '''
# Leave processes behind: each forks, leaves its session and its parent, and sleeps.
import subprocess
import sys

for _ in range(4):
    subprocess.Popen([sys.executable, "-c", "import os, time\\nif os.fork():\\n    os._exit(0)\\n"
                      "os.setsid()\\ntime.sleep(600)", "{mark}"], start_new_session=True)
print("left 4 processes behind")
'''


def _with_marked(mark: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and mark.encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            pass
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["sandboxed", "unsandboxed"])
def test_processes_that_escaped_their_session_are_gone_after_grading(mode, tmp_path):
    """A submission's children that left its session and its process group (double fork and
    setsid) are killed when its grading ends, sandboxed or not."""
    import signal

    if mode == "sandboxed":
        need_sandbox()
    mark = f"minickpt-escapee-{os.getpid()}-{mode}"
    nb = json.loads((LABS / "lab01_basics" / "lab01_basics.ipynb").read_text())
    nb["cells"].append({"cell_type": "code", "metadata": {}, "source": ESCAPEES.replace(
        "{mark}", mark), "outputs": [], "execution_count": None, "id": "escape"})
    d = tmp_path / "subs" / "runaway" / "lab01_basics"
    d.mkdir(parents=True)
    (d / "lab01_basics.ipynb").write_text(json.dumps(nb))
    extra = ["--unsandboxed"] if mode == "unsandboxed" else []
    try:
        proc = _grade(str(tmp_path / "subs"), *extra, "--timeout", "60", "--out",
                      str(tmp_path / "out"), "--work", str(tmp_path / "work"), timeout=800)
        left = _with_marked(mark)
    finally:
        for pid in _with_marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "left 4 processes behind" in _graded_text(tmp_path / "work", "runaway")
    assert left == [], f"still running after grading: {left}"
    r = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert (r["isolation"] == "sandbox" or r["isolation"].startswith("partial")) if \
        mode == "sandboxed" else r["isolation"].startswith("NONE (unsandboxed on request: --unsandboxed)")


def _graded_text(work: Path, student: str, lab: str = "lab01_basics") -> str:
    nb = json.loads((work / "subs" / lab / student / "graded.ipynb").read_text())
    return "\n".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))


# ---------------------------------------------------------------------------------------
# issue 20.3: a cgroup per slot
# ---------------------------------------------------------------------------------------
CGROUP_PROBE = '''
import os, sys, time
def spin():
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    while True:
        pass
before = {p for p in os.listdir("/proc") if p.isdigit()}
for _ in range(4):
    if os.fork() == 0:
        spin()
    os.wait()
time.sleep(0.3)
def same_cgroup(p):  # new processes of the machine are not ours: only those in our cgroup
    try:
        return open(f"/proc/{p}/cgroup").read() == open("/proc/self/cgroup").read()
    except OSError:
        return False
mine = [p for p in os.listdir("/proc") if p.isdigit() and p not in before and same_cgroup(p)]
print("spinners", len(mine))
def cpu():
    t = 0
    for p in mine:
        try:
            f = open(f"/proc/{p}/stat").read().rpartition(") ")[2].split()
            t += int(f[11]) + int(f[12])
        except (OSError, ValueError, IndexError):
            pass
    return t / os.sysconf("SC_CLK_TCK")
c0, t0 = cpu(), time.monotonic()
time.sleep(2)
print("cores", (cpu() - c0) / (time.monotonic() - t0))
alive = 0
for _ in range(3):  # 3 x 120 MiB, touched, in a 256 MiB cgroup: not all of them live
    pid = os.fork()
    if pid == 0:
        b = bytearray(120 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(3)
        os._exit(0)
time.sleep(0.1)
ok = 0
while True:
    try:
        _, status = os.wait()
    except ChildProcessError:
        break
    ok += os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
print("allocations that lived", ok)
sys.stdout.flush()
'''


@pytest.mark.timeout(120)
def test_a_slot_cgroup_bounds_a_submission_as_a_whole():
    """Four spinners that left their session get a quarter of a core between them (the
    slot's cpu share), three 120 MiB processes do not all fit in 256 MiB, and kill() leaves
    nothing in the slot."""
    from autograder import cgroups

    slots, why = cgroups.make_slot_cgroups(1, cpus=0.25, memory=256 << 20, processes=64,
                                           name=f"minickpt-test-{os.getpid()}")
    if not slots:
        if REQUIRE:
            pytest.fail(f"no cgroup per slot here: {why}")
        pytest.skip(f"no cgroup per slot here: {why}")
    slot = slots[0]
    try:
        proc = subprocess.run(slot.join_command([sys.executable, "-c", CGROUP_PROBE]),
                              capture_output=True, text=True, timeout=60)
        left = slot.pids()
        killed = slot.kill()
        after = slot.pids()
    finally:
        cgroups.remove_all(slots)
    got = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert float(got["cores"]) < 0.25 * 1.6, proc.stdout + proc.stderr
    assert int(got["allocations that lived"]) < 3, proc.stdout + proc.stderr
    assert int(got["spinners"]) == 4 and len(left) >= 4 and killed >= 4 and after == []


def test_without_cgroups_the_results_say_what_is_lost(monkeypatch):
    from autograder import cgroups

    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 1000)
    lost = sandbox._cgroups_lost()
    assert lost and "no cgroup per submission" in lost[0] and "cgroups need root" in lost[0]
    iso = sandbox.Isolation("bwrap-root", lost=lost)
    assert "no cgroup per submission" in iso.marker and iso.warning()


def test_what_the_referee_cannot_see_between_two_calls_is_flagged():
    """The documented limit: a patch outside the modules the helpers use by name, made by
    one call of a student's function and undone by a later one before the test ends, or a
    write straight into a module's dict, is not seen while the test runs; the scan flags each
    spelling for a person to read, and the history's names too."""
    flags = scan([("task_1_1", "import numpy\nnumpy._core.numeric.isclose = f\n"
                               "import email.message\nemail.message.Message.get = g\n"),
                  ("task_1_2", "import numpy\nvars(numpy)['isclose'] = f\nnumpy.__dict__['x'] = 1\n"
                               "setattr(numpy._core.numeric, 'isclose', f)"),
                  ("task_1_3", "x = In[-1] + _ih[0]\nimport sys\nsys.addaudithook(print)\n"
                               "h = get_ipython().history_manager")])
    text = " | ".join(flags)
    for want in ("assigns numpy._core.numeric.isclose in task_1_1",
                 "assigns email.message.Message.get in task_1_1", "vars in task_1_2",
                 "setattr(numpy._core.numeric, ...) in task_1_2", "In in task_1_3",
                 "_ih in task_1_3", "sys.addaudithook in task_1_3",
                 "get_ipython().history_manager in task_1_3"):
        assert want in text, (want, flags)


def _hidden_lines(lab_name: str) -> set[str]:
    """The lab's hidden test lines (20 characters or more) that no visible part of its cells
    shows too: the ones a leak would carry out (a line hidden in lab 3 may be shown in lab 6)."""
    cells = load_lab(SOLUTIONS / lab_name / f"{lab_name}.ipynb").cells
    shown = {s.strip() for c in cells for s in split_hidden(c.source)[0].split("\n")}
    return {s.strip() for c in cells for s in split_hidden(c.source)[1].split("\n")
            if len(s.strip()) >= 20} - shown


ISSUE_20_CLASSES = ("cheat_patch_stdlib", "cheat_read_history", "attack_spinners", "odd_source")


def _issue_20_example(lab: str, kind: str) -> str:
    """The example of one of issue 20's classes in ``lab``: lab 1 has one of each (on
    ``perfect``), labs 2-6 one ``attack_issue_20`` that holds all four (first task right)."""
    return kind if kind in EXAMPLES[lab] else "attack_issue_20"


def check_issue_20(corpus, labs, slots: int) -> None:
    """The checks of the issue-20 test, per lab, on a run's results and work folder (``slots``:
    its -j, which sets each slot's share of the cores). Examples named attack_* are graded
    only in the sandbox: without one, their checks are skipped (need_sandbox says so)."""
    import base64
    import zlib

    for lab in labs:
        release = nbformat.read(LABS / lab / f"{lab}.ipynb", as_version=4)
        ex = {kind: _issue_20_example(lab, kind) for kind in ISSUE_20_CLASSES}
        ex = {k: v for k, v in ex.items() if ISOLATION.sandboxed or not v.startswith("attack_")}
        if "cheat_patch_stdlib" in ex:  # nothing beyond the task it got right on purpose
            r = _result(corpus, ex["cheat_patch_stdlib"], lab)
            honest = "" if ex["cheat_patch_stdlib"] == "cheat_patch_stdlib" else \
                _gid(_first(release, "task_")).removeprefix("task_").replace("_", ".")
            assert r["status"] == "graded" and r["ran_all_cells"], (lab, r["reason"])
            assert r["total"] == r["groups"].get(honest, 0) and all(
                v == 0 for g, v in r["groups"].items() if g != honest), (lab, r["groups"])
            assert any("contextlib._GeneratorContextManager.__exit__" in f for f in r["review"]), \
                (lab, r["review"])
        if "cheat_read_history" in ex:
            out = _graded_outputs(corpus, ex["cheat_read_history"], lab)
            blob = zlib.decompress(base64.b64decode(re.search(r"CARRIED-OUT:(\S+)", out)[1])).decode()
            hidden = _hidden_lines(lab)
            assert hidden and len(blob) > 1000, (lab, len(blob))
            leaked = [h for h in hidden if h in blob]
            assert not leaked, f"{lab}: hidden test lines carried out: {leaked[:3]}"
            # (a judged lab's kernel runs no test, so the referee never reports the hook it
            # refused after one; no line of a test is in that kernel to carry out at all)
            assert judge.judges(lab) or any(
                "sys.addaudithook (refused)" in f
                for f in _result(corpus, ex["cheat_read_history"], lab)["review"]), lab
        if "odd_source" in ex:
            odd = _result(corpus, ex["odd_source"], lab)
            assert odd["status"] == "graded" and odd["ran_all_cells"], (lab, odd["reason"])
            assert any("lone surrogates" in n for n in odd["notes"]), (lab, odd["notes"])
            quiz = _gid(_first(release, "quiz_"))
            assert f"cannot be scanned (RecursionError): read {quiz} yourself" in odd["review"], \
                (lab, odd["review"])
            assert "cannot be compiled (RecursionError" in \
                _graded_outputs(corpus, ex["odd_source"], lab)
        if "attack_spinners" in ex:
            spun = _graded_outputs(corpus, ex["attack_spinners"], lab)
            spin = re.search(r"spinners: (\d+) got ([\d.]+) CPU-seconds in ([\d.]+) s", spun)
            assert spin and int(spin[1]) >= 8, (lab, spun[-2000:])
            if "no cgroup" not in ISOLATION.marker:  # the slot's share: the cores over -j
                share = len(os.sched_getaffinity(0)) / slots
                assert float(spin[2]) <= share * float(spin[3]) * 1.3 + 0.5, (lab, spin[0])


def test_timings_say_where_each_submissions_time_went_and_name_the_slowest(tmp_path):
    """grade.sh's timings.csv: per submission its slot seconds and phases (phases.json of its
    folder; empty for one that never reached a kernel); --durations N: the N slowest."""
    from autograder.grade import TIMING_PHASES, write_timings

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "phases.json").write_text(json.dumps(
        {"prepare": 0.1, "kernel": 0.8, "setup": 1.5, "cells": 62.0, "cpu": 3.0, "throttled": 0,
         "slowest_cell": "test_1_4_resume", "slowest_cell_seconds": 60.0,
         "timed_out": ["test_1_4_resume"], "judge": 41.5, "slowest_test": "test_1_3_leaf",
         "slowest_test_seconds": 12.25}))
    timings = [("slow", "lab01_basics", 64.5), ("broken", "lab01_basics", 0.2)]
    dirs = {("slow", "lab01_basics"): tmp_path / "a", ("broken", "lab01_basics"): tmp_path / "b"}
    text = write_timings(tmp_path / "timings.csv", timings, dirs, 1)
    with open(tmp_path / "timings.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert list(rows["slow"]) == ["student", "lab", "seconds", *TIMING_PHASES]
    assert rows["slow"]["timed_out"] == "test_1_4_resume" and rows["slow"]["kernel"] == "0.8"
    assert rows["broken"]["seconds"] == "0.2" and rows["broken"]["cells"] == ""
    assert text.startswith("slowest 1 of 2 submission(s)") and "slow/lab01_basics" in text
    assert "timed out: test_1_4_resume" in text and "broken" not in text
    assert rows["slow"]["judge"] == "41.5" and rows["slow"]["slowest_test"] == "test_1_3_leaf"
    assert "judge 41.5 s (slowest test_1_3_leaf 12.25 s)" in text, text
    assert write_timings(tmp_path / "t2.csv", timings, dirs, 0) == ""


def test_a_labs_fill_waits_only_for_a_fill_of_the_same_lab(tmp_path):
    """Two grade.sh (two corpus classes) fill different labs' caches at once; the same lab's
    fill is held by one of them while the other waits, then reuses it."""
    with compile_cache.key_lock(tmp_path, "lab-a") as held:
        assert held
        with compile_cache.key_lock(tmp_path, "lab-b", timeout=0) as other:
            assert other
        with compile_cache.key_lock(tmp_path, "lab-a", timeout=0) as same:
            assert not same
        with compile_cache.Lock(tmp_path, timeout=0) as root:  # the root's, for installs
            assert root
