"""Issue 31, classes 1 and 2: minickpt's own implementation of the task under test reached from
the student's code — through a module's ``__dict__``, a default argument, a walrus, a thread,
a reload — in the kernel (the referee) and in the worker processes the labs start
(``minickpt.labkit.watch``). Such a test earns nothing and says what was reached; the library's
other functions, and the reference called by the test itself, stay fine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minickpt import labkit as lab

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "0"}


KERNEL = r'''
import hmac, importlib.util, builtins, sys
import numpy as np
import minickpt as mc
import minickpt.labkit as lab
from minickpt.labkit import check

spec = importlib.util.spec_from_file_location("referee", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
mod.__dict__["__builtins__"] = dict(vars(builtins))
spec.loader.exec_module(mod)
with open(sys.argv[2], "wb") as f:
    f.write(b"k" * 32)
out = sys.stdout
captured = []
class Grab:
    def write(self, t): captured.append(t)
    def flush(self): pass
sys.stdout = Grab()
ref = mod.boot(sys.argv[2], "n")
ns = {"lab": lab, "check": check, "np": np, "mc": mc, "sys": sys}
ref.seal(ns)
K = b"k" * 32

def sign(gid, src):
    return hmac.new(K, f"n|test|{gid}|{()!r}|{src}".encode(), "sha256").hexdigest()

def sealed(gid, src):
    data = src.encode()
    stream = b"".join(bytes.fromhex(hmac.new(K, f"n|text|{gid}|{i}".encode(), "sha256").hexdigest())
                      for i in range((len(data) + 31) // 32))
    return bytes(a ^ b for a, b in zip(data, stream)).hex()

def run(label, gid, src):
    captured.clear()
    try:
        ref.test(gid, sealed(gid, src), sign(gid, src))
        result = "receipt" if mod.RECEIPT in "".join(captured) else "MISSING"
    except BaseException as e:
        notes = [line.split(" ", 3)[3] for line in "".join(captured).split("\n")
                 if line.startswith(mod.RECEIPT) and hmac.compare_digest(line.split(" ", 3)[2],
                 hmac.new(K, f"n|restored|{gid}|{line.split(' ', 3)[3]}".encode(), "sha256").hexdigest())]
        result = f"{type(e).__name__}: {e} | notes " + " ; ".join(notes)
    print(f"{label}: {result}", file=out)

TEST = """
x = np.arange(4, dtype=np.float32)
check(np.array_equal(to_host(x), lab.reference("to_host")(x)), "to_host is wrong")
"""
n = [0]
def case(label, cell):
    exec(cell, ns)
    n[0] += 1
    run(label, f"test_1_2_{n[0]}", TEST)

case("honest", "def to_host(x):\n    return np.asarray(x)")
case("dict default", 'def to_host(x, _f=mc.tree.__dict__["to_host"]):\n    return _f(x)')
case("bare", 'to_host = mc.tree.__dict__["to_host"]')
case("vars walrus", 'def to_host(x, _f=(_g := vars(mc.tree)["to" "_host"])):\n    return _f(x)')
case("profile off", """
def to_host(x, _f=mc.tree.__dict__["to_host"]):
    sys.setprofile(None)
    return _f(x)""")
case("thread", """
import threading
def to_host(x, _f=mc.tree.__dict__["to_host"]):
    box = []
    t = threading.Thread(target=lambda: box.append(_f(x)))
    t.start(); t.join()
    return box[0]""")
case("raw thread", """
import _thread, time
def to_host(x, _f=mc.tree.__dict__["to_host"]):
    box = []
    _thread.start_new_thread(lambda: box.append(_f(x)), ())
    while not box: time.sleep(0.01)
    return box[0]""")
case("reload", """
import importlib.util
def to_host(x):
    spec = importlib.util.spec_from_file_location("minickpt._fresh_tree", mc.tree.__file__)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
    return m.to_host(x)""")
case("library helper", """
def to_host(x):
    return np.asarray(mc.tree.path_str(("a", "b")) and x)""")

# a worker the private copy of the kit starts (lab 6's loop process), told the task by the referee
import linecache, tempfile
LOOP = """import minickpt as mc
def train_until_preempted(mngr, carry, step_fn, *, start=0, stop, items,
                          _f=mc.production.preemption.__dict__["train_until_preempted"]):
    return _f(mngr, carry, step_fn, start=start, stop=stop, items=items)
"""
name = "/tmp/ipykernel_0/reached-cell.py"
linecache.cache[name] = (len(LOOP), None, LOOP.splitlines(True), name)
exec(compile(LOOP, name, "exec"), ns)
ns["tempfile"] = tempfile
run("worker", "test_6_3_1", "d = tempfile.mkdtemp()\n"
    "lab.run_loop_process(train_until_preempted, d, stop=6, every=3)")
'''


def test_the_reference_reached_from_the_students_code_in_the_kernel_earns_nothing(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(KERNEL)
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "autograder" / "referee.py"),
                           str(tmp_path / "key")], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["honest"] == "receipt"             # the test calls the reference itself: fine
    assert lines["library helper"] == "receipt"     # minickpt's other functions: fine
    for label in ("dict default", "bare", "vars walrus", "thread", "reload"):
        assert lines[label].startswith("TamperedError: while your code ran it reached "
                                       "minickpt's own to_host (task 1.2)"), (label, lines[label])
        assert "watch: reached minickpt's own to_host (task 1.2)" in lines[label], lines[label]
    assert "called sys.setprofile while the grader watched" in lines["profile off"]
    assert lines["profile off"] != "receipt"
    assert "started a thread around the grader's watch" in lines["raw thread"]
    assert lines["worker"].startswith("LabCheckError: while your code ran in the worker "
                                      "process it reached minickpt's own train_until_preempted "
                                      "(task 6.3)"), lines["worker"]
    assert "watch: reached minickpt's own train_until_preempted (task 6.3)" in lines["worker"]


def test_a_workers_namespace_holds_no_reference_before_the_students_cell():
    ns = lab.lab3_namespace()
    refs = {id(f) for fns in lab.reference_functions().values() for f in fns}
    assert "resume" not in ns and not any(id(v) in refs for v in ns.values())
    assert ns["Rename"] is not None and "migrate_leaf" in ns   # the lab's other names stay


def _cell(tmp_path: Path, name: str, text: str):
    path = tmp_path / f"{name}_cell.py"
    path.write_text(text)
    ns: dict = {"__name__": "student"}
    exec(compile(text, str(path), "exec"), ns)
    return ns[name]


LOOP_VIA_DICT = '''
import minickpt as mc
def train_until_preempted(mngr, carry, step_fn, *, start=0, stop, items,
                          _f=mc.production.preemption.__dict__["train_until_preempted"]):
    return _f(mngr, carry, step_fn, start=start, stop=stop, items=items)
'''
LOOP_VIA_WALRUS = '''
def train_until_preempted(mngr, carry, step_fn, *, start=0, stop, items,
                          _f=(mc := __import__("minickpt")).production.preemption.__dict__[
                              "train_until_preempted"]):
    return _f(mngr, carry, step_fn, start=start, stop=stop, items=items)
'''
LOOP_PATCHES = '''
import minickpt as mc
mc.CheckpointManager = mc.CheckpointManager  # harmless
def train_until_preempted(mngr, carry, step_fn, *, start=0, stop, items):
    import minickpt.production.preemption as p
    p.LoopResult = dict
    raise SystemExit(0)
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text", [LOOP_VIA_DICT, LOOP_VIA_WALRUS], ids=["dict", "walrus"])
def test_the_reference_reached_in_the_loop_worker_fails_the_test(tmp_path, text):
    fn = _cell(tmp_path, "train_until_preempted", text)
    with pytest.raises(lab.LabCheckError, match=r"reached minickpt's own train_until_preempted "
                                                r"\(task 6\.3\)"):
        lab.run_loop_process(fn, str(tmp_path), stop=6, every=3)


@pytest.mark.timeout(240)
def test_the_loop_worker_reports_minickpt_changed_and_passes_an_honest_loop(tmp_path):
    fn = _cell(tmp_path, "train_until_preempted", LOOP_PATCHES)
    with pytest.raises(lab.LabCheckError, match=r"changed minickpt\.production\.preemption\."
                                                r"LoopResult"):
        lab.run_loop_process(fn, str(tmp_path), stop=6, every=3)
    import inspect

    honest = _cell(tmp_path, "train_until_preempted", "import signal, time\n"
                   "from minickpt.production.preemption import *\n"
                   "from minickpt.production.preemption import LoopResult\n"
                   + inspect.getsource(lab.reference("train_until_preempted")))
    os.makedirs(tmp_path / "b")
    rc, out, err = lab.run_loop_process(honest, str(tmp_path / "b"), stop=6, every=3)
    assert rc == 0 and out[-1] == "result LoopResult 6 False", err


RESUME_VIA_DEFAULT = '''
def resume(mngr, state, rng, _r=mc.restore.__dict__["resume"]):
    return _r(mngr, state, rng)
'''


@pytest.mark.timeout(300)
def test_the_reference_reached_in_the_lab3_drill_fails_the_test(tmp_path):
    fn = _cell(tmp_path, "resume", "import minickpt as mc\n" + RESUME_VIA_DEFAULT)
    with pytest.raises(lab.LabCheckError, match=r"reached minickpt's own resume \(task 3\.3\)"):
        lab.lab3_drill(fn, steps=15, every=5, kill_after=8)


AGREE_WALRUS = '''
def agree_on_step(steps, _f=mc.multihost.sync.__dict__["agree_on_step"],
                  _x=(plugged_in := (lambda *fns: __import__("contextlib").nullcontext()))):
    return _f(steps)
'''


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_reference_reached_in_run_processes_fails_the_test(tmp_path):
    """The walrus rebinds nothing of the harness (plugged_in still swaps the student's function
    in), and the default's reference is seen running inside it."""
    fn = _cell(tmp_path, "agree_on_step", "import minickpt as mc\n" + AGREE_WALRUS)
    body = "report(step=mc.multihost.sync.agree_on_step([3, 4]))"
    with pytest.raises(lab.LabCheckError, match=r"reached minickpt's own agree_on_step "
                                                r"\(task 4\.1\)"):
        lab.run_processes(body, processes=2, devices=1, functions=[fn])
