"""The crash-safety harness shared by the tests and ``scripts/crash_report.py``.

Each part returns figures (how many crash points, states, kills, cases) and the list of
everything that went wrong, so that a test asserts the list is empty and the report prints the
figures. Sizes are parameters: the tests run CI sizes, the report (``--more``) larger ones.

Saved values are a function of the step (:func:`items`), so a checker that finds step ``s``
knows exactly what it must hold.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
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
from minickpt.commit import is_temporary
from minickpt.crashsim import AssertionFailure, explore
from minickpt.fs import FileSystem
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

    def manager(self, world: str, fs: FileSystem, **extra: Any) -> CheckpointManager:
        return CheckpointManager(os.path.join(world, self.run_dir),
                                 CheckpointManagerOptions(**{**self.options, **extra}), fs=fs)


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

# Async saving (issue: background thread running Checkpointer.write + retention) adds one
# Scenario here: options={"enable_async_checkpointing": True}, and a run that saves, then
# calls m.wait_until_finished(). The recorder crashes every thread at once, so nothing else
# in the harness changes.


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


def _leaf(step_dir: str, item: str, leaf: str) -> dict[str, Any]:
    obj = json.loads(open(_manifest_path(step_dir, item), "rb").read())
    return next(e for e in obj["leaves"] if e["path"] == [leaf])


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
