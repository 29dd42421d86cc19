#!/usr/bin/env python3
"""Build the course site into ``site/_build/html`` (what ``bash scripts/site.sh`` runs).

1. Every chapter executed, once per commit: read from the cache that the test suite fills
   (``scripts/chapter_cache.py``), or executed now, one at a time. A chapter that fails stops
   the build with the message naming its cell.
2. The generated pages written under ``site/`` (ignored by git): ``chapters/`` the executed
   chapters, ``labs/<lab>/`` the released labs exactly as students receive them (``labs/``, never
   executed: no solution, no hidden test), each with a plain-text ``.py`` next to it and a line
   of links at its top (Colab, the plain-text source, the repository) in place of the badge.
3. Sphinx (myst-nb with execution off, sphinx-book-theme), one process.

    .venv/bin/python scripts/site.py [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
GENERATED = ("chapters", "labs", "api")  # under site/, written by this build (git-ignored)


try:  # imported from the repository's root (the tests: pytest puts it on sys.path)
    from scripts import chapter_cache, notebooks  # notebooks: the badge's Colab URL, the repo URL
except ImportError:  # run as a script: python scripts/site.py puts scripts/ on sys.path
    import chapter_cache  # type: ignore[no-redef]
    import notebooks  # type: ignore[no-redef]


def colab_url(nb: notebooks.Notebook, url: str) -> str:
    """The Colab link of the notebook's own badge (scripts/notebooks.py writes it)."""
    m = re.search(r'href="([^"]+)"', notebooks.badge_source(nb, url))
    assert m, "scripts/notebooks.py's badge has no link"
    return m.group(1)


def links_cell(nb: notebooks.Notebook, url: str, text_file: str, repo_file: Path) -> nbformat.NotebookNode:
    blob = f"{url}/blob/{notebooks.BRANCH}/{repo_file.as_posix()}"
    cell = nbformat.v4.new_markdown_cell(
        ":::{container} course-links\n"
        f"[Open in Colab]({colab_url(nb, url)}) ·\n"
        f"{{download}}`Plain-text source ({text_file}) <{text_file}>` ·\n"
        f"[{repo_file.as_posix()} in the repository]({blob})\n"
        ":::")
    cell["id"] = "course-links"
    return cell


def page(node: nbformat.NotebookNode, links: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook as a page: the title, the links in place of the badge, the set-up cell
    (folded: the same in every notebook), then the rest."""
    cells = [c for c in node.cells if c.get("id") != notebooks.BADGE_ID
             and "colab-badge.svg" not in c.source]
    setup = [c for c in cells if c.get("id") == notebooks.SETUP_ID
             or c.source.startswith(notebooks.SETUP_MARKER)]
    cells = [c for c in cells if c not in setup]
    for c in setup:
        c.metadata["tags"] = [*c.metadata.get("tags", []), "hide-input"]
    head: list[nbformat.NotebookNode] = []
    if cells and cells[0].cell_type == "markdown" and cells[0].source.lstrip().startswith("# "):
        title, _, rest = cells[0].source.lstrip().partition("\n")
        head = [nbformat.v4.new_markdown_cell(title)]
        head[0]["id"] = "course-title"
        cells[0].source = rest.lstrip("\n")
        if not cells[0].source.strip():
            cells.pop(0)
    node.cells = [*head, links, *setup, *cells]
    return node


def api_modules() -> list[str]:
    """The public modules: the ones ``site/api.md``'s autosummary table lists."""
    text = (SITE / "api.md").read_text(encoding="utf-8")
    return re.findall(r"^ {3}(minickpt[\w.]*)\s*$", text, flags=re.M)


def write_pages(executions: list, url: str) -> None:
    for d in GENERATED:
        shutil.rmtree(SITE / d, ignore_errors=True)
        (SITE / d).mkdir(parents=True)
    import minickpt

    top = ", ".join(n for n in minickpt.__all__ if not n.startswith("_"))
    for mod in api_modules():  # one page per public module, from its docstrings
        skip = f"   :exclude-members: {top}\n" if mod != "minickpt" else ""  # shown once
        (SITE / "api" / f"{mod}.rst").write_text(
            f"{mod}\n{'=' * len(mod)}\n\n.. automodule:: {mod}\n{skip}", encoding="utf-8")
    by_path = {nb.path: nb for nb in notebooks.notebooks(ROOT)}
    for run in executions:
        rel = run.chapter.relative_to(ROOT)
        nb = by_path[rel]
        shutil.copy(ROOT / nb.pair, SITE / "chapters" / nb.pair.name)
        node = page(nbformat.from_dict(run.notebook), links_cell(nb, url, nb.pair.name, nb.pair))
        nbformat.write(node, SITE / "chapters" / rel.name)
    for rel, nb in by_path.items():
        if rel.parts[0] != "labs":
            continue
        node = nbformat.read(ROOT / rel, as_version=4)
        where = SITE / rel  # labs/<lab>/<lab>.ipynb: the repository's relative links hold
        where.parent.mkdir(parents=True, exist_ok=True)
        text = rel.with_suffix(".py").name
        where.with_suffix(".py").write_text(jupytext.writes(node, fmt="py:percent"),
                                            encoding="utf-8")
        nbformat.write(page(node, links_cell(nb, url, text, rel)), where)


def build(out: Path, log=print) -> int:
    """Build the site into ``out``; returns the exit status (0: built)."""
    t0 = time.perf_counter()
    # Last chapter first: tests/test_notebooks.py asks for them first to last, so when both
    # run at once (pytest-xdist) each executes half and neither waits long for the other.
    runs = chapter_cache.execute_all(chapter_cache.chapters(ROOT)[::-1], root=ROOT,
                                     log=lambda m: log(f"site: {m}"))[::-1]
    failed = [r for r in runs if r.failure]
    if failed:
        for r in failed:
            log(f"site: a chapter failed to execute, so the site is not built:\n{r.failure}")
        return 1
    t1 = time.perf_counter()
    write_pages(runs, notebooks.repo_url(ROOT))
    warnings = out.parent / "sphinx-warnings.txt"
    shutil.rmtree(out, ignore_errors=True)  # no page of an earlier build may linger
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-j", "1", "-q", "-E",
           "-w", str(warnings), str(SITE), str(out)]
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    t2 = time.perf_counter()
    executed = sum(not r.cached for r in runs)
    log(f"site: chapters ready in {t1 - t0:.1f} s ({executed} executed, "
        f"{len(runs) - executed} from the cache); Sphinx {t2 - t1:.1f} s; "
        f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}/index.html")
    text = warnings.read_text(encoding="utf-8") if warnings.exists() else ""
    if text.strip():
        log(f"site: Sphinx warnings ({warnings}):\n{text.rstrip()}")
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=SITE / "_build" / "html")
    a = p.parse_args(argv)
    return build(a.out.resolve())


if __name__ == "__main__":
    sys.exit(main())
