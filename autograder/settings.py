"""nbgrader's configuration for this repository, in one function.

Used three ways: by ``autograder/nbgrader_config.py`` (for plain ``nbgrader`` commands), by the
build (labs/ from solutions/) and by the grader, which passes its own work folders. Layout::

    solutions/<lab>/<lab>.ipynb   nbgrader's *source*: solutions and hidden tests
    labs/<lab>/<lab>.ipynb        nbgrader's *release*: what students get (committed)
    .grading/                     submitted/, autograded/, feedback/, gradebook.db (ignored by git)
"""

from __future__ import annotations

import os
from typing import Any

from . import ROOT

COURSE_ID = "minickpt-course"
CELL_TIMEOUT = 60
"""Seconds a cell may run under the grader: ample for importing JAX and compiling a training
step on a slow 2-core machine, short enough that an endless loop costs one minute."""
SETUP_TIMEOUT = 300
"""Seconds for the locked setup cells (grade_id ``setup*``): they import JAX, Flax and Optax,
and a setup cell that times out would fail every test after it. Students cannot edit them: the
grader restores locked cells from the source."""
KERNEL = "python3"


def cell_timeout_for(default: int) -> Any:
    """nbclient's ``timeout_func``: the setup cells get :data:`SETUP_TIMEOUT`."""

    def timeout(cell: Any) -> int:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
        return max(SETUP_TIMEOUT, default) if str(gid).startswith("setup") else default

    return timeout


def configure(c: Any, *, root: str | os.PathLike[str] = ROOT, work: str | os.PathLike[str] = ".grading",
              source: str | os.PathLike[str] = "solutions", release: str | os.PathLike[str] = "labs",
              timeout: int = CELL_TIMEOUT, kernel: str = KERNEL) -> Any:
    """Fill the traitlets config ``c`` (directories are relative to ``root`` unless absolute)."""
    from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import (
        CheckCellMetadata,
        ClearHiddenTests,
        ClearMarkScheme,
        ClearOutput,
        ComputeChecksums,
        GetGrades,
        IncludeHeaderFooter,
        InstantiateTests,
        LockCells,
        SaveCells,
    )

    from .preprocessors import TaskStubs

    root = os.fspath(root)
    work_abs = os.path.join(root, os.fspath(work))
    os.makedirs(work_abs, exist_ok=True)  # sqlite cannot create the folder of its database
    cd = c.CourseDirectory
    cd.root = root
    cd.course_id = COURSE_ID
    cd.source_directory = os.fspath(source)
    cd.release_directory = os.fspath(release)
    cd.submitted_directory = os.path.join(os.fspath(work), "submitted")
    cd.autograded_directory = os.path.join(os.fspath(work), "autograded")
    cd.feedback_directory = os.path.join(os.fspath(work), "feedback")
    cd.solution_directory = os.path.join(os.fspath(work), "solution")
    cd.source_with_tests_directory = os.path.join(os.fspath(work), "source_with_tests")
    cd.db_url = "sqlite:///" + os.path.join(work_abs, "gradebook.db")

    # labs/ must be byte-reproducible: drop editor noise first, and give stubs their task IDs
    c.GenerateAssignment.preprocessors = [
        ClearMetadataPreprocessor, IncludeHeaderFooter, InstantiateTests, LockCells, TaskStubs,
        ClearOutput, CheckCellMetadata, ComputeChecksums, SaveCells, ClearHiddenTests,
        ClearMarkScheme, ComputeChecksums, CheckCellMetadata]
    c.ClearMetadataPreprocessor.enabled = True
    c.ClearMetadataPreprocessor.preserve_cell_metadata_mask = {"nbgrader", "tags", "deletable",
                                                               "editable"}
    c.ClearMetadataPreprocessor.preserve_nb_metadata_mask = {"kernelspec", ("language_info", "name")}

    # grading with plain `nbgrader autograde` (grade.sh does not use it: its own executor runs
    # the lab's cells under the referee, see autograder/grade.py); these keep it sensible
    # grading: students come from the submissions; deleted test cells come back
    c.Autograde.create_student = True
    c.OverwriteCells.add_missing_cells = True
    c.Execute.timeout = int(timeout)
    c.Execute.timeout_func = cell_timeout_for(int(timeout))
    c.Execute.interrupt_on_timeout = True
    c.Execute.startup_timeout = 120
    c.Execute.kernel_name = kernel
    # Minimal tracebacks: the failing check's message, without the hidden test's source lines
    c.Execute.extra_arguments = ["--HistoryManager.hist_file=:memory:",
                                 "--InteractiveShell.xmode=Minimal"]
    c.LimitOutput.max_lines = 300
    # feedback shows the tests' messages, never the hidden tests' code
    c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]
    return c
