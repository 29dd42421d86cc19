"""What grading costs, from a finished ``submit.sh`` run (or any ``grade.sh --out`` folders).

    .venv/bin/python autograder/slurm/throughput.py RESULTS.parts [--students 500]

Per lab: the submissions graded, the core-seconds each took (``timings.csv``: one submission is
one kernel, about one core, from its start to its grade), submissions per core-minute, and the
compilation cache's fill (``fill/run.json``); then what a course of ``--students`` students
handing in every lab costs in core-hours. From the array's logs (``logs/shard-I.out``: each
task's grade.sh seconds and -j), what the tasks held: cores x seconds, set-up and idle slots
included, against the kernels' own seconds. Reads only the grader's and the jobs' own files.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path


def gather(folders: list[Path]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per submission per lab (every ``timings.csv`` below the folders, the grader's
    ``_reference`` rows left out) and each lab's fill seconds (every ``run.json``)."""
    seconds: dict[str, list[float]] = {}
    fills: dict[str, float] = {}
    for folder in folders:
        for path in sorted(folder.rglob("timings.csv")):
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    if not row["student"].startswith("_"):
                        seconds.setdefault(row["lab"], []).append(float(row["seconds"]))
        for path in sorted(folder.rglob("run.json")):
            caches = json.loads(path.read_text()).get("compile_cache", {})
            for lab, c in caches.items():
                if "fill_seconds" in c:
                    fills[lab] = max(fills.get(lab, 0.0), float(c["fill_seconds"]))
    return seconds, fills


TASK_LINE = re.compile(r"^grade-shard: slice \d+/\d+ on \S+ with -j (\d+)|"
                       r"^grade-shard: slice \d+/\d+: grade\.sh exited \d+ after (\d+) s", re.M)


def held(folders: list[Path]) -> tuple[int, float, float]:
    """Array tasks found, core-seconds they held (-j x grade.sh's seconds) and the kernels'
    seconds in those tasks' slices."""
    tasks, cores_s, kernels_s = 0, 0.0, 0.0
    for folder in folders:
        for log in sorted(folder.glob("logs/shard-*.out")):
            jobs = secs = None
            for m in TASK_LINE.finditer(log.read_text(errors="replace")):
                jobs = int(m[1]) if m[1] else jobs
                secs = float(m[2]) if m[2] else secs
            timings = folder / log.stem / "timings.csv"
            if jobs is None or secs is None or not timings.exists():
                continue
            with open(timings, newline="") as f:
                kernels_s += sum(float(r["seconds"]) for r in csv.DictReader(f))
            tasks, cores_s = tasks + 1, cores_s + jobs * secs
    return tasks, cores_s, kernels_s


def report(seconds: dict[str, list[float]], fills: dict[str, float], students: int) -> str:
    """A Markdown table per lab and the course's cost in core-hours."""
    lines = ["| lab | graded | core-s per submission: mean (median) | submissions per core-minute "
             f"| cache fill (s) | {students} students (core-h) |", "|---|---|---|---|---|---|"]
    total = 0.0
    for lab, secs in sorted(seconds.items()):
        mean = statistics.fmean(secs)
        hours = (students * mean + fills.get(lab, 0.0)) / 3600
        total += hours
        lines.append(f"| {lab} | {len(secs)} | {mean:.1f} ({statistics.median(secs):.1f}) | "
                     f"{60 / mean:.2f} | {fills.get(lab, 0.0):.0f} | {hours:.1f} |")
    lines.append(f"| **course** | {sum(map(len, seconds.values()))} | | | | **{total:.1f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path,
                   help="RESULTS.parts of submit.sh, or grade.sh --out folders")
    p.add_argument("--students", type=int, default=500)
    a = p.parse_args(argv)
    seconds, fills = gather(a.folders)
    if not seconds:
        print(f"throughput: no timings.csv below {', '.join(map(str, a.folders))}",
              file=sys.stderr)
        return 2
    print(report(seconds, fills, a.students))
    tasks, cores_s, kernels_s = held(a.folders)
    if tasks:
        print(f"\narray: {tasks} task(s) held {cores_s:.0f} core-s for {kernels_s:.0f} s of "
              f"kernels: x{cores_s / kernels_s:.2f} (set-up, and slots idle at a slice's end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
