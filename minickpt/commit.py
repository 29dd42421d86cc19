"""The atomic, durable commit — the one moment a checkpoint starts to exist.

A save never writes into its final directory. It writes into a temporary directory whose name
can never be mistaken for a checkpoint, then:

1. fsyncs every file it wrote and every directory in the temporary tree — together, as one
   group commit, since none of these fsyncs depends on another,
2. renames the temporary directory to its final name — atomically, and never over an
   existing checkpoint,
3. fsyncs the parent directory, so that the rename itself survives a power cut.

Skip step 1 and a crash can leave a directory with the right name and empty files; skip step
3 and the rename can vanish. Deletion runs the other way round: a checkpoint is first renamed
to a deletion name (atomic, durable), and only then removed file by file, so a crash half-way
through a delete never leaves a half-deleted directory under a checkpoint's name.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterable

from .errors import StepAlreadyExistsError
from .fs import FileSystem, SyncBatch

TMP_MARK = ".minickpt-tmp-"
DELETE_MARK = ".minickpt-del-"
# A checkpoint that a restore found damaged and skipped, moved out of the step namespace so
# that the resumed run can save that step again; kept (never cleaned up) for a person to look at.
DAMAGED_MARK = ".minickpt-damaged-"
METADATA_FILE = "_CHECKPOINT_METADATA"


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------
def step_dir_name(step: int, prefix: str | None = "step", fixed_length: int | None = None) -> str:
    """``step_100`` (or ``step_00000100`` with ``fixed_length=8``, or ``100`` with no prefix)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    digits = f"{step:0{fixed_length}d}" if fixed_length else str(step)
    return f"{prefix}_{digits}" if prefix else digits


def parse_step(name: str, prefix: str | None = "step") -> int | None:
    """The step a directory name stands for, or None if it is not a checkpoint's name.

    Temporary and deletion names never parse: they carry a suffix the pattern rejects.
    """
    # ASCII digits only: \d would also take "step_٣" (Arabic-Indic 3) for step 3
    pat = rf"{re.escape(prefix)}_([0-9]+)" if prefix else r"([0-9]+)"
    m = re.fullmatch(pat, name)
    return int(m.group(1)) if m else None


def is_temporary(name: str) -> bool:
    """True for a directory left by an unfinished save or delete."""
    return TMP_MARK in name or DELETE_MARK in name


# ---------------------------------------------------------------------------------------
# commit
# ---------------------------------------------------------------------------------------
def make_temporary(fs: FileSystem, root: str, final_name: str) -> str:
    """Create the directory a save writes into: ``<final_name>.minickpt-tmp-<random>``."""
    path = os.path.join(root, f"{final_name}{TMP_MARK}{secrets.token_hex(4)}")
    fs.mkdir(path)
    return path


def commit(fs: FileSystem, tmp_dir: str, final_dir: str, *, subdirs: Iterable[str] = (),
           sync: SyncBatch | None = None) -> None:
    """Task 2.3 — make the fully written temporary directory ``tmp_dir`` the checkpoint
    ``final_dir``, atomically and durably.

    Receives the file system (every call goes through ``fs``), the temporary directory a
    save has written, the final name, the sub-directories the writers created in ``tmp_dir``
    (``subdirs``, relative names) and the writers' ``sync``: a :class:`~minickpt.fs.SyncBatch`
    holding the files they wrote but did not fsync (``None``: the caller made its files
    durable itself). Returns nothing. Guarantees, whenever a power cut strikes (during the
    commit or at any time after it returned):

    * ``final_dir`` is either absent or complete — every directory and every byte written
      into ``tmp_dir``; never a directory of that name with missing or torn contents;
    * once the commit has returned, ``final_dir`` is there for good;
    * an existing ``final_dir`` is never replaced nor changed, at any moment;
    * ``sync`` stays the caller's: the commit may flush it (which closes the files it holds),
      and the caller closes it.

    Raises :class:`~minickpt.errors.StepAlreadyExistsError` naming ``final_dir`` when it
    already exists; ``OSError`` with the same errno, saying the checkpoint is in place but
    could still be undone by a power cut, when making the commit durable fails after
    ``final_dir`` is in place (the caller must then not delete older checkpoints on its
    strength); any other error unchanged (``tmp_dir`` is then left for the caller to abort).
    """
    batch = sync if sync is not None else SyncBatch(fs)
    try:
        for sub in subdirs:
            batch.add_dir(os.path.join(tmp_dir, sub))
        batch.add_dir(tmp_dir)
        batch.flush()
    finally:
        if sync is None:
            batch.close()
    try:
        fs.rename(tmp_dir, final_dir)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise StepAlreadyExistsError(
                f"{final_dir} already exists: minickpt never replaces a committed checkpoint. "
                "Delete it first (manager.delete(step)) or save under another step.") from e
        raise
    parent = os.path.dirname(os.path.abspath(final_dir))
    try:
        fs.fsync_dir(parent)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e}: {final_dir} is complete and in place, but "
                               f"the fsync of {parent} failed, so a power cut could still undo "
                               "its rename", e.filename) from e


def abort(fs: FileSystem, tmp_dir: str) -> None:
    """Remove what a failed save left; never raises (the original error matters more)."""
    try:
        if fs.exists(tmp_dir):
            fs.rmtree(tmp_dir)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------
# deletion and cleanup
# ---------------------------------------------------------------------------------------
def delete_dir(fs: FileSystem, path: str) -> None:
    """Crash-safe deletion: rename out of the checkpoint namespace (durably), then remove."""
    fs.rmtree(retire_dir(fs, path))


def retire_dir(fs: FileSystem, path: str, *, durable: bool = True) -> str:
    """The first, atomic half of :func:`delete_dir`: rename ``path`` to a deletion name
    (and, when ``durable``, fsync the parent so that the rename survives a crash). From then
    on no reader sees the checkpoint; removing its files is :func:`remove_retired`.

    With ``durable=False`` a crash before the parent's next fsync may bring the checkpoint
    back — whole, since nothing of it is removed before that fsync — which is safe; its
    files must then only be removed through :func:`remove_retired`. Returns the new name.
    """
    root = os.path.dirname(os.path.abspath(path))
    doomed = f"{path}{DELETE_MARK}{secrets.token_hex(4)}"
    fs.rename(path, doomed)
    if durable:
        fs.fsync_dir(root)
    return doomed


def set_aside(fs: FileSystem, path: str) -> str:
    """Rename a damaged checkpoint out of the step namespace (durably) and return its new
    name, ``<step dir>.minickpt-damaged-<hex>``: it never parses as a step, is not a
    temporary (no cleanup removes it), and ``minickpt ls`` shows it as set aside."""
    aside = f"{path}{DAMAGED_MARK}{secrets.token_hex(4)}"
    fs.rename(path, aside)
    fs.fsync_dir(os.path.dirname(os.path.abspath(path)))
    return aside


def remove_retired(fs: FileSystem, doomed: str) -> None:
    """The second half of :func:`delete_dir`: make the retirement durable, then remove the
    files (a crash half-way leaves a deletion temporary, cleaned at the next start-up)."""
    fs.fsync_dir(os.path.dirname(os.path.abspath(doomed)))
    fs.rmtree(doomed)


def cleanup_temporaries(fs: FileSystem, root: str) -> list[str]:
    """Task 2.4 — remove what crashed saves and deletes left in ``root``; return the names
    removed, sorted.

    Receives the file system (every call through ``fs``) and a run directory. A crash can
    leave two kinds of leftovers: the temporary directory of a save that never committed
    and a checkpoint renamed for deletion whose files were not all removed (both carry one
    of minickpt's marks in their names). Guarantees: every such leftover in ``root`` is gone
    completely (a tree or a stray file, whatever the step prefix), and once this returns no
    power cut brings one back; nothing else is touched — a committed checkpoint of any
    prefix, the manager's lock file, a file of the user's that merely looks alike
    (``step_7.tmp``, ``notes.txt``): deleting a committed checkpoint here would lose exactly
    what the crash left intact. A ``root`` that does not exist holds nothing: ``[]``. Other
    ``OSError``s propagate. Call it only while no other writer uses ``root`` (the manager
    holds a lock for that): another writer's save in progress looks just like a crashed one.
    """
    removed = []
    try:
        names = fs.listdir(root)
    except FileNotFoundError:
        return removed
    doomed = [name for name in sorted(names) if is_temporary(name)]
    if any(DELETE_MARK in name for name in doomed):
        # a killed delete's rename may not be durable yet: removing its files first would
        # let a power cut bring the checkpoint back, torn, under its committed name
        fs.fsync_dir(root)
    for name in doomed:
        fs.rmtree(os.path.join(root, name))
        removed.append(name)
    if removed:
        fs.fsync_dir(root)
    return removed


def makedirs(fs: FileSystem, path: str) -> None:
    """Create ``path`` and its missing parents, each made durable (its parent fsynced)."""
    parent = os.path.dirname(path)
    if parent and parent != path and not fs.exists(parent):
        makedirs(fs, parent)
    try:
        fs.mkdir(path)
    except FileExistsError:
        return
    if parent:
        fs.fsync_dir(parent)
