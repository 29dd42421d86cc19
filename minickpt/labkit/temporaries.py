"""Small conveniences for test cells: temporary directories, a flipped byte, a quiet stderr,
the records of a log."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def tempdir(parent: str | None = None) -> Iterator[str]:
    """A fresh directory (in ``parent``, else the system's temporary folder), removed
    afterwards."""
    d = tempfile.mkdtemp(prefix="minickpt-lab-", dir=parent)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def flip_byte(path: str, offset: int) -> None:
    """Damage one byte of a file, the way a bad disk or a bad copy would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def quiet_stderr() -> None:
    """Send what would go to stderr (warnings, log messages) to stdout from now on.

    nbgrader scores a test cell 0 when it writes anything to stderr, and JAX warns on
    stderr; a warning must not cost a student points. The text stays visible.
    """
    sys.stderr = sys.stdout


class _Records(logging.Handler):
    """Keeps every record it is handed, in order."""

    def __init__(self, records: list[logging.LogRecord], level: int) -> None:
        super().__init__(level)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logged(name: str = "minickpt", level: int = logging.INFO
           ) -> Iterator[list[logging.LogRecord]]:
    """The records the log ``name`` (and its children) receives at ``level`` or above while
    the block runs, so a test can check that a function said why (``log.info(...)``).

    The log is lowered to ``level`` for the block if it would drop those records, and left
    as it was afterwards (its level and its handlers).
    """
    log = logging.getLogger(name)
    records: list[logging.LogRecord] = []
    handler = _Records(records, level)
    old = log.level
    log.addHandler(handler)
    if not log.isEnabledFor(level):
        log.setLevel(level)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        if log.level != old:
            log.setLevel(old)
