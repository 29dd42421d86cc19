"""Crash-safety figures for minickpt: crash points, post-crash states, kills, damage, hostile
input, full disks, concurrent writers. The same harness as the tests (tests/crash_harness.py).

    .venv/bin/python scripts/crash_report.py              # CI sizes, about a minute
    .venv/bin/python scripts/crash_report.py --scale 10   # 10x random states, kills, churn
    .venv/bin/python scripts/crash_report.py --json       # the figures as JSON

Exits 1, listing what went wrong, if anything did.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from typing import Any
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 4 CPU devices, as in the tests: multi-process (sharded) saves need several
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

import crash_harness as h  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=1, help="multiply random states, kills, churn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.getLogger("minickpt").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")
    figs: dict[str, Any] = {}
    failures: list[str] = []
    t_all = time.perf_counter()

    def section(name: str) -> None:
        if not args.json:
            print(f"\n== {name}", flush=True)

    def row(label: str, value: Any) -> None:
        figs[label] = value
        if not args.json:
            print(f"  {label:<52} {value}", flush=True)

    with tempfile.TemporaryDirectory() as tmp, h.scratch(os.path.join(tmp, "mem")) as mem:
        section("every crash point (a power cut before each file-system call)")
        tried = survived = states = distinct = 0
        for i, scn in enumerate(h.SCENARIOS):
            f = h.explore_scenario(scn, os.path.join(mem, f"s{i}"),
                                   random_states=4 * args.scale, seed=args.seed)
            tried, survived = tried + f.crash_points, survived + f.survived
            states, distinct = states + f.states, distinct + f.distinct_states
            failures += f.failures
            if not args.json:
                print(f"  {scn.name:<70} {f.survived}/{f.crash_points} points, "
                      f"{f.states} states ({f.distinct_states} distinct)")
        row("crash points tried", tried)
        row("crash points survived", survived)
        row("post-crash states checked", states)
        row("distinct post-crash states checked", distinct)
        caught = 0
        for name, (target, broken, scn, symptom) in h.MUTATIONS.items():
            with mock.patch(target, broken):
                f = h.explore_scenario(scn, os.path.join(mem, "mut"), random_states=4)
            ok = any(symptom in x for x in f.failures)
            caught += ok
            if not ok:
                failures.append(f"the harness missed a broken library: {name}")
        row("broken libraries the harness catches", f"{caught}/{len(h.MUTATIONS)}")

        section("real SIGKILLs of a process saving in a loop")
        with h.Zygote() as zyg:
            k = h.kill_drill(zyg, os.path.join(tmp, "kill", "run"), kills=20 * args.scale,
                             seed=args.seed + 7)
            failures += k.failures
            row("SIGKILLs", k.kills)
            row("SIGKILLs survived (latest valid, exact, nothing lost)", k.survived)
            row("  of which interrupted a save or a delete", k.mid_save)

            section("concurrency")
            for mode in ("refuse", "serialise", "nolock"):
                d = os.path.join(tmp, f"two-{mode}")
                os.makedirs(d)
                wrong = h.two_writers(zyg, d, mode)
                failures += [f"two writers ({mode}): {w}" for w in wrong]
                row(f"two writers, {mode}: never interleaved", "yes" if not wrong else "NO")
            d = os.path.join(tmp, "churn")
            os.makedirs(d)
            out, wrong = h.reader_under_churn(zyg, d, 3.0 * args.scale, seed=args.seed + 3)
            failures += [f"reader under churn: {w}" for w in wrong]
            row("restores while a writer saved and deleted (all exact)", out["restored"])
            row("  clean not-found (step deleted under the reader)", out["not found"])

        def damage(cases: list[Any], template: str, tag: str, note: str = "") -> str:
            det = 0
            for i, case in enumerate(cases):
                wrong = h.check_damage(case, template, os.path.join(tmp, f"{tag}{i}"))
                det += not wrong
                failures.extend(f"damage '{case.name}'{note}: {w}" for w in wrong)
            return f"{det}/{len(cases)}"

        section("damage (verify, restore, fallback, CLI)")
        tpl = os.path.join(tmp, "template")
        h.build_run(tpl)
        row("damage cases detected and named", damage(h.DAMAGE, tpl, "d"))
        stpl = os.path.join(tmp, "template-sharded")
        h.build_sharded_run(stpl)
        row("  to multi-process checkpoints (format 2)",
            damage(h.SHARDED_DAMAGE, stpl, "ds", " (multi-process)"))

        section("hostile checkpoints (nothing runs, nothing outside read or written)")
        refused = ignored = skipped = 0
        cases = [(c, tpl) for c in h.HOSTILE] + [(c, stpl) for c in h.SHARDED_HOSTILE]
        for i, (case, template) in enumerate(cases):
            try:
                wrong = h.check_hostile(case, template, os.path.join(tmp, f"h{i}"))
            except h.SkipCase:
                skipped += 1
                continue
            refused += case.refused and not wrong
            ignored += (not case.refused) and not wrong
            failures += [f"hostile '{case.name}': {w}" for w in wrong]
        row("hostile inputs refused (multi-process ones included)",
            f"{refused}/{sum(c.refused for c, _ in cases)}")
        row("hostile inputs ignored harmlessly", f"{ignored}/"
            f"{sum(not c.refused for c, _ in cases)}")
        if skipped:
            row("hostile cases this machine cannot build", skipped)

        section("full disks and I/O errors")
        n = h.save_call_count()
        injected = clean = 0
        for err in (errno.ENOSPC, errno.EIO):
            for persistent in (False, True):
                for k_ in range(n):
                    wrong = h.check_save_fault(os.path.join(mem, f"f{err}{persistent}{k_}"),
                                               k_, err, persistent=persistent)
                    if wrong == ["the fault was never reached"]:
                        continue
                    injected += 1
                    clean += not wrong
                    failures += [f"{errno.errorcode[err]} at call {k_}: {w}" for w in wrong]
        row("I/O errors injected (ENOSPC, EIO; once or for good)", injected)
        row("I/O errors handled cleanly", clean)
        injected = clean = 0
        ctpl = os.path.join(tmp, "template-sharded-12")  # steps 1 and 2; the save is step 3
        h.build_sharded_run(ctpl, (1, 2))
        for err in (errno.ENOSPC, errno.EIO):
            for proc in range(h.SHARD_PROCESSES):
                n = h.collective_save_call_count(ctpl, os.path.join(mem, "count"), proc)
                for k_ in range(n):
                    reached, wrong = h.check_collective_save_fault(
                        ctpl, os.path.join(mem, f"c{err}{proc}{k_}"), proc, k_, err)
                    injected += reached
                    clean += reached and not wrong
                    failures += [f"{errno.errorcode[err]} at call {k_} of process {proc}'s "
                                 f"part of a multi-process save: {w}" for w in wrong]
        row("I/O errors injected into multi-process saves", injected)
        row("  handled cleanly (every process raises the errno)", clean)
        for kind in ("tmpfs", "ext4"):
            try:
                with h.small_filesystem(kind, os.path.join(tmp, f"mnt-{kind}"),
                                        size_mb=2 if kind == "tmpfs" else 4) as mnt:
                    wrong, met = h.check_real_full_disk(mnt)
                failures += [f"real full {kind}: {w}" for w in wrong]
                row(f"a really full {kind}", f"errno {errno.errorcode.get(met, met)}, "
                    + ("handled cleanly" if not wrong else "NOT clean"))
            except h.SkipCase as e:
                row(f"a really full {kind}", f"skipped: {e}")
    row("seconds", round(time.perf_counter() - t_all, 1))
    if args.json:
        print(json.dumps({"figures": figs, "failures": failures}, indent=1))
    elif failures:
        print(f"\n{len(failures)} FAILURES:")
        for f in failures[:50]:
            print("  " + f)
    else:
        print("\nall passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
