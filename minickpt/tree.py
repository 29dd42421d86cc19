"""Pytrees as checkpoints see them: key paths, flattening against a target, host snapshots.

A checkpoint stores a pytree as a flat list of leaves, each named by its *key path* — the
sequence of dict keys, list indices and attribute names from the root to the leaf. Names are
kept as strings (``("opt_state", "0", "mu", "Dense_0", "kernel")``) so that a dict key, a
dataclass field and a list index of the same name match across versions of a model: this is
what lets a ``TrainState`` saved today restore into a plain dict tomorrow, and back.

Lab 1 rebuilds :func:`flatten_with_names`, :func:`unflatten_like` and :func:`to_host`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .errors import UnsupportedLeafError
from .format.buffers import aligned_empty
from .format.spec import canonical_impl

Names = tuple[str, ...]

log = logging.getLogger("minickpt")


# ---------------------------------------------------------------------------------------
# key paths
# ---------------------------------------------------------------------------------------
def key_name(key: Any) -> str:
    """One step of a JAX key path as a string: dict key, index or attribute name."""
    t = type(key)  # the exact key types first: one dict look-up instead of four isinstance
    if t is _DICT_KEY:
        k = key.key
        return k if type(k) is str else str(k)
    get = _KEY_PARTS.get(t)
    if get is not None:
        return str(get(key))
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.GetAttrKey):
        return key.name
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


_DICT_KEY = jax.tree_util.DictKey
_KEY_PARTS: dict[type, Any] = {jax.tree_util.SequenceKey: lambda k: k.idx,
                               jax.tree_util.GetAttrKey: lambda k: k.name,
                               jax.tree_util.FlattenedIndexKey: lambda k: k.key}


def path_names(path: Iterable[Any]) -> Names:
    """A JAX key path as a tuple of strings."""
    return tuple(map(key_name, path))


def path_str(names: Iterable[str]) -> str:
    """How a leaf is named to people: ``params/Dense_0/kernel`` (``<root>`` for a bare leaf).

    Fast and plain, for messages; where two leaves must never read the same (a listing, a
    diff), use :func:`display_path`.
    """
    names = tuple(names)
    return "/".join(names) if names else "<root>"


def display_path(names: Iterable[str]) -> str:
    """:func:`path_str`, but one string per leaf, never the same for two: a name that holds a
    ``/`` (or a ``"``, or is empty, or is ``<root>``) is shown JSON-quoted, so the dict key
    ``"a/b"`` reads ``"a/b"`` and the nested ``a`` → ``b`` reads ``a/b``."""
    names = tuple(names)
    if not names:
        return "<root>"
    return "/".join(_shown(n) for n in names)


def _shown(name: str) -> str:
    if not name or "/" in name or '"' in name or name == "<root>":
        return json.dumps(name, ensure_ascii=False)
    return name


def flatten_with_names(tree: Any) -> list[tuple[Names, Any]]:
    """Task 1.1 — the leaves of ``tree`` with their key paths as string tuples, in tree order.

    ``None`` is an empty subtree in JAX, so it has no leaf here (the skeleton keeps it).
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = [(path_names(p), leaf) for p, leaf in leaves]
    seen: set[Names] = set()
    for names, _leaf in out:
        if names in seen:
            raise ValueError(f"two leaves share the key path {path_str(names)!r}; "
                             "a checkpoint needs every path to be unique")
        seen.add(names)
    return out


# the library's own task 1.1 function, in a tuple: labkit.plugged_in swaps every module
# attribute that *is* it, and skeleton() must keep telling the two apart (a student's
# version is always walked and checked, never served from the cache)
_LIBRARY_FLATTEN = (flatten_with_names,)


def unflatten_like(target: Any, values: Mapping[Names, Any]) -> Any:
    """Task 1.1 (back) — a tree shaped like ``target`` whose leaves come from ``values``.

    Raises ``KeyError`` naming the first path of ``target`` missing from ``values``.
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for p, _ in paths:
        names = path_names(p)
        if names not in values:
            raise KeyError(f"no value for {path_str(names)!r}")
        leaves.append(values[names])
    return jax.tree_util.tree_unflatten(treedef, leaves)


def nest(named: Iterable[tuple[Names, Any]]) -> Any:
    """Nested dicts from ``(names, value)`` pairs — the inverse of flattening to names."""
    root: dict[str, Any] = {}
    for names, value in named:
        if not names:
            return value
        node = root
        for n in names[:-1]:
            node = node.setdefault(n, {})
            if not isinstance(node, dict):
                raise ValueError(f"{path_str(names)} is both a leaf and a subtree")
        node[names[-1]] = value
    return root


# ---------------------------------------------------------------------------------------
# skeletons: the container structure, for restoring without a target
# ---------------------------------------------------------------------------------------
def _children_or_leaf(node: Any) -> list[tuple[str, Any]] | None:
    """The direct children of ``node``, or None if it is a leaf — one flatten, one level.

    (Asking "is it a leaf?" by flattening the whole subtree at every node made the walk
    quadratic in the depth of the tree.)
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if len(flat) == 1 and not flat[0][0] and flat[0][1] is node:
        return None
    return [(key_name(p[0]), child) for p, child in flat]


# leaves that need no pytree look-up (a jax.Array is checked separately)
_PLAIN_LEAVES = (np.ndarray, np.generic, bool, int, float, complex, str)


def skeleton(tree: Any, *, fast: bool = True) -> tuple[dict[str, Any], list[tuple[Names, Any]]]:
    """The JSON-able container structure of ``tree``, and its named leaves in tree order
    (exactly what :func:`flatten_with_names` returns, which this calls).

    Containers become ``{"t": "dict" | "list" | "tuple" | "namedtuple" | "node", ...}`` and
    each leaf ``{"t": "leaf", "i": index}``. Class names are recorded for people to read, never
    imported back (a checkpoint must not choose which code runs).

    Plain dicts, lists, tuples and array leaves are walked directly, as JAX itself orders
    them (dict keys sorted); every other node goes through JAX's own flattening.
    ``fast=False`` sends every node through JAX — the reference the fast path is tested
    against.

    The structure of a tree a training loop saves again and again does not change: with the
    library's own :func:`flatten_with_names`, the walk's result is cached under JAX's
    ``treedef`` and the leaves' names (a changed key, container type, node class or leaf
    count changes one of them) and handed out as a fresh copy each time.
    """
    own = fast and flatten_with_names is _LIBRARY_FLATTEN[0]
    if own:  # the cache's key: JAX's treedef and the leaves' names, from one flattening
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [(path_names(p), leaf) for p, leaf in flat]
        key = (treedef, tuple(names for names, _leaf in leaves))
        try:
            cached = _SKELETONS.get(key)
        except Exception:  # a node whose aux data cannot be hashed or compared: no cache
            own, cached = False, None
        if cached is not None:  # its names were unique when it was built: they are now
            return json.loads(cached), leaves
    leaves = flatten_with_names(tree)  # on a miss: with its check that names are unique
    index = {names: i for i, (names, _leaf) in enumerate(leaves)}
    if len(index) != len(leaves):
        raise ValueError("two leaves share a key path; a checkpoint needs every path to be "
                         "unique")
    visited = 0

    def leaf(node: Any, names: Names) -> dict[str, Any]:
        nonlocal visited
        i = index.get(names)
        if i is None or leaves[i][1] is not node:
            raise ValueError(f"flatten_with_names gave no leaf {path_str(names)!r} for this "
                             "leaf of the tree: leaves must be named by their key paths")
        visited += 1
        return {"t": "leaf", "i": i}

    def walk(node: Any, names: Names) -> dict[str, Any]:
        if len(names) > MAX_DEPTH:
            raise ValueError(f"tree is nested deeper than {MAX_DEPTH} levels at {path_str(names)}")
        if node is None:
            return {"t": "none"}
        if fast:
            t = type(node)
            if isinstance(node, (jax.Array, *_PLAIN_LEAVES)):
                return leaf(node, names)
            if t is dict:
                try:
                    keys = sorted(node)  # JAX orders a dict's children by sorted key
                except TypeError:
                    keys = None  # unorderable keys: let JAX decide (and explain)
                if keys is not None:
                    return {"t": "dict", "type": "dict",
                            "c": [[_json_key(k), walk(node[k], (*names, str(k)))]
                                  for k in keys]}
            elif t is list or t is tuple:
                return {"t": "list" if t is list else "tuple",
                        "c": [walk(child, (*names, str(i))) for i, child in enumerate(node)]}
        kids = _children_or_leaf(node)
        if kids is None:
            return leaf(node, names)
        if isinstance(node, Mapping) and not _is_namedtuple(node):
            keys = [_json_key(k) for k in _dict_keys(node, kids)]
            return {"t": "dict", "type": type(node).__name__,
                    "c": [[k, walk(child, (*names, name))]
                          for k, (name, child) in zip(keys, kids, strict=True)]}
        if isinstance(node, list) or (isinstance(node, tuple) and not _is_namedtuple(node)):
            return {"t": "list" if isinstance(node, list) else "tuple",
                    "c": [walk(child, (*names, name)) for name, child in kids]}
        kind = "namedtuple" if _is_namedtuple(node) else "node"
        return {"t": kind, "type": type(node).__name__,
                "c": [[name, walk(child, (*names, name))] for name, child in kids]}

    skel = walk(tree, ())
    if visited != len(leaves):
        raise ValueError(f"flatten_with_names gave {len(leaves)} leaves, the tree has {visited}")
    if own:
        if len(_SKELETONS) >= _SKELETONS_MAX:
            _SKELETONS.clear()  # many structures in one process: start over, never grow
        _SKELETONS[key] = json.dumps(skel)
    return skel, leaves


# (treedef, leaf names) -> the skeleton as JSON: json.loads rebuilds it in C, several times
# faster than the walk, and every caller gets its own copy to keep or change
_SKELETONS: dict[tuple[Any, tuple[Names, ...]], str] = {}
_SKELETONS_MAX = 64

MAX_DEPTH = 200


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _dict_keys(node: Any, kids: list[tuple[str, Any]]) -> list[Any]:
    # tree_flatten_with_path sorts dict keys; recover the original key objects in that order
    by_name = {str(k): k for k in node.keys()}
    return [by_name.get(name, name) for name, _ in kids]


def _json_key(k: Any) -> Any:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        return str(k)
    return k


def from_skeleton(skel: Mapping[str, Any], leaves: list[Any]) -> Any:
    """Rebuild a tree from :func:`skeleton`'s output: dicts, lists, tuples and ``None``.

    Named tuples and other nodes come back as dicts of their fields, because a checkpoint
    never names the code to rebuild them with. Pass a target to get the real classes back.
    """

    def build(node: Mapping[str, Any], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"skeleton is nested deeper than {MAX_DEPTH} levels")
        t = node["t"]
        if t == "leaf":
            return leaves[node["i"]]
        if t == "none":
            return None
        if t == "dict" or t == "namedtuple" or t == "node":
            return {k: build(child, depth + 1) for k, child in node["c"]}
        if t == "list":
            return [build(child, depth + 1) for child in node["c"]]
        if t == "tuple":
            return tuple(build(child, depth + 1) for child in node["c"])
        raise ValueError(f"unknown container type {t!r} in skeleton")

    return build(skel, 0)


# ---------------------------------------------------------------------------------------
# host snapshots
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostKey:
    """A typed PRNG key on the host: its raw ``uint32`` data plus the name of its impl.

    What a saved typed key (``jax.random.key``) restores as without a target: a restore
    without a target puts nothing on a device, and numpy has no key dtype. :meth:`to_jax`
    makes it a key again; a restore into a target key gets the key directly.
    """

    data: np.ndarray
    impl: str

    def to_jax(self, device: Any = None) -> jax.Array:
        """The typed key array again (on ``device``, a device or sharding, if given)."""
        return jax.random.wrap_key_data(jax.device_put(self.data, device),
                                        impl=canonical_impl(self.impl))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[: self.data.ndim - len(_impl_key_shape(self.impl))])


def _impl_key_shape(impl: str) -> tuple[int, ...]:
    try:
        return tuple(jax.random.key_data(jax.random.key(0, impl=canonical_impl(impl))).shape)
    except Exception:  # unknown impl: assume the common 2-word key
        return (2,)


SCALAR_TYPES = (bool, int, float, complex, str)


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # key dtypes are never numpy dtypes
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# Platforms whose device memory reaches the host only through a transfer into a new buffer.
_TRANSFER_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})


def _transfer_made_a_copy(x: jax.Array) -> bool:
    """Whether ``np.asarray(x)`` is certainly a fresh host buffer rather than a view of x.

    On GPU and TPU an array in device memory comes to the host by a device-to-host transfer
    into a new (read-only, never rewritten) numpy buffer: that buffer already *is* a snapshot,
    so copying it again would only double the time and memory of the "photo". On CPU, and for
    arrays placed in host memory kinds, ``np.asarray`` may be a zero-copy view of the array's
    own buffer, which a later donation may hand to XLA to overwrite. When unsure: False (copy).
    """
    try:
        sharding = x.sharding
        platforms = {d.platform for d in sharding.device_set}
        kind = sharding.memory_kind
    except Exception:  # an unusual array type: be safe and copy
        return False
    return bool(platforms) and platforms <= _TRANSFER_PLATFORMS and kind in (None, "device")


# ---- pinned zero-copy views (CPU) ------------------------------------------------------
# On the CPU backend ``np.asarray(x)`` of a single-buffer jax.Array is a view of the array's
# own buffer, and (in the JAX versions probed below) that view *pins* the buffer: while it is
# alive, a jitted step that donates x does not get the buffer (XLA allocates a new output),
# and ``x.delete()`` leaves the bytes alone. JAX never writes into an array's buffer
# otherwise, so such a view is as good a snapshot as a copy, without the copy's time. That
# guarantee is JAX behaviour, not API: it is checked once at run time, and without it every
# snapshot is a copy again.

_PIN_LOCK = threading.Lock()
_pinning: bool | None = None  # the probe's verdict, once it has run


def pinning_works() -> bool:
    """Whether zero-copy views pin CPU buffers against donation and deletion (probed once)."""
    global _pinning
    with _PIN_LOCK:
        if _pinning is None:
            _pinning = _probe_pinning()
            if not _pinning:
                log.debug("minickpt: a numpy view does not pin a CPU jax.Array's buffer in "
                          "jax %s: async snapshots copy every CPU array", jax.__version__)
        return _pinning


@contextlib.contextmanager
def own_thread_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Collect the warnings the *calling thread* shows while the block runs; pass every other
    thread's on, untouched, to wherever they were going.

    ``warnings.catch_warnings(record=True)`` cannot do this: the warnings machinery is one per
    process, so it records (and hides) every thread's warnings — a data loader's deprecation
    warning during the pinning probe would turn pinning off for the whole run, and vanish.
    Here only ``showwarning`` is wrapped: filters stay as the program set them (so this thread
    sees what it would have seen), and the wrapper stops collecting when the block ends, even
    if someone else's ``catch_warnings`` puts it back later.
    """
    me, caught, done = threading.get_ident(), [], threading.Event()
    shown_before = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if not done.is_set() and threading.get_ident() == me:
            caught.append(warnings.WarningMessage(message, category, filename, lineno, file,
                                                  line))
        elif shown_before is getattr(warnings, "_showwarning_orig", None):
            # the default display; a surrounding catch_warnings(record=True) swaps what it
            # calls (_showwarnmsg_impl), so go through that, not straight to stderr
            impl = getattr(warnings, "_showwarnmsg_impl", None)
            msg = warnings.WarningMessage(message, category, filename, lineno, file, line)
            impl(msg) if impl is not None else shown_before(message, category, filename,
                                                             lineno, file, line)
        else:
            shown_before(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield caught
    finally:
        done.set()
        if warnings.showwarning is show:
            warnings.showwarning = shown_before


def _probe_pinning() -> bool:
    """Take a view of a small CPU array, donate the array to a jitted step, delete it: the
    view must still hold the original values, with no error and no warning on the way (from
    this thread: other threads' warnings are none of the probe's business, and go on to
    where they were going, :func:`own_thread_warnings`)."""
    try:
        cpu = jax.devices("cpu")
        expected = np.arange(1024, dtype=np.float32)
        with own_thread_warnings() as caught:
            donate = jax.jit(lambda a: a * 0 - 7, donate_argnums=0)
            arrays = [jax.device_put(expected, cpu[0]) + 0]  # +0: a buffer XLA owns
            if len(cpu) > 1:  # a replicated array: the view pins one of its buffers
                from jax.sharding import NamedSharding, PartitionSpec
                mesh = jax.sharding.Mesh(np.array(cpu[:2]), ("d",))
                arrays.append(jax.device_put(arrays[0] + 0,
                                             NamedSharding(mesh, PartitionSpec())))
            for x in arrays:
                view = pinned_view(x, probe=False)
                if view is None:
                    return False
                y = donate(x)
                y.block_until_ready()
                if x.is_deleted() or not np.array_equal(view, expected) \
                        or not np.all(np.asarray(y) == -7):
                    return False
                x.delete()
                del y
                if not np.array_equal(view, expected):
                    return False
        return not caught
    except Exception as e:  # any surprise: copy, as before
        log.debug("minickpt: the pinning probe failed: %s: %s", type(e).__name__, e)
        return False


def pinned_view(x: jax.Array, *, probe: bool = True) -> np.ndarray | None:
    """A zero-copy numpy view that pins one buffer of a CPU ``jax.Array``, or None.

    None when pinning cannot stand in for a copy: the array is not on the CPU, has several
    distinct shards (``np.asarray`` would assemble them: a copy anyway), lives in a special
    memory kind, is a PRNG key, or the probe (:func:`pinning_works`) said no.
    """
    try:
        if is_prng_key(x) or not x.is_fully_addressable:
            return None
        sharding = x.sharding
        if {d.platform for d in sharding.device_set} != {"cpu"} \
                or sharding.memory_kind not in (None, "device", "unpinned_host"):
            return None
        if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
            return None
        if probe and not pinning_works():
            return None
        view = np.asarray(x)
        ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    except Exception:  # an unusual array type: not pinned, the caller copies
        return None
    return view if view.ctypes.data in ptrs and view.size == x.size else None


def _copy(a: np.ndarray) -> np.ndarray:
    """A C-ordered copy in 64-byte-aligned memory, which a direct write sends from its own
    pages (see ``format.encode``) instead of through a bounce buffer."""
    out = aligned_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def to_host(x: Any, *, copy: bool = False, path: str = "<leaf>") -> Any:
    """Task 1.2 — one leaf brought to host memory with its exact dtype.

    * ``jax.Array`` → ``numpy.ndarray`` of the same dtype (bfloat16 stays bfloat16). On CPU
      this is a zero-copy view unless ``copy=True``; an async save needs the copy, because
      the device buffer may be donated or overwritten after ``save()`` returns. (On GPU/TPU
      the transfer itself makes the copy, so ``copy=True`` does not copy a second time.)
    * typed PRNG key (``jax.random.key``) → :class:`HostKey` (raw data + impl name).
    * numpy arrays and scalars stay numpy; Python scalars, strings and ``None`` stay as is, and
      so does a :class:`HostKey` (with ``copy=True``, one of copied data).
    * anything else (object arrays, functions...) is refused: storing it would need pickle.
    """
    if isinstance(x, np.generic):  # before Python scalars: np.float64 subclasses float
        x = np.asarray(x)
    elif x is None or isinstance(x, SCALAR_TYPES):
        return x
    elif isinstance(x, HostKey):  # already on the host; copy=True still promises a copy
        return HostKey(_copy(x.data), x.impl) if copy else x
    if isinstance(x, jax.Array):
        if is_prng_key(x):
            data = np.asarray(jax.random.key_data(x))
            return HostKey(np.array(data, copy=True) if copy else data,
                           str(jax.random.key_impl(x)))
        arr = np.asarray(x)
        return _copy(arr) if copy and not _transfer_made_a_copy(x) else arr
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedLeafError(
                f"leaf {path} is a numpy array of dtype {x.dtype}: object arrays hold "
                "Python objects and could only be stored with pickle, which minickpt never "
                "uses. Convert it to a numeric array or a list of strings.")
        return _copy(x) if copy else x
    raise UnsupportedLeafError(
        f"leaf {path} is a {type(x).__module__}.{type(x).__qualname__}: minickpt stores "
        "arrays, numbers, strings and None. If it is code (a function, an optimizer), keep "
        "it out of the saved tree; if it is data, convert it to an array first.")


def snapshot_leaf(x: Any, *, path: str = "<leaf>", pin: bool = False) -> Any:
    """Task 5.1 — one leaf as a host "photo" that nothing done to ``x`` after this returns can change.

    Returns the leaf as minickpt writes it (what :func:`to_host` returns for it: a numpy array
    with the leaf's dtype and bytes, a :class:`HostKey` for a typed key, a Python scalar,
    string or None as it is). Guarantees: no in-place write into a numpy leaf, no
    ``x.delete()`` and no donation of ``x``'s buffer to a jitted step, after this returns,
    changes the result. With ``pin=False`` the result never shares memory with ``x``; with
    ``pin=True`` a CPU array whose buffer JAX can pin costs no copy. A leaf minickpt cannot
    store raises :class:`UnsupportedLeafError` naming ``path``, now rather than later in a
    background thread.
    """
    if pin and isinstance(x, jax.Array):
        view = pinned_view(x)
        if view is not None:
            return view
    return to_host(x, copy=True, path=path)
