"""A JAX compilation cache for grading that no submission can write to.

Most of a grading is JAX compiling the training steps every submission compiles (a lab's
setup, the library's own functions the tests plug the student's into). JAX's persistent
compilation cache would skip that, but a cache that kernels can write to is a hole: an entry
is a compiled program, and what one submission wrote there the next one's tests would load
and run as their own code (JAX's own docs: "Sharing a compilation cache is equivalent to
allowing anyone who can write to the cache directory to run code on your machine").

So the cache is

* **filled only by trusted code**: before a lab's submissions are graded, the grader grades
  the lab's own source notebook (student ``reference``) exactly as a submission (same kernel
  environment, XLA flags, devices, sandbox, so the cache keys match), with the cache folder
  writable for that one kernel. The grader then copies the entries it wrote (regular files
  only) into a new folder of its own, records each one's SHA-256 in ``manifest.json``, and
  renames the folder into place under a lock (shards that start at once fill it once);
* **never writable by a submission**: a sandboxed kernel gets it as a read-only bind mount
  (:data:`IN_SANDBOX`) and a minimum compile time so large that JAX never even tries to write
  (a miss prints nothing). An unsandboxed kernel (``MINICKPT_SANDBOX=off``) runs with the
  grader's own rights and could write to any folder the grader reads, so it gets a private
  copy in its own scratch folder, made from the digests the grader checked when the run
  began: what one unsandboxed submission changes reaches neither the shared folder's
  verified copy nor the next submission;
* **reused across runs**: one folder per lab under ``.cache/grading-jax/``, named by a hash
  of everything its entries depend on (the lab's source folder, ``minickpt/``, the installed
  JAX packages, Python, the CPU and accelerators, the kernel's environment). A folder
  that fails its check (a file added, changed, missing, not ours, writable by others) is
  removed and filled again. A missing or broken cache only makes grading slower: JAX keys
  every entry by the program it holds, and a miss compiles.

``--compile-cache off`` (or ``MINICKPT_GRADE_CACHE=off``) grades without it; a folder path
instead of ``off`` puts the cache there.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import ROOT

DEFAULT_ROOT = ROOT / ".cache" / "grading-jax"
ENV = "MINICKPT_GRADE_CACHE"
"""``off`` turns the cache off; a folder moves it (default ``.cache/grading-jax/``)."""
IN_SANDBOX = "/opt/minickpt-grader/jax-cache"
"""Where a sandboxed kernel sees the cache (read-only, or writable for the reference's fill)."""
NEVER_WRITE_SECS = "1e9"
"""The minimum compile time of an entry JAX would write: a read-only kernel never tries."""
FORMAT = "minickpt-grading-jax-cache 1"
MANIFEST = "manifest.json"
ENTRY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,300}-cache$")
MAX_ENTRY_BYTES = 256 << 20
MAX_TOTAL_BYTES = 4 << 30
LOCK_WAIT = 3600.0
"""Seconds to wait for another grade.sh filling the cache before grading without it."""


def cache_env(path: str, *, fill: bool) -> dict[str, str]:
    """The variables a kernel gets for the grading cache at ``path``. The same in the fill and
    in a submission, but for the minimum compile time (it is not part of JAX's keys); the
    XLA caches that JAX would put in the folder too (GPU autotuning, written by XLA itself)
    are off in both, so the compile options, which the keys hash, match."""
    return {"JAX_COMPILATION_CACHE_DIR": path,
            "JAX_ENABLE_COMPILATION_CACHE": "true",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0" if fill else NEVER_WRITE_SECS,
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
            "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",  # -1: no eviction, no lock or atime files
            **NO_SOURCE_INFO}


NO_SOURCE_INFO = {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0"}
"""No Python frame in the programs' locations. By default every op of an entry carries the
traceback that traced it (the hidden test's cell file, its line, the ``<test_…>`` names of
the referee's test functions), and the fill is the source notebook with its hidden tests: a
submission that read the entries learnt which hidden test ran which ops where. With no frame
an entry holds the program and the op names only. JAX's keys hash the program with its
locations stripped, and fill and submission both get this setting, so they still match."""


def where(option: str | None) -> Path | None:
    """The cache's root folder from ``--compile-cache`` or :data:`ENV`; None when off."""
    value = option if option is not None else os.environ.get(ENV, "")
    if value.strip().lower() in ("off", "0", "no", "none", "false"):
        return None
    return Path(value).resolve() if value.strip() else DEFAULT_ROOT


# ---------------------------------------------------------------------------------------
# the key: what the entries depend on
# ---------------------------------------------------------------------------------------
def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [x for x in f if x.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _jax_packages() -> list[str]:
    names = []
    for d in importlib.metadata.distributions():
        name = (d.metadata["Name"] or "").lower()
        if name.startswith(("jax", "libtpu", "nvidia-")) or name == "ml-dtypes":
            names.append(f"{name}=={d.version}")
    return sorted(set(names))


def _tree_hash(h: Any, folder: Path, pattern: str) -> None:
    for p in sorted(folder.rglob(pattern)):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes() + b"\0")


def lab_files(lab_dir: Path) -> list[Path]:
    """The files of a lab's source folder a kernel sees: the notebook and its data files."""
    return [f for f in sorted(lab_dir.iterdir())
            if f.is_file() and not f.name.startswith(".")]


def cache_key(lab_dir: Path, kernel_env: dict[str, str]) -> str:
    """A hash of everything a lab's compiled programs depend on (a change: a new folder).
    Not in it: the lab's name (two labs with the same files share one folder) and the kind
    of sandbox (the programs are the same in any; the entries were written by the reference
    in either case)."""
    import minickpt

    h = hashlib.sha256(FORMAT.encode() + b"\0")
    for f in lab_files(lab_dir):
        name = "<notebook>" if f.suffix == ".ipynb" else f.name  # a data file: by its name
        h.update(b"lab:" + name.encode() + b"\0" + f.read_bytes() + b"\0")
    _tree_hash(h, Path(minickpt.__file__).resolve().parent, "*.py")
    facts = {"packages": _jax_packages(), "python": sys.version, "machine": platform.machine(),
             "cpu": _cpu(), "env": sorted(kernel_env.items()),
             "devices": sorted(p.name for pat in ("nvidia*", "accel*")
                               for p in Path("/dev").glob(pat))}
    h.update(json.dumps(facts, sort_keys=True).encode())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------
# a folder and its check
# ---------------------------------------------------------------------------------------
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(folder: Path) -> dict[str, str]:
    """The entries of a filled folder (name -> SHA-256) after checking every one against the
    manifest; raises ValueError saying what is wrong. Checked: the folder and its files are
    ours, not links, not writable by group or others, exactly the manifest's files, each with
    its digest."""
    me = os.geteuid()

    def ours(p: Path, kind: int) -> os.stat_result:
        st = os.lstat(p)
        if stat.S_IFMT(st.st_mode) != kind:
            raise ValueError(f"{p} is not a {'folder' if kind == stat.S_IFDIR else 'file'}")
        if st.st_uid != me or st.st_mode & 0o022:
            raise ValueError(f"{p} is owned by uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):o} (want uid {me}, not group/other "
                             "writable)")
        return st

    ours(folder, stat.S_IFDIR)
    ours(folder / MANIFEST, stat.S_IFREG)
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != FORMAT or manifest.get("key") != folder.name:
        raise ValueError(f"{folder / MANIFEST} is not this cache's manifest")
    entries = dict(manifest["entries"])
    present = set(os.listdir(folder)) - {MANIFEST}
    if present != set(entries):
        extra, missing = sorted(present - set(entries)), sorted(set(entries) - present)
        raise ValueError(f"{folder} holds other files than its manifest lists "
                         f"(not listed: {extra[:3]}, missing: {missing[:3]})")
    for name, digest in entries.items():
        ours(folder / name, stat.S_IFREG)
        if _digest(folder / name) != digest:
            raise ValueError(f"{folder / name} does not match its digest in the manifest")
    return entries


def install(filled: Path, folder: Path, *, lab: str, source: Path) -> dict[str, str]:
    """Copy the entries a fill wrote into ``filled`` (regular files named like JAX's entries,
    nothing else) into a new folder of ours, with their digests, and rename it to ``folder``.
    The fill's kernel is dead by now; the copy is what was checked, not the folder it wrote."""
    tmp = folder.parent / f".new-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    os.chmod(tmp, 0o755)
    entries: dict[str, str] = {}
    total = 0
    for p in sorted(filled.iterdir()) if filled.is_dir() else []:
        st = os.lstat(p)
        if not (stat.S_ISREG(st.st_mode) and ENTRY_RE.match(p.name)) \
                or st.st_size > MAX_ENTRY_BYTES or total + st.st_size > MAX_TOTAL_BYTES:
            continue
        data = p.read_bytes()
        total += len(data)
        fd = os.open(tmp / p.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp / p.name, 0o644)
        entries[p.name] = hashlib.sha256(data).hexdigest()
    manifest = {"format": FORMAT, "key": folder.name, "lab": lab,
                "filled_from": str(source), "source_sha256": _digest(source),
                "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "entries": entries}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    os.chmod(tmp / MANIFEST, 0o644)
    if folder.exists():
        discard(folder)
    os.rename(tmp, folder)
    return entries


def discard(folder: Path) -> None:
    """Remove a folder that failed its check (renamed aside first: never half there)."""
    aside = folder.parent / f".old-{folder.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def private_copy(folder: str, entries: dict[str, str], dest: Path) -> bool:
    """An unsandboxed kernel's own copy of the cache, from the digests the grader checked when
    the run began: False (and no copy) when the shared folder no longer matches them."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, digest in entries.items():
        try:
            data = (Path(folder) / name).read_bytes()
        except OSError:
            data = b""
        if hashlib.sha256(data).hexdigest() != digest:
            shutil.rmtree(dest, ignore_errors=True)
            return False
        (dest / name).write_bytes(data)
    return True


@dataclass
class Lock:
    """An exclusive lock on the cache's root folder (``name`` ``.lock``: its tidying, checks
    and installs, each short), or on one key (``.lock-<key>``: held through that key's fill,
    so two grade.sh fill a lab once, while fills of other labs go on beside it)."""

    root: Path
    timeout: float = LOCK_WAIT
    name: str = ".lock"
    _f: Any = None

    def __enter__(self) -> bool:
        """True once held; False when another process held it for longer than ``timeout``."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._f = open(self.root / self.name, "a+")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def prepare_root(root: Path) -> str | None:
    """Make the cache's root folder ours and closed to others; the reason when it cannot be
    used (then grading goes on without a cache)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return f"{root} is not a folder of uid {os.geteuid()}"
        if st.st_mode & 0o022:
            os.chmod(root, 0o755)
    except OSError as e:
        return f"{root}: {e}"
    return None


KEEP_UNUSED_DAYS = 30


def key_lock(root: Path, key: str, timeout: float = LOCK_WAIT) -> Lock:
    """The lock held through the fill of ``key`` (see :class:`Lock`)."""
    return Lock(root, timeout, f".lock-{key}")


def tidy(root: Path, using: set[str]) -> None:
    """Under the lock: remove what a killed install left (``.new-*``, ``.old-*``: no other
    install runs now), mark the folders this run uses as used (their mtime), and remove
    folders no run used for :data:`KEEP_UNUSED_DAYS` days (minickpt or JAX changed since)."""
    now = time.time()
    for p in root.iterdir():
        try:
            if p.name.startswith((".new-", ".old-")):  # (installs hold the root's lock)
                shutil.rmtree(p, ignore_errors=True)
            elif p.name in using:
                os.utime(p)
            elif p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and \
                    now - p.stat().st_mtime > KEEP_UNUSED_DAYS * 86400:
                discard(p)
        except OSError:
            pass


def fill_folder(work: Path, key: str) -> Path:
    """An empty folder the reference's kernel will write to (the worker gives it to the
    slot's sandbox uid: :func:`autograder.runner._compile_cache`)."""
    folder = work / "compile-cache" / key
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, mode=0o700)
    return folder
