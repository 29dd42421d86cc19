"""The course machinery: labs built from solutions and minickpt, and the grader end to end.

Grading end to end (the examples, the hostile corpus, -j, shards) is in
tests/test_grading_hardening.py, one grade.sh run per lab that several tests read.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import ROOT, build
from autograder.grade import LabInfo, find_submissions, unpack_zip
from minickpt import labkit

SOLUTIONS, LABS, EXAMPLES_DIR = ROOT / "solutions", ROOT / "labs", ROOT / "autograder" / "examples"
LAB_NAMES = build.lab_names(SOLUTIONS)
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def cells(path: Path) -> list:
    return nbformat.read(path, as_version=4).cells


def grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


# ---------------------------------------------------------------------------------------
# the build: one source of truth
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def built(tmp_path_factory):
    from autograder import tools_on_path

    tools_on_path()
    return build.build(tmp_path_factory.mktemp("build"), solutions_in=SOLUTIONS)


def _assert_same(name: str, built_dir: Path, committed: Path, ignore: set[str] = frozenset()):
    want = build._files(built_dir)
    have = {k: v for k, v in build._files(committed).items() if k not in ignore}
    if name == "solutions":
        have = {k: v for k, v in have.items() if k.split(os.sep)[0] in LAB_NAMES}
    stale = sorted(set(have) ^ set(want)) + sorted(k for k in set(have) & set(want)
                                                    if have[k] != want[k])
    assert not stale, (f"{name}/ is out of date in {stale}: run `python -m autograder.build` "
                       "and commit the result")


def _body(fn) -> list[str]:
    """A function's lines after its docstring."""
    src = textwrap.dedent(inspect.getsource(fn))
    return src.split("\n")[ast.parse(src).body[0].body[0].end_lineno:]


def test_solution_cells_are_minickpts_own_code(built):
    """A library change without a rebuild, or a solution cell edited by hand, fails here."""
    _assert_same("solutions", built["solutions"], SOLUTIONS)
    for lab in LAB_NAMES:
        for cell in cells(SOLUTIONS / lab / f"{lab}.ipynb"):
            m = build.TASK_CELL_RE.match(grade_id(cell))
            if m:
                task = f"{m.group(1)}.{m.group(2)}"
                assert cell.source == build.render_task(task)
                for fn in labkit.reference_functions()[task]:
                    assert "\n".join(_body(fn)).strip("\n") in cell.source


def test_labs_are_what_nbgrader_generates_from_solutions(built):
    _assert_same("labs", built["labs"], LABS)
    assert sorted(p.name for p in LABS.iterdir()) == LAB_NAMES


def test_examples_are_up_to_date(built):
    _assert_same("examples", built["examples"], EXAMPLES_DIR, ignore=build.EXAMPLE_EXTRA)


def _region_lines(source: str, begin: str, end: str, *, inside: bool = True) -> list[str]:
    """The (stripped) lines between the markers, or with ``inside=False`` those outside."""
    out, within = [], False
    for line in source.split("\n"):
        if begin in line:
            within = True
        elif end in line:
            within = False
        elif within == inside:
            out.append(line.strip())
    return out


def test_no_solution_or_hidden_test_in_labs():
    texts = {p: p.read_text(errors="replace") for p in LABS.rglob("*") if p.is_file()}
    for path, text in texts.items():
        for marker in MARKERS:
            assert marker not in text, f"{path} contains {marker!r}"
    for lab in LAB_NAMES:
        released = "\n".join(c.source for c in cells(LABS / lab / f"{lab}.ipynb"))
        source_cells = cells(SOLUTIONS / lab / f"{lab}.ipynb")
        secrets: set[str] = set()
        for cell in source_cells:
            m = build.TASK_CELL_RE.match(grade_id(cell))
            if m:  # the reference functions' bodies, straight from minickpt
                for fn in labkit.reference_functions()[f"{m.group(1)}.{m.group(2)}"]:
                    secrets |= {b.strip() for b in _body(fn) if len(b.strip()) >= 12
                                and not b.strip().startswith("#")}
            secrets |= {s for s in _region_lines(cell.source, "BEGIN SOLUTION", "END SOLUTION")
                        if len(s) >= 6}
        shown = {s for c in source_cells
                 for s in _region_lines(c.source, "BEGIN HIDDEN", "END HIDDEN", inside=False)}
        for c in source_cells:  # hidden test lines that are not also visible somewhere
            secrets |= {s for s in _region_lines(c.source, "BEGIN HIDDEN", "END HIDDEN")
                        if len(s) >= 12 and s not in shown and not s.startswith("#")}
        assert secrets, "found nothing to look for: the check would be empty"
        leaked = sorted(s for s in secrets if s in released)
        assert not leaked, f"labs/{lab} shows solution code or hidden tests: {leaked[:5]}"


def test_every_task_of_every_lab_has_its_reference_and_its_tests():
    tasks = labkit.reference_functions()
    for lab in LAB_NAMES:
        ids = [grade_id(c) for c in cells(SOLUTIONS / lab / f"{lab}.ipynb")]
        for gid in ids:
            m = build.TASK_CELL_RE.match(gid)
            if m:
                task = f"{m.group(1)}.{m.group(2)}"
                assert task in tasks, f"{lab}: no minickpt function says 'Task {task}'"
                assert any(i.startswith(f"test_{m.group(1)}_{m.group(2)}_") for i in ids), \
                    f"{lab}: task {task} has no test cell test_{m.group(1)}_{m.group(2)}_*"
    for fns in tasks.values():
        for fn in fns:
            assert labkit.TASK_RE.match(inspect.getdoc(fn)), fn


# ---------------------------------------------------------------------------------------
# pieces of the machinery
# ---------------------------------------------------------------------------------------
def test_plugged_in_runs_the_students_function_inside_minickpt_and_puts_it_back(tmp_path):
    import jax.numpy as jnp

    import minickpt as mc
    from minickpt import tree
    from minickpt.format import encode

    ref = labkit.reference("plan_leaf")
    calls = []

    def plan_leaf(names, host):
        calls.append(names)
        return ref(names, host)

    with pytest.raises(RuntimeError, match="boom"), labkit.plugged_in(plan_leaf):
        assert encode.plan_leaf is plan_leaf
        mc.Checkpointer().save(tmp_path / "c", {"t": {"a": jnp.ones(2), "b": 3}})
        raise RuntimeError("boom")
    assert calls == [("a",), ("b",)]
    assert encode.plan_leaf is ref
    with pytest.raises(labkit.LabCheckError, match="own function"), labkit.plugged_in(ref):
        pass

    def restore_checkpoint(ckpt_dir, target, **kw):
        return "mine"

    with labkit.plugged_in(restore_checkpoint):  # bound by name in the package too
        assert mc.restore_checkpoint(tmp_path, None) == "mine"
    assert mc.restore_checkpoint(tmp_path / "none", 5) == 5
    assert tree.flatten_with_names is labkit.reference("flatten_with_names")


def test_checks_require_real_values_not_imposters():
    class Yes:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    assert not labkit.same(Yes(), "B") and labkit.same("B", "B")
    assert not labkit.same({Yes()}, {"A"}) and labkit.same({"A", "C"}, {"C", "A"})
    assert not labkit.close_to(True, 1.0, 0.1) and labkit.close_to(298, 300.0, 0.05)
    with pytest.raises(labkit.LabCheckError, match="msg"):
        labkit.check(1, "msg")  # truthy is not True
    with pytest.raises(labkit.LabCheckError, match="it raised KeyError"), \
            labkit.expect_raises(ValueError, "wanted ValueError"):
        raise KeyError("x")


def test_stubs_name_their_task_and_quiz_answers_stay_runnable():
    from nbformat.v4 import new_code_cell

    from autograder.preprocessors import TaskStubs

    pp = TaskStubs()
    task = new_code_cell('def f(x):\n    """Task 9.2 — f."""\n    ### BEGIN SOLUTION\n'
                         '    return x\n    ### END SOLUTION')
    assert pp._replace_solution_region(task, "python")
    assert task.source.endswith('    # YOUR CODE HERE\n    raise NotImplementedError("Task 9.2: f")')
    quiz = new_code_cell('### BEGIN SOLUTION\nQ3 = "D"\n### END SOLUTION')
    pp._replace_solution_region(quiz, "python")
    assert quiz.source == "Q3 = None  # YOUR ANSWER HERE"
    with pytest.raises(RuntimeError, match="task function"):
        pp._replace_solution_region(new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"),
                                    "python")


def test_submissions_are_found_in_folders_and_safe_zips(tmp_path):
    for student in ("ann", "bob", "../evil", ".hidden"):
        d = tmp_path / "subs" / "x" / student / "lab01_basics"
        d.mkdir(parents=True, exist_ok=True)
        (d / "lab01_basics.ipynb").write_text("{}")
    (tmp_path / "subs" / "x" / "ann" / "lab09_other").mkdir()
    (tmp_path / "subs" / "x" / "ann" / "lab09_other" / "lab09_other.ipynb").write_text("{}")
    subs, warnings = find_submissions(tmp_path / "subs", {"lab01_basics"})
    assert [(s.student, s.lab) for s in subs] == [("ann", "lab01_basics"), ("bob", "lab01_basics"),
                                                  ("evil", "lab01_basics")]
    assert any(".hidden" in w for w in warnings)
    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("class/ann/lab01_basics/lab01_basics.ipynb", "{}")
    found, _ = find_submissions(unpack_zip(good, tmp_path / "u"), {"lab01_basics"})
    assert [s.student for s in found] == ["ann"]
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("../ann/lab01_basics/lab01_basics.ipynb", "{}")
    with pytest.raises(SystemExit, match="unsafe"):
        unpack_zip(bad, tmp_path / "v")


def test_task_groups():
    assert LabInfo.group("test_1_3_leaf") == "1.3"
    assert LabInfo.group("test_quiz_q2") == "quiz"
    info = LabInfo("l", {"test_1_1_a": 2, "test_quiz_q1": 1, "test_1_1_b": 2, "test_1_2_a": 3})
    assert info.groups == {"1.1": 4, "1.2": 3, "quiz": 1} and info.max_score == 8


# ---------------------------------------------------------------------------------------
# grade.sh's arguments (grading itself: tests/test_grading_hardening.py)
# ---------------------------------------------------------------------------------------
def test_grade_sh_says_what_is_wrong_with_its_arguments(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "autograder" / "grade.sh"), str(tmp_path),
                           "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "no submissions" in proc.stderr


def test_grade_sh_never_empties_a_folder_it_did_not_write(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    proc = subprocess.run(["bash", str(ROOT / "autograder" / "grade.sh"), str(EXAMPLES_DIR),
                           "--out", str(mine), "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not written by grade.sh" in proc.stderr
    assert (mine / "thesis.tex").read_text() == "precious"


def _errors_in_a_plain_kernel(path: Path, cwd: Path) -> list[tuple[str, str, str]]:
    """Run a lab notebook top to bottom in a plain ``python3`` kernel, as a student does in
    Jupyter (no referee, no sandbox, errors allowed): (grade id, error name, message) of every
    cell that raised."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for extra in path.parent.iterdir():  # the lab's data files, beside it as in the release
        if extra.is_file() and extra.suffix != ".ipynb":
            (cwd / extra.name).write_bytes(extra.read_bytes())
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(cwd)}})
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    with client.setup_kernel(env=env):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                client.execute_cell(cell, index)
    return [(c.metadata.get("nbgrader", {}).get("grade_id", f"cell {i}"), o.ename, o.evalue)
            for i, c in enumerate(nb.cells) if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lab", LAB_NAMES)
def test_labs_run_in_a_plain_kernel_as_students_run_them(lab, tmp_path):
    """What a student sees in Jupyter, without the grader: the released lab fails only where
    a task is still to do (NotImplementedError naming it) or a check says so (LabCheckError),
    never with a broken cell of the lab's own. (The solution notebook is executed once, by
    the graded corpus, as the student ``reference``: it must score full marks there.)"""
    (tmp_path / "release").mkdir()
    errors = _errors_in_a_plain_kernel(LABS / lab / f"{lab}.ipynb", tmp_path / "release")
    assert errors, "the released lab passed its tests with nothing written"
    odd = [e for e in errors if e[1] not in ("NotImplementedError", "LabCheckError")]
    assert not odd, odd
    assert all(gid.startswith("test_") for gid, _, _ in errors), errors


# ---------------------------------------------------------------------------------------
# hints on request: out of the notebook, out of a grep of the package
# ---------------------------------------------------------------------------------------
def _hint_fragments(lab: str) -> list[str]:
    from minickpt.labkit.hints import parse_hints_md

    hints = parse_hints_md((SOLUTIONS / build.HINTS_DIR / f"{lab}.md").read_text())
    return [line.strip() for levels in hints.values() for text in levels.values()
            for line in text.split("\n") if len(line.strip()) >= 24]


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_hints_stay_out_of_what_a_text_dump_of_the_lab_or_the_package_shows(lab):
    """A student who dumps the notebook as text, or greps the installed package, reads no hint;
    every task offers both levels through lab.hint."""
    released = (LABS / lab / f"{lab}.ipynb").read_text()
    text = "\n".join(c.source for c in cells(LABS / lab / f"{lab}.ipynb"))
    package = "\n".join(p.read_text(errors="replace")
                        for p in (ROOT / "minickpt").rglob("*") if p.is_file()
                        and p.suffix in (".py", ".md", ".txt", ".json"))
    fragments = _hint_fragments(lab)
    assert len(fragments) >= 8, "found almost nothing to look for: the check would be empty"
    for where, dump in (("labs/", text), ("minickpt/", package)):
        shown = [f for f in fragments if f in dump]
        assert not shown, f"{where} shows hint text of {lab}: {shown[:3]}"
    assert "<details" not in released and "Hint 1" not in released
    assert "`lab.reference(name)` is minickpt's own implementation" in text, \
        "the lab must say what lab.reference is, and that a task reaching it scores 0"
    for task in build.lab_tasks(nbformat.read(SOLUTIONS / lab / f"{lab}.ipynb", as_version=4)):
        assert f'lab.hint("{task}")' in text and f'lab.hint("{task}", 2)' in text, task


def test_hint_shows_each_level_on_request_and_says_what_is_wrong(capsys):
    from minickpt.labkit.hints import parse_hints_md

    want = parse_hints_md((SOLUTIONS / build.HINTS_DIR / "lab02_save_policy.md").read_text())
    assert labkit.hint("2.3") is None
    out = capsys.readouterr().out
    assert "Task 2.3, hint 1 (the idea)" in out and want["2.3"][1] in out
    labkit.hint("2.3", 2)
    assert want["2.3"][2] in capsys.readouterr().out
    with pytest.raises(labkit.LabCheckError, match="use 1 .* or 2"):
        labkit.hint("2.3", 3)
    with pytest.raises(labkit.LabCheckError, match="no hints for task '9.9'.*2.3"):
        labkit.hint("9.9")


def test_the_shipped_hints_are_the_instructors_and_authoring_mistakes_stop_the_build(tmp_path):
    from minickpt.labkit.hints import decode_hints, parse_hints_md

    assert build.hints_module(SOLUTIONS, LAB_NAMES) == build.HINTS_MODULE.read_text(), \
        "minickpt/labkit/hints_data.py is out of date: run `python -m autograder.build`"
    shipped = labkit.hints._all()
    for lab in LAB_NAMES:
        for task, levels in parse_hints_md(
                (SOLUTIONS / build.HINTS_DIR / f"{lab}.md").read_text()).items():
            assert shipped[task] == levels
    assert decode_hints(labkit.hints.encode_hints({"1.1": {1: "a", 2: "b"}})) == \
        {"1.1": {1: "a", 2: "b"}}
    with pytest.raises(ValueError, match="task 1.1 has no hint 2"):
        parse_hints_md("## 1.1\n\n### 1\n\nthe idea\n", "x.md")
    with pytest.raises(ValueError, match="x.md:3: hint level 3"):
        parse_hints_md("## 1.1\n\n### 3\n\nmore\n", "x.md")
    (tmp_path / build.HINTS_DIR).mkdir()
    (tmp_path / "lab01_basics").mkdir()
    (tmp_path / "lab01_basics" / "lab01_basics.ipynb").write_bytes(
        (SOLUTIONS / "lab01_basics" / "lab01_basics.ipynb").read_bytes())
    (tmp_path / build.HINTS_DIR / "lab01_basics.md").write_text(
        "## 1.1\n\n### 1\n\na\n\n### 2\n\nb\n")
    with pytest.raises(ValueError, match=r"hints for tasks \['1.1'\], but lab01_basics has"):
        build.hints_module(tmp_path, ["lab01_basics"])
