"""Which code wrote a checkpoint: the git commit and branch of the working tree the training
process was started in, read from ``.git`` directly — no ``git`` process, nothing that can make a
save fail. Set ``MINICKPT_GIT=0`` to leave it out.

Part of the core because every checkpoint's metadata records it (``checkpointer.writer_info``);
:mod:`minickpt.production.versioning` re-exports it for chapter 6.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

_SHA = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")  # SHA-1, or SHA-256 repositories
_MAX_GIT_FILE = 64 << 20


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def _find_git_dir(start: str) -> tuple[str, str, str] | None:
    """(worktree root, git dir, common dir) for the repository containing ``start``."""
    d = os.path.abspath(start)
    while True:
        dot = os.path.join(d, ".git")
        if os.path.isdir(dot):
            git_dir = dot
        elif os.path.isfile(dot):  # a linked worktree or a submodule: "gitdir: <path>"
            text = _read(dot) or ""
            if not text.startswith("gitdir:"):
                return None
            git_dir = os.path.normpath(os.path.join(d, text[len("gitdir:"):].strip()))
        else:
            parent = os.path.dirname(d)
            if parent == d:
                return None
            d = parent
            continue
        common = _read(os.path.join(git_dir, "commondir"))
        common_dir = os.path.normpath(os.path.join(git_dir, common.strip())) if common \
            else git_dir
        return d, git_dir, common_dir


def _resolve_ref(ref: str, git_dir: str, common_dir: str) -> str | None:
    for base in (git_dir, common_dir):  # per-worktree refs first, then shared ones
        text = _read(os.path.join(base, *ref.split("/")))
        if text is not None and _SHA.match(text.strip()):
            return text.strip()
    try:
        with open(os.path.join(common_dir, "packed-refs"), encoding="utf-8",
                  errors="replace") as f:
            for n, line in enumerate(f):
                if n * 100 > _MAX_GIT_FILE:
                    break
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref and _SHA.match(parts[0]):
                    return parts[0]
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=16)
def _git_info_cached(start: str) -> dict[str, Any] | None:
    found = _find_git_dir(start)
    if found is None:
        return None
    root, git_dir, common_dir = found
    head = (_read(os.path.join(git_dir, "HEAD")) or "").strip()
    if head.startswith("ref:"):
        ref = head[4:].strip()
        branch = ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else ref
        commit = _resolve_ref(ref, git_dir, common_dir)  # None on a branch with no commit yet
    elif _SHA.match(head):
        branch, commit = None, head  # detached HEAD
    else:
        return None
    return {"commit": commit, "branch": branch, "root": root}


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The commit and branch of the git working tree containing ``path`` (default: the
    current directory), or None outside a repository. Read once per directory per process;
    never raises."""
    if os.environ.get("MINICKPT_GIT", "1").lower() in ("0", "false", "no", "off"):
        return None
    try:
        start = os.fspath(path) if path is not None else os.getcwd()
        info = _git_info_cached(os.path.abspath(start))
        return dict(info) if info is not None else None
    except Exception:  # metadata is a courtesy: it must never fail a save
        return None
