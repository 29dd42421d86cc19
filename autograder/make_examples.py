"""The example submissions in ``autograder/examples/<student>/<lab>/<lab>.ipynb``, written by
the build from the released lab, so that they follow the lab when it changes.

Each example is the released notebook as a student would hand it in: ``perfect`` fills every
task with the reference code and answers the quiz right; the others start from ``perfect`` (or
from the blank release) and make one kind of mistake the grader must handle. Their expected
scores, per task, are in ``autograder/examples/expected.csv`` (written by hand: the point is to
check the grader against what a person expects).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat

from .build import BEGIN, END, write_notebook

Edit = Callable[[Any, Any], Any]


def _cell(nb: Any, grade_id: str) -> Any:
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            return c
    raise KeyError(f"no cell with grade_id {grade_id!r}")


def _replace(nb: Any, grade_id: str, old: str, new: str) -> None:
    cell = _cell(nb, grade_id)
    if old not in cell.source:
        raise ValueError(f"example edit: {old!r} not found in cell {grade_id}; update "
                         "autograder/make_examples.py to the new reference code")
    cell.source = cell.source.replace(old, new, 1)


def perfect(release: Any, source: Any) -> Any:
    """Every solution cell of the release gets the reference code (markers removed)."""
    nb = copy.deepcopy(release)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            src = _cell(source, meta["grade_id"]).source
            cell.source = "\n".join(line for line in src.split("\n")
                                    if line.strip() not in (BEGIN, END))
    return nb


# ---------------------------------------------------------------------------------------
# lab 1's examples
# ---------------------------------------------------------------------------------------
LEXICAL_RESTORE = '''
def restore_checkpoint(ckpt_dir, target, step=None, prefix="checkpoint_", *, partial=False, fs=None):
    """Task 1.4 — my own version: the newest checkpoint is the last name in sorted order."""
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    if re.fullmatch(re.escape(prefix) + r"\\d+", os.path.basename(ckpt_dir)) and os.path.isdir(ckpt_dir):
        path = ckpt_dir
    elif step is not None:
        path = os.path.join(ckpt_dir, f"{prefix}{step}")
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"Matching checkpoint not found: {path}")
    else:
        names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith(prefix)) if os.path.isdir(ckpt_dir) else []
        if not names:
            return target
        path = os.path.join(ckpt_dir, names[-1])
    return Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)[ITEM]
'''.strip()

NP_GENERIC_FIRST = '''    if isinstance(x, np.generic):  # before Python scalars: np.float64 subclasses float
        x = np.asarray(x)
    elif x is None or isinstance(x, (*SCALAR_TYPES, HostKey)):
        return x'''
NP_GENERIC_LAST = '''    if x is None or isinstance(x, (*SCALAR_TYPES, HostKey)):
        return x
    if isinstance(x, np.generic):
        x = np.asarray(x)'''
LITTLE_ENDIAN = """        entry.update(kind="array", dtype=dtype_name(host.dtype), shape=list(host.shape))
        buf = _as_bytes(host)"""
NATIVE_ORDER = """        entry.update(kind="array", dtype=dtype_name(host.dtype), shape=list(host.shape))
        buf = host.reshape(-1).view(np.uint8)  # the raw bytes, as they are in memory"""
CRC_CHECK = '''    if verify and "crc32" in entry:
        got = zlib.crc32(raw)'''
NO_CRC_CHECK = '''    if False:  # checksums later
        got = zlib.crc32(raw)'''


def _answers(nb: Any, **answers: str) -> None:
    for name, value in answers.items():
        _cell(nb, f"quiz_{name.lower()}").source = f"{name} = {value}"


def partial(release: Any, source: Any) -> Any:
    """Task 1.1 right; 1.2 misses np.float64 (a float subclass); 1.3 writes bytes in the
    machine's order, not little-endian; 1.4 finds the newest checkpoint by sorting names;
    7 of 11 quiz answers right."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)
    _replace(nb, "task_1_3", LITTLE_ENDIAN, NATIVE_ORDER)
    _cell(nb, "task_1_4").source = LEXICAL_RESTORE
    _answers(nb, Q2='"B"', Q7="100.0", Q9='"B"', Q10="{100, 400}")
    return nb


def blank(release: Any, source: Any) -> Any:
    """The released lab, handed in untouched."""
    return copy.deepcopy(release)


def syntax_error(release: Any, source: Any) -> Any:
    """Task 1.2's cell does not even parse (a colon is missing); the rest is right."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", "elif x is None or isinstance(x, (*SCALAR_TYPES, HostKey)):",
             "elif x is None or isinstance(x, (*SCALAR_TYPES, HostKey))")
    return nb


def edited_test(release: Any, source: Any) -> Any:
    """Task 1.3 skips the checksum, and both of its test cells were replaced by ``pass``."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", CRC_CHECK, NO_CRC_CHECK)
    for gid in ("test_1_3_leaf", "test_1_3_minickpt"):
        _cell(nb, gid).source = "pass"
    return nb


def deleted_cell(release: Any, source: Any) -> Any:
    """``unflatten_like`` returns the target unchanged, and both task 1.1 test cells and one
    quiz test cell were deleted."""
    nb = perfect(release, source)
    cell = _cell(nb, "task_1_1")
    head, _, _ = cell.source.rpartition("def unflatten_like")
    cell.source = head + ('def unflatten_like(target, values):\n'
                          '    """Task 1.1 (back) — mine: the target already has the right shape."""\n'
                          '    return target')
    gone = {"test_1_1_names", "test_1_1_minickpt", "test_quiz_q5"}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") not in gone]
    return nb


def never_finishes(release: Any, source: Any) -> Any:
    """``restore_checkpoint`` loops forever; the grader must stop that cell and go on."""
    nb = perfect(release, source)
    _replace(nb, "task_1_4", "    fs = fs or DEFAULT_FS\n",
             "    while True:  # waiting for the checkpoint to appear\n        pass\n"
             "    fs = fs or DEFAULT_FS\n")
    return nb


EXAMPLES: dict[str, dict[str, Edit]] = {
    "lab01_basics": {
        "perfect": perfect, "partial": partial, "blank": blank, "syntax_error": syntax_error,
        "edited_test": edited_test, "deleted_cell": deleted_cell,
        "never_finishes": never_finishes,
    },
}


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
                write_notebook(make(release, source), dest)
