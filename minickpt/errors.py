"""Errors minickpt raises.

Each error says what was wrong and where (the checkpoint, the item, the leaf), so that a
person reading a traceback at 3 a.m. knows which file to look at and what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class MiniCkptError(Exception):
    """Base class of every error minickpt raises on purpose."""


class CheckpointNotFoundError(MiniCkptError, FileNotFoundError):
    """The directory or the step asked for does not exist."""


class StepAlreadyExistsError(MiniCkptError, FileExistsError):
    """A committed checkpoint already has this step; minickpt never silently replaces one."""


class CheckpointCorruptedError(MiniCkptError):
    """A checkpoint on disk is damaged: missing files, bad JSON, wrong sizes or checksums."""

    def __init__(self, path: str, reason: str, *, leaf: str | None = None):
        self.path = str(path)
        self.leaf = leaf
        self.reason = reason
        where = f"{self.path}" + (f" (leaf {leaf})" if leaf is not None else "")
        super().__init__(f"damaged checkpoint at {where}: {reason}")


class UnsafeCheckpointError(CheckpointCorruptedError):
    """A checkpoint tries something a trusted one never does (escape its directory, pickle)."""


class FormatVersionError(CheckpointCorruptedError):
    """The checkpoint was written by a format this version of minickpt does not read."""


class CheckpointTooLargeError(MiniCkptError, MemoryError):
    """Restoring would need more memory than this machine has; refused before allocating."""


class UnsupportedLeafError(MiniCkptError, TypeError):
    """A leaf of the tree cannot be stored without pickle (an object array, a function...)."""


@dataclass(frozen=True)
class Mismatch:
    """One difference between what was saved and what the restore target expects."""

    path: str
    kind: str  # "missing" | "unexpected" | "shape" | "dtype" | "kind"
    saved: str | None = None
    expected: str | None = None

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"  {self.path}: in the target but not in the checkpoint"
        if self.kind == "unexpected":
            return f"  {self.path}: in the checkpoint but not in the target"
        return f"  {self.path}: {self.kind} differs (saved {self.saved}, target {self.expected})"


class StructureMismatchError(MiniCkptError, ValueError):
    """The saved tree and the restore target differ; lists every difference at once."""

    def __init__(self, item: str, mismatches: Sequence[Mismatch], hint: str = ""):
        self.item = item
        self.mismatches = list(mismatches)
        lines = [f"item '{item}' does not match its restore target ({len(self.mismatches)} "
                 f"difference{'s' if len(self.mismatches) != 1 else ''}):"]
        lines += [str(m) for m in self.mismatches]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))
