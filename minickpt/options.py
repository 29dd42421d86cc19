"""CheckpointManagerOptions: what a manager does, with Orbax's names and meanings, checked when
they are made (an impossible option is an error at once, not a surprise a week into a run)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .multihost.save import MultiHostOptions


@dataclass
class CheckpointManagerOptions:
    """Options with Orbax's names and meanings (``step_prefix`` defaults to ``"step"`` here,
    giving ``step_100/``; Orbax's default is a bare ``100/``)."""

    save_interval_steps: int = 1
    save_on_steps: Collection[int] | None = None
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    # minickpt's: the keep_latest newest steps are kept besides max_to_keep's (with best_fn:
    # "the last K for resuming, and the best N"); None keeps none besides
    keep_latest: int | None = None
    step_prefix: str | None = "step"
    step_format_fixed_length: int | None = None
    create: bool = True
    cleanup_tmp_directories: bool = True
    read_only: bool = False
    enable_async_checkpointing: bool = False
    # Remove a deleted checkpoint's files on a background thread. The deletion itself (the
    # rename out of the step namespace) still happens inside save(), after the new
    # checkpoint is durable; the fsync that makes it durable and the unlinking — slow on a
    # busy or remote file system — leave the critical path, in that order.
    # wait_until_finished()/close() wait for them.
    enable_background_delete: bool = False
    # minickpt's own
    verify_on_restore: bool = True
    fallback_on_damage: bool = True
    lock: bool = True  # flock <dir>/.minickpt.lock; without it, temporaries are not cleaned
    # chapter 4: time-outs and roles when several processes save together
    multihost: MultiHostOptions = field(default_factory=MultiHostOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.save_interval_steps, int) or self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be an int >= 1, got "
                             f"{self.save_interval_steps!r}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {self.max_to_keep!r}")
        if self.keep_latest is not None and (not isinstance(self.keep_latest, int)
                                             or self.keep_latest < 0):
            raise ValueError(f"keep_latest must be None or an int >= 0, got "
                             f"{self.keep_latest!r}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be None or >= 1, got {self.keep_period!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        self.save_on_steps = frozenset(self.save_on_steps or ())
