#!/usr/bin/env bash
# The test suite: sets up .venv if needed, lints, then runs pytest (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONHASHSEED=0
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
