"""The judge (issue 47): the wire between it and the student's worker, what the worker may
reach, what enters the sandbox, and a lab judged end to end against a real worker process."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autograder import ROOT
from autograder.judge import cells as cells_mod
from autograder.judge import session, wire, worker
from autograder.notebook import assemble, load_lab, read_submission, split_hidden

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def pair():
    """Two endpoints joined by a socket pair: "judge" and "worker", both in this process."""
    a, b = socket.socketpair()
    judge = wire.Endpoint(Connection(a.detach()), "judge", session.confined_policy(["/nowhere"]),
                          timeout=120).start()
    other = wire.Endpoint(Connection(b.detach()), "worker", wire.Policy(private=True,
                                                                         setattr=True),
                          timeout=120).start()
    yield judge, other
    judge.close()
    other.close()


def _remote(ep_from: wire.Endpoint, ep_to: wire.Endpoint, obj):
    """``obj`` (of ``ep_to``'s side) as ``ep_from`` sees it: a handle."""
    return ep_from.decode(ep_to.encode(obj))


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids)
    | st.dictionaries(st.text(max_size=5), kids, max_size=4), max_leaves=20)


@settings(max_examples=60, deadline=None)
@given(plain)
def test_plain_data_crosses_by_value_unchanged(value):
    a, b = socket.socketpair()
    try:
        judge = wire.Endpoint(Connection(a.detach()), "judge")
        other = wire.Endpoint(Connection(b.detach()), "worker")
        back = other.decode(judge.encode(value))
        assert back == value and type(back) is type(value)
    finally:
        a.close()
        b.close()


def test_arrays_cross_with_their_dtype_shape_and_byte_order(pair):
    judge, other = pair
    import ml_dtypes

    for a in (np.arange(6, dtype=">i2").reshape(2, 3), np.float32(1.5), np.array(2.0),
              np.arange(4).astype(ml_dtypes.bfloat16), np.zeros((0, 3)),
              np.arange(12.0)[::2], np.array(["ab", "c"]), np.array([None, 1], dtype=object)):
        got = other.decode(judge.encode(a))
        assert type(got) is type(a)
        if isinstance(a, np.ndarray):
            assert got.dtype == a.dtype and got.shape == a.shape
            assert got.tolist() == a.tolist()
        else:
            assert got == a and got.dtype == a.dtype


def test_a_leaf_sent_back_is_the_senders_own_object_and_in_place_changes_come_back(pair):
    judge, other = pair
    leaf, big = np.arange(4.0), 2**80
    echo = _remote(judge, other, lambda x: x)
    out = echo([leaf, big, 2.5])
    assert out[0] is leaf and out[1] is big

    def scale(a):
        a *= 2
        return None

    arr = np.ones(3)
    _remote(judge, other, scale)(arr)
    assert arr.tolist() == [2.0, 2.0, 2.0]  # the callee changed it in place: so here too

    def view(a):
        return a[1:3]

    v = _remote(judge, other, view)(arr)
    assert np.shares_memory(v, arr)


def test_a_list_or_dict_argument_changed_in_place_is_changed_at_the_caller(pair):
    """Lab 2's steps_to_keep must not reorder the caller's infos: a list the callee sorts in
    place (or a dict it updates, nested or not) is changed at the caller's too, its items still
    the caller's own; an argument left alone is left alone."""
    judge, other = pair
    a, b = np.arange(2.0), np.arange(3.0)

    def meddle(xs, d, nested, alone):
        xs.sort(key=len, reverse=True)
        d["new"] = 1
        nested["k"].append(3)
        return None

    xs, d, inner, alone = [a, b], {"old": 0}, [1, 2], [5, 6]
    nested = {"k": inner}
    _remote(judge, other, meddle)(xs, d, nested, alone)
    assert xs[0] is b and xs[1] is a
    assert d == {"old": 0, "new": 1}
    assert nested["k"] is inner and inner == [1, 2, 3]
    assert alone == [5, 6]


def test_an_object_two_arguments_share_is_one_plain_object_there(pair):
    """Two records holding one dict (``dataclasses.replace`` shares its fields) arrive as two
    records holding one plain dict, not a dict and a handle: lab 6's stepless checkpoint beside
    step 0 (their metrics one dict) made the reference best_checkpoint read no metric from the
    second, and the judge failed the solution. An object inside itself still crosses."""
    import dataclasses

    from minickpt import CheckpointMetadata

    judge, other = pair
    metrics = {"loss": 0.3}
    m0 = CheckpointMetadata(step=0, items={}, metrics=metrics)
    stepless = dataclasses.replace(m0, step=None)

    def look(source, twice):
        return ([type(m.metrics) is dict and m.metrics["loss"] for m in source],
                source[0].metrics is source[1].metrics, twice[0] is twice[1])

    shared = [1, 2]
    assert _remote(judge, other, look)([stepless, m0], [shared, shared]) == \
        ([0.3, 0.3], True, True)
    loop: list = [1]
    loop.append(loop)
    assert _remote(judge, other, lambda x: x[0])(loop) == 1


def test_a_buffer_the_callee_fills_is_filled_at_the_caller(pair):
    """A file system the test defines stays in the judge, and the student's restore reads
    through it: ``preadv(fd, [memoryview, ...], offset)`` fills the worker's own buffers, as in
    one process (lab 1's restore through a test's ``fs``). A bytearray too; a read-only view
    and an argument left alone are left alone."""
    judge, other = pair
    arr = np.zeros(6, np.uint8)
    views = [memoryview(arr)[:2], memoryview(arr)[2:]]
    raw, ro = bytearray(3), memoryview(b"abc")

    def fill(bufs, extra, readonly):
        for i, b in enumerate(bufs):
            b[:] = bytes([i + 1]) * len(b)
        extra[:] = b"xyz"
        return len(readonly)

    assert _remote(other, judge, fill)(views, raw, ro) == 3
    assert arr.tolist() == [1, 1, 2, 2, 2, 2] and raw == bytearray(b"xyz") and bytes(ro) == b"abc"


def test_a_closed_wire_never_reads_from_the_next_ones_socket():
    """A wire is closed and a new one opened, again and again (a worker replaced after each
    death or hang): the old reader must be gone before its descriptor is reused, or it reads
    the new wire's bytes (seen as a torn message, or a call that never arrived: this file's
    tests timed out now and then)."""
    def double(x):
        x *= 2

    for _ in range(150):
        a, b = socket.socketpair()
        judge = wire.Endpoint(Connection(a.detach()), "judge", timeout=10).start()
        other = wire.Endpoint(Connection(b.detach()), "worker", timeout=10).start()
        try:
            arr = np.ones(3)
            _remote(judge, other, double)(arr)
            assert arr.tolist() == [2.0] * 3
        finally:
            judge.close()
            other.close()


def test_exceptions_keep_their_class_errno_notes_and_identity(pair):
    judge, other = pair
    from minickpt.errors import CheckpointCorruptedError

    def fail(kind):
        if kind == "os":
            raise OSError(28, "No space left on device", "/x")
        raise CheckpointCorruptedError("/ckpt", "bad bytes")

    f = _remote(judge, other, fail)
    with pytest.raises(OSError) as e:
        f("os")
    assert e.value.errno == 28 and e.value.filename == "/x"
    with pytest.raises(CheckpointCorruptedError) as e:
        f("ckpt")
    assert "bad bytes" in str(e.value)

    boom = ValueError("boom")

    def keep(fn):
        try:
            fn()
        except ValueError as err:
            err.add_note("step 3")
            return err

    def raiser():
        raise boom

    got = _remote(judge, other, keep)(raiser)
    assert got is boom and boom.__notes__ == ["step 3"]


def test_the_worker_reaches_no_class_module_or_function_of_the_judge_and_no_path_outside(pair):
    """What the worker may do with the judge's objects (issue 47: an attribute walk from a
    served object to the judge's globals gets an error, not a reference)."""
    judge, other = pair
    from minickpt.fs import FileSystem

    class Served:
        def __init__(self):
            self.cls = Served
            self.mod = os
            self.fn = os.system
            self.data = [1, 2]

        def method(self):
            return 7

    served = _remote(other, judge, Served())
    assert served.method() == 7 and served.data == [1, 2]
    for name in ("cls", "mod", "fn", "__dict__", "__globals__"):
        with pytest.raises((AttributeError, wire.WireError)):
            getattr(served, name)
    fs = _remote(other, judge, FileSystem())
    with pytest.raises(PermissionError, match="outside the folder"):
        fs.exists("/etc/passwd")
    opaque = _remote(other, judge, print)  # may be passed along, never called
    with pytest.raises(TypeError, match="passed along"):
        opaque("hello")


def test_nothing_of_a_test_enters_the_sandbox(tmp_path):
    """Issue 47, point 3: for a lab the judge decides, no line of a test (hidden or not) and
    no expected value is in what the kernel runs or in what the worker is sent."""
    lab_name = "lab01_basics"
    lab = load_lab(ROOT / "solutions" / lab_name / f"{lab_name}.ipynb")
    sub = ROOT / "autograder" / "examples" / "perfect" / lab_name / f"{lab_name}.ipynb"
    student = read_submission(sub)
    asm = assemble(lab, student, referee_path="/r.py", key_file="/k", judged=True)
    ran = "\n".join(c.run for c in asm.cells if c.role != "student")  # theirs is theirs
    elsewhere = {line.strip() for c in lab.cells if c.role not in ("test", "quiz")
                 for line in c.source.splitlines()}
    test_lines = {line.strip() for c in lab.cells if c.role == "test"
                  for line in c.source.splitlines() if len(line.strip()) > 25} - elsewhere
    assert test_lines and not {line for line in test_lines if line in ran}
    hidden = {line.strip() for c in lab.cells if c.role in ("test", "quiz")
              for line in split_hidden(c.source)[1].splitlines() if len(line.strip()) > 25}
    shown = {line.strip() for c in asm.cells for line in c.show.splitlines()}
    assert not (hidden - shown) & {line.strip() for line in ran.splitlines()}

    sent: list[bytes] = []
    real = Connection.send_bytes

    def spy(self, data, *a, **k):
        sent.append(bytes(data))
        return real(self, data, *a, **k)

    setup, _ = cells_mod.lab_cells(lab_name)
    w = session.StudentWorker(lab_name, [c.source for c in student if c.grade_id.startswith("task_")],
                              str(tmp_path))
    try:
        Connection.send_bytes = spy
        w.start(setup, list(cells_mod.lab_task_names(lab_name)))
    finally:
        Connection.send_bytes = real
        w.close()
    program, job = sent[0].decode(), sent[1].decode(errors="replace")
    assert program == session.worker_program()  # public code, the same for everyone
    assert not {line for line in test_lines if line in job}
    assert worker.BOOT.count("\n") < 10 and "argv[1]" in worker.BOOT  # argv: one fd number


@pytest.mark.timeout(600)
def test_a_lab_judged_against_a_real_worker(tmp_path):
    """The solution's code earns every test of lab 1 from the judge; a wrong ``restore_checkpoint``
    (``if step:``) loses 1.4 and nothing else; a worker that dies costs only its own test."""
    lab_name = "lab01_basics"
    nb = json.loads((ROOT / "solutions" / lab_name / f"{lab_name}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
             and c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    verdicts, problems = session.judge_lab(lab_name, cells, str(tmp_path / "a"))
    assert not problems, problems
    assert all(v.passed for v in verdicts), [(v.grade_id, v.message) for v in verdicts]
    assert not problems
    dying = [c.replace("def to_host(", "import os\n\ndef to_host(", 1)
             .replace('    """Task 1.2', '    os._exit(3)\n    """Task 1.2', 1) for c in cells]
    verdicts, problems = session.judge_lab(lab_name, dying, str(tmp_path / "b"))
    by = {v.grade_id: v.passed for v in verdicts}
    assert not by["test_1_2_host"] and by["test_1_1_names"]
    assert any("new one" in p for p in problems)


@pytest.mark.timeout(600)
def test_a_worker_that_does_not_answer_is_replaced_before_the_next_test(tmp_path):
    """A call into the student's code that never returns (never_finishes) fails its test at
    the call time-out; the worker still running it is ended, and the next test gets a new one
    (a worker left spinning would slow every test after it, in the submission's slot)."""
    lab_name = "lab01_basics"
    nb = json.loads((ROOT / "solutions" / lab_name / f"{lab_name}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
             and c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    once = ('    """Task 1.2', '    if not os.path.exists("hung"):\n        open("hung", "w").close()'
            '\n        while True:\n            pass\n    """Task 1.2')
    hanging = [c.replace("def to_host(", "import os\n\ndef to_host(", 1).replace(*once, 1)
               for c in cells]
    assert hanging != cells
    verdicts, problems = session.judge_lab(lab_name, hanging, str(tmp_path), timeout=10)
    failed = [v.grade_id for v in verdicts if not v.passed]
    assert len(failed) == 1 and "did not answer within 10 s" in verdicts[
        [v.grade_id for v in verdicts].index(failed[0])].message, verdicts
    assert any("did not answer in time; the next test got a new worker" in p
               for p in problems), problems


def test_an_input_drawn_at_grading_time_differs_from_the_notebooks(monkeypatch):
    from minickpt.labkit.devices import drawn

    assert drawn(5) == 5  # a notebook: the seed itself
    seeds = set()
    for _ in range(3):
        with cells_mod.plugged("lab01_basics", {}):
            seeds.add(drawn(5))
    assert 5 not in seeds and len(seeds) == 3


def test_lab_texts_tell_students_how_their_work_is_judged():
    text = (ROOT / "docs" / "grading.md").read_text()
    assert "judge" in text.lower()
    assert Path(session.__file__).exists()


@pytest.mark.timeout(600)
def test_after_a_grader_tool_the_next_test_never_reuses_the_worker_it_ended(tmp_path, monkeypatch):
    """A grader's drill ends the slot's processes, the student's worker among them, and that
    kill can land after the tool returns (under load it did: lab 6's ``wrong_c`` lost its
    6.4 points to ``BrokenPipeError`` after 6.3's drill). The next test gets a new worker
    whether or not the old one still looks alive; the student is told nothing of it."""
    lab_name = "lab01_basics"
    nb = json.loads((ROOT / "solutions" / lab_name / f"{lab_name}.ipynb").read_text())
    student = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
               and c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    started: list[session.StudentWorker] = []
    real_start = session.StudentWorker.start

    def start(self, *args, **kwargs):
        started.append(self)
        return real_start(self, *args, **kwargs)

    def drill() -> None:  # its kill lands, and the judge has not seen it yet
        os.kill(started[-1].proc.pid, signal.SIGKILL)
        time.sleep(0.5)

    monkeypatch.setattr(session.StudentWorker, "start", start)
    monkeypatch.setattr(session.StudentWorker, "alive", lambda self: True)
    setup, _ = cells_mod.lab_cells(lab_name)
    tests = [cells_mod.TestCell("t_drill", "1.1", 1, "grader_drill()"),
             cells_mod.TestCell("t_after", "1.2", 1,
                                "import numpy as np\nassert to_host(np.arange(3)) is not None")]
    verdicts, problems = session.judge_lab(lab_name, student, str(tmp_path),
                                           tools={"grader_drill": drill}, cells=(setup, tests))
    assert [(v.grade_id, v.passed) for v in verdicts] == [("t_drill", True), ("t_after", True)], \
        [(v.grade_id, v.message) for v in verdicts]
    assert len(started) == 2 and not problems, problems
