"""The device-side snapshot of an async save: copy on the accelerator now, bring it over later.

The host snapshot of an array on a GPU/TPU is its device-to-host transfer, and ``save()``
waits for all of it (on a TPU v5e, 400 MB took 100+ ms of the training loop). Here ``save()``
only *enqueues* a copy of each accelerator leaf on its own device (:func:`copy_on_device`:
``jnp.copy``, a jitted XLA copy with the leaf's sharding, into new buffers) and returns; the
background writer then transfers the copies to the host (:func:`fetch`), lays them out
exactly as :func:`minickpt.format.encode.plan_item` does, and writes.

Why the copy is a snapshot: it is an ordinary JAX computation that reads the leaf, dispatched
before ``save()`` returns, so everything the training loop dispatches afterwards — a step
that donates the leaf's buffer, ``x.delete()`` — comes after it in JAX's order of execution,
and JAX guarantees that a computation dispatched earlier sees the value it was given (that is
what makes ``y = f(x); state = step(state)`` with donation correct). The copy's buffers belong
to the snapshot alone and are freed when written.

It costs one state's worth of device memory until the transfer ends, so in the automatic mode
it is used only when the accelerator leaves fit in a fraction (:data:`MAX_FREE_FRACTION`) of
each device's free memory (``memory_stats()``); otherwise, or where a device has no memory
figures, the save takes the host snapshot as before. Everything else — numpy leaves, Python
scalars, typed PRNG keys (a few bytes), CPU arrays unless forced — is snapshot on the host in
``save()``, as before, and an unsupported leaf is refused there, before any copy is enqueued.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import UnsupportedLeafError
from .format import encode as _encode
from .format.encode import ItemPlan
from .format.spec import check_name, dtype_name
from .tree import Names, _transfer_made_a_copy, is_prng_key, path_str, skeleton, snapshot_leaf

FETCH_THREADS = 4
"""Transfers to the host in flight at once in :meth:`DeviceSnapshot.finish`."""
MAX_FREE_FRACTION = 0.5
"""The automatic mode copies on the device only if, on every device, the copies take at most
this fraction of its free memory (``bytes_limit - bytes_in_use``)."""


# ---- seams (tests replace them) ------------------------------------------------------------
def on_accelerator(x: Any) -> bool:
    """Whether the automatic mode copies ``x`` on its device: a fully addressable, non-key
    ``jax.Array`` in the device memory of a GPU/TPU (whose host snapshot is a transfer)."""
    return (isinstance(x, jax.Array) and not is_prng_key(x) and x.is_fully_addressable
            and _transfer_made_a_copy(x))


def accelerator_present() -> bool:
    """Whether JAX's default backend is an accelerator: on a CPU-only JAX the automatic mode
    looks no further (asked only once a save holds a ``jax.Array``)."""
    return jax.default_backend() != "cpu"


def copy_on_device(x: jax.Array) -> jax.Array:
    """A copy of ``x`` in new buffers on the same devices, with the same sharding; enqueued
    (asynchronous dispatch), not waited for."""
    return jnp.copy(x)


def fetch(x: jax.Array, path: str) -> np.ndarray:
    """The background transfer of one copy to host memory (``path`` names it in errors)."""
    return np.asarray(x)


def memory_stats(device: Any) -> Mapping[str, Any] | None:
    """The device's memory figures (``bytes_limit``, ``bytes_in_use``), or None."""
    try:
        return device.memory_stats()
    except Exception:  # a backend without them
        return None


# ---- the memory guard ----------------------------------------------------------------------
def bytes_per_device(leaves: Sequence[jax.Array]) -> dict[Any, int]:
    """The bytes the copies of ``leaves`` take on each device (a shard's worth per device)."""
    need: dict[Any, int] = {}
    for x in leaves:
        sharding = x.sharding
        nbytes = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in sharding.addressable_devices:
            need[d] = need.get(d, 0) + nbytes
    return need


def fits(leaves: Sequence[jax.Array], fraction: float = MAX_FREE_FRACTION) -> bool:
    """Whether the copies of ``leaves`` fit in ``fraction`` of every device's free memory;
    False where a device gives no figures."""
    for device, nbytes in bytes_per_device(leaves).items():
        stats = memory_stats(device)
        try:
            free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])  # type: ignore[index]
        except Exception:  # None, or no such figures
            return False
        if nbytes > fraction * free:
            return False
    return True


# ---- the snapshot --------------------------------------------------------------------------
@dataclass
class _Item:
    skel: dict[str, Any]
    names: list[Names]  # the leaves' paths: the state's own leaves are not kept
    hosts: list[Any]  # the host snapshot of each leaf; None where a copy is pending
    scalar: list[bool]
    copies: dict[int, jax.Array] = field(default_factory=dict)


class DeviceSnapshot:
    """Items whose accelerator leaves are being copied on their devices; :meth:`finish`
    (in the background) transfers them and returns the plans :meth:`Checkpointer.write
    <minickpt.checkpointer.Checkpointer.write>` takes."""

    def __init__(self, items: dict[str, _Item]):
        self._items = items

    def finish(self) -> dict[str, ItemPlan]:
        """Transfer every copy to the host (:data:`FETCH_THREADS` at a time), free it, and lay
        each item out. Raises what a transfer raises.

        Why a few at a time, each a blocking :func:`fetch` in its own thread: a blocking
        transfer waits without the GIL, while ``copy_to_host_async`` holds it for the
        transfer's set-up. On a TPU v5e (400 MB in 50 leaves), starting every transfer at once
        took 100 ms and cost the training loop beside it 85 ms; four threads took 140 ms and
        cost it 17 ms, one leaf after another 460 ms and 16 ms (``python -m
        benchmarks.d2h_probe``)."""
        try:
            jobs = [(it, i, c) for it in self._items.values() for i, c in it.copies.items()]
            if len(jobs) > 1 and FETCH_THREADS > 1:
                with ThreadPoolExecutor(min(FETCH_THREADS, len(jobs)),
                                        thread_name_prefix="minickpt-fetch") as pool:
                    done = [pool.submit(fetch, c, path_str(it.names[i])) for it, i, c in jobs]
                    for (it, i, _c), fut in zip(jobs, done, strict=True):
                        it.hosts[i] = fut.result()
                        del it.copies[i]  # on an accelerator: its device memory is freed now
            else:
                for it, i, c in jobs:
                    it.hosts[i] = fetch(c, path_str(it.names[i]))
                    del it.copies[i]
            return {name: _layout(it) for name, it in self._items.items()}
        finally:
            self.release()

    def release(self) -> None:
        """Drop every copy still held (freed on its device) and every host snapshot (a pinned
        view is unpinned once the plans made of it are cleared too)."""
        for it in self._items.values():
            it.copies.clear()
            it.hosts.clear()
        self._items.clear()


def take(items: Mapping[str, Any], *, force: bool, executor: Executor | None = None,
         pin: bool = False) -> DeviceSnapshot | None:
    """The blocking part of a device snapshot of ``items``, or None for a host snapshot.

    ``force=False`` (automatic): accelerator leaves (:func:`on_accelerator`) are copied on
    their devices if some exist and they :func:`fit`; ``force=True``: every fully addressable,
    non-key ``jax.Array`` is, CPU arrays included, whatever the free memory. Every other leaf
    is snapshot on the host now (:func:`minickpt.tree.snapshot_leaf`, pinned where ``pin``),
    and checked — an unsupported leaf or dtype raises :class:`UnsupportedLeafError` naming its
    item and path — before any copy is enqueued.
    """
    if not isinstance(items, Mapping) or not items:
        raise TypeError("items must be a non-empty mapping of item name to pytree, "
                        "e.g. {'params': params, 'opt_state': opt_state}")
    if not force and not (any(isinstance(leaf, jax.Array)
                              for leaf in jax.tree_util.tree_leaves(list(items.values())))
                          and accelerator_present()):
        return None  # the host snapshot, at the cost of one flattening
    flat: dict[str, tuple[dict[str, Any], list[tuple[Names, Any]]]] = {}
    chosen: dict[str, list[int]] = {}
    for name, tree in items.items():
        key = check_name(str(name))
        skel, named = skeleton(tree)
        flat[key] = (skel, named)
        chosen[key] = [i for i, (_n, leaf) in enumerate(named) if _eligible(leaf, force)]
    device_leaves = [flat[k][1][i][1] for k, idx in chosen.items() for i in idx]
    if not device_leaves or (not force and not fits(device_leaves)):
        return None
    out: dict[str, _Item] = {}
    for name, (skel, named) in flat.items():
        try:
            out[name] = _host_part(skel, named, set(chosen[name]), executor, pin)
        except UnsupportedLeafError as e:
            raise UnsupportedLeafError(f"item '{name}': {e}") from None
    for name, it in out.items():  # every leaf checked: now enqueue the copies
        named = flat[name][1]
        for i in chosen[name]:
            it.copies[i] = copy_on_device(named[i][1])
    return DeviceSnapshot(out)


def _eligible(leaf: Any, force: bool) -> bool:
    if not force:
        return on_accelerator(leaf)
    try:
        return isinstance(leaf, jax.Array) and not is_prng_key(leaf) \
            and leaf.is_fully_addressable
    except Exception:  # an unusual array type: the host snapshot decides
        return False


def _host_part(skel: dict[str, Any], named: list[tuple[Names, Any]], device: set[int],
               executor: Executor | None, pin: bool) -> _Item:
    """Snapshot on the host every leaf not copied on its device (large ones in ``executor``'s
    threads, as :func:`~minickpt.format.encode.plan_item` does); check the dtypes of the rest."""
    hosts: list[Any] = [None] * len(named)
    scalar = [isinstance(leaf, np.generic) for _n, leaf in named]
    futures: dict[int, Future[Any]] = {}
    for i, (names, leaf) in enumerate(named):
        if i in device:
            try:
                dtype_name(leaf.dtype)
            except UnsupportedLeafError as e:
                raise UnsupportedLeafError(f"leaf {path_str(names)}: {e}") from None
        elif executor is not None and getattr(leaf, "nbytes", 0) >= _encode._HOST_IN_THREAD_BYTES:
            try:
                futures[i] = executor.submit(snapshot_leaf, leaf, path=path_str(names), pin=pin)
            except RuntimeError:  # the executor is shut down (interpreter exit): do it here
                pass
    for i, (names, leaf) in enumerate(named):
        if i in device:
            continue
        fut = futures.get(i)
        hosts[i] = fut.result() if fut is not None else snapshot_leaf(
            leaf, path=path_str(names), pin=pin)
    return _Item(skel, [names for names, _leaf in named], hosts, scalar)


def _layout(it: _Item) -> ItemPlan:
    """The item's entries, byte views and offsets: :func:`~minickpt.format.encode.plan_item`'s
    layout, from leaves already on the host."""
    return _encode.lay_out(it.skel, zip(it.names, it.hosts, it.scalar, strict=True))
