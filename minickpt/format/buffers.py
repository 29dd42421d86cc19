"""Host buffers: for reading, allocations aligned for XLA (zero-copy restores on CPU) and the
check, before allocating, that what is read fits in this machine's memory; for writing, the
page-aligned bounce buffers that O_DIRECT writes go through."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

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
    if nbytes >= _PLAIN_PAGES_FROM:
        _plain_pages(raw)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes].view(dt).reshape(shape)


_ALIGN_FROM = 16 << 10  # below this a copy costs less than the bookkeeping


def _plain_pages(raw: np.ndarray) -> None:
    """Take back numpy's request for huge pages on a buffer about to be filled by a read.

    numpy advises huge pages for every allocation from 4 MiB. Where the kernel compacts
    memory to find them on first touch (transparent huge pages with ``defrag=madvise``, a
    common default), a first restore of 400 MB in a fresh process took 0.07-1.6 s, against
    a steady 0.12 s in plain pages. Where the kernel would not stall for them (``defrag`` of
    ``defer`` or ``never``), numpy's advice stands: huge pages then cost nothing to wait for.
    Memory that glibc hands out again after a free is already touched: the advice costs it
    nothing, and later restores in the process still reuse it."""
    if _MADVISE is None:
        return
    page = mmap.PAGESIZE
    lo = -(-raw.ctypes.data // page) * page
    hi = (raw.ctypes.data + raw.nbytes) // page * page
    if hi > lo:
        _MADVISE(lo, hi - lo, mmap.MADV_NOHUGEPAGE)  # advice: an error changes nothing


THP_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"  # the kernel's huge-page policy


def _madvise(defrag: str = THP_DEFRAG) -> Any:
    """libc's madvise where an advised huge page can stall a first touch, else None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return None
    try:
        with open(defrag) as f:
            chosen = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None  # no transparent huge pages here
    if chosen not in ("always", "madvise", "defer+madvise"):  # compacts for advised memory
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_PLAIN_PAGES_FROM = 4 << 20  # where numpy starts to advise huge pages
_MADVISE = _madvise()


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


# ---------------------------------------------------------------------------------------
# reused host buffers for restores onto an accelerator
# ---------------------------------------------------------------------------------------
class RestorePool:
    """Host buffers that a restore onto an accelerator reads leaves into, one leaf at a time:
    the leaf goes to its device, and once its transfer is done its buffer takes the next read.

    Why: a restore that reads every leaf into fresh memory touches the whole state's size of
    new pages, and first touch is what such a restore pays for most where fresh memory is
    dear (374 ms for 400 MB on the TPU machine, gVisor; seconds on a ballooned VM). With
    this pool it touches a few leaves' worth, once, and holds no more than that.

    Buffers come in power-of-two size classes from 1 MiB, so leaves of similar sizes share
    them; a read fills only a leaf's bytes, so the rest of a class's buffer is never touched
    (and costs no memory). Up to :data:`_POOL_KEEP_BYTES` of free buffers are kept for the next
    restore; :func:`release_restore_buffers` frees them. Buffers are numpy arrays (64-byte
    aligned), never unmapped by hand: one still read by a transfer that an error abandoned
    stays alive as long as the transfer holds it.

    ``in_use``, ``peak`` (the most bytes handed out at once since :meth:`reset_peak`) and
    ``allocated`` (bytes of buffers ever made) are the pool's own accounting, which a test
    reads to show that a restore's host memory is bounded by the pool, not by the state.
    """

    def __init__(self, keep_bytes: int) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._keep = keep_bytes
        self.in_use = 0
        self.peak = 0
        self.allocated = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_POOL_MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` bytes (uint8, 64-byte aligned); give it back with
        :meth:`give` once nothing reads it any more."""
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            if buf is None:
                self.allocated += size
        return buf if buf is not None else aligned_empty((size,), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        with self._lock:
            self.in_use -= size
            if self.held_bytes() + size <= self._keep:
                self._free.setdefault(size, []).append(buf)

    def drop(self, buf: np.ndarray) -> None:
        """Count ``buf`` as returned without reusing it (a transfer that failed part-way may
        still read it; it is freed when the last reference goes)."""
        with self._lock:
            self.in_use -= buf.nbytes

    def held_bytes(self) -> int:
        """Bytes of free buffers kept for the next restore."""
        return sum(len(v) * k for k, v in self._free.items())

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.in_use

    def release(self) -> None:
        with self._lock:
            self._free.clear()


_POOL_MIN_CLASS = 1 << 20
_POOL_KEEP_BYTES = 512 << 20  # kept between restores: 4 reader threads' two buffers of 64 MiB
POOL_MAX_LEAF = 256 << 20  # a larger leaf is read into memory of its own (freed once placed)
RESTORE_POOL = RestorePool(_POOL_KEEP_BYTES)


def release_restore_buffers() -> None:
    """Free the restore buffers kept for the next restore onto an accelerator."""
    RESTORE_POOL.release()
