"""The copy queue: one background thread that copies steps to the mirror, one at a time,
each retried with a bounded exponential backoff, and what became of each.

It knows nothing of checkpoints: ``copy(step)`` does the work (returns the bytes copied,
None when there is nothing to copy any more, or a note saying why it is skipped),
``after_copy(step)`` runs once a copy has
succeeded (the mirror's retention), ``after_job(step)`` after every job, whatever its
outcome (the local tier's retention), ``notify(record)`` reports every attempt. A step that
fails every attempt is kept in :attr:`CopyQueue.failed` until a later copy of it succeeds or
the owner :meth:`forgets <CopyQueue.forget>` it; it is never dropped silently.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger("minickpt")


class CopyQueue:
    def __init__(self, copy: Callable[[int], int | str | None], *, url: str,
                 after_copy: Callable[[int], None], after_job: Callable[[int], None],
                 notify: Callable[[dict[str, Any]], None], on_exit: Callable[[], None],
                 max_attempts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self._copy, self.url = copy, url
        self._after_copy, self._after_job, self._notify = after_copy, after_job, notify
        self._on_exit = on_exit
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, \
            max_backoff_s
        self.failed: dict[int, str] = {}  # step -> last error, after every retry
        self.mirrored: list[int] = []  # steps copied, in order
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._pending: collections.Counter[int] = collections.Counter()  # queued or copying
        self._jobs = 0  # jobs not finished yet (the copy and what runs after it)
        self._idle = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minickpt-mirror", daemon=True)
        self._thread.start()

    def put(self, step: int) -> None:
        with self._idle:
            self._pending[step] += 1
            self._jobs += 1
        self._queue.put(step)

    def pending(self) -> set[int]:
        """Steps queued or being copied."""
        with self._idle:
            return set(self._pending)

    def forget(self, step: int) -> None:
        """The owner no longer needs ``step`` mirrored (retention would not keep it)."""
        self.failed.pop(step, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no job is left; False when ``timeout`` ran out first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._jobs:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self, timeout: float | None) -> bool:
        """Ask the thread to finish after its current job (the queued ones are dropped);
        False when it is still inside a copy after ``timeout`` (it ends on its own later)."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                step = self._queue.get()
                if step is None:
                    return
                try:
                    if not self._stopping.is_set():
                        self._with_retries(step)
                except BaseException:  # pragma: no cover - keep the thread alive
                    log.exception("minickpt: mirror worker error")
                finally:
                    with self._idle:
                        self._pending[step] -= 1
                        if not self._pending[step]:
                            del self._pending[step]
                    try:
                        if not self._stopping.is_set():
                            self._after_job(step)
                    except Exception:  # pragma: no cover - logged, tried after the next copy
                        log.exception("minickpt: local retention failed")
                    with self._idle:
                        self._jobs -= 1
                        self._idle.notify_all()
        finally:
            self._on_exit()

    def _with_retries(self, step: int) -> None:
        for attempt in range(1, self.max_attempts + 1):
            t0 = time.perf_counter()
            try:
                nbytes = self._copy(step)
            except Exception as e:
                err: BaseException = e
            else:
                self.failed.pop(step, None)
                base = {"step": step, "ok": True, "attempt": attempt, "error": None,
                        "total_s": time.perf_counter() - t0, "target": self.url,
                        "time": time.time()}
                if nbytes is None or isinstance(nbytes, str):  # nothing to copy any more
                    self._notify({**base, "skipped": True, "note": nbytes
                                  or "deleted locally before it was mirrored"})
                    return
                self.mirrored.append(step)
                self._notify({**base, "bytes": nbytes})
                self._after_copy(step)
                return
            msg = f"{type(err).__name__}: {err}"
            retry = attempt < self.max_attempts and not self._stopping.is_set()
            self._notify({"step": step, "ok": False, "attempt": attempt, "error": msg,
                          "will_retry": retry, "total_s": time.perf_counter() - t0,
                          "target": self.url, "time": time.time()})
            text = (f"minickpt: copying step {step} to the mirror {self.url} failed "
                    f"(attempt {attempt} of {self.max_attempts}): {msg}")
            log.error(text)
            warnings.warn(text, stacklevel=2)
            if not retry:
                self.failed[step] = msg
                return
            if self._stopping.wait(min(self.backoff_s * 2 ** (attempt - 1),
                                       self.max_backoff_s)):
                self.failed[step] = msg
                return
