"""Host buffers: for reading, allocations aligned for XLA (zero-copy restores on CPU) and the
check, before allocating, that what is read fits in this machine's memory; for writing, the
page-aligned bounce buffers that O_DIRECT writes go through."""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from ..errors import CheckpointTooLargeError
from .spec import ALIGN


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    numpy aligns large buffers to 16 bytes only; XLA's CPU client takes a host buffer
    aligned to 64 *without copying it* (``jax.device_put`` then aliases it), so a restore
    into jax arrays on a CPU backend costs one read, not a read and a copy — and needs the
    state's size in memory once, not twice.
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dt)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes].view(dt).reshape(shape)


_ALIGN_FROM = 16 << 10  # below this a copy costs less than the bookkeeping


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say).

    Asked once per process: on Linux it is a ``sysinfo`` system call on every restore
    otherwise, for a number that does not change while the process runs.
    """
    if "bytes" not in _HOST_MEMORY:
        try:
            _HOST_MEMORY["bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            _HOST_MEMORY["bytes"] = None
    return _HOST_MEMORY["bytes"]


_HOST_MEMORY: dict[str, int | None] = {}


def _check_fits_in_memory(need: int, what: str, advice: str = "") -> None:
    """Refuse, before allocating, to read ``need`` bytes (``what``: which ones) that exceed
    this machine's memory."""
    limit = host_memory_bytes()
    if limit is not None and need > limit:
        raise CheckpointTooLargeError(
            f"reading {need} bytes {what} would need more than the {limit} bytes of memory "
            f"this machine has; refusing before allocating{advice}")


# ---------------------------------------------------------------------------------------
# bounce buffers for writes that bypass the page cache (O_DIRECT)
# ---------------------------------------------------------------------------------------
_BOUNCE_LOCK = threading.Lock()
_BOUNCE_FREE: dict[int, list[mmap.mmap]] = {}  # size -> buffers not in use
_BOUNCE_KEEP = 6  # per size: one save's writes in flight (4) and the one being filled, and
# one more (a second save, or a caller's larger depth, maps the rest afresh)


def take_bounce(size: int) -> mmap.mmap:
    """A page-aligned, writable buffer of ``size`` bytes, for O_DIRECT writes.

    An O_DIRECT write needs its memory aligned to the device's block size; a host array
    (a numpy or JAX buffer) is aligned to 64 bytes at best, so its bytes are copied into
    one of these first. Buffers are kept between saves (:func:`give_bounce`): a fresh one
    costs a page fault per 4 KiB on first use, which for 8 MiB is more than the copy.
    """
    with _BOUNCE_LOCK:
        free = _BOUNCE_FREE.get(size)
        if free:
            return free.pop()
    return mmap.mmap(-1, size)


def give_bounce(buf: mmap.mmap) -> None:
    """Return a buffer from :func:`take_bounce`; up to a few per size are kept for the next
    save, the rest are unmapped."""
    with _BOUNCE_LOCK:
        free = _BOUNCE_FREE.setdefault(len(buf), [])
        if len(free) < _BOUNCE_KEEP:
            free.append(buf)
            return
    buf.close()


def release_bounce_buffers() -> None:
    """Unmap every kept bounce buffer (their memory goes back to the system)."""
    with _BOUNCE_LOCK:
        bufs = [b for free in _BOUNCE_FREE.values() for b in free]
        _BOUNCE_FREE.clear()
    for b in bufs:
        b.close()
