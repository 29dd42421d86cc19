"""Key paths and host snapshots (lab 1's tasks 1.1 and 1.2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minickpt.errors import UnsupportedLeafError
from minickpt.format.spec import canonical_impl
from minickpt.tree import (
    HostKey,
    flatten_with_names,
    from_skeleton,
    nest,
    path_str,
    skeleton,
    to_host,
    unflatten_like,
)


def test_flatten_names_dict_keys_indices_and_fields():
    from minickpt.demo import make_state

    names = [path_str(n) for n, _ in flatten_with_names(make_state(0))]
    assert "params/params/Dense_0/kernel" in names
    assert "opt_state/0/mu/params/Dense_1/bias" in names
    assert names[0] == "step"


def test_unflatten_like_roundtrip_and_missing():
    tree = {"a": [jnp.ones(2), (jnp.zeros(1),)], "b": None}
    flat = dict(flatten_with_names(tree))
    back = unflatten_like(tree, flat)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    del flat[("a", "0")]
    with pytest.raises(KeyError, match="a/0"):
        unflatten_like(tree, flat)


def test_skeleton_keeps_empty_containers_and_none():
    import optax

    tree = {"opt": optax.adam(1e-3).init({"w": jnp.ones(2)}), "n": None, "e": {}, "t": ()}
    skel, leaves = skeleton(tree)
    back = from_skeleton(skel, [leaf for _, leaf in leaves])
    assert back["n"] is None and back["e"] == {} and back["t"] == ()
    assert back["opt"][1] == {}  # optax's EmptyState() survives as an empty record


class Twin:
    """A pytree node whose two children claim the same key name."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    Twin, lambda t: (((jax.tree_util.GetAttrKey("x"), t.a), (jax.tree_util.GetAttrKey("x"), t.b)),
                     None),
    lambda _, kids: Twin(*kids))


def test_duplicate_paths_are_refused():
    with pytest.raises(ValueError, match="unique"):
        flatten_with_names({"t": Twin(jnp.ones(1), jnp.zeros(1))})
    with pytest.raises(ValueError, match="unique"):
        skeleton({"t": Twin(jnp.ones(1), jnp.zeros(1))})


def test_to_host_keeps_dtypes_and_copies_on_request():
    x = jnp.arange(4, dtype=jnp.bfloat16)
    h = to_host(x)
    assert isinstance(h, np.ndarray) and h.dtype == jnp.bfloat16
    c = to_host(x, copy=True)
    assert c.flags.owndata and c.flags.writeable
    k = to_host(jax.random.key(1))
    assert isinstance(k, HostKey) and canonical_impl(k.impl) == "threefry2x32" and k.data.dtype == np.uint32
    assert to_host(3) == 3 and to_host("s") == "s" and to_host(None) is None
    assert isinstance(to_host(np.float64(2.0)), np.ndarray)
    with pytest.raises(UnsupportedLeafError, match="pickle"):
        to_host(np.array([{}], dtype=object), path="p")


def test_nest_is_the_inverse_of_flattening():
    tree = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    assert nest(flatten_with_names(tree)) == tree


def test_a_key_impl_as_any_jax_printed_it_restores():
    """JAX 0.4.30 prints threefry's impl as its tag 'fry', newer JAX as 'threefry2x32'; a
    checkpoint holds what ``str(jax.random.key_impl(key))`` gave, and must restore under both."""
    assert canonical_impl("threefry2x32") == "threefry2x32"
    assert canonical_impl("fry") == "threefry2x32"
    assert canonical_impl("rbg") == "rbg"
    assert canonical_impl("no_such_impl") == "no_such_impl"
    here = str(jax.random.key_impl(jax.random.key(0)))
    assert canonical_impl(here) == "threefry2x32"


def test_a_host_key_written_under_another_jax_becomes_a_key_again():
    """JAX 0.4.30 names threefry2x32 "fry" in what it writes; newer JAX accepts only names:
    a HostKey carrying either spelling makes the same key, under either JAX."""
    key = jax.random.key(7)
    data = np.asarray(jax.random.key_data(key))
    for spelling in ("fry", "threefry2x32", str(jax.random.key_impl(key))):
        back = HostKey(data, spelling).to_jax()
        assert jax.random.key_impl(back) == jax.random.key_impl(key), spelling
        assert np.array_equal(jax.random.key_data(back), data), spelling
