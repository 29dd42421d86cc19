"""The machine a run measures: what it is, and the page cache's state.

A benchmark number without its machine is not a number. This module describes the CPU, the
memory, the file system the checkpoints land on and the library versions, and controls the
page cache: a *warm* read comes from memory, a *cold* one from the disk. Files are evicted one
by one with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (unprivileged, touches nobody else's
data) and the eviction is checked with ``mincore``; the global ``drop_caches`` is used only
when asked for and only as root, because it empties the cache of every user of the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import math
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata as _md
from typing import Any


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mem_total_bytes() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def mount_of(path: str) -> dict[str, str]:
    """The mount (device, file system type, options) holding ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] = {}
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        dev, mnt, fstype, opts = parts[:4]
        mnt = mnt.replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best.get("mount", "")):
            best = {"device": dev, "mount": mnt, "fstype": fstype, "options": opts}
    if best.get("device", "").startswith("/dev/"):
        name = os.path.basename(os.path.realpath(best["device"]))
        rot = _read(f"/sys/class/block/{name}/queue/rotational").strip()
        if not rot:  # a partition: ask its disk
            rot = _read(f"/sys/class/block/{name}/../queue/rotational").strip()
        if rot:
            best["rotational"] = rot
    return best


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def crc_impl() -> str:
    """Which CRC-32 minickpt checks with: "isal" (ISA-L, ~7× faster) or "zlib"."""
    try:
        from minickpt.format.spec import CRC_IMPL
    except ImportError:  # an older layout
        import minickpt.format

        return str(getattr(minickpt.format, "CRC_IMPL", "zlib"))
    return str(CRC_IMPL)


def describe(bench_dir: str) -> dict[str, Any]:
    """Everything a reader needs to judge the numbers of this run."""
    import jax

    devices = jax.devices()
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": mem_total_bytes(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": f"{len(devices)} × {devices[0].device_kind}",
        "bench_dir": bench_dir,
        "filesystem": mount_of(bench_dir),
        "load_avg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "minickpt_crc32": crc_impl(),
        "versions": {d: _version(d) for d in ("minickpt", "jax", "jaxlib", "numpy", "flax",
                                               "optax", "orbax-checkpoint", "tensorstore",
                                               "isal")},
    }
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(__file__))
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(__file__))
        if rev.returncode == 0:
            info["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def one_line(info: dict[str, Any]) -> str:
    """The machine in one line, for the table's caption."""
    fs = info.get("filesystem", {})
    mem = info.get("mem_total_bytes") or 0
    v = info["versions"]
    return (f"{info['cpu']} ({info['cpu_affinity'] or info['cpu_count']} cores), "
            f"{mem / 2**30:.0f} GiB RAM, {fs.get('fstype', '?')} on {fs.get('device', '?')} "
            f"(mounted {fs.get('options', '?')}), {info['os']}; Python {info['python']}, jax "
            f"{v.get('jax')} on {info['jax_devices']}, orbax-checkpoint "
            f"{v.get('orbax-checkpoint')}")


# ---------------------------------------------------------------------------------------
# the page cache
# ---------------------------------------------------------------------------------------
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def resident_fraction(path: str) -> float | None:
    """The fraction of ``path``'s pages in the page cache (``mincore``), or None if unknown."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    if not hasattr(_LIBC, "mincore"):
        return None
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
        try:
            buf = ctypes.c_char.from_buffer(mm)  # no page is touched by taking the address
            page = mmap.PAGESIZE
            npages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            rc = _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size),
                               vec)
            del buf
            if rc != 0:
                return None
            return sum(v & 1 for v in vec) / npages
        finally:
            mm.close()


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        out += [os.path.join(root, n) for n in names]
    return out


class PageCache:
    """Evicts files from the page cache so that the next read comes from the disk."""

    def __init__(self, method: str = "fadvise"):
        if method not in ("fadvise", "drop_caches"):
            raise ValueError(f"unknown eviction method {method!r}")
        if method == "drop_caches" and not (os.geteuid() == 0 and os.access(
                "/proc/sys/vm/drop_caches", os.W_OK)):
            raise PermissionError("drop_caches needs root and a writable "
                                  "/proc/sys/vm/drop_caches; use the fadvise method")
        self.method = method
        self.evictions = 0
        self.checked: list[float] = []  # resident fraction after each eviction we checked

    @property
    def available(self) -> bool:
        return hasattr(os, "posix_fadvise")

    def evict(self, path: str) -> None:
        """Write back and evict every file under ``path`` (dirty pages cannot be dropped)."""
        files = _files(path)
        self.evictions += 1
        if self.method == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        else:
            for name in files:
                fd = os.open(name, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        big = max(files, key=os.path.getsize, default=None)
        if big is not None and len(self.checked) < 50:
            frac = resident_fraction(big)
            if frac is not None:
                self.checked.append(frac)

    def statement(self) -> str:
        if not self.evictions:
            return "no cold-cache figure in this run"
        how = ("posix_fadvise(DONTNEED) on each file read, before each cold repetition"
               if self.method == "fadvise" else
               "sync + echo 3 > /proc/sys/vm/drop_caches before each cold repetition (global)")
        if self.checked:
            worst = max(self.checked)
            how += (f"; mincore after eviction: at most {worst:.1%} of the largest file still "
                    "cached")
        else:
            how += "; eviction not verified (mincore unavailable)"
        return how


def read_whole(path: str, chunk: int = 16 << 20) -> int:
    """Read every byte of every file under ``path`` (through the page cache); bytes read."""
    total = 0
    buf = bytearray(chunk)
    for name in _files(path):
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


class WarmCache:
    """Puts a checkpoint's files in the page cache before a warm restore is timed.

    A warm row must not rely on a file being cached by accident (a save written with
    ``O_DIRECT`` leaves nothing behind): every file the restore reads is read once, untimed,
    and ``mincore`` checks that the largest one is resident."""

    def __init__(self) -> None:
        self.warmings = 0
        self.checked: list[float] = []  # resident fraction after each warming we checked

    def warm(self, path: str) -> None:
        read_whole(path)
        self.warmings += 1
        big = max(_files(path), key=os.path.getsize, default=None)
        if big is not None and len(self.checked) < 200:
            frac = resident_fraction(big)
            if frac is not None:
                self.checked.append(frac)

    def statement(self) -> str:
        if not self.warmings:
            return "no warm-cache figure in this run"
        how = ("each library's checkpoint files (and the probe's file) read once, untimed, "
               "before each warm repetition")
        if self.checked:
            how += (f"; mincore after warming: at least {min(self.checked):.1%} of the largest "
                    "file cached")
        else:
            how += "; not verified (mincore unavailable)"
        return how


def drop_caches_possible() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def python_exe() -> str:
    return sys.executable


# ---------------------------------------------------------------------------------------
# the disk's limit, measured with fio
# ---------------------------------------------------------------------------------------
PROBE_LABEL = "probe, not fio"


@dataclass(frozen=True)
class FioCase:
    """One fio job: sequential ``rw`` ("write", ending in fsync, or "read") of ``bs`` blocks
    by ``jobs`` processes, through the page cache or with ``O_DIRECT``."""

    rw: str
    bs: str
    direct: bool
    jobs: int
    # buffered writes that start the disk's writeback after every block (fio's
    # sync_file_range=write:1), as minickpt does, instead of leaving it all to the fsync
    writeback: bool = False

    @property
    def engine(self) -> str:
        # O_DIRECT with one synchronous request at a time leaves the device idle between
        # requests; libaio keeps a few in flight, as any tool after the disk's limit does
        return "libaio" if self.direct else "psync"

    def describe(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered"
        if self.writeback:
            how += "+sync_file_range"
        return f"{self.rw} bs={self.bs} {how} {self.jobs} job{'s' * (self.jobs > 1)}"


def fio_cases(rw: str, smoke: bool = False) -> list[FioCase]:
    """The cases the limit is the best of: buffered and O_DIRECT, two block sizes, 1–4 jobs;
    for writes also buffered with the writeback started after every block (a plain buffered
    write leaves it all to the final fsync, which a save that starts it early beats)."""
    wb = rw == "write"
    if smoke:
        return [FioCase(rw, "1M", False, 1), FioCase(rw, "1M", True, 2)] + (
            [FioCase(rw, "1M", False, 2, writeback=True)] if wb else [])
    return ([FioCase(rw, "1M", False, j) for j in (1, 2, 4)]
            + [FioCase(rw, "16M", False, j) for j in (1, 4)]
            + [FioCase(rw, bs, True, j) for bs in ("1M", "16M") for j in (1, 4)]
            + ([FioCase(rw, "16M", False, j, writeback=True) for j in (1, 4)] if wb else []))


def fio_args(case: FioCase, path: str, total_bytes: int, runtime_s: float) -> list[str]:
    """fio's command line for ``case`` on ``path`` (a file; each job takes its own slice, so
    the jobs together move ``total_bytes``), stopping after ``runtime_s``."""
    block = _bytes(case.bs)
    per_job = max(block, total_bytes // case.jobs // block * block)
    args = ["fio", "--name=limit", f"--filename={path}", f"--rw={case.rw}", f"--bs={case.bs}",
            f"--direct={int(case.direct)}", f"--numjobs={case.jobs}", f"--size={per_job}",
            f"--offset_increment={per_job}", f"--ioengine={case.engine}",
            f"--runtime={max(1, math.ceil(runtime_s))}", "--group_reporting",
            "--output-format=json"]
    if case.direct:
        args.append("--iodepth=4")
    if case.writeback:
        args.append("--sync_file_range=write:1")
    if case.rw == "write":
        args += ["--end_fsync=1", "--fallocate=none"]  # the fsync is inside the timed run
    else:
        args.append("--invalidate=1")  # fio evicts the file's cached pages first: a cold read
    return args


def _bytes(size: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)


def parse_fio(text: str, rw: str) -> dict[str, float]:
    """Bytes/s, bytes moved and seconds of the ``rw`` side of a fio ``--output-format=json``
    report, summed over its jobs (with or without ``--group_reporting``). Text before the
    JSON (fio's own warnings) is skipped; a job that failed raises."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON in fio's output: " + text[:200])
    doc = json.loads(text[start:])
    jobs = doc.get("jobs") or []
    if not jobs:
        raise ValueError("fio's report has no jobs")
    moved, seconds = 0, 0.0
    for job in jobs:
        if job.get("error"):
            raise ValueError(f"fio job {job.get('jobname')!r} failed: error {job['error']}")
        side = job[rw]
        moved += int(side["io_bytes"])
        seconds = max(seconds, float(side["runtime"]) / 1e3)  # ms; jobs run side by side
    if moved <= 0 or seconds <= 0:
        raise ValueError(f"fio moved no bytes ({rw})")
    return {"bytes_per_s": moved / seconds, "bytes": moved, "seconds": seconds,
            "fio_version": doc.get("fio version", "?")}


def fio_available() -> str | None:
    return shutil.which("fio")


def fio_limits(directory: str, total_bytes: int, *, runtime_s: float = 2.0,
               smoke: bool = False, run: Any = None) -> dict[str, Any]:
    """Every case of :func:`fio_cases` for writes and reads on ``directory``'s file system;
    the limit of each is the best bytes/s a case reached. Without fio (or if it fails):
    ``{"tool": None, "reason": ...}``, and the suite falls back to its probe."""
    exe = fio_available()
    if exe is None:
        return {"tool": None, "reason": "fio is not installed (scripts/install-fio.sh)"}
    run = run or (lambda args: subprocess.run(args, capture_output=True, text=True,
                                              timeout=runtime_s * 4 + 60))
    path = os.path.join(directory, f"fio-limit-{os.getpid()}")
    out: dict[str, Any] = {"tool": "fio", "path_fs": mount_of(directory).get("fstype"),
                           "total_bytes": total_bytes, "cases": []}
    try:
        for rw in ("write", "read"):  # fio lays out the reads' file where a write stopped
            for case in fio_cases(rw, smoke):
                if rw == "write":  # a save writes a new file, so each write case does
                    with contextlib.suppress(OSError):  # too (the reads' file fio lays out)
                        os.unlink(path)
                proc = run(fio_args(case, path, total_bytes, runtime_s))
                if proc.returncode != 0:
                    raise RuntimeError(f"fio {case.describe()}: exit {proc.returncode}: "
                                       f"{(proc.stderr or proc.stdout)[-500:]}")
                r = parse_fio(proc.stdout, rw)
                out["cases"].append({"case": case.describe(), "rw": rw,
                                     "spec": asdict(case), **r})
                out["fio_version"] = r["fio_version"]
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as e:
        return {"tool": None, "reason": f"fio failed: {e}"}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for rw in ("write", "read"):
        best = max((c for c in out["cases"] if c["rw"] == rw), key=lambda c: c["bytes_per_s"])
        out[rw] = {"bytes_per_s": best["bytes_per_s"], "case": best["case"],
                   "spec": best["spec"]}
        direct = [c for c in out["cases"] if c["rw"] == rw and c["spec"].get("direct")]
        if direct:  # the path minickpt's large files take: the row's note compares it too
            d = max(direct, key=lambda c: c["bytes_per_s"])
            out[f"{rw}_direct"] = {"bytes_per_s": d["bytes_per_s"], "case": d["case"]}
    return out


def fio_once(case: FioCase, path: str, nbytes: int, *, runtime_s: float = 120.0,
             run: Any = None) -> dict[str, float]:
    """One run of ``case`` on ``path`` moving ``nbytes`` (the row's own bytes), parsed as
    :func:`parse_fio` does: the suite times the sweep's best case again inside each large
    row's repetitions, so that the row and its limit are measured at the same moments. A
    write case must be given a path that does not exist (a save writes a new file); a read
    case reads what is there (fio lays the file out if it is missing) with a cold cache."""
    run = run or (lambda args: subprocess.run(args, capture_output=True, text=True,
                                              timeout=runtime_s + 60))
    proc = run(fio_args(case, path, nbytes, runtime_s))
    if proc.returncode != 0:
        raise RuntimeError(f"fio {case.describe()}: exit {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout)[-500:]}")
    return parse_fio(proc.stdout, case.rw)


def limit_label(kind: str, fio: dict[str, Any] | None) -> str:
    """How a large row's limit is named in the table: fio's best case, or the probe."""
    if fio and fio.get("tool") == "fio":
        return f"fio {kind}, best: {fio[kind]['case'].split(' ', 1)[1]}"
    return {"write": "write+fsync", "read": "cold read"}[kind] + f" ({PROBE_LABEL})"
