"""``python -m benchmarks``: run the suite, print the table, write JSON, Markdown and a plot."""

from __future__ import annotations

import argparse
import os
import re
import sys

README_START = "<!-- benchmarks:start -->"
README_END = "<!-- benchmarks:end -->"


def update_readme(readme: str, table_md: str) -> None:
    """Replace the performance page's table (between the two markers) with this run's."""
    with open(readme) as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme} has no {README_START} ... {README_END} section to update")
    new = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END),
                 lambda _m: f"{README_START}\n{table_md.rstrip()}\n{README_END}", text,
                 flags=re.S)
    with open(readme, "w") as f:
        f.write(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 2 repetitions: checks the harness in seconds")
    p.add_argument("--out", default="bench-out", help="where results.json, table.md and "
                   "scaling.png go (default: bench-out/)")
    p.add_argument("--dir", default="", help="where checkpoints are written (default: a "
                   "fresh folder under --out, on the same disk); removed afterwards")
    p.add_argument("--only", nargs="*", default=(), metavar="FIGURE",
                   choices=["tiny", "leaves200", "leaves100k", "trainstate", "large", "items", "huge",
                            "memory",
                            "scaling",
                            "async", "multihost"], help="run only these figures (leaves100k, 100,000 small leaves, runs only "
                        "when named here: Orbax needs minutes a save there)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of the small figures")
    p.add_argument("--reps-huge", type=int, default=None,
                   help="repetitions of the huge rows (default 3); on a file system whose "
                        "speed drifts (9p), more give the interleaved medians a chance")
    p.add_argument("--async-rounds", type=int, default=None,
                   help="rounds of each async throughput figure (default 5); the figure is "
                        "their median")
    p.add_argument("--large-mb", type=int, default=None, help="size of the large state in MB")
    p.add_argument("--huge-mb", type=int, nargs="*", default=None, metavar="MB",
                   help="sizes of the huge rows in MB (default 1 GiB and 2000 MB; none in "
                        "--smoke; give no size to skip them)")
    p.add_argument("--many-leaves", type=int, default=None,
                   help="leaves of the many-small-leaves figure (default 100000)")
    p.add_argument("--no-orbax", action="store_true", help="leave Orbax out")
    p.add_argument("--no-managers", action="store_true",
                   help="leave the CheckpointManager rows out")
    p.add_argument("--no-fio", action="store_true",
                   help="skip fio: the large rows' limit is the suite's probe (labelled so)")
    p.add_argument("--no-cold", action="store_true", help="leave the cold-cache rows out")
    p.add_argument("--drop-caches", action="store_true",
                   help="evict with the global drop_caches (root only; empties every user's "
                        "cache) instead of per-file posix_fadvise")
    p.add_argument("--async", dest="run_async", choices=["auto", "on", "off"], default="auto",
                   help="async figures: auto = when minickpt has AsyncCheckpointer")
    p.add_argument("--multihost", dest="run_multihost", choices=["auto", "on", "off"],
                   default="auto", help="multi-host figures: auto = when minickpt.multihost "
                                        "exists")
    p.add_argument("--update-readme", metavar="PAGE", nargs="?", const="docs/performance.md",
                   help="write this run's table into the performance page's table "
                        "(docs/performance.md; the README's headline table is kept by hand), and "
                        "its plot and raw numbers to benchmarks/latest/")
    a = p.parse_args(argv)

    from .suite import Config, print_report, run, write_outputs

    kw = dict(out=a.out, workdir=a.dir, only=tuple(a.only), orbax=not a.no_orbax,
              fio=not a.no_fio,
              managers=not a.no_managers, cold=not a.no_cold,
              evict="drop_caches" if a.drop_caches else "fadvise", run_async=a.run_async,
              run_multihost=a.run_multihost)
    if a.reps is not None:
        kw["reps_small"] = a.reps
    if a.reps_huge is not None:
        kw["reps_huge"] = a.reps_huge
    if a.async_rounds is not None:
        kw["async_rounds"] = a.async_rounds
    if a.large_mb is not None:
        kw["large_bytes"] = kw["memory_bytes"] = kw["async_bytes"] = a.large_mb * 10**6
    if a.huge_mb is not None:
        kw["huge_sizes"] = tuple(mb * 10**6 for mb in a.huge_mb)
    if a.many_leaves is not None:
        kw["many_leaves"] = a.many_leaves
    cfg = Config.smoke(**kw) if a.smoke else Config.full(**kw)
    res = run(cfg)
    paths = write_outputs(res, a.out)
    print_report(res)
    print("\nwrote " + ", ".join(paths.values()))
    if a.update_readme:
        with open(paths["readme"]) as f:
            update_readme(a.update_readme, f.read())
        latest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "latest")
        os.makedirs(latest, exist_ok=True)
        import shutil

        for key, name in (("json", "results.json"), ("markdown", "table.md"),
                          ("plot", "scaling.png")):
            dest = os.path.join(latest, name)
            if key in paths and os.path.abspath(paths[key]) != os.path.abspath(dest):
                shutil.copyfile(paths[key], dest)  # --out benchmarks/latest: already there
        print(f"updated the Performance section of {a.update_readme} and {latest}/")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
