#!/usr/bin/env python3
"""Execute each chapter once per commit, and share that execution.

The test suite (``tests/test_notebooks.py``) and the site (``scripts/site.py``) both need every
chapter executed top to bottom. Executing a chapter costs a minute or more on a 2-core machine,
so it is done once and kept: the executed ``.ipynb`` goes to a cache folder (``.cache/chapters/``,
or ``$MINICKPT_CHAPTER_CACHE``) under a key that hashes everything the outputs depend on:

* the chapter notebook itself,
* every source file of ``minickpt`` (what the chapter imports),
* the environment (``pyproject.toml``, ``constraints.txt``, the Python version, the installed
  versions of what the chapters import — ``scripts/versions.sh`` runs them in environments
  that ``constraints.txt`` does not describe — and ``JAX_PLATFORMS``), and this file (how the
  chapter is executed).

A different commit of any of these is a different key, so a stale output is never reused. A
chapter that fails is cached too, as the message that names the failing cell: the second
reader of the same commit fails with the same message instead of paying for the run again
(delete the cache folder to retry a failure you believe was chance).

Two processes may ask for the same chapter at once (pytest-xdist runs the notebook tests and the
site test on different workers): a per-chapter file lock makes the second one wait and then read
what the first one wrote. :func:`execute_all` takes the chapters nobody else is executing first,
so two workers split the chapters between them rather than queue on one.

    .venv/bin/python scripts/chapter_cache.py            # execute (or reuse) every chapter
    .venv/bin/python scripts/chapter_cache.py --status   # which chapters are cached
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython tracebacks
CELL_TIMEOUT_S = 180  # JAX compiles on first use; no single cell should come near this
ENV_FILES = ("pyproject.toml", "constraints.txt")
IMPORTED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes",
            "matplotlib", "msgpack", "isal")


def cache_dir(root: Path = ROOT) -> Path:
    """Where executed chapters are kept: ``$MINICKPT_CHAPTER_CACHE`` or ``<root>/.cache/chapters``."""
    env = os.environ.get("MINICKPT_CHAPTER_CACHE")
    return Path(env) if env else root / ".cache" / "chapters"


def chapters(root: Path = ROOT) -> list[Path]:
    return sorted((root / "chapters").glob("*.ipynb"))


def key(chapter: Path, root: Path = ROOT) -> str:
    """The hash of everything a chapter's outputs depend on (see the module docstring)."""
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    add("chapter", chapter.read_bytes())
    for f in sorted((root / "minickpt").rglob("*.py")):
        add(f.relative_to(root).as_posix(), f.read_bytes())
    for name in ENV_FILES:
        f = root / name
        add(name, f.read_bytes() if f.exists() else b"")
    add("executor", Path(__file__).read_bytes())
    add("python", sys.version.encode())
    add("installed", " ".join(f"{n}={_installed(n)}" for n in IMPORTED).encode())
    add("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "").encode())
    return h.hexdigest()[:20]


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


# ---------------------------------------------------------------------------------------
# executing one notebook
# ---------------------------------------------------------------------------------------
def run_notebook(nb: nbformat.NotebookNode, cwd: Path, name: str) -> str | None:
    """Execute ``nb`` in place, top to bottom, in a fresh ``python3`` kernel (this venv's).

    Returns None, or a message naming the first cell that failed and its error. The kernel gets
    no device flags from this process: the notebook's own set-up cell must provide them,
    exactly as for a reader.
    """
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with client.setup_kernel(env=env):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, index)
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
                first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
                return (f"{name}: cell {index + 1} (id {cell.get('id')}, starting {first!r}) "
                        f"failed:\n{ANSI.sub('', str(e))}")
    return None


# ---------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------
@dataclass
class Execution:
    """One chapter's execution: the executed notebook, or the message naming the failed cell."""

    chapter: Path
    key: str
    notebook: nbformat.NotebookNode | None
    failure: str | None
    seconds: float  # how long the execution took (when it ran, not when it was read back)
    cached: bool  # read from the cache rather than executed by this call
    path: Path | None  # the executed .ipynb in the cache (None on failure)


@contextlib.contextmanager
def _locked(lock: Path, wait: bool) -> Iterator[bool]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _read(chapter: Path, k: str, folder: Path) -> Execution | None:
    stem = chapter.stem
    done, failed = folder / f"{stem}-{k}.ipynb", folder / f"{stem}-{k}.failed.json"
    if done.exists():
        nb = nbformat.read(done, as_version=4)
        seconds = float(nb.metadata.get("minickpt_cache", {}).get("seconds", 0.0))
        return Execution(chapter, k, nb, None, seconds, True, done)
    if failed.exists():
        record = json.loads(failed.read_text(encoding="utf-8"))
        message = (f"{record['failure']}\n(cached failure, {failed}: delete it to execute "
                   "the chapter again)")
        return Execution(chapter, k, None, message, float(record["seconds"]), True, None)
    return None


def execute(chapter: Path, *, root: Path = ROOT, folder: Path | None = None,
            wait: bool = True) -> Execution | None:
    """The chapter executed at this commit: from the cache, or executed now and cached.

    With ``wait=False``, returns None at once if another process is executing this chapter.
    """
    chapter = chapter.resolve()
    folder = folder or cache_dir(root)
    k = key(chapter, root)
    with _locked(folder / f"{chapter.stem}.lock", wait) as got:
        if not got:
            return None
        found = _read(chapter, k, folder)
        if found is not None:
            return found
        nb = nbformat.read(chapter, as_version=4)
        name = chapter.relative_to(root).as_posix() if chapter.is_relative_to(root) \
            else chapter.name
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"{chapter.stem}-") as cwd:
            failure = run_notebook(nb, Path(cwd), name)
        seconds = round(time.perf_counter() - t0, 1)
        for old in folder.glob(f"{chapter.stem}-*"):  # older commits' executions
            old.unlink(missing_ok=True)
        if failure:
            _write_atomic(folder / f"{chapter.stem}-{k}.failed.json",
                          json.dumps({"failure": failure, "seconds": seconds}))
            return Execution(chapter, k, None, failure, seconds, False, None)
        nb.metadata["minickpt_cache"] = {"key": k, "seconds": seconds}
        done = folder / f"{chapter.stem}-{k}.ipynb"
        _write_atomic(done, nbformat.writes(nb))
        return Execution(chapter, k, nb, None, seconds, False, done)


def execute_all(paths: list[Path], *, root: Path = ROOT, folder: Path | None = None,
                log: Callable[[str], None] = print) -> list[Execution]:
    """Every chapter executed (or read back), one at a time, in the order of ``paths``.

    Chapters another process is executing right now are left for a second pass (which waits for
    them and reads what that process wrote), so two processes split the work.
    """
    results: dict[Path, Execution] = {}
    for wait in (False, True):
        for p in paths:
            if p in results:
                continue
            t0 = time.perf_counter()
            r = execute(p, root=root, folder=folder, wait=wait)
            if r is None:
                log(f"{p.name}: being executed by another process; coming back to it")
                continue
            how = "cached" if r.cached else "executed"
            waited = time.perf_counter() - t0
            log(f"{p.name}: {how} ({r.seconds:.1f} s to execute"
                + (f", {waited:.1f} s here)" if r.cached and waited > 1 else ")")
                + (" FAILED" if r.failure else ""))
            results[p] = r
    return [results[p] for p in paths]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--status", action="store_true", help="say which chapters are cached")
    a = p.parse_args(argv)
    paths = chapters()
    if a.status:
        for c in paths:
            k = key(c)
            state = _read(c, k, cache_dir())
            print(f"{c.name}: " + ("not cached" if state is None else
                                   "cached (failed)" if state.failure else "cached"))
        return 0
    failed = [r for r in execute_all(paths) if r.failure]
    for r in failed:
        print(r.failure, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
