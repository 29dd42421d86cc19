"""Running checkpointing for weeks (chapter 6): planning, preemption, drills, monitoring,
tiered storage and versioning. One module per concept:

* :mod:`.planning` — the save interval from the save cost and the MTBF (Young, Daly), lost
  work, the seed's P_fail, retention from capacity, all from the manager's measured saves;
* :mod:`.preemption` — SIGTERM/SIGINT: save at the next step boundary, stop cleanly;
* :mod:`.drill` — kill a real training process with SIGKILL, restart it, measure recovery;
* :mod:`.monitoring` — every save and restore as a JSON line next to the checkpoints;
* :mod:`.tiered` — fast local saves mirrored in the background to a second store (the
  mirror itself in :mod:`.mirror`, the background copies in :mod:`.copy_queue`);
* :mod:`.versioning` — git commit in every checkpoint, best version from metadata, migration.

Nothing here is imported by ``import minickpt``; import what you use.
"""

from .mirror import MirrorError
from .monitoring import MetricsMonitor, attach_monitor, load_metrics, plot_dashboard, summarize
from .planning import (
    IntervalPlan,
    daly_interval,
    expected_lost_work,
    expected_waste_fraction,
    interval_failure_probability,
    max_to_keep_for_capacity,
    measured_save_cost,
    optimal_interval,
    p_fail,
    plan_interval,
    recommended_save_interval_steps,
    young_interval,
)
from .preemption import LoopResult, PreemptionHandler, handle_preemption, train_until_preempted
from .tiered import TieredCheckpointManager

__all__ = [
    "IntervalPlan",
    "LoopResult",
    "MetricsMonitor",
    "MirrorError",
    "PreemptionHandler",
    "TieredCheckpointManager",
    "attach_monitor",
    "daly_interval",
    "expected_lost_work",
    "expected_waste_fraction",
    "handle_preemption",
    "interval_failure_probability",
    "load_metrics",
    "max_to_keep_for_capacity",
    "measured_save_cost",
    "optimal_interval",
    "p_fail",
    "plan_interval",
    "plot_dashboard",
    "recommended_save_interval_steps",
    "summarize",
    "train_until_preempted",
    "young_interval",
]
