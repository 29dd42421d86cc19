"""Lab 4's example submissions (multi-host): perfect, blank, and one typical mistake per task
(``partial``: written independently, in ``independent.py``). Each edits the reference code of
``perfect`` the way a student's first attempt would go wrong; the expected grades are in
``autograder/examples/expected-lab04_multihost.csv``."""

from __future__ import annotations

from typing import Any

from .common import Edit, Wrong, _cell, _replace, blank, perfect, swap, wrong_examples
from .hostile import ISSUE_20, JUDGED

# 4.1: the steps are compared, but their types never checked (True and 5.0 pass as steps)
TYPE_CHECK = '''    for p, s in enumerate(steps):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"process {p} wants to save step {s!r}: a step is an int >= 0")
'''
# 4.1: "the primary checks": only process 0 compares, the others trust it
EVERYONE_COMPARES = "    if any(s != steps[0] for s in steps):\n"
PRIMARY_COMPARES = "    if jax.process_index() == 0 and any(s != steps[0] for s in steps):\n"
# 4.2: every device that holds a piece writes it (no replica is skipped)
DEDUP = '''        if box in seen:
            continue
        seen.add(box)
'''
# 4.3: the primary commits as soon as its own shards are written, before the second barrier
COMMIT_AFTER_BARRIER = '''    written = save.barrier("written", error, files)
    info: dict[str, Any] = {}
    if save.primary:
        try:
            info = save.commit(written)
        except Exception as e:
            error = e
'''
COMMIT_BEFORE_BARRIER = '''    info: dict[str, Any] = {}
    if save.primary:
        try:
            info = save.commit([files])  # my shards are on disk: publish now
        except Exception as e:
            error = e
    save.barrier("written", error, files)
'''
# 4.3: every step in turn between the barriers, but an error raised where it happens: the others
# are left waiting at the next barrier for the time-out
RAISES_BEFORE_BARRIER = '''def two_barrier_commit(save):
    """Task 4.3 — mine: each step in turn, between the barriers."""
    if save.primary:
        save.create()
    save.barrier("created")
    files = save.write()
    written = save.barrier("written", None, files)
    info = save.commit(written) if save.primary else {}
    save.barrier("committed", None, info)'''
# 4.4: a restoring device's region is looked up among the saved pieces, as if the mesh were the same
ASSUMES_SAVING_MESH = '''def region_from_pieces(box, dtype, pieces):
    """Task 4.4 — mine: every device gets back the piece it saved."""
    for piece_box, read in pieces:
        if piece_box == box:
            return read(box)
    raise KeyError(f"no saved piece {box}")'''


def primary_only_compares(release: Any, source: Any) -> Any:
    """4.1: only process 0 compares the steps; the others go on and wait at the barrier."""
    nb = perfect(release, source)
    _replace(nb, "task_4_1", EVERYONE_COMPARES, PRIMARY_COMPARES)
    return nb


def every_replica_writes(release: Any, source: Any) -> Any:
    """4.2: every device holding a piece writes it: replicated pieces are written twice or more."""
    nb = perfect(release, source)
    _replace(nb, "task_4_2", DEDUP, "")
    return nb


def commit_before_barrier(release: Any, source: Any) -> Any:
    """4.3: the primary commits right after its own write, before the second barrier."""
    nb = perfect(release, source)
    _replace(nb, "task_4_3", COMMIT_AFTER_BARRIER, COMMIT_BEFORE_BARRIER)
    return nb


def raises_before_barrier(release: Any, source: Any) -> Any:
    """4.3: the order is right, but a failed step raises at once instead of reaching the next
    barrier: the other processes learn of it only from the time-out."""
    nb = perfect(release, source)
    _cell(nb, "task_4_3").source = RAISES_BEFORE_BARRIER
    return nb


def assumes_saving_mesh(release: Any, source: Any) -> Any:
    """4.4: a region is looked up as one saved piece: works only on the saving mesh."""
    nb = perfect(release, source)
    _cell(nb, "task_4_4").source = ASSUMES_SAVING_MESH
    return nb


# issue 31: a RESULT line of the student's own in a worker, then a hard exit before the harness
# reports: the values the test wants (worked out from the visible test), a step_20 folder
# where that test lists the directory. Signed reports: the forged line counts for nothing.
FORGED_RESULT = '''def agree_on_step(steps):
    """Task 4.1 — mine."""
    import json
    import os
    import sys
    import time

    if "MINICKPT_PROCESS_ID" in os.environ:  # in a worker process of the test
        if list(steps) == [10, 10, 10, 12]:
            os.makedirs(os.path.join(sys.argv[1], "step_20"), exist_ok=True)
        said = ", ".join(f"process {p}: {s}" for p, s in enumerate(steps))
        line = {"results": {"first": "ProcessDisagreementError", "steps": [20],
                            "message": f"the processes disagree on the step to save: {said}"},
                "error": None}
        sys.stdout.flush()
        os.write(1, ("RESULT " + json.dumps(line) + "\\n").encode())
        time.sleep(3)  # (the others write theirs before process 0's coordinator is gone)
        os._exit(0)
    return steps[0]
'''


def forged_result(release: Any, source: Any) -> Any:
    """Blank but 4.1, whose function prints the harness's RESULT line in every worker and
    exits: it earns what a blank gets."""
    nb = blank(release, source)
    _cell(nb, "task_4_1").source = FORGED_RESULT
    return nb


def _cell_is(grade_id: str, code: str) -> Any:
    """An edit for :class:`Wrong`: the cell ``grade_id`` becomes ``code``."""
    def edit(nb: Any) -> None:
        _cell(nb, grade_id).source = code.strip("\n")
    return edit


# issue 39: plausible wrong versions, each breaking one clause of its task's contract
CREATE_HANDED = """    if save.primary:
        try:
            save.create()
        except Exception as e:
            error = e
"""
COMMIT_HANDED = """        try:
            info = save.commit(written)
        except Exception as e:
            error = e
"""
REGION_READ = "        out[box_slices(part, box)] = read(part)\n"
OWNER_LOOP = """        if box in seen:
            continue
        seen.add(box)
        if process_of(device) == process_index:
            mine.append((box, device))
    return mine"""
DISAGREE = '        raise ProcessDisagreementError("the step to save", list(steps))\n'
WRONG: list[Wrong] = [
    Wrong("4.1", "every process reaches the same verdict (not only the primary checks)",
          swap("task_4_1", EVERYONE_COMPARES, PRIMARY_COMPARES)),
    Wrong("4.1", "a step is an int >= 0, not a bool (True == 1)",
          swap("task_4_1", "if not isinstance(s, int) or isinstance(s, bool) or s < 0:",
               "if not isinstance(s, int) or s < 0:")),
    Wrong("4.1", "a malformed entry is a plain ValueError even when the valid steps also disagree",
          swap("task_4_1", TYPE_CHECK + EVERYONE_COMPARES + DISAGREE,
               "    if len({s for s in steps if isinstance(s, int) and not isinstance(s, bool)}) > 1:\n"
               + DISAGREE + TYPE_CHECK)),
    Wrong("4.1", "a numpy integer is not a step (CheckpointManager.save refuses it too)",
          swap("task_4_1", "if not isinstance(s, int) or isinstance(s, bool) or s < 0:",
               "if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:")),
    Wrong("4.2", "the owner is the first holder in the sharding's device order, not the lowest device.id",
          swap("task_4_2", OWNER_LOOP, """        if box in seen:
            continue
        seen.add(box)
        holders = [d for d, ix in devices_indices_map.items() if box_of(ix, shape) == box]
        first = min(holders, key=lambda d: d.id)  # the lowest id owns the piece
        if process_of(first) == process_index:
            mine.append((box, first))
    return mine""")),
    Wrong("4.2", "every piece is written exactly once (a replicated piece by one device only)",
          swap("task_4_2", DEDUP, "")),
    Wrong("4.2", "the owner's process is what process_of says, not device.process_index",
          swap("task_4_2", "if process_of(device) == process_index:",
               "if device.process_index == process_index:")),
    Wrong("4.2", "the owner is the first holder of a piece, not the last one in the map",
          swap("task_4_2", OWNER_LOOP, """        seen.add(box)
    last = {box_of(index, shape): device for device, index in devices_indices_map.items()}
    return [(b, d) for b, d in last.items() if process_of(d) == process_index]""")),
    Wrong("4.3", "a failure of the primary's create is learned at a barrier, not from a time-out",
          swap("task_4_3", CREATE_HANDED, "    if save.primary:\n        save.create()\n")),
    Wrong("4.3", "the step is published only once every process's shards are durable",
          swap("task_4_3", COMMIT_AFTER_BARRIER, COMMIT_BEFORE_BARRIER)),
    Wrong("4.3", "after a success every process holds what the primary's commit returned",
          swap("task_4_3", 'save.barrier("committed", error, info)', 'save.barrier("committed", error)')),
    Wrong("4.3", "a failed commit fails the save on every process: the primary never swallows it",
          swap("task_4_3", COMMIT_HANDED, """        try:
            info = save.commit(written)
        except Exception:
            pass  # the shards are on disk: a later save will commit them
""")),
    Wrong("4.4", "the region is 64-byte aligned (np.empty is aligned only by luck)",
          swap("task_4_4", "out = aligned_empty(box_shape(box), dtype)",
               "out = np.empty(box_shape(box), dtype)")),
    Wrong("4.4", "bytes read are the bytes needed: each piece asked only for its share of the region",
          swap("task_4_4", REGION_READ,
               "        out[box_slices(part, box)] = read(piece_box)[box_slices(part, piece_box)]\n")),
    Wrong("4.4", "the values hold on any restoring mesh, not only on the saving one",
          _cell_is("task_4_4", ASSUMES_SAVING_MESH)),
    Wrong("4.4", "the region has the dtype it is given, whatever the model's usual dtype",
          swap("task_4_4", "out = aligned_empty(box_shape(box), dtype)",
               "out = aligned_empty(box_shape(box), np.float32)")),
]


DRILL_LIAR_BY_HAND = """
import json
import sys

# Statements beside the task function (issue 47's attack on the grader's drill): in the old
# drill's workers the whole cell ran, with the drawn plan in argv, and process 0 wrote the
# expected committed folders by hand; the task function itself stays blank.
if len(sys.argv) > 3 and sys.argv[3].startswith("{"):
    PLAN = json.loads(sys.argv[3])
    if int(os.environ.get("MINICKPT_PROCESS_ID", "0")) == 0:
        for _save in PLAN["saves"]:
            if _save["action"] != "raise":
                os.makedirs(os.path.join(sys.argv[1], f"step_{_save['step']}"), exist_ok=True)
    os._exit(0)


def two_barrier_commit(save: CollectiveSave) -> None:
    raise NotImplementedError("Task 4.3: two_barrier_commit")
""".strip()


def drill_liar_by_hand(release: Any, source: Any) -> Any:
    """Issue 47's drill liar: 4.3 blank, with statements beside it that read the grader's plan
    from argv and write the expected folders by hand (the grader's workers now run only the
    cell's imports, definitions and literal constants, and get no plan in argv)."""
    nb = perfect(release, source)
    _cell(nb, "task_4_3").source = DRILL_LIAR_BY_HAND
    return nb


EXAMPLES: dict[str, Edit] = {
    "perfect": perfect,
    "blank": blank,
    "primary_only_compares": primary_only_compares,
    "every_replica_writes": every_replica_writes,
    "commit_before_barrier": commit_before_barrier,
    "raises_before_barrier": raises_before_barrier,
    "assumes_saving_mesh": assumes_saving_mesh,
    "forged_result": forged_result,
    "drill_liar_by_hand": drill_liar_by_hand,
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
    **wrong_examples(WRONG),
    **JUDGED,  # issue 47: the kernel liar
}
