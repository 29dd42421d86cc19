"""Lab 5's example submissions (async): the perfect and blank ones, a partial one, and one
typical mistake per task, each graded as ``autograder/examples/expected-lab05_async.csv`` says."""

from __future__ import annotations

from typing import Any

from .common import Edit, _answers, _replace, blank, perfect
from .hostile import ISSUE_20

COPIED = "    return to_host(x, copy=True, path=path)"
SHARED = "    return to_host(x, path=path)  # to_host already brings it to the host"

IN_FLIGHT_CHECK = '''        if writer._thread is not None and writer._thread.is_alive():
            raise MiniCkptError(f"cannot start the background save of {what}: the save of "
                                f"{writer._what} is still in flight (wait() first)")
'''
NOT_DAEMON = "name=f\"{writer.name}:{what}\", daemon=False)"
DAEMON = "name=f\"{writer.name}:{what}\", daemon=True)  # never blocks the exit"

KEEP = '''    except BaseException as e:  # kept for the training loop, never swallowed
        e.add_note(f"minickpt: raised in the background by the async save of {what}")
        with writer._lock:
            writer._error = e'''
SWALLOW = '''    except Exception as e:  # don't crash the training run over a checkpoint
        print(f"warning: the async save of {what} failed: {e}")'''

STALL = "        stall += max(0.0, min(unblocked, prev_end) - start)"
NO_STALL = "        stall += 0.0  # a stall shows up in blocked_s anyway"
HIDDEN = '''        for s0, s1 in steps:
            hidden += max(0.0, min(end, s1) - max(unblocked, s0))'''
WALL_TIME = "        hidden += end - unblocked  # the loop was free again from unblocked on"


def partial(release: Any, source: Any) -> Any:
    """5.1 right; 5.2's thread is a daemon (a normal exit would kill a pending save); 5.3
    never counts a stall; 5 of 8 quiz answers right."""
    nb = perfect(release, source)
    _replace(nb, "task_5_2", NOT_DAEMON, DAEMON)
    _replace(nb, "task_5_3", STALL, NO_STALL)
    _answers(nb, Q2='{"A"}', Q4="0.5", Q6="0.0")
    return nb


def shares_memory(release: Any, source: Any) -> Any:
    """5.1's snapshot is ``to_host`` without the copy: a numpy leaf changed in place after
    ``save()`` returns changes the checkpoint."""
    nb = perfect(release, source)
    _replace(nb, "task_5_1", COPIED, SHARED)
    return nb


def swallows_errors(release: Any, source: Any) -> Any:
    """5.2's thread prints the error of a failed write and forgets it: the training loop
    never hears that its checkpoint was not committed."""
    nb = perfect(release, source)
    _replace(nb, "task_5_2", KEEP, SWALLOW)
    return nb


def two_in_flight(release: Any, source: Any) -> Any:
    """5.2 starts a second save while one is still in flight (no check of the running
    thread): the manager, which waits first, still works, but a second caller of
    ``writer.start`` gets two writes at once (the writer's test and async_faulty_run)."""
    nb = perfect(release, source)
    _replace(nb, "task_5_2", IN_FLIGHT_CHECK, "")
    return nb


def wall_time_overlap(release: Any, source: Any) -> Any:
    """5.3 counts every second of a write after ``save()`` returned as hidden, whether a
    step was computing or not (wall time only)."""
    nb = perfect(release, source)
    _replace(nb, "task_5_3", HIDDEN, WALL_TIME)
    return nb


EXAMPLES: dict[str, Edit] = {
    "perfect": perfect, "blank": blank, "partial": partial, "shares_memory": shares_memory,
    "swallows_errors": swallows_errors, "two_in_flight": two_in_flight,
    "wall_time_overlap": wall_time_overlap,
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
}
