"""Lab 4's test processes under the grader's judge (issue 47).

A test of lab 4 runs its body in the JAX processes of one job (:func:`.lab4.run_processes`).
In a notebook each process runs the student's task cells from their source, then the body.
Under the judge (``autograder/judge``) the body is a test's text, hidden lines included, and
the reports are signed with a key: neither may reach the student's code. So there each JAX
process is a trusted one (the full minickpt, outside the sandbox): it runs the body, holds the
key and reports to the judge, and it starts a student's worker of its own (the judge's
``StudentWorker``, in the submission's sandbox, as the judge said: :func:`.processes.student_worker`),
which holds the student's cells' definitions and nothing else. The lab's task functions are
proxies to that worker, plugged into minickpt there (every task of the lab, as the judge
plugs them in its own process). What a test reads (the reports, the files on disk) was made
by the trusted processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..launch import key_pipe, lost_port_race

_JUDGED = '''\
import json, os, sys


''' + "{pin}" + '''from minickpt.launch import signer as _signer
_send, _ = _signer({key_env!r})  # before the student's worker starts: it never sees the key
del _signer
_spec = {spec!r}
sys.path.append(_spec.pop("path"))
from minickpt.multihost.process import ENV_NUM_PROCESSES as _N, ENV_PROCESS_ID as _ID
for _k, _fd in enumerate(_spec.pop("fds", None) or ()):  # workers the judge forked: this one's
    if _k == int(os.environ[_ID]):
        _spec["fd"] = _fd
    else:
        os.close(_fd)
_spec["setup"] += {identity!r}.format(int(os.environ[_ID]), int(os.environ[_N]))
from autograder.judge.session import worker_in_process as _worker_in_process
_started = {{}}
try:  # in this thread: the sandbox's worker dies with the thread that started it
    _started["worker"] = _worker_in_process(_spec)
except BaseException as _e:  # (a student's code that does not load: its tasks are not plugged in)
    _started["error"] = _e
import minickpt.multihost.process as _mhp
import minickpt.multihost.sync as _mhs
_mhp.initialize()
{imports}
from minickpt.labkit.lab4_judged import missing_task as _missing_task, whose as _whose
ME, N = jax.process_index(), jax.process_count()
directory = sys.argv[1]
_results = {{}}


def report(**values):
    """Send values (JSON) back to the test cell, which reads them per process."""
    _results.update(values)


_error, _test = None, {{}}
try:  # the body in the harness's names, the student's task functions (proxies) beside them
    _fns = dict(_started["worker"][1]) if "worker" in _started else {{}}
    _plugs = [_missing_task(_n, _t) if _n not in _fns else  # (the test's own: as they are)
              _fns[_n] if _n in {names!r} else _whose(_fns[_n], _n, _t) for _n, _t in {tasks!r}]
    _test = {{_k: _v for _k, _v in globals().items() if not _k.startswith("_")}}
    _test.update({{_n: _fns[_n] for _n in {names!r} if _n in _fns}})
    for _n in {names!r}:
        if _n not in _fns:
            _test[_n] = _missing_task(_n, dict({tasks!r})[_n])
    with plugged_in(*_plugs):
        exec(compile({body!r}, "<the test>", "exec"), _test)
except BaseException as _e:
    _error = {{"type": type(_e).__name__, "message": str(_e),
              "kinds": [_c.__name__ for _c in type(_e).__mro__]}}
_send({{"results": _results, "error": _error}})  # one write: no log line splits it
try:  # process 0 hosts the coordination service: nobody leaves before everybody is done
    _mhs.default_sync().exchange("lab4-done", None, float(_test.get("DONE_WAIT", 20.0)),
                                 "the end of the test")
    if ME == 0:
        time.sleep(0.5)  # while the others read the barrier's values
except Exception:
    pass
_mhp.hard_exit(0)  # no jax.distributed.shutdown(): a failed peer would make it wait
'''
"""A judged process's program (the test's body and the key stay in it; the student's code
is in its worker)."""

_IDENTITY = """
jax.process_index = lambda backend=None: {0}
jax.process_count = lambda backend=None: {1}
"""
"""The worker's view of the job: in a notebook the student's code runs in JAX process ``k`` of
``n`` and asks ``jax.process_index()``; its worker under the judge joins no job (no backend,
no threads), so these two answer as that process would."""


TIME_SCALE = 3.0
"""A judged job may run this many times the limit its test names (``timeout_s``, 50 s by
default) before it counts as hung: the grader's machine runs several slots at once, and under
that load the primary (which commits, and hosts the coordinator) came last, past 50 s. The
limit only ends a job that hangs; a student's own run keeps the test's."""


def missing_task(name: str, task: str) -> Callable[..., Any]:
    """What stands for a task the student's cells do not define (as the judge's plug does)."""
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"Task {task}: {name} is not plugged in: define {name} in "
                                  f"task {task}'s cell")

    return whose(missing, name, task)


def whose(fn: Callable[..., Any], name: str, task: str) -> Callable[..., Any]:
    """``fn`` as minickpt calls it in a test of another task: an error it raises says whose
    function it was ("this test runs your Task 4.1 agree_on_step, which raised ..."), as the
    graded build's plug points say it in the judge's own process. A test's own functions are
    plugged in as they are: its checks read their errors' text (cut at 300 characters)."""
    def plugged(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            _say_whose(e, task, name)
            raise

    plugged.__name__ = plugged.__qualname__ = name
    return plugged


def _say_whose(e: BaseException, task: str, name: str) -> None:
    if getattr(e, "_minickpt_whose", None):  # raised in a task that one of theirs called
        return
    try:
        e._minickpt_whose = task  # type: ignore[attr-defined]
    except AttributeError:
        return
    said = f"this test runs your Task {task} {name}, which raised {type(e).__name__}: "
    if isinstance(e, OSError) and e.strerror is not None:
        e.strerror = said + str(e.strerror)
    elif len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (said + e.args[0],)
    elif not e.args:
        e.args = (said.rstrip(": "),)


def run_judged(spec: Mapping[str, Any], body: str, names: Sequence[str], *, processes: int,
               devices: int, directory: str | None, timeout_s: float, pin: str, imports: str,
               key_env: str) -> tuple[Any, bytes]:
    """:func:`.lab4.run_processes` under the judge: ``spec`` from
    :func:`.processes.student_worker`; ``body`` with its values set, compiled already; ``pin``,
    ``imports`` and ``key_env``: lab 4's first lines, setup names and key variable. Returns
    the launch's result and the key its reports are signed with."""
    import secrets

    from .plugging import reference_functions
    from .temporaries import tempdir

    tasks = [(fn.__name__, tid) for tid, fns in reference_functions().items()
             if tid.split(".")[0] == "4" for fn in fns]
    # the worker's setup: the names every process of the job gives the student's code outside
    # the judge (lab 4's setup cell without its print of the devices: no JAX backend, and its
    # threads, in each of the job's 4 workers; the slot's cgroup counts every thread)
    spec = {**spec, "setup": imports}
    work = spec.pop("private")  # outside the sandbox's view: the test's text is written here
    fork = spec.pop("fork", None)  # the judge's fork servers, when it has them
    spawn = spec.pop("spawn", None)
    key = secrets.token_bytes(32)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        made = []

        def script(spec: Mapping[str, Any]) -> str:
            """The job's program, with ``spec`` (this launch's workers) in it."""
            path = os.path.join(work, f"lab4_process_{len(made)}.py")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "w", encoding="utf-8") as f:
                f.write(_JUDGED.format(pin=pin, key_env=key_env, spec=dict(spec),
                                       imports=imports, identity=_IDENTITY, tasks=tasks,
                                       names=list(names), body=body))
            made.append(path)
            return path

        if directory is None:  # (under the judge: in the test's folder, the worker's too)
            directory = stack.enter_context(tempdir())
        for attempt in range(3):  # (a coordinator that lost the race for its port: again)
            res = _launch_once(script, directory, spec, fork, key, processes=processes,
                               devices=devices, timeout_s=timeout_s, key_env=key_env,
                               spawn=spawn)
            if attempt == 2 or not lost_port_race(res):
                break
    return res, key


def _launch_once(script: Callable[[Mapping[str, Any]], str], directory: str,
                 spec: Mapping[str, Any], fork: Callable[[], Any] | None, key: bytes, *,
                 processes: int, devices: int, timeout_s: float, key_env: str,
                 spawn: Callable[..., Any] | None = None) -> Any:
    """One launch of the job; with a fork server, each process gets a worker forked for it
    (a fork, not a second of imports), which is ended with the job."""
    from ..launch import launch

    forked: list[Any] = []
    with contextlib.ExitStack() as stack:
        if fork is not None:
            stack.callback(_end_forked, forked)
            try:
                for _ in range(processes):
                    forked.append(fork())
            except Exception:  # the server ended: each process starts its own worker
                _end_forked(forked)
            if forked:
                spec = {**spec, "fds": [s.fileno() for s, _ in forked]}
        with key_pipe(key, processes) as r:  # (a job started again drains a new one)
            env = {"JAX_PLATFORMS": "cpu", key_env: str(r)}
            # (cwd: where a relative name resolves, for the worker's calls too: the job's
            # folder, where the judge lets the worker name things; the script stays apart)
            return launch([script(spec), directory], processes, devices_per_process=devices,
                          timeout_s=timeout_s * TIME_SCALE, grace_s=timeout_s, cwd=directory,
                          env=env, pass_fds=(r, *(s.fileno() for s, _ in forked)),
                          port_retries=0, spawn=spawn)


def _end_forked(forked: list[Any]) -> None:
    for sock, proc in forked:
        sock.close()
        proc.kill()
    forked.clear()
