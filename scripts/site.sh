#!/usr/bin/env bash
# Build the course site into site/_build/html: the landing page, the six chapters executed (with
# their outputs, figures and math), the six labs as students receive them, the minickpt API from
# its docstrings, the authors' guide and the instructors' grading guide.
# Works on a fresh clone: scripts/bootstrap.sh installs the pinned environment (the [site] extra
# included). Chapters are executed once per commit and shared with the test suite
# (scripts/chapter_cache.py): a build after the tests, or a second build, executes nothing.
#     bash scripts/site.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONHASHSEED=0
exec .venv/bin/python scripts/site.py "$@"
