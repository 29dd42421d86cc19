"""Lab 2's example submissions: perfect, blank, partial, and one typical mistake per task.

Each mistake is the reference code with one realistic change (the expected grades, written by
hand, are in ``autograder/examples/expected-lab02_save_policy.csv``).
"""

from __future__ import annotations

from typing import Any

from .common import Edit, _answers, _cell, _replace, blank, perfect
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


RENAME_FIRST = '''
def commit(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    """Task 2.3 — mine: publish first (the rename is atomic), then make it all durable."""
    try:
        fs.rename(tmp_dir, final_dir)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise StepAlreadyExistsError(f"{final_dir} already exists") from e
        raise
    batch = sync if sync is not None else SyncBatch(fs)
    try:
        for sub in subdirs:
            batch.add_dir(os.path.join(final_dir, sub))
        batch.add_dir(final_dir)
        batch.flush()
    finally:
        if sync is None:
            batch.close()
    try:
        fs.fsync_dir(os.path.dirname(os.path.abspath(final_dir)))
    except OSError as e:
        raise OSError(e.errno, f"{final_dir} is in place, but its rename could be undone") from e
'''.strip()


def commit_rename_first(release: Any, source: Any) -> Any:
    """Task 2.3 renames first and fsyncs afterwards (every call of the protocol, in the wrong
    order): a power cut between the rename and the flush leaves step_N with torn files."""
    nb = perfect(release, source)
    _cell(nb, "task_2_3").source = RENAME_FIRST
    return nb


def commit_replaces_existing(release: Any, source: Any) -> Any:
    """Task 2.3 makes room like seed 000's MiniCheckpointer: an existing final_dir is removed
    (rmtree) before the rename. The manager never commits onto a saved step, so only the
    commit's own crash test finds it: a crash between the two calls loses the checkpoint."""
    nb = perfect(release, source)
    _replace(nb, "task_2_3", "    try:\n        fs.rename(tmp_dir, final_dir)\n",
             "    if fs.exists(final_dir):  # a re-run of this step: make room for the new one\n"
             "        fs.rmtree(final_dir)\n    try:\n        fs.rename(tmp_dir, final_dir)\n")
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
    "commit_rename_first": commit_rename_first,
    "commit_replaces_existing": commit_replaces_existing,
    "cleanup_too_greedy": cleanup_too_greedy,
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
}
