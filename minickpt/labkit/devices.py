"""The devices JAX sees and a real (Flax + Optax) training state on them, for every lab."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .checks import is_key


def devices() -> list[jax.Device]:
    """The devices of the default backend: the GPU/TPU on Colab, several CPUs locally."""
    return list(jax.devices())


def describe_devices() -> str:
    ds = devices()
    return f"JAX {jax.__version__} on {len(ds)} {ds[0].platform.upper()} device(s): " + \
        ", ".join(str(d) for d in ds)


def mesh() -> jax.sharding.Mesh:
    """A one-axis mesh (``"data"``) over every device."""
    return jax.sharding.Mesh(np.array(devices()), ("data",))


def shard(tree: Any) -> Any:
    """Place every array of ``tree`` on all devices: split along its first axis where that
    axis divides evenly, replicated otherwise. Keys and Python values stay as they are."""
    m = mesh()
    n = m.devices.size
    P = jax.sharding.PartitionSpec

    def place(x: Any) -> Any:
        if not isinstance(x, jax.Array) or is_key(x):
            return x
        spec = P("data") if x.ndim >= 1 and x.shape[0] % n == 0 and x.shape[0] >= n else P()
        return jax.device_put(x, jax.sharding.NamedSharding(m, spec))

    return jax.tree_util.tree_map(place, tree)


def drawn(seed: int) -> int:
    """``seed`` itself in a notebook; under the grader's judge, a seed drawn for this grading
    from it (its ``minickpt._graded.SALT``), so that the inputs a test generates cannot be
    known ahead, and no answer can be precomputed from the public repository. The judge
    computes what it expects from the same inputs, in its own process."""
    import sys

    salt = getattr(sys.modules.get("minickpt._graded"), "SALT", None)
    if not isinstance(salt, int):
        return seed
    import zlib

    return zlib.crc32(f"{salt}:{seed}".encode()) & 0x7FFFFFFF


def train_state(steps: int = 3, *, seed: int = 0, dtype: Any = None, sharded: bool = False
                ) -> tuple[Any, jax.Array]:
    """A real Flax ``TrainState`` (MLP + Adam, see :mod:`minickpt.demo`) after ``steps``
    training steps, and the dropout key that comes next.

    ``dtype`` casts the parameters and Adam's moments (e.g. ``jnp.bfloat16``); ``sharded``
    spreads the arrays over every device (:func:`shard`).
    """
    from ..demo import make_state, train

    seed = drawn(seed)
    state, rng = make_state(seed), jax.random.key(42 + seed)
    state = state.replace(step=jax.numpy.asarray(state.step, jax.numpy.int32))  # as after a step
    if steps:
        state, rng, _ = train(state, rng, 0, steps)
    if dtype is not None:
        def cast(x: Any) -> Any:
            if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
                return x.astype(dtype)
            return x
        state = state.replace(params=jax.tree_util.tree_map(cast, state.params),
                              opt_state=jax.tree_util.tree_map(cast, state.opt_state))
    if sharded:
        state = shard(state)
    return state, rng


def train(state: Any, rng: jax.Array, start: int, stop: int) -> tuple[Any, jax.Array]:
    """Steps ``start+1 .. stop`` of the lab's training run (the batch is a function of the
    step, so a resumed run sees the same data as an uninterrupted one)."""
    from ..demo import train as demo_train

    state, rng, _ = demo_train(state, rng, start, stop)
    return state, rng


def resume_rtol() -> float:
    """How closely a resumed run must match an uninterrupted one: bit for bit on CPU; on
    GPU/TPU reductions may run in another order, so a tiny relative difference is allowed."""
    return 0.0 if jax.default_backend() == "cpu" else 1e-5
