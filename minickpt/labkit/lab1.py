"""Lab 1 (basics): a round trip of every dtype the format stores, judged on the bytes.

:func:`roundtrip_every_dtype` saves a tree with one leaf of every kind a checkpoint can meet
(every dtype of :data:`minickpt.format.spec.DTYPES`, 0-d, empty, big-endian and
non-contiguous arrays, numpy scalars, typed PRNG keys of every implementation, Python values)
through the real ``Checkpointer`` with the student's functions plugged in, then checks what
is on disk (the manifest's dtype, shape and byte count, and the little-endian C-order bytes
at the offset it names) and what comes back (bit for bit, with and without a target).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .devices import (
    drawn,  # module level: the referee's private copy of the kit cannot import later
)
from .plugging import plugged_in
from .temporaries import tempdir

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _bits(dt: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """An array of ``dt`` whose bytes are random where every bit pattern is a value (floats:
    NaN payloads, -0.0, infinities), and valid values where not (bool, sub-byte ints)."""
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if dt.name.startswith(("int2", "int4", "uint2", "uint4", "float4", "float6")):
        return (rng.integers(0, 2, n)).astype(dt).reshape(shape)  # 0 and 1 exist in each
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape).copy()


def dtype_cases(seed: int = 0) -> dict[str, Any]:
    """Name → leaf: every kind of leaf a round trip can get wrong (host values, as
    ``to_host`` hands them to ``plan_leaf``, plus typed keys as ``jax.Array``)."""
    import jax

    from ..format.spec import DTYPES
    rng = np.random.default_rng(drawn(seed))
    out: dict[str, Any] = {}
    for name, dt in DTYPES.items():
        out[f"{name} 2x3"] = _bits(dt, (2, 3), rng)
        out[f"{name} 0-d"] = _bits(dt, (), rng)
        out[f"{name} empty 3x0"] = np.zeros((3, 0), dt)
        if dt.itemsize > 1 and dt.kind in "iufc" and dt.byteorder != "|":
            out[f"{name} big-endian"] = _bits(dt, (5,), rng).astype(dt.newbyteorder(">"))
    out["float32 transposed"] = _bits(np.dtype(np.float32), (3, 4), rng).T
    out["int16 every other"] = _bits(np.dtype(np.int16), (9,), rng)[::2]
    out["bfloat16 transposed"] = _bits(DTYPES["bfloat16"], (2, 5), rng).T
    out["numpy scalar float32"] = np.float32(-0.0)
    out["numpy scalar bfloat16"] = DTYPES["bfloat16"].type(1.5)
    out["numpy scalar int64"] = np.int64(-(2**62))
    for impl in KEY_IMPLS:
        out[f"key {impl}"] = jax.random.key(7, impl=impl)
        out[f"keys {impl} x3"] = jax.random.split(jax.random.key(8, impl=impl), 3)
    out["value int"] = 2**70
    out["value float"] = -0.0
    out["value str"] = "run-1 ✓"
    out["value bool"] = True
    return out


def _little(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"))).tobytes()


def _native(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("=") if dt.byteorder in "<>" else dt


class RoundTripReport:
    """What :func:`roundtrip_every_dtype` found: the leaves checked and every problem."""

    def __init__(self) -> None:
        self.leaves = 0
        self.problems: list[str] = []

    def first(self) -> str:
        return self.problems[0] if self.problems else ""

    def add(self, leaf: str, what: str) -> None:
        if not any(p.startswith(f"{leaf}: ") for p in self.problems):  # one per leaf
            self.problems.append(f"{leaf}: {what}")


def _why_bytes(arr: np.ndarray, got: bytes) -> str:
    if arr.dtype.byteorder == ">" and got == np.ascontiguousarray(arr).tobytes():
        return ("they are in the array's own big-endian order: data.bin is little-endian "
                "whatever the array or the machine")
    if len(got) != arr.nbytes:
        return f"{len(got)} bytes where the array has {arr.nbytes}: was it cast?"
    if not arr.flags.c_contiguous and got == arr.tobytes(order="A"):
        return "they are in the array's memory order, not C order (a transposed view?)"
    return "they are not the array's bytes in little-endian C order"


def roundtrip_every_dtype(*fns: Callable[..., Any], seed: int = 0) -> RoundTripReport:
    """Save :func:`dtype_cases` with ``fns`` (the student's ``plan_leaf`` and
    ``decode_leaf``) plugged into minickpt, and check the disk and both restores."""
    import jax

    from ..checkpointer import Checkpointer
    from ..format.spec import dtype_name
    from ..tree import HostKey, to_host

    cases = dtype_cases(seed)
    report = RoundTripReport()
    report.leaves = len(cases)
    planner = next((f for f in fns if getattr(f, "__name__", "") == "plan_leaf"), None)
    for name, leaf in list(cases.items()) if planner is not None else ():
        try:  # each leaf on its own first, so that one that raises is named
            planner(("t", name), to_host(leaf))
        except Exception as e:
            layout = ("" if not isinstance(leaf, np.ndarray) or leaf.flags.c_contiguous else
                      " (this leaf is a strided view, not C-contiguous)")
            report.add(name, f"plan_leaf raised {type(e).__name__}: {str(e)[:200]}{layout}")
            del cases[name]
    with plugged_in(*fns) if fns else contextlib.nullcontext(), tempdir() as d:
        path = os.path.join(d, "c")
        try:
            Checkpointer().save(path, {"t": cases})
        except Exception as e:
            report.problems.append(f"saving the tree raised {type(e).__name__}: {e}")
            return report
        with open(os.path.join(path, "t", "manifest.json")) as f:
            manifest = json.load(f)
        data_file = os.path.join(path, "t", "data.bin")
        data = b""
        if os.path.exists(data_file):
            with open(data_file, "rb") as f:
                data = f.read()
        entries = {"/".join(e.get("path", [])): e for e in manifest.get("leaves", [])}
        for name, leaf in cases.items():  # what is on disk
            e = entries.get(name)
            if e is None:
                report.add(name, "no manifest entry names this leaf")
                continue
            if isinstance(leaf, jax.Array):
                kd = np.asarray(jax.random.key_data(leaf))
                impl = str(jax.random.key_impl(leaf))
                if e.get("kind") != "prng_key" or e.get("impl") != impl:
                    report.add(name, f"saved as kind {e.get('kind')!r} with impl {e.get('impl')!r}; "
                               f"a typed key must be saved as 'prng_key' with its impl {impl!r}, or "
                               "a restore cannot make the same key again")
                    continue
                arr: Any = kd
            elif isinstance(leaf, (np.ndarray, np.generic)):
                arr = np.asarray(leaf)
            else:
                if e.get("kind") != "value" or "nbytes" in e:
                    report.add(name, f"a Python value should live in the manifest entry itself, got {e}")
                continue
            want_dt = dtype_name(_native(arr.dtype))
            if e.get("dtype") != want_dt or e.get("shape") != list(arr.shape):
                report.add(name, f"described as dtype {e.get('dtype')!r} shape {e.get('shape')}, "
                           f"expected {want_dt!r} {list(arr.shape)}" +
                           (": a cast changes the bits and the size" if e.get("dtype") != want_dt else ""))
                continue
            off, n = e.get("offset", 0), e.get("nbytes", -1)
            got = data[off:off + n] if isinstance(n, int) and n >= 0 else b""
            if got != _little(arr):
                report.add(name, f"the bytes in data.bin at offset {off}: {_why_bytes(arr, got)}")
        try:  # what comes back, without a target and into the tree itself
            raw = Checkpointer().restore(path)["t"]
        except Exception as e:
            report.problems.append(f"restoring raised {type(e).__name__}: {str(e)[:300]}")
            return report
        into_error = ""
        try:
            into = Checkpointer().restore(path, {"t": cases})["t"]
        except Exception as e:
            into = None
            into_error = (f"restoring into the tree itself raised {type(e).__name__}: "
                          f"{str(e)[:300]}")
        for name, leaf in cases.items():
            got, back = raw.get(name), (into or {}).get(name)
            if isinstance(leaf, jax.Array):
                kd, impl = np.asarray(jax.random.key_data(leaf)), str(jax.random.key_impl(leaf))
                if type(got) is not HostKey or got.impl != impl or \
                        np.asarray(got.data).tobytes() != kd.tobytes():
                    report.add(name, f"restored without a target as {type(got).__name__} "
                               f"{getattr(got, 'impl', '')}; expected HostKey(data, {impl!r}) with "
                               "the same data")
                elif into is not None and not (isinstance(back, jax.Array) and jax.dtypes.issubdtype(
                        back.dtype, jax.dtypes.prng_key) and str(jax.random.key_impl(back)) == impl
                          and np.asarray(jax.random.key_data(back)).tobytes() == kd.tobytes()):
                    report.add(name, "restored into the target, it is not the same typed key")
                continue
            if isinstance(leaf, np.generic):
                if type(got) is not type(leaf) or got.tobytes() != leaf.tobytes():
                    report.add(name, f"a numpy scalar {type(leaf).__name__} came back as "
                               f"{type(got).__name__} {got!r}: honour the entry's 'scalar' mark")
                continue
            if isinstance(leaf, np.ndarray):
                want = _little(leaf)
                ok = type(got) is np.ndarray and got.dtype == _native(leaf.dtype) and \
                    got.shape == leaf.shape and np.ascontiguousarray(got).tobytes() == want
                if not ok:
                    what = (f"{type(got).__name__}" if type(got) is not np.ndarray else
                            f"dtype {got.dtype} shape {got.shape}" +
                            (" with other bits" if got.dtype == _native(leaf.dtype)
                             and got.shape == leaf.shape else ""))
                    report.add(name, f"restored as {what}; expected dtype {_native(leaf.dtype)} "
                               f"shape {leaf.shape}, bit for bit")
                continue
            if type(got) is not type(leaf) or repr(got) != repr(leaf):
                report.add(name, f"the value came back as {got!r}, expected {leaf!r}")
        if into_error:
            report.problems.append(into_error)
    return report
