"""The course notebooks: each chapter runs top to bottom, and every notebook is in order
(Colab badge, set-up cell, plain-text pair in sync, no committed outputs)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import time
import types
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython tracebacks
CELL_TIMEOUT_S = 180  # JAX compiles on first use; no single cell should come near this


def _load_tool() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("course_notebooks",
                                                  ROOT / "scripts" / "notebooks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


tool = _load_tool()


# ---------------------------------------------------------------------------------------
# every notebook in order
# ---------------------------------------------------------------------------------------
def test_there_are_chapter_notebooks():
    assert CHAPTERS, "no notebooks in chapters/: the notebook checks below would prove nothing"


def test_every_notebook_has_badge_setup_cell_and_synced_pair():
    problems = [msg for nb in tool.notebooks(ROOT) for msg in tool.check(nb, ROOT)]
    assert not problems, "notebooks out of order:\n" + "\n".join(problems)


def _mini_repo(tmp_path: Path) -> Path:
    """A copy of the parts of the repository the tool reads, to break on purpose."""
    root = tmp_path / "repo"
    (root / "chapters").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", root)
    shutil.copy(ROOT / "chapters" / "jupytext.toml", root / "chapters")
    for suffix in (".ipynb", ".py"):
        shutil.copy(CHAPTERS[0].with_suffix(suffix), root / "chapters")
    return root


def _problems(root: Path) -> list[str]:
    return [msg for nb in tool.notebooks(root) for msg in tool.check(nb, root)]


def test_check_finds_each_kind_of_problem_and_fix_repairs_it(tmp_path):
    root = _mini_repo(tmp_path)
    name = CHAPTERS[0].name
    ipynb, py = root / "chapters" / name, (root / "chapters" / name).with_suffix(".py")
    assert _problems(root) == []

    nb = nbformat.read(ipynb, as_version=4)
    del nb.cells[0]  # the badge
    nb.cells[-1].source += "\n\nAn extra sentence only in the .ipynb."
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    nbformat.write(nb, ipynb)
    problems = "\n".join(_problems(root))
    assert "Colab badge" in problems
    assert "set-up cell" in problems  # the set-up cell is now cell 1, not cell 2
    assert "have outputs" in problems
    assert "differ" in problems and name.removesuffix(".ipynb") + ".py" in problems

    assert tool.main(["--root", str(root)]) == 0
    assert _problems(root) == []
    assert "An extra sentence only in the .ipynb." in py.read_text()  # the newer file won

    # an edit made in the .py (the newer file) is carried into the .ipynb
    py.write_text(py.read_text().replace("# # Chapter", "# # Edited chapter", 1))
    os.utime(py, (time.time() + 5, time.time() + 5))
    assert any("differ" in p for p in _problems(root))
    assert tool.main(["--root", str(root)]) == 0
    assert "# Edited chapter" in "".join(c.source for c in nbformat.read(ipynb, 4).cells)


def test_solution_badge_points_at_the_released_lab_and_labs_are_only_checked(tmp_path):
    root = _mini_repo(tmp_path)
    lab = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Lab 9"),
                                          nbformat.v4.new_code_cell("x = 1")])
    for folder in ("solutions", "labs"):
        (root / folder / "lab09_x").mkdir(parents=True)
        nbformat.write(lab, root / folder / "lab09_x" / "lab09_x.ipynb")
    assert tool.main(["--root", str(root)]) == 1  # labs/ is generated: the tool leaves it
    solution = nbformat.read(root / "solutions" / "lab09_x" / "lab09_x.ipynb", 4)
    assert "/blob/main/labs/lab09_x/lab09_x.ipynb" in solution.cells[0].source
    assert solution.cells[2].source == "# Lab 9"
    problems = _problems(root)
    assert problems and all(p.startswith("labs/") and "nbgrader" in p for p in problems)


def test_repository_url_is_declared_once_and_used_by_badge_and_install_cell():
    url = tool.repo_url(ROOT)
    nb = tool.Notebook(Path("chapters/01_basics.ipynb"), True, True, True)
    assert f"colab.research.google.com/github/{url.removeprefix('https://github.com/')}/" \
        in tool.badge_source(nb, url)
    assert f"git+{url}" in tool.setup_source(url)


def _run_setup_cell(monkeypatch, *, colab: bool) -> list[list[str]]:
    calls: list[list[str]] = []
    fake_subprocess = types.SimpleNamespace(run=lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setitem(sys.modules, "subprocess", fake_subprocess)
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(tool.setup_source(tool.repo_url(ROOT)), {})
    return calls


def test_setup_cell_installs_the_course_package_only_on_colab(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert _run_setup_cell(monkeypatch, colab=False) == []
    # and it asked for several CPU devices without dropping the flags already there
    assert os.environ["XLA_FLAGS"] == ("--xla_cpu_enable_fast_math=false "
                                       "--xla_force_host_platform_device_count=4")
    calls = _run_setup_cell(monkeypatch, colab=True)
    assert len(calls) == 1, "on Colab the set-up cell must run pip exactly once"
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert f"minickpt[colab] @ git+{tool.repo_url(ROOT)}" in cmd


# ---------------------------------------------------------------------------------------
# every chapter runs top to bottom
# ---------------------------------------------------------------------------------------
def run_notebook(nb: nbformat.NotebookNode, cwd: Path, name: str) -> str | None:
    """Execute ``nb`` in place, top to bottom, in a fresh ``python3`` kernel (this venv's).

    Returns None, or a message naming the first cell that failed and its error. The kernel gets
    no device flags from this test process: the notebook's own set-up cell must provide them,
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


@pytest.mark.timeout(120)
def test_a_failing_cell_is_named(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("x = 2\nraise RuntimeError('boom')"),
                                         nbformat.v4.new_code_cell("never = True")])
    failure = run_notebook(nb, tmp_path, "broken.ipynb")
    assert failure is not None
    assert "broken.ipynb: cell 3" in failure and "starting 'x = 2'" in failure
    assert "RuntimeError" in failure and "boom" in failure
    assert nb.cells[3].outputs == [] and nb.cells[3].execution_count is None  # stopped there


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_runs_top_to_bottom(path, tmp_path, record_property):
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    failure = run_notebook(nb, tmp_path, str(path.relative_to(ROOT)))
    if failure:
        pytest.fail(failure, pytrace=False)
    record_property("seconds", round(time.perf_counter() - t0, 1))

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), \
        f"{path.name} ran but drew no figure; every chapter has at least one"
    text = "".join(o.get("text", "") for o in outputs)
    assert "4 CPU device(s)" in text or "GPU" in text or "TPU" in text, \
        "the set-up cell should have given JAX several CPU devices on this machine"
