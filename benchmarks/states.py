"""The states the figures save: tiny, 200 leaves, real Flax/Optax TrainStates, large.

Array contents are random normal numbers, like trained weights: Orbax compresses what it
writes, and zeros would flatter it with a ratio no real checkpoint has.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def nbytes(tree: Any) -> int:
    """Bytes of every array leaf (typed PRNG keys by their raw data)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                 jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if hasattr(leaf, "nbytes"):
            total += int(leaf.nbytes)
    return total


def num_leaves(tree: Any) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def abstract(tree: Any) -> Any:
    """The restore target Orbax users pass: shapes, dtypes and shardings, no data."""
    def f(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(f, tree)


def _rand(rng: np.random.Generator, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def tiny() -> dict[str, Any]:
    """Four leaves: a weight matrix, a bias, a step counter and a learning rate."""
    rng = np.random.default_rng(0)
    return {"w": _rand(rng, (4, 4)), "b": _rand(rng, (4,)),
            "step": jnp.asarray(7, jnp.int32), "lr": jnp.asarray(1e-3, jnp.float32)}


def leaves200(total_bytes: int = 80_000) -> dict[str, Any]:
    """200 leaves of about ``total_bytes`` together: 100 layers of weights and biases."""
    rng = np.random.default_rng(1)
    per_layer = max(total_bytes // 100 // 4, 2)  # float32 elements per layer
    bias = max(per_layer // 10, 1)
    return {f"layer_{i:03d}": {"w": _rand(rng, (per_layer - bias,)), "b": _rand(rng, (bias,))}
            for i in range(100)}


def uniform(total_bytes: int, leaves: int = 50, seed: int = 2) -> dict[str, Any]:
    """``leaves`` float32 arrays of equal size adding up to about ``total_bytes``."""
    rng = np.random.default_rng(seed)
    n = max(total_bytes // leaves // 4, 1)
    return {f"leaf_{i:03d}": _rand(rng, (n,)) for i in range(leaves)}


def train_state(hidden: int | None = None, layers: int = 1) -> Any:
    """A real Flax ``TrainState`` with Adam's moments.

    Without arguments it is :func:`minickpt.demo.make_state` (the course's model); with
    ``hidden``/``layers`` a wider MLP of the same kind, for a state of tens of megabytes.
    """
    if hidden is None:
        from minickpt.demo import make_state

        return make_state()
    import flax.linen as nn
    import optax
    from flax.training import train_state as ts

    class WideMLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = nn.relu(nn.Dense(hidden)(x))
            return nn.Dense(1)(x)

    model = WideMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, hidden)))
    return ts.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))



def many_leaves(leaves: int = 100_000, per_group: int = 100) -> dict[str, Any]:
    """``leaves`` tiny float32 arrays (4 values each), ``per_group`` to a sub-dict: a state
    made of very many small parameters (per-channel scales, many optimizer states), where
    a checkpoint's cost is per leaf, not per byte. Its data is 16 bytes a leaf; the state
    itself, 100,000 jax.Arrays, takes far more host memory than that (see
    ``benchmarks.memory``)."""
    rng = np.random.default_rng(4)
    data = rng.standard_normal((leaves, 4), dtype=np.float32)
    flat = jax.device_put([row.copy() for row in data])  # one batched transfer
    return {f"group_{g:04d}": {f"p_{j:03d}": flat[g * per_group + j]
                               for j in range(min(per_group, leaves - g * per_group))}
            for g in range((leaves + per_group - 1) // per_group)}
