"""Lab 2's example submissions: perfect, blank, partial, and one typical mistake per task.

Each mistake is the reference code with one realistic change (the expected grades, written by
hand, are in ``autograder/examples/expected-lab02_save_policy.csv``).
"""

from __future__ import annotations

from typing import Any

from .common import Edit, _answers, _replace, blank, perfect
from .hostile import ISSUE_20

INTERVAL = "    return step % save_interval_steps == 0 or step in save_on_steps"
NEWEST = "        keep = set(steps[-max_to_keep:]) if max_to_keep > 0 else set()"
FLUSH = "        batch.add_dir(tmp_dir)\n        batch.flush()\n"
MATCH = "        if is_temporary(name):"
NOT_BACKWARDS = "    if step <= last_saved_step:\n        return False\n"
EEXIST = """    try:
        fs.rename(tmp_dir, final_dir)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise StepAlreadyExistsError(
                f"{final_dir} already exists: minickpt never replaces a committed checkpoint. "
                "Delete it first (manager.delete(step)) or save under another step.") from e
        raise
"""
ROOT_FSYNC = "    if removed:\n        fs.fsync_dir(root)\n"


def off_by_one_interval(release: Any, source: Any) -> Any:
    """Task 2.1 counts steps from 1: it saves at steps 4, 9, 14 ... for an interval of 5."""
    nb = perfect(release, source)
    _replace(nb, "task_2_1", INTERVAL,
             "    return (step + 1) % save_interval_steps == 0 or step in save_on_steps")
    return nb


def keeps_oldest(release: Any, source: Any) -> Any:
    """Task 2.2 keeps the max_to_keep *oldest* steps: every save deletes the newest ones."""
    nb = perfect(release, source)
    _replace(nb, "task_2_2", NEWEST,
             "        keep = set(steps[:max_to_keep]) if max_to_keep > 0 else set()")
    return nb


def commit_without_fsync(release: Any, source: Any) -> Any:
    """Task 2.3 closes the writers' files instead of fsyncing them, then renames: tmp +
    rename, as in the seeds."""
    nb = perfect(release, source)
    _replace(nb, "task_2_3", FLUSH, "        batch.add_dir(tmp_dir)\n"
             "        batch.close()  # the rename is atomic: no need to wait for the disk\n")
    return nb


def cleanup_too_greedy(release: Any, source: Any) -> Any:
    """Task 2.4 removes every name containing "tmp" or "del": a run with step_prefix="model"
    loses its committed checkpoints, and the user's step_9.tmp goes too."""
    nb = perfect(release, source)
    _replace(nb, "task_2_4", MATCH, '        if "tmp" in name or "del" in name:')
    return nb


def partial(release: Any, source: Any) -> Any:
    """2.1 may save backwards (no check against the last saved step); 2.2 right; 2.3 lets the
    rename's EEXIST through as a bare OSError; 2.4 never fsyncs the directory; 6 of 10 quiz
    answers right."""
    nb = perfect(release, source)
    _replace(nb, "task_2_1", NOT_BACKWARDS, "")
    _replace(nb, "task_2_3", EEXIST, "    fs.rename(tmp_dir, final_dir)\n")
    _replace(nb, "task_2_4", ROOT_FSYNC, "")
    _answers(nb, Q1='"B"', Q4="23", Q7='{"A", "C"}', Q10="10.0")
    return nb


EXAMPLES: dict[str, Edit] = {
    "perfect": perfect,
    "blank": blank,
    "partial": partial,
    "off_by_one_interval": off_by_one_interval,
    "keeps_oldest": keeps_oldest,
    "commit_without_fsync": commit_without_fsync,
    "cleanup_too_greedy": cleanup_too_greedy,
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
}
