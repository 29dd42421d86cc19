"""The crash-safety harness shared by the tests and ``scripts/crash_report.py``.

Each part returns figures (how many crash points, states, kills, cases) and the list of
everything that went wrong, so that a test asserts the list is empty and the report prints the
figures. Sizes are parameters: the tests run CI sizes, the report (``--more``) larger ones.

Saved values are a function of the step (:func:`items`), so a checker that finds step ``s``
knows exactly what it must hold.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import os
import pickle
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.commit import DELETE_MARK, is_temporary
from minickpt.crashsim import AssertionFailure, explore
from minickpt.format.encode import write_item
from minickpt.fs import FileSystem, SyncBatch
from minickpt.legacy import save_checkpoint


class NoSyncFileSystem(FileSystem):
    """The real file system without fsync: for setting up worlds and checking copies, where
    durability is modelled (or irrelevant) and fsync would only cost time."""

    def fsync(self, fd: int) -> None:
        return None


FAST = NoSyncFileSystem()


# ---------------------------------------------------------------------------------------
# values derivable from the step
# ---------------------------------------------------------------------------------------
def items(step: int, size: int = 300) -> dict[str, Any]:
    """What a training loop would save at ``step``: two items, several dtypes, scalars."""
    return {
        "params": {"w": np.arange(size, dtype=np.float32) + step,
                   "b": np.full(7, step, np.int64)},
        "opt": {"mu": (np.arange(64) * (step + 1)).astype(ml_dtypes.bfloat16),
                "count": step, "tag": f"step-{step}"},
    }


def check_items(restored: Any, step: int, size: int = 300) -> None:
    """Raise AssertionError unless ``restored`` is exactly ``items(step)``."""
    want = items(step, size)
    p, o = restored["params"], restored["opt"]
    assert np.array_equal(p["w"], want["params"]["w"]), f"step {step}: params/w differs"
    assert np.array_equal(p["b"], want["params"]["b"]), f"step {step}: params/b differs"
    assert np.asarray(o["mu"]).tobytes() == want["opt"]["mu"].tobytes(), \
        f"step {step}: opt/mu differs"
    assert o["count"] == step and o["tag"] == f"step-{step}", f"step {step}: opt scalars differ"


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Same temporary names and timestamps on every run of a scenario, so that the states two
    crash points leave compare equal and are checked once."""
    counter = itertools.count()
    with mock.patch("secrets.token_hex", lambda n=4: f"{next(counter):0{2 * (n or 4)}x}"), \
            mock.patch("time.time_ns", lambda: 1_700_000_000_000_000_000):
        yield


# ---------------------------------------------------------------------------------------
# every crash point
# ---------------------------------------------------------------------------------------
@dataclass
class Scenario:
    """A piece of a training run's checkpointing, and what a crash in it may leave.

    ``allowed``: the step sets a fresh manager may find after any crash. ``new``: steps
    saved here: once durable they must stay, and they must be there when the scenario is
    over. ``deleted``: steps removed here: once gone they must not come back.
    """

    name: str
    setup: Callable[[str], None]
    run: Callable[[FileSystem, str], None]
    allowed: set[tuple[int, ...]]
    new: tuple[int, ...] = ()
    deleted: tuple[int, ...] = ()
    run_dir: str = "run"
    options: dict[str, Any] = field(default_factory=dict)
    item_of: Callable[[Any], Any] = lambda r: r  # restored -> {"params", "opt"}

    def manager(self, world: str, fs: FileSystem, sync: Any = None,
                **extra: Any) -> CheckpointManager:
        return CheckpointManager(os.path.join(world, self.run_dir),
                                 CheckpointManagerOptions(**{**self.options, **extra}), fs=fs,
                                 sync=sync)


def _saved(world: str, steps: Any, run_dir: str = "run", **opts: Any) -> None:
    with CheckpointManager(os.path.join(world, run_dir), CheckpointManagerOptions(**opts),
                           fs=FAST) as m:
        for s in steps:
            m.save(s, items(s), metrics={"loss": 1.0 / (s + 1)}, force=True)


def _run_and_drop(m_factory: Callable[[], CheckpointManager],
                  body: Callable[[CheckpointManager], None]) -> None:
    """Run ``body`` on a manager; after a crash, forget its lock fd (the dead process's
    descriptors are closed by the recorder, never by this manager's destructor)."""
    m = None
    try:
        m = m_factory()
        body(m)
        m.close()
    finally:
        if m is not None:
            m._lock_fd = None


def _scenario_retention(world: str) -> None:
    _saved(world, [1, 2], max_to_keep=2)
    run = os.path.join(world, "run")
    junk = os.path.join(run, "step_3.minickpt-tmp-0badc0de", "params")
    os.makedirs(junk)
    with open(os.path.join(junk, "data.bin"), "wb") as f:
        f.write(b"half a save")
    os.makedirs(os.path.join(run, "step_0.minickpt-del-0badc0de", "opt"))


SCENARIOS: list[Scenario] = []


def _add(s: Scenario) -> Scenario:
    SCENARIOS.append(s)
    return s


RETENTION = _add(Scenario(
    "save with retention, after cleaning an interrupted save and delete",
    setup=_scenario_retention,
    run=lambda fs, w: _run_and_drop(lambda: RETENTION.manager(w, fs),
                                    lambda m: m.save(3, items(3), metrics={"loss": 0.25})),
    allowed={(1, 2), (1, 2, 3), (2, 3)}, new=(3,), deleted=(1,),
    options={"max_to_keep": 2}))

FIRST = _add(Scenario(
    "first save into a directory that does not exist yet",
    setup=lambda w: None,
    run=lambda fs, w: _run_and_drop(lambda: FIRST.manager(w, fs),
                                    lambda m: m.save(1, items(1))),
    allowed={(), (1,)}, new=(1,), run_dir="runs/exp1"))

DELETE = _add(Scenario(
    "explicit delete, then save",
    setup=lambda w: _saved(w, [1, 2, 3]),
    run=lambda fs, w: _run_and_drop(lambda: DELETE.manager(w, fs),
                                    lambda m: (m.delete(2), m.save(4, items(4)))),
    allowed={(1, 2, 3), (1, 3), (1, 3, 4)}, new=(4,), deleted=(2,)))

MANY = _add(Scenario(
    "save that makes retention delete three checkpoints (best_fn, max_to_keep=1)",
    setup=lambda w: _saved(w, [1, 2, 3]),
    run=lambda fs, w: _run_and_drop(lambda: MANY.manager(w, fs),
                                    lambda m: m.save(4, items(4), metrics={"loss": 0.01})),
    allowed={(1, 2, 3), (1, 2, 3, 4), (2, 3, 4), (3, 4), (4,)}, new=(4,), deleted=(1, 2, 3),
    options={"max_to_keep": 1, "best_fn": lambda m: m["loss"], "best_mode": "min"}))


def _legacy_setup(world: str) -> None:
    for s in (1, 2):
        save_checkpoint(os.path.join(world, "ckpts"), items(s), s, keep=5, fs=FAST)


LEGACY = _add(Scenario(
    "Flax-style save_checkpoint(keep=2)",
    setup=_legacy_setup,
    run=lambda fs, w: save_checkpoint(os.path.join(w, "ckpts"), items(3), 3, keep=2, fs=fs),
    allowed={(1, 2), (1, 2, 3), (2, 3)}, new=(3,), deleted=(1,), run_dir="ckpts",
    options={"step_prefix": "checkpoint"}, item_of=lambda r: r["state"]))

# Async saving: the write, the commit and the retention run on the background thread. The
# recorder crashes every thread at once (each later call, from any thread, raises
# SimulatedCrash); the error the background thread keeps is raised by wait_until_finished()
# and ignored because the recorder knows it crashed. The main thread makes no file-system
# call while the background one runs, so every run makes the same calls in the same order.
ASYNC = _add(Scenario(
    "async save with retention, after cleaning an interrupted save and delete",
    setup=_scenario_retention,
    run=lambda fs, w: _run_and_drop(lambda: ASYNC.manager(w, fs),
                                    lambda m: (m.save(3, items(3), metrics={"loss": 0.25}),
                                               m.wait_until_finished())),
    allowed={(1, 2), (1, 2, 3), (2, 3)}, new=(3,), deleted=(1,),
    options={"max_to_keep": 2, "enable_async_checkpointing": True}))

ASYNC_MANY = _add(Scenario(
    "async save whose retention deletes three checkpoints in the background",
    setup=lambda w: _saved(w, [1, 2, 3]),
    run=lambda fs, w: _run_and_drop(lambda: ASYNC_MANY.manager(w, fs),
                                    lambda m: (m.save(4, items(4), metrics={"loss": 0.01}),
                                               m.wait_until_finished())),
    allowed={(1, 2, 3), (1, 2, 3, 4), (2, 3, 4), (3, 4), (4,)}, new=(4,), deleted=(1, 2, 3),
    options={"max_to_keep": 1, "best_fn": lambda m: m["loss"], "best_mode": "min",
             "enable_async_checkpointing": True}))

# Background delete: the retired checkpoint's parent fsync and removal run on another
# thread. The main thread's only call meanwhile is one lstat (it changes nothing durable),
# so where it falls among the remover's calls shifts the crash points by at most one.
BACKGROUND_DELETE = _add(Scenario(
    "save whose retention removes the old checkpoint in the background",
    setup=_scenario_retention,
    run=lambda fs, w: _run_and_drop(lambda: BACKGROUND_DELETE.manager(w, fs),
                                    lambda m: (m.save(3, items(3), metrics={"loss": 0.25}),
                                               m.wait_until_finished())),
    allowed={(1, 2), (1, 2, 3), (2, 3)}, new=(3,), deleted=(1,),
    options={"max_to_keep": 2, "enable_background_delete": True}))



# A collective save on two simulated processes (threads): the primary writes every leaf
# (the values are host arrays) through the recorder; the other makes no file-system call
# that changes anything. Retention's decision travels in the last barrier, and the primary
# removes the retired step's files after it. When the recorder crashes the primary, the
# group learns of the death at once (as the coordination service would, later), so the
# other process fails its next barrier instead of waiting out the time-out.
def _collective(w: str, fs: FileSystem) -> None:
    from minickpt import MultiHostOptions
    from minickpt.faults import SimulatedCrash
    from minickpt.multihost.sync import LocalGroup, LocalSync

    class Group(LocalGroup):
        def __init__(self, n: int):
            super().__init__(n)
            self.dead: set[int] = set()

        def kill(self, p: int) -> None:
            with self._cond:
                self.dead = {p}
                for key, got in self._values.items():
                    if p not in got:
                        self._failed.setdefault(key, {p})
                self._cond.notify_all()

        def sync(self, process_index: int) -> LocalSync:
            group = self

            class Sync(LocalSync):
                def exchange(self, key: str, value: Any, timeout_s: float,
                             what: str = "") -> list[Any]:
                    with group._cond:
                        if group.dead:
                            group._failed.setdefault(key, set(group.dead))
                    return super().exchange(key, value, timeout_s, what)

            return Sync(self, process_index)

    group = Group(2)

    def work(sync: Any) -> None:
        primary = sync.process_index == 0
        try:
            _run_and_drop(lambda: COLLECTIVE.manager(
                w, fs if primary else FAST, sync, multihost=MultiHostOptions(timeout_s=20)),
                lambda m: m.save(3, items(3), metrics={"loss": 0.25}))
        except SimulatedCrash:
            group.kill(sync.process_index)
            raise

    group.run(work, timeout_s=60)


COLLECTIVE = _add(Scenario(
    "collective save of 2 processes with retention, the retired step removed after the "
    "last barrier",
    setup=_scenario_retention, run=lambda fs, w: _collective(w, fs),
    allowed={(1, 2), (1, 2, 3), (2, 3)}, new=(3,), deleted=(1,),
    options={"max_to_keep": 2}))

# explore() insists that every run of a scenario makes the same number of calls.


# The harness must fail on a library that is not crash-safe: each mutation breaks one
# rule of the commit protocol; (patch target, replacement, scenario, symptom expected).
def _flush(fs, batch, *dirs):
    """What commit() does first: fsync the files and directories handed over (together)."""
    batch = batch if batch is not None else SyncBatch(fs)
    for d in dirs:
        batch.add_dir(d)
    batch.flush()


def _commit_without_parent_fsync(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    _flush(fs, sync, *(os.path.join(tmp_dir, d) for d in subdirs), tmp_dir)
    fs.rename(tmp_dir, final_dir)


def _commit_without_tmp_fsync(fs, tmp_dir, final_dir, *, subdirs=(), sync=None):
    _flush(fs, sync, *(os.path.join(tmp_dir, d) for d in subdirs))
    fs.rename(tmp_dir, final_dir)
    fs.fsync_dir(os.path.dirname(final_dir))


def _write_item_without_fsync(fs, item_dir, plan, *, sync=None, **kw):
    """Writes the item but neither fsyncs it nor hands it to the save's group commit."""
    return write_item(fs, item_dir, plan, fsync=False, **kw)


def _delete_without_fsync(fs, path):
    doomed = path + DELETE_MARK + "x"
    fs.rename(path, doomed)
    fs.rmtree(doomed)


def _remove_retired_without_fsync(fs, doomed):
    fs.rmtree(doomed)  # before the retirement's rename is durable


MUTATIONS = {
    "commit skips the parent's fsync (the rename can vanish)":
        ("minickpt.checkpointer.commit", _commit_without_parent_fsync, FIRST,
         "can be lost although its save returned"),
    "commit skips the temporary directory's fsync (entries inside can vanish)":
        ("minickpt.checkpointer.commit", _commit_without_tmp_fsync, RETENTION,
         "is listed but damaged"),
    "items are written without fsync (data lost, names kept)":
        ("minickpt.checkpointer.write_item", _write_item_without_fsync, RETENTION,
         "is listed but damaged"),
    "delete removes files before its rename is durable":
        ("minickpt.retention.delete_dir", _delete_without_fsync, DELETE,
         "is listed but damaged"),
    "an async save's items are written without fsync":
        ("minickpt.checkpointer.write_item", _write_item_without_fsync, ASYNC,
         "is listed but damaged"),
    "a background removal starts before the retirement is durable":
        ("minickpt.retention.remove_retired", _remove_retired_without_fsync, BACKGROUND_DELETE,
         "is listed but damaged"),
    "a collective save's removal after the barrier starts before the retirement is durable":
        ("minickpt.retention.remove_retired", _remove_retired_without_fsync, COLLECTIVE,
         "is listed but damaged"),
}


def observe(scn: Scenario, world: str) -> tuple[int, ...]:
    """What a fresh manager finds after a crash: the steps, each verified and restored.

    Raises AssertionError (with the reason) if it lists a damaged or wrong checkpoint, falls
    back silently, or leaves a temporary behind."""
    run = os.path.join(world, scn.run_dir)
    if not os.path.isdir(run):
        return ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with scn.manager(world, FAST) as m:
            steps = tuple(m.all_steps())
            for s in steps:
                rep = m.verify(s)
                assert rep.ok, f"step {s} is listed but damaged: {rep.problems}"
                check_items(scn.item_of(m.restore(s)), s)
            if steps:
                assert m.restore().step == steps[-1], "restore() did not pick the latest"
        left = [n for n in os.listdir(run) if is_temporary(n)]
        assert not left, f"temporaries left after a manager opened: {left}"
    assert not [w for w in caught if "skipping damaged" in str(w.message)], \
        [str(w.message) for w in caught]
    return steps


@dataclass
class CrashFigures:
    scenario: str
    crash_points: int = 0
    survived: int = 0
    states: int = 0
    distinct_states: int = 0
    failures: list[str] = field(default_factory=list)


def explore_scenario(scn: Scenario, workdir: str, *, random_states: int = 4, seed: int = 0,
                     max_failures: int = 20) -> CrashFigures:
    """Crash ``scn`` before every one of its file-system calls and check every state."""
    template = os.path.join(workdir, "template")
    os.makedirs(template)
    scn.setup(template)
    figs = CrashFigures(scn.name)
    seen: set[str] = set()
    first_all: dict[int, int] = {}
    first_none: dict[int, int] = {}

    def run(fs: FileSystem, world: str) -> None:
        with deterministic():
            scn.run(fs, world)

    points = list(explore(template, run, lambda d: observe(scn, d), workdir=workdir,
                          random_states=random_states, seed=seed))
    for pt in points:
        figs.crash_points += 1
        figs.states += len(pt.states)
        bad = []
        for st, out in zip(pt.states, pt.outcomes, strict=True):
            if isinstance(out, AssertionFailure):
                bad.append(f"{st.label}: {out.message}")
            elif out not in scn.allowed:
                bad.append(f"{st.label}: a fresh manager found steps {list(out)}, "
                           f"allowed are {sorted(map(list, scn.allowed))}")
        good = [o for o in pt.outcomes if not isinstance(o, AssertionFailure)]
        for s in scn.new:
            if good and all(s in o for o in good):
                first_all.setdefault(s, pt.index)
            elif s in first_all:
                bad.append(f"step {s} was durable from crash point {first_all[s]} on, but a "
                           "crash here can lose it")
            if pt.call == "end" and not all(s in o for o in good):
                bad.append(f"step {s} can be lost although its save returned")
        for s in scn.deleted:
            if good and all(s not in o for o in good):
                first_none.setdefault(s, pt.index)
            elif s in first_none:
                bad.append(f"step {s} was deleted for good at crash point {first_none[s]}, "
                           "but comes back after a crash here")
        for b in bad:
            msg = f"[{scn.name}] crash before call {pt.index} ({pt.call}): {b}"
            if msg not in seen and len(figs.failures) < max_failures:
                figs.failures.append(msg + f"\n    un-synced then: {pt.pending}")
            seen.add(msg)
        figs.survived += not bad
    figs.distinct_states = sum(p.checked for p in points)
    shutil.rmtree(workdir, ignore_errors=True)
    return figs


# ---------------------------------------------------------------------------------------
# damage: every case detected by verify and by restore, naming the file and the leaf
# ---------------------------------------------------------------------------------------
def build_run(run: str, steps: Any = (1, 2, 3), fs: FileSystem = FAST) -> None:
    """A run directory with ``items(s)`` saved for each step (metrics: loss = 1/(s+1))."""
    with CheckpointManager(run, fs=fs) as m:
        for s in steps:
            m.save(s, items(s), metrics={"loss": 1.0 / (s + 1)}, force=True)


def _manifest_path(step_dir: str, item: str) -> str:
    return os.path.join(step_dir, item, "manifest.json")


def flip(rel: str, where: int | bytes | Callable[[str], int], bit: int = 0x10
         ) -> Callable[[str], None]:
    """Flip one bit of ``rel``: at a byte offset, in the first byte of a marker, or where a
    function of the step directory says."""
    def apply(step_dir: str) -> None:
        p = os.path.join(step_dir, rel)
        raw = bytearray(open(p, "rb").read())
        if isinstance(where, bytes):
            i = raw.index(where)
        elif callable(where):
            i = where(step_dir)
        else:
            i = where
        raw[i] ^= bit
        with open(p, "wb") as f:
            f.write(raw)
    return apply


def truncate(rel: str, frac: float) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        p = os.path.join(step_dir, rel)
        os.truncate(p, int(os.path.getsize(p) * frac))
    return apply


def remove(rel: str) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        p = os.path.join(step_dir, rel)
        if os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    return apply


def replace(rel: str, make: Callable[[str, str], None]) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        p = os.path.join(step_dir, rel)
        remove(rel)(step_dir)
        make(p, step_dir)
    return apply


def from_step(rel: str, step: int = 2) -> Callable[[str], None]:
    """Replace ``rel`` with the same file (or directory) of another step."""
    def apply(step_dir: str) -> None:
        src = os.path.join(os.path.dirname(step_dir), f"step_{step}", rel)
        dst = os.path.join(step_dir, rel)
        remove(rel)(step_dir)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    return apply


def write_metadata(step_dir: str, meta: dict[str, Any]) -> None:
    """Write metadata as minickpt would (its own checksum included): a consistent lie."""
    from minickpt.checkpointer import encode_metadata

    meta = {k: v for k, v in meta.items() if k != "metadata_crc32"}
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "wb") as f:
        f.write(encode_metadata(meta))


def lie_in_metadata(fn: Callable[[dict[str, Any]], None]) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        meta = json.loads(open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "rb").read())
        fn(meta)
        write_metadata(step_dir, meta)
    return apply


def lie_in_manifest(item: str, fn: Callable[[dict[str, Any]], None], *,
                    consistent: bool = True) -> Callable[[str], None]:
    """Rewrite an item's manifest; ``consistent``: also record its new checksum in the
    metadata, as a buggy writer would (so only cross-checks can catch the lie)."""
    def apply(step_dir: str) -> None:
        p = _manifest_path(step_dir, item)
        obj = json.loads(open(p, "rb").read())
        fn(obj)
        raw = json.dumps(obj).encode()
        with open(p, "wb") as f:
            f.write(raw)
        if consistent:
            lie_in_metadata(lambda m: m["items"][item].update(
                manifest_crc32=zlib.crc32(raw)))(step_dir)
    return apply


def _leaf_entry(obj: dict[str, Any], leaf: str) -> dict[str, Any]:
    return next(e for e in obj["leaves"] if e["path"] == [leaf])


def _set(leaf: str, **kv: Any) -> Callable[[dict[str, Any]], None]:
    return lambda obj: _leaf_entry(obj, leaf).update(kv)


def _mkdir(p: str, _step_dir: str) -> None:
    os.mkdir(p)


def _zeros_like(rel: str) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        p = os.path.join(step_dir, rel)
        n = os.path.getsize(p)
        with open(p, "wb") as f:
            f.write(bytes(n))
    return apply


def _append(rel: str, data: bytes) -> Callable[[str], None]:
    def apply(step_dir: str) -> None:
        with open(os.path.join(step_dir, rel), "ab") as f:
            f.write(data)
    return apply


def _skeleton_key(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def fn(obj: dict[str, Any]) -> None:
        for kid in obj["tree"]["c"]:
            if kid[0] == old:
                kid[0] = new
    return fn


def _same_leaf_twice(obj: dict[str, Any]) -> None:
    obj["tree"]["c"][1][1]["i"] = 0


@dataclass
class Damage:
    """One way a checkpoint gets damaged, and what the error must name."""

    name: str
    apply: Callable[[str], None]  # given the step directory
    file: str  # relative to the step directory
    leaf: str | None = None


DAMAGE: list[Damage] = [
    Damage("bit flip in an array (params/w)", flip("params/data.bin", 64 + 600), "params/data.bin", "w"),
    Damage("bit flip in an array (params/b)", flip("params/data.bin", 8), "params/data.bin", "b"),
    Damage("bit flip in a bfloat16 array (opt/mu)", flip("opt/data.bin", 10), "opt/data.bin", "mu"),
    Damage("bit flip in the last byte of a data file", flip("params/data.bin", 1263, 0x01),
           "params/data.bin", "w"),
    Damage("bit flip in a manifest (a shape)", flip("params/manifest.json", b"300]"),
           "params/manifest.json"),
    Damage("bit flip in a manifest (a stored value)", flip("opt/manifest.json", b'3},', 0x01),
           "opt/manifest.json"),
    Damage("bit flip in the metadata (a metric)", flip("_CHECKPOINT_METADATA", b"0.25", 0x02),
           "_CHECKPOINT_METADATA"),
    Damage("bit flip in the metadata (the step: 3 becomes 2)",
           flip("_CHECKPOINT_METADATA", lambda d: open(os.path.join(
               d, "_CHECKPOINT_METADATA"), "rb").read().index(b'"step": 3') + 8, 0x01),
           "_CHECKPOINT_METADATA"),
    Damage("bit flip in the metadata (a recorded manifest checksum)",
           flip("_CHECKPOINT_METADATA", lambda d: open(os.path.join(
               d, "_CHECKPOINT_METADATA"), "rb").read().index(b'"manifest_crc32": ') + 19, 0x01),
           "_CHECKPOINT_METADATA"),
    Damage("bit flip in the metadata (the writer's host name)",
           flip("_CHECKPOINT_METADATA", lambda d: open(os.path.join(
               d, "_CHECKPOINT_METADATA"), "rb").read().index(b'"host": "') + 9, 0x01),
           "_CHECKPOINT_METADATA"),
    Damage("data file truncated to half", truncate("params/data.bin", 0.5), "params/data.bin", "w"),
    Damage("data file truncated to nothing", truncate("params/data.bin", 0), "params/data.bin", "b"),
    Damage("manifest truncated to half", truncate("params/manifest.json", 0.5),
           "params/manifest.json"),
    Damage("metadata truncated to half", truncate("_CHECKPOINT_METADATA", 0.5),
           "_CHECKPOINT_METADATA"),
    Damage("metadata truncated to nothing", truncate("_CHECKPOINT_METADATA", 0),
           "_CHECKPOINT_METADATA"),
    Damage("data file all zeros, size kept (a hole-filled file)", _zeros_like("params/data.bin"),
           "params/data.bin", "b"),
    Damage("manifest all zeros, size kept", _zeros_like("opt/manifest.json"), "opt/manifest.json"),
    Damage("data file grown (bytes appended)", _append("params/data.bin", b"\0" * 64),
           "params/data.bin"),
    Damage("data file deleted", remove("params/data.bin"), "params/data.bin", "b"),
    Damage("manifest deleted", remove("params/manifest.json"), "params/manifest.json"),
    Damage("metadata deleted", remove("_CHECKPOINT_METADATA"), "_CHECKPOINT_METADATA"),
    Damage("item directory deleted", remove("opt"), "opt"),
    Damage("every file deleted, directory kept",
           lambda d: [remove(n)(d) for n in os.listdir(d)], "_CHECKPOINT_METADATA"),
    Damage("data file replaced by a directory", replace("params/data.bin", _mkdir),
           "params/data.bin", "b"),
    Damage("data file from another step (same size)", from_step("params/data.bin"),
           "params/data.bin", "b"),
    Damage("item directory from another step", from_step("opt"), "opt/manifest.json"),
    Damage("metadata from another step", from_step("_CHECKPOINT_METADATA"), "_CHECKPOINT_METADATA"),
    Damage("manifest lies about a shape (checksums consistent)",
           lie_in_manifest("params", _set("w", shape=[150], nbytes=600)), "params/data.bin", "w"),
    Damage("manifest lies about a shape, nbytes untouched",
           lie_in_manifest("params", _set("w", shape=[301])), "params/manifest.json", "w"),
    Damage("manifest lies about an offset (into another leaf)",
           lie_in_manifest("params", _set("b", offset=128)), "params/manifest.json", "b"),
    Damage("manifest lies about an offset (past the end)",
           lie_in_manifest("params", _set("w", offset=128)), "params/manifest.json", "w"),
    Damage("manifest lies about its data size",
           lie_in_manifest("params", lambda o: o.update(data_bytes=2000)), "params/data.bin"),
    Damage("manifest lies about a dtype of another width",
           lie_in_manifest("params", _set("b", dtype="int32")), "params/manifest.json", "b"),
    Damage("manifest lies about a checksum",
           lie_in_manifest("params", lambda o: _leaf_entry(o, "w").update(
               crc32=(_leaf_entry(o, "w")["crc32"] + 1) % 2**32)), "params/data.bin", "w"),
    Damage("manifest lies about the tree (one leaf named twice)",
           lie_in_manifest("params", _same_leaf_twice), "params/manifest.json"),
    Damage("manifest lies about the tree (a key differs from its leaf's path)",
           lie_in_manifest("params", _skeleton_key("b", "bias")), "params/manifest.json", "b"),
    Damage("manifest edited, checksum not updated",
           lie_in_manifest("params", _set("b", shape=[8], nbytes=64), consistent=False),
           "params/manifest.json"),
    Damage("metadata lies: lists an item that is not there",
           lie_in_metadata(lambda m: m["items"].update(ghost=dict(m["items"]["opt"]))), "ghost"),
    Damage("metadata lies: leaves an item out",
           lie_in_metadata(lambda m: m["items"].pop("opt")), "opt"),
    Damage("metadata lies about an item's leaf count",
           lie_in_metadata(lambda m: m["items"]["params"].update(num_leaves=3)), "params"),
    Damage("metadata lies about an item's data size",
           lie_in_metadata(lambda m: m["items"]["params"].update(data_bytes=1200)), "params"),
    Damage("metadata lies about its step", lie_in_metadata(lambda m: m.update(step=2)),
           "_CHECKPOINT_METADATA"),
]


def check_damage(case: Damage, template: str, workdir: str) -> list[str]:
    """Apply ``case`` to step 3 of a copy of ``template`` (steps 1, 2, 3) and return what
    verify, restore, fallback and the CLI got wrong (nothing, if all is well)."""
    from minickpt import CheckpointCorruptedError, Checkpointer
    from minickpt.cli import main as cli_main

    run = os.path.join(workdir, "run")
    shutil.copytree(template, run)
    step_dir = os.path.join(run, "step_3")
    case.apply(step_dir)
    file = os.path.join(step_dir, case.file)
    wrong: list[str] = []

    def names(text: str, what: str) -> None:
        if file not in text:
            wrong.append(f"{what} does not name {case.file}: {text[:400]}")
        if case.leaf is not None and f"leaf {case.leaf})" not in text:
            wrong.append(f"{what} does not name leaf {case.leaf}: {text[:400]}")

    rep = Checkpointer().verify(step_dir, step=3)
    if rep.ok:
        wrong.append(f"Checkpointer.verify passed (problems: {rep.problems})")
    else:
        names("\n".join(rep.problems), "Checkpointer.verify")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = CheckpointManager(run, CheckpointManagerOptions(read_only=True))
        rep = m.verify(3)
        if rep.ok:
            wrong.append("manager.verify(3) passed")
        else:
            names("\n".join(rep.problems), "manager.verify(3)")
        for s in (1, 2):
            if not m.verify(s).ok:
                wrong.append(f"damage to step 3 spread to step {s}")
        try:
            m.restore(3)
            wrong.append("restore(3) returned without an error")
        except CheckpointCorruptedError as e:
            names(str(e), "restore(3)")
        except Exception as e:
            wrong.append(f"restore(3) raised {type(e).__name__} instead: {e}")
        try:
            r = m.restore()
            if r.step != 2:
                wrong.append(f"restore() fell back to step {r.step}, not 2")
            else:
                check_items(r, 2)
            if not any("step 3" in str(w.message) for w in caught):
                wrong.append("restore() fell back without a warning naming step 3")
        except Exception as e:
            wrong.append(f"restore() with fallback raised {type(e).__name__}: {e}")
        try:
            m.restore(fallback=False)
            wrong.append("restore(fallback=False) returned a damaged checkpoint")
        except CheckpointCorruptedError:
            pass
        except Exception as e:
            wrong.append(f"restore(fallback=False) raised {type(e).__name__}: {e}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli_main(["verify", run, "3"])
    if rc != 1:
        wrong.append(f"`minickpt verify` exited {rc}, not 1")
    else:
        names(out.getvalue(), "`minickpt verify`")
    return wrong


# ---------------------------------------------------------------------------------------
# sharded checkpoints (format 2): the same checks for the files several processes write
# ---------------------------------------------------------------------------------------
SHARD_PROCESSES = 2


def sharded_items(step: int) -> dict[str, Any]:
    """``items(step)`` with ``params/w`` a jax.Array sharded over up to 4 devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = sorted(jax.devices(), key=lambda d: d.id)[:4]
    if len(devices) < SHARD_PROCESSES:
        raise SkipCase(f"a sharded save by {SHARD_PROCESSES} processes needs as many devices "
                       f"(this JAX has {len(devices)}; set XLA_FLAGS="
                       "--xla_force_host_platform_device_count=4)")
    tree = items(step)
    mesh = Mesh(np.array(devices), ("x",))
    tree["params"]["w"] = jax.device_put(tree["params"]["w"],
                                         NamedSharding(mesh, PartitionSpec("x")))
    return tree


def build_sharded_run(run: str, steps: Any = (1, 2, 3), fs: FileSystem = FAST) -> None:
    """Like :func:`build_run`, but each step saved by SHARD_PROCESSES simulated processes
    (:class:`minickpt.multihost.sync.LocalGroup`): ``params`` is a format-2 item with
    ``data.p<i>.bin`` + ``manifest.p<i>.json`` per process."""
    from minickpt import MultiHostOptions
    from minickpt.multihost.sync import LocalGroup

    opts = CheckpointManagerOptions(multihost=MultiHostOptions(timeout_s=30))
    for s in steps:
        def save(sync: Any, s: int = s) -> bool:
            tree = sharded_items(s)  # each process its own arrays, as in a real job
            with CheckpointManager(run, opts, fs=fs, sync=sync) as m:
                return m.save(s, tree, metrics={"loss": 1.0 / (s + 1)}, force=True)

        for r in LocalGroup(SHARD_PROCESSES).run(save):
            if isinstance(r, BaseException):
                raise r


def lie_in_shard_manifest(item: str, process: int, fn: Callable[[dict[str, Any]], None]
                          ) -> Callable[[str], None]:
    """Rewrite one process's shard manifest and re-seal every checksum that pins it down
    (its record in the item's manifest, and the metadata): a consistent lie."""
    def apply(step_dir: str) -> None:
        name = f"manifest.p{process}.json"
        p = os.path.join(step_dir, item, name)
        obj = json.loads(open(p, "rb").read())
        fn(obj)
        raw = json.dumps(obj).encode()
        with open(p, "wb") as f:
            f.write(raw)

        def reseal(o: dict[str, Any]) -> None:
            for rec in o["shard_files"]:
                if rec["manifest"] == name:
                    rec.update(manifest_crc32=zlib.crc32(raw), num_shards=len(obj["shards"]))
        lie_in_manifest(item, reseal)(step_dir)
    return apply


def _metadata_offset(marker: bytes, skip: int) -> Callable[[str], int]:
    return lambda d: open(os.path.join(d, "_CHECKPOINT_METADATA"), "rb").read().index(
        marker) + skip


SHARDED_DAMAGE: list[Damage] = [
    Damage("bit flip in a shard (params/w in process 1's file)", flip("params/data.p1.bin", 10),
           "params/data.p1.bin", "w"),
    Damage("bit flip in the last byte of a shard file", flip("params/data.p0.bin", 619, 0x01),
           "params/data.p0.bin", "w"),
    Damage("shard file truncated to half", truncate("params/data.p1.bin", 0.5),
           "params/data.p1.bin", "w"),
    Damage("shard file deleted", remove("params/data.p0.bin"), "params/data.p0.bin", "w"),
    Damage("shard file grown (bytes appended)", _append("params/data.p0.bin", b"\0" * 64),
           "params/data.p0.bin"),
    Damage("shard file all zeros, size kept", _zeros_like("params/data.p1.bin"),
           "params/data.p1.bin", "w"),
    Damage("shard file from another step (same size)", from_step("params/data.p1.bin"),
           "params/data.p1.bin", "w"),
    Damage("shard manifest deleted", remove("params/manifest.p1.json"),
           "params/manifest.p1.json"),
    Damage("bit flip in a shard manifest (an index)", flip("params/manifest.p1.json", b"150"),
           "params/manifest.p1.json"),
    Damage("shard manifest from another process", lambda d: shutil.copyfile(
        os.path.join(d, "params/manifest.p0.json"), os.path.join(d, "params/manifest.p1.json")),
           "params/manifest.p1.json"),
    Damage("shard manifest lies about an index (checksums consistent)",
           lie_in_shard_manifest("params", 1, lambda o: o["shards"][0].update(
               index=[[75, 150]])), "params/manifest.json", "w"),
    Damage("shard manifest lies about an offset (onto the next shard, consistent)",
           lie_in_shard_manifest("params", 1, lambda o: o["shards"][0].update(offset=320)),
           "params/manifest.p1.json", "w"),
    Damage("shard manifest lies about an offset (past the end, consistent)",
           lie_in_shard_manifest("params", 0, lambda o: o["shards"][1].update(offset=640)),
           "params/manifest.p0.json", "w"),
    Damage("shard manifest lies about a checksum (consistent)",
           lie_in_shard_manifest("params", 1, lambda o: o["shards"][1].update(
               crc32=(o["shards"][1]["crc32"] + 1) % 2**32)), "params/data.p1.bin", "w"),
    Damage("manifest drops a process's shard file (consistent)",
           lie_in_manifest("params", lambda o: o["shard_files"].pop(1)),
           "params/manifest.json", "w"),
    Damage("manifest forgets a leaf is sharded (consistent)",
           lie_in_manifest("params", lambda o: _leaf_entry(o, "w").pop("sharded")),
           "params/manifest.json", "w"),
    Damage("bit flip in the metadata of a sharded checkpoint (its shard bytes)",
           flip("_CHECKPOINT_METADATA", _metadata_offset(b'"shard_bytes": ', 15), 0x01),
           "_CHECKPOINT_METADATA"),
    Damage("metadata lies about an item's shard bytes",
           lie_in_metadata(lambda m: m["items"]["params"].update(shard_bytes=620)), "params"),
]
"""Damage to the files of a multi-process save; the template is :func:`build_sharded_run`'s
(each process writes two 75-element shards of params/w: 620 bytes with alignment)."""


# ---------------------------------------------------------------------------------------
# sizes and scratch space
# ---------------------------------------------------------------------------------------
SCALE = max(1, int(os.environ.get("MINICKPT_CRASH_SCALE", "1")))
"""Multiplies the randomised parts (random crash states per point, kills, read/write
rounds). CI runs 1; ``MINICKPT_CRASH_SCALE=20 pytest tests/test_crash*.py`` runs more."""


@contextlib.contextmanager
def scratch(fallback: str) -> Iterator[str]:
    """A scratch directory in memory (/dev/shm) when there is one: the crash harness creates
    and deletes tens of thousands of small files, which a busy disk's journal makes slow.
    Durability is modelled, so nothing here needs a real disk."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="minickpt-crash-", dir=base) if base else fallback
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        if base:
            shutil.rmtree(path, ignore_errors=True)


FIGURES: dict[str, int] = {}
"""Figures gathered by the tests that ran, printed at the end of the pytest run."""


def add_figures(**kv: int) -> None:
    for k, v in kv.items():
        FIGURES[k] = FIGURES.get(k, 0) + int(v)


# ---------------------------------------------------------------------------------------
# hostile checkpoints: refused, nothing executed, nothing outside read or written
# ---------------------------------------------------------------------------------------
class _Canary:
    """Unpickling this creates the canary file: proof that pickled data was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


class AuditFileSystem(FileSystem):
    """The real file system, noting every file opened (by its real path, after the kernel
    followed any link), every path looked at, and every write."""

    def __init__(self, inside: str):
        self.inside = os.path.realpath(inside)
        self.lexical = os.path.abspath(inside)
        self.escapes: list[str] = []
        self.writes: list[str] = []

    def _in(self, p: str, root: str) -> bool:
        return p == root or p.startswith(root + os.sep)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            self.writes.append(f"open for writing {path}")
        fd = super().open(path, flags, mode)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc here: fall back to the name asked for
            real = os.path.realpath(path)
        if not self._in(real, self.inside):
            self.escapes.append(f"opened {real} (asked for {path})")
        return fd

    def _look(self, path: str) -> None:
        if not self._in(os.path.abspath(path), self.lexical):
            self.escapes.append(f"looked at {path}")

    def lstat(self, path: str) -> os.stat_result:
        self._look(path)
        return super().lstat(path)

    def listdir(self, path: str) -> list[str]:
        self._look(path)
        return super().listdir(path)

    def _write(self, what: str) -> None:
        self.writes.append(what)

    def write(self, fd: int, data: Any) -> int:
        self._write(f"write fd {fd}")
        return super().write(fd, data)

    def writev(self, fd: int, buffers: Any) -> int:
        self._write(f"writev fd {fd}")
        return super().writev(fd, buffers)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._write(f"mkdir {path}")
        super().mkdir(path, mode)

    def rename(self, src: str, dst: str) -> None:
        self._write(f"rename {src}")
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._write(f"unlink {path}")
        super().unlink(path)

    def rmdir(self, path: str) -> None:
        self._write(f"rmdir {path}")
        super().rmdir(path)

    def ftruncate(self, fd: int, length: int) -> None:
        self._write(f"ftruncate fd {fd}")
        super().ftruncate(fd, length)


class _Hung(BaseException):
    """Raised by an alarm: a BaseException, so that no ``except Exception`` swallows it."""


class SkipCase(Exception):
    """This machine cannot build the case (e.g. no sparse files this large)."""


@dataclass
class Hostile:
    """A hostile checkpoint (step 3 of a run whose steps 1 and 2 are valid).

    ``refused``: reading step 3 must fail with ``error``; otherwise it is ``ignored``: the
    hostile part is never looked at and step 3 restores exactly. Either way nothing runs and
    nothing outside the run is read or written.
    """

    name: str
    build: Callable[[str, str], None]  # (step directory, outside directory)
    error: type | None = None  # None: UnsafeCheckpointError for escapes and pickles, else
    #                            any MiniCkptError
    refused: bool = True


def _outside_copy(rel: str) -> Callable[[str, str], None]:
    """Replace ``rel`` by a symlink to an intact copy of it outside the run."""
    def build(step_dir: str, outside: str) -> None:
        src = os.path.join(step_dir, rel)
        dst = os.path.join(outside, "copy-" + rel.replace("/", "-"))
        if os.path.isdir(src):
            shutil.copytree(src, dst)
            shutil.rmtree(src)
        else:
            shutil.copyfile(src, dst)
            os.unlink(src)
        os.symlink(dst, src)
    return build


def _step_dir_symlink(step_dir: str, outside: str) -> None:
    dst = os.path.join(outside, "copy-step")
    shutil.copytree(step_dir, dst)
    shutil.rmtree(step_dir)
    os.symlink(dst, step_dir)


def _fifo(rel: str) -> Callable[[str, str], None]:
    def build(step_dir: str, outside: str) -> None:
        p = os.path.join(step_dir, rel)
        os.unlink(p)
        os.mkfifo(p)
    return build


def _raw(rel: str, data: bytes | Callable[[str], bytes]) -> Callable[[str, str], None]:
    def build(step_dir: str, outside: str) -> None:
        with open(os.path.join(step_dir, rel), "wb") as f:
            f.write(data(outside) if callable(data) else data)
    return build


def _raw_consistent(step_dir: str, item: str, fn: Callable[[bytes], bytes]) -> None:
    """Rewrite an item's manifest bytes and record their checksum, as its writer would."""
    p = _manifest_path(step_dir, item)
    raw = fn(open(p, "rb").read())
    with open(p, "wb") as f:
        f.write(raw)
    lie_in_metadata(lambda m: m["items"][item].update(manifest_crc32=zlib.crc32(raw)))(step_dir)


def _sparse(rel: str, size: int) -> Callable[[str, str], None]:
    def build(step_dir: str, outside: str) -> None:
        p = os.path.join(step_dir, rel)
        try:
            os.truncate(p, size)
        except OSError as e:
            raise SkipCase(f"cannot make a {size}-byte sparse file here: {e}") from e
    return build


def _manifest(item: str, fn: Callable[[dict[str, Any]], None]) -> Callable[[str, str], None]:
    lie = lie_in_manifest(item, fn)
    return lambda step_dir, outside: lie(step_dir)


def _metadata(fn: Callable[[dict[str, Any]], None]) -> Callable[[str, str], None]:
    lie = lie_in_metadata(fn)
    return lambda step_dir, outside: lie(step_dir)


def _pickle_as_data(step_dir: str, outside: str) -> None:
    payload = pickle.dumps(_Canary(os.path.join(outside, "CANARY")))
    with open(os.path.join(step_dir, "params", "data.bin"), "wb") as f:
        f.write(payload)
    _manifest("params", lambda o: o.update(
        data_bytes=len(payload),
        leaves=[{"path": ["b"], "kind": "pickle", "nbytes": len(payload), "offset": 0},
                _leaf_entry(o, "w")]))(step_dir, outside)


def _npy_with_objects(step_dir: str, outside: str) -> None:
    arr = np.array([_Canary(os.path.join(outside, "CANARY")), 1], dtype=object)
    np.save(os.path.join(step_dir, "params", "data.npy"), arr, allow_pickle=True)
    _manifest("params", lambda o: o.update(data_file="data.npy"))(step_dir, outside)


def _pickles_beside(step_dir: str, outside: str) -> None:
    canary = _Canary(os.path.join(outside, "CANARY"))
    with open(os.path.join(step_dir, "state.pkl"), "wb") as f:
        pickle.dump(canary, f)
    np.save(os.path.join(step_dir, "params", "extra.npy"), np.array([canary], dtype=object),
            allow_pickle=True)
    with open(os.path.join(step_dir, "checkpoint"), "wb") as f:  # a Flax-style file
        pickle.dump({"params": canary}, f)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _skeleton(fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda o: o.update(tree=fn(o["tree"]))


def _deep_skeleton(tree: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = tree
    for _ in range(300):
        node = {"t": "list", "c": [node]}
    return node


def _key_entry(impl: str, shape: list[int]) -> Callable[[dict[str, Any]], None]:
    def fn(o: dict[str, Any]) -> None:
        e = _leaf_entry(o, "b")
        e.update(kind="prng_key", impl=impl, dtype="uint32", shape=shape,
                 nbytes=4 * int(np.prod(shape)))
    return fn


def _unicode_step(step_dir: str, outside: str) -> None:
    shutil.copytree(step_dir, os.path.join(os.path.dirname(step_dir), "step_\u0669"))


def _namedtuple_type_names_code(o: dict[str, Any]) -> None:
    o["tree"]["t"] = "namedtuple"
    o["tree"]["type"] = "__import__('os').system('touch CANARY')"


HOSTILE: list[Hostile] = [
    # pickles and code
    Hostile("manifest leaf of kind 'pickle' over a pickle payload", _pickle_as_data),
    Hostile("manifest dtype 'object'", _manifest("params", _set("b", dtype="object"))),
    Hostile("manifest dtype 'O'", _manifest("params", _set("b", dtype="O"))),
    Hostile("manifest dtype '|O8'", _manifest("params", _set("b", dtype="|O8"))),
    Hostile("data file is a .npy of pickled objects", _npy_with_objects),
    Hostile("PRNG key whose impl names code",
            _manifest("params", _key_entry("__import__('os').system('x')", [7, 2]))),
    Hostile("PRNG key data of the wrong shape for its impl",
            _manifest("params", _key_entry("threefry2x32", [7]))),
    Hostile("pickles beside the checkpoint (state.pkl, .npy of objects, Flax file)",
            _pickles_beside, refused=False),
    Hostile("tree type name that is code", _manifest("params", _namedtuple_type_names_code),
            refused=False),
    # escaping the directory
    Hostile("data_file '../../../outside/secret.txt'",
            _manifest("params", lambda o: o.update(data_file="../../../outside/secret.txt"))),
    Hostile("data_file '/etc/passwd'", _manifest("params", lambda o: o.update(
        data_file="/etc/passwd"))),
    Hostile("data_file 'data/../../x.bin'", _manifest("params", lambda o: o.update(
        data_file="data/../../x.bin"))),
    Hostile("item name '../outside' in the metadata",
            _metadata(lambda m: m["items"].update({"../outside": m["items"].pop("params")}))),
    Hostile("item name '/tmp' in the metadata",
            _metadata(lambda m: m["items"].update({"/tmp": m["items"].pop("params")}))),
    Hostile("item name 'a/b' in the metadata",
            _metadata(lambda m: m["items"].update({"a/b": m["items"].pop("params")}))),
    Hostile("item name '..' in the metadata",
            _metadata(lambda m: m["items"].update({"..": m["items"].pop("params")}))),
    Hostile("item directory is a symlink to an intact copy outside", _outside_copy("params")),
    Hostile("data file is a symlink to an intact copy outside", _outside_copy("params/data.bin")),
    Hostile("manifest is a symlink to an intact copy outside",
            _outside_copy("params/manifest.json")),
    Hostile("metadata is a symlink to an intact copy outside",
            _outside_copy("_CHECKPOINT_METADATA")),
    Hostile("the step directory is a symlink to an intact copy outside", _step_dir_symlink),
    Hostile("item directory is a symlink to itself",
            lambda d, o: (shutil.rmtree(os.path.join(d, "opt")),
                          os.symlink("opt", os.path.join(d, "opt")))),
    Hostile("data file is a symlink to /dev/zero",
            lambda d, o: (os.unlink(os.path.join(d, "params/data.bin")),
                          os.symlink("/dev/zero", os.path.join(d, "params/data.bin")))),
    Hostile("manifest is a FIFO (opening it would block)", _fifo("params/manifest.json")),
    Hostile("metadata is a FIFO (opening it would block)", _fifo("_CHECKPOINT_METADATA")),
    Hostile("data file is a FIFO (opening it would block)", _fifo("params/data.bin")),
    # memory
    Hostile("a leaf of 10^12 elements over a small data file",
            _manifest("params", _set("w", shape=[10**12], nbytes=4 * 10**12))),
    Hostile("a leaf of 10^12 elements over a 4 TB sparse data file (all else consistent)",
            lambda d, o: (_manifest("params", lambda m: (
                _leaf_entry(m, "w").update(shape=[10**12], nbytes=4 * 10**12),
                m.update(data_bytes=64 + 4 * 10**12)))(d, o),
                _metadata(lambda m: m["items"]["params"].update(
                    data_bytes=64 + 4 * 10**12))(d, o),
                _sparse("params/data.bin", 64 + 4 * 10**12)(d, o))),
    Hostile("a shape of 65 dimensions", _manifest("params", _set("b", shape=[1] * 64 + [7]))),
    Hostile("a shape of 2^62 x 2^62", _manifest("params", _set("b", shape=[2**62, 2**62]))),
    Hostile("a negative shape and size", _manifest("params", _set("b", shape=[-7], nbytes=-56))),
    Hostile("a manifest of 300 MB (sparse)", _sparse("params/manifest.json", 300 << 20)),
    Hostile("a metadata file of 20 MB (sparse)", _sparse("_CHECKPOINT_METADATA", 20 << 20)),
    Hostile("metadata listing 10000 items",
            _metadata(lambda m: m["items"].update(
                {f"i{k}": dict(m["items"]["opt"]) for k in range(10_000)}))),
    # versions
    Hostile("manifest format_version 3 (newer than this minickpt)",
            _manifest("params", lambda o: o.update(format_version=3))),
    Hostile("manifest format_version 0", _manifest("params", lambda o: o.update(
        format_version=0))),
    Hostile("manifest format_version '1' (a string)",
            _manifest("params", lambda o: o.update(format_version="1"))),
    Hostile("manifest of another format ('orbax')",
            _manifest("params", lambda o: o.update(format="orbax"))),
    Hostile("metadata format_version 99", _metadata(lambda m: m.update(format_version=99))),
    Hostile("metadata without a format", _metadata(lambda m: m.pop("format"))),
    # malformed JSON
    Hostile("manifest of random bytes", _raw("params/manifest.json", bytes(range(256)) * 4)),
    Hostile("manifest of invalid UTF-8", _raw("params/manifest.json", b'{"format": "\xff\xfe"}')),
    Hostile("manifest that is a JSON list", _raw("params/manifest.json", b"[1, 2, 3]")),
    Hostile("manifest nested 100000 deep", _raw("params/manifest.json", _nested(100_000))),
    Hostile("metadata nested 100000 deep", _raw("_CHECKPOINT_METADATA", _nested(100_000))),
    Hostile("metadata nested 1000000 deep", _raw("_CHECKPOINT_METADATA", _nested(1_000_000))),
    Hostile("manifest holding a 5000-digit integer (its checksum recorded)",
            lambda d, o: _raw_consistent(d, "params", lambda raw: raw.replace(
                b'"shape":[7]', b'"shape":[' + b"9" * 5000 + b"]"))),
    Hostile("metadata holding a 5000-digit integer",
            lambda d, o: _raw("_CHECKPOINT_METADATA", open(os.path.join(
                d, "_CHECKPOINT_METADATA"), "rb").read().replace(b'"step": 3', b'"step": '
                                                                 + b"9" * 5000))(d, o)),
    Hostile("shape holding NaN", _manifest("params", _set("b", shape=[float("nan")]))),
    Hostile("skeleton nested 300 deep", _manifest("params", _skeleton(_deep_skeleton))),
    Hostile("skeleton whose dict key is a list",
            _manifest("params", lambda o: o["tree"]["c"][0].__setitem__(0, ["b"]))),
    Hostile("leaf path holding a number", _manifest("params", _set("b", path=[7]))),
    Hostile("float value that overflows (0x1p99999)",
            _manifest("opt", lambda o: _leaf_entry(o, "count").update(type="float",
                                                                       value="0x1p99999"))),
    Hostile("float value that is not a number",
            _manifest("opt", lambda o: _leaf_entry(o, "count").update(type="float",
                                                                       value="one"))),
    Hostile("complex value of the wrong shape",
            _manifest("opt", lambda o: _leaf_entry(o, "count").update(type="complex",
                                                                       value=[1]))),
    Hostile("metadata items that is a list", _metadata(lambda m: m.update(items=["params"]))),
    Hostile("metadata step that is a string", _metadata(lambda m: m.update(step="3"))),
    # names
    Hostile("a directory named step_\u0669 (an Arabic-Indic 9) beside the steps",
            _unicode_step, refused=False),
]


SHARDED_HOSTILE: list[Hostile] = [
    Hostile("shard file is a symlink to an intact copy outside",
            _outside_copy("params/data.p1.bin")),
    Hostile("shard manifest is a symlink to an intact copy outside",
            _outside_copy("params/manifest.p1.json")),
    Hostile("shard manifest is a FIFO (opening it would block)",
            _fifo("params/manifest.p0.json")),
    Hostile("shard file is a FIFO (opening it would block)", _fifo("params/data.p0.bin")),
    Hostile("shard manifest record '../../../outside/manifest.p0.json'",
            _manifest("params", lambda o: o["shard_files"][0].update(
                manifest="../../../outside/manifest.p0.json"))),
    Hostile("shard record data_file '/etc/passwd'",
            _manifest("params", lambda o: o["shard_files"][1].update(data_file="/etc/passwd"))),
    Hostile("a sharded leaf of 10^12 elements (its shards cover 300)",
            _manifest("params", _set("w", shape=[10**12], nbytes=4 * 10**12))),
    Hostile("a shard 10^12 elements long",
            lambda d, o: lie_in_shard_manifest("params", 1, lambda m: m["shards"][0].update(
                index=[[0, 10**12]], nbytes=4 * 10**12))(d)),
    Hostile("a shard manifest holding a pickle",
            lambda d, o: lie_in_shard_manifest("params", 1, lambda m: m["shards"][0].update(
                kind="pickle", payload=pickle.dumps(_Canary(os.path.join(
                    o, "CANARY"))).hex()))(d), refused=False),
]
"""Hostile multi-process checkpoints (the template is :func:`build_sharded_run`'s)."""


def check_hostile(case: Hostile, template: str, workdir: str) -> list[str]:
    """Build ``case`` into step 3 of a copy of ``template`` and return what went wrong."""
    import signal

    from minickpt import Checkpointer, CheckpointNotFoundError, MiniCkptError, UnsafeCheckpointError
    from minickpt.cli import main as cli_main

    error = case.error if case.error is not None else (
        UnsafeCheckpointError if any(w in case.name for w in (
            "pickle", "object", "'O", "symlink", "'..", "'/", "data_file", "item name",
            "npy")) else MiniCkptError)
    run = os.path.join(workdir, "run")
    outside = os.path.join(workdir, "outside")
    shutil.copytree(template, run)
    os.makedirs(outside)
    with open(os.path.join(outside, "secret.txt"), "w") as f:
        f.write("not yours")
    step_dir = os.path.join(run, "step_3")
    case.build(step_dir, outside)
    before = _snapshot(outside)
    wrong: list[str] = []
    audit = AuditFileSystem(run)

    def expect_error(what: str, fn: Callable[[], Any], err: type) -> None:
        try:
            fn()
            if case.refused:
                wrong.append(f"{what} accepted it")
        except err:
            pass
        except Exception as e:
            wrong.append(f"{what} raised {type(e).__name__}, not {err.__name__}: {e}")

    def on_alarm(*_: Any) -> None:
        raise _Hung("hung for 20 s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(20)
    try:
        ck = Checkpointer(audit)
        try:
            rep = ck.verify(step_dir, step=3)
            if rep.ok == case.refused:
                wrong.append(f"Checkpointer.verify said ok={rep.ok}: {rep.problems}")
        except Exception as e:
            wrong.append(f"Checkpointer.verify raised {type(e).__name__}: {e}")
        if case.refused:
            expect_error("Checkpointer.restore", lambda: ck.restore(step_dir, step=3), error)
        else:
            try:
                check_items(ck.restore(step_dir, step=3), 3)
            except Exception as e:
                wrong.append(f"Checkpointer.restore of the ignored case failed: {e!r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = CheckpointManager(run, CheckpointManagerOptions(read_only=True), fs=audit)
            expect_error("manager.restore(3)", lambda: m.restore(3), MiniCkptError)
            for what, fn in [("manager.verify(3)", lambda: m.verify(3)),
                             ("manager.metadata(3)", lambda: m.metadata(3)),
                             ("manager.item_metadata(3)", lambda: m.item_metadata(3))]:
                try:
                    fn()
                except MiniCkptError:
                    pass
                except Exception as e:
                    wrong.append(f"{what} raised {type(e).__name__}: {e}")
            try:
                r = m.restore()
                want = 2 if case.refused else 3
                if r.step != want:
                    wrong.append(f"restore() returned step {r.step}, not {want}")
                check_items(r, r.step)
            except Exception as e:
                wrong.append(f"restore() raised {type(e).__name__}: {e}")
        if case.refused and 3 in m.all_steps():
            try:
                if m.verify(3).ok:
                    wrong.append("manager.verify(3) said ok")
            except CheckpointNotFoundError:
                pass
            except Exception as e:
                wrong.append(f"manager.verify(3) raised {type(e).__name__}: {e}")
        out = io.StringIO()
        with mock.patch("minickpt.cli.DEFAULT_FS", audit), \
                mock.patch("minickpt.checkpointer.DEFAULT_FS", audit), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            for argv in (["verify", run, "3"], ["ls", "--deep", run], ["inspect", run, "3"],
                         ["diff", os.path.join(run, "step_2"), step_dir]):
                try:
                    rc = cli_main(argv)
                    if argv[0] == "verify" and (rc == 0) == case.refused:
                        wrong.append(f"`minickpt verify` exited {rc}")
                except Exception as e:
                    wrong.append(f"`minickpt {argv[0]}` raised {type(e).__name__}: {e}")
    except _Hung as e:
        wrong.append(f"reading it hung: {e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if audit.escapes:
        wrong.append(f"read outside the run: {audit.escapes[:3]}")
    if audit.writes:
        wrong.append(f"wrote while only reading: {audit.writes[:3]}")
    if os.path.exists(os.path.join(outside, "CANARY")) or os.path.exists("CANARY"):
        wrong.append("the canary exists: pickled data was loaded")
    if _snapshot(outside) != before:
        wrong.append("something outside the run changed")
    return wrong


def _snapshot(path: str) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------------------
# real processes: SIGKILL at random moments, two writers
# ---------------------------------------------------------------------------------------
class Zygote:
    """A process that imported minickpt once and forks workers (tests/crash_worker.py)."""

    def __init__(self, timeout: float = 120.0):
        import subprocess
        import sys

        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "crash_worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._reply()

    def _reply(self) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError("the worker zygote did not answer")
        return json.loads(line)

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def fork(self, fn: str, **args: Any) -> int:
        return int(self._ask({"op": "fork", "fn": fn, "args": args})["pid"])

    def wait(self, pid: int) -> int:
        return int(self._ask({"op": "wait", "pid": pid})["status"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [ln.strip() for ln in f.read().split("\n") if ln.strip()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    """Whether a worker (the zygote's child, not ours to wait for) still runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _wait_for(path: str, word: str, timeout: float, pid: int | None = None) -> bool:
    """Wait until the log at ``path`` has a line starting with ``word`` (False if the
    worker ``pid`` died first, or after ``timeout`` seconds)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(ln.startswith(word) for ln in _lines(path)):
            return True
        if pid is not None and not _alive(pid):
            return any(ln.startswith(word) for ln in _lines(path))
        time.sleep(0.005)
    return False


@dataclass
class KillFigures:
    kills: int = 0
    survived: int = 0
    mid_save: int = 0  # restarts that found (and removed) an interrupted save or delete
    during_open: int = 0  # kills while the manager was starting (cleanup, lock)
    steps_saved: int = 0
    failures: list[str] = field(default_factory=list)


def kill_drill(zyg: Zygote, root: str, *, kills: int, seed: int = 0, size: int = 64 * 1024,
               max_delay: float = 0.4) -> KillFigures:
    """A process saves in a loop and is SIGKILLed at a random moment, ``kills`` times; after
    each kill a fresh manager must find every checkpoint valid, and the latest one must be
    at least the last step the process reported saved, holding exactly ``items(step)``."""
    import random
    import signal
    import time

    rng = random.Random(seed)
    figs = KillFigures()
    last_saved = 0
    os.makedirs(os.path.dirname(root), exist_ok=True)
    for k in range(kills):
        log = os.path.join(os.path.dirname(root), f"kill{k}.log")
        pid = zyg.fork("save_loop", root=root, log=log, size=size, max_to_keep=3, seconds=30.0)
        if not _wait_for(log, "ready", 60, pid):
            os.kill(pid, signal.SIGKILL)
            zyg.wait(pid)
            figs.failures.append(f"kill {k}: the worker never became ready")
            continue
        if k % 4 == 3:  # every fourth round, let it save once first: progress is certain
            _wait_for(log, "saved", 60, pid)
        # mostly while saving; one kill in six while the manager starts (lock, cleanup)
        time.sleep(rng.uniform(0.0, 0.004) if rng.random() < 1 / 6 else
                   rng.uniform(0.0, max_delay))
        os.kill(pid, signal.SIGKILL)
        status = zyg.wait(pid)
        figs.kills += 1
        lines = _lines(log)
        saved = [int(ln.split()[1]) for ln in lines if ln.startswith("saved ")]
        if saved:
            last_saved = saved[-1]
        figs.during_open += not any(ln.startswith("open") for ln in lines)
        figs.steps_saved += len(saved)
        wrong = []
        if status != -signal.SIGKILL:
            wrong.append(f"the worker ended with status {status} before the kill")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with CheckpointManager(root) as m:
                    figs.mid_save += bool(m.removed_temporaries)
                    steps = m.all_steps()
                    latest = m.latest_step()
                    if last_saved and (latest is None or latest < last_saved):
                        wrong.append(f"latest step is {latest}, but step {last_saved} was "
                                     "saved before the kill")
                    for s in steps:
                        if not m.verify(s).ok:
                            wrong.append(f"step {s} is damaged: {m.verify(s).problems}")
                    if latest is not None:
                        r = m.restore()
                        if r.step != latest:
                            wrong.append(f"restore() gave step {r.step}, latest is {latest}")
                        check_items(r, r.step, size)
                if [w for w in caught if "skipping damaged" in str(w.message)]:
                    wrong.append("restore() had to skip a damaged checkpoint")
        except Exception as e:
            wrong.append(f"restart failed: {type(e).__name__}: {e}")
        figs.survived += not wrong
        figs.failures += [f"kill {k} (after {len(saved)} saves): {w}" for w in wrong]
    return figs


# ---------------------------------------------------------------------------------------
# full disks and I/O errors
# ---------------------------------------------------------------------------------------
def _temporaries(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if is_temporary(n))


def check_save_fault(root: str, k: int, err: int, *, persistent: bool = False) -> list[str]:
    """Steps 1, 2 saved (max_to_keep=2); save 3 meets ``err`` at its k-th file-system call
    (and, ``persistent``, at every later write-like call: a disk that stays full). Returns
    what went wrong: the error must carry the errno and name the checkpoint, no temporary
    may stay, steps 1 and 2 must stay intact, and retention must not run for a failed save."""
    import errno as errno_mod

    from minickpt.faults import FaultyFileSystem

    build_run(root, (1, 2))
    writes = {"write", "writev", "fsync", "mkdir", "open", "ftruncate"}

    def full(op: str, args: tuple[Any, ...]) -> bool:  # a full disk still lets you delete
        return op != "open" or bool(args[1] & os.O_CREAT)

    fs = FaultyFileSystem(error=OSError(err, os.strerror(err)), base=FAST,
                          ops=writes if persistent else
                          FaultyFileSystem(base=FAST).ops,
                          when=full if persistent else None, persistent=persistent)
    wrong: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2), fs=fs)
        fs.fail_at = fs.count + k
        failed = None
        try:
            m.save(3, items(3))
        except OSError as e:
            failed = e
        fs.fail_at = None
        if not fs.tripped:
            m.close()
            return ["the fault was never reached"]
        step3 = os.path.isdir(os.path.join(root, "step_3"))
        if failed is not None:
            if failed.errno != err:
                wrong.append(f"error carries errno {failed.errno}, not {err}: {failed}")
            if "step_3" not in str(failed):
                wrong.append(f"error does not name the checkpoint: {failed}")
            if err == errno_mod.ENOSPC and not step3 and "disk is full" not in str(failed):
                wrong.append(f"ENOSPC error does not say the disk is full: {failed}")
            if sorted(s for s in (1, 2) if os.path.isdir(os.path.join(root, f"step_{s}"))) \
                    != [1, 2]:
                wrong.append("a failed save triggered a retention deletion")
            if _temporaries(root):
                wrong.append(f"temporaries left after the error: {_temporaries(root)}")
        else:
            errnos = [w for w in caught if f"[Errno {err}]" in str(w.message)]
            if not step3:
                wrong.append("save returned, but step 3 is not there")
            elif not errnos and _temporaries(root):
                wrong.append("a fault after the commit left a temporary without a warning")
        try:
            if step3 and 3 not in m.all_steps():
                wrong.append("step 3 is on disk but the manager does not list it")
            if not step3:  # the manager must still work once the disk is fine again
                m.save(3, items(3))
            m.save(4, items(4))
            if _temporaries(root):
                wrong.append(f"temporaries still there after the next save: "
                             f"{_temporaries(root)}")
            for s in m.all_steps():
                if not m.verify(s).ok:
                    wrong.append(f"step {s} damaged: {m.verify(s).problems}")
            if m.all_steps() != [3, 4]:
                wrong.append(f"after two more saves the steps are {m.all_steps()}")
        except Exception as e:
            wrong.append(f"the manager did not recover: {type(e).__name__}: {e}")
        m.close()
    return wrong


def check_collective_save_fault(template: str, root: str, process: int, k: int, err: int
                                ) -> tuple[bool, list[str]]:
    """A multi-process save of step 3 (SHARD_PROCESSES simulated processes, max_to_keep=2)
    over a copy of ``template`` (steps 1 and 2, sharded) in which ``process`` meets ``err``
    at its k-th file-system call of the save. Returns (whether the fault was reached, what
    went wrong): if step 3 was not committed, *every* process must raise an error carrying
    the errno (the failing one: the checkpoint named; the others: the failing process
    named), no temporary may stay, and steps 1 and 2 must be intact and not retired."""
    from minickpt import MiniCkptError, MultiHostOptions
    from minickpt.faults import FaultyFileSystem
    from minickpt.multihost.sync import LocalGroup

    shutil.copytree(template, root)
    opts = CheckpointManagerOptions(max_to_keep=2, multihost=MultiHostOptions(timeout_s=30))
    faulty = FaultyFileSystem(error=OSError(err, os.strerror(err)), base=FAST)

    def save(sync: Any) -> bool:
        tree = sharded_items(3)  # each process its own arrays, as in a real job
        fs = faulty if sync.process_index == process else FAST
        m = CheckpointManager(root, opts, fs=fs, sync=sync)
        try:
            if fs is faulty:
                faulty.fail_at = faulty.count + k
            return m.save(3, tree)
        finally:
            if fs is faulty:  # only its own: the others return while the primary removes
                faulty.fail_at = None  # the retired step's files (after the last barrier)
            m.close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = LocalGroup(SHARD_PROCESSES).run(save)
    if not faulty.tripped:
        return False, []
    wrong: list[str] = []
    step3 = os.path.isdir(os.path.join(root, "step_3"))
    for p, r in enumerate(results):
        if isinstance(r, BaseException) and not isinstance(r, (OSError, MiniCkptError)):
            wrong.append(f"process {p} raised {type(r).__name__}: {r}")
        elif not step3 and not isinstance(r, BaseException):
            wrong.append(f"process {p} returned {r!r} from a save that was not committed")
        elif isinstance(r, BaseException) and getattr(r, "errno", None) != err:
            wrong.append(f"process {p}'s error carries errno {getattr(r, 'errno', None)}, "
                         f"not {err}: {r}")
        elif isinstance(r, BaseException) and p == process and "step_3" not in str(r):
            wrong.append(f"process {p}'s error does not name the checkpoint: {r}")
        elif isinstance(r, BaseException) and p != process and f"process {process}" not in str(r):
            wrong.append(f"process {p}'s error does not name process {process}: {r}")
    # a failed retention delete (after the commit) may leave a deletion temporary: it is
    # invisible, and the next manager to open the directory removes it
    left = [n for n in _temporaries(root) if not step3 or DELETE_MARK not in n]
    if left:
        wrong.append(f"temporaries left: {left}")
    with CheckpointManager(root, opts, fs=FAST) as m:
        if _temporaries(root):
            wrong.append(f"temporaries left after a manager opened: {_temporaries(root)}")
        want = [1, 2, 3] if step3 else [1, 2]  # retention only after a complete commit:
        if m.all_steps() not in (want, [2, 3]):  # step 1 may go only once step 3 is in
            wrong.append(f"a fresh manager finds steps {m.all_steps()}")
        for s in m.all_steps():
            rep = m.verify(s)
            if not rep.ok:
                wrong.append(f"step {s} is damaged: {rep.problems}")
            else:
                check_items(m.restore(s), s)
    return True, wrong


def collective_save_call_count(template: str, root: str, process: int) -> int:
    """How many file-system calls ``process`` makes in a collective save of step 3."""
    from minickpt import MultiHostOptions
    from minickpt.faults import FaultyFileSystem
    from minickpt.multihost.sync import LocalGroup

    shutil.copytree(template, root)
    opts = CheckpointManagerOptions(max_to_keep=2, multihost=MultiHostOptions(timeout_s=30))
    counter = FaultyFileSystem(base=FAST)
    counts: dict[str, int] = {}

    def save(sync: Any) -> bool:
        tree = sharded_items(3)
        fs = counter if sync.process_index == process else FAST
        with CheckpointManager(root, opts, fs=fs, sync=sync) as m:
            start = counter.count
            out = m.save(3, tree)
            if fs is counter:
                counts["n"] = counter.count - start
            return out

    for r in LocalGroup(SHARD_PROCESSES).run(save):
        if isinstance(r, BaseException):
            raise r
    shutil.rmtree(root)
    return counts["n"]


def save_call_count() -> int:
    """How many file-system calls saving step 3 (with retention) makes."""
    from minickpt.faults import FaultyFileSystem

    with tempfile.TemporaryDirectory() as d:
        build_run(os.path.join(d, "run"), (1, 2))
        fs = FaultyFileSystem(base=FAST)
        with CheckpointManager(os.path.join(d, "run"), CheckpointManagerOptions(max_to_keep=2),
                               fs=fs) as m:
            start = fs.count
            m.save(3, items(3))
            return fs.count - start


@contextlib.contextmanager
def small_filesystem(kind: str, mountpoint: str, size_mb: int = 2) -> Iterator[str]:
    """Mount a tiny file system at ``mountpoint`` (tmpfs, or ext4 in a loop-mounted image);
    raise SkipCase saying why when this machine does not allow it. Always unmounted."""
    import subprocess

    def sh(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    if os.geteuid() != 0:
        raise SkipCase("mounting a small file system needs root")
    os.makedirs(mountpoint, exist_ok=True)
    if kind == "tmpfs":
        r = sh("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", mountpoint)
    elif kind == "ext4":
        if shutil.which("mkfs.ext4") is None:
            raise SkipCase("mkfs.ext4 is not installed")
        img = mountpoint + ".img"
        with open(img, "wb") as f:
            f.truncate(size_mb << 20)
        r = sh("mkfs.ext4", "-q", "-F", "-m", "0", img)
        if r.returncode == 0:
            r = sh("mount", "-o", "loop", img, mountpoint)
    else:
        raise ValueError(kind)
    if r.returncode != 0:
        raise SkipCase(f"cannot mount a {size_mb} MB {kind} here: "
                       f"{(r.stderr or r.stdout).strip()}")
    try:
        yield mountpoint
    finally:
        if sh("umount", mountpoint).returncode != 0:
            sh("umount", "-l", mountpoint)


def check_real_full_disk(mountpoint: str) -> tuple[list[str], int]:
    """Fill a real small file system with checkpoints until one does not fit. Returns what
    went wrong and the errno met."""
    st = os.statvfs(mountpoint)
    free = st.f_bavail * st.f_frsize
    size = int(free / 2.6) // 4  # float32 leaves: two checkpoints fit, a third does not
    root = os.path.join(mountpoint, "run")
    wrong: list[str] = []
    met = 0
    m = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=3))
    try:
        m.save(1, items(1, size))
        m.save(2, items(2, size))
        try:
            m.save(3, items(3, size))
            wrong.append("a third checkpoint fitted: the file system is larger than planned")
        except OSError as e:
            met = e.errno or 0
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                wrong.append(f"the error carries errno {e.errno}, not ENOSPC: {e}")
            if "step_3" not in str(e) or "disk is full" not in str(e):
                wrong.append(f"the error does not say which checkpoint, or what to do: {e}")
        if _temporaries(root):
            wrong.append(f"temporaries left on the full disk: {_temporaries(root)}")
        if m.all_steps() != [1, 2]:
            wrong.append(f"steps after the failure: {m.all_steps()}")
        for s in (1, 2):
            if not m.verify(s).ok:
                wrong.append(f"step {s} damaged by the full disk: {m.verify(s).problems}")
            check_items(m.restore(s), s, size)
        m.delete(1)  # free space: saving works again
        m.save(3, items(3, size))
        check_items(m.restore(), 3, size)
    finally:
        m.close()
    return wrong, met


def check_run_owners(root: str, writers: str = "AB") -> tuple[dict[int, str], list[str]]:
    """Which writer made each checkpoint; wrong if any checkpoint mixes two writers' items."""
    from crash_worker import writer_items

    m = CheckpointManager(root, CheckpointManagerOptions(read_only=True))
    owners: dict[int, str] = {}
    wrong = []
    for s in m.all_steps():
        rep = m.verify(s)
        if not rep.ok:
            wrong.append(f"step {s} damaged: {rep.problems}")
            continue
        r = m.restore(s)
        who, _, step = str(r["opt"]["tag"]).partition("-")
        want = writer_items(s, who) if who in writers else None
        if want is None or int(step) != s:
            wrong.append(f"step {s} holds tag {r['opt']['tag']!r}")
        elif not np.array_equal(r["params"]["w"], want["params"]["w"]) \
                or r["opt"]["count"] != want["opt"]["count"]:
            wrong.append(f"step {s} mixes items of two writers")
        else:
            owners[s] = who
    return owners, wrong


def two_writers(zyg: Zygote, workdir: str, mode: str) -> list[str]:
    """Two processes open managers on one directory at the same moment.

    ``refuse``: neither waits; one must be refused with a clear error. ``serialise``: both
    wait for the lock; all of both writers' steps must be there. ``nolock``: lock=False,
    both save the same steps; each step must be exactly one writer's, the other told it
    exists. In every mode no checkpoint may mix the two writers' items."""
    import time

    from crash_worker import EXIT_REFUSED

    root = os.path.join(workdir, "run")
    os.makedirs(root, exist_ok=True)
    logs = {w: os.path.join(workdir, f"{w}.log") for w in "AB"}
    steps = {"A": list(range(10, 16)), "B": list(range(20, 26))} if mode == "serialise" \
        else {w: list(range(1, 9)) for w in "AB"}
    start = time.time() + 1.0
    pids = {w: zyg.fork("writer", root=root, log=logs[w], name=w, steps=steps[w],
                        start_at=start, wait_for_lock=mode == "serialise",
                        lock=mode != "nolock") for w in "AB"}
    codes = {w: zyg.wait(pid) for w, pid in pids.items()}
    owners, wrong = check_run_owners(root)
    if mode == "refuse":
        if sorted(codes.values()) != [0, EXIT_REFUSED]:
            return [*wrong, f"exit codes {codes}: expected one writer refused"]
        loser = next(w for w, c in codes.items() if c == EXIT_REFUSED)
        refusal = _lines(logs[loser])[-1]
        if "another CheckpointManager is writing to" not in refusal or "pid" not in refusal:
            wrong.append(f"the refusal is not clear: {refusal}")
        winner = "B" if loser == "A" else "A"
        if owners != {s: winner for s in steps[winner]}:
            wrong.append(f"steps and owners: {owners}")
        return wrong
    if codes != {"A": 0, "B": 0}:
        return [*wrong, f"exit codes {codes}: {[_lines(p)[-2:] for p in logs.values()]}"]
    if mode == "serialise":
        if owners != {s: w for w in "AB" for s in steps[w]}:
            wrong.append(f"steps and owners: {owners}")
        return wrong
    for s in steps["A"]:  # nolock: one "saved" and one "exists" for every step
        said = {w: next((ln.split()[0] for ln in _lines(logs[w]) if ln.endswith(f" {s}")), "?")
                for w in "AB"}
        if sorted(said.values()) != ["exists", "saved"] or said.get(owners.get(s, "")) != "saved":
            wrong.append(f"step {s}: writers said {said}, owner {owners.get(s)}")
    return wrong


def reader_under_churn(zyg: Zygote, workdir: str, seconds: float, seed: int = 3
                       ) -> tuple[dict[str, int], list[str]]:
    """A read-only manager restores (latest, or a random listed step) while another process
    saves and deletes as fast as it can. Every restore must be whole and exact, or a clean
    CheckpointNotFoundError when the step was deleted under it; never a "damaged" fallback."""
    import random
    import time

    from minickpt import CheckpointNotFoundError

    root = os.path.join(workdir, "run")
    log = os.path.join(workdir, "churn.log")
    pid = zyg.fork("churn", root=root, log=log, seconds=seconds)
    outcomes = {"restored": 0, "not found": 0}
    wrong: list[str] = []
    if not _wait_for(log, "ready", 60, pid):
        zyg.wait(pid)
        return outcomes, [f"the writer never started: {_lines(log)}"]
    give_up = time.monotonic() + 60
    while not os.path.isdir(root):
        if time.monotonic() > give_up:
            return outcomes, [f"the writer never created {root}: {_lines(log)[-3:]}"]
        time.sleep(0.01)
    rng = random.Random(seed)
    reader = CheckpointManager(root, CheckpointManagerOptions(read_only=True))
    deadline = time.monotonic() + seconds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would mean "damaged"
        while time.monotonic() < deadline and len(wrong) < 5:
            try:
                reader.reload()
                steps = reader.all_steps()
                if not steps:
                    continue
                s = rng.choice(steps)
                r = reader.restore(s) if rng.random() < 0.5 else reader.restore()
                check_items(r, int(r.step), 20000)
                reader.verify(s)
                outcomes["restored"] += 1
            except CheckpointNotFoundError:
                outcomes["not found"] += 1
            except BaseException as e:
                wrong.append(f"{type(e).__name__}: {e}")
    if zyg.wait(pid) != 0:
        wrong.append(f"the writer failed: {_lines(log)[-3:]}")
    if outcomes["restored"] < 10:
        wrong.append(f"too few restores to mean anything: {outcomes}")
    return outcomes, wrong
