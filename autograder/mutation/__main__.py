"""Mutation testing of the labs' tests: ``python -m autograder.mutation --task 1.4``.

    python -m autograder.mutation --task 1.4 [--task 2.3 ...]   run those tasks' mutants
    python -m autograder.mutation --lab 1                        every task of lab 1
    python -m autograder.mutation --report                       rewrite the report only
    python -m autograder.mutation --mark-before --report         keep today's totals as "before"

Results go to ``.cache/mutation/<task>.jsonl`` (ignored); ``--report`` (implied after a run)
writes ``docs/mutation-report.md`` and ``docs/mutation-report.json`` from them and from
``autograder/mutation/equivalent.toml``. One worker process at a time (``--timeout`` bounds
each mutant; a mutant past it is killed, and a fresh worker goes on with the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import mutants as M
from . import report as R

CACHE = M.ROOT / ".cache" / "mutation"


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def stale(out: Path, task: str) -> bool:
    """Whether the results file ``out`` holds a run measured on other code or tests than
    today's (a baseline of another digest): those results say nothing of today's mutants, and
    a run that skipped them as done would leave them standing."""
    digest = M.task_digest(task)
    return any("baseline" in r and r.get("digest") != digest for r in _records(out))


def run_task(task: str, timeout: float, setup_timeout: float, fresh: bool) -> None:
    """Run every mutant of ``task`` not yet in its results file, one worker at a time; a
    file measured on other code or tests is started afresh."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / f"{task}.jsonl"
    if out.exists() and (fresh or stale(out, task)):
        out.unlink()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "PYTHONPATH": str(M.ROOT)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(M.ROOT / ".cache" / "jax-compile"))
    while True:
        recs = _records(out)
        done = {r["id"] for r in recs if "id" in r}
        listing = CACHE / f"{task}.done"
        listing.write_text("\n".join(sorted(done)))
        n_before = len(done)
        proc = subprocess.Popen([sys.executable, "-m", "autograder.mutation.worker", task,
                                 str(out), str(listing)], cwd=M.ROOT, env=env,
                                start_new_session=True)
        started_at, current = time.monotonic(), None
        timed_out = None
        while proc.poll() is None:
            time.sleep(0.5)
            recs = _records(out)
            last = recs[-1] if recs else {}
            if "start" in last:
                if current != last["start"]:
                    current, started_at = last["start"], time.monotonic()
                if time.monotonic() - started_at > timeout:
                    timed_out = current
            elif current is None and time.monotonic() - started_at > setup_timeout:
                timed_out = "(setup)"
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        if timed_out == "(setup)":
            raise SystemExit(f"{task}: the worker did not finish its setup in {setup_timeout} s")
        recs = _records(out)
        last = recs[-1] if recs else {}
        if "start" in last:  # the worker died (time-out, crash, os._exit) inside a mutant
            why = f"ran past {timeout:g} s" if timed_out else f"the process died (rc {proc.returncode})"
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"id": last["start"], "status": "killed", "by": "time-out"
                                    if timed_out else "crash", "message": why,
                                    "seconds": timeout if timed_out else None}) + "\n")
            continue
        if proc.returncode == 3:
            base = next((r for r in reversed(recs) if "baseline" in r), {})
            raise SystemExit(f"{task}: the reference fails its own tests: {base}")
        done = {r["id"] for r in _records(out) if "id" in r}
        if proc.returncode != 0 and len(done) == n_before:
            raise SystemExit(f"{task}: the worker failed (rc {proc.returncode}) before any mutant")
        if proc.returncode == 0:
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.mutation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", action="append", default=[], help="a task id, e.g. 1.4")
    p.add_argument("--lab", action="append", default=[], help="every task of lab N")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one mutant may run")
    p.add_argument("--setup-timeout", type=float, default=900.0)
    p.add_argument("--fresh", action="store_true", help="forget earlier results of these tasks")
    p.add_argument("--report", action="store_true", help="(re)write the report")
    p.add_argument("--mark-before", action="store_true",
                   help="record the current totals as the report's 'before' column")
    a = p.parse_args(argv)
    tasks = list(a.task)
    if a.lab:
        from minickpt.labkit.plugging import reference_functions

        tasks += [t for t in reference_functions() if t.split(".")[0] in a.lab]
    failed = []
    for task in tasks:
        print(f"mutation: task {task}", flush=True)
        try:
            run_task(task, a.timeout, a.setup_timeout, a.fresh)
        except SystemExit as e:  # this task cannot be measured: say so, go on with the others
            print(f"mutation: {e}", flush=True)
            failed.append(task)
    if tasks or a.report or a.mark_before:
        R.write(CACHE, mark_before=a.mark_before)
    if failed:
        print(f"mutation: not measured: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
