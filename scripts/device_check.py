"""Run every chapter and lab solution on the accelerator JAX finds, and say how each went.

    JAX_PLATFORMS= bash scripts/device-check.sh --out table.md          # on a TPU/GPU machine
    JAX_PLATFORMS=cpu .venv/bin/python scripts/device_check.py --out t.md chapters/05_async.ipynb

One process per notebook, and no Jupyter kernel: a kernel talks to its client over TCP on
loopback, which some accelerator machines refuse (a TPU VM's container refuses every TCP
socket), and a kernel would hold the accelerator in a process of its own. Instead a fresh
interpreter executes the notebook's code cells in order, in one namespace, like "Run all"
without stopping at an error (so a cascade of errors shows, as it would for a reader who runs
on). ``%`` and ``!`` lines, where a notebook has any, get IPython-free stand-ins (``!cmd``
runs in a shell; ``%matplotlib`` and other magics are dropped and noted). Each notebook runs in
a fresh temporary folder (its ``chNN-work/``), with matplotlib's non-interactive backend.

The report is a Markdown table, one row per notebook: the platform it ran on, its error cells
(``cell N``: the cell's number in the notebook, as ``tests/test_notebooks.py`` counts, and the
first line of its error), the parts it skipped (its lines that start with ``skipped``), and its
verdicts that differ from the course's text; then, per notebook, every ``claim:`` and
``verdict:`` line it printed. ``--out`` writes it to a file too. The exit status is 1 when a
notebook has an error cell (or its process died), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 600  # no cell of a chapter comes near this on a laptop
SKIP = re.compile(r"^\s*skipped\b")
SAID = re.compile(r"^\s*(claim|verdict): ")


def _name(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def notebooks() -> list[Path]:
    """Every chapter and every lab solution, in course order."""
    return sorted(ROOT.glob("chapters/*.ipynb")) + sorted(ROOT.glob("solutions/*/*.ipynb"))


def cell_code(source: str) -> tuple[str, list[str]]:
    """The cell's source as plain Python, and notes on what was replaced: ``!cmd`` runs in a
    shell (``subprocess.run(cmd, shell=True)``), other ``%`` magics are dropped."""
    out, notes = [], []
    for line in source.splitlines():
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith("!"):
            out.append(f"{indent}__import__('subprocess').run({stripped[1:]!r}, shell=True)")
            notes.append(f"ran in a shell: {stripped[1:]}")
        elif stripped.startswith("%"):
            out.append(f"{indent}pass  # {stripped}")
            notes.append(f"dropped the magic {stripped.split()[0]}")
        else:
            out.append(line)
    return "\n".join(out) + "\n", notes


class _Tee(io.TextIOBase):
    """Writes through to the real stream and keeps a copy of the current cell's text."""

    def __init__(self, real: Any):
        self.real, self.buf = real, io.StringIO()

    def write(self, s: str) -> int:
        self.real.write(s)
        return self.buf.write(s)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:  # subprocess and faulthandler ask for it
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.real, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the cell ran longer than {CELL_TIMEOUT_S} s")


def run_notebook(path: Path, cell_timeout_s: int = CELL_TIMEOUT_S) -> dict[str, Any]:
    """Execute ``path``'s code cells in this process, in the current folder; what happened."""
    nb = json.loads(path.read_text())
    ns: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    result: dict[str, Any] = {"notebook": _name(path), "errors": [],
                              "skipped": [], "said": [], "notes": [], "cells": 0}
    t0 = time.monotonic()
    signal.signal(signal.SIGALRM, _timeout)
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if not source.strip():
            continue
        code, notes = cell_code(source)
        result["notes"] += [f"cell {index + 1}: {n}" for n in notes]
        result["cells"] += 1
        tee = _Tee(sys.stdout)
        filename = f"<{path.name} cell {index + 1}>"
        # as IPython does: inspect.getsource finds a cell's functions (lab 3's drill runs the
        # student's resume from its source in a worker)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        signal.alarm(cell_timeout_s)
        try:
            with contextlib.redirect_stdout(tee):
                exec(compile(code, filename, "exec"), ns)
        except BaseException as e:  # a cell's failure, whatever it is, is reported
            if isinstance(e, KeyboardInterrupt):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            result["errors"].append({"cell": index + 1, "error": f"{type(e).__name__}: {first}"})
            traceback.print_exc()
        finally:
            signal.alarm(0)
        for line in tee.buf.getvalue().splitlines():
            if SKIP.match(line):
                result["skipped"].append(line.strip())
            elif SAID.match(line):
                result["said"].append(line.strip())
        with contextlib.suppress(Exception):
            import matplotlib.pyplot as plt
            plt.close("all")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if "jax" in sys.modules:
        import jax
        devs = jax.devices()
        result["platform"] = f"{len(devs)} {devs[0].platform.upper()} ({devs[0].device_kind})"
    else:
        result["platform"] = "(no JAX)"
    return result


def run_in_process(path: Path, timeout_s: float, cell_timeout_s: int) -> dict[str, Any]:
    """Run one notebook in a fresh interpreter, in a fresh folder; its result, or why none."""
    with tempfile.TemporaryDirectory(prefix="device-check-") as work:
        out = Path(work) / "result.json"
        env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(path),
               "--json", str(out), "--cell-timeout", str(cell_timeout_s)]
        err_path = Path(work) / "stderr.txt"
        t0 = time.monotonic()
        with open(err_path, "w") as err:
            try:  # the notebook's output goes to this stdout; its stderr is kept for the report
                rc = subprocess.run(cmd, cwd=work, env=env, stdout=sys.stderr, stderr=err,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = None
        if out.exists():
            return json.loads(out.read_text())
        tail = err_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        why = (f"the process ran past {timeout_s:.0f} s" if rc is None
               else f"the process died (exit {rc}): {tail[0][:200]}")
        return {"notebook": _name(path), "platform": "?", "cells": 0,
                "errors": [{"cell": 0, "error": why}], "skipped": [], "said": [], "notes": [],
                "wall_s": round(time.monotonic() - t0, 1)}


def _cell(items: list[str]) -> str:
    return "<br>".join(i.replace("|", "\\|") for i in items) or "—"


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown report of :func:`run_notebook` results."""
    lines = ["| notebook | platform | cells | error cells | skipped | verdicts that differ | s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        errors = [f"cell {e['cell']}: {e['error'][:160]}" for e in r["errors"]]
        differ = [s[len("verdict: this run differs from "):][:160] for s in r["said"]
                  if s.startswith("verdict: this run differs")]
        lines.append(f"| {r['notebook']} | {r['platform']} | {r['cells']} | "
                     f"{_cell(errors) if errors else '0'} | {_cell(r['skipped'])} | "
                     f"{_cell(differ)} | {r['wall_s']} |")
    for r in results:
        lines += ["", f"### {r['notebook']}", ""]
        if not r["said"]:
            lines.append("no claim or verdict printed")
            continue
        lines += ["| # | printed |", "|---|---|"]
        lines += [f"| {i} | {_cell([s])} |" for i, s in enumerate(r["said"], 1)]
        lines += [f"\nnote: {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to run (default: every chapter and lab solution)")
    ap.add_argument("--out", type=Path, help="also write the Markdown report here")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds one notebook may take in all (default 1800)")
    ap.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT_S,
                    help=f"seconds one cell may take (default {CELL_TIMEOUT_S})")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)   # the per-notebook process
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one is not None:
        sys.path.insert(0, str(ROOT))
        result = run_notebook(a.one.resolve(), a.cell_timeout)
        a.json.write_text(json.dumps(result))
        return 0
    paths = [p.resolve() for p in a.notebooks] or notebooks()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    print(f"device check: {len(paths)} notebook(s), JAX_PLATFORMS="
          f"{os.environ.get('JAX_PLATFORMS', '')!r}", file=sys.stderr)
    results = []
    for p in paths:
        print(f"== {_name(p)}", file=sys.stderr)
        results.append(run_in_process(p, a.timeout, a.cell_timeout))
    report = table(results)
    if a.out is not None:
        a.out.write_text(report)
    print(report)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
