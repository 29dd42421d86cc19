"""Test setup: JAX on CPU with 4 host devices, so sharding is exercised without a GPU."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def small_tree():
    """A little tree with the awkward cases: bfloat16, a typed key, scalars, None, empty."""
    import jax.numpy as jnp
    return {
        "params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3, jnp.bfloat16)},
        "step": 7,
        "rng": jax.random.key(3),
        "legacy_rng": jax.random.PRNGKey(5),
        "name": "run-1",
        "empty": np.zeros((0, 2), np.int8),
        "nothing": None,
    }


def tree_equal(a, b) -> bool:
    """Leaf-by-leaf exact equality (NaN == NaN, dtypes must match, keys by their data)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            if not (hasattr(y, "dtype") and jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)):
                return False
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (int, float, complex, str, bool)) and not hasattr(x, "dtype"):
            if type(x) is not type(y):
                return False
            if x != y and not (x != x and y != y):
                return False
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.tobytes() != y.tobytes():
            return False
    return True


_FINGERPRINTS: dict[int, str] = {}


@pytest.fixture
def reference_fingerprint():
    """``fn(total)``: the fingerprint of minickpt.demo's run trained uninterrupted to ``total``
    steps, in this process (computed once per total)."""

    def fn(total: int) -> str:
        if total not in _FINGERPRINTS:
            from minickpt.demo import fingerprint, make_state, train

            st, key, _ = train(make_state(), jax.random.key(42), 0, total)
            _FINGERPRINTS[total] = fingerprint((st, key))
        return _FINGERPRINTS[total]

    return fn


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """A JAX compilation cache shared by the training subprocesses of the tests: each
    restart loads the programs the first run compiled (as a production restart should)."""
    return str(tmp_path_factory.mktemp("jax-compile-cache"))


def pytest_terminal_summary(terminalreporter):
    """The crash-safety figures of this run (crash points, states, kills, cases)."""
    import sys

    harness = sys.modules.get("crash_harness")
    if harness is not None and harness.FIGURES:
        terminalreporter.section("crash safety figures")
        for name, value in harness.FIGURES.items():
            terminalreporter.write_line(f"{name:<40} {value}")


def pytest_collection_modifyitems(config, items):
    """test_grading_hardening's graded corpus (the tests on ``corpus`` and ``sliced``), the
    longest part of the suite, is collected first: under ``--dist loadscope``
    (scripts/test.sh) its module is then the first scope handed out, so one worker starts on
    it at once while the other takes the rest."""
    def in_corpus(item) -> bool:
        return item.module.__name__.endswith("test_grading_hardening") and \
            bool({"corpus", "sliced"} & set(getattr(item, "fixturenames", ())))

    items.sort(key=lambda item: not in_corpus(item))  # stable: the rest keep their order
