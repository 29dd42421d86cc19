"""Lab 4 (multi-host): several real JAX processes on localhost, shards and the commit protocol."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .checks import LabCheckError
from .plugging import graded_build, own_task_functions, reference, task_sources
from .processes import student_worker
from .temporaries import tempdir
from .watch import Reports

# What every process launched by run_processes imports before the student's code: the names
# of lab 4's setup cell (tests/test_lab04_multihost.py checks that the two agree).
LAB4_IMPORTS = """\
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import minickpt as mc
from minickpt import labkit as lab
from minickpt.labkit import check, expect_raises, grader_drill, plugged_in, same
from minickpt.errors import MultiHostError, PeerTimeoutError, ProcessDisagreementError
from minickpt.format.shards import Box, box_of, box_shape, box_slices
from minickpt.format.buffers import aligned_empty
from minickpt.multihost.save import CollectiveSave
from minickpt.multihost.sync import default_sync
"""

_PIN_CPUS = '''\
_me = int(os.environ.get("MINICKPT_PROCESS_ID", "0"))
try:  # at most 2 CPUs each, so that JAX's thread pools stay small on a many-core machine
    _cpus = sorted(os.sched_getaffinity(0))
    if len(_cpus) > 2:
        _start = (2 * _me) % len(_cpus)
        os.sched_setaffinity(0, (_cpus[_start:] + _cpus)[:2])
except (AttributeError, OSError):
    pass
'''
"""A worker's first lines: at most 2 CPUs each, so that JAX's thread pools stay small on a
many-core machine (``_me``: its process id)."""

_WORKER = '''\
import json, os, sys


''' + _PIN_CPUS + '''from minickpt.launch import signer as _signer
_send, _ = _signer({key_env!r})  # before any code of the student's: see minickpt.launch.signer
del _signer
import minickpt.multihost.process as _mhp
import minickpt.multihost.sync as _mhs
_mhp.initialize()
{imports}
from minickpt.labkit import watch as _watch
_w = _watch.worker()
ME, N = jax.process_index(), jax.process_count()
directory = sys.argv[1]
_results = {{}}


def report(**values):
    """Send values (JSON) back to the test cell, which reads them per process."""
    _results.update(values)


_error = None
try:  # the student's cell in a namespace of its own; the test's: theirs, the harness's on top
    _harness = {{_k: _v for _k, _v in globals().items() if _k != "_send"}}
    _mine = _w.namespace(_harness)
    exec(compile({source!r}, "<your task cell>", "exec"), _mine)
    _test = _w.test_namespace(_mine, _harness, {names!r})
    with _harness["plugged_in"](*[_test[_n] for _n in {names!r}]):
        exec(compile({body!r}, "<the test>", "exec"), _test)
except BaseException as _e:
    _error = {{"type": type(_e).__name__, "message": str(_e),
              "kinds": [_c.__name__ for _c in type(_e).__mro__]}}
_send({{"results": _results, "error": _error}})  # one write: no log line splits it
try:  # process 0 hosts the coordination service: nobody leaves before everybody is done
    # a body whose job loses a process on purpose sets DONE_WAIT: then nobody waits long for it
    _mhs.default_sync().exchange("lab4-done", None, float(globals().get("DONE_WAIT", 20.0)),
                                 "the end of the test")
    if ME == 0:
        time.sleep(0.5)  # while the others read the barrier's values
except Exception:
    pass
_mhp.hard_exit(0)  # no jax.distributed.shutdown(): a failed peer would make it wait
'''


class ProcessesRun:
    """What the processes of one :func:`run_processes` job reported."""

    def __init__(self, n: int, launched: Any, key: bytes):
        self.n = n
        self.launched = launched
        self.results: list[dict[str, Any]] = [{} for _ in range(n)]
        self.errors: list[dict[str, Any] | None] = [None] * n
        self.reported = [False] * n
        found, self.forged = launched.signed_reports(key)
        for p, values in enumerate(found):
            for got in values[-1:]:  # the harness reports once, at the end
                self.results[p], self.errors[p] = got["results"], got["error"]
                self.reported[p] = True

    def output_tail(self, process: int, lines: int = 8) -> str:
        out = [x for x in self.launched.outputs[process] if "RESULT " not in x]
        return "".join(out[-lines:]).strip()

    def check_reported(self) -> None:
        """Every process ran to its end (a process that died or hung is named)."""
        for p in range(self.n):
            if not self.reported[p]:
                rc = self.launched.returncodes[p]
                why = ("it was still running at the time limit" if self.launched.timed_out
                       else f"it exited with code {rc}")
                forged = (f"; it printed {self.forged[p]} RESULT line(s) the harness did not "
                          "write, which count for nothing" if self.forged[p] else "")
                raise LabCheckError(f"process {p} of {self.n} never reported ({why}{forged}); "
                                    f"its last output:\n{self.output_tail(p)}")

    def error_of(self, p: int) -> str | None:
        e = self.errors[p]
        return None if e is None else f"{e['type']}: {e['message']}"

    def raised(self, p: int, kind: str) -> bool:
        e = self.errors[p]
        return e is not None and kind in e["kinds"]

    def check_no_errors(self, what: str) -> None:
        self.check_reported()
        bad = [p for p in range(self.n) if self.errors[p] is not None]
        if bad:
            raise LabCheckError(f"{what} failed on process{'es' if len(bad) > 1 else ''} "
                                f"{', '.join(map(str, bad))}: {self.error_of(bad[0])}")


def can_start_processes(what: str) -> bool:
    """True when this machine can run a test's processes (a ``jax.distributed`` job joins
    them over TCP on 127.0.0.1). Where it refuses every TCP socket (a TPU VM's container),
    one line says that ``what`` is skipped, and False: the cell ends there, without an error
    in every test. Under the grader a test that cannot run earns nothing: it raises."""
    from ..launch import loopback_refused

    refused = loopback_refused()
    if refused is None:
        return True
    if __name__.startswith("minickpt._referee_"):  # the grader's private copy of the kit
        raise LabCheckError(f"{what} cannot run: {refused}")
    print(f"skipped {what}: no TCP on 127.0.0.1 here, so its processes cannot start "
          "(run this lab on Colab or a laptop to pass it)")
    return False


def describe_processes(devices: int = 2) -> str:
    """One line for the setup cell: where the tests' processes run, or why they cannot."""
    from ..launch import loopback_refused

    refused = loopback_refused()
    if refused is not None:
        return f"the multi-process tests will be skipped here: {refused}"
    return (f"the tests' processes run on CPU devices (JAX_PLATFORMS=cpu, {devices} each), "
            f"beside this notebook's {jax.devices()[0].platform.upper()}")


def run_processes(body: str, *, processes: int = 4, devices: int = 2,
                  functions: Sequence[Callable[..., Any]] = (), directory: str | None = None,
                  timeout_s: float = 50.0, values: Mapping[str, Any] | None = None
                  ) -> ProcessesRun:
    """Run ``body`` in ``processes`` JAX processes of one ``jax.distributed`` job on this
    machine (``devices`` CPU devices each), with ``functions`` — yours — plugged into
    minickpt in every process.

    ``body`` sees lab 4's setup names, ``ME`` and ``N`` (this process, how many),
    ``directory`` (one folder shared by the job) and ``report(**values)``, which sends JSON
    values back; ``values`` (name -> a value whose repr reads back, like a plan of tuples)
    are set before it runs. A body that kills a process of the job on purpose sets
    ``DONE_WAIT`` (s) to a few seconds: at the end every process waits that long for the
    others (20 s otherwise). An exception in ``body`` is caught and reported, never fatal;
    every process is killed when the job ends or after ``timeout_s``. A body that does not
    compile fails here, once, not in every process.
    """
    import os
    import textwrap

    from ..launch import key_pipe, launch, lost_port_race

    body = textwrap.dedent(body)  # a body written inside an `if` of the test cell
    body = "".join(f"{k} = {v!r}\n" for k, v in (values or {}).items()) + body
    compile(body, "<the test>", "exec")  # a SyntaxError names its line here, in the cell
    names = [getattr(fn, "__name__", "") for fn in functions]
    for fn in functions:
        reference(fn.__name__)  # a name no task has fails here, not in every process
    judged = student_worker()
    if judged is not None:  # under the grader's judge: trusted processes, the student's code in
        from .lab4_judged import run_judged  # workers of their own (see that module)

        res, key = run_judged(judged, body, names, processes=processes, devices=devices,
                              directory=directory, timeout_s=timeout_s, pin=_PIN_CPUS,
                              imports=LAB4_IMPORTS, key_env=KEY_ENV)
        return ProcessesRun(processes, res, key)
    mine = list(functions)
    if graded_build():  # minickpt calls the student's other lab 4 tasks there, also in a test of its own code
        mine += own_task_functions("4")
    source = task_sources(mine)
    key = secrets.token_bytes(32)  # signs the harness's reports (see _WORKER's _signer)
    with tempdir() as work, Reports(functions) as reports:
        script = os.path.join(work, "lab4_process.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(_WORKER.format(imports=LAB4_IMPORTS, source=source, names=names,
                                   body=body, key_env=KEY_ENV))
        shared = directory or os.path.join(work, "shared")
        os.makedirs(shared, exist_ok=True)
        for attempt in range(3):  # a key per launch: a job started again drains its own
            with key_pipe(key, processes) as r:
                env = {**reports.env({"JAX_PLATFORMS": "cpu"}), KEY_ENV: str(r)}
                res = launch([script, shared], processes, devices_per_process=devices,
                             timeout_s=timeout_s, grace_s=timeout_s, cwd=work, env=env,
                             pass_fds=(*reports.pass_fds, r), port_retries=0)
            if attempt == 2 or not lost_port_race(res):
                break
    return ProcessesRun(processes, res, key)


KEY_ENV = "MINICKPT_LAB4_REPORT_KEY_FD"
"""The descriptor a worker reads its report key from (then closes, before the student's cell).
The key is the only thing that tells the harness's RESULT line from one the student's code
prints (or writes to a descriptor, then ``os._exit``): the parent takes signed lines only.
Code that reads the harness's own memory could sign too, but it could as well change what
the test body reports; the classes closed are the printed or written line."""


def global_array(name: str, shape: Sequence[int], sharding: Any,
                 dtype: Any = np.float32) -> jax.Array:
    """An array spread over ``sharding`` (possibly over several processes) whose values every
    process, and the test, can compute alone: :func:`lab4_values`."""
    g = lab4_values(name, shape, dtype)
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: g[idx])


def lab4_values(name: str, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """The values of the lab's array ``name``: a function of its name and shape alone."""
    n = int(np.prod(shape))
    base = sum(map(ord, name)) % 17
    return ((np.arange(n) * 3 + base) % 251).reshape(tuple(shape)).astype(dtype)


def process_mesh(shape: Sequence[int], axes: Sequence[str]) -> jax.sharding.Mesh:
    """A mesh over every device of the job, process by process (process 0's devices first)."""
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devs).reshape(tuple(shape)), tuple(axes))


def distinct_boxes(shape: Sequence[int], sharding: Any) -> list[list[list[int]]]:
    """The pieces of an array on ``sharding``, each once (JSON: ``[[start, stop], ...]``)."""
    from ..format.shards import box_of

    out: list[list[list[int]]] = []
    for index in sharding.devices_indices_map(tuple(shape)).values():
        box = [list(b) for b in box_of(index, tuple(shape))]
        if box not in out:
            out.append(box)
    return out


def shard_boxes(step_dir: str, item: str) -> dict[str, dict[tuple[tuple[int, int], ...],
                                                          list[int]]]:
    """Leaf path -> box -> the processes that wrote it, read from the item's per-process
    shard manifests (``manifest.p<i>.json``) as they are on disk."""
    import json
    import os

    out: dict[str, dict[tuple[tuple[int, int], ...], list[int]]] = {}
    item_dir = os.path.join(step_dir, item)
    for name in sorted(os.listdir(item_dir)):
        m = re.fullmatch(r"manifest\.p(\d+)\.json", name)
        if not m:
            continue
        with open(os.path.join(item_dir, name), encoding="utf-8") as f:
            doc = json.load(f)
        for s in doc.get("shards", []):
            box = tuple((int(a), int(b)) for a, b in s["index"])
            out.setdefault("/".join(s["path"]), {}).setdefault(box, []).append(int(m.group(1)))
    return out


def coverage_message(step_dir: str, item: str,
                     expected: Mapping[str, Sequence[Sequence[Sequence[int]]]]) -> str | None:
    """None if every expected box of every leaf was written by exactly one process, else what
    is wrong, naming the leaf, the box and the processes."""
    got = shard_boxes(step_dir, item)
    for leaf, boxes in expected.items():
        have = got.get(leaf, {})
        for b in boxes:
            box = tuple((int(x), int(y)) for x, y in b)
            who = have.get(box, [])
            if not who:
                return (f"leaf {leaf}: box {[list(x) for x in box]} was written by no process "
                        "(every piece must have an owner)")
            if len(who) > 1:
                return (f"leaf {leaf}: box {[list(x) for x in box]} was written "
                        f"{len(who)} times, by processes {sorted(who)} (one replica each: "
                        "only the process of its first device writes it)")
        extra = [b for b in have if [list(x) for x in b] not in [list(map(list, e))
                                                                 for e in boxes]]
        if extra:
            return f"leaf {leaf}: box {[list(x) for x in extra[0]]} is not a piece of its sharding"
    return None


def listing(path: str) -> list[str]:
    """The names in a directory, sorted, without hidden ones (such as the manager's lock)."""
    import os

    return sorted(n for n in os.listdir(path) if not n.startswith("."))


class FakeDevice(NamedTuple):
    """A stand-in for a ``jax.Device`` in pure tests: an id and the process it belongs to."""

    id: int
    process_index: int


def fake_devices_indices_map(shape: Sequence[int], mesh_ids: Any, axes: Sequence[str],
                             spec: Sequence[Any], owner: Mapping[int, int]
                             ) -> dict[FakeDevice, tuple[slice, ...]]:
    """What ``NamedSharding(Mesh(devices, axes), P(*spec)).devices_indices_map(shape)`` gives
    for a mesh of fake devices (``mesh_ids``: their ids, laid out as the mesh), in the
    sharding's device order; ``owner`` maps a device id to its process."""
    ids = np.asarray(mesh_ids)
    sizes = dict(zip(axes, ids.shape, strict=True))
    out: dict[FakeDevice, tuple[slice, ...]] = {}
    for coord in np.ndindex(*ids.shape):
        at = dict(zip(axes, coord, strict=True))
        index = []
        for k, n in enumerate(shape):
            entry = spec[k] if k < len(spec) else None
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if not names:
                index.append(slice(None))
                continue
            pieces = int(np.prod([sizes[a] for a in names]))
            i = int(np.ravel_multi_index([at[a] for a in names], [sizes[a] for a in names]))
            size = n // pieces
            index.append(slice(i * size, (i + 1) * size))
        dev_id = int(ids[coord])
        out[FakeDevice(dev_id, owner[dev_id])] = tuple(index)
    return out


def ownership_message(shape: Sequence[int], devices_indices_map: Mapping[Any, Sequence[slice]],
                      got: Mapping[int, Any], process_of: Callable[[Any], int]) -> str | None:
    """None if ``got`` (process -> what ``owned_shards`` returned for it) gives every piece of
    the array to exactly one process — the one of its first device in the sharding's order,
    with that device — else what is wrong, naming the box."""
    from ..format.shards import box_of

    first: dict[Any, Any] = {}
    for device, index in devices_indices_map.items():
        first.setdefault(box_of(index, tuple(shape)), device)
    writers: dict[Any, list[tuple[int, Any]]] = {}
    for p, pairs in got.items():
        if type(pairs) is not list:
            return f"process {p}: owned_shards should return a list, got {type(pairs).__name__}"
        for pair in pairs:
            if type(pair) is not tuple or len(pair) != 2:
                return (f"process {p}: each item should be a (box, device) tuple, got "
                        f"{pair!r}")
            box, device = pair
            if type(box) is not tuple or not all(
                    type(b) is tuple and len(b) == 2 and all(type(x) is int for x in b)
                    for b in box):
                return (f"process {p}: a box should be a tuple of (start, stop) int pairs such "
                        f"as ((0, 4), (0, 8)); got {box!r} (box_of(index, shape) makes one)")
            if box not in first:
                return f"process {p}: box {box} is not a piece of this sharding"
            writers.setdefault(box, []).append((p, device))
    for box, device in first.items():
        who = writers.get(box, [])
        want = process_of(device)
        if not who:
            return (f"box {box} is written by no process: process {want} should own it (its "
                    f"first holder, device {device.id}, is on process {want})")
        if len(who) > 1:
            return (f"box {box} is written {len(who)} times (by processes "
                    f"{[q for q, _ in who]}, devices {[d.id for _, d in who]}): one replica only, "
                    f"that of its first holder, device {device.id} on process {want}")
        (q, dev), = who
        if q != want:
            return (f"box {box} is written by process {q}, but its first holder, device "
                    f"{device.id}, is on process {want} (as process_of says)")
        if dev != device:
            return (f"box {box}: process {q} says device {dev.id} writes it, but the first "
                    f"device holding it in the sharding's order is device {device.id}")
    return None


class RecordingSave:
    """A stand-in for a ``CollectiveSave`` that records what a ``two_barrier_commit`` calls,
    in order, to test the protocol alone: no processes, no files. ``fail`` names the step
    (``"create"``, ``"write"``, ``"commit"``) that raises ``OSError`` here; a barrier given an
    error raises, as the real one does on every process."""

    def __init__(self, primary: bool, *, processes: int = 4, fail: str | None = None):
        self.primary, self.processes, self.fail = primary, processes, fail
        self.calls: list[tuple[Any, ...]] = []
        self.files = {"params": {"process": "this one", "data_file": "data.p1.bin"}}

    def _step(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if self.fail == name:
            raise OSError(5, f"Input/output error (injected in {name})")

    def create(self) -> None:
        self._step("create")

    def write(self) -> dict[str, Any]:
        self._step("write")
        return self.files

    def commit(self, files: Any) -> dict[str, Any]:
        self._step("commit", "every process's files" if files == [self.files] * self.processes
                   else f"files={files!r}")
        return {"committed": True}

    def barrier(self, phase: str, error: BaseException | None = None,
                value: Any = None) -> list[Any] | None:
        self.calls.append(("barrier", phase, None if error is None else type(error).__name__))
        if error is not None:
            from ..errors import MultiHostError

            raise MultiHostError(f"the save failed at barrier {phase!r}: {error}")
        return None if phase == "committed" else [value] * self.processes


def _expected_calls(primary: bool, fail: str | None) -> list[tuple[Any, ...]]:
    seq: list[tuple[Any, ...]] = []
    for phase, mine, who in (("created", "create", primary), ("written", "write", True),
                             ("committed", "commit", primary)):
        failed = None
        if who:
            seq.append(("commit", "every process's files") if mine == "commit" else (mine,))
            failed = "OSError" if fail == mine else None
        seq.append(("barrier", phase, failed))
        if failed:
            break
    return seq


def _said(call: tuple[Any, ...]) -> str:
    if call[0] == "barrier":
        return f"barrier({call[1]!r}" + (f", <{call[2]}>)" if call[2] else ")")
    if call[0] == "commit":
        return f"commit({call[1]})"
    return f"{call[0]}()"


def protocol_message(fn: Callable[[Any], Any], primary: bool,
                     fail: str | None = None) -> str | None:
    """None if ``fn`` (a ``two_barrier_commit``) makes the calls the protocol prescribes, in
    order, on a primary or another process, when step ``fail`` fails there (or none); else
    what it did instead."""
    save = RecordingSave(primary, fail=fail)
    raised: BaseException | None = None
    try:
        fn(save)
    except Exception as e:
        raised = e
    if isinstance(raised, NotImplementedError):  # the task is still to do: say which
        return f"{type(raised).__name__}: {raised}"
    want = _expected_calls(primary, fail)
    who = "the primary" if primary else "a process that is not the primary"
    when = f" when its {fail}() fails" if fail else ""
    got = save.calls
    for i, w in enumerate(want):
        if i >= len(got):
            hint = ""
            if raised is not None and fail and w[0] == "barrier":
                hint = (f" — it raised {type(raised).__name__} at once: a process whose step "
                        "fails must still go to the next barrier, with the error, so that the "
                        "others learn it instead of waiting for the time-out")
            elif raised is not None:
                hint = f" — it raised {type(raised).__name__}: {raised}"
            return (f"on {who}{when}, call {i + 1} should be save.{_said(w)}, but "
                    f"two_barrier_commit stopped after {[_said(c) for c in got]}{hint}")
        if got[i] != w:
            return (f"on {who}{when}, call {i + 1} should be save.{_said(w)}, got "
                    f"save.{_said(got[i])} (the calls so far: {[_said(c) for c in got[:i + 1]]})")
    if len(got) > len(want):
        return (f"on {who}{when}, the protocol ends with save.{_said(want[-1])}, but "
                f"two_barrier_commit went on with save.{_said(got[len(want)])}")
    if fail and raised is None:
        return f"on {who}{when}, two_barrier_commit returned: the save's failure must be raised"
    if not fail and raised is not None:
        return f"on {who}, two_barrier_commit raised {type(raised).__name__}: {raised}"
    return None
