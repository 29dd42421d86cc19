"""The course machinery: building labs/ from solutions/ and grading submitted labs.

* ``python -m autograder.build``  regenerates solution cells from minickpt, labs/ with nbgrader,
  and the example submissions (``--check`` only compares, for CI).
* ``bash autograder/grade.sh``    grades submissions (``python -m autograder.grade``).

See docs/LABS.md for the conventions lab authors follow.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: nbgrader's course directory."""


def tools_on_path() -> None:
    """Put this interpreter's bin/ first on PATH: nbgrader runs ``alembic`` (and the kernel
    spec runs ``python``) by name, and they must be the ones of this environment."""
    import os
    import sys

    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path
