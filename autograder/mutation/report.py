"""The mutation report: ``docs/mutation-report.md`` for people, ``docs/mutation-report.json`` for
the CI check (``tests/test_mutation_report.py``), written from the workers' results and from
``equivalent.toml``.

A task counts as covered only when every one of its mutants has a result and those results were
measured on the task's current code and tests (the digest the worker recorded equals today's):
the report never shows a stale run as current. CI recomputes each digest and fails when a task's
reference or test cells changed after its report, without re-running a mutant.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import mutants as M

EQUIVALENT = Path(__file__).with_name("equivalent.toml")
DOCS = M.ROOT / "docs"
JSON_PATH = DOCS / "mutation-report.json"
MD_PATH = DOCS / "mutation-report.md"


def equivalents() -> dict[str, str]:
    """Mutant id -> the one line saying why no user could tell it from the reference."""
    if not EQUIVALENT.exists():
        return {}
    data = tomllib.loads(EQUIVALENT.read_text(encoding="utf-8"))
    return {k: v["why"] for k, v in data.get("mutants", {}).items()}


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def task_entry(task: str, cache: Path, why: dict[str, str], *, any_digest: bool = False
               ) -> dict[str, Any]:
    """One task's line of the report (see the module docstring for "covered"). With
    ``any_digest`` results measured on older code count too: only for "before" totals."""
    ms = M.task_mutants(task)
    recs = _records(cache / f"{task}.jsonl")
    digest = M.task_digest(task)
    results, under = {}, None  # a result counts under the baseline before it, of today's digest
    for r in recs:
        if "baseline" in r:
            under = r.get("digest")
        elif "id" in r and (any_digest or under == digest):
            results[r["id"]] = r
    entry: dict[str, Any] = {
        "lab": M.lab_of(task), "functions": [f.__name__ for f in M.task_functions(task)],
        "tests": M.test_cells(task), **digest, "mutants": len(ms), "killed": 0,
        "timeouts": 0, "equivalent": [], "survivors": [], "not_run": 0,
    }
    for m in ms:
        r = results.get(m.id)
        if r is None:
            entry["not_run"] += 1
        elif r["status"] == "killed":
            entry["killed"] += 1
            entry["timeouts"] += r.get("by") in ("time-out", "crash")
        elif m.id in why:
            entry["equivalent"].append({"id": m.id, "mutant": m.describe(), "why": why[m.id]})
        else:
            entry["survivors"].append({"id": m.id, "mutant": m.describe()})
    entry["covered"] = entry["not_run"] == 0
    return entry


def _totals(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    t = {"mutants": 0, "killed": 0, "equivalent": 0, "survivors": 0, "not_run": 0}
    for e in entries:
        t["mutants"] += e["mutants"]
        t["killed"] += e["killed"]
        t["equivalent"] += len(e["equivalent"])
        t["survivors"] += len(e["survivors"])
        t["not_run"] += e["not_run"]
    return t


def before_totals(folder: Path, why: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per-lab totals of the results kept in ``folder`` (copies of the first runs' files, taken
    before the tests that killed their survivors were written), counted from the records
    themselves: those mutants were measured on the code of that day."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        task = path.name[:-len(".jsonl")]
        t = out.setdefault(M.lab_of(task), {"mutants": 0, "killed": 0, "equivalent": 0,
                                            "survivors": 0, "not_run": 0})
        for r in _records(path):
            if "id" not in r:
                continue
            t["mutants"] += 1
            if r["status"] == "killed":
                t["killed"] += 1
            elif r["id"] in why:
                t["equivalent"] += 1
            else:
                t["survivors"] += 1
    return out


def build(cache: Path, mark_before: bool = False) -> dict[str, Any]:
    """The report as data; ``before`` is carried over from the committed report unless
    ``mark_before`` makes today's per-lab totals the new "before"."""
    from minickpt.labkit.plugging import reference_functions

    why = equivalents()
    tasks = {t: task_entry(t, cache, why) for t in reference_functions()}
    labs: dict[str, dict[str, int]] = {}
    for lab in sorted({e["lab"] for e in tasks.values()}):
        labs[lab] = _totals(e for e in tasks.values() if e["lab"] == lab)
    old = json.loads(JSON_PATH.read_text(encoding="utf-8")) if JSON_PATH.exists() else {}
    before = old.get("before", {})
    if mark_before:
        before = before_totals(cache.parent / "mutation-before", why)
    known = {m.id for t in tasks for m in M.task_mutants(t)}
    return {"tool": "cosmic-ray 8.7 operators (curated pairs) + autograder/mutation/operators.py",
            "command": "python -m autograder.mutation --task X.Y (then --report)",
            "before": before, "labs": labs, "tasks": tasks,
            "stale_equivalents": sorted(set(why) - known)}


def markdown(rep: dict[str, Any]) -> str:
    """The report for people: per lab and per task, then every survivor and equivalent."""
    lines = ["# Mutation report", "",
             "Written by `python -m autograder.mutation` (see `autograder/mutation/`); do not edit.",
             "Each task's reference functions are mutated with cosmic-ray's operators and this",
             "harness's own (`autograder/mutation/operators.py`); each mutant runs through the",
             "task's test cells, visible and hidden, with `run_tests` (the judge's runner).",
             "A mutant is *killed* when one of those tests fails or it runs past its time bound.",
             "*Equivalent* mutants are listed in `autograder/mutation/equivalent.toml` with why no",
             "user could tell them apart. A task is *covered* when every mutant has a result",
             "measured on its current code and tests; `not run` counts the rest.",
             "*Before* is each task's first run, before the tests written for its survivors",
             "(issue 48: labs 1, 2 and 5 were first run through a stand-in of the judge's",
             "runner with the same cells and plugging, before the judge landed; labs 4 and 6",
             "were first run on their test cells of that day, before issue 48's tests for them).", "",
             "## Per lab", "",
             "| lab | mutants | killed | equivalent | survivors | not run | before (killed/equivalent/survivors) |",
             "|---|---|---|---|---|---|---|"]
    for lab, t in rep["labs"].items():
        b = rep["before"].get(lab)
        bt = f"{b['killed']}/{b['equivalent']}/{b['survivors']}" if b else "—"
        lines.append(f"| {lab} | {t['mutants']} | {t['killed']} | {t['equivalent']} | "
                     f"{t['survivors']} | {t['not_run']} | {bt} |")
    lines += ["", "## Per task", "",
              "| task | functions | mutants | killed (time-outs) | equivalent | survivors | not run |",
              "|---|---|---|---|---|---|---|"]
    for task, e in rep["tasks"].items():
        lines.append(f"| {task} | {', '.join(e['functions'])} | {e['mutants']} | "
                     f"{e['killed']} ({e['timeouts']}) | {len(e['equivalent'])} | "
                     f"{len(e['survivors'])} | {e['not_run']} |")

    lines += ["", "## Survivors", ""]
    any_s = False
    for task, e in rep["tasks"].items():
        for s in e["survivors"]:
            any_s = True
            lines.append(f"- **{task}** `{s['id']}`: {s['mutant']}")
    if not any_s:
        lines.append("None among the tasks run.")
    lines += ["", "## Equivalent mutants", ""]
    for task, e in rep["tasks"].items():
        for s in e["equivalent"]:
            lines.append(f"- **{task}** `{s['id']}`: {s['mutant']}. *Why:* {s['why']}")
    not_cov = [t for t, e in rep["tasks"].items() if not e["covered"]]
    lines += ["", "## Not covered", "",
              ", ".join(not_cov) if not_cov else "Every task is covered.", ""]
    return "\n".join(lines)


def write(cache: Path, mark_before: bool = False) -> dict[str, Any]:
    rep = build(cache, mark_before)
    JSON_PATH.write_text(json.dumps(rep, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    MD_PATH.write_text(markdown(rep), encoding="utf-8")
    return rep
