"""Lab 4's tasks and the helpers its tests use (minickpt.labkit.lab4).

The tasks' reference functions are tested in tests/test_multihost.py too; here: their edge
cases as the lab states them, that each typical mistake of the examples is caught by the
checks the lab uses (with the box or the call named), and that ``run_processes`` really runs
a student's cell in a ``jax.distributed`` job.
"""

from __future__ import annotations

import itertools
import linecache
import re

import jax
import nbformat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import minickpt as mc
from minickpt import labkit as lab
from minickpt.errors import MultiHostError, PeerTimeoutError, ProcessDisagreementError
from minickpt.format.regions import region_from_pieces
from minickpt.format.shards import box_shape, box_slices
from minickpt.multihost.ownership import owned_shards
from minickpt.multihost.save import two_barrier_commit
from minickpt.multihost.sync import LocalGroup, agree_on_step

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
LAB = ROOT / "solutions" / "lab04_multihost" / "lab04_multihost.ipynb"


def test_the_processes_import_what_the_setup_cell_imports():
    """A student's cell runs in the launched processes after LAB4_IMPORTS: it must give the
    names the lab's setup cell gives (the tasks' code uses only those)."""
    setup = next(c.source for c in nbformat.read(LAB, 4).cells
                 if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")

    def names(src: str) -> set[str]:
        out = set()
        for line in src.splitlines():
            m = re.match(r"^(?:from \S+ )?import (.+?)(?:\s+#.*)?$", line.strip())
            if m:
                for part in m.group(1).split(","):
                    out.add(part.split(" as ")[-1].strip())
        return out

    assert names(lab.LAB4_IMPORTS) == names(setup)


# ---------------------------------------------------------------------------------------
# 4.1
# ---------------------------------------------------------------------------------------
@pytest.mark.task("4.1")
@pytest.mark.parametrize("bad", [[5, 5.0], [True, True], [4, "4"], [2, None], [3, -1], [],
                                 [np.int64(3), 3], [4, 5, "6"]])
def test_4_1_a_step_is_an_int_at_least_zero(bad):
    """A numpy integer is no step either (the manager's save refuses one too), and a
    malformed entry is a plain ValueError even when the valid steps also disagree."""
    with pytest.raises(ValueError) as e:
        agree_on_step(bad)
    assert not isinstance(e.value, ProcessDisagreementError)


@pytest.mark.task("4.1")
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=40))
def test_4_1_the_verdict_depends_on_the_steps_alone(steps):
    if len(set(steps)) == 1:
        assert agree_on_step(steps) == steps[0] and type(agree_on_step(steps)) is int
    else:
        with pytest.raises(ProcessDisagreementError) as e:
            agree_on_step(steps)
        odd = next(p for p, s in enumerate(steps) if s != steps[0])
        assert f"{steps[odd]}" in str(e.value)


# ---------------------------------------------------------------------------------------
# 4.2
# ---------------------------------------------------------------------------------------
SPECS = [("p", "l"), ("p", None), (None, "p"), ("l", None), (None, None), (("l", "p"), None),
         (("p", "l"),), ("l", "p")]


@pytest.mark.task("4.2")
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]])
@pytest.mark.parametrize("spec", SPECS)
def test_4_2_the_fake_sharding_map_is_jaxs(spec, order):
    """The lab's pure tests use fake devices; their map must be the one JAX computes."""
    devs = jax.devices()[:4]
    ids = np.array(order).reshape(2, 2)
    m = Mesh(np.array([[devs[i] for i in row] for row in ids]), ("p", "l"))
    real = NamedSharding(m, P(*spec)).devices_indices_map((8, 4))
    fake = lab.fake_devices_indices_map((8, 4), ids, ("p", "l"), spec, {i: i // 2 for i in range(4)})
    assert [(d.id, tuple(s.indices(n) for s, n in zip(ix, (8, 4), strict=True)))
            for d, ix in real.items()] == \
        [(d.id, tuple(s.indices(n) for s, n in zip(ix, (8, 4), strict=True)))
         for d, ix in fake.items()]


def _every_replica(shape, imap, process_index, *, process_of=lambda d: d.process_index):
    from minickpt.format.shards import box_of

    return [(box_of(ix, shape), d) for d, ix in imap.items() if process_of(d) == process_index]


@pytest.mark.task("4.2")
@pytest.mark.parametrize("spec", SPECS)
def test_4_2_the_reference_passes_and_every_replica_writes_is_caught_naming_the_box(spec):
    ids = np.arange(8).reshape(4, 2)
    own = {i: i // 2 for i in range(8)}
    imap = lab.fake_devices_indices_map((8, 4), ids, ("p", "l"), spec, own)
    of = lambda d: own[d.id]  # noqa: E731
    ok = {p: owned_shards((8, 4), imap, p, process_of=of) for p in range(4)}
    assert lab.ownership_message((8, 4), imap, ok, of) is None
    bad = {p: _every_replica((8, 4), imap, p, process_of=of) for p in range(4)}
    msg = lab.ownership_message((8, 4), imap, bad, of)
    replicated = len({tuple(map(tuple, (s.indices(8) for s in ix))) for ix in imap.values()}) < 8
    assert (msg is not None) == replicated
    if msg:
        assert re.search(r"box \(\(\d+, \d+\), \(\d+, \d+\)\) is written \d times", msg)


@pytest.mark.task("4.2")
def test_4_2_coverage_names_a_duplicated_and_a_missing_box(tmp_path):
    """coverage_message reads the shard manifests as they are on disk."""
    item = tmp_path / "step_1" / "params"
    item.mkdir(parents=True)
    shards = {0: [[[0, 4], [0, 4]]], 1: [[[0, 4], [0, 4]]]}
    for p, boxes in shards.items():
        (item / f"manifest.p{p}.json").write_text(__import__("json").dumps(
            {"shards": [{"path": ["w"], "index": b} for b in boxes]}))
    expected = {"w": [[[0, 4], [0, 4]], [[4, 8], [0, 4]]]}
    msg = lab.coverage_message(str(tmp_path / "step_1"), "params", expected)
    assert "box [[0, 4], [0, 4]] was written 2 times, by processes [0, 1]" in msg
    (item / "manifest.p1.json").unlink()
    msg = lab.coverage_message(str(tmp_path / "step_1"), "params", expected)
    assert "box [[4, 8], [0, 4]] was written by no process" in msg


# ---------------------------------------------------------------------------------------
# 4.3
# ---------------------------------------------------------------------------------------
@pytest.mark.task("4.3")
@pytest.mark.parametrize("primary,fail", [(True, None), (False, None), (True, "create"),
                                          (True, "write"), (False, "write"), (True, "commit")])
def test_4_3_the_reference_makes_the_protocols_calls(primary, fail):
    assert lab.protocol_message(two_barrier_commit, primary, fail) is None


def _commit_before_barrier(save):
    if save.primary:
        save.create()
    save.barrier("created")
    files = save.write()
    info = save.commit([files]) if save.primary else {}
    save.barrier("written", None, files)
    save.barrier("committed", None, info)


def _raises_at_once(save):
    if save.primary:
        save.create()
    save.barrier("created")
    written = save.barrier("written", None, save.write())
    save.barrier("committed", None, save.commit(written) if save.primary else {})


@pytest.mark.task("4.3")
def test_4_3_the_typical_mistakes_are_named():
    msg = lab.protocol_message(_commit_before_barrier, True)
    assert "call 4 should be save.barrier('written')" in msg and "commit(" in msg
    msg = lab.protocol_message(_raises_at_once, False, "write")
    assert "must still go to the next barrier" in msg


@pytest.mark.task("4.3")
def test_4_3_commit_before_the_barrier_publishes_an_incomplete_step(tmp_path):
    """The mistake for real, with threads playing 4 processes: the slow process's shards are
    missing from a published step, and a restore refuses it naming the region."""
    group = LocalGroup(4)
    m = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("p", "l"))
    w = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(m, P("p")))
    opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=10))

    def work(sync):
        if sync.process_index == 3:
            sync.faults["before_write"] = lambda: __import__("time").sleep(0.5)
        with mc.CheckpointManager(tmp_path, opts, sync=sync) as mngr:
            mngr.save(1, {"params": {"w": w}})

    with lab.plugged_in(_as(_commit_before_barrier, "two_barrier_commit")):
        results = group.run(work, timeout_s=60)
    assert all(isinstance(r, MultiHostError) or isinstance(r, OSError) for r in results), results
    with pytest.raises(mc.CheckpointCorruptedError, match="not covered by any shard"):
        mc.Checkpointer().restore(tmp_path / "step_1")


@pytest.mark.task("4.3")
def test_4_3_raising_at_once_leaves_the_others_to_time_out(tmp_path):
    group = LocalGroup(2)
    m = Mesh(np.array(jax.devices()[:2]), ("p",))
    w = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(m, P("p")))
    opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=2))

    def broken():
        raise OSError(5, "Input/output error")

    def work(sync):
        if sync.process_index == 1:
            sync.faults["after_write"] = broken
        with mc.CheckpointManager(tmp_path, opts, sync=sync) as mngr:
            mngr.save(1, {"params": {"w": w}})

    with lab.plugged_in(_as(_raises_at_once, "two_barrier_commit")):
        results = group.run(work, timeout_s=60)
    assert isinstance(results[0], PeerTimeoutError) and isinstance(results[1], OSError)
    assert lab.listing(str(tmp_path)) == []


# ---------------------------------------------------------------------------------------
# 4.4
# ---------------------------------------------------------------------------------------
@st.composite
def grid_and_region(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    cuts = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        cuts.append([0, *inner, n])
    region = []
    for n in shape:
        a = draw(st.integers(0, n))
        region.append((a, draw(st.integers(a, n))))
    return shape, cuts, tuple(region)


@pytest.mark.task("4.4")
@settings(max_examples=60, deadline=None)
@given(grid_and_region())
def test_4_4_any_region_from_any_grid_of_pieces(case):
    shape, cuts, region = case
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    asked = []

    def piece(b):
        def read(part):
            asked.append((b, part))
            assert all(b0 <= p0 < p1 <= b1 for (p0, p1), (b0, b1) in zip(part, b, strict=True))
            return full[box_slices(part)].copy()
        return b, read

    boxes = [tuple(itertools.pairwise(c)) for c in cuts]
    pieces = [piece(tuple(b)) for b in itertools.product(*boxes)]
    out = region_from_pieces(region, full.dtype, pieces)
    assert out.shape == box_shape(region) and out.dtype == full.dtype
    assert np.array_equal(out, full[box_slices(region)])
    assert len(asked) == len({b for b, _ in asked})  # each piece asked at most once


def _assumes_saving_mesh(box, dtype, pieces):
    for piece_box, read in pieces:
        if piece_box == box:
            return read(box)
    raise KeyError(f"no saved piece {box}")


@pytest.mark.task("4.4")
def test_4_4_a_restore_that_assumes_the_saving_mesh_fails_on_another(tmp_path):
    group = LocalGroup(2)
    m = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("p", "l"))
    w = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(m, P("p", "l")))
    opts = mc.CheckpointManagerOptions(multihost=mc.MultiHostOptions(timeout_s=10))

    def work(sync):
        with mc.CheckpointManager(tmp_path, opts, sync=sync) as mngr:
            mngr.save(1, {"params": {"w": w}})

    assert group.run(work) == [None, None]
    other = Mesh(np.array(jax.devices()[:4]), ("x",))
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32,
                                                   sharding=NamedSharding(other, P(None, "x")))}}
    with lab.plugged_in(_as(region_from_pieces, "region_from_pieces")):  # a copy: plugged in
        got = mc.CheckpointManager(tmp_path).restore(1, target=target)["params"]["w"]
    assert np.array_equal(np.asarray(got), np.arange(32, dtype=np.float32).reshape(8, 4))
    with lab.plugged_in(_as(_assumes_saving_mesh, "region_from_pieces")), pytest.raises(Exception, match="no saved piece"):
        mc.CheckpointManager(tmp_path).restore(1, target=target)


def _as(fn, name):
    """A copy of ``fn`` called ``name``: what a student's function of that name would be."""
    import types

    out = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


# ---------------------------------------------------------------------------------------
# run_processes: a student's cell, in a real jax.distributed job
# ---------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_run_processes_ships_the_whole_cell_and_reports_per_process():
    """A function defined in a notebook cell (IPython keeps the cell's text in linecache,
    under a file name that does not exist) travels with the cell's helpers; the body's
    exception is reported, not fatal."""
    cell = ("def _helper(steps):\n    return steps[0]\n\n\n"
            "def agree_on_step(steps):\n    return _helper(steps) + 1000\n")
    name = "/tmp/ipykernel_0/lab4-cell.py"
    linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
    ns: dict = {}
    exec(compile(cell, name, "exec"), ns)
    body = """
        report(me=ME, n=N, devices=len(jax.local_devices()), plan=PLAN,
               step=mc.multihost.sync.agree_on_step([3, 4]))
        if ME == 1:
            raise RuntimeError("a failing body is reported")
    """  # indented, as inside a test cell's `if`
    run = lab.run_processes(body, processes=2, devices=2, functions=[ns["agree_on_step"]],
                            values={"PLAN": [(1, "before_write", 0, "raise")]})
    run.check_reported()
    assert [r["me"] for r in run.results] == [0, 1]
    assert all(r["plan"] == [[1, "before_write", 0, "raise"]] for r in run.results)
    assert all(r["n"] == 2 and r["devices"] == 2 and r["step"] == 1003 for r in run.results)
    assert run.errors[0] is None and run.raised(1, "RuntimeError")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_job_launched_again_after_a_lost_port_race_still_reports(tmp_path):
    """The coordinator can lose the race for its port; the launcher then starts the job again.
    The report key was written once, for the first processes: the second ones read an empty
    pipe and signed with no key, so every report was "a RESULT line the harness did not
    write" (lab 4's corpus under load: process 0 never reported, exit code 0)."""
    from minickpt.launch import _BIND_FAILED

    body = f"""
        import os
        first = os.path.join(directory, "first-attempt")
        if ME == 0 and not os.path.exists(first):
            open(first, "w").close()
            print({_BIND_FAILED!r}, flush=True)   # as the coordinator says when it lost
        report(me=ME)
    """
    run = lab.run_processes(body, processes=2, devices=1, directory=str(tmp_path))
    run.check_reported()
    assert [r["me"] for r in run.results] == [0, 1]


def test_a_body_that_does_not_compile_fails_once_in_the_cell():
    """Values glued in front of an indented body used to reach 4 processes as an
    IndentationError each, reported as the student's failed save (lab 4's 4.3 tests)."""
    body = "PLAN = []\n" + """
        report(plan=PLAN)
    """
    with pytest.raises(IndentationError):
        lab.run_processes(body, processes=2, devices=2)
