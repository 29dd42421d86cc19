"""Hints on request: ``lab.hint("2.3")`` shows a task's first hint (the idea),
``lab.hint("2.3", 2)`` its second (a plan).

Why not folded ``<details>`` blocks in the notebook: a student who dumps the notebook as text,
or skims it before coding, reads them all. The texts live on the instructor's side
(``solutions/hints/<lab>.md``); what ships with the kit is :mod:`.hints_data`, written by
``python -m autograder.build`` (``--check`` fails when it is out of date) and compressed so
that neither a skim nor a grep of the package shows a hint before it is asked for.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from typing import Any

# at import, not in a function: the referee's private copy of the kit is not in sys.modules
from . import hints_data
from .checks import LabCheckError

LEVELS = {1: "the idea", 2: "a plan"}


def encode_hints(hints: dict[str, dict[int, str]]) -> str:
    """Task → level → text, as the ASCII the kit ships (compressed, then base64)."""
    data = {t: {str(lv): txt for lv, txt in sorted(levels.items())}
            for t, levels in sorted(hints.items(), key=lambda kv: _key(kv[0]))}
    raw = json.dumps(data, ensure_ascii=False, sort_keys=True).encode()
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def decode_hints(blob: str) -> dict[str, dict[int, str]]:
    """The inverse of :func:`encode_hints`."""
    data = json.loads(zlib.decompress(base64.b64decode(blob)).decode())
    return {t: {int(lv): txt for lv, txt in levels.items()} for t, levels in data.items()}


def parse_hints_md(text: str, where: str = "hints.md") -> dict[str, dict[int, str]]:
    """A hints file: ``## X.Y`` per task, then ``### 1`` and ``### 2``, each with its text.
    A task without both levels, or a level with no text, is an authoring mistake: raise."""
    hints: dict[str, dict[int, str]] = {}
    task: str | None = None
    level: int | None = None
    for n, line in enumerate(text.split("\n"), 1):
        m2, m3 = re.match(r"^## (\d+\.\d+)\s*$", line), re.match(r"^### (\d+)\s*$", line)
        if m2:
            task, level = m2.group(1), None
            if task in hints:
                raise ValueError(f"{where}:{n}: task {task} appears twice")
            hints[task] = {}
        elif m3:
            if task is None:
                raise ValueError(f"{where}:{n}: a hint level before any '## X.Y' task heading")
            level = int(m3.group(1))
            if level not in LEVELS:
                raise ValueError(f"{where}:{n}: hint level {level}: only {sorted(LEVELS)} exist")
            hints[task][level] = ""
        elif task is not None and level is not None:
            hints[task][level] += line + "\n"
    for t, levels in hints.items():
        for lv in LEVELS:
            if not levels.get(lv, "").strip():
                raise ValueError(f"{where}: task {t} has no hint {lv} ({LEVELS[lv]})")
        hints[t] = {lv: txt.strip() for lv, txt in levels.items()}
    return hints


def _key(task: str) -> tuple[int, ...]:
    return tuple(int(p) for p in task.split("."))


def _all() -> dict[str, dict[int, str]]:
    return decode_hints("".join(hints_data.BLOB))


def hint(task: str, level: int = 1) -> Any:
    """Show hint ``level`` (1: the idea, 2: a plan) of lab task ``task`` (``"2.3"``).

    In Jupyter it is rendered as Markdown; elsewhere it is printed. Returns nothing to keep.
    """
    hints = _all()
    task = str(task).removeprefix("Task ").strip()
    if task not in hints:
        raise LabCheckError(f"no hints for task {task!r}: the tasks are "
                            f"{', '.join(sorted(hints, key=_key))}")
    if level not in LEVELS or isinstance(level, bool):
        raise LabCheckError(f"hint level {level!r} of task {task}: use 1 ({LEVELS[1]}) "
                            f"or 2 ({LEVELS[2]})")
    text = f"**Task {task}, hint {level} ({LEVELS[level]}).** {hints[task][level]}"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None  # type: ignore[assignment]
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(text))
    else:
        print(text)
    return None
