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

**Several processes.** Under ``jax.distributed`` the scheduler may signal one host, or all of
them at slightly different steps; if each decided alone, one would start a collective save
the others never join, and the job would end in a :class:`~minickpt.errors.PeerTimeoutError`
instead of a clean save. So the decision is collective (the idea of JAX's preemption sync
manager, done with minickpt's own time-outs): at every ``sync_every_steps``-th step (a
*check step*, ``step % k == 0``) each process publishes whether it has received a notice,
and all of them take the same decision from the same flags — the first check step at which
any process was preempted is the step every process saves, and then stops.

The trade-off is ``k``. A check is one small key-value write and one barrier with a time-out
(``MultiHostOptions.timeout_s``): about a millisecond on a LAN, but it waits for the slowest
process, so doing it every step would turn every step into a synchronisation point. Between
check steps nothing is exchanged. The price is latency: the save comes up to ``k - 1``
steps later than the notice, so choose ``k`` so that ``k`` steps and one save fit in the
scheduler's grace period (30 s on GCE and Kubernetes by default). Every process must ask
about every check step (a training loop that asks about every step does), and, as with
any collective, ask about them in the same order.
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

    Once attached, the manager's ``should_save(step)`` and ``reached_preemption(step)``
    follow it (see :meth:`reached` for which step it names); how a training loop uses them is
    the loop's design (lab 6's task 6.3). Works without a manager too (``handler.reached(step)``). A second signal while the
    first is pending falls through to the previous handler (a second Ctrl-C raises
    KeyboardInterrupt; a second SIGTERM terminates), so a stuck job can still be stopped.
    The previous handlers are put back by :meth:`close`, which an attached manager's
    ``close()`` calls. Signal handlers can only be installed from the main thread.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, *,
                 force_on_repeat: bool = True, install: bool = True,
                 sync: Any = None, sync_every_steps: int = 10, timeout_s: float = 60.0):
        if not isinstance(sync_every_steps, int) or sync_every_steps < 1:
            raise ValueError(f"sync_every_steps must be an int >= 1, got {sync_every_steps!r}")
        self.signals = tuple(signals)
        # Several processes: the decision is taken together at check steps (module docstring).
        # attach() takes the manager's Sync and time-out when they are not given here.
        self.sync = sync
        self.sync_every_steps = sync_every_steps
        self.timeout_s = timeout_s
        self._last_check: int | None = None  # the last check step decided together
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
        already decided), then ``step + 1``. Under several processes, a collective decision
        at check steps instead (see the module docstring).
        """
        if self.sync is not None and self.sync.process_count > 1:
            return self._reached_together(step)
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

    def _reached_together(self, step: int) -> bool:
        """The multi-process decision: at the first ask about a check step, every process
        publishes whether it was preempted; any one preempted makes it the safe step."""
        with self._lock:
            if self.safe_step is not None:
                return step >= self.safe_step
            k = self.sync_every_steps
            if step % k or (self._last_check is not None and step <= self._last_check):
                return False  # not a check step, or one already decided (no)
            flags = self.sync.exchange(
                f"preemption/{step}", self.received, self.timeout_s,
                f"preemption check at step {step} (every process must ask about every "
                f"{k}th step)")
            previous, self._last_check = self._last_check, step
            if previous is not None:  # everybody has read it: they all reached this one
                self.sync.forget(f"preemption/{previous}")
            who = [p for p, sig in enumerate(flags) if sig is not None]
            if not who:
                return False
            self.safe_step = step
            if self.received is None:  # not signalled here: act on the others' notice
                self.received, self.received_at = flags[who[0]], time.time()
            log.warning("minickpt: process(es) %s received %s; every process saves at step %d "
                        "and stops", ", ".join(map(str, who)), _signal_name(flags[who[0]]),
                        step)
            return True

    # ---- manager integration -------------------------------------------------------------
    def attach(self, manager: Any) -> PreemptionHandler:
        """Make ``manager.should_save`` / ``manager.reached_preemption`` follow this handler;
        ``manager.close()`` then closes it (restoring the previous signal handlers).

        Under several processes the handler takes the manager's :class:`~minickpt.multihost.sync.Sync`
        and ``MultiHostOptions.timeout_s`` for its collective decision (unless it has one)."""
        if self.sync is None:
            sync = getattr(manager, "_sync", None)
            if sync is not None and sync.process_count > 1:
                self.sync = sync
                mh = getattr(getattr(manager, "options", None), "multihost", None)
                if mh is not None:
                    self.timeout_s = mh.timeout_s
        manager.preemption_handler = self
        return self


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def handle_preemption(manager: Any, signals: Iterable[int] = DEFAULT_SIGNALS, *,
                      sync_every_steps: int = 10) -> PreemptionHandler:
    """Install a :class:`PreemptionHandler` for ``signals`` and attach it to ``manager``."""
    return PreemptionHandler(signals, sync_every_steps=sync_every_steps).attach(manager)


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

    Computes steps ``start+1 .. stop`` with ``step_fn(carry, step)`` (new carry, metrics),
    calls ``on_step`` with the step, the new carry and its metrics after each, and lets the
    manager see every step (``items(carry)``, with its metrics: the manager's policy decides
    what is saved). After a
    preemption notice it stops at the step the manager names, having lost none: that step is
    the newest checkpoint. Every save it started is on disk when it returns; it never saves
    from, or installs, a signal handler.
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
