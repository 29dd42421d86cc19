"""Issue 38: the grader runs lab 3's crash drill itself (autograder/drills.py). The student's
functions run in sandboxed workers; the kill moments, the disk, the reference run and the
verdict stay in the grader's process. Each wrong resume here passes the drill the kernel runs
(in the student's process, where it proves nothing) and must fail the grader's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from drill_support import solution_cells

from autograder import drills
from autograder.notebook import judge_quiz

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)





def _with_resume(code: str) -> list[str]:
    """The solution's lab 3 cells with resume replaced by ``code`` (a later cell: the last
    definition counts, as in the kernel)."""
    return [*solution_cells("lab03_resume"), textwrap.dedent(code)]


def test_definitions_keep_imports_and_definitions_of_the_task_cells_only():
    cells = ["import os\nx = print('not run')\ndef resume(m, s, r):\n    return s, r, 1\n",
             "def helper():\n    pass\nprint('a cell that defines no task function')\n",
             "@staticmethod\ndef resume(m, s, r):\n    return s, r, 2\nresume(1, 2, 3)\n",
             "%time not python\n"]
    code = drills.definitions(cells, {"resume"})
    assert "import os" in code and "print" not in code and "helper" not in code
    assert code.index("return s, r, 1") < code.index("@staticmethod") < code.index("return s, r, 2")
    assert "resume(1, 2, 3)" not in code


def test_the_solutions_resume_passes_the_graders_drill(box):
    assert drills.drill_3_3(solution_cells("lab03_resume"), box) is None


RECOMPUTES = """
def resume(mngr, state, rng):
    # recomputes the run up to the newest step instead of restoring it: right only for the
    # one run that the kernel's drill starts from
    t = mngr.latest_step()
    if t is None:
        return state, rng, 1
    s, r, _ = mc.demo.train(state, rng, 0, t)
    return s, r, t + 1
"""

JUMPS_AHEAD = """
def resume(mngr, state, rng):
    # restores, then trains to the end itself and commits the last step: nothing left to kill
    t = mngr.latest_step()
    if t is None:
        state, rng, t = state, rng, 0
    else:
        got = mngr.restore(target={"state": state, "rng": rng})
        state, rng = got["state"], got["rng"]
    state, rng, _ = mc.demo.train(state, rng, t, 15)
    mngr.save(15, {"state": state, "rng": rng}, force=True)
    return state, rng, 16
"""


@pytest.mark.parametrize("code,said", [(RECOMPUTES, "ended elsewhere"),
                                       (JUMPS_AHEAD, "resumed from step 15")])
def test_a_resume_that_does_not_go_on_from_the_disk_fails_the_graders_drill(box, code, said):
    failed = drills.drill_3_3(_with_resume(code), box)
    assert failed is not None and said in failed, failed


def test_a_missing_resume_is_named():
    assert "no function resume" in drills.drill_3_3(["def other():\n    pass\n"], None)


def test_a_grader_check_without_the_tool_fails_with_a_reason():
    failed = judge_quiz("failed = grader_drill('3.3')\ncheck(failed is None, failed)\n", {})
    assert failed is not None and "grader_drill" in failed


def test_the_grading_worker_keeps_its_own_jax_on_the_cpu_and_the_kernels_env_unpinned():
    """The grader's checks and drill references run JAX in the grading worker; on a TPU that
    process must not take the chip a neighbouring kernel needs, nor pin the kernels."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("from autograder import runner, sandbox; runner.keep_jax_on_cpu(); import jax; "
            "print(jax.config.jax_platforms, 'JAX_PLATFORMS' in sandbox.kernel_env())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["cpu", "False"], out.stderr[-2000:]


def test_the_lab3_drills_plan_is_not_in_the_workers_argv_or_environment(tmp_path):
    """Issue 47: what the grader draws for 3.3 (the planted run's seed, the kill steps) is
    never in the worker's command line or environment: the seed reaches it only as the
    checkpoint on disk its resume must restore, the kill moments stay here. (The workers
    here exit at once: only what they were started with is looked at.)"""
    import sys

    from minickpt.labkit import lab3

    seen: list = []

    def wrap(argv, env):
        seen.append((list(argv), dict(env)))
        return [sys.executable, "-c", "pass"]

    seed = 987654321
    lab3.run_lab3_drill("def resume(*a):\n    pass\n", str(tmp_path), wrap=wrap, env={},
                        plant_seed=seed, kills=2, timeout_s=20)
    assert seen
    for argv, env in seen:
        text = " ".join(argv) + " ".join(f"{k}={v}" for k, v in env.items())
        assert str(seed) not in text


def test_a_worker_that_writes_much_to_stderr_ends_the_lab3_drill_by_itself(tmp_path):
    """A resume that recurses without end (a reached minickpt's own, a default argument
    holding the plug) dies with a traceback of a thousand frames. Before, the drill read
    only the worker's stdout: the traceback filled the stderr pipe, the worker blocked
    writing it, and the drill waited for the watchdog (2 x timeout_s, 100 s in the grader)
    to kill it, for each such submission. The worker's stderr is read as it comes: it ends
    by itself, with its error's last line in ``err``."""
    import sys

    from minickpt.labkit import lab3

    babble = ("import sys\n"
              "for _ in range(2000):\n"
              "    sys.stderr.write('frame ' + 'x' * 200 + '\\n')\n"
              "raise SystemExit('the last line of the babble')\n")

    def wrap(argv, env):
        return [sys.executable, "-c", babble]

    r = lab3.run_lab3_drill("def resume(*a):\n    pass\n", str(tmp_path), wrap=wrap,
                            env={}, kills=2, timeout_s=30)
    run = r["runs"][0]
    assert run["rc"] == 1, run["rc"]  # its own exit, not the watchdog's SIGKILL (-9)
    assert "the last line of the babble" in run["err"], run["err"][-300:]
    assert len(run["err"]) <= 3000


def test_grader_drill_outside_the_grader_says_so_and_returns_none(capsys):
    """Issue 48: an instructor's run-all of a solution notebook (Jupyter, device-check.sh)
    runs the grader checks as plain code; the setup cell's grader_drill then says that the
    grader runs the drill and lets the check pass."""
    from minickpt.labkit import check, grader_drill

    failed = grader_drill("6.3")
    check(failed is None, failed)
    assert failed is None and "the grader runs this drill itself" in capsys.readouterr().out


def test_a_kernel_value_named_grader_drill_never_reaches_a_grader_check():
    """Whatever the kernel reports under the tool's name, the grader check calls the
    grader's own tool (bound after the kernel's values)."""
    calls = []

    def tool(task):
        calls.append(task)
        return "the grader's verdict"

    failed = judge_quiz("failed = grader_drill('6.3')\ncheck(failed is None, failed)\n",
                        {"grader_drill": None}, {"grader_drill": tool})
    assert calls == ["6.3"] and "the grader's verdict" in failed


def test_a_tests_own_drill_under_the_judge_is_the_graders_and_runs_once(monkeypatch):
    """Lab 3's drill test asked for two drills of three sandboxed JAX processes each: its own
    (``lab3_drill``) and its grader check's. Under the judge the test's own is the grader's
    run (``tool(...).for_test``), and the grader check then reads that run's verdict: one
    drill. Asked again, or after a run of another set-up, the grader check runs its own."""
    calls: list = []

    def fake_run(cells, box, **params):
        calls.append(params)
        return {"runs": []}, "the grader's own drill: it did not resume"

    monkeypatch.setitem(drills.RUNS, "3.3", (fake_run, drills.RUNS["3.3"][1]))
    monkeypatch.setitem(drills.DRILLS, "3.3", lambda cells, box: calls.append("again"))
    tool = drills.tool(["def resume(*a):\n    pass\n"], object())
    assert tool.for_test("3.3", **drills.RUNS["3.3"][1]) == {"runs": []}
    assert tool("3.3") == "the grader's own drill: it did not resume" and len(calls) == 1
    assert tool("3.3") is None and calls[-1] == "again"
    tool.for_test("3.3", steps=9, every=3, kills=1, timeout_s=50.0)
    assert tool("3.3") is None and calls[-1] == "again" and len(calls) == 4


def test_lab3_drill_under_the_judge_asks_for_the_graders_drill():
    from minickpt.labkit import LabCheckError, lab3, processes

    asked: list = []

    def resume(*a):
        pass

    def graders(task, **params):
        asked.append((task, params))
        return {"runs": ["the grader's"]}

    with processes.launched_by(grader_drill=graders):
        assert lab3.lab3_drill(resume, steps=15, every=5, kills=2) == {"runs": ["the grader's"]}
    assert asked == [("3.3", {"steps": 15, "every": 5, "kills": 2, "timeout_s": 50.0})]

    tool = drills.tool(["def resume(*a):\n    pass\n"], object())
    stopped = (None, "the grader's drill stopped: the workers left a link")
    real = drills.run_3_3
    drills.run_3_3 = lambda cells, box, **params: stopped
    try:
        with pytest.raises(LabCheckError, match="left a link"):
            tool.for_test("3.3", **drills.RUNS["3.3"][1])
    finally:
        drills.run_3_3 = real


def test_lab6s_plain_drill_under_the_judge_is_the_graders_and_the_async_one_is_not(tmp_path):
    """Lab 6's drill test of the plain set-up (sync, no hard exit) under the judge is the
    grader's drill (drawn set-up, its verdict read again by the grader check); the hidden
    drill of an async manager and a hard exit is run as the test says."""
    from minickpt.labkit import lab6, processes

    asked: list = []

    def train_until_preempted(*a, **k):
        pass

    def graders(task, **params):
        asked.append((task, params))
        return "the grader's own drill: step 7 was lost"

    with processes.launched_by(grader_drill=graders):
        got = lab6.preemption_drill(train_until_preempted, str(tmp_path), signals=2, seed=0)
    assert got == "the grader's own drill: step 7 was lost"
    assert asked == [("6.3", {"signals": 2, "seed": 0})]
    calls: list = []
    tool = drills.tool(["def train_until_preempted(*a):\n    pass\n"], object())
    real = drills.DRILLS["6.3"]
    drills.DRILLS["6.3"] = lambda cells, box: calls.append(1) or "lost a step"
    try:
        assert tool.for_test("6.3", signals=2, seed=0) == "lost a step"
        assert tool("6.3") == "lost a step" and len(calls) == 1
    finally:
        drills.DRILLS["6.3"] = real
