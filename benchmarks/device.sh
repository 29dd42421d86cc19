#!/usr/bin/env bash
# The benchmark suite with the states' arrays on the accelerator JAX finds (issue 40, item 5).
#   bash benchmarks/device.sh OUT_DIR [FIGURE ...]
# Default figures: tiny trainstate large items huge async (huge: the 2 GB rows only). The table
# (OUT_DIR/table.md) says where the arrays lived and which file system the checkpoints were on.
# On a machine without the project's virtual environment (the borrowed TPU machine), the Python
# packages come from that machine's own index (/opt/pypi/simple) into /tmp/site, placed LAST on
# PYTHONPATH so that the machine's own (TPU) JAX stays first. No fio there: probe limits,
# labelled so; no cold rows (evicting a 9p file's cache is not measurable there).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash benchmarks/device.sh OUT_DIR [FIGURE ...]}
shift
FIGURES=("$@")
[ ${#FIGURES[@]} -eq 0 ] && FIGURES=(tiny trainstate large items huge async)
PY=python3
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif [ -d /opt/pypi/simple ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site \
    flax optax orbax-checkpoint matplotlib msgpack
  # ISA-L's CRC-32 (~7× zlib's): a wheel carried in .whl/ (the index has none; see
  # docs/performance.md, "On an accelerator"), else the index; the table says which one ran
  if compgen -G ".whl/isal-*.whl" > /dev/null; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/isal-*.whl
  else
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
      --index-url file:///opt/pypi/simple --target /tmp/site isal \
      || echo "device.sh: no isal in this machine's index: CRC-32 via zlib" >&2
  fi
  export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1
"$PY" -c 'import jax; print("JAX", jax.__version__, "on", jax.devices())'
mkdir -p "$OUT"
WORK=$(mktemp -d "$PWD/bench-out-device-XXXXXX")  # the checkpoints: on the repository's disk
trap 'rm -rf "$WORK"' EXIT
"$PY" -m benchmarks --only "${FIGURES[@]}" --huge-mb 2000 --reps-huge 5 --async-rounds 9 \
  --no-fio --no-cold --multihost off --out "$OUT" --dir "$WORK"
# where a tiny restore's time goes there, call by call, beside its floor (issue 51)
if [[ " ${FIGURES[*]} " == *" tiny "* ]]; then
  "$PY" -m benchmarks.restore_pieces --dir "$WORK" --reps 150 | tee "$OUT/restore_pieces.txt"
fi
