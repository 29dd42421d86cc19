#!/usr/bin/env bash
# Execute every chapter and lab solution on the accelerator JAX finds (one process per notebook,
# no Jupyter kernel) and write a Markdown table of error cells, skipped parts and verdicts.
#   JAX_PLATFORMS= bash scripts/device-check.sh --out table.md            # all notebooks
#   JAX_PLATFORMS= bash scripts/device-check.sh --out t.md chapters/03_resume.ipynb
# JAX_PLATFORMS must be set on purpose: empty lets JAX take the accelerator, "cpu" checks on the
# CPU. docs/devices.md says how the lead runs it on a TPU and where its table goes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${JAX_PLATFORMS+set}" ]; then
  echo "device-check: set JAX_PLATFORMS on purpose (empty: the accelerator JAX finds; cpu: the CPU)" >&2
  exit 2
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" scripts/device_check.py "$@"
