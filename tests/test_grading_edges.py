"""The sandbox's edges of issue 31: no keyring passes a value from one submission to the next,
no nested user namespace, a compilation cache that names no hidden test, and an environment
whose ``minickpt`` is an editable install of another checkout.

Each test starts a few bare sandboxed processes (seconds), never a graded lab.

Issue 38's edges (points 3 and 4): nothing of a failed test outlives its cell (one bare kernel
run up to lab 1's first test), only regular files are graded (links, pipes, folders: refused
by name, a whole grade.sh run of them exits 0), nothing of a private ``--source`` is mounted,
one output budget per submission, the worker inside its slot's cgroup and the ``-j`` rule.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from autograder import sandbox, seccomp

REQUIRE = os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1"


@functools.cache
def _probe() -> sandbox.Isolation:
    return sandbox.probe()


def _isolation() -> sandbox.Isolation:
    iso = _probe()
    if iso.mode != "bwrap-root":
        why = f"needs the sandbox as root (have {iso.mode}: {iso.detail})"
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)
    return iso


def _run(iso, uid: int, ipc: Path, code: str, python: str | None = None):
    sandbox.prepare_ipc_dir(ipc, iso, uid)
    python = python or sys.executable
    cmd = sandbox.kernel_command(
        iso, [sandbox.sandbox_python(python), "-c", code], uid=uid, cwd="/home/student/x",
        ipc_dir=str(ipc), read_only=sandbox.python_paths(python), limits=sandbox.Limits(),
        env={}, extra_ro=sandbox.package_binds(python))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


ADD_KEY = r'''
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 248, "aarch64": 217}[platform.machine()]
for ring in (-4, -5, -3):  # the user, user-session and session keyrings
    got = libc.syscall(nr, b"user", b"covert-31", b"answer=42", 9, ctypes.c_int(ring))
    print("add", ring, got, ctypes.get_errno())
'''
READ_KEY = r'''
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 250, "aarch64": 219}[platform.machine()]
found = []
for ring in (-4, -5, -3):
    key = libc.syscall(nr, 10, ctypes.c_int(ring), b"user", b"covert-31", 0)  # KEYCTL_SEARCH
    if key > 0:
        buf = ctypes.create_string_buffer(64)
        n = libc.syscall(nr, 11, key, buf, 64)  # KEYCTL_READ
        found.append(buf.raw[:max(n, 0)].decode())
found += [line for line in open("/proc/keys") if "covert-31" in line]
print("found", found)
'''


def test_a_key_one_submission_adds_never_reaches_the_next_in_its_slot(tmp_path):
    """The slot's uid is reused: its user keyring outlived the submission that wrote it.
    Every keyring call is refused in the sandbox, and a slot's keyrings start empty."""
    iso = _isolation()
    with sandbox.SlotUids(1) as slot:
        uid = slot.uids[0]
        first = _run(iso, uid, tmp_path / "ipc", ADD_KEY)
        second = _run(iso, uid, tmp_path / "ipc", READ_KEY)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert [line.split()[2] for line in first.stdout.splitlines()] == ["-1"] * 3, first.stdout
    assert second.stdout.strip() == "found []", second.stdout
    with sandbox.SlotUids(1) as slot:  # a later run, the same uid
        third = _run(iso, slot.uids[0], tmp_path / "ipc", READ_KEY)
    assert third.stdout.strip() == "found []", third.stdout


def test_no_user_namespace_can_be_made_inside_the_sandbox(tmp_path):
    iso = _isolation()
    code = ("import os, subprocess, threading\n"
            "r = subprocess.run(['unshare', '-Ur', 'true'], capture_output=True)\n"
            "print('unshare', r.returncode)\n"
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('os.unshare', 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n")
    with sandbox.SlotUids(1) as slot:
        proc = _run(iso, slot.uids[0], tmp_path / "ipc", code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert lines[0] != "unshare 0" and lines[1] == "os.unshare 1", proc.stdout  # EPERM
    assert "thread" in lines  # threads and processes (clone without the flag) still work


def test_the_filter_is_a_short_program_for_each_machine_it_knows():
    prog = seccomp.program("x86_64")
    assert len(prog) % 8 == 0 and len(prog) // 8 < 64
    assert seccomp.supported("aarch64") and not seccomp.supported("sparc")
    with pytest.raises(ValueError, match="sparc"):
        seccomp.program("sparc")


HIDDEN_CELL = '''
import jax, jax.numpy as jnp
def program(x):
    return jnp.cos(x) * 3 + 2
def test_hidden_marker_31():
    return float(jax.jit(program)(jnp.float32(1.0)))
print(test_hidden_marker_31())
'''


def test_the_compilation_cache_names_no_hidden_test(tmp_path):
    """What a fill writes carries no frame of the code that traced it: not the hidden test's
    cell file, not its function's name (the jitted function's own name stays: it names the
    program, as the entry's file name does)."""
    cell = tmp_path / "ipykernel_7" / "cell_hidden_31.py"
    cell.parent.mkdir()
    cell.write_text(HIDDEN_CELL)
    cache = tmp_path / "cache"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           **sandbox.kernel_env({}, cache=(str(cache), True))}
    proc = subprocess.run([sys.executable, str(cell)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    assert any(p.name.startswith("jit_program-") for p in entries), entries
    for p in entries:
        raw = p.read_bytes()
        try:
            raw = zlib.decompress(raw)
        except zlib.error:
            pass
        for marker in (b"cell_hidden_31", b"ipykernel_7", b"test_hidden_marker_31"):
            assert marker not in raw, (p.name, marker)


def _venv_importing(tmp_path: Path, package: Path | None) -> str:
    """A bare environment (no pip) that sees the shared one's packages through a .pth and,
    first, ``package``'s folder (a checkout elsewhere, as an editable install points)."""
    env = tmp_path / "env"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(env)],
                   check=True, timeout=120)
    site = next((env / "lib").glob("python3*/site-packages"))
    shared = next(p for p in sys.path if p.endswith("site-packages") and
                  Path(p).resolve().is_relative_to(Path(sys.prefix).resolve()))
    lines = ([str(package.parent)] if package else []) + [str(Path(shared).resolve())]
    (site / "zz_course.pth").write_text("\n".join(lines) + "\n")
    return str(env / "bin" / "python")


def test_an_editable_install_of_another_checkout_runs_this_checkouts_minickpt(tmp_path):
    iso = _isolation()
    other = tmp_path / "other-checkout" / "minickpt"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHICH = 'the other checkout'\n")
    python = _venv_importing(tmp_path, other)
    assert sandbox.env_package(python) == str(other.resolve())
    assert sandbox.package_binds(python) == {sandbox.grader_package(): str(other.resolve())}
    found = sandbox.probe(python)
    assert found.mode == "bwrap-root" and not found.detail, found.detail
    with sandbox.SlotUids(1) as slot:
        proc = _run(iso, slot.uids[0], tmp_path / "ipc",
                    "import minickpt; print(getattr(minickpt, 'WHICH', 'this checkout'))",
                    python=python)
    assert proc.stdout.strip() == "this checkout", proc.stdout + proc.stderr


def test_an_environment_without_minickpt_is_named_as_the_cause(tmp_path):
    _isolation()
    python = _venv_importing(tmp_path, None)
    found = sandbox.probe(python)
    if sandbox.env_package(python) is not None:  # the shared site-packages holds a copy
        pytest.skip("the shared environment has minickpt installed as a plain package")
    assert not found.sandboxed and "has no minickpt installed" in found.detail, found.detail
    cause = sandbox._probe_cause("ModuleNotFoundError: No module named 'minickpt'", python, [])
    assert "has no minickpt installed" in cause


# ---------------------------------------------------------------------------------------
# lab 4: the harness's RESULT line cannot be forged from the student's code
# ---------------------------------------------------------------------------------------
def agree_on_step(steps):
    """A forger: in a worker, print the RESULT line the test wants, then leave at once."""
    import json
    import os

    if "MINICKPT_PROCESS_ID" in os.environ:
        line = {"results": {"v": int(steps[0]), "forged": True}, "error": None}
        os.write(1, f"RESULT {json.dumps(line)}\n".encode())
        os.write(1, f"RESULT mac={'0' * 64} {json.dumps(line)}\n".encode())
        os._exit(0)
    return steps[0]


def test_a_result_line_printed_by_the_students_code_earns_nothing():
    from minickpt import labkit
    from minickpt.labkit import lab4

    run = lab4.run_processes("report(v=agree_on_step([3, 3]))", processes=2, devices=1,
                             functions=[agree_on_step], timeout_s=60)
    assert run.reported == [False, False] and run.results == [{}, {}], run.results
    assert run.forged[0] == 2  # (process 1 may be gone with the job before its own)
    with pytest.raises(labkit.LabCheckError, match="the harness did not write"):
        run.check_reported()
    honest = lab4.run_processes("report(v=agree_on_step([3, 3]))", processes=2, devices=1,
                                functions=[_honest(agree_on_step)], timeout_s=60)
    assert honest.reported == [True, True] and honest.results == [{"v": 3}, {"v": 3}]
    assert honest.forged == [0, 0]


def _honest(_fn):
    def agree_on_step(steps):
        """Mine: the first step (enough for this test)."""
        return steps[0]
    return agree_on_step


# ---------------------------------------------------------------------------------------
# issue 38 (3): hidden test text does not outlive its cell
# ---------------------------------------------------------------------------------------
PROBE = r'''
import gc, linecache, sys, traceback, types
_found = {"set": [n for n in ("last_type", "last_value", "last_traceback", "last_exc")
                  if getattr(sys, n, None) is not None]}
_texts = []
_v = getattr(sys, "last_value", None)
if _v is not None:
    _texts.append("".join(traceback.TracebackException(
        type(_v), _v, sys.last_traceback, capture_locals=True).format()))
_ip = get_ipython()
_r = _ip.last_execution_result
for _e in (getattr(_r, "error_in_exec", None), getattr(_r, "error_before_exec", None)):
    while _e is not None:
        if _e.__traceback__ is not None:
            _found["set"].append("an exception's __traceback__")
            _texts.append("".join(traceback.TracebackException(
                type(_e), _e, _e.__traceback__, capture_locals=True).format()))
        _e = _e.__context__
_texts.append(repr(getattr(_ip.history_manager, "exceptions", {})))
_texts.append(repr({k: v for k, v in linecache.cache.items() if k.startswith("<test")}))
for _o in gc.get_objects():
    if isinstance(_o, types.FrameType) and _o.f_code.co_filename.startswith("<test"):
        _found["set"].append("a frame of a test")
        _texts.append(repr(_o.f_locals))
    elif isinstance(_o, types.TracebackType):
        _t = _o
        while _t is not None:
            if _t.tb_frame.f_code.co_filename.startswith("<test") or \
                    "source" in _t.tb_frame.f_locals:
                _found["set"].append("a traceback through a test")
                _texts.append(repr(_t.tb_frame.f_locals))
            _t = _t.tb_next
_found["text"] = "\n".join(_texts)
open("probe.txt", "w").write(repr(_found))
print("PROBE written")
'''


def _leak_probe(tmp: str) -> dict:
    """Lab 1's blank release, run in a bare unsandboxed kernel under the referee up to its
    first test (which fails), then :data:`PROBE`: what the kernel still holds of it."""
    import ast
    import asyncio
    import json

    from nbformat.v4 import new_code_cell, new_notebook

    from autograder import execute, runner
    from autograder.notebook import assemble, load_lab, read_submission

    tmp_path = Path(tmp)
    lab = load_lab(ROOT / "solutions" / LAB / f"{LAB}.ipynb")
    student = read_submission(ROOT / "labs" / LAB / f"{LAB}.ipynb")
    key_file = tmp_path / "referee.key"
    asm = assemble(lab, student, referee_path=str(runner.REFEREE_FILE), key_file=str(key_file))
    key_file.write_bytes(asm.key)
    first = next(i for i, c in enumerate(asm.cells) if c.role == "test")
    cells = [new_code_cell(c.run, metadata={"minickpt": {"role": c.role}})
             for c in asm.cells[:first + 1] if c.kind == "code"]
    nb = new_notebook(cells=[*cells, new_code_cell(PROBE)])
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    iso = sandbox.unsandboxed("test")
    km = sandbox.make_kernel_manager(iso, uid=0, ipc_dir=str(ipc), cwd=str(tmp_path),
                                     limits=sandbox.Limits(), extra_ro={},
                                     kernel_args=runner.KERNEL_ARGS, max_message_bytes=32 << 20)
    client = execute.GradingClient(nb, km, timeout=120, setup_timeout=120,
                                   keep_output_bytes=1 << 20, max_output_bytes=64 << 20,
                                   interrupt_grace=10, reap_uid=None)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)}
    runner.run_client(client, tmp_path / "kernel.log", env=env, cwd=str(tmp_path))
    km.context.destroy(linger=0)
    del asyncio
    test_out = json.dumps(nb.cells[-2].outputs)
    if not (tmp_path / "probe.txt").exists():
        raise AssertionError(f"the probe wrote nothing: {json.dumps(nb.cells[-1].outputs)[:3000]}")
    found = ast.literal_eval((tmp_path / "probe.txt").read_text())
    hidden = [s.strip() for s in asm.cells[first].full.split("\n") if len(s.strip()) >= 20
              and s.strip() not in asm.cells[first].show]
    return {"set": found["set"], "leaked": [s for s in hidden if s in found["text"]],
            "hidden": len(hidden), "test_failed": '"error"' in test_out,
            "test_out": test_out[:2000]}


ROOT = Path(__file__).resolve().parents[1]
LAB = "lab01_basics"


@pytest.mark.timeout(300)
def test_after_a_failed_test_the_kernel_holds_no_trace_of_its_text(tmp_path):
    """Round 4: after a failed test cell, ``sys.last_traceback`` (and IPython's last result)
    held the referee's frames; ``TracebackException(..., capture_locals=True)`` in the next
    cell printed the test's whole text. After each test cell nothing of it is left: no
    ``sys.last_*``, no exception with a traceback, no frame or traceback through a test."""
    import json

    proc = subprocess.run([sys.executable, "-c", "import tests.test_grading_edges as t, sys, "
                           "json; print(json.dumps(t._leak_probe(sys.argv[1])))",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["test_failed"] and got["hidden"] >= 3, got
    assert got["set"] == [] and got["leaked"] == [], got


# ---------------------------------------------------------------------------------------
# issue 38 (4): the grader's own edges
# ---------------------------------------------------------------------------------------
def _refusals(tmp_path: Path) -> dict[str, Path]:
    """One hand-in of each kind that is not a regular file."""
    from autograder import grade

    subs = tmp_path / "subs"
    made = {}
    for student in ("link_solutions", "link_zero", "fifo", "folder", "link_dangling"):
        d = subs / student / LAB
        d.mkdir(parents=True)
        made[student] = d / f"{LAB}.ipynb"
    made["link_solutions"].symlink_to(ROOT / "solutions" / LAB / f"{LAB}.ipynb")
    made["link_zero"].symlink_to("/dev/zero")
    made["link_dangling"].symlink_to(tmp_path / "nowhere.ipynb")
    os.mkfifo(made["fifo"])
    made["folder"].mkdir()
    found, warnings = grade.find_submissions(subs, {LAB})
    assert {s.student for s in found} == set(made), (found, warnings)
    return made


@pytest.mark.timeout(60)
def test_only_a_regular_file_is_graded_a_link_is_refused_by_name_never_followed(tmp_path):
    """Round 4: a submitted notebook that was a link to the solutions notebook scored 26/26; a
    link to /dev/zero filled the work file system and failed the neighbour's grading. Each
    hand-in that is not a regular file is a row with its reason, at once, reading nothing."""
    from autograder import runner

    cfg = {"iso": {"mode": "none"}, "source": str(ROOT / "solutions")}
    why = {"link_solutions": "symbolic link", "link_zero": "symbolic link",
           "link_dangling": "symbolic link", "fifo": "not a regular file",
           "folder": "not a regular file"}
    for student, path in _refusals(tmp_path).items():
        job = runner.Job(0, student, LAB, str(path), str(tmp_path / "work" / student))
        result = runner.grade_one(job, cfg, {})
        assert result["status"] == "failed" and why[student] in result["reason"], result
        assert result["total"] == 0, result
        work = Path(job.dir)
        assert sum(f.stat().st_size for f in work.rglob("*") if f.is_file()) < 1 << 20
        assert not (work / "submitted.ipynb").exists()


@pytest.mark.timeout(200)
def test_a_class_of_links_and_pipes_is_graded_with_reasons_and_grade_sh_exits_0(tmp_path):
    """The whole run: every such hand-in is a ``failed`` row with its reason, exit status 0
    (no kernel starts: nothing of theirs is run, so no sandbox is needed for this)."""
    import csv

    _refusals(tmp_path)
    proc = subprocess.run(
        ["bash", str(ROOT / "autograder" / "grade.sh"), str(tmp_path / "subs"), "--lab", LAB,
         "-j", "2", "--compile-cache", "off", "--unsandboxed", "--out", str(tmp_path / "out"),
         "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "out" / f"grades-{LAB}.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"link_solutions", "link_zero", "fifo", "folder", "link_dangling"}
    assert all(r["status"] == "failed" and r["total"] == "0" for r in rows.values()), rows
    assert "symbolic link" in rows["link_solutions"]["reason"], rows["link_solutions"]


@pytest.mark.timeout(60)
def test_nothing_but_the_notebook_of_a_private_source_reaches_the_kernel(tmp_path, monkeypatch):
    """Round 4: an editor backup (``lab01_basics.ipynb.bak``) beside the private source's
    notebook was mounted into the kernel's working folder and printed on the feedback page.
    The kernel is shown no file of ``--source``: the lab's data files come from the released
    lab (what students downloaded), regular files only."""
    from autograder import runner

    source = tmp_path / "private"
    (source / LAB).mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / LAB / f"{LAB}.ipynb", source / LAB)
    for name in (f"{LAB}.ipynb.bak", "answers.txt", "hidden_tests.py"):
        (source / LAB / name).write_text("SECRET")
    release = tmp_path / "labs"
    (release / LAB).mkdir(parents=True)
    shutil.copy(ROOT / "labs" / LAB / f"{LAB}.ipynb", release / LAB)
    (release / LAB / "data.csv").write_text("x\n1\n")
    (release / LAB / "link.csv").symlink_to(source / LAB / "answers.txt")
    seen = {}

    def fake_manager(iso, **kw):
        seen.update(kw["extra_ro"])
        raise RuntimeError("no kernel in this test")

    monkeypatch.setattr(sandbox, "make_kernel_manager", fake_manager)
    shutil.copy(ROOT / "labs" / LAB / f"{LAB}.ipynb", tmp_path / "sub.ipynb")
    cfg = {"iso": {"mode": "bwrap-user"}, "source": str(source), "release": str(release),
           "limits": {}, "ipc": str(tmp_path / "ipc"), "timeout": 60, "setup_timeout": 60,
           "wall": 600, "grace": 5, "keep_output": 1 << 20, "max_output": 1 << 20,
           "max_message": 1 << 20}
    job = runner.Job(0, "alice", LAB, str(tmp_path / "sub.ipynb"), str(tmp_path / "work"))
    assert runner.grade_one(job, cfg, {})["status"] == "error"  # the fake manager
    assert seen, "the kernel's mounts were not seen"
    assert not [s for s in seen if Path(s).resolve().is_relative_to(source.resolve())], seen
    cwd = f"/home/student/{LAB}"
    data = {d: s for s, d in seen.items() if d.startswith(cwd + "/")}
    assert set(data) == {f"{cwd}/data.csv"}, seen


def _stream(text: str, name: str = "stdout") -> dict:
    return {"msg_type": "stream", "header": {"msg_type": "stream"}, "parent_header": {},
            "metadata": {}, "content": {"name": name, "text": text}}


def _client():
    from nbformat.v4 import new_notebook

    from autograder import execute

    client = execute.GradingClient(new_notebook(), None, timeout=60, setup_timeout=60,
                                   keep_output_bytes=1 << 20, max_output_bytes=64 << 20,
                                   interrupt_grace=5, reap_uid=None)
    client.reset_execution_trackers()
    client.clear_before_next_output = False  # (async_execute_cell sets it)
    return client


def test_one_output_budget_per_submission_bounds_what_is_kept_whatever_the_cells():
    """Round 4: 300 cells of 1 MiB each were all kept (a 957 MB worker, a 304 MB
    graded.ipynb; 1900 cells: MemoryError, "the grader failed"). Per submission, what is kept
    is bounded in characters and in outputs; the rest is counted, the submission is graded
    with the reason, and a receipt (the referee's sign) still gets through."""
    from autograder import execute
    from autograder.referee import RECEIPT

    client = _client()
    mib = "x" * (1 << 20)
    cells = []
    for k in range(40):
        client._reset_cell()
        outs: list = []
        client.output(outs, _stream(mib), None, k)
        client.output(outs, _stream(f"\n{RECEIPT} test_{k} {'0' * 64} ok\n"), None, k)
        cells.append(outs)
    kept = sum(len(o.get("text", "")) for outs in cells for o in outs)
    assert kept <= execute.SUBMISSION_KEEP_CHARS + 40 * 200, kept
    assert all(f"{RECEIPT} test_{k} " in "".join(o.get("text", "") for o in outs)
               for k, outs in enumerate(cells))
    assert "output" in client.report.output_budget and "MiB" in client.report.output_budget

    client = _client()  # a flood of tiny outputs: one output of each stream, not a million
    client._reset_cell()
    outs = []
    for i in range(20_000):
        client.output(outs, _stream(f"{i}\n", "stderr" if i % 1000 == 0 else "stdout"), None, 0)
    assert len(outs) <= 60, len(outs)
    displays = []
    for _ in range(2 * execute.SUBMISSION_OUTPUTS):
        client.output(displays, {"msg_type": "display_data", "header": {"msg_type": "display_data"},
                                 "parent_header": {},
                                 "metadata": {}, "content": {"data": {"text/plain": "."},
                                                             "metadata": {}}}, None, 1)
    assert len(displays) <= execute.SUBMISSION_OUTPUTS, len(displays)


def test_the_default_j_is_what_the_slots_memory_allows():
    """Round 4: ``-j`` assumed 2 GiB a slot while a slot's cgroup allows 6 GiB (and the
    worker was outside it): 8 slots on a 16 GiB machine could ask for 48 GiB. The rule: one
    slot per usable core, and no more slots than the grader's memory (the machine's, or its
    own cgroup's limit if lower) holds slots' allowances (``Limits.slot_memory_bytes``,
    kernel and worker together)."""
    from autograder import grade

    slot = sandbox.Limits().slot_memory_bytes
    assert grade.default_jobs(cores=8, memory=16 << 30) == 16 * (1 << 30) // slot == 2
    assert grade.default_jobs(cores=2, memory=256 << 30) == 2
    assert grade.default_jobs(cores=8, memory=1 << 30) == 1  # never 0
    assert grade.default_jobs(cores=64, memory=64 << 30, slot_memory=4 << 30) == 16
    assert 1 <= grade.default_jobs() <= grade.usable_cores()


@pytest.mark.timeout(120)
def test_the_grading_worker_runs_inside_its_slots_cgroup_and_survives_its_clean_up(tmp_path):
    """Round 4: the worker, which keeps a submission's output, ran outside the slot's limits.
    It is now started inside the slot's cgroup (the slot's memory bounds kernel and worker
    together), and the clean-up after each submission kills everything in it but the worker."""
    from autograder import cgroups, runner

    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    made, why = cgroups.make_slot_cgroups(1, cpus=1.0, memory=2 << 30, processes=64,
                                          name=f"minickpt-test-{os.getpid()}")
    if not made:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)
    slot = None
    try:
        cfg = {"iso": {"mode": "none"}, "limits": {}}
        slot = runner.Slot(0, None, cfg, tmp_path, made[0])
        slot.start()
        worker = slot.proc.pid
        other = subprocess.Popen(made[0].join_command(["sleep", "60"]))
        for _ in range(100):
            if worker in made[0].pids() and other.pid in made[0].pids():
                break
            import time
            time.sleep(0.05)
        assert worker in made[0].pids() and other.pid in made[0].pids(), made[0].pids()
        made[0].kill(spare={worker})
        assert other.wait(timeout=10) != 0
        assert slot.proc.poll() is None, "the worker was killed with the submission"
    finally:
        if slot is not None:
            slot.close()
        cgroups.remove_all(made)
