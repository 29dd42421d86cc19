"""What a submission writes, made safe for where the grader puts it: the instructor's terminal,
a spreadsheet, the output folder's logs.

A test's error text, a reason, a review flag come from the student's code (a check's message
is whatever the submission made it raise), and they reach three sinks that interpret bytes:

* **the terminal**: escape sequences (``ESC [ 2 J`` clears the screen, ``ESC ] ...`` sets the
  title or a hyperlink, ``\\r`` overwrites a line, bidi overrides reorder it).
  :func:`printable` writes every control and format character as a visible ``\\x..`` /
  ``\\u....`` escape (newlines and tabs stay); :class:`SafeStream` applies it to everything the
  grader prints, so no message needs to remember to.
* **a spreadsheet**: a cell that begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage
  return is a formula to Excel, LibreOffice and Google Sheets (``=HYPERLINK(...)``,
  ``=cmd|...``). :func:`csv_cell` applies OWASP's rule (prefix such a cell with ``'``, which the
  spreadsheet shows as text), except plain numbers; :func:`writer` and :func:`dict_writer` are
  ``csv.writer`` / ``csv.DictWriter`` that apply it, and :func:`printable`, to every cell. Every
  CSV the grader writes goes through them.
* **the disk**: :func:`copy_capped` copies a log keeping its head and its tail.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_KEEP = {"\n", "\t"}
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
"""OWASP's characters that make a cell a formula, and their full-width forms (LibreOffice
reads ``＝`` as ``=``)."""
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


def _unsafe_ranges() -> str:
    """A regex class of every control (Cc), format (Cf: bidi overrides, zero-width ...),
    line/paragraph separator and surrogate code point, but ``\\n`` and ``\\t``."""
    ranges: list[list[int]] = []
    for c in [*range(0x30000), *range(0xE0000, 0xE1000)]:  # where Unicode assigns any of them
        if 0xD800 <= c <= 0xDFFF or (chr(c) not in _KEEP and unicodedata.category(chr(c))
                                       in ("Cc", "Cf", "Zl", "Zp")):
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


_UNSAFE = re.compile(f"[{_unsafe_ranges()}]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def printable(text: Any) -> str:
    """``text`` with every control, format and line/paragraph-separator character (but ``\\n``
    and ``\\t``) written as a visible escape: nothing in it can move the cursor, recolour,
    retitle, reorder or clear a terminal."""
    return _UNSAFE.sub(_escape, str(text))


def csv_cell(value: Any) -> Any:
    """A CSV cell no spreadsheet reads as a formula (OWASP: a leading ``'``), printable."""
    if not isinstance(value, str):
        return value
    value = printable(value)
    if value.startswith(FORMULA_START) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


class _Writer:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def writerow(self, row: Iterable[Any]) -> Any:
        return self._inner.writerow([csv_cell(v) for v in row])

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        for row in rows:
            self.writerow(row)


class _DictWriter(_Writer):
    def writeheader(self) -> Any:
        return self._inner.writeheader()

    def writerow(self, row: dict[str, Any]) -> Any:  # type: ignore[override]
        return self._inner.writerow({k: csv_cell(v) for k, v in row.items()})


def writer(f: Any, **kw: Any) -> _Writer:
    """``csv.writer(f)`` whose every cell is :func:`csv_cell`."""
    return _Writer(csv.writer(f, **kw))


def dict_writer(f: Any, fieldnames: list[str], **kw: Any) -> _DictWriter:
    """``csv.DictWriter(f, fieldnames)`` whose every cell is :func:`csv_cell`."""
    return _DictWriter(csv.DictWriter(f, fieldnames=[csv_cell(n) for n in fieldnames], **kw))


class SafeStream(io.TextIOBase):
    """A text stream that writes :func:`printable` text to ``raw``: the grader's stdout and
    stderr while it grades (see :func:`autograder.grade.main`)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def write(self, s: str) -> int:
        self.raw.write(printable(s))
        return len(s)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", "utf-8")


def unwrapped(stream: Any) -> Any:
    """The stream below a :class:`SafeStream` (for a progress bar's own ``\\r``)."""
    return stream.raw if isinstance(stream, SafeStream) else stream


@contextlib.contextmanager
def safe_terminal() -> Iterator[None]:
    """While it lasts, everything printed to stdout and stderr is :func:`printable`."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SafeStream(sys.stdout), SafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def copy_capped(src: Path, dest: Path, limit: int) -> int:
    """Copy at most ``limit`` bytes of ``src`` to ``dest``: all of it when it is no larger,
    else its first and last halves and a line that says how much was left out (a log's start
    says how the kernel began, its end how it ended). Returns the bytes left out."""
    size = os.path.getsize(src)
    with open(src, "rb") as f, open(dest, "wb") as out:
        if size <= limit:
            while chunk := f.read(1 << 20):
                out.write(chunk)
            return 0
        half = limit // 2
        out.write(f.read(half))
        f.seek(size - half)
        left = size - 2 * half
        out.write(f"\n[grader] ... {left} bytes of this log were not copied ...\n".encode())
        out.write(f.read(half))
        return left
