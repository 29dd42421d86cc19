"""Lab 4 under the judge (issue 47): each JAX process of a test's job is a trusted one (the
body, the report key, the reports), and the student's task functions are proxies to a worker
of its own, started in the sandbox as the judge says, holding the student's cells' definitions
and nothing of a test."""

from __future__ import annotations

import json
import os

import pytest

from autograder import ROOT, drills
from autograder.judge import cells as cells_mod
from autograder.judge import session
from autograder.notebook import load_lab

pytestmark = pytest.mark.timeout(1800)

LAB = "lab04_multihost"

RECORDER = r'''
import json, os, sys
from multiprocessing import connection
log, fd = sys.argv[2], sys.argv[1]
real, init = connection.Connection.recv_bytes, connection.Connection.__init__


def recv_bytes(self, maxlength=None):
    b = real(self, maxlength)
    with open(f"{log}.{os.getpid()}.bytes", "ab") as f:
        f.write(b + b"\n")
    return b


def record(conn_fd):
    fds = {x: os.readlink(f"/proc/self/fd/{x}") for x in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{x}")}
    with open(f"{log}.{os.getpid()}.json", "w") as f:
        json.dump({"argv": sys.argv, "env": dict(os.environ), "fds": fds,
                   "conn": str(conn_fd)}, f)


def __init__(self, handle, *a, **kw):  # a worker forked by a fork server: its own record
    init(self, handle, *a, **kw)
    if str(handle) != fd:
        record(handle)


connection.Connection.recv_bytes = recv_bytes
connection.Connection.__init__ = __init__
record(fd)
sys.argv = ["-c", fd]
exec(BOOT)
'''
"""A student's worker that first writes down what it was given: its command, environment and
open descriptors, and every byte the wire brings it (then it is the worker)."""


def _solution_cells() -> list[str]:
    nb = json.loads((ROOT / "solutions" / LAB / f"{LAB}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
            and c.get("metadata", {}).get("nbgrader", {}).get("solution")]


def _test_lines() -> set[str]:
    cells = load_lab(ROOT / "solutions" / LAB / f"{LAB}.ipynb").cells
    elsewhere = {line.strip() for c in cells if c.role != "test"
                 for line in c.source.splitlines()}
    return {line.strip() for c in cells if c.role == "test" for line in c.source.splitlines()
            if len(line.strip()) > 25 and not line.strip().startswith("#")} - elsewhere


TESTS = ("test_4_1_processes", "test_4_4_pieces", "test_4_4_processes")


def test_lab4_judged_end_to_end_and_its_workers_get_no_test_text(box, tmp_path):
    """Before: under the judge ``run_processes`` ran the test's body (hidden lines too) and
    held its report key in processes that exec'd the student's cells, and its processes had
    no student's code to run (the proxies have no source there). Now the solution earns every
    test of lab 4, decided in the judge, and each student's worker the tests' JAX processes
    started (in the sandbox where there is one) was given the setup cell and the student's
    definitions only (checked on :data:`TESTS`, hidden lines included): no line of a test, no report key (no descriptor but its socket, nothing
    of the key in its environment)."""
    from minickpt.labkit import lab4

    cells = _solution_cells()
    setup, tests = cells_mod.lab_cells(LAB)
    # two tests of processes (4.1's and 4.4's: 5 jobs of 2-4 processes): the whole lab's
    # verdicts under the judge are the corpus's (its _reference and perfect rows)
    some = (setup, [t for t in tests if t.grade_id in TESTS])
    assert len(some[1]) == len(TESTS)
    spied: list[str] = []
    with box.scratch() as d:
        spy = os.path.join(d, "spy")
        os.makedirs(spy)
        os.chmod(spy, 0o777)
        how = drills.judge_launch(box, d) if box.iso.sandboxed else {}
        real = how.get("wrap")

        def wrap(argv: list[str], env: dict[str, str]) -> list[str]:
            if argv[1:3] == ["-c", session.worker.BOOT]:  # a student's worker: record it
                log = os.path.join(spy, f"w{len(spied)}")
                spied.append(log)
                argv = [argv[0], "-c", f"BOOT = {session.worker.BOOT!r}\n{RECORDER}",
                        argv[3], log]
            return real(argv, env) if real is not None else argv

        verdicts, problems = session.judge_lab(
            LAB, cells, d, wrap=wrap if box.iso.sandboxed else None,
            uid=box.uid if box.iso.mode == "bwrap-root" else None,
            tools={"grader_drill": drills.tool(cells, box)}, cells=some,
            end_workers=box.end_workers, launch={**how, "wrap": wrap})
        assert not problems, problems
        failed = [(v.grade_id, v.message) for v in verdicts if not v.passed]
        assert not failed, failed
        assert len(verdicts) == len(TESTS)
        names = sorted(os.listdir(spy))
        records = [json.load(open(os.path.join(spy, n))) for n in names if n.endswith(".json")]
        received = [open(os.path.join(spy, n), "rb").read().decode("latin-1") for n in names
                    if n.endswith(".bytes")]
    # the judge's own worker, and at least one of each of the tests' jobs' 4 processes (each
    # started, or forked by a fork server that was started so)
    assert len(records) >= 5 and len(received) == len(records), (len(spied), len(records))
    text = "\n".join(received)
    assert "def two_barrier_commit(" in text and "def region_from_pieces(" in text
    leaked = [line for line in _test_lines() if line in text]
    assert not leaked, leaked[:3]
    assert "BEGIN HIDDEN" not in text and "mngr.save(10 if ME != N - 1 else 12" not in text
    for r in records:
        assert lab4.KEY_ENV not in r["env"] and not any(lab4.KEY_ENV in a for a in r["argv"])
        # past stdin, stdout and stderr: its socket, and the folder its listing read
        others = {f: t for f, t in r["fds"].items() if int(f) > 2 and f != r["conn"]
                  and not t.startswith("/proc/")}
        assert not others, r["fds"]



def test_a_dtype_crosses_by_value():
    """Lab 4's ``region_from_pieces(box, dtype, pieces)``: the dtype is a value on the other
    side (numpy refuses a handle as a data type), the pieces' read callables stay handles."""
    import socket
    from multiprocessing.connection import Connection

    import numpy as np

    from autograder.judge import wire

    a, b = socket.socketpair()
    judge = wire.Endpoint(Connection(a.detach()), "judge", session.confined_policy(["/nowhere"]),
                          timeout=60).start()
    other = wire.Endpoint(Connection(b.detach()), "worker",
                          wire.Policy(private=True, setattr=True), timeout=60).start()
    try:
        def student(dtype, pieces):
            (box, read), = pieces
            return np.asarray(read(box), dtype=dtype), dtype.str

        fn = judge.decode(other.encode(student))
        for dt in (np.dtype(np.float32), np.dtype(">i4"), np.dtype("bool")):
            out, name = fn(dt, [(((0, 2),), lambda part: np.ones(2))])
            assert out.dtype == dt and name == dt.str
    finally:
        judge.close()
        other.close()


@pytest.mark.parametrize("at", [0, 16, 48])
def test_an_array_crosses_as_aligned_as_it_was(at):
    """Lab 4.4's test reads the region's address (64-byte aligned: ``aligned_empty``): the
    copy the judge gets starts where the student's array did, modulo 64."""
    import numpy as np

    from autograder.judge import wire

    raw = np.zeros(64 + 6 * 4, np.uint8)
    start = (at - raw.__array_interface__["data"][0]) % 64
    a = raw[start:start + 24].view(np.float32)
    a[:] = np.arange(6)
    b = wire._nd_from(wire._nd_enc(a.reshape(2, 3)))
    assert b.__array_interface__["data"][0] % 64 == at and b.flags.writeable
    assert np.array_equal(b, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_a_judged_job_is_given_more_time_than_a_test_names_before_it_counts_as_hung(tmp_path):
    """Under load (the suite beside a second copy of itself), lab 4's judged jobs failed with
    "process 0 of 4 never reported (it was still running at the time limit)": the primary,
    which commits and hosts the coordinator, came last, past run_processes' 50 s. The limit
    is there to end a job that hangs; on the grader's busy machine a judged job now gets
    :data:`~minickpt.labkit.lab4_judged.TIME_SCALE` times the limit a test names. Here a
    test names 8 s and process 0 reports after 12 s: every process reports."""
    import json as json_

    from minickpt.labkit import lab4
    from minickpt.labkit.processes import launched_by

    nb = json_.loads((ROOT / "solutions" / LAB / f"{LAB}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
             and c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    spec = session.worker_spec(LAB, cells, str(tmp_path), "", wrap=None, timeout=60,
                               outside=str(tmp_path))
    # process 0 reports at 1.5x the named limit after the call (at once if starting took
    # longer than that, on a busy machine): past the named limit, within the judge's
    body = ("import time\nif ME == 0:\n    time.sleep(max(0.0, REPORT_AT - time.time()))\n"
            "report(me=ME)\n")
    import time

    with launched_by(student_worker=spec):
        run = lab4.run_processes(body, processes=4, devices=1, timeout_s=8.0,
                                 values={"REPORT_AT": time.time() + 12.0})
    run.check_reported()
    assert [r.get("me") for r in run.results] == [0, 1, 2, 3]
