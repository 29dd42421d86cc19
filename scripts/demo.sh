#!/usr/bin/env bash
# Train a small Flax model, checkpoint it, kill it with SIGKILL, resume, compare bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" exec .venv/bin/python -m minickpt.demo "$@"
