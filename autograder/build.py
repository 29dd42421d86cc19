"""Build the labs: solution cells from minickpt, labs/ from solutions/, and the example
submissions from labs/. ``python -m autograder.build`` writes them; ``--check`` writes nothing
and fails (exit 1) when any committed file differs from what the build would write.

One source of truth for the reference solutions: the solution cell of task X.Y in
``solutions/<lab>/<lab>.ipynb`` (``grade_id`` ``task_X_Y``) is *generated* from the minickpt
functions whose docstrings start with ``"Task X.Y"``: their signature and docstring, then their
body between ``### BEGIN SOLUTION`` and ``### END SOLUTION``. Change the library and rebuild; a
solution cell edited by hand, or a library change without a rebuild, fails ``--check`` in CI.

The hints ``lab.hint("X.Y", level)`` shows come from ``solutions/hints/<lab>.md`` (outside the
lab's folder, so neither nbgrader nor the grader copies them anywhere) and are written,
compressed, into ``minickpt/labkit/hints_data.py``: every task of a lab must have both levels,
and its markdown must offer ``lab.hint("X.Y")`` instead of showing a hint.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import inspect
import os
import re
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat

from . import ROOT, tools_on_path
from .notebook_io import BEGIN, END, write_notebook

LAB_RE = re.compile(r"^lab\d\d_[a-z0-9_]+$")
TASK_CELL_RE = re.compile(r"^task_(\d+)_(\d+)$")
HINTS_DIR = "hints"
HINTS_MODULE = ROOT / "minickpt" / "labkit" / "hints_data.py"


def lab_names(solutions: Path) -> list[str]:
    """The labs: folders ``labNN_name`` of ``solutions/`` holding ``<lab>.ipynb``."""
    return sorted(p.name for p in solutions.iterdir()
                  if p.is_dir() and LAB_RE.match(p.name) and (p / f"{p.name}.ipynb").is_file())


# ---------------------------------------------------------------------------------------
# solution cells from minickpt
# ---------------------------------------------------------------------------------------
def render_function(fn: Callable[..., Any]) -> str:
    """A reference function as a solution: signature and docstring, then its body between
    the solution markers."""
    src = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(src).body[0]
    if not isinstance(node, ast.FunctionDef) or not node.body or not (
            isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)) or len(node.body) < 2:
        raise ValueError(f"{fn.__module__}.{fn.__qualname__}: a task function needs a docstring "
                         "and a body")
    lines = src.rstrip("\n").split("\n")
    head = lines[:node.body[0].end_lineno]
    body = lines[node.body[0].end_lineno:]
    indent = re.match(r"\s*", next(b for b in body if b.strip())).group(0)
    return "\n".join([*head, indent + BEGIN, *body, indent + END])


def render_task(task: str) -> str:
    from minickpt.labkit import reference_functions

    fns = reference_functions().get(task)
    if not fns:
        raise KeyError(f"no minickpt function has a docstring starting with 'Task {task}'")
    return "\n\n\n".join(render_function(fn) for fn in fns)


def sync_solutions(nb: Any, lab: str) -> Any:
    """Regenerate every task cell of a solution notebook; give every cell a stable id."""
    used: set[str] = set()
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        m = TASK_CELL_RE.match(meta.get("grade_id", ""))
        if m and meta.get("solution"):
            cell.source = render_task(f"{m.group(1)}.{m.group(2)}")
        if not cell.get("id") or cell["id"] in used:
            gid = meta.get("grade_id", "")
            cell["id"] = gid if gid and gid not in used else \
                hashlib.sha1(f"{lab}:{i}".encode()).hexdigest()[:8]
        used.add(cell["id"])
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


# ---------------------------------------------------------------------------------------
# the hints, encoded into the kit
# ---------------------------------------------------------------------------------------
def lab_tasks(nb: Any) -> list[str]:
    """The task IDs of a lab notebook, from its solution cells' grade ids."""
    out = []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        m = TASK_CELL_RE.match(meta.get("grade_id", ""))
        if m and meta.get("solution"):
            out.append(f"{m.group(1)}.{m.group(2)}")
    return out


def hints_module(solutions: Path, labs: list[str]) -> str:
    """The text of ``hints_data.py``: every lab's hints, checked against its tasks."""
    from minickpt.labkit.hints import encode_hints, parse_hints_md

    hints: dict[str, dict[int, str]] = {}
    for lab in labs:
        src = solutions / HINTS_DIR / f"{lab}.md"
        if not src.is_file():
            raise ValueError(f"{src}: missing (every task of {lab} needs two hints)")
        got = parse_hints_md(src.read_text(encoding="utf-8"), str(src))
        nb = nbformat.read(solutions / lab / f"{lab}.ipynb", as_version=4)
        tasks = lab_tasks(nb)
        if sorted(got) != sorted(tasks):
            raise ValueError(f"{src}: hints for tasks {sorted(got)}, but {lab} has tasks "
                             f"{sorted(tasks)}")
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        if "<details>" in text:
            raise ValueError(f"{lab}: a <details> block shows in the notebook's text; hints go "
                             f"in {src} and the lab offers lab.hint(...)")
        for t in tasks:
            if f'lab.hint("{t}")' not in text:
                raise ValueError(f'{lab}: task {t}\'s text does not offer lab.hint("{t}")')
        hints.update(got)
    blob = encode_hints(hints)
    lines = [blob[i:i + 96] for i in range(0, len(blob), 96)]
    return ('"""The hints of every lab task, compressed (written by ``python -m autograder.build``\n'
            'from ``solutions/hints/``; read them with ``lab.hint(task, level)``)."""\n\n'
            "BLOB = (\n" + "".join(f'    "{line}"\n' for line in lines) + ")\n")


# ---------------------------------------------------------------------------------------
# labs/ from solutions/ (nbgrader generate_assignment)
# ---------------------------------------------------------------------------------------
def generate_labs(solutions: Path, release: Path, labs: list[str]) -> None:
    """Run nbgrader's generate_assignment for ``labs`` into ``release`` (a throwaway
    gradebook: labs/ does not depend on one)."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    from .settings import configure

    with tempfile.TemporaryDirectory(prefix="minickpt-build-") as work:
        cfg = configure(Config(), work=work, source=str(solutions), release=str(release))
        cfg.Application.log_level = "WARN"
        api = NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)
        for lab in labs:
            res = api.generate_assignment(lab, force=True, create=True)
            if not res["success"]:
                raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n"
                                   f"{res.get('log', '')}\n{res.get('error', '')}")


# ---------------------------------------------------------------------------------------
# the build
# ---------------------------------------------------------------------------------------
def build(out: Path, *, solutions_in: Path) -> dict[str, Path]:
    """Write the synced solutions, the labs and the examples under ``out``; return the three
    folders."""
    from .make_examples import write_examples

    labs = lab_names(solutions_in)
    sol_out, labs_out, ex_out = out / "solutions", out / "labs", out / "examples"
    for lab in labs:
        nb = nbformat.read(solutions_in / lab / f"{lab}.ipynb", as_version=4)
        write_notebook(sync_solutions(nb, lab), sol_out / lab / f"{lab}.ipynb")
        for extra in sorted((solutions_in / lab).iterdir()):  # data files travel with the lab
            if extra.name != f"{lab}.ipynb" and not extra.name.startswith(".") and \
                    extra.name != "__pycache__":
                dest = sol_out / lab / extra.name
                (shutil.copytree if extra.is_dir() else shutil.copy2)(extra, dest)
    from .notebook import load_lab

    for lab in labs:  # what the grader needs of a lab (a setup cell, quiz checks that stand alone)
        load_lab(sol_out / lab / f"{lab}.ipynb")
    hints_out = out / "hints_data.py"
    hints_out.write_text(hints_module(solutions_in, labs), encoding="utf-8")
    generate_labs(sol_out, labs_out, labs)
    write_examples(labs_out, sol_out, ex_out)
    return {"solutions": sol_out, "labs": labs_out, "examples": ex_out, "hints": hints_out}


def _files(d: Path) -> dict[str, bytes]:
    if not d.is_dir():
        return {}
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts}


COMMITTED = {"solutions": ROOT / "solutions", "labs": ROOT / "labs",
             "examples": ROOT / "autograder" / "examples"}
# hand-written files beside the examples: the README and each lab's expected grades
EXAMPLE_EXTRA = frozenset({"README.md"} | {p.name for p in COMMITTED["examples"].glob("expected-*.csv")})


def compare(built: dict[str, Path]) -> list[str]:
    """Differences between the committed folders and a build, one line (plus a diff) each."""
    problems = []
    if "hints" in built:
        want, have = built["hints"].read_bytes(), \
            HINTS_MODULE.read_bytes() if HINTS_MODULE.is_file() else None
        if have is None:
            problems.append("minickpt/labkit/hints_data.py: missing (the build writes it)")
        elif want != have:
            problems.append("minickpt/labkit/hints_data.py: differs from the build (the hints in "
                            "solutions/hints/ changed)")
    for name, committed in COMMITTED.items():
        want, have = _files(built[name]), _files(committed)
        if name == "solutions":
            have = {k: v for k, v in have.items() if k.split(os.sep)[0] in
                    {p.split(os.sep)[0] for p in want}}
        if name == "examples":
            have = {k: v for k, v in have.items() if k not in EXAMPLE_EXTRA}
        for rel in sorted(set(want) | set(have)):
            if rel not in have:
                problems.append(f"{name}/{rel}: missing (the build writes it)")
            elif rel not in want:
                problems.append(f"{name}/{rel}: not written by the build (stale?)")
            elif want[rel] != have[rel]:
                diff = difflib.unified_diff(
                    have[rel].decode(errors="replace").splitlines(),
                    want[rel].decode(errors="replace").splitlines(),
                    f"committed/{rel}", f"built/{rel}", n=1, lineterm="")
                problems.append(f"{name}/{rel}: differs from the build\n" +
                                "\n".join(list(diff)[:40]))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.build", description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if solutions/, labs/, autograder/examples/ "
                        "or minickpt/labkit/hints_data.py differ from what the build writes")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tools_on_path()
    with tempfile.TemporaryDirectory(prefix="minickpt-build-") as tmp:
        built = build(Path(tmp), solutions_in=COMMITTED["solutions"])
        problems = compare(built)
        if a.check:
            for line in problems:
                print(line, file=sys.stderr)
            if problems:
                print(f"\n{len(problems)} file(s) out of date: run `python -m autograder.build` "
                      "and commit the result", file=sys.stderr)
                return 1
            print("solutions/, labs/, autograder/examples/ and the hints are up to date")
            return 0
        for name, committed in COMMITTED.items():
            keep = {committed / x for x in EXAMPLE_EXTRA} if name == "examples" else set()
            if name == "labs" or name == "examples":
                for old in sorted(committed.iterdir()) if committed.is_dir() else []:
                    if old not in keep:
                        shutil.rmtree(old) if old.is_dir() else old.unlink()
            for rel, data in _files(built[name]).items():
                dest = committed / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists() or dest.read_bytes() != data:
                    dest.write_bytes(data)
        hints = built["hints"].read_bytes()
        if not HINTS_MODULE.is_file() or HINTS_MODULE.read_bytes() != hints:
            HINTS_MODULE.write_bytes(hints)
        changed = [line.split(":")[0] for line in problems]
        print("updated: " + (", ".join(changed) if changed else "nothing (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
