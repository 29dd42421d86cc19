"""Lab 5's example submissions (async): the perfect and blank ones, a partial one, and one
typical mistake per task, each graded as ``autograder/examples/expected-lab05_async.csv`` says."""

from __future__ import annotations

from typing import Any

from .common import Edit, Wrong, _answers, _replace, blank, perfect, swap, wrong_examples
from .hostile import ISSUE_20, JUDGED, ROUND_4

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


# -- issue 39: plausible wrong versions, each breaking one clause of its task ------------------
PIN_BLOCK = """    if pin and isinstance(x, jax.Array):
        view = pinned_view(x)
        if view is not None:
            return view
"""
LOCKED_START = """    with writer._lock:
        if writer._thread is not None and writer._thread.is_alive():
            raise MiniCkptError(f"cannot start the background save of {what}: the save of "
                                f"{writer._what} is still in flight (wait() first)")
        if writer._error is not None:
            raise MiniCkptError(f"cannot start the background save of {what}: the error "
                                f"of the save of {writer._what} was not collected yet")
        thread = threading.Thread(target=run_in_background, args=(writer, fn, what),
                                  name=f"{writer.name}:{what}", daemon=False)
        thread.start()  # under the lock: a thread set but not started would look finished
        writer._thread, writer._what = thread, what
"""
UNLOCKED_START = """    if writer._thread is not None and writer._thread.is_alive():
        raise MiniCkptError(f"cannot start the background save of {what}: the save of "
                            f"{writer._what} is still in flight (wait() first)")
    if writer._error is not None:
        raise MiniCkptError(f"cannot start the background save of {what}: the error "
                            f"of the save of {writer._what} was not collected yet")
    thread = threading.Thread(target=run_in_background, args=(writer, fn, what),
                              name=f"{writer.name}:{what}", daemon=False)
    writer._thread, writer._what = thread, what  # set first, so that wait() finds it
    thread.start()
"""
UNREPORTED_CHECK = """        if writer._error is not None:
            raise MiniCkptError(f"cannot start the background save of {what}: the error "
                                f"of the save of {writer._what} was not collected yet")
"""


def _no_locking(nb: Any) -> None:
    """No lock anywhere: the check, the set of ``_thread`` (before ``start()``), the error."""
    _replace(nb, "task_5_2", LOCKED_START, UNLOCKED_START)
    _replace(nb, "task_5_2", """        with writer._lock:
            writer._error = e""", """        writer._error = e""")
    _replace(nb, "task_5_2", """    with writer._lock:
        err, writer._error = writer._error, None""", """    err, writer._error = writer._error, None""")


WRONG: list[Wrong] = [
    # 5.1
    Wrong("5.1", "pin=True: a view only where the probe says JAX pins (np.asarray without asking)",
          swap("task_5_1", PIN_BLOCK, """    if pin and isinstance(x, jax.Array) and not is_prng_key(x):
        return np.asarray(x)  # zero-copy on CPU: JAX pins the buffer while the view lives
""")),
    Wrong("5.1", "raises UnsupportedLeafError now for a leaf minickpt cannot store (object array)",
          swap("task_5_1", COPIED, """    if isinstance(x, np.ndarray):
        return x.copy()  # a numpy leaf: memory of its own is the photo
""" + COPIED)),
    Wrong("5.1", "pin=True costs no copy where JAX pins the buffer (always copying is time lost)",
          swap("task_5_1", PIN_BLOCK, "")),
    Wrong("5.1", "an array deleted or donated before the call raises, never returns a value",
          swap("task_5_1", PIN_BLOCK, """    if isinstance(x, jax.Array) and x.is_deleted():
        return None  # nothing left to save
""" + PIN_BLOCK)),
    # 5.2
    Wrong("5.2", "one save in flight: no locking at all, _thread set before start() (races)",
          _no_locking),
    Wrong("5.2", "no failure lost: a BaseException (KeyboardInterrupt) raised by fn is kept too",
          swap("task_5_2", "    except BaseException as e:  # kept for the training loop, never swallowed",
               "    except Exception as e:  # a failed write is kept for the training loop")),
    Wrong("5.2", "check_for_errors() never waits for the disk (guarantee 5)",
          swap("task_5_2", """    with writer._lock:
        err, writer._error = writer._error, None""", """    writer.wait()  # let the write in flight finish, then look at its error
    with writer._lock:
        err, writer._error = writer._error, None""")),
    Wrong("5.2", "no save over an unreported failure: a start before it was raised is refused",
          swap("task_5_2", UNREPORTED_CHECK, "")),
    # 5.3
    Wrong("5.3", "stall_s is only the wait for the previous write, not the whole save() call",
          swap("task_5_3", STALL,
               "        stall += (unblocked - start) if prev_end > start else 0.0")),
    Wrong("5.3", "saves come in any order (the previous save is the one before in time)",
          swap("task_5_3", "    saves = sorted(saves)", "    saves = list(saves)")),
    Wrong("5.3", "with no saves every value is 0.0, a float",
          swap("task_5_3", "    blocked = stall = write = hidden = 0.0",
               "    blocked = stall = write = hidden = 0")),
    Wrong("5.3", "hidden_s counts a step only while the write still runs (not past its end)",
          swap("task_5_3", "hidden += max(0.0, min(end, s1) - max(unblocked, s0))",
               "hidden += max(0.0, s1 - max(unblocked, s0))")),
]


EXAMPLES: dict[str, Edit] = {
    **JUDGED,  # issue 47: the kernel liar
    "perfect": perfect, "blank": blank, "partial": partial, "shares_memory": shares_memory,
    "swallows_errors": swallows_errors, "two_in_flight": two_in_flight,
    "wall_time_overlap": wall_time_overlap,
    **ISSUE_20, **ROUND_4,  # issue 20's four classes in one submission (cheap: see make_examples)
    **wrong_examples(WRONG),  # issue 39: wrong_a ... one wrong version per task each
}
