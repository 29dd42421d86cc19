"""nbgrader preprocessors of this course."""

from __future__ import annotations

import re
from typing import Any

from nbgrader.preprocessors import ClearSolutions

TASK_IN_SOURCE = re.compile(r"Task (\d+\.\d+)")
DEF = re.compile(r"^\s*def\s+([A-Za-z_]\w*)\s*\(")
ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*)\s*=")


class TaskStubs(ClearSolutions):
    """nbgrader's ClearSolutions, with stubs that say what they stand for.

    * In a task function (its docstring starts with "Task 1.3"), the solution becomes
      ``raise NotImplementedError("Task 1.3: plan_leaf")`` under ``# YOUR CODE HERE``, so an
      unfinished task fails with its ID, which one search finds everywhere (CONTRIBUTING.md).
    * A quiz answer (``Q3 = "D"``) becomes ``Q3 = None  # YOUR ANSWER HERE``: the cell still
      runs, and the answer's visible test says what form the answer takes.

    A code solution region anywhere else is an authoring mistake and stops the build.
    """

    def _replace_solution_region(self, cell: Any, language: str) -> bool:
        if cell.cell_type != "code":
            return super()._replace_solution_region(cell, language)
        out: list[str] = []
        region: list[str] | None = None
        indent = ""
        task = func = None
        replaced = False
        for line in cell.source.split("\n"):
            if self.begin_solution_delimeter in line:
                if region is not None:
                    raise RuntimeError(f"nested BEGIN SOLUTION in cell:\n{cell.source}")
                region, indent = [], re.match(r"\s*", line).group(0)
            elif self.end_solution_delimeter in line:
                if region is None:
                    raise RuntimeError(f"END SOLUTION without BEGIN SOLUTION in cell:\n{cell.source}")
                out += [indent + s for s in self._stub(region, task, func, cell.source)]
                region, replaced = None, True
            elif region is not None:
                region.append(line)
            else:
                out.append(line)
                if (m := DEF.match(line)) is not None:
                    func, task = m.group(1), None
                if task is None and (m := TASK_IN_SOURCE.search(line)) is not None:
                    task = m.group(1)
        if region is not None:
            raise RuntimeError(f"BEGIN SOLUTION without END SOLUTION in cell:\n{cell.source}")
        cell.source = "\n".join(out)
        return replaced

    @staticmethod
    def _stub(region: list[str], task: str | None, func: str | None, source: str) -> list[str]:
        code = [s for s in region if s.strip() and not s.strip().startswith("#")]
        names = [ASSIGN.match(s) for s in code]
        if code and all(m is not None and m.group(1).startswith("Q") for m in names):
            return [f"{m.group(1)} = None  # YOUR ANSWER HERE" for m in names if m is not None]
        if task is None or func is None:
            raise RuntimeError("a solution region must lie in a task function (docstring "
                               "'Task X.Y — ...') or hold quiz answers (Q1 = ...); cell:\n"
                               + source)
        return ["# YOUR CODE HERE", f'raise NotImplementedError("Task {task}: {func}")']
