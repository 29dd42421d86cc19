"""The judge's fork servers (autograder/judge/zygote.py): a child forked from a server that
imported JAX once behaves as a process started afresh — its descriptors, environment, folder,
output and exit code — and a server that ends takes its children with it and says so."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from autograder import ROOT
from autograder.judge.zygote import TRUSTED_PRELOAD, Zygote
from minickpt.launch import launch

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    z = Zygote(str(tmp_path), env=env, preload=TRUSTED_PRELOAD, timeout=60)
    yield z
    z.close()


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_child_gets_its_argv_env_folder_descriptors_and_exit_code(server, tmp_path):
    r, w = os.pipe()
    os.write(w, b"secret")
    os.close(w)
    work = tmp_path / "work"
    work.mkdir()
    script = _script(tmp_path, f"""
        import os, sys
        print("argv", sys.argv[1:], "cwd", os.getcwd() == {str(work)!r})
        print("env", os.environ.get("ONLY_HERE"), "HOME" in os.environ)
        print("fd", os.read({r}, 100).decode(), flush=True)
        print("to stderr", file=sys.stderr)
        sys.exit(3)
        """)
    p = server.run([script, "a", "b"], {"ONLY_HERE": "yes", "PATH": os.environ["PATH"]},
                   str(work), (r,))
    os.close(r)
    out = p.stdout.read()
    assert p.wait(30) == 3 and p.poll() == 3
    assert "argv ['a', 'b'] cwd True" in out and "env yes False" in out, out
    assert "fd secret" in out and "to stderr" in out, out


def test_a_child_that_raises_exits_1_with_its_traceback_and_one_killed_says_minus_9(
        server, tmp_path):
    bad = _script(tmp_path, "raise KeyError('nope')\n")
    p = server.run([bad], {}, str(tmp_path))
    assert p.wait(30) == 1 and "KeyError: 'nope'" in p.stdout.read()
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    p = server.run([str(slow)], {}, str(tmp_path))
    assert p.stdout.readline().strip() == "up"
    assert os.getpgid(p.pid) == p.pid and p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)  # as launch ends a process: its group
    assert p.wait(30) == -9


def test_launch_through_a_server_reports_as_with_new_interpreters(server, tmp_path):
    script = _script(tmp_path, """
        import os, sys
        me = int(os.environ["MINICKPT_PROCESS_ID"])
        print("process", me, "of", os.environ["MINICKPT_NUM_PROCESSES"], flush=True)
        sys.exit(0 if me != 1 else 5)
        """)
    res = launch([script], 3, timeout_s=60, grace_s=5, cwd=str(tmp_path), spawn=server.run)
    assert res.returncodes == [0, 5, 0] and res.first_failure == 1
    assert any("process 1 of 3" in line for line in res.outputs[1])


def test_a_server_that_ends_takes_its_children_and_refuses_more(server, tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    p = server.run([str(slow)], {}, str(tmp_path))
    assert p.stdout.readline().strip() == "up"
    server.proc.kill()
    assert p.wait(30) == -9
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its parent-death signal ended it for real
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child outlived its server")
    assert not server.alive()
    with pytest.raises(ChildProcessError, match="ended"):
        server.run([str(slow)], {}, str(tmp_path))


def test_a_forked_worker_serves_the_students_functions_and_ends_when_told(tmp_path):
    from autograder.judge.session import StudentWorker

    z = Zygote(str(tmp_path), timeout=60)  # a student's worker's server (here unsandboxed)
    try:
        workers = []
        for k in range(2):
            w = StudentWorker("lab01_basics", [f"def f(x):\n    return x + {k}\n"],
                              str(tmp_path), zygote=z)
            workers.append(w)
            assert w.start("import numpy as np", ["f"])["f"](40) == 40 + k
            assert w.alive()
        workers[0].close()
        assert workers[0].proc.wait(30) in (0, -9) and not workers[0].alive()  # hung up on
        assert workers[1].functions["f"](1) == 2  # its sibling serves on
    finally:
        for w in workers:
            w.close()
        z.close()


def test_launch_starts_new_interpreters_once_the_server_cannot(server, tmp_path):
    script = _script(tmp_path, "import os\nprint('me', os.environ['MINICKPT_PROCESS_ID'])\n")
    calls = []

    def spawn(*args):
        calls.append(args)
        server.close()  # ended before the job (a drill's clean-up of the slot's processes)
        return server.run(*args)

    res = launch([script], 3, timeout_s=60, grace_s=5, cwd=str(tmp_path), spawn=spawn)
    assert res.returncodes == [0, 0, 0] and len(calls) == 1
    assert [any(f"me {i}" in line for line in res.outputs[i]) for i in range(3)] == [True] * 3
