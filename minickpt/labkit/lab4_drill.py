"""Lab 4's grader drill (issue 38, mended for issue 47): the grader draws the data and the
faults, the workers run the student's lab 4 functions in the submission's sandbox, and the
verdict is read from the disk by the grader's own process.

What the workers learn, and when. A worker starts knowing only its folder: it runs lab 4's
setup imports and the student's definitions, and only then connects to the grader's socket
(:mod:`minickpt.labkit.channel`) and receives, save by save, what it is to save (a step and the
seed of its values) and, on the one process that fails, where and how. Nothing of the plan is
in ``argv``, the environment or a file. The grader reads the folder after every save, so each
step must appear exactly when its save returns (not before, and only when it succeeded), and
the library's save path tells it, per save and process, how often it called each of the
student's functions: a good save that never went through ``two_barrier_commit`` fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

DRILL_SPECS: tuple[tuple[Any, ...], ...] = (
    ("p", "l"), ("p", None), (None, "l"), ("l", "p"), ("l", None), (None, "p"),
    (("p", "l"), None), (("l", "p"), None))
"""The shardings the grader's drill draws from, on a (processes, 2) mesh ``("p", "l")``: each
spans the processes (a fully replicated array is the primary's alone, not its shards)."""
DRILL_POINTS = ("after_agree", "after_create", "before_write", "after_write", "before_commit")
"""Where a drill's save may fail: every point before the step is published (``before_commit``:
the primary's commit, which only the primary reaches)."""
DRILL_ERRORS = ("OSError", "RuntimeError", "ValueError")
"""The kinds of failure a drill injects: the contract says *any* failure fails the save
everywhere, so not only the OSError of a disk."""
NAMES = ("agree_on_step", "owned_shards", "two_barrier_commit", "region_from_pieces")

_DRILL_BODY = '''import minickpt.multihost.process as _mhp
_mhp.initialize()
import functools
import jax
import minickpt as mc
from minickpt.labkit import channel as _ch
from minickpt.labkit import lab4 as _lab4
from minickpt.labkit import lab4_drill as _lab4_drill
from minickpt.labkit import plugged_in as _plug
from minickpt.multihost.sync import default_sync as _default_sync
_dir = sys.argv[1]
_ns = {"__name__": "lab04_student"}
exec(_lab4.LAB4_IMPORTS, _ns)
with open(os.path.join(_dir, "lab4_tasks.py"), encoding="utf-8") as _f:
    exec(compile(_f.read(), "<your lab 4 cells>", "exec"), _ns)
ME, N = jax.process_index(), jax.process_count()
_conn = _ch.connect(_dir)  # only now, the student's definitions loaded, does anything come
_ch.send(_conn, {"hello": ME})
_setup = _ch.recv(_conn, 120.0)
_calls = {}


def _counted(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _calls[fn.__name__] = _calls.get(fn.__name__, 0) + 1
        return fn(*args, **kwargs)
    return call


_mine = [_counted(_ns[_n]) for _n in _setup["names"] if callable(_ns.get(_n))]
_KINDS = {"OSError": OSError, "RuntimeError": RuntimeError, "ValueError": ValueError}
with _plug(*_mine):
    _sync = _default_sync()
    _opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(
        timeout_s=_setup["timeout_s"], primary_host=_setup["primary"]))
    with mc.CheckpointManager(os.path.join(_dir, "ckpt"), _opts) as _mngr:
        while True:
            _save = _ch.recv(_conn, 300.0)
            if _save is None:
                break
            _tree = {"params": _lab4_drill.drill_tree(_save["seed"], _setup["layout"])}
            _sync.faults.clear()
            _fault = _save.get("fault")
            if _fault is not None and _fault["action"] == "raise":
                def _hook(_f=_fault):
                    _kind = _KINDS[_f["kind"]]
                    _what = f"injected at {_f['point']} on process {ME}"
                    raise _kind(5, f"Input/output error ({_what})") if _kind is OSError \\
                        else _kind(f"a {_f['kind']} ({_what})")
                _sync.faults[_fault["point"]] = _hook
            elif _fault is not None:
                def _hook(_s=float(_fault["action"])):
                    time.sleep(_s)
                _sync.faults[_fault["point"]] = _hook
            _calls.clear()
            try:
                _mngr.save(_save["step"], _tree)
                _seen = "returned"
            except Exception as _e:
                _seen = f"{type(_e).__name__}: {str(_e)[:200]}"
            _sync.faults.clear()
            _ch.send(_conn, {"step": _save["step"], "outcome": _seen, "calls": dict(_calls)})
    try:  # process 0 hosts the coordination service: nobody leaves before everybody is done
        _sync.exchange("lab4-drill-done", None, 20.0, "the end of the drill")
        if ME == 0:
            time.sleep(0.5)
    except Exception:
        pass
_mhp.hard_exit(0)
'''

_DRILL_LAUNCHER = '''\
import json, sys
from minickpt.launch import launch
res = launch(["-c", sys.argv[1], sys.argv[2]], int(sys.argv[3]), devices_per_process=2,
             timeout_s=float(sys.argv[4]), grace_s=float(sys.argv[4]),
             env={"JAX_PLATFORMS": "cpu"})
tails = ["".join(o[-6:])[-1500:] for o in res.outputs]
print("LAUNCHED " + json.dumps({"rc": res.returncodes, "timed_out": res.timed_out,
                                "tails": tails}), flush=True)
sys.exit(0 if all(rc == 0 for rc in res.returncodes) else 1)
'''


def _worker_script() -> str:
    """What each of the drill's processes runs (argv: its folder, nothing else)."""
    from .lab4 import _PIN_CPUS

    return "import json, os, sys, time\n" + _PIN_CPUS + _DRILL_BODY


def drill_values(seed: int, name: str, shape: Sequence[int], dtype: str) -> np.ndarray:
    """The values of leaf ``name`` in the drill's save of ``seed``: drawn from ``seed``, so
    that only the grader, which chose it, knows them before the workers run."""
    import zlib

    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-100, 100, tuple(shape)).astype(np.dtype(dtype))
    return (rng.standard_normal(tuple(shape)) * 100).astype(np.dtype(dtype))


def _spec(entries: Sequence[Any]) -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[tuple(e) if isinstance(e, list | tuple) else e for e in entries])


def drill_tree(seed: int, layout: Mapping[str, Sequence[Any]]) -> dict[str, jax.Array]:
    """In a worker of the drill: the tree to save, each leaf on its drawn sharding over the
    job's (processes, 2) mesh, with the values of :func:`drill_values`."""
    from jax.sharding import NamedSharding

    from .lab4 import process_mesh

    m = process_mesh((jax.process_count(), 2), ("p", "l"))
    out = {}
    for name, (shape, spec, dtype) in layout.items():
        g = drill_values(seed, name, shape, dtype)
        out[name] = jax.make_array_from_callback(tuple(shape), NamedSharding(m, _spec(spec)),
                                                 lambda idx, g=g: g[idx])
    return out


def drill_boxes(layout: Mapping[str, Sequence[Any]], processes: int
                ) -> dict[str, list[list[list[int]]]]:
    """Leaf -> its distinct pieces on the drill's mesh, worked out here without devices."""
    from ..format.shards import box_of
    from .lab4 import fake_devices_indices_map

    ids = np.arange(2 * processes).reshape(processes, 2)
    owner = {i: i // 2 for i in range(2 * processes)}
    out: dict[str, list[list[list[int]]]] = {}
    for name, (shape, spec, _) in layout.items():
        imap = fake_devices_indices_map(tuple(shape), ids, ("p", "l"),
                                        [tuple(e) if isinstance(e, list) else e for e in spec],
                                        owner)
        boxes: list[list[list[int]]] = []
        for index in imap.values():
            b = [list(x) for x in box_of(index, tuple(shape))]
            if b not in boxes:
                boxes.append(b)
        out[name] = boxes
    return out


def drill_plan(chance: Any = None, processes: int = 4) -> dict[str, Any]:
    """What the grader draws for one drill: the tree's layout (3 leaves, shardings and sizes),
    the primary, the seeds of the values, a slow process in the first save, and the process
    and the point where the second save fails, and the kind of each failure (an OSError or
    another exception: :data:`DRILL_ERRORS`). Four saves: a good one (a process slow to
    write), a failed one (an error on a process, at a point before publication), one whose
    primary's commit fails before the rename, a good one. A failed save publishes nothing and
    raises on every process."""
    import random

    chance = chance or random.SystemRandom()
    layout = {}
    for i, dtype in enumerate(chance.sample(["float32", "int32", "float16", "int8"], 3)):
        spec = [list(e) if isinstance(e, tuple) else e for e in chance.choice(DRILL_SPECS)]
        shape = [2 * processes * chance.randint(1, 2), processes * chance.randint(1, 3)]
        layout[f"leaf{i}_{chance.randint(0, 999)}"] = [shape, spec, dtype]
    steps = sorted(chance.sample(range(1, 1000), 4))
    primary = chance.randrange(processes)
    slow = chance.choice([p for p in range(processes) if p != primary])

    def seed() -> int:
        return chance.randint(1, 2**31 - 1)

    # the primary's commit fails with an error that is not an OSError, every time: a
    # two_barrier_commit that reads "any failure" as a disk's passes a drill of OSErrors
    kinds = [chance.choice(DRILL_ERRORS), chance.choice(DRILL_ERRORS[1:])]
    saves = [
        {"step": steps[0], "seed": seed(), "process": slow, "point": "before_write",
         "action": "1.5"},
        {"step": steps[1], "seed": seed(), "process": chance.randrange(processes),
         "point": chance.choice(DRILL_POINTS[:-1]), "action": "raise", "kind": kinds[0]},
        # the primary's commit fails (before the rename): only the primary reaches that point
        {"step": steps[2], "seed": seed(), "process": primary, "point": "before_commit",
         "action": "raise", "kind": kinds[1]},
        {"step": steps[3], "seed": seed(), "process": processes, "point": "before_write",
         "action": "0"},
    ]
    return {"layout": layout, "primary": primary, "saves": saves, "timeout_s": 6,
            "processes": processes,
            "names": list(NAMES)}


def _for_process(save: Mapping[str, Any], p: int) -> dict[str, Any]:
    """What process ``p`` is told of one save, just before it: the step, the seed of the
    values, and its own fault (where, and what), if it is the one the save slows or fails."""
    fault = None
    if save["process"] == p:
        fault = {"point": save["point"], "action": save["action"],
                 "kind": save.get("kind", "OSError")}
    return {"step": save["step"], "seed": save["seed"], "fault": fault}


def run_lab4_drill(code: str, d: str, plan: Mapping[str, Any], *, timeout_s: float = 150.0,
                   env: Mapping[str, str] | None = None, python: str | None = None,
                   wrap: Callable[[list[str], dict[str, str]], list[str]] | None = None,
                   after_run: Callable[[], None] | None = None) -> dict[str, Any]:
    """Lab 4's drill, as the grader runs it from its own process (autograder/drills.py): one
    command (``wrap`` puts it in the submission's sandbox, one network namespace for the
    job's TCP on 127.0.0.1) launches ``plan["processes"]`` JAX processes that run ``code``
    (the student's lab 4 definitions, plugged into minickpt) and make the plan's saves in
    ``d/ckpt``, told one save at a time over the channel, after the code is loaded; the
    folder is read here after each. ``after_run``: once the command has ended (its
    processes gone, the folder checked readable).

    Returns ``rc`` (the command's), ``listings`` (the folder before the first save and after
    each), ``outcomes`` and ``calls`` (per save, by process: what the save path reported),
    ``channel`` (what went wrong on the channel, or None), ``said`` (what the launcher
    printed) and ``err``; the verdict is :func:`lab4_drill_message`."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from . import channel
    from .lab4 import listing

    n = int(plan["processes"])
    ckpt = os.path.join(d, "ckpt")
    with open(os.path.join(d, "lab4_tasks.py"), "w", encoding="utf-8") as f:
        f.write(code)
    launch_s = timeout_s * 0.8
    out: dict[str, Any] = {"rc": None, "said": None, "err": "", "ckpt": ckpt, "listings": [],
                           "outcomes": [], "calls": [], "channel": None}
    listener = channel.Listener(d)  # before wrap: the folder's entries become the slot's
    cmd = [python or sys.executable, "-c", _DRILL_LAUNCHER, _worker_script(), d, str(n),
           str(launch_s)]
    env = {**(env if env is not None else {}), "JAX_PLATFORMS": "cpu"}
    cmd = wrap(cmd, env) if wrap is not None else cmd
    conns: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    streams: dict[str, str] = {}
    proc = None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, errors="replace")

        def drain(name: str, stream: Any) -> None:
            streams[name] = stream.read()

        readers = [threading.Thread(target=drain, args=(k, s), daemon=True)
                   for k, s in (("out", proc.stdout), ("err", proc.stderr))]
        for t in readers:
            t.start()
        out["channel"] = _drive(listener, conns, plan, n, ckpt, out, deadline, listing)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out["err"] = f"still running after {timeout_s:.0f} s"
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=5)
        out["rc"] = proc.returncode
        for line in streams.get("out", "").splitlines():
            if line.startswith("LAUNCHED "):
                try:
                    out["said"] = json.loads(line[len("LAUNCHED "):])
                except ValueError:
                    pass
        out["err"] = (out["err"] + streams.get("err", ""))[-2000:]
    finally:
        for c in conns.values():
            c.close()
        listener.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if after_run is not None:
            after_run()
    return out


def _drive(listener: Any, conns: dict[int, Any], plan: Mapping[str, Any], n: int, ckpt: str,
           out: dict[str, Any], deadline: float, listing: Callable[[str], list[str]]
           ) -> str | None:
    """The grader's side of the channel: every process says who it is, gets the set-up,
    then each save in turn; the folder is read before the first save and after each. What
    went wrong on the channel, or None."""
    import os
    import time

    from . import channel

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    while len(conns) < n:
        c = listener.accept(min(left(), 120.0))
        if c is None:
            return (f"only {len(conns)} of the {n} processes started and connected to the "
                    "drill (did loading your cells fail in a process?)")
        try:
            hello = channel.recv(c, 10.0)
        except channel.ChannelError as e:
            c.close()
            return f"a process connected but did not say which it is: {e}"
        p = hello.get("hello") if isinstance(hello, dict) else None
        if type(p) is not int or not 0 <= p < n or p in conns:
            c.close()
            return f"a connection that is not one of the drill's processes said {hello!r}"
        conns[p] = c
    listener.close()  # nothing else connects
    setup = {"layout": plan["layout"], "primary": plan["primary"],
             "timeout_s": plan["timeout_s"], "names": plan["names"]}
    for c in conns.values():
        channel.send(c, setup)
    out["listings"].append(listing(ckpt) if os.path.isdir(ckpt) else [])
    for save in plan["saves"]:
        for p, c in conns.items():
            channel.send(c, _for_process(save, p))
        outcomes: dict[int, str] = {}
        calls: dict[int, dict[str, int]] = {}
        for p, c in sorted(conns.items()):
            try:
                rep = channel.recv(c, min(left(), 90.0))
            except channel.ChannelError as e:
                return f"process {p} did not report the end of the save of step_{save['step']}: {e}"
            if not isinstance(rep, dict) or rep.get("step") != save["step"]:
                return f"process {p} reported {str(rep)[:200]} for the save of step_{save['step']}"
            outcomes[p] = str(rep.get("outcome"))[:300]
            got = rep.get("calls")
            calls[p] = {str(k): v for k, v in got.items() if type(v) is int} \
                if isinstance(got, dict) else {}
        out["outcomes"].append(outcomes)
        out["calls"].append(calls)
        out["listings"].append(listing(ckpt) if os.path.isdir(ckpt) else [])
    for c in conns.values():
        channel.send(c, None)
    return None


def lab4_drill_message(r: Mapping[str, Any], plan: Mapping[str, Any]) -> str | None:
    """The verdict of :func:`run_lab4_drill`, read from the disk by this process (the full
    library): each step appeared exactly when its save returned, and only when it succeeded;
    every good save went through the student's ``two_barrier_commit`` on every process; the
    failed saves left nothing and raised everywhere; each good save is a committed step that
    verifies, every piece of every leaf written exactly once, restored here to the values
    drawn for it; then the command's exit code."""
    import os

    ckpt = r["ckpt"]

    def where(s: Mapping[str, Any]) -> str:
        if s["action"] == "raise":
            return (f"the save of step_{s['step']} (a {s.get('kind', 'OSError')} at {s['point']} "
                    f"on process {s['process']}, primary {plan['primary']})")
        slow = (f", process {s['process']} slow at {s['point']} ({s['action']} s)"
                if s["process"] < plan["processes"] and float(s["action"]) > 0 else "")
        return f"the save of step_{s['step']} (no failure{slow}, primary {plan['primary']})"

    said = r.get("said") or {}
    tails = said.get("tails") or []
    hint = f"; process 0 printed: {tails[0].strip()[-600:]}" if tails else (
        f"; {r['err'].strip()[-600:]}" if r.get("err") else "")
    if r.get("channel"):
        return f"{r['channel']}{hint}"
    if not os.path.isdir(ckpt):
        return f"the saves' processes made no checkpoint folder{hint}"
    if msg := _as_it_went(r, plan, where):
        return msg
    try:
        return _drill_disk(r, plan, where, hint)
    except Exception as e:  # what the workers left is not a checkpoint this library reads
        return f"the checkpoints on disk could not be read: {type(e).__name__}: {str(e)[:300]}"


def _as_it_went(r: Mapping[str, Any], plan: Mapping[str, Any],
                where: Callable[[Any], str]) -> str | None:
    """What the folder and the save path showed save by save: a step on disk before its save
    (written by something other than the save), a good save that did not publish its step
    when it returned or did not call ``two_barrier_commit`` once on every process, a save
    whose outcome on a process is not what the plan makes it."""
    listings, outcomes, calls = r["listings"], r["outcomes"], r["calls"]
    for k, s in enumerate(plan["saves"]):
        name = f"step_{s['step']}"
        if name in listings[k]:
            return (f"{where(s)}: {name} was on disk before its save began: something other "
                    "than the save wrote it")
        good = s["action"] != "raise"
        for p in sorted(outcomes[k]):
            got, n_calls = outcomes[k][p], calls[k][p].get("two_barrier_commit", 0)
            if good and got != "returned":
                return f"on process {p}, {where(s)} raised {got}"
            if not good and got == "returned":
                return (f"on process {p}, {where(s)} returned as if it had succeeded: a "
                        "failure anywhere must fail the save on every process")
            if not good and got.startswith("PeerTimeoutError"):
                return (f"on process {p}, {where(s)} ended in a time-out ({got[:160]}): any "
                        "failure, of any kind, must reach every process through the next "
                        "barrier, not leave the others waiting for a process that has gone")
            if good and n_calls != 1:
                return (f"on process {p}, {where(s)} called your two_barrier_commit {n_calls} "
                        "times: every save goes through it once on every process")
        if good and name not in listings[k + 1]:
            return (f"{where(s)}: when every process's save had returned, {name} was not "
                    f"published (the folder held {listings[k + 1]}): nobody may return before "
                    "the step is published")
    return None

def _drill_disk(r: Mapping[str, Any], plan: Mapping[str, Any], where: Callable[[Any], str],
                hint: str) -> str | None:
    import os

    from ..manager import CheckpointManager
    from ..options import CheckpointManagerOptions
    from .lab4 import coverage_message, listing

    ckpt, saves = r["ckpt"], plan["saves"]
    good = [s for s in saves if s["action"] != "raise"]
    said = r.get("said") or {}
    on_disk = listing(ckpt)
    boxes = drill_boxes(plan["layout"], plan["processes"])
    with CheckpointManager(ckpt, CheckpointManagerOptions(read_only=True)) as m:
        for s in saves:  # in the order of the plan: the first that went wrong is said
            name = f"step_{s['step']}"
            if s["action"] == "raise":
                if name in on_disk:
                    return (f"{where(s)}: {name} was published although the save failed "
                            "before its commit")
                tmp = [n for n in on_disk if n.startswith(name + ".")]
                if tmp:
                    return f"{where(s)}: the failed save left its temporary directory {tmp[0]}"
                continue
            if name not in on_disk:
                return f"{where(s)}: {name} was not committed (the folder holds {on_disk}){hint}"
            report = m.verify(s["step"])
            if not report.ok:
                said_ = "; ".join(str(x).replace(ckpt + os.sep, "") for x in report.problems[:2])
                return f"{where(s)}: {name} does not verify: {said_}"
            msg = coverage_message(os.path.join(ckpt, name), "params", boxes)
            if msg is not None:
                return f"{where(s)}: {msg}"
            got = m.restore(s["step"])["params"]
            for leaf, (shape, spec, dtype) in plan["layout"].items():
                want_v = drill_values(s["seed"], leaf, shape, dtype)
                have = np.asarray(got[leaf]) if leaf in got else None
                if have is None or have.shape != want_v.shape or have.dtype != want_v.dtype \
                        or not np.array_equal(have, want_v):
                    return (f"{where(s)}: leaf {leaf} ({dtype} {shape} on P{tuple(spec)}) "
                            "restored here does not hold the values it was saved with")
    want = sorted(f"step_{s['step']}" for s in good)
    if sorted(on_disk) != want:
        return f"after the drill's saves the folder should hold {want} alone; it holds {on_disk}"
    if r.get("rc") != 0:
        return (f"the disk is right, but the saves' processes did not all end normally (exit "
                f"codes {said.get('rc')}){hint}")
    return None


