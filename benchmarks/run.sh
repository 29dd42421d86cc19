#!/usr/bin/env bash
# The benchmark suite in one command: minickpt vs Orbax vs the machine's limits.
#   bash benchmarks/run.sh            full run (about 12 minutes on 2 cores when quiet)
#   bash benchmarks/run.sh --smoke    the harness at tiny sizes (under a minute)
# Any other option of `python -m benchmarks --help` passes through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/install-fio.sh  # the disk's limit (without it: a probe, labelled so)
exec .venv/bin/python -m benchmarks "$@"
