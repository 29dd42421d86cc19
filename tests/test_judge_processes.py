"""The judge (issue 47) and the tests that start processes of their own on the student's code
(lab 3's crash drill, lab 6's loop processes): the proxies carry the student's code, the
processes start as the judge says (in the sandbox, as the grader's drills do), and what they
are given holds no line of a test."""

from __future__ import annotations

import json
import os

import pytest

from autograder import ROOT, drills
from autograder.judge import cells as cells_mod
from autograder.judge import session
from autograder.notebook import load_lab
from minickpt.labkit import processes

pytestmark = pytest.mark.timeout(900)


def _solution_cells(lab: str) -> list[str]:
    nb = json.loads((ROOT / "solutions" / lab / f"{lab}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
            and c.get("metadata", {}).get("nbgrader", {}).get("solution")]


def _test_lines(lab: str) -> set[str]:
    """The lines of the lab's test cells (hidden and grader checks too) found nowhere else in
    the lab: what no process the judge starts for the student may be given."""
    cells = load_lab(ROOT / "solutions" / lab / f"{lab}.ipynb").cells
    elsewhere = {line.strip() for c in cells if c.role != "test"
                 for line in c.source.splitlines()}
    return {line.strip() for c in cells if c.role == "test" for line in c.source.splitlines()
            if len(line.strip()) > 25 and not line.strip().startswith("#")} - elsewhere


def _spying(seen: list[dict], real):
    """``real`` (a wrap, or None), noting in ``seen`` every command it is given, its
    environment and the files of its folder at that moment."""
    def wrap(argv: list[str], env: dict[str, str]) -> list[str]:
        files = {}
        for a in argv:
            folder = os.path.dirname(a) if os.path.isfile(a) else None
            for name in os.listdir(folder) if folder else ():
                p = os.path.join(folder, name)
                if os.path.isfile(p) and name.endswith(".py"):
                    files[p] = open(p, encoding="utf-8").read()
        seen.append({"argv": list(argv), "env": dict(env), "files": files})
        return real(argv, env) if real is not None else argv
    return wrap


def _judge_with_spy(lab: str, cells: list[str], box: drills.Box, grade_ids: set[str],
                    drilled: list[dict] | None = None):
    """``lab`` judged as the runner judges it (autograder/runner.py ``_judge``), the launch
    options spied on: every command a test's own process starts with, its environment and
    the files of its folder at that moment (``drilled``: the same of the grader's drills)."""
    seen: list[dict] = []
    if drilled is not None:
        box_wrap = box.wrap
        box.wrap = lambda d: _spying(drilled, box_wrap(d))  # type: ignore[method-assign]
    with box.scratch() as d:
        how = drills.judge_launch(box, d) if box.iso.sandboxed else {}
        wrap = _spying(seen, how.get("wrap"))

        lab_cells = cells_mod.lab_cells(lab)
        wanted = (lab_cells[0], [c for c in lab_cells[1] if c.grade_id in grade_ids])
        verdicts, problems = session.judge_lab(
            lab, cells, d, wrap=box.wrap(d) if box.iso.sandboxed else None,
            uid=box.uid if box.iso.mode == "bwrap-root" else None,
            tools={"grader_drill": drills.tool(cells, box)}, cells=wanted,
            end_workers=box.end_workers, launch={**how, "wrap": wrap})
    return verdicts, problems, seen


def test_lab3s_drill_is_judged_with_the_students_code_and_no_test_line(box):
    """Before: under the judge ``lab3_drill(resume)`` read the proxy's own source and its
    training process had no ``resume`` to run. Now the solution's code earns lab 3's drill
    test (visible, hidden and grader check, all decided in this process), its processes start
    through the judge's launch (the sandbox where there is one), and what they are given is
    the student's code and the kit's driver: no line of a test."""
    lab = "lab03_resume"
    cells = _solution_cells(lab)
    drilled: list[dict] = []
    verdicts, problems, seen = _judge_with_spy(lab, cells, box, {"test_3_3_drill"}, drilled)
    assert not problems, problems
    assert [(v.grade_id, v.passed) for v in verdicts] == [("test_3_3_drill", True)], \
        [(v.grade_id, v.message) for v in verdicts]
    # one drill, the grader's (its processes started by the grader's box, one command for
    # all), stands for the test's own drill and its grader check: not two drills
    runs = [s for s in drilled if any(str(a).endswith("resume_task_3_3.py") for a in s["argv"])]
    assert not seen and len(runs) == 1, (len(seen), [s["argv"][-6:] for s in drilled])
    seen = runs
    given = "\n".join([*(a for s in seen for a in s["argv"]),
                       *(f"{k}={v}" for s in seen for k, v in s["env"].items()),
                       *(t for s in seen for t in s["files"].values())])
    assert "def resume(" in given and "def restore_newest_valid(" in given
    leaked = [line for line in _test_lines(lab) if line in given]
    assert not leaked, leaked[:3]
    assert "BEGIN HIDDEN" not in given and "grader_drill" not in given


def test_a_proxy_carries_only_the_students_definitions():
    cells = ["import os\nX = 3\nprint('demo')\n\ndef resume(a):\n    return a\n",
             "resume(1)\n", "def other():\n    pass\n"]

    def proxy(*a):
        return None

    session.give_sources({"resume": proxy}, cells)
    src = processes.source_of(proxy)
    assert "def resume(a)" in src and "import os" in src and "X = 3" in src
    assert "print(" not in src and "resume(1)" not in src and "def other" not in src
    with processes.launched_by(wrap=len):
        assert processes.launch_options("wrap", "locate") == {"wrap": len}
    assert processes.launch_options("wrap") == {}


def test_lab6s_preemption_drill_is_judged_in_processes_the_judge_starts(box):
    """Lab 6's drill test under the judge: the solution's loop, carried by its proxy, runs in
    the processes the grader's drill starts (signalled there), and earns the test, its grader
    check included; nothing of a test is in what they are given."""
    lab = "lab06_production"
    drilled: list[dict] = []
    verdicts, problems, seen = _judge_with_spy(lab, _solution_cells(lab), box,
                                               {"test_6_3_sigterm"}, drilled)
    assert not problems, problems
    assert [(v.grade_id, v.passed) for v in verdicts] == [("test_6_3_sigterm", True)], \
        [(v.grade_id, v.message) for v in verdicts]
    # the test's own drill of the plain set-up is the grader's (drawn set-up, signals=3: four
    # processes), and its grader check reads that run: one drill, not a second of three
    runs = [s for s in drilled if "multiprocessing.connection" not in " ".join(s["argv"])]
    assert not seen and len(runs) == 4, (len(seen), len(runs))
    seen = runs
    given = "\n".join([*(a for s in seen for a in s["argv"]),
                       *(f"{k}={v}" for s in seen for k, v in s["env"].items()),
                       *(t for s in seen for t in s["files"].values())])
    assert "def train_until_preempted(" in given
    leaked = [line for line in _test_lines(lab) if line in given]
    assert not leaked, leaked[:3]


@pytest.fixture
def ends():
    """The judge's and the worker's endpoints, joined by a socket pair in this process."""
    import socket
    from multiprocessing.connection import Connection

    from autograder.judge import wire

    a, b = socket.socketpair()
    judge = wire.Endpoint(Connection(a.detach()), "judge", session.confined_policy(["/nowhere"]),
                          timeout=60).start()
    other = wire.Endpoint(Connection(b.detach()), "worker",
                          wire.Policy(private=True, setattr=True), timeout=60).start()
    yield judge, other
    judge.close()
    other.close()


def test_what_labs_3_and_6_hand_across_the_wire(ends):
    """A test's generator of steps is iterated in the judge (lab 3's ``iter([2, 10, 9])``); a
    ShapeDtypeStruct target crosses by value; minickpt's CheckpointTooLargeError (a
    MemoryError too) comes back as itself; a record's fields the student's function set come
    back to the test's record (lab 6's KillRecord)."""
    import jax
    import jax.numpy as jnp

    from minickpt.errors import CheckpointTooLargeError
    from minickpt.production.drill import KillRecord

    judge, other = ends

    def student(steps, target, rec):
        rec.resumed_from = 10
        got = sorted(steps)
        if type(target) is not jax.ShapeDtypeStruct:
            raise TypeError(type(target).__name__)
        raise CheckpointTooLargeError(f"{got} {target.shape}")

    fn = judge.decode(other.encode(student))

    def steps():
        yield from (2, 10, 9)

    rec = KillRecord(1, "step", 13, False, False, None, None, None, None, None)
    with pytest.raises(CheckpointTooLargeError, match=r"\[2, 9, 10\] \(3,\)"):
        fn(steps(), jax.ShapeDtypeStruct((3,), jnp.int16), rec)
    assert rec.resumed_from == 10 and rec.killed_after_step == 13
    remote = judge.decode(other.encode({"a": 1}.keys()))
    assert len(remote) == 1 and "a" in remote and list(remote) == ["a"]


def test_a_wrapper_holding_minickpts_own_is_noted_for_review():
    """Under the judge no test runs in the kernel, whose watch flagged a task function that ran
    minickpt's own (``reached_dict_default``): the worker notes a task function holding it
    (or, on the graded build, its plug point) in a default or its closure; the runner puts
    the note in the review column. Points: the graded build has no implementation to reach."""
    import minickpt as mc
    from autograder.judge import worker

    def resume(*args, _f=mc.restore.__dict__["resume"], **kwargs):
        return _f(*args, **kwargs)

    def check_structure(manifest, target, item="state", _other=mc.restore.__dict__["resume"]):
        return []  # another task's function held: the library used, not flagged

    notes = worker.reached({"resume": resume, "check_structure": check_structure},
                           ["resume", "check_structure", "migrate"])
    assert len(notes) == 1 and notes[0].startswith(worker.REACHED + " resume")
