"""Claims as checks: a chapter's sentence about the reader's run, checked in the cell that prints
the number.

A chapter says what *this* run shows only through these two functions, so that the prose can
never drift from the measurement:

* :func:`claim` — a deterministic statement (a count, an equality, bit-identity, an error
  raised, which steps are kept). It is asserted: if it stops holding, the chapter fails (in CI
  too) with the claim's own words and what was seen instead.
* :func:`verdict` — a measured statement that varies by machine (a timing, a ratio, "above the
  model"). It never fails: it prints whether this run agrees with the text, and if not, how it
  differs and what that means. The prose beside it says what to look for, never the outcome.

Both print one line starting with ``claim:`` or ``verdict:``, so a reader (and a test) can find
every checked sentence of a chapter in its output.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ClaimError(AssertionError):
    """A sentence of the chapter does not hold for this run: the text must change, or the code."""


def claim(ok: Any, text: str, *, seen: Any = None) -> None:
    """Assert the deterministic sentence ``text``; ``seen`` says what the run showed instead.

    ``ok`` must be a real ``bool`` (or numpy bool): an object whose truth is always ``True``
    must not make a sentence hold.
    """
    if not isinstance(ok, bool | np.bool_):
        raise TypeError(f"claim({text!r}): the condition must be a bool, got {type(ok).__name__}")
    if not ok:
        extra = "" if seen is None else f" (this run: {seen})"
        raise ClaimError(f"the chapter says: {text!r}, and this run contradicts it{extra}")
    print(f"claim: {text}  [holds]")


def verdict(ok: Any, text: str, *, otherwise: str, seen: Any = None) -> bool:
    """Print whether this run agrees with the measured sentence ``text``; return ``ok``.

    ``otherwise`` is what it means when the run differs (a busy machine, a fast disk ...):
    the reader learns something either way.
    """
    agrees = bool(ok)
    shown = "" if seen is None else f" ({seen})"
    if agrees:
        print(f"verdict: this run agrees: {text}{shown}")
    else:
        print(f"verdict: this run differs from '{text}'{shown}: {otherwise}")
    return agrees
