"""Errors minickpt raises.

Each error says what was wrong and where (the checkpoint, the item, the leaf), so that a
person reading a traceback at 3 a.m. knows which file to look at and what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class MiniCkptError(Exception):
    """Base class of every error minickpt raises on purpose."""


class CheckpointNotFoundError(MiniCkptError, FileNotFoundError, ValueError):
    """The directory or the step asked for does not exist.

    A ``FileNotFoundError`` (what Orbax raises) and also a ``ValueError`` (what Flax's legacy
    ``restore_checkpoint`` raises for a missing step), so both ``except`` styles keep working.
    """


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


# ---------------------------------------------------------------------------------------
# multi-host (chapter 4)
# ---------------------------------------------------------------------------------------
class MultiHostError(MiniCkptError):
    """A collective save or restore failed on some process; the message names which and why.

    ``errno`` is that of the first process that failed with a file-system error (ENOSPC on
    one host's disk, say), so that callers can tell a full disk from a dead peer.
    """

    errno: int | None = None


class PeerTimeoutError(MultiHostError, TimeoutError):
    """Some processes did not reach a barrier (or publish a value) within the time-out.

    ``missing`` lists every process that did not arrive: it died, hangs, or runs other code.
    """

    def __init__(self, what: str, missing: Sequence[int], timeout_s: float, detail: str = ""):
        self.what = what
        self.missing = sorted(set(missing))
        self.timeout_s = timeout_s
        procs = ", ".join(map(str, self.missing)) or "unknown"
        msg = (f"{what}: process(es) {procs} did not arrive within {timeout_s:g} s "
               "(dead, hung, or running different code)")
        super().__init__(msg + (f"; {detail}" if detail else ""))


class ProcessDisagreementError(MultiHostError, ValueError):
    """Processes passed different values where they must agree (the step of a save...)."""

    def __init__(self, what: str, values: Sequence[object]):
        self.what = what
        self.values = list(values)
        groups: dict[str, list[int]] = {}
        for p, v in enumerate(self.values):
            groups.setdefault(repr(v), []).append(p)
        parts = [f"process{'es' if len(ps) > 1 else ''} {_ranges(ps)}: {v}"
                 for v, ps in sorted(groups.items(), key=lambda kv: kv[1][0])]
        super().__init__(f"processes disagree on {what}: " + "; ".join(parts)
                         + ". Every process must call this with the same value.")


def _ranges(ps: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: short even with thousands of processes."""
    out: list[str] = []
    start = prev = None
    for p in [*ps, None]:
        if start is not None and (p is None or p != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if p is not None and start is None:
            start = p
        prev = p
    return ", ".join(out)
