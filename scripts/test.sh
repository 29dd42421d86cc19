#!/usr/bin/env bash
# The test suite: sets up .venv if needed, lints, then runs pytest (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/install-sandbox.sh   # bubblewrap, to grade the hostile examples in isolation
bash scripts/install-strace.sh    # strace: chapters 2 and 3 trace what Orbax fsyncs and reads
bash scripts/install-browser.sh   # chromium + chromedriver, to open the built site (tests/test_site.py)
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONHASHSEED=0
# One JAX compilation cache for every process of the suite (hundreds of subprocesses, kernels
# and chapters compile the same training steps): roughly halves their CPU time. Graded
# submissions never see it (autograder.sandbox.SHARED_CACHE_ENV).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax-compile}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
if [ "$(id -u)" = 0 ]; then         # CI runs as root: the sandbox must work, not be skipped
  export MINICKPT_REQUIRE_SANDBOX="${MINICKPT_REQUIRE_SANDBOX:-1}"
fi
.venv/bin/ruff check .
# Both cores: each test module (and each class of the graded corpus) runs on one worker, its
# fixtures built once. The graded corpus of tests/test_grading_hardening.py, the longest part,
# is one class per lab (a grade.sh -j 2 run each), collected first and costliest first
# (tests/conftest.py) and handed out in that order (--no-loadscope-reorder): both workers
# grade from the start, and the rest of the suite fills the time after them.
# MINICKPT_TEST_WORKERS=0 runs everything in this process.
workers="${MINICKPT_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}"
[ "$workers" -gt 2 ] && workers=2
dist=()
[ "$workers" -gt 0 ] && dist=(-n "$workers" --dist loadscope --no-loadscope-reorder)
# --durations: the slowest steps, the site build and the graded corpus among them, in the log;
# the corpus's own slowest submissions and their phases follow (tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${dist[@]}" "$@"
