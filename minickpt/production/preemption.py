"""Preemption: on SIGTERM (or SIGINT), save at the next step boundary and stop cleanly.

A preemptible VM, a Kubernetes pod being evicted or a batch scheduler reclaiming a node all
send SIGTERM first and SIGKILL a little later (30 s on GCE and Kubernetes by default). Python's
default reaction to SIGTERM is to die on the spot, in the middle of a step or of a save. A
:class:`PreemptionHandler` turns the signal into a flag instead; the training loop notices it at
the next step boundary, saves that step and returns, and the restarted job resumes exactly
there: no step is lost and nothing is computed twice.

The step to save is chosen like JAX's ``multihost_utils.reached_preemption_sync_point``: the
first step the loop *asks about* after the signal, unless the loop already asked about that
step before the signal (its save decision was already taken), in which case the next one.
So ``manager.should_save(step)`` and ``manager.reached_preemption(step)`` always agree, however
the signal falls between them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("minickpt")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Catches preemption signals and says at which step to save and stop.

    >>> handler = PreemptionHandler().attach(mngr)   # SIGTERM and SIGINT
    >>> ... mngr.save(step, items); if mngr.reached_preemption(step): break

    Works without a manager too (``handler.reached(step)``). A second signal while the
    first is pending falls through to the previous handler (a second Ctrl-C raises
    KeyboardInterrupt; a second SIGTERM terminates), so a stuck job can still be stopped.
    The previous handlers are put back by :meth:`close`, which an attached manager's
    ``close()`` calls. Signal handlers can only be installed from the main thread.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, *,
                 force_on_repeat: bool = True, install: bool = True):
        self.signals = tuple(signals)
        self.force_on_repeat = force_on_repeat
        self.received: int | None = None  # the signal number, once one arrived
        self.received_at: float | None = None
        self.safe_step: int | None = None  # the step at which to save and stop
        self._last_step: int | None = None  # the highest step asked about before the signal
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        if install:
            self.install()

    # ---- signals -------------------------------------------------------------------------
    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be installed from the main thread "
                               "(Python delivers signals only there); create it before "
                               "starting threads, or pass install=False and call notify()")
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes: only set flags here (no locks, no
        # logging: the interrupted code may hold them).
        if self.received is not None and self.force_on_repeat:
            prev = self._previous.get(signum)
            self.close()
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                os.kill(os.getpid(), signum)  # the default action, now that it is restored
            return
        if self.received is None:
            self.received, self.received_at = signum, time.time()

    def notify(self, signum: int = signal.SIGTERM) -> None:
        """Report a preemption notice that did not come as a signal (a metadata-server
        watcher thread, a scheduler hook): the same as receiving ``signum``."""
        if self.received is None:
            self.received, self.received_at = signum, time.time()

    def close(self) -> None:
        """Put back the signal handlers that were there before (idempotent)."""
        for sig, prev in list(self._previous.items()):
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
                else:
                    log.warning("minickpt: the handler for signal %d was replaced after the "
                                "PreemptionHandler was installed; leaving it in place", sig)
            except ValueError:  # not the main thread: cannot touch handlers from here
                log.warning("minickpt: PreemptionHandler closed outside the main thread; the "
                            "handler for signal %d stays installed", sig)
                continue
            del self._previous[sig]

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the decision --------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """Whether a preemption notice has arrived."""
        return self.received is not None

    def reached(self, step: int) -> bool:
        """Whether ``step`` is at or past the step at which to save and stop.

        False until a signal arrives. The first call after it fixes the safe step: ``step``
        itself, unless this step was already asked about before the signal (its save was
        already decided), then ``step + 1``.
        """
        with self._lock:
            if self.received is None:
                if self._last_step is None or step > self._last_step:
                    self._last_step = step
                return False
            if self.safe_step is None:
                self.safe_step = step if self._last_step is None or step > self._last_step \
                    else self._last_step + 1
                log.warning("minickpt: received %s; saving at step %d and stopping",
                            _signal_name(self.received), self.safe_step)
            return step >= self.safe_step

    # ---- manager integration -------------------------------------------------------------
    def attach(self, manager: Any) -> PreemptionHandler:
        """Make ``manager.should_save`` / ``manager.reached_preemption`` follow this handler;
        ``manager.close()`` then closes it (restoring the previous signal handlers)."""
        manager.preemption_handler = self
        return self


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def handle_preemption(manager: Any, signals: Iterable[int] = DEFAULT_SIGNALS
                      ) -> PreemptionHandler:
    """Install a :class:`PreemptionHandler` for ``signals`` and attach it to ``manager``."""
    return PreemptionHandler(signals).attach(manager)


@dataclass
class LoopResult:
    """Where a training loop stopped: its carry, the last step run, and whether a
    preemption stopped it (then that step is saved)."""

    carry: Any
    step: int
    preempted: bool


def train_until_preempted(manager: Any, carry: Any,
                          step_fn: Callable[[Any, int], tuple[Any, Mapping[str, Any] | None]],
                          *, start: int, stop: int,
                          items: Callable[[Any], Mapping[str, Any]],
                          on_step: Callable[[int, Any, Any], None] | None = None) -> LoopResult:
    """Task 6.3 — a training loop that saves at the next step boundary after a preemption
    notice and stops cleanly.

    Runs steps ``start+1 .. stop``: ``carry, metrics = step_fn(carry, step)``, then offers
    ``items(carry)`` to ``manager.save`` (which saves on the interval, and at the preemption
    step), then stops if ``manager.reached_preemption(step)``. Waits for pending (async)
    saves before returning, so the process can exit right after.
    """
    step = start
    for step in range(start + 1, stop + 1):
        carry, metrics = step_fn(carry, step)
        if on_step is not None:
            on_step(step, carry, metrics)
        manager.save(step, items(carry), metrics=metrics)
        if manager.reached_preemption(step):
            manager.wait_until_finished()
            return LoopResult(carry, step, True)
    manager.wait_until_finished()
    return LoopResult(carry, step, False)
