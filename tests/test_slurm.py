"""A class graded on a real Slurm: autograder/slurm/submit.sh against one grade.sh run.

Opt-in (``MINICKPT_SLURM=1``): it installs Slurm from Debian's packages when missing
(scripts/install-slurm.sh: munged, slurmctld and slurmd on localhost, one node, state in a temp
folder), which costs about a minute, and grades a lab's examples twice, which costs ten on two
cores. The lab is ``MINICKPT_SLURM_LABS`` (comma-separated; default lab02_save_policy, whose
15 examples have all four kinds of issue 20 and copies that the similarity report pairs).

What it checks: the three jobs ran as designed (the fill filled the compilation cache, every
task of the array reused it and graded only its slice, the merge ran after the array), and the
merged results equal, file by file, what one ``grade.sh`` run over the same folder writes: the
same files, byte for byte, except what says how and when they were made (run.json's
settings, timings.csv that only a grading run writes, the logs' text) and what differs between
two runs on one machine as well (VOLATILE: temp names, fd numbers, an output's trailing
newlines). The similarity flags are among the bytes compared: the merge compares the whole
class, as the single run does.
The throughput of both runs is printed (the numbers in docs/slurm.md come from such runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from autograder import ROOT, sandbox
from autograder.grade import shard_of

REAL = [
    pytest.mark.skipif(os.environ.get("MINICKPT_SLURM") != "1",
                       reason="opt-in: MINICKPT_SLURM=1 installs and starts a local Slurm"),
    pytest.mark.timeout(3600),
    pytest.mark.slow,
]
"""The tests on a real Slurm; the ones on a fake ``sbatch`` at the end run always (seconds)."""


def real(test):
    for mark in REAL:
        test = mark(test)
    return test

INSTALL = ROOT / "scripts" / "install-slurm.sh"
SUBMIT = ROOT / "autograder" / "slurm" / "submit.sh"
GRADE_SH = ROOT / "autograder" / "grade.sh"
EXAMPLES = ROOT / "autograder" / "examples"
LABS = os.environ.get("MINICKPT_SLURM_LABS", "lab02_save_policy").split(",")
SHARDS = 3
TIMEOUT = "60"  # seconds a cell may run, as the grading tests give it
WAIT_S = 2400  # the most the three jobs may take in all
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
NOT_COMPARED = {"run.json", "timings.csv"}
"""How and when a run was made: compared apart (run.json) or not at all (timings.csv)."""


def _env(slurm_conf: Path) -> dict[str, str]:
    env = {**os.environ, "SLURM_CONF": str(slurm_conf), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the notebooks choose their devices themselves
    if sandbox.probe().mode != "bwrap-root":  # both runs alike; attack_* are then skipped
        if os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"no sandbox here: {sandbox.probe().detail}")
        env["MINICKPT_SANDBOX"] = "off"
    return env


def _scontrol(job: str, env: dict[str, str]) -> list[dict[str, str]]:
    """Every record `scontrol show job` has for a job (an array: one per task)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            for line in out.splitlines() if line.strip()]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A single-node Slurm on localhost, stopped (and its state removed) at the end."""
    # in /tmp itself: munged runs as the munge user, who cannot enter pytest's 0700 folders
    state = Path(tempfile.mkdtemp(prefix="minickpt-slurm-", dir="/tmp"))
    proc = subprocess.run(["bash", str(INSTALL), "start", str(state)], capture_output=True,
                          text=True, timeout=900)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(proc.stderr.strip().splitlines()[-1])
        yield state / "slurm.conf"
    finally:
        subprocess.run(["bash", str(INSTALL), "stop", str(state)], timeout=120)


@pytest.fixture(scope="module")
def runs(slurm, tmp_path_factory):
    """The examples of LABS graded by submit.sh (SHARDS tasks of 1 core) and by one grade.sh
    -j 2, with one compilation cache of their own (the fill job fills it, the rest reuse it)."""
    tmp = tmp_path_factory.mktemp("graded")
    subs = tmp / "subs"
    for lab in LABS:
        for nb in sorted(EXAMPLES.glob(f"*/{lab}/{lab}.ipynb")):
            (subs / nb.parent.parent.name / lab).mkdir(parents=True)
            shutil.copyfile(nb, subs / nb.parent.parent.name / lab / nb.name)
    env = _env(slurm)
    cache = ["--compile-cache", str(tmp / "cache"), "--timeout", TIMEOUT]
    t0 = time.monotonic()
    submit = subprocess.run(["bash", str(SUBMIT), str(subs), "--out", str(tmp / "slurm"),
                             "--shards", str(SHARDS), "--cpus", "1", "--", *cache],
                            capture_output=True, text=True, env=env, timeout=600)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    parts = tmp / "slurm.parts"
    fill, array, merge = (parts / "jobs").read_text().split()
    deadline, jobs = time.monotonic() + WAIT_S, {}
    while time.monotonic() < deadline:
        jobs = {name: _scontrol(job, env) for name, job in
                (("fill", fill), ("array", array), ("merge", merge))}
        if all(r and all(t.get("JobState") in ENDED for t in r) for r in jobs.values()):
            break
        time.sleep(5)
    else:
        subprocess.run(["scancel", fill, array, merge], env=env, timeout=30)
        pytest.fail(f"the jobs did not end in {WAIT_S} s: "
                    + str({n: [t.get("JobState") for t in r] for n, r in jobs.items()}))
    slurm_s = time.monotonic() - t0
    t1 = time.monotonic()
    one = subprocess.run(["bash", str(GRADE_SH), str(subs), "-j", "2", "--out", str(tmp / "one"),
                          "--work", str(tmp / "work-one"), *cache],
                         capture_output=True, text=True, env=env, timeout=WAIT_S)
    return {"tmp": tmp, "subs": subs, "parts": parts, "jobs": jobs, "submit": submit,
            "ids": (fill, array, merge), "one": one, "slurm_s": slurm_s,
            "one_s": time.monotonic() - t1, "env": env}


def _log(runs, name: str) -> str:
    path = runs["parts"] / "logs" / f"{name}.out"
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path})"


@real
def test_the_fill_the_array_and_the_merge_ran_one_after_the_other(runs):
    """Three jobs: the fill, SHARDS array tasks (each after the fill, each its slice by
    name), the merge after them all; every one COMPLETED with exit 0."""
    jobs = runs["jobs"]
    fill = runs["ids"][0]
    for name, records in jobs.items():
        for r in records:
            assert (r["JobState"], r["ExitCode"]) == ("COMPLETED", "0:0"), \
                (name, r.get("ArrayTaskId"), _log(runs, name if name != "array" else
                                                  f"shard-{r.get('ArrayTaskId')}"))
    tasks = sorted(int(r["ArrayTaskId"]) for r in jobs["array"])
    assert tasks == list(range(1, SHARDS + 1))
    assert all(r["Dependency"] == "(null)" or fill in r["Dependency"] for r in jobs["array"])
    when = {name: [r["StartTime"] for r in records] + [r["EndTime"] for r in records]
            for name, records in jobs.items()}  # ISO times: compared as text
    fill_end = max(r["EndTime"] for r in jobs["fill"])
    assert all(r["StartTime"] >= fill_end for r in jobs["array"]), when
    assert jobs["merge"][0]["StartTime"] >= max(r["EndTime"] for r in jobs["array"]), when
    students = sorted(p.name for p in runs["subs"].iterdir())
    for i in tasks:
        run = json.loads((runs["parts"] / f"shard-{i}" / "run.json").read_text())
        assert run["shard"] == [i, SHARDS]
        assert {c["state"] for c in run["compile_cache"].values()} == {"reused"}, run
        graded = json.loads((runs["parts"] / f"shard-{i}" / "results.json").read_text())
        want = [s for s in students if shard_of(s, SHARDS) == i
                and (runs["env"].get("MINICKPT_SANDBOX") != "off" or not s.startswith("attack_"))]
        assert sorted({r["student"] for r in graded}) == want
    fill_run = json.loads((runs["parts"] / "fill" / "run.json").read_text())
    assert {lab: c["state"] for lab, c in fill_run["compile_cache"].items()} == \
        dict.fromkeys(LABS, "filled")


VOLATILE = [
    (re.compile(r"minickpt-lab-[a-z0-9_]{8}"), "minickpt-lab-XXXXXXXX"),  # a lab's mkdtemp
    (re.compile(r"\btmp[a-z0-9_]{8}\b"), "tmpXXXXXXXX"),  # tempfile's names
    (re.compile(r"\bfd \d+\b"), "fd N"),  # lab 2's crash states name the fd of each call
    (re.compile(r"\n\s*\n"), "\n"),  # a kernel's output may end in an empty line, or not,
    (re.compile(r"\s+</pre>"), "</pre>"),  # and in its last newline, or not
]
"""What differs between two grade.sh runs over the same folder on one machine too (two runs
of four of lab 2's examples: the messages, summaries and feedback pages of three of them):
compared without it, and only where the bytes differ."""


def _stable(text: str) -> str:
    for pattern, same in VOLATILE:
        text = pattern.sub(same, text)
    return text


@real
def test_the_merged_results_equal_one_grade_sh_run_file_by_file(runs):
    """Every file of the merge's --out is the single run's: grades.csv, grades-<lab>.csv,
    class-summary*, similarity-<lab>.*, summary.txt, results.json, every feedback page, byte
    for byte or, where a run's own temp names, fd numbers or a kernel output's trailing newlines
    differ (VOLATILE, as between two single runs), equal without those; the logs are the same
    files (their text holds times and pids); run.json the same labs and isolation."""
    one = runs["one"]
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    top = {d: runs["tmp"] / d for d in ("slurm", "one")}
    merged, single = _files(top["slurm"]), _files(top["one"])
    assert sorted(set(merged) - NOT_COMPARED) == sorted(set(single) - NOT_COMPARED)
    assert any(name.startswith("feedback/") for name in merged)
    assert any(name.startswith("similarity-") for name in merged)
    compared = [name for name in merged if name not in NOT_COMPARED
                and not name.startswith("logs/")]
    volatile = [name for name in compared if merged[name] != single[name]]
    differ = [name for name in volatile
              if _stable((top["slurm"] / name).read_text(encoding="utf-8"))
              != _stable((top["one"] / name).read_text(encoding="utf-8"))]
    print(f"compared {len(compared)} files: {len(compared) - len(volatile)} byte for byte, "
          f"{len(volatile) - len(differ)} without VOLATILE ({', '.join(volatile) or 'none'}), "
          f"{len(differ)} different")
    assert differ == [], differ
    a, b = (json.loads((top[d] / "run.json").read_text()) for d in ("slurm", "one"))
    assert a["labs"] == b["labs"] and a["isolation"] == b["isolation"]
    assert a["shard"] is None and len(a["merged_from"]) == SHARDS


@real
def test_throughput_is_reported(runs):
    """autograder/slurm/throughput.py over the run: per lab submissions per core-minute, the
    course's core-hours, the cores the tasks held; printed (docs/slurm.md's figures)."""
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "python"),
                           str(ROOT / "autograder" / "slurm" / "throughput.py"),
                           str(runs["parts"])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    graded = len(json.loads((runs["tmp"] / "slurm" / "results.json").read_text()))
    assert re.search(rf"^\| \*\*course\*\* \| {graded} \|", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^array: {SHARDS} task\(s\) held", proc.stdout, re.M), proc.stdout
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"slurm: {graded} submissions in {runs['slurm_s']:.0f} s wall (fill, {SHARDS} tasks "
          f"of 1 core on {os.cpu_count()} cores, merge; jobs {' '.join(runs['ids'])}); "
          f"one grade.sh -j 2: {runs['one_s']:.0f} s; load average {' '.join(load)}")


# ---------------------------------------------------------------------------------------
# submit.sh's wiring, against a fake sbatch that records what it was asked (always run)
# ---------------------------------------------------------------------------------------
FAKE_SBATCH = """#!/usr/bin/env bash
n=$(( $(wc -l < "$SBATCH_LOG" 2>/dev/null || echo 0) + 101 ))
printf '%s\\0' "$@" | base64 -w0 >> "$SBATCH_LOG"; echo >> "$SBATCH_LOG"
echo "$n;cluster"
"""


def _fake(tmp_path: Path) -> dict[str, str]:
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "sbatch").write_text(FAKE_SBATCH)
    (bin_ / "sbatch").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}",
            "SBATCH_LOG": str(tmp_path / "sbatch.log")}


def _calls(tmp_path: Path) -> list[list[str]]:
    import base64

    return [base64.b64decode(line).decode().split("\0")[:-1]
            for line in (tmp_path / "sbatch.log").read_text().splitlines()]


def _class(tmp_path: Path) -> Path:
    subs = tmp_path / "class"
    for student, lab in (("ada", "lab01_basics"), ("bo", "lab01_basics"), ("bo", "lab03_resume")):
        (subs / student / lab).mkdir(parents=True)
        (subs / student / lab / f"{lab}.ipynb").write_text("{}")
    return subs


def test_submit_chains_fill_array_and_merge(tmp_path):
    """The fill gets a --lab per lab of the class; the array N tasks after the fill (afterany:
    a failed fill only costs time); the merge after every task (afterok), cancelled when one
    fails; every job its log in RESULTS.parts/logs; grade.sh's options reach fill and tasks."""
    subs = _class(tmp_path)
    proc = subprocess.run(["bash", str(SUBMIT), str(subs), "--out", str(tmp_path / "res"),
                           "--shards", "3", "--cpus", "2", "--sbatch", "--partition=p --time=9",
                           "--", "--timeout", "30"],
                          capture_output=True, text=True, env=_fake(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fill, array, merge = _calls(tmp_path)
    parts = str(tmp_path / "res.parts")
    for call in (fill, array, merge):
        assert {"--parsable", "--partition=p", "--time=9", f"--chdir={parts}"} <= set(call)
    assert "--cpus-per-task=2" in fill and "--cpus-per-task=2" in array
    assert fill[-8:] == [str(ROOT), parts, "--lab", "lab01_basics", "--lab", "lab03_resume",
                         "--timeout", "30"]
    assert fill[-9].endswith("fill-cache.sbatch")
    assert {"--array=1-3", "--dependency=afterany:101", f"--output={parts}/logs/shard-%a.out"
            } <= set(array)
    assert array[-6:] == [str(ROOT), str(subs), parts, "3", "--timeout", "30"]
    assert array[-7].endswith("grade-shard.sbatch")
    assert {"--dependency=afterok:102", "--kill-on-invalid-dep=yes",
            f"--output={parts}/logs/merge.out"} <= set(merge)
    assert merge[-4:] == [str(ROOT), parts, "3", str(tmp_path / "res")]
    assert (tmp_path / "res.parts" / "jobs").read_text().split() == ["101", "102", "103"]
    assert "squeue -j 101,102" in proc.stdout


@pytest.mark.parametrize("args, says", [
    (["--", "--out", "x"], "set by submit.sh"),
    (["--", "-j", "4"], "set by submit.sh"),
    (["--shards", "0"], "positive number"),
    (["--bogus"], "unknown option"),
])
def test_submit_refuses_what_it_would_get_wrong(tmp_path, args, says):
    """Options that would clash with the array's own (--out, -j) or make no sense are refused
    before anything is submitted, with the reason."""
    subs = _class(tmp_path)
    proc = subprocess.run(["bash", str(SUBMIT), str(subs), "--out", str(tmp_path / "res"), *args],
                          capture_output=True, text=True, env=_fake(tmp_path), timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "sbatch.log").exists()


def test_submit_never_empties_a_folder_it_did_not_write(tmp_path):
    """--out holding someone's files, or a RESULTS.parts not made by submit.sh: refused."""
    subs = _class(tmp_path)
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "mine.txt").write_text("keep")
    proc = subprocess.run(["bash", str(SUBMIT), str(subs), "--out", str(tmp_path / "res")],
                          capture_output=True, text=True, env=_fake(tmp_path), timeout=120)
    assert proc.returncode == 2 and "did not write" in proc.stderr
    (tmp_path / "other.parts").mkdir()
    (tmp_path / "other.parts" / "x").write_text("keep")
    proc = subprocess.run(["bash", str(SUBMIT), str(subs), "--out", str(tmp_path / "other")],
                          capture_output=True, text=True, env=_fake(tmp_path), timeout=120)
    assert proc.returncode == 2 and "not made by submit.sh" in proc.stderr
    assert (tmp_path / "res" / "mine.txt").read_text() == "keep"
    assert (tmp_path / "other.parts" / "x").read_text() == "keep"
    assert not (tmp_path / "sbatch.log").exists()
