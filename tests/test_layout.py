"""The library's layout: modules that read top-down (no circle of imports) and in one sitting
(no module over 800 lines), as COURSE.md sets them out (issue 51).

The import graph is built from the sources with :mod:`ast`, without importing anything, and
counts every import a module makes, at its top or inside a function: an import deferred into
a function still ties the two modules together (the circle ``format/buffers → format/spec →
tree → format/buffers`` went through one). A package's implicit import of its parents is not
an edge; ``from . import name`` is an edge to the submodule ``name`` where there is one, else
to the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minickpt"
MAX_LINES = 800


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each module of minickpt -> the modules of minickpt it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:
                        edges.add(sub)
                    elif target in mods:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_must():
    """The checker itself: it finds relative, absolute and deferred imports."""
    graph = import_graph()
    assert "minickpt.format.spec" in graph["minickpt.format.buffers"]
    assert "minickpt.format.buffers" in graph["minickpt.tree"]
    assert "minickpt.checkpointer" in graph["minickpt"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_of_imports_in_minickpt():
    found = cycles(import_graph())
    graph = import_graph()
    lines = [" -> ".join(c) + "\n    edges: " + "; ".join(
        f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, ("modules of minickpt import each other in a circle (so they cannot be "
                       "read top-down, and one of them sees the other half-initialised); "
                       "move what both need into the lower module:\n  " + "\n  ".join(lines))


# LEAD: remove after merging the split of labkit/lab4.py (issue 51, another branch), so that
# this test fails on that module too. Until then it is the one module allowed over the limit,
# and the test reports it as an expected failure (xfail) rather than passing silently.
_SPLIT_PENDING = "minickpt/labkit/lab4.py"


def test_no_module_over_800_lines():
    """Every module of minickpt/, labkit/ included: nothing is excluded."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p, _ in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    if set(long) == {_SPLIT_PENDING}:
        pytest.xfail(f"{_SPLIT_PENDING} ({long[_SPLIT_PENDING]} lines) is being split along "
                     "its tasks on another branch; nothing else is over the limit")
    assert not long, (f"modules over {MAX_LINES} lines (one concept per module, read in one "
                      f"sitting: split them along their concepts): {long}")
