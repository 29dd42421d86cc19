"""The format's names and numbers: versions, file names, alignment, limits, the
checksum, the allowed dtypes and names (see :mod:`minickpt.format` for the layout)."""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import UnsupportedLeafError

FORMAT_NAME = "minickpt"
FORMAT_VERSION = 1  # what an item without sharded leaves is written as (every single-host save)
SHARDED_FORMAT_VERSION = 2  # an item with leaves written in shards by several processes
MAX_FORMAT_VERSION = SHARDED_FORMAT_VERSION  # the newest version this minickpt reads
SHARD_MANIFEST_FORMAT = "minickpt-shards"
MANIFEST_FILE = "manifest.json"
DATA_FILE = "data.bin"
ALIGN = 64
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
_CRC_IN_THREAD_BYTES = 8 << 20  # below this, threads cost more than they save
_HOST_IN_THREAD_BYTES = 1 << 20

try:  # ISA-L computes the very same CRC-32 as zlib, ~4× faster (carry-less multiply)
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - isal is an optional extra ("minickpt[fast]")
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
"""The manifest's checksum of a buffer: CRC-32 as zlib computes it (whichever library does)."""
CRC_IMPL = "isal" if _isal_crc32 is not None else "zlib"

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_DATA_FILE_RE = re.compile(r"^data(\.[A-Za-z0-9_\-]{1,64})?\.bin$")
_SHARD_MANIFEST_RE = re.compile(r"^manifest\.p(\d{1,7})\.json$")


def _allowed_dtypes() -> dict[str, np.dtype]:
    names = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
    out = {n: np.dtype(n) for n in names}
    for n in ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn",
              "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4"]:
        if hasattr(ml_dtypes, n):
            out[n] = np.dtype(getattr(ml_dtypes, n))
    return out


DTYPES = _allowed_dtypes()


_NAME_OF: dict[np.dtype, str] = {}  # dtype -> checked name (numpy's dtype.name is slow)


def dtype_name(dtype: np.dtype) -> str:
    """The manifest's name for a dtype; refuses anything that is not plain numbers."""
    dt = np.dtype(dtype)
    name = _NAME_OF.get(dt)
    if name is not None:
        return name
    name = dt.name
    if name not in DTYPES or DTYPES[name] != dt.newbyteorder("="):
        raise UnsupportedLeafError(f"dtype {dt} cannot be stored (supported: {sorted(DTYPES)})")
    _NAME_OF[dt] = name
    return name




# names a checkpoint directory already uses for itself (compared case-insensitively: on
# macOS and Windows "_checkpoint_metadata" is the same file)
RESERVED_NAMES = frozenset({"_checkpoint_metadata"})


def check_name(name: str, what: str = "item name") -> str:
    """Item and file names must be plain names: no separators, no '..', no hidden files, and
    none of the names the checkpoint itself uses (:data:`RESERVED_NAMES`)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"{what} {name!r} is not allowed: use letters, digits, '_', '-' and '.', "
                         "not starting with '.' or '-'")
    if name.lower() in RESERVED_NAMES:
        raise ValueError(f"{what} {name!r} is reserved: the checkpoint keeps its own metadata "
                         "under that name; call the item something else")
    return name


_KEY_SHAPES: dict[str, tuple[int, ...] | None] = {}
_IMPL_RE = re.compile(r"^[a-z0-9_]{1,64}$")


KNOWN_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg", "philox2x32", "philox4x32", "threefry4x32")


@functools.lru_cache(maxsize=64)
def canonical_impl(impl: str) -> str:
    """The name ``jax.random.key(..., impl=)`` and ``wrap_key_data`` accept for a key
    implementation, given its name as ``str(jax.random.key_impl(key))`` wrote it. JAX 0.4.30
    writes the short tag (``"fry"`` for ``threefry2x32``), newer JAX the name, and each accepts
    only names: a checkpoint written by either restores under both. Unknown: unchanged.

    It lives with the format's names (a manifest stores the name as the writer's JAX printed
    it), below :mod:`minickpt.tree`, which uses it too; JAX is imported on first use, as in
    :func:`key_data_shape`."""
    import jax

    try:
        jax.random.key(0, impl=impl)
        return impl
    except Exception:  # not a name this JAX accepts: perhaps another JAX's way to print it
        pass
    for name in KNOWN_IMPLS:  # as key_impl prints it here, or its tag: the dtype "key<fry>"
        try:
            key = jax.random.key(0, impl=name)
            if impl in (str(jax.random.key_impl(key)), str(key.dtype)[4:-1]):
                return name
        except Exception:  # this JAX lacks that implementation
            continue
    return impl


def key_data_shape(impl: str) -> tuple[int, ...] | None:
    """The trailing data shape of a PRNG key implementation JAX knows (None if unknown).

    Only plain lower-case names reach JAX, and JAX only looks them up in its registry.
    """
    if not _IMPL_RE.match(impl):
        return None
    if impl not in _KEY_SHAPES:
        import jax

        try:
            name = canonical_impl(impl)  # JAX 0.4.30 wrote "fry" for threefry2x32
            _KEY_SHAPES[impl] = tuple(jax.eval_shape(
                lambda: jax.random.key_data(jax.random.key(0, impl=name))).shape)
        except (ValueError, TypeError, KeyError):
            _KEY_SHAPES[impl] = None
    return _KEY_SHAPES[impl]


def json_text(value: Any) -> str:
    """``json.dumps(value)``, byte for byte, without its per-call cost for the plain values
    (strings, integers, finite floats, booleans, None) that most fields of a manifest or
    the metadata are: a tiny save writes a few dozen, and each ``json.dumps`` call builds
    an encoder first."""
    t = type(value)
    if t is str:
        return encode_basestring_ascii(value)
    if t is int:
        return int.__repr__(value)
    if value is None:
        return "null"
    if t is bool:
        return "true" if value else "false"
    if t is float and math.isfinite(value):
        return float.__repr__(value)
    return json.dumps(value)
