"""Copying a step between the local disk and a mirror store: :func:`upload_step` and
:func:`fetch_step` (split from :mod:`.mirror`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..checkpointer import Checkpointer
from ..commit import METADATA_FILE, abort, commit, make_temporary
from ..errors import CheckpointCorruptedError
from ..fs import FileSystem
from .lease import Writer
from .mirror import COMMIT_SUCCESS_FILE, UPLOAD_MARKER, read_chunks

log = logging.getLogger("minickpt")


def walk(listdir: Callable[[str], list[str]], is_dir: Callable[[str], bool], rel: str
         ) -> tuple[list[str], list[str]]:
    """(directories, files) under ``rel``, relative to it, parents before children."""
    dirs, files = [], []
    for name in sorted(listdir(rel)):
        sub = f"{rel}/{name}" if rel else name
        if is_dir(sub):
            d2, f2 = walk(listdir, is_dir, sub)
            dirs += [name] + [f"{name}/{d}" for d in d2]
            files += [f"{name}/{f}" for f in f2]
        else:
            files.append(name)
    return dirs, files


def _check_copy(store: Any, rel: str, metadata: bytes | None) -> None:
    """Re-read the mirror's copy and verify every checksum (CheckpointCorruptedError)."""
    problems = store.verify(rel) if metadata is None else store.verify(rel, metadata=metadata)
    if problems:
        raise CheckpointCorruptedError(store.path(rel), "the mirror copy does not verify: "
                                       + "; ".join(problems))


def upload_step(store: Any, writer: Writer, lfs: FileSystem, src: str, name: str) -> int:
    """Copy the committed local checkpoint ``src`` to ``name`` in the mirror with the
    mirror's own atomic commit; returns the bytes copied. The caller has checked that
    ``name`` is free (or removed what was its own there)."""
    dirs, files = walk(lambda r: lfs.listdir(os.path.join(src, r)),
                       lambda r: lfs.is_dir(os.path.join(src, r)), "")
    files.sort(key=lambda f: f == METADATA_FILE)
    if METADATA_FILE not in files:
        raise CheckpointCorruptedError(src, "has no metadata: not a committed checkpoint")
    sizes = {f: lfs.lstat(os.path.join(src, f)).st_size for f in files}
    meta = lfs.read_file(os.path.join(src, METADATA_FILE))
    # Without a rename the commit marker is the publication: every other file is uploaded
    # and verified (the metadata served from memory) before the metadata, then the marker.
    verify_first = not store.atomic_rename
    tmp = store.new_upload(name, writer)  # the in-progress marker: the first object
    nbytes, beat = 0, time.monotonic()
    try:
        for d in dirs:
            store.makedirs(f"{tmp}/{d}")
        for f in files:  # the metadata, which makes a checkpoint valid, goes last
            if time.monotonic() - beat > store.stale_after_s / 10:
                store.begin(tmp, writer, "upload")  # still alive, for readers elsewhere
                beat = time.monotonic()
            if f == METADATA_FILE and verify_first:
                # every file there, whole (one listing), and every leaf's checksum
                there = store.sizes(tmp)
                wrong = [f"{g}: {there.get(g, 'missing')} bytes of {sizes[g]}"
                         for g in files if g != f and there.get(g) != sizes[g]]
                if wrong:
                    raise OSError(f"{store.path(tmp)}: " + "; ".join(wrong))
                _check_copy(store, tmp, meta)
            n = store.write_file(f"{tmp}/{f}", read_chunks(lfs, os.path.join(src, f)))
            # (the files before the metadata were sized above, from one listing)
            got = store.size(f"{tmp}/{f}") if not verify_first or f == METADATA_FILE else n
            if n != sizes[f] or got != sizes[f]:
                raise OSError(f"{store.path(f'{tmp}/{f}')}: wrote {n} bytes of "
                              f"{sizes[f]}, {got} there")
            nbytes += n
        if not verify_first:
            _check_copy(store, tmp, None)
        store.check_lease(writer)  # fenced: a writer whose lease was taken publishes nothing
        store.commit(tmp, name, dirs, writer)
    except BaseException:
        store.abort_upload(tmp, writer)
        raise
    return nbytes


def fetch_step(store: Any, lfs: FileSystem, root: str, name: str,
               replace: Callable[[], None]) -> None:
    """Copy the mirror's ``name`` back into the local ``root``: into a temporary directory,
    verify every checksum, ``replace()`` a damaged local copy, commit."""
    final = os.path.join(root, name)
    tmp = make_temporary(lfs, root, name)
    try:
        dirs, files = walk(store.listdir, store.is_dir, name)
        for d in dirs:
            lfs.mkdir(os.path.join(tmp, d))
        for f in files:
            if f in (COMMIT_SUCCESS_FILE, UPLOAD_MARKER):  # the mirror's own files
                continue
            lfs.write_file(os.path.join(tmp, f), store.read_chunks(f"{name}/{f}"))
        rep = Checkpointer(lfs).verify(tmp, deep=True)
        if not rep.ok:
            raise CheckpointCorruptedError(store.path(name), "the mirror's copy is damaged "
                                           "too: " + "; ".join(rep.problems))
        if lfs.exists(final):
            replace()
        commit(lfs, tmp, final, subdirs=dirs)
    except BaseException:
        abort(lfs, tmp)
        raise
