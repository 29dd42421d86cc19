"""What the labs use from minickpt: each task's reference function, a way to plug a student's
function into the library, a real training state on the devices JAX sees, and checks whose
messages teach.

The kit is a package: the shared part (:mod:`.plugging`, :mod:`.checks`, :mod:`.devices`,
:mod:`.temporaries`) and one module per lab (:mod:`.lab1` ... :mod:`.lab6`). A lab imports it
as ``from minickpt import labkit as lab`` and calls ``lab.check``,
``lab.train_state``, ``lab.crash_every_call`` ...: this file gathers those names.

A lab task is one or more functions of minickpt whose docstrings start with ``"Task 1.3 —"``
(see CONTRIBUTING.md). A student writes functions of the same names in the lab notebook; a
test cell then runs the real library with them in place::

    with plugged_in(plan_leaf, decode_leaf):          # minickpt now calls the student's code
        mc.Checkpointer().save(path, {"state": state})
        check(..., "the bytes of Dense_0's kernel in data.bin ...")

:func:`plugged_in` replaces every reference to the reference function inside minickpt's
modules (``format.plan_leaf``, ``checkpointer``'s imported name, ``minickpt.restore_checkpoint``
...) for the duration of the ``with`` block, so the library needs no hooks and the student's
function is exercised exactly where the library's own would be.

Checks raise :class:`LabCheckError` with a message meant for the student, never a bare
``assert``. Comparisons check types first, because an object whose ``==`` is always ``True``
must not pass a test.
"""

from __future__ import annotations

from . import watch as watch  # the referee reads its private copy's
from .checks import (
    LabCheckError,
    Raised,
    check,
    check_choice,
    check_choices,
    close_to,
    expect_raises,
    is_key,
    same,
    tree_diff,
)
from .claims import ClaimError, claim, verdict
from .devices import (
    describe_devices,
    devices,
    mesh,
    resume_rtol,
    shard,
    train,
    train_state,
)
from .hints import hint
from .lab1 import (
    RoundTripReport,
    dtype_cases,
    roundtrip_every_dtype,
)
from .lab2 import (
    LOOKALIKES,
    CrashReport,
    crash_commit,
    crash_every_call,
    describe_retention,
    lab2_items,
    retention_cases,
)
from .lab3 import (
    drill_message,
    lab3_drill,
    lab3_loss,
    lab3_manifest,
    lab3_namespace,
    lab3_new_state,
)
from .lab4 import (
    LAB4_IMPORTS,
    FakeDevice,
    ProcessesRun,
    RecordingSave,
    can_start_processes,
    coverage_message,
    describe_processes,
    distinct_boxes,
    fake_devices_indices_map,
    global_array,
    lab4_values,
    listing,
    ownership_message,
    process_mesh,
    protocol_message,
    run_processes,
    shard_boxes,
)
from .lab5 import (
    async_faulty_run,
    async_training_run,
    describe_leaf,
    donating_train_step,
    fresh_train_state,
    gated_fs,
    pinning_works,
    pretend_no_pinning,
    random_timelines,
    record_async_run,
    shares_memory,
    snapshot_cases,
    start_race,
    writer_threads,
)
from .lab6 import (
    drill_worker,
    drill_worker_fingerprint,
    lab6_carry,
    no_array_reads,
    preemption_drill,
    printing_worker,
    run_loop_process,
    simulate_lost_per_failure,
    simulate_p_fail,
    simulate_waste,
)
from .plugging import (
    TASK_RE,
    plugged_in,
    reference,
    reference_functions,
    standing_in,
    task_id,
)
from .temporaries import (
    flip_byte,
    logged,
    quiet_stderr,
    tempdir,
)

__all__ = [
    "LAB4_IMPORTS",
    "LOOKALIKES",
    "TASK_RE",
    "ClaimError",
    "CrashReport",
    "FakeDevice",
    "LabCheckError",
    "ProcessesRun",
    "Raised",
    "RecordingSave",
    "RoundTripReport",
    "async_faulty_run",
    "async_training_run",
    "can_start_processes",
    "check",
    "check_choice",
    "check_choices",
    "claim",
    "close_to",
    "coverage_message",
    "crash_commit",
    "crash_every_call",
    "describe_devices",
    "describe_leaf",
    "describe_processes",
    "describe_retention",
    "devices",
    "distinct_boxes",
    "donating_train_step",
    "drill_message",
    "drill_worker",
    "drill_worker_fingerprint",
    "dtype_cases",
    "expect_raises",
    "fake_devices_indices_map",
    "flip_byte",
    "fresh_train_state",
    "gated_fs",
    "global_array",
    "grader_drill",
    "hint",
    "is_key",
    "lab2_items",
    "lab3_drill",
    "lab3_loss",
    "lab3_manifest",
    "lab3_namespace",
    "lab3_new_state",
    "lab4_values",
    "lab6_carry",
    "listing",
    "logged",
    "mesh",
    "no_array_reads",
    "ownership_message",
    "pinning_works",
    "plugged_in",
    "preemption_drill",
    "pretend_no_pinning",
    "printing_worker",
    "process_mesh",
    "protocol_message",
    "quiet_stderr",
    "random_timelines",
    "record_async_run",
    "reference",
    "reference_functions",
    "resume_rtol",
    "retention_cases",
    "roundtrip_every_dtype",
    "run_loop_process",
    "run_processes",
    "same",
    "shard",
    "shard_boxes",
    "shares_memory",
    "simulate_lost_per_failure",
    "simulate_p_fail",
    "simulate_waste",
    "snapshot_cases",
    "standing_in",
    "start_race",
    "task_id",
    "tempdir",
    "train",
    "train_state",
    "tree_diff",
    "verdict",
    "writer_threads",
]


def grader_drill(task: str) -> None:
    """A grader check's ``grader_drill("X.Y")`` outside the grader (Jupyter, an instructor's
    run-all, ``scripts/device-check.sh``): says that the grader runs that drill itself and
    returns None, so that a solution notebook runs top to bottom anywhere.

    Under the grader a grader check never runs in the kernel: it runs in the grader's own
    process, where ``grader_drill`` is bound to the grader's drill for the submission after
    every name the kernel reported (autograder/notebook.py, ``judge_quiz``), so nothing a
    student's kernel defines under this name reaches it."""
    print(f"Task {task}: the grader runs this drill itself, outside your notebook "
          "(its sandboxed workers, its own draws); nothing to run here")
