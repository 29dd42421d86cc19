"""Writing a lab notebook the one way every generated file is written (validated, nbformat's
layout, a final newline), and the markers of a solution region. Shared by the build and the
example submissions, so neither imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def write_notebook(nb: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.validate(nb)
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
