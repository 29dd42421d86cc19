#!/usr/bin/env bash
# Grade submitted labs. With no argument: a tour of the example submissions of every lab (autograder/grade.py says which).
#   bash autograder/grade.sh [SUBMISSIONS_DIR_OR_ZIP] [--lab LAB] [--out DIR] [--help]
# Sets up .venv on first use (scripts/bootstrap.sh) and the sandbox (scripts/install-sandbox.sh). Exit code 2 only if grading itself failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
bash "$ROOT/scripts/install-sandbox.sh"                # bubblewrap, when root and apt-get allow
export PATH="$ROOT/.venv/bin:$PATH"                    # nbgrader runs `alembic`, the kernel `python`
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the autograder package
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"  # kernels share a GPU
exec "$ROOT/.venv/bin/python" -m autograder.grade "$@"
