"""The restore path's shortcuts (issue 19) change no answer: the quick check of a manifest
entry passes only entries the full check passes, and a lab's plugged-in task 1.1 function
still names the leaves of every restore."""

import copy

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import minickpt
from minickpt import item_manifest, labkit
from minickpt.errors import MiniCkptError as CheckpointError

GOOD = {"path": ["params", "w"], "kind": "array", "dtype": "float32", "shape": [2, 3],
        "nbytes": 24, "offset": 64, "crc32": 12345}

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**33), st.floats(allow_nan=False),
                   st.text(max_size=3), st.sampled_from(["float32", "int8", "O", "array",
                                                         "prng_key", "value"]),
                   st.lists(st.integers(-1, 4), max_size=3),
                   st.lists(st.text(max_size=2), max_size=2))


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from([*GOOD, "sharded", "scalar"]), value=VALUES,
       drop=st.booleans(), data_bytes=st.integers(0, 200))
def test_quick_entry_check_passes_only_what_the_full_check_passes(key, value, drop,
                                                                 data_bytes):
    e = copy.deepcopy(GOOD)
    if drop:
        e.pop(key, None)
    else:
        e[key] = value
    if item_manifest._plain_array_ok(e, "data.bin", data_bytes):
        item_manifest._check_entry_fully(e, 0, "m.json", "data.bin", data_bytes)  # no raise
    try:  # and the check as a whole raises exactly when the full one does
        item_manifest._check_entry_fully(copy.deepcopy(e), 0, "m.json", "data.bin", data_bytes)
        full_ok = True
    except (CheckpointError, TypeError, ValueError):
        full_ok = False
    try:
        item_manifest._check_entry(e, 0, "m.json", "data.bin", data_bytes)
        quick_ok = True
    except (CheckpointError, TypeError, ValueError):
        quick_ok = False
    assert quick_ok == full_ok, e


def test_good_entry_takes_the_quick_check():
    assert item_manifest._plain_array_ok(GOOD, "data.bin", 88)
    assert not item_manifest._plain_array_ok(GOOD, "data.bin", 87)  # ends past the file
    assert not item_manifest._plain_array_ok(GOOD, None, 88)


def test_a_plugged_in_flatten_names_the_leaves_of_every_restore(tmp_path):
    ref = labkit.reference("flatten_with_names")
    calls = []

    def flatten_with_names(tree):
        calls.append(1)
        return ref(tree)

    state = {"w": jax.numpy.arange(6.0).reshape(2, 3), "b": np.int32(3)}
    ck = minickpt.Checkpointer()
    ck.save(str(tmp_path / "c"), {"state": state})
    target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                                    if isinstance(x, jax.Array) else x, state)}
    plain = ck.restore(str(tmp_path / "c"), target)
    with labkit.plugged_in(flatten_with_names):
        got = ck.restore(str(tmp_path / "c"), target)
    assert len(calls) >= 2  # the structure check, and the restore's own naming
    for a, b in ((plain, got), (got, {"state": state})):
        assert labkit.tree_diff(a, b) is None
