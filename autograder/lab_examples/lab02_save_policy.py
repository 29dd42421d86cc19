"""Lab 2's example submissions: perfect, blank, partial, and one typical mistake per task.

Each mistake is the reference code with one realistic change (the expected grades, written by
hand, are in ``autograder/examples/expected-lab02_save_policy.csv``).
"""

from __future__ import annotations

from typing import Any

from .common import Edit, Wrong, _answers, _cell, _replace, blank, perfect, swap, wrong_examples
from .hostile import ISSUE_20, JUDGED, ROUND_4

INTERVAL = "    return step % save_interval_steps == 0 or step in save_on_steps"
NEWEST = "        keep = set(steps[-max_to_keep:]) if max_to_keep > 0 else set()"
FLUSH = "        batch.add_dir(tmp_dir)\n        batch.flush()\n"
MATCH = "    doomed = [name for name in sorted(names) if is_temporary(name)]"
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
    _replace(nb, "task_2_4", MATCH,
             '    doomed = [name for name in sorted(names) if "tmp" in name or "del" in name]')
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




# -- issue 39: plausible wrong versions, each breaking one clause of its task's contract ----
FIRST_SAVE = "    if last_saved_step is None:\n        return True\n"
LEGACY_WALK = "            if s != 0 and s - last_kept >= keep_every_n_steps:"
NEWEST_SORTED = "    steps = sorted(i.step for i in infos)\n    if max_to_keep is None"
SUBDIRS = "        for sub in subdirs:\n            batch.add_dir(os.path.join(tmp_dir, sub))\n"
PARENT_FSYNC_ERROR = """    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e}: {final_dir} is complete and in place, but "
                               f"the fsync of {parent} failed, so a power cut could still undo "
                               "its rename", e.filename) from e"""
REMOVALS = """    for name in sorted(names):
        if is_temporary(name):
            fs.rmtree(os.path.join(root, name))
            removed.append(name)
"""
DOOMED = """    doomed = [name for name in sorted(names) if is_temporary(name)]
    if any(DELETE_MARK in name for name in doomed):
        # a killed delete's rename may not be durable yet: removing its files first would
        # let a power cut bring the checkpoint back, torn, under its committed name
        fs.fsync_dir(root)
    for name in doomed:
        fs.rmtree(os.path.join(root, name))
        removed.append(name)
"""

WRONG: list[Wrong] = [
    # 2.1 should_save
    Wrong("2.1", "True only when nothing is saved (last_saved_step is None), not for a last "
          "saved step 0: `if not last_saved_step` saves step 3 after step 0 with I=5",
          swap("task_2_1", FIRST_SAVE, "    if not last_saved_step:\n        return True\n")),
    Wrong("2.1", "never at or before last_saved_step: `step < last_saved_step` saves the last "
          "saved step again",
          swap("task_2_1", "    if step <= last_saved_step:", "    if step < last_saved_step:")),
    Wrong("2.1", "never at or before last_saved_step, save_on_steps included: an extra step "
          "checked first goes back in time",
          swap("task_2_1", FIRST_SAVE, "    if step in save_on_steps:\n        return True\n"
               + FIRST_SAVE)),
    Wrong("2.1", "nothing saved yet: save whatever the step (a run resumed at step 7 saves at "
          "7), not only on the interval",
          swap("task_2_1", FIRST_SAVE, "    if last_saved_step is None:\n"
               "        return step % save_interval_steps == 0 or step in save_on_steps\n")),
    # 2.2 steps_to_keep, legacy_steps_to_keep
    Wrong("2.2", "the newest step has no special protection: a new checkpoint worse than the "
          "best N is dropped at once (here it is always kept)",
          swap("task_2_2", "    if keep_period:\n        keep |=",
               "    keep.add(steps[-1])  # never delete the checkpoint just saved\n"
               "    if keep_period:\n        keep |=")),
    Wrong("2.2", "max_to_keep=0 keeps none by the max_to_keep rule: `steps[-0:]` is every step",
          swap("task_2_2", NEWEST, "        keep = set(steps[-max_to_keep:])")),
    Wrong("2.2", "infos may come in any order and must not be changed: sorting the caller's "
          "list in place",
          swap("task_2_2", NEWEST_SORTED, "    infos.sort(key=lambda i: i.step)  # oldest first\n"
               "    steps = [i.step for i in infos]\n    if max_to_keep is None")),
    Wrong("2.2", "Flax's keep_every_n_steps is a distance from the last step kept in the walk, "
          "not `step % n == 0`",
          swap("task_2_2", LEGACY_WALK, "            if s != 0 and s % keep_every_n_steps == 0:")),
    Wrong("2.2", "Flax never keeps step 0 by the keep_every_n_steps rule (it tests the step "
          "for truth first)",
          swap("task_2_2", LEGACY_WALK, "            if s - last_kept >= keep_every_n_steps:")),
    # 2.3 commit
    Wrong("2.3", "once commit has returned final_dir is there for good: no fsync of the parent "
          "after the rename, so a power cut can undo it",
          swap("task_2_3", "    parent = os.path.dirname(os.path.abspath(final_dir))\n    try:\n"
               "        fs.fsync_dir(parent)\n", "    parent = os.path.dirname(os.path.abspath("
               "final_dir))\n    try:\n        pass  # the rename is atomic: it is done\n")),
    Wrong("2.3", "final_dir is never incomplete: every directory written into tmp_dir (the "
          "subdirs too) is durable before the rename; here only tmp_dir itself",
          swap("task_2_3", SUBDIRS, "")),
    Wrong("2.3", "raises StepAlreadyExistsError only when final_dir exists (EEXIST/ENOTEMPTY); "
          "any other error unchanged: here every OSError of the rename becomes 'exists'",
          swap("task_2_3", "        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):\n",
               "        if True:  # the rename failed: final_dir is taken\n")),
    Wrong("2.3", "a failed fsync after the rename raises OSError with that errno, saying the "
          "checkpoint is in place: here a RuntimeError without the errno",
          swap("task_2_3", PARENT_FSYNC_ERROR, "    except OSError as e:\n"
               "        raise RuntimeError(f\"could not fsync {parent}: {e}\") from e")),
    # 2.4 cleanup_temporaries
    Wrong("2.4", "once it returns no power cut brings a removed name back, and a committed step "
          "is never torn: no fsync of the run directory before removing a -del- leftover "
          "whose rename may not be durable",
          swap("task_2_4", DOOMED, REMOVALS)),
    Wrong("2.4", "every leftover of a crashed save *or delete* is removed: only TMP_MARK is "
          "matched, a half-deleted checkpoint stays",
          swap("task_2_4", "    doomed = [name for name in sorted(names) if is_temporary(name)]",
               "    doomed = [name for name in sorted(names) if TMP_MARK in name]")),
    Wrong("2.4", "other OSErrors propagate unchanged: a removal that fails is skipped, and the "
          "leftover stays while the manager opens as if all were clean",
          swap("task_2_4", "        fs.rmtree(os.path.join(root, name))\n        removed.append(name)\n",
               "        try:\n            fs.rmtree(os.path.join(root, name))\n"
               "        except OSError:\n            continue  # never block opening the run\n"
               "        removed.append(name)\n")),
    Wrong("2.4", "a leftover is gone completely whether it is a directory tree or a stray file: "
          "only directories are removed",
          swap("task_2_4", "    doomed = [name for name in sorted(names) if is_temporary(name)]",
               "    doomed = [name for name in sorted(names) if is_temporary(name)\n"
               "              and fs.is_dir(os.path.join(root, name))]")),
]


EXAMPLES: dict[str, Edit] = {
    **JUDGED,  # issue 47: the kernel liar
    "perfect": perfect,
    "blank": blank,
    "partial": partial,
    "off_by_one_interval": off_by_one_interval,
    "keeps_oldest": keeps_oldest,
    "commit_without_fsync": commit_without_fsync,
    "commit_rename_first": commit_rename_first,
    "commit_replaces_existing": commit_replaces_existing,
    "cleanup_too_greedy": cleanup_too_greedy,
    **wrong_examples(WRONG),  # issue 39: wrong_a, wrong_b ... (one wrong version per task)
    **ISSUE_20, **ROUND_4,  # issue 20's four classes in one submission (cheap: see make_examples)
}
