"""The system calls a sandboxed kernel may not make: a classic-BPF seccomp filter for bwrap.

Two channels the namespaces leave open are closed here, each as a class, not a spelling:

* **the kernel keyrings** (``add_key``, ``request_key``, ``keyctl``): a slot's uid is reused
  for every submission and every run, and the uid's user keyring outlives the processes, so a
  key one submission added was read by the next one graded in that slot. No kernel needs a
  keyring, so the three calls fail with ``EPERM`` (as in Docker's default profile): nothing
  is stored, whatever library or ``ctypes`` spelling makes the call.
* **new user namespaces** (``unshare``/``clone`` with ``CLONE_NEWUSER``; ``clone3``, whose
  flags a filter cannot read, fails with ``ENOSYS`` so that the C library falls back to
  ``clone``): the sandbox needs none, and one would hand its creator every capability inside.

Calls of another ABI (x32, 32-bit) are refused whole: a filter keyed on one table of
numbers must not be bypassed through another. bwrap loads the filter (``--seccomp FD``)
right before it starts the kernel, after ``no_new_privs``; every process below inherits it.
"""

from __future__ import annotations

import atexit
import errno
import os
import platform
import shutil
import struct
import tempfile

# classic BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_ABS_W, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_KILL_PROCESS = 0x80000000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (args little-endian: low word)
CLONE_NEWUSER = 0x10000000

# per machine: audit arch, x32 bit (0: none), syscall numbers
_TABLES = {
    "x86_64": (0xC000003E, 0x40000000,
               {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
                "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, 0,
                {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97,
                 "clone": 220, "clone3": 435}),
}
KEYRING_CALLS = ("add_key", "request_key", "keyctl")


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in _TABLES


def program(machine: str | None = None) -> bytes:
    """The filter as ``struct sock_filter[]`` bytes for this machine's architecture."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        raise ValueError(f"no seccomp table for machine {machine!r} (have {sorted(_TABLES)})")
    arch, x32, nr = _TABLES[machine]
    ins: list[tuple[int, int, int, int]] = []

    def ret(value: int) -> None:
        ins.append((_RET, 0, 0, value))

    ins.append((_LD_ABS_W, 0, 0, _OFF_ARCH))
    ins.append((_JEQ, 1, 0, arch))
    ret(_KILL_PROCESS)                                  # another ABI: never
    ins.append((_LD_ABS_W, 0, 0, _OFF_NR))
    if x32:
        ins.append((_JSET, 0, 1, x32))
        ret(_ERRNO | errno.EPERM)
    for name in KEYRING_CALLS:
        ins.append((_JEQ, 0, 1, nr[name]))
        ret(_ERRNO | errno.EPERM)
    ins.append((_JEQ, 0, 1, nr["clone3"]))
    ret(_ERRNO | errno.ENOSYS)
    for name in ("unshare", "clone"):                   # flags in the first argument
        ins.append((_JEQ, 0, 4, nr[name]))
        ins.append((_LD_ABS_W, 0, 0, _OFF_ARG0))
        ins.append((_JSET, 0, 1, CLONE_NEWUSER))
        ret(_ERRNO | errno.EPERM)
        ret(_ALLOW)
    ret(_ALLOW)
    return b"".join(struct.pack("<HBBI", *i) for i in ins)


_FILE: str | None = None


def filter_file() -> str:
    """The filter in a file only this process's user can write (made once per process)."""
    global _FILE
    if _FILE is None or not os.path.exists(_FILE):
        folder = tempfile.mkdtemp(prefix="minickpt-seccomp-")
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "kernel.bpf")
        with open(path, "wb") as f:
            f.write(program())
        os.chmod(path, 0o444)
        _FILE = path
    return _FILE


FD = 9
"""The descriptor bwrap reads the filter from (opened by :func:`wrap`'s shell)."""


def wrap(bwrap_argv: list[str]) -> list[str]:
    """``bwrap_argv`` (which carries ``--seccomp 9``) started with the filter open as fd 9:
    a shell opens the file and execs bwrap (a kernel manager starts its command with every
    other descriptor closed, so the descriptor cannot be passed any other way)."""
    return ["/bin/sh", "-c", f'f="$1"; shift; exec "$@" {FD}<"$f"', "minickpt-seccomp",
            filter_file(), *bwrap_argv]
