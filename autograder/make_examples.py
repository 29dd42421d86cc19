"""The example submissions in ``autograder/examples/<student>/<lab>/<lab>.ipynb``, written by
the build from the released lab, so that they follow the lab when it changes.

Each example is the released notebook as a student would hand it in: ``perfect`` fills every
task with the reference code and answers the quiz right; the others start from ``perfect`` (or
from the blank release) and make one kind of mistake the grader must handle. Their expected
scores, per task, are in ``autograder/examples/expected-<lab>.csv`` (written by hand: the point
is to check the grader against what a person expects; tests/test_grading_hardening.py compares).

Each lab's examples live with that lab, in ``autograder/lab_examples/<lab>.py``: a module with
its own ``EXAMPLES: dict[str, Edit]`` (and, where the lab brings a new kind of attack, a
``TOUR``), made from the helpers of ``lab_examples/common.py`` (``perfect``, ``blank``,
``_cell``, ``_replace``, ``_append`` ...) and the lab-independent hostile parts of
``lab_examples/hostile.py``. Lab 1's module holds the hostile corpus, one example of each kind.
This module only gathers them and writes them.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
from pathlib import Path
from typing import Any

import nbformat

from .lab_examples.common import Edit, blank
from .notebook_io import write_notebook

EXAMPLES: dict[str, dict[str, Edit]] = {}
TOUR: dict[str, tuple[str, ...]] = {}
"""What ``grade.sh`` with no argument grades besides every lab's ``perfect``, ``partial`` and
``blank`` (:func:`autograder.grade.example_tour`): each lab module's ``TOUR`` (see
``lab_examples/lab01_basics.py``)."""


CROSS_LAB = ("copies", "reached", "independent", "edges")
"""Modules of ``lab_examples/`` whose ``EXAMPLES`` are ``{lab: {student: edit}}``: issue 31's
copies (minickpt's code or another student's handed in), the task's reference reached from
the student's code, ``partial`` written independently (it replaces the lab module's) and the
grader's own edges (issue 38: ``edges``, lab 1 only); their
expected rows are in each lab's ``expected-<lab>.csv``."""


def _other_labs() -> None:
    """Gather the examples of every lab that has a module in ``autograder/lab_examples/``."""
    from . import lab_examples

    for info in sorted(pkgutil.iter_modules(lab_examples.__path__), key=lambda m: m.name):
        if not info.name.startswith("lab"):  # common, hostile: what the labs' modules use
            continue
        mod = importlib.import_module(f"{lab_examples.__name__}.{info.name}")
        EXAMPLES[info.name] = dict(mod.EXAMPLES)
        TOUR[info.name] = tuple(getattr(mod, "TOUR", ()))
    for name in CROSS_LAB:  # attacks on the grading that fit several labs: lab -> examples
        mod = importlib.import_module(f"{lab_examples.__name__}.{name}")
        for lab, examples in mod.EXAMPLES.items():
            EXAMPLES[lab].update(examples)


_other_labs()


def write_examples(labs: Path, solutions: Path, out: Path) -> None:
    """Write every example of every lab that has examples."""
    for lab, examples in EXAMPLES.items():
        release = nbformat.read(labs / lab / f"{lab}.ipynb", as_version=4)
        source = nbformat.read(solutions / lab / f"{lab}.ipynb", as_version=4)
        for student, make in examples.items():
            dest = out / student / lab / f"{lab}.ipynb"
            if make is blank:  # byte for byte what students download
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(labs / lab / f"{lab}.ipynb", dest)
            else:
                _write(make(release, source), dest)


def _write(nb: Any, dest: Path) -> None:
    """build's write_notebook; a notebook holding a lone surrogate (odd_source: valid JSON,
    not encodable text) is written with ASCII escapes, as a student's editor could."""
    try:
        write_notebook(nb, dest)
    except UnicodeEncodeError:
        import json

        nbformat.validate(nb)
        dest.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=True) + "\n",
                        encoding="ascii")
