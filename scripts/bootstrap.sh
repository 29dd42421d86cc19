#!/usr/bin/env bash
# Make .venv hold exactly what constraints.txt pins (the course, dev and site extras), once.
# Re-runs are instant: a stamp records the hash of pyproject.toml + constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.13 python3.12 python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      PY="$c"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: Python 3.11 or newer is needed" >&2; exit 1; }

want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
stamp=.venv/.minickpt-stamp
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing the course environment into .venv (first run: a few minutes)" >&2
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt \
  -e ".[course,dev,site]"
echo "$want" > "$stamp"
