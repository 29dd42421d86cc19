"""What the tests of the grader's drills share (tests/test_grader_drills*.py): a lab's solution
task cells as a student would hand them in; the ``box`` fixture is in conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def solution_cells(lab: str) -> list[str]:
    """The task cells of ``solutions/<lab>``, without nbgrader's solution markers."""
    nb = json.loads((ROOT / "solutions" / lab / f"{lab}.ipynb").read_text())
    return ["".join(line for line in c["source"] if line.strip() not in MARKERS)
            for c in nb["cells"]
            if c.get("metadata", {}).get("nbgrader", {}).get("grade_id", "").startswith("task_")]
