"""One batch of one task's mutants, in a fresh process: ``python -m autograder.mutation.worker
TASK OUT.jsonl [DONE.txt]``.

Why a process of its own: ``run_tests`` (issue 47's judge) sets ``XLA_FLAGS`` before it imports
JAX, so JAX must not be loaded yet; and a mutant that hangs or kills its process must cost only
itself. The parent (``python -m autograder.mutation``) reads OUT.jsonl as it grows: a ``start``
line before each mutant, a result line after it, and kills this process when a mutant runs past
its bound (a time-out is a kill: the tests noticed). Many mutants of one task share the process,
so JAX, the setup cell and the training steps' compilations are paid once.

A mutant is run through the task's test cells one at a time, the cheapest (measured on the
unmutated reference) first, and stops at the first that fails: killed. The unmutated
reference must pass every one of the task's cells first (drills included: ``grader_drill`` is
lent as the grader lends it), or the task is not measured.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def _write(out: Any, record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()
    os.fsync(out.fileno())


def _tools(sources: dict[str, str], root: Path) -> dict[str, Any]:
    """``grader_drill`` as the grader lends it to a grader check, over ``sources`` (the
    lab's task functions as code, one of them the mutant): the drill's workers run that code
    as they would a student's cells. Plain processes here (no sandbox): the code is ours."""
    from autograder import drills, sandbox

    box = drills.Box(sandbox.unsandboxed("the mutation harness runs reference code only"), 0,
                     sandbox.Limits(), {}, root)
    return {"grader_drill": drills.tool(list(sources.values()), box)}


def _run(run_tests: Any, lab: str, functions: dict[str, Any], grade_ids: list[str],
         tools: dict[str, Any]) -> Any:
    """``run_tests`` as the judge runs a lab's tests: a test's own drill of a task the grader
    drills is the grader's drill (``autograder.judge.session.judge_lab``)."""
    from minickpt.labkit.processes import DRILL_KEY, launched_by

    with launched_by(**{DRILL_KEY: tools["grader_drill"].for_test}):
        return run_tests(lab, functions, grade_ids, tools=tools)


def main(argv: list[str]) -> int:
    task, out_path = argv[0], Path(argv[1])
    done = set(Path(argv[2]).read_text().split()) if len(argv) > 2 else set()
    if hasattr(os, "nice"):
        os.nice(5)  # a shared machine: the team's interactive work first
    from autograder.judge.cells import run_tests  # before JAX: it chooses the devices

    from . import mutants as M

    lab = M.lab_of(task)
    refs = M.lab_functions(lab)
    originals = {f.__name__: f for f in M.task_functions(task)}
    grade_ids = M.test_cells(task)
    sources = {name: M.source_of(fn) for name, fn in M.lab_functions(lab, recompile=False).items()}
    scratch = Path(tempfile.mkdtemp(prefix="mutation-drills-"))
    with out_path.open("a", encoding="utf-8") as out:
        t0 = time.monotonic()
        base = _run(run_tests, lab, refs, grade_ids, _tools(sources, scratch))
        failed = [v for v in base if not v.passed]
        _write(out, {"baseline": [[v.grade_id, v.passed, round(v.seconds, 2), v.message[:300]]
                                  for v in base], "seconds": round(time.monotonic() - t0, 1), "digest": M.task_digest(task)})
        if failed:
            return 3  # the reference fails its own tests: nothing about mutants can be said
        order = [v.grade_id for v in sorted(base, key=lambda v: v.seconds)]
        for m in M.task_mutants(task):
            if m.id in done:
                continue
            _write(out, {"start": m.id, "at": time.time()})
            t = time.monotonic()
            try:
                fn = M.compile_mutant(m, originals[m.function])
            except Exception as e:
                _write(out, {"id": m.id, "status": "killed", "by": "definition",
                             "message": f"{type(e).__name__}: {e}"[:300], "seconds": 0.0})
                continue
            functions = {**refs, m.function: fn}
            status, by, message = "survived", None, ""
            for gid in order:
                try:
                    (v,) = _run(run_tests, lab, functions, [gid],
                                _tools({**sources, m.function: m.source}, scratch))
                    ok, msg = v.passed, v.message
                except BaseException as e:
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    ok, msg = False, "".join(traceback.format_exception_only(e)).strip()
                if not ok:
                    status, by, message = "killed", gid, msg
                    break
            _write(out, {"id": m.id, "status": status, "by": by, "message": message[:300],
                         "seconds": round(time.monotonic() - t, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
