"""Issue 38, lab 4: the grader runs the multi-process save itself (autograder/drills.py,
drill_4_3). One sandboxed command launches 4 JAX processes with the student's lab 4 functions;
the layout, the values (seeds), the primary, a slow process and a failure are drawn by the
grader, and the verdict is read from the disk by the grader's own process."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
from drill_support import solution_cells

from autograder import drills
from minickpt.labkit import lab4_drill

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)





def _plan(point: str = "after_write", victim: int = 2, primary: int = 1,
          every_spec: bool = False) -> dict:
    """A drawn plan with its failure fixed (and, with ``every_spec``, a leaf of every sharding
    the drill draws from)."""
    plan = lab4_drill.drill_plan(random.Random(7))
    plan["primary"] = primary
    plan["saves"][0]["process"] = next(p for p in (3, 2, 0) if p != primary)
    plan["saves"][1].update(point=point, process=victim)
    plan["saves"][2].update(process=primary)
    if every_spec:
        dtypes = ["float32", "int32", "float16", "int8"]
        plan["layout"] = {f"s{i}": [[8, 4 * (1 + i % 2)],
                                    [list(e) if isinstance(e, tuple) else e for e in spec],
                                    dtypes[i % 4]]
                          for i, spec in enumerate(lab4_drill.DRILL_SPECS)}
    return plan


def _with(code: str) -> list[str]:
    """The solution's lab 4 cells, then ``code`` (a later cell: the last definition counts)."""
    return [*solution_cells("lab04_multihost"), textwrap.dedent(code)]


def test_drill_boxes_are_the_pieces_of_each_sharding():
    boxes = lab4_drill.drill_boxes({"a": [[8, 4], ["p", "l"], "float32"],
                              "b": [[8, 4], [None, "l"], "int8"],
                              "c": [[8, 4], [["l", "p"], None], "float16"]}, 4)
    assert len(boxes["a"]) == 8 and len(boxes["b"]) == 2 and len(boxes["c"]) == 8
    assert [[0, 8], [0, 2]] in boxes["b"] and [[0, 1], [0, 4]] in boxes["c"]


def test_the_workers_run_only_the_imports_definitions_and_literal_constants_of_the_cells():
    cells = ["import sys\nPHASES = ('created', 'written')\nPLAN = json.loads(sys.argv[3])\n"
             "open('/tmp/x', 'w').write('by hand')\ndef two_barrier_commit(save):\n"
             "    return PHASES\n",
             "x = 1\nprint('a cell without a task function')\n", "%time not python\n",
             "def owned_shards(*a, **k):\n    return []\n"]
    code = drills.definitions(cells, lab4_drill.drill_plan(random.Random(1))["names"])
    assert "PHASES = " in code and "import sys" in code and "owned_shards" in code
    assert "argv" not in code and "by hand" not in code and "x = 1" not in code
    assert code.index("PHASES") < code.index("def owned_shards")


def test_the_values_are_the_seeds_and_differ_between_seeds():
    a = lab4_drill.drill_values(5, "w", (8, 4), "float16")
    assert a.dtype == np.float16 and np.array_equal(a, lab4_drill.drill_values(5, "w", (8, 4), "float16"))
    assert not np.array_equal(a, lab4_drill.drill_values(6, "w", (8, 4), "float16"))
    assert lab4_drill.drill_values(5, "w", (8, 4), "int8").dtype == np.int8


def test_a_drawn_plan_fails_saves_before_publication_on_a_process_that_reaches_the_point():
    for seed in range(50):
        plan = lab4_drill.drill_plan(random.Random(seed))
        good, bad, commit, last = plan["saves"]
        assert bad["action"] == "raise" and bad["point"] in lab4_drill.DRILL_POINTS[:-1]
        assert commit == {**commit, "point": "before_commit", "process": plan["primary"],
                          "action": "raise"}
        assert good["process"] != plan["primary"] and float(good["action"]) > 0
        assert last["action"] == "0" and last["process"] == plan["processes"]
        assert good["step"] < bad["step"] < commit["step"] < last["step"]
        assert commit["kind"] != "OSError", "the commit's failure is not a disk's error"


def test_the_solution_passes_the_graders_drill_on_every_sharding(box):
    assert drills.drill_4_3(solution_cells("lab04_multihost"), box, _plan(every_spec=True)) is None


def test_the_solution_passes_a_drawn_drill(box):
    assert drills.drill_4_3(solution_cells("lab04_multihost"), box) is None


COMMITS_BEFORE_BARRIER = """
def two_barrier_commit(save):
    # the primary publishes as soon as its own shards are written
    error = None
    if save.primary:
        try:
            save.create()
        except Exception as e:
            error = e
    save.barrier("created", error)
    files = None
    try:
        files = save.write()
    except Exception as e:
        error = e
    info = {}
    if save.primary:
        try:
            info = save.commit([files])
        except Exception as e:
            error = e
    save.barrier("written", error, files)
    save.barrier("committed", error, info)
"""

SWALLOWS_WRITE = """
def two_barrier_commit(save):
    # a failed write is the writer's business: the others commit what was written
    error = None
    if save.primary:
        try:
            save.create()
        except Exception as e:
            error = e
    save.barrier("created", error)
    files = None
    try:
        files = save.write()
    except Exception:
        pass
    written = save.barrier("written", None, files)
    info = {}
    if save.primary:
        try:
            info = save.commit(written)
        except Exception as e:
            error = e
    save.barrier("committed", error, info)
"""

SWALLOWS_COMMIT = """
def two_barrier_commit(save):
    # a failed commit: the shards are on disk, a later save will commit them
    error = None
    if save.primary:
        try:
            save.create()
        except Exception as e:
            error = e
    save.barrier("created", error)
    files = None
    try:
        files = save.write()
    except Exception as e:
        error = e
    written = save.barrier("written", error, files)
    info = {}
    if save.primary:
        try:
            info = save.commit(written)
        except Exception:
            pass
    save.barrier("committed", error, info)
"""

CATCHES_ONLY_OSERROR = """
def two_barrier_commit(save):
    # the contract's "any failure" read as a disk's: only an OSError reaches the barrier
    err = None
    if save.primary:
        try:
            save.create()
        except OSError as e:
            err = e
    save.barrier("created", error=err)
    err, files = None, None
    try:
        files = save.write()
    except OSError as e:
        err = e
    all_files = save.barrier("written", error=err, value=files)
    err, result = None, None
    if save.primary:
        try:
            result = save.commit(all_files)
        except OSError as e:
            err = e
    save.barrier("committed", error=err, value=result)
"""


def _plan_kinds(first: str, second: str) -> dict:
    plan = _plan("after_write", victim=2)
    plan["saves"][1]["kind"], plan["saves"][2]["kind"] = first, second
    return plan


EVERY_REPLICA = """
def owned_shards(shape, devices_indices_map, process_index, *, process_of=lambda d: d.process_index):
    # every device holding a piece writes it
    return [(box_of(index, shape), device) for device, index in devices_indices_map.items()
            if process_of(device) == process_index]
"""


@pytest.mark.parametrize("code,plan,said", [
    (COMMITS_BEFORE_BARRIER, _plan(), "step_"),
    (SWALLOWS_WRITE, _plan("after_write", victim=2),
     "was published although the save failed|returned as if it had succeeded"),
    (EVERY_REPLICA, _plan(every_spec=True), "more than one shard"),
    (SWALLOWS_COMMIT, _plan(), "returned as if it had succeeded"),
    (CATCHES_ONLY_OSERROR, _plan_kinds("OSError", "RuntimeError"), "ended in a time-out"),
])
def test_a_wrong_save_fails_the_graders_drill(box, code, plan, said):
    import re

    failed = drills.drill_4_3(_with(code), box, plan)
    assert failed is not None and "grader's own drill" in failed and re.search(said, failed), failed


def test_a_missing_two_barrier_commit_is_named():
    assert "no function two_barrier_commit" in drills.drill_4_3(["def other():\n    pass\n"], None)


# -- issue 47: drill liars ---------------------------------------------------------------------
BY_HAND_BESIDE = """
import json
import sys
# statements beside the task function: in the old drill's workers they ran, read the plan from
# argv and wrote the expected folders by hand; the task functions stay blank
if len(sys.argv) > 3 and sys.argv[3].startswith("{"):
    PLAN = json.loads(sys.argv[3])
    os.makedirs(os.path.join(sys.argv[1], "step_" + str(PLAN["saves"][0]["step"])))
def two_barrier_commit(save):
    raise NotImplementedError("Task 4.3: two_barrier_commit")
"""

BY_HAND_INSIDE = """
def two_barrier_commit(save):
    # no create/write/commit: the step's folder made by hand, with a metadata file of its own
    if save.primary:
        os.makedirs(os.path.join(save.directory, "params"), exist_ok=True)
        with open(os.path.join(save.directory, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"step": save.step}, f)
    save.barrier("created")
    save.barrier("written", None, {})
    save.barrier("committed", None, {})
"""


@pytest.mark.parametrize("code,said", [
    (BY_HAND_BESIDE, "Task 4.3: two_barrier_commit"),
    (BY_HAND_INSIDE, "step_"),
])
def test_files_written_by_hand_fail_the_graders_drill(box, code, said):
    failed = drills.drill_4_3(_with(code), box, _plan())
    assert failed is not None and "grader's own drill" in failed and said in failed, failed


def test_nothing_of_the_plan_is_in_the_workers_argv_environment_or_folder(tmp_path):
    """The command line holds the folder and the process count; the environment none of
    the plan; the folder, when the command starts, the student's definitions and the
    grader's socket. The plan comes over the channel once the definitions are loaded."""
    plan = _plan()
    seen: dict = {}

    def wrap(argv, env):
        seen.update(argv=list(argv), env=dict(env), files=sorted(p.name for p in tmp_path.iterdir()))
        return argv

    code = drills.definitions(solution_cells("lab04_multihost"), plan["names"])
    r = lab4_drill.run_lab4_drill(code, str(tmp_path), plan, wrap=wrap, env={})
    text = " ".join(seen["argv"][3:]) + " ".join(f"{k}={v}" for k, v in seen["env"].items())
    for save in plan["saves"]:
        assert str(save["seed"]) not in text and f"step_{save['step']}" not in text
    assert not any(leaf in text for leaf in plan["layout"])
    assert seen["files"] == ["drill.sock", "lab4_tasks.py"]
    assert lab4_drill.lab4_drill_message(r, plan) is None


def test_a_step_on_disk_before_its_save_is_named():
    plan = _plan()
    step = plan["saves"][0]["step"]
    r = {"ckpt": "/nonexistent", "channel": None, "listings": [[f"step_{step}"]],
         "outcomes": [], "calls": [], "said": None, "err": ""}
    failed = lab4_drill.lab4_drill_message({**r, "ckpt": str(ROOT)}, plan)
    assert "before its save began" in failed
