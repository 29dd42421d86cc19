"""One control group per parallel slot: the CPU, memory and processes of a submission as a
whole, whatever it forks (children in their own sessions included).

rlimits bound one process at a time: a submission that forks a hundred spinning children
takes every core of the machine (its neighbours in the other slots time out), and a hundred
children of 4 GiB each are 400 GiB. A cgroup bounds the sum: ``cpu.max`` (v1:
``cpu.cfs_quota_us``) gives each slot its share of the cores, ``memory.max`` (v1:
``memory.limit_in_bytes``, and no swap) its memory, ``pids.max`` its processes and threads.
The kernel's command joins its slot's cgroup before it starts (a root shell writes its own
pid to ``cgroup.procs`` and execs the sandbox), so everything it starts is inside, and
:meth:`SlotCgroup.kill` ends every process in it after the submission.

cgroup v2 (one hierarchy with the cpu, memory and pids controllers) and v1 (one hierarchy per
controller) are both used; ``grade.sh`` sets them up itself (root is needed). Where neither
can be used, :func:`make_slot_cgroups` says why, and every result is marked: the CPU, memory
and processes of a submission are then bounded per process only.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("cpu", "memory", "pids")
PERIOD_US = 100_000


@dataclass(frozen=True)
class SlotCgroup:
    """The cgroup folders of one slot (v2: one; v1: one per controller)."""

    paths: tuple[str, ...]
    version: int

    def join_command(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (the shell joins it, then execs ``argv``)."""
        joins = " && ".join(f"echo $$ > {shlex.quote(os.path.join(p, 'cgroup.procs'))}"
                            for p in self.paths)
        return ["/bin/sh", "-c", f"{joins} && exec \"$@\"", "minickpt-cgroup", *argv]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for p in self.paths:
            try:
                with open(os.path.join(p, "cgroup.procs")) as f:
                    found.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
        return sorted(found)

    def kill(self, spare: set[int] | frozenset[int] = frozenset()) -> int:
        """SIGKILL every process in the cgroup but ``spare`` (the slot's grading worker, which
        runs in it too), until none is left. Returns how many."""
        if self.version == 2 and not spare:
            try:
                with open(os.path.join(self.paths[0], "cgroup.kill"), "w") as f:
                    f.write("1")
            except OSError:
                pass
        killed: set[int] = set()
        for _ in range(300):
            victims = [p for p in self.pids() if p != os.getpid() and p not in spare]
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
        return len(killed)

    def remove(self) -> None:
        self.kill()
        for p in self.paths:
            for _ in range(50):
                try:
                    os.rmdir(p)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # its last processes are still exiting
                    time.sleep(0.05)

    def as_list(self) -> list[str]:
        return [str(self.version), *self.paths]


def from_list(data: list[str] | None) -> SlotCgroup | None:
    if not data:
        return None
    return SlotCgroup(tuple(data[1:]), int(data[0]))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _own(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` ("" for v2's)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path
    except OSError:
        pass
    return None


def _v1_mount(controller: str) -> tuple[str, str] | None:
    """(mount point, root of the mount inside the hierarchy) of a v1 controller."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if rfields and rfields[0] == "cgroup" and controller in rfields[-1].split(","):
                    return fields[4], fields[3]
    except OSError:
        pass
    return None


def _limits_v2(path: str, cpus: float, memory: int, processes: int) -> None:
    _write(os.path.join(path, "cpu.max"), f"{max(1000, int(cpus * PERIOD_US))} {PERIOD_US}")
    _write(os.path.join(path, "memory.max"), str(memory))
    if os.path.exists(os.path.join(path, "memory.swap.max")):
        _write(os.path.join(path, "memory.swap.max"), "0")
    _write(os.path.join(path, "pids.max"), str(processes))


def _make_v2(name: str, n: int, cpus: float, memory: int, processes: int) -> list[SlotCgroup]:
    with open(os.path.join(ROOT, "cgroup.controllers")) as f:
        have = set(f.read().split())
    missing = [c for c in CONTROLLERS if c not in have]
    if missing:
        raise OSError(f"cgroup v2 lacks the {', '.join(missing)} controller(s)")
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    _write(os.path.join(ROOT, "cgroup.subtree_control"), enable)  # the root may have processes
    top = os.path.join(ROOT, name)
    os.makedirs(top, exist_ok=True)
    _write(os.path.join(top, "cgroup.subtree_control"), enable)
    slots = []
    for k in range(n):
        path = os.path.join(top, f"slot-{k}")
        os.makedirs(path, exist_ok=True)
        _limits_v2(path, cpus, memory, processes)
        slots.append(SlotCgroup((path,), 2))
    return slots


def _make_v1(name: str, n: int, cpus: float, memory: int, processes: int) -> list[SlotCgroup]:
    bases = {}
    for c in CONTROLLERS:
        mount, own = _v1_mount(c), _own(c)
        if mount is None or own is None:
            raise OSError(f"no cgroup v1 hierarchy with the {c} controller")
        point, root = mount
        rel = os.path.relpath(own, root) if own.startswith(root) else ""
        bases[c] = os.path.normpath(os.path.join(point, rel, name))
    slots = []
    for k in range(n):
        paths = {c: os.path.join(base, f"slot-{k}") for c, base in bases.items()}
        for p in paths.values():
            os.makedirs(p, exist_ok=True)
        _write(os.path.join(paths["cpu"], "cpu.cfs_period_us"), str(PERIOD_US))
        _write(os.path.join(paths["cpu"], "cpu.cfs_quota_us"), str(max(1000, int(cpus * PERIOD_US))))
        mem = paths["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory))
        _write(os.path.join(paths["pids"], "pids.max"), str(processes))
        slots.append(SlotCgroup(tuple(dict.fromkeys(paths.values())), 1))
    return slots


def make_slot_cgroups(n: int, *, cpus: float, memory: int, processes: int,
                      name: str | None = None) -> tuple[list[SlotCgroup], str]:
    """``n`` slot cgroups, each bounded to ``cpus`` cores, ``memory`` bytes (no swap) and
    ``processes`` tasks: (the cgroups, "") or ([], why they cannot be made here)."""
    name = name or f"minickpt-grade-{os.getpid()}"
    if os.geteuid() != 0:
        return [], "cgroups need root"
    errors = []
    for version, make in ((2, _make_v2), (1, _make_v1)):
        if version == 2 and not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
            errors.append("no cgroup v2 hierarchy at /sys/fs/cgroup")
            continue
        try:
            slots = make(name, n, cpus, memory, processes)
        except OSError as e:
            errors.append(f"v{version}: {e}")
            continue
        if all(_works(s) for s in slots):
            return slots, ""
        for s in slots:
            s.remove()
        errors.append(f"v{version}: a process could not join the slot's cgroup")
    return [], "; ".join(errors)


def _works(slot: SlotCgroup) -> bool:
    """A process started with :meth:`SlotCgroup.join_command` really is in the cgroup."""
    import subprocess

    cmd = slot.join_command(["/bin/sh", "-c", "cat /proc/self/cgroup"])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    tail = os.path.basename(slot.paths[0])
    return any(line.endswith("/" + tail) for line in out.splitlines())


def remove_all(slots: list[SlotCgroup]) -> None:
    """Kill what is left in the slots and remove their folders (and their parent's)."""
    parents = set()
    for s in slots:
        s.remove()
        parents.update(os.path.dirname(p) for p in s.paths)
    for p in parents:
        try:
            os.rmdir(p)
        except OSError:
            pass
