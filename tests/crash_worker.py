"""Worker processes for the SIGKILL and two-writer tests.

``python tests/crash_worker.py`` starts a *zygote*: it imports minickpt (and so JAX) once,
then forks a fresh child for each request read from stdin, so that twenty kills cost twenty
forks rather than twenty interpreter starts. Requests and replies are JSON lines:

    {"op": "fork", "fn": "save_loop", "args": {...}}  ->  {"pid": 1234}
    {"op": "wait", "pid": 1234}                       ->  {"pid": 1234, "status": -9}

Children never write to stdout (it is the zygote's reply channel); they report progress as
lines in a log file of their own (``saved 17``), written with one ``write`` each so that a
kill can cut the log only between lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

EXIT_REFUSED = 3  # the other writer holds the directory


def _log(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _warm_up() -> None:
    import jax

    jax.process_count()  # the first save would start JAX's runtime; do it before "ready"


def writer_items(step: int, writer: str, size: int = 1000) -> dict[str, Any]:
    """A checkpoint whose every item says which writer made it (to spot interleaving)."""
    import numpy as np

    off = {"A": 0, "B": 1000}[writer]
    return {"params": {"w": np.arange(size, dtype=np.float32) + step + off},
            "opt": {"tag": f"{writer}-{step}", "count": step + off}}


def save_loop(root: str, log: str, size: int, max_to_keep: int, seconds: float) -> int:
    """Resume from the latest checkpoint and save every step until killed."""
    from crash_harness import items

    from minickpt import CheckpointManager, CheckpointManagerOptions

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _warm_up()
    _log(fd, "ready")
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=max_to_keep)) as m:
        _log(fd, f"open {len(m.removed_temporaries)}")
        step = (m.latest_step() or 0) + 1
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m.save(step, items(step, size))
            _log(fd, f"saved {step}")
            step += 1
    return 0


def writer(root: str, log: str, name: str, steps: list[int], start_at: float,
           wait_for_lock: bool, lock: bool = True) -> int:
    """Open a manager at ``start_at`` (with or without waiting for the lock) and save."""
    from minickpt import CheckpointManager, CheckpointManagerOptions, MiniCkptError
    from minickpt.errors import StepAlreadyExistsError

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _warm_up()
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + 60
    while True:
        try:
            m = CheckpointManager(root, CheckpointManagerOptions(lock=lock))
            break
        except MiniCkptError as e:
            if not wait_for_lock or time.monotonic() > deadline:
                _log(fd, "refused " + json.dumps(str(e)))
                return EXIT_REFUSED
            time.sleep(0.01)
    with m:
        for s in steps:
            try:
                m.save(s, writer_items(s, name), force=True)
                _log(fd, f"saved {s}")
            except StepAlreadyExistsError:
                _log(fd, f"exists {s}")
    return 0


def churn(root: str, log: str, seconds: float, size: int = 20000) -> int:
    """Save continuously with max_to_keep=2: every save also deletes a checkpoint."""
    from crash_harness import items

    from minickpt import CheckpointManager, CheckpointManagerOptions

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _warm_up()
    _log(fd, "ready")
    with CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2)) as m:
        step = (m.latest_step() or 0) + 1
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m.save(step, items(step, size))
            step += 1
    _log(fd, f"done {step - 1}")
    return 0


FUNCS = {"save_loop": save_loop, "writer": writer, "churn": churn}


def zygote() -> None:
    import minickpt  # noqa: F401 - the point: import once, fork many times

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    sys.stdin.close()
                    code = FUNCS[req["fn"]](**req["args"]) or 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            print(json.dumps({"pid": pid}), flush=True)
        elif req["op"] == "wait":
            _, status = os.waitpid(req["pid"], 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"pid": req["pid"], "status": code}), flush=True)


if __name__ == "__main__":
    zygote()
