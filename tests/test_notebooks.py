"""The course notebooks: each chapter runs top to bottom, and every notebook is in order
(Colab badge, set-up cell, plain-text pair in sync, no committed outputs)."""

from __future__ import annotations

import os
import shutil
import sys
import time
import types
from pathlib import Path

import nbformat
import pytest

# One execution per chapter per commit, shared with the site build (scripts/site.py); the
# repository root is on sys.path (pyproject: pythonpath).
from scripts import chapter_cache
from scripts import notebooks as tool

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


run_notebook = chapter_cache.run_notebook


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
def test_chapter_runs_top_to_bottom(path, record_property):
    # Executed once per commit (scripts/chapter_cache.py), in a fresh folder, and shared with
    # the site build: whichever of the two asks first executes, the other waits and reads.
    run = chapter_cache.execute(path)
    if run.failure:
        pytest.fail(run.failure, pytrace=False)
    record_property("seconds", run.seconds)
    record_property("cached", run.cached)
    nb = run.notebook

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), \
        f"{path.name} ran but drew no figure; every chapter has at least one"
    text = "".join(o.get("text", "") for o in outputs)
    assert "4 CPU device(s)" in text or "GPU" in text or "TPU" in text, \
        "the set-up cell should have given JAX several CPU devices on this machine"


# ---------------------------------------------------------------------------------------
# the shared execution: once per commit, whoever asks first
# ---------------------------------------------------------------------------------------
def _cache_repo(tmp_path: Path, code: str) -> tuple[Path, Path]:
    root = tmp_path / "repo"
    (root / "chapters").mkdir(parents=True)
    (root / "minickpt").mkdir()
    (root / "minickpt" / "__init__.py").write_text("VERSION = 1\n")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A"),
                                         nbformat.v4.new_code_cell(code)])
    path = root / "chapters" / "01_tiny.ipynb"
    nbformat.write(nb, path)
    return root, path


@pytest.mark.timeout(240)
def test_a_chapter_executes_once_per_commit_and_a_second_reader_waits_for_it(tmp_path):
    import threading

    root, path = _cache_repo(tmp_path, "import time\ntime.sleep(1)\nprint('ran', 6 * 7)")
    folder = tmp_path / "cache"
    runs: list = []

    def ask() -> None:
        runs.append(chapter_cache.execute(path, root=root, folder=folder))

    workers = [threading.Thread(target=ask) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=200)
    assert len(runs) == 2 and all(r.failure is None for r in runs), runs
    assert sorted(r.cached for r in runs) == [False, True], \
        "two readers at once must execute the chapter once: one executes, the other waits"
    assert "ran 42" in runs[0].notebook.cells[1].outputs[0]["text"]
    assert runs[0].path == runs[1].path and runs[0].path.parent == folder

    # while another process executes it, a reader that will not wait is told so
    with chapter_cache._locked(folder / "01_tiny.lock", wait=True):
        assert chapter_cache.execute(path, root=root, folder=folder, wait=False) is None

    # a change to the library is a new commit: executed again, the old copy dropped
    old = runs[0].path
    (root / "minickpt" / "__init__.py").write_text("VERSION = 2\n")
    again = chapter_cache.execute(path, root=root, folder=folder)
    assert not again.cached and again.key != runs[0].key and not old.exists()


@pytest.mark.timeout(240)
def test_a_failed_chapter_is_cached_as_the_message_naming_its_cell(tmp_path):
    root, path = _cache_repo(tmp_path, "x = 1\nraise ValueError('chapter broke')")
    folder = tmp_path / "cache"
    first = chapter_cache.execute(path, root=root, folder=folder)
    assert first.failure and not first.cached and first.notebook is None
    assert "chapters/01_tiny.ipynb: cell 2" in first.failure and "chapter broke" in first.failure
    second = chapter_cache.execute(path, root=root, folder=folder)
    assert second.cached and second.failure.startswith(first.failure)
    assert "delete it to execute" in second.failure


def test_a_chapter_run_under_other_versions_is_not_reused(tmp_path, monkeypatch):
    """scripts/versions.sh runs the chapters at the floors and at the newest releases, with
    the same pyproject.toml and constraints.txt: a chapter executed under the pinned jax must
    not pass for one executed under another."""
    root, path = _cache_repo(tmp_path, "print(1)")
    here = chapter_cache.key(path, root)
    real = chapter_cache._installed
    monkeypatch.setattr(chapter_cache, "_installed",
                        lambda name: "0.6.2" if name == "jax" else real(name))
    assert chapter_cache.key(path, root) != here
