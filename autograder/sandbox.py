"""Isolation of one submission's kernel: Linux namespaces (bubblewrap), a dedicated uid, rlimits.

The grader itself runs outside; only the Jupyter kernel that executes the student's code runs in
the sandbox, and talks to the grader over ZMQ ``ipc`` sockets (unix sockets in a folder the
sandbox's uid owns: TCP cannot cross the sandbox's own network namespace). Inside, the kernel

* sees ``/usr``, ``/etc``, the Python interpreter and its environment, and the ``minickpt``
  package, all read-only; never the repository's ``solutions/``, the grader's work folder
  (other students' notebooks, the graded notebooks with their hidden tests) or its output;
* writes only to its own size-capped tmpfs folders (``/tmp``, ``/dev/shm`` and its working
  folder); the folder of its sockets is closed to it once they exist;
* has no network: its own network namespace holds only ``lo`` (localhost servers of the grading
  machine are out of reach too); its own pid, ipc and uts namespaces;
* runs as a uid that only this slot uses (a run takes one per parallel slot, under a lock), with
  no capabilities and ``no_new_privs``, so the process limit counts exactly its processes;
* makes no keyring call and no new user namespace (a seccomp filter:
  :mod:`autograder.seccomp`), and a slot's uid starts each run with empty keyrings, so
  nothing passes from one submission graded in a slot to the next;
* imports the grader's own ``minickpt``, bound where its environment imports it from (an
  editable install of another checkout points elsewhere: :func:`package_binds`);
* is bounded by rlimits: address space per process, CPU seconds, processes (threads count),
  file size, open files, no core dumps; and, as a whole, by its slot's cgroup (a share of the
  cores, memory, tasks: :mod:`autograder.cgroups`). Wall time and output size are bounded by
  the executor.

Run as root, bubblewrap keeps every capability and its user namespace would map the sandbox to
root, so the privileges are dropped inside with ``setpriv`` (then ``prlimit``). As an ordinary
user, bubblewrap uses an unprivileged user namespace; there is no dedicated uid then, so the
process limit is left out. Where bubblewrap (or setpriv/prlimit) is missing or does not work,
:func:`probe` says exactly what is lost and why (the real cause: an interpreter the sandbox
does not show, a package it cannot import), and grade.sh refuses to grade unless asked
(``--unsandboxed``, ``MINICKPT_SANDBOX=off``), then warns loudly and marks every result.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UID_BASE = 64200
"""First uid of the range the sandboxes use (one per parallel slot); ``--sandbox-uid`` moves it."""
UID_RANGE = 1000
LOCK_DIR = Path(tempfile.gettempdir())
PASS_ENV_PREFIXES = ("JAX_", "XLA_", "CUDA_", "NVIDIA_", "TPU_", "OMP_NUM_THREADS")
"""Environment variables that reach the kernel (everything else is cleared)."""


@dataclass(frozen=True)
class Limits:
    """What one submission's kernel may use. Defaults fit a lab on a laptop with room to spare."""

    memory_bytes: int = 4 << 30      # RLIMIT_AS, per process (JAX on CPU peaks near 1.7 GiB)
    cpu_seconds: int = 1800          # RLIMIT_CPU: the kernel's CPU time over its whole life
    processes: int = 256             # RLIMIT_NPROC of the slot's uid; threads count (JAX ~25)
    file_bytes: int = 256 << 20      # RLIMIT_FSIZE: the largest file it may write
    open_files: int = 1024           # RLIMIT_NOFILE
    tmp_bytes: int = 256 << 20       # size of its /tmp, /dev/shm and working folder (tmpfs: RAM)
    slot_memory_bytes: int = 6 << 30  # memory of all its processes together (its cgroup), no swap
    slot_processes: int = 1024       # pids.max of its cgroup: the sandbox's (`processes`) and the
    #                                  judge's: its worker, lab 4's 4 trusted JAX processes (~30
    #                                  threads each) and their 4 student workers (~250 measured)
    cpus: float = 0.0                # cores of its cgroup; 0: the machine's cores / parallel slots

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Isolation:
    """What this machine offers, found once per run by :func:`probe`."""

    mode: str                                  # "bwrap-root", "bwrap-user" or "none"
    bwrap: str | None = None
    setpriv: str | None = None
    prlimit: str | None = None
    lost: tuple[str, ...] = ()                 # what does not hold, said for a person
    detail: str = ""                           # why (the probe's error)

    @property
    def sandboxed(self) -> bool:
        return self.mode != "none"

    @property
    def requested(self) -> bool:
        """No sandbox because the instructor asked for none (``--unsandboxed``,
        ``MINICKPT_SANDBOX=off``), not because it failed."""
        return self.detail.startswith(ASKED)

    @property
    def marker(self) -> str:
        """The value of the ``isolation`` column: ``sandbox`` when everything holds."""
        if not self.lost:
            return "sandbox"
        asked = f"NONE ({self.detail}): " if self.requested else "NONE: "
        return ("partial: " if self.sandboxed else asked) + "; ".join(self.lost)

    def warning(self) -> str | None:
        """A loud warning for the terminal, or None when every mechanism works."""
        if not self.lost:
            return None
        bar = "!" * 78
        lines = [bar, "!! grade: STUDENT CODE IS NOT FULLY ISOLATED ON THIS MACHINE",
                 *[f"!!   - {item}" for item in self.lost]]
        if self.detail:
            lines.append(f"!!   why: {self.detail}")
        lines += [f"!! fix: {self.fix}", "!! Every result is marked in the `isolation` column.",
                  bar]
        return "\n".join(lines)

    @property
    def fix(self) -> str:
        """What to do about :attr:`detail` (the probe's real cause, not a generic advice)."""
        d = self.detail
        if self.requested:
            return "unset MINICKPT_SANDBOX (and drop --unsandboxed) to grade in the sandbox"
        if "not installed" in d or "setpriv" in d:
            return "sudo bash scripts/install-sandbox.sh   (apt-get install bubblewrap util-linux)"
        if "not visible inside the sandbox" in d or "cannot import" in d:
            return ("make the course environment a real folder (not inside a folder the sandbox "
                    "hides: /home, /root, /tmp, /run, /var, /mnt, /srv, /opt are empty there) or "
                    "report the paths above as a bug of autograder/sandbox.py")
        if "cgroup" in d:
            return "run grade.sh as root on a machine with cgroups (v2, or v1's cpu, memory, pids)"
        if self.sandboxed:
            return "run grade.sh as root for a uid per slot (the process limit)"
        return ("run `python -m autograder.sandbox` to see what fails; bubblewrap needs "
                "unprivileged user namespaces, or root")


# ---------------------------------------------------------------------------------------
# probing the machine
# ---------------------------------------------------------------------------------------
NO_SANDBOX_LOST = ("the kernel can read the solutions, the work folder and other students' work",
                   "it can write anywhere the grader can", "it has the network",
                   "no process limit")
NO_PRLIMIT = "no limits on memory, CPU time, file size (prlimit is missing)"


ASKED = "unsandboxed on request"


def unsandboxed(how: str) -> Isolation:
    """No sandbox because the instructor asked (``how``: the flag or the variable)."""
    return _unsandboxed(f"{ASKED}: {how}")


def _unsandboxed(detail: str) -> Isolation:
    """No bubblewrap: still the rlimits, when prlimit is there (and the slots' cgroups)."""
    prlimit = shutil.which("prlimit") if sys.platform.startswith("linux") else None
    lost = NO_SANDBOX_LOST + (() if prlimit else (NO_PRLIMIT,)) + _cgroups_lost()
    return Isolation("none", prlimit=prlimit, lost=lost, detail=detail)


def _cgroups_lost() -> tuple[str, ...]:
    """() when a cgroup per slot can be made here, else what is lost (and why)."""
    if not sys.platform.startswith("linux"):
        return (f"{NO_CGROUP} (not Linux)",)
    from . import cgroups

    made, why = cgroups.make_slot_cgroups(1, cpus=1.0, memory=1 << 30, processes=64,
                                          name=f"minickpt-probe-{os.getpid()}-{time.monotonic_ns()}")
    cgroups.remove_all(made)
    return (f"{NO_CGROUP} ({why})",) if why else ()


NO_CGROUP = ("no cgroup per submission: its CPU share, memory and processes are bounded per "
             "process only (a submission that forks spinners slows its neighbours)")


def probe(python: str = sys.executable) -> Isolation:
    """Find bubblewrap, setpriv and prlimit and check that a sandboxed Python really starts.

    Set ``MINICKPT_SANDBOX=off`` to grade without a sandbox on purpose (still marked).
    """
    if os.environ.get("MINICKPT_SANDBOX", "").lower() in ("off", "0", "no", "none"):
        return unsandboxed("MINICKPT_SANDBOX=off")
    if not sys.platform.startswith("linux"):
        return _unsandboxed(f"not Linux ({sys.platform})")
    bwrap, setpriv, prlimit = (shutil.which(t) for t in ("bwrap", "setpriv", "prlimit"))
    bwrap = os.environ.get("MINICKPT_BWRAP") or bwrap  # tests: a bubblewrap that fails
    if bwrap is None:
        return _unsandboxed("bubblewrap (bwrap) is not installed")
    root = os.geteuid() == 0
    lost: list[str] = []
    if root and setpriv is None:
        return _unsandboxed("setpriv (util-linux) is missing: cannot drop root inside bwrap")
    if prlimit is None:
        lost.append(NO_PRLIMIT)
    if not root:
        lost.append("no process limit (a dedicated uid needs root)")
    lost += _cgroups_lost()
    iso = Isolation("bwrap-root" if root else "bwrap-user", bwrap, setpriv, prlimit, tuple(lost))
    # the probe's uid is locked like a slot's: two grade.sh started side by side (the shards
    # of a job array on one machine) once probed with one fixed uid, and each one's clean-up
    # killed the other's probe, which then graded without a sandbox
    inside, paths = sandbox_python(python), python_paths(python)
    with SlotUids(1) as slot, tempfile.TemporaryDirectory(prefix="minickpt-probe-") as tmp:
        uid = slot.uids[0]
        cmd = kernel_command(iso, [inside, "-c", PROBE_CODE], uid=uid,
                             cwd="/tmp", ipc_dir=tmp, read_only=paths,
                             limits=Limits(), env={}, extra_ro=package_binds(python))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            err = f"{type(e).__name__}: {e}"
        if proc is None or proc.returncode != 0 or proc.stdout.strip() != "ok":
            if proc is not None:
                err = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                err = err[0]
            return _unsandboxed(_probe_cause(err, inside, paths))
    return iso


PROBE_CODE = "import ipykernel, minickpt, numpy; print('ok')"
"""What the probe runs in the sandbox: the kernel's own imports, not merely ``python``."""


def _probe_cause(err: str, python: str, paths: list[str]) -> str:
    """The probe's error said as its cause: which path the sandbox did not show."""
    shown = ", ".join(paths) or "nothing beyond /usr"
    if "No module named 'minickpt'" in err:
        theirs, mine = env_package(python), grader_package()
        if theirs is None:
            return (f"the environment of {python} has no minickpt installed (the kernel imports "
                    f"it from there; `pip install -e {os.path.dirname(mine or '.')}`)")
        if theirs != mine:
            return (f"the environment of {python} imports minickpt from {theirs} (an editable "
                    f"install of another checkout?), not this checkout's {mine}, and the "
                    f"sandbox could not show it there ({err})")
    if "failed to execute" in err or "No such file" in err or "execvp" in err:
        return (f"the Python interpreter {python} is not visible inside the sandbox (it shows "
                f"/usr, /etc and {shown}; the error: {err})")
    if "ModuleNotFoundError" in err or "ImportError" in err:
        return (f"the sandboxed Python {python} cannot import what the kernel needs ({err}); "
                f"its packages live outside what the sandbox shows ({shown})")
    return f"bubblewrap does not work here: {err}"


def sandbox_python(python: str = sys.executable) -> str:
    """The interpreter as the sandbox runs it: the same ``bin/python`` of the same
    environment, with the environment's folder resolved (``.venv`` may be a link to a
    virtual environment elsewhere, which the sandbox shows at its real place). Not the
    fully resolved file: a venv's ``bin/python`` links to the base interpreter, and Python
    finds its environment (``pyvenv.cfg``) from the path it was started by."""
    env = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(python))))
    here = os.path.join(env, os.path.basename(os.path.dirname(os.path.abspath(python))),
                        os.path.basename(python))
    return here if os.path.exists(here) else os.path.realpath(python)


def python_paths(python: str = sys.executable) -> list[str]:
    """Folders the kernel's interpreter needs, read-only: its environment (at its real place),
    the base installation, and the ``minickpt`` package (an editable install points into the
    repository: only that folder is bound, never the repository itself). Where the
    environment imports minickpt from elsewhere, :func:`package_binds` binds this one there."""
    inside = sandbox_python(python)
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
             os.path.dirname(os.path.dirname(inside)),
             os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    mine = grader_package()
    if mine is not None and env_package(python) in (None, mine):
        paths.add(mine)
    system = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin")
    keep = sorted(p for p in paths if not any(p == s or p.startswith(s + "/") for s in system))
    # drop folders inside another kept folder
    return [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep)]


def grader_package() -> str | None:
    """The ``minickpt`` folder the grader itself runs (its tests, its cache key)."""
    try:
        import minickpt
    except ImportError:  # pragma: no cover - the grader always has it
        return None
    return os.path.dirname(os.path.realpath(minickpt.__file__))


FIND_PACKAGE = ("import importlib.util as u; s = u.find_spec('minickpt'); "
                "print((s.submodule_search_locations or [''])[0] if s else '')")


def env_package(python: str = sys.executable) -> str | None:
    """The ``minickpt`` folder the kernel's interpreter imports, asked of that interpreter
    with the kernel's environment (no PYTHONPATH, no user site): an editable install of
    another checkout points elsewhere than the grader's. None: it imports none."""
    return _env_package(sandbox_python(python))


_FOUND: dict[str, str | None] = {}


def _env_package(python: str) -> str | None:
    if python not in _FOUND:
        try:
            proc = subprocess.run([python, "-c", FIND_PACKAGE], capture_output=True, text=True,
                                  timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin",
                                                            "PYTHONNOUSERSITE": "1",
                                                            "HOME": "/nonexistent"})
            found = proc.stdout.strip() if proc.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            found = ""
        _FOUND[python] = os.path.realpath(found) if found else None
    return _FOUND[python]


def package_binds(python: str = sys.executable) -> dict[str, str]:
    """{grader's minickpt: where the environment imports it} when the two differ (the
    environment is an editable install of another checkout, or holds an installed copy): the
    kernel then runs the very package the grader grades with, at the place its environment
    looks. {} when they agree or the environment has none."""
    mine, theirs = grader_package(), env_package(python)
    return {mine: theirs} if mine and theirs and theirs != mine else {}


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------
def kernel_command(iso: Isolation, argv: list[str], *, uid: int, cwd: str, ipc_dir: str,
                   read_only: list[str], limits: Limits, env: dict[str, str],
                   extra_ro: dict[str, str] | None = None,
                   cache: tuple[str, bool] | None = None) -> list[str]:
    """``argv`` wrapped in the sandbox: bwrap (namespaces, mounts) → setpriv (as root) →
    prlimit. ``extra_ro`` binds single files (source → path inside) read-only; ``cache``
    (a folder, writable?) is the grading compilation cache, seen at
    :data:`autograder.compile_cache.IN_SANDBOX`: read-only unless this kernel fills it."""
    if not iso.sandboxed:  # no namespaces; the rlimits at least (not the process limit: our uid)
        if not iso.prlimit:
            return list(argv)
        return [iso.prlimit, f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_seconds}",
                f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}", "--core=0",
                "--", *argv]
    a: list[str] = [iso.bwrap or "bwrap", "--die-with-parent", "--new-session",
                    "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                    "--unshare-cgroup-try", "--hostname", "sandbox"]
    if iso.mode == "bwrap-user":
        a += ["--unshare-user", "--cap-drop", "ALL"]
    from . import seccomp

    filtered = seccomp.supported()
    if filtered:  # no keyrings, no new user namespaces (autograder/seccomp.py says why)
        a += ["--seccomp", str(seccomp.FD)]
    a += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "lib", "lib64", "sbin"):
        target = os.path.join("/", name)
        if os.path.islink(target):
            a += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            a += ["--ro-bind", target, target]
    a += ["--proc", "/proc", "--dev", "/dev"]
    gpus = sorted(str(p) for pat in ("nvidia*", "accel*") for p in Path("/dev").glob(pat))
    for dev in gpus:  # an accelerator stays usable (its driver reads /sys)
        a += ["--dev-bind", dev, dev]
    if gpus:
        a += ["--ro-bind", "/sys", "/sys"]
    size, small = str(limits.tmp_bytes), str(min(limits.tmp_bytes, 64 << 20))
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    a += ["--perms", "1777", "--size", small, "--tmpfs", "/dev/shm"]
    for empty in ("/root", "/home", "/run", "/var", "/mnt", "/media", "/srv", "/opt"):
        a += ["--perms", "0755", "--tmpfs", empty]
    made: set[str] = {"/", "/tmp", "/dev", "/root", "/home", "/run", "/var", "/mnt", "/media",
                      "/srv", "/opt", "/usr", "/etc"}

    def parents(path: str) -> None:
        parent = os.path.dirname(path)
        if parent in made or parent == path:
            return
        parents(parent)
        made.add(parent)
        a.extend(["--perms", "0755", "--dir", parent])

    binds = [(p, p, "--ro-bind") for p in read_only] + [(ipc_dir, ipc_dir, "--bind")]
    binds += [(src, dst, "--ro-bind") for src, dst in (extra_ro or {}).items()]
    if cache is not None:
        from .compile_cache import IN_SANDBOX

        binds.append((cache[0], IN_SANDBOX, "--bind" if cache[1] else "--ro-bind"))
    inside = [b for b in binds if b[1].startswith(cwd.rstrip("/") + "/")]
    for src, dst, how in [b for b in binds if b not in inside]:
        parents(dst)
        a += [how, src, dst]
    if cwd not in made:  # the working folder: an empty tmpfs, then the lab's data files
        parents(cwd)
        a += ["--perms", "1777", "--size", small, "--tmpfs", cwd]
        made.add(cwd)
    for src, dst, how in inside:
        parents(dst)
        a += [how, src, dst]
    a += ["--chdir", cwd, "--clearenv"]
    base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONNOUSERSITE": "1", "USER": "student"}
    for k, v in {**base_env, **env}.items():
        a += ["--setenv", k, v]
    a.append("--")
    if iso.mode == "bwrap-root":
        a += [iso.setpriv or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
              "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    if iso.prlimit:
        a += [iso.prlimit, f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_seconds}",
              f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}", "--core=0"]
        if iso.mode == "bwrap-root":
            a.append(f"--nproc={limits.processes}")
        a.append("--")
    return seccomp.wrap(a + list(argv)) if filtered else a + list(argv)


SHARED_CACHE_ENV = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE_", "JAX_ENABLE_COMPILATION_CACHE",
                    "JAX_RAISE_PERSISTENT_CACHE_ERRORS", "JAX_EXPLAIN_CACHE_MISSES")
"""JAX's persistent compilation cache and what steers it: a folder every process that has it
set reads compiled programs from and writes them to. The test suite shares one
(scripts/test.sh); a submission must never get it: what one submission wrote there, the next
one's tests (and their fresh subprocesses) would load and run as their own compiled code.
The grader's own cache (:mod:`autograder.compile_cache`: filled by the reference, read-only
to submissions) is set by the grader, never taken from its environment."""


def kernel_env(environ: dict[str, str] | None = None,
               cache: tuple[str, bool] | None = None) -> dict[str, str]:
    """The grader's environment variables that the kernel keeps (JAX/XLA/accelerator ones),
    without a shared compilation cache; with ``cache`` (its path as the kernel sees it, and
    whether this kernel fills it), the grading cache's variables."""
    from .compile_cache import cache_env

    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if k.startswith(PASS_ENV_PREFIXES) and not k.startswith(SHARED_CACHE_ENV)}
    if cache is not None:
        env.update(cache_env(cache[0], fill=cache[1]))
    return env


def without_shared_caches(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less the compilation cache's variables (an unsandboxed kernel's env)."""
    return {k: v for k, v in environ.items() if not k.startswith(SHARED_CACHE_ENV)}


# ---------------------------------------------------------------------------------------
# the processes of a sandbox uid
# ---------------------------------------------------------------------------------------
def processes_of(uid: int) -> list[tuple[int, int]]:
    """``(start time, pid)`` of every process whose real uid is ``uid``, oldest first."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                real = next((line.split()[1] for line in f if line.startswith("Uid:")), None)
            if real is None or int(real) != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] in ("Z", "X"):  # dead already: a zombie waits for its parent
                continue
            start = int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
        found.append((start, int(entry)))
    return sorted(found)


def kill_uid(uid: int, keep: int | None = None) -> int:
    """SIGKILL every process of ``uid`` except ``keep``; repeat until none is left (a fork
    bomb forks while it is being killed). Returns how many processes were killed."""
    if uid <= 0:
        raise ValueError(f"refusing to kill the processes of uid {uid}")
    killed: set[int] = set()
    for _ in range(200):
        victims = [pid for _, pid in processes_of(uid) if pid != keep]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return len(killed)


# ---------------------------------------------------------------------------------------
# every process a submission started, wherever it went (its own session, its own group)
# ---------------------------------------------------------------------------------------
def become_subreaper() -> bool:
    """Make this process the one that orphans below it are handed to (Linux
    ``PR_SET_CHILD_SUBREAPER``): a child that double-forks and calls ``setsid`` leaves its
    session and its process group, never this process's tree, so :func:`kill_descendants`
    finds it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every living (not zombie) process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] not in ("Z", "X"):
                found[int(entry)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    return found


def descendants(pid: int, spare: set[int] = frozenset()) -> list[int]:
    """Every living process below ``pid`` (not below the ``spare`` ones)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [c for c in children.get(pid, []) if c not in spare]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c in children.get(p, []) if c not in spare]
    return out


def kill_descendants(pid: int | None = None, spare: set[int] = frozenset()) -> int:
    """SIGKILL every process below ``pid`` (default: this one) until none is left, reaping
    the orphans handed to us. Returns how many were killed."""
    pid = os.getpid() if pid is None else pid
    killed: set[int] = set()
    for _ in range(200):
        victims = descendants(pid, spare)
        if not victims:
            break
        for v in victims:
            try:
                os.kill(v, signal.SIGKILL)
                killed.add(v)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
        _reap()
    _reap()
    return len(killed)


def _reap() -> None:
    while True:
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if got == 0:
            return


KEYCTL = {"x86_64": 250, "aarch64": 219}
"""The ``keyctl`` system call's number per machine."""


def clear_keyrings(uid: int) -> bool:
    """Empty the user keyrings of ``uid`` (as root: a forked child that becomes the uid does
    it, no interpreter started). The sandbox's seccomp filter denies every keyring call, so
    nothing new lands there; this clears what a run before that filter left."""
    import ctypes
    import platform

    nr = KEYCTL.get(platform.machine())
    if os.geteuid() != 0 or not sys.platform.startswith("linux") or nr is None:
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # looked up before the fork
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            # KEYCTL_CLEAR (7) of KEY_SPEC_USER_KEYRING (-4), KEY_SPEC_USER_SESSION_KEYRING (-5)
            code = 0 if all(syscall(nr, 7, ring) == 0 for ring in (-4, -5)) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# ---------------------------------------------------------------------------------------
# one uid per parallel slot, never shared with another grade.sh running at the same time
# ---------------------------------------------------------------------------------------
@dataclass
class SlotUids:
    """Takes ``n`` uids from the sandbox range under exclusive locks (released at exit, even
    after a crash: the lock dies with the process)."""

    n: int
    base: int = UID_BASE
    uids: list[int] = field(default_factory=list)
    _locks: list[Any] = field(default_factory=list)

    def __enter__(self) -> SlotUids:
        for uid in range(self.base, self.base + UID_RANGE):
            if len(self.uids) == self.n:
                break
            f = open(LOCK_DIR / f"minickpt-grade-uid-{uid}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            if processes_of(uid):  # left over from a run that was killed
                kill_uid(uid)
            clear_keyrings(uid)
            self.uids.append(uid)
            self._locks.append(f)
        if len(self.uids) < self.n:
            self.__exit__()
            raise RuntimeError(f"no free sandbox uid in {self.base}..{self.base + UID_RANGE - 1}")
        return self

    def __exit__(self, *exc: object) -> None:
        for uid in self.uids:
            kill_uid(uid)
        for f in self._locks:
            f.close()
        self._locks.clear()


# ---------------------------------------------------------------------------------------
# a Jupyter kernel manager that starts the kernel in the sandbox
# ---------------------------------------------------------------------------------------
RECEIVE_QUEUE = 16
"""Messages ZMQ queues per socket of the grader before they are read (its default is 1000,
each up to ``max_message`` bytes: 32 GiB); a kernel that sends faster loses its messages."""


def make_kernel_manager(iso: Isolation, *, uid: int, ipc_dir: str, cwd: str, limits: Limits,
                        extra_ro: dict[str, str], kernel_args: list[str],
                        max_message_bytes: int, cgroup: Any = None,
                        cache: tuple[str, bool] | None = None) -> Any:
    """An AsyncKernelManager whose kernel is ipykernel run in the sandbox (``iso``), over ZMQ
    ipc sockets in ``ipc_dir`` (owned by ``uid``); interrupts go over the control channel.
    ``cache``: the grading compilation cache (a folder, writable?) for a sandboxed kernel."""
    import zmq.asyncio
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager

    python = sys.executable
    argv = [sandbox_python(python) if iso.sandboxed else python, "-m", "ipykernel_launcher",
            "-f", "{connection_file}", *kernel_args]
    spec = KernelSpec(argv=argv, display_name="Python 3 (minickpt grader)", language="python",
                      interrupt_mode="message", metadata={"debugger": False})
    read_only = python_paths(python)

    class SandboxKernelManager(AsyncKernelManager):  # type: ignore[misc]
        @property
        def kernel_spec(self) -> Any:
            return spec

        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            cmd = super().format_kernel_cmd(extra_arguments)
            if iso.sandboxed:
                os.chown(self.connection_file, uid if iso.mode == "bwrap-root" else -1, -1)
                os.chmod(self.connection_file, 0o600)
            inside = None
            if cache is not None:
                from .compile_cache import IN_SANDBOX

                inside = (IN_SANDBOX, cache[1])
            cmd = kernel_command(iso, cmd, uid=uid, cwd=cwd, ipc_dir=ipc_dir,
                                 read_only=read_only, limits=limits,
                                 env=kernel_env(cache=inside),
                                 extra_ro={**package_binds(python), **extra_ro},
                                 cache=cache)
            return cgroup.join_command(cmd) if cgroup is not None else cmd

    context = zmq.asyncio.Context()
    context.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a 1 GB message is dropped, not read
    context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)  # and few are queued unread: bounded memory
    km = SandboxKernelManager(context=context, kernel_name="minickpt-grader")
    if iso.sandboxed:
        km.transport = "ipc"
        km.ip = os.path.join(ipc_dir, "k")
    km.connection_file = os.path.join(ipc_dir, "connection.json")
    return km


def prepare_ipc_dir(path: Path, iso: Isolation, uid: int) -> None:
    """An empty folder for the kernel's sockets, owned by the sandbox's uid."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, mode=0o700)
    if iso.mode == "bwrap-root":
        os.chown(path, uid, uid)


def describe(iso: Isolation, limits: Limits) -> dict[str, Any]:
    """For run.json: what isolated the kernels of this run."""
    return {"mode": iso.mode, "marker": iso.marker, "lost": list(iso.lost), "detail": iso.detail,
            "limits": limits.as_dict(), "bwrap": iso.bwrap, "setpriv": iso.setpriv,
            "prlimit": iso.prlimit}


if __name__ == "__main__":  # python -m autograder.sandbox: what this machine offers
    found = probe()
    print(json.dumps(describe(found, Limits()), indent=1))
    print(found.warning() or "every isolation mechanism works here")
