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


def pytest_configure(config):
    """A folder where the corpus runs of tests/test_grading_hardening.py leave their
    timings.csv (on any xdist worker), for the summary at the end of the run."""
    import tempfile

    if not hasattr(config, "workerinput") and "MINICKPT_CORPUS_TIMINGS" not in os.environ:
        os.environ["MINICKPT_CORPUS_TIMINGS"] = tempfile.mkdtemp(prefix="minickpt-corpus-")
        config._corpus_timings = os.environ["MINICKPT_CORPUS_TIMINGS"]


def pytest_unconfigure(config):
    """The timings folder this run made is removed once the summary is written."""
    import shutil

    folder = getattr(config, "_corpus_timings", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("MINICKPT_CORPUS_TIMINGS", None)


def corpus_durations(folder: str, n: int = 10) -> list[str]:
    """Lines for the log: each corpus group's wall time, and the ``n`` slowest submissions
    of the whole corpus with where their time went (grade.sh's timings.csv)."""
    import csv
    import json
    from pathlib import Path

    lines, rows = [], []
    for path in sorted(Path(folder).glob("*.json")):
        g = json.loads(path.read_text())
        with open(path.with_suffix(".csv"), newline="") as f:
            mine = [{**r, "group": g["group"]} for r in csv.DictReader(f)]
        rows += mine
        slot = sum(float(r["seconds"]) for r in mine)
        lines.append(f"group {g['group']:<20} {g['submissions']:>3} submissions  "
                     f"{g['seconds']:>6.0f} s wall  {slot:>6.0f} s in slots (-j {g['jobs']}, "
                     f"cells {g['timeout']} s)")
    if not rows:
        return []
    lines.append(f"slowest {min(n, len(rows))} of {len(rows)} graded submissions:")
    for r in sorted(rows, key=lambda r: -float(r["seconds"]))[:n]:
        lines.append(f"{float(r['seconds']):7.1f}s {r['student']}/{r['lab']} ({r['group']}): "
                     f"kernel {r.get('kernel') or '-'} s, setup {r.get('setup') or '-'} s, "
                     f"cells {r.get('cells') or '-'} s (slowest {r.get('slowest_cell') or '-'} "
                     f"{r.get('slowest_cell_seconds') or '-'} s), cpu {r.get('cpu') or '-'} s, "
                     f"throttled {r.get('throttled') or '-'} s"
                     + (f", timed out: {r['timed_out']}" if r.get("timed_out") else "")
                     + (f"; judge {r['judge']} s (slowest {r.get('slowest_test') or '-'} "
                        f"{r.get('slowest_test_seconds') or '-'} s)" if r.get("judge") else ""))
    return lines


def pytest_terminal_summary(terminalreporter):
    """The crash-safety figures of this run (crash points, states, kills, cases), and where
    the graded corpus spent its time."""
    import sys

    harness = sys.modules.get("crash_harness")
    if harness is not None and harness.FIGURES:
        terminalreporter.section("crash safety figures")
        for name, value in harness.FIGURES.items():
            terminalreporter.write_line(f"{name:<40} {value}")
    folder = os.environ.get("MINICKPT_CORPUS_TIMINGS")
    lines = corpus_durations(folder) if folder and os.path.isdir(folder) else []
    if lines:
        terminalreporter.section("graded corpus: groups and slowest submissions")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    """The graded corpus's classes (tests/test_grading_hardening.py: those with a
    ``CORPUS_COST``, the longest parts of the suite) are collected first, the costliest
    first: under ``--dist loadscope --no-loadscope-reorder`` (scripts/test.sh) each class is
    a scope, handed out in this order, so both workers start grading at once and the rest of
    the suite fills the time after (and between) them."""
    def cost(item) -> float:
        return getattr(getattr(item, "cls", None), "CORPUS_COST", 0.0) or 0.0

    items.sort(key=lambda item: -cost(item))  # stable: the rest keep their order


@pytest.fixture
def box(tmp_path):
    """A grader drill's box (autograder/drills.py) as the grader makes it: sandboxed as root
    with a slot uid where this machine allows it (CI), else plain processes (the workers then
    run unsandboxed). MINICKPT_REQUIRE_SANDBOX=1 turns the fallback into a failure."""
    from autograder import drills, sandbox

    iso = sandbox.probe()
    if iso.mode != "bwrap-root":
        if os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"needs the sandbox as root (have {iso.mode}: {iso.detail})")
        yield drills.Box(sandbox.unsandboxed("a test without the sandbox"), 0, sandbox.Limits(),
                         {}, tmp_path)
        return
    with sandbox.SlotUids(1) as slot:
        os.chmod(tmp_path, 0o755)
        yield drills.Box(iso, slot.uids[0], sandbox.Limits(), {}, tmp_path)
