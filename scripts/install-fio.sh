#!/usr/bin/env bash
# Install fio, the standard disk benchmark the suite measures the disk's limit with
# (benchmarks/machine.py). Debian/Ubuntu package; needs root and apt-get; elsewhere it says what
# to do. Idempotent: does nothing when fio is already installed. benchmarks/run.sh runs it.
# Without fio the suite still runs: its limit is then a single write+fsync stream, labelled
# "probe, not fio" in the table.
set -euo pipefail
. "$(dirname "$0")/apt.sh"
if command -v fio >/dev/null 2>&1; then
  exit 0
fi
if ! can_apt; then
  echo "install-fio: fio is missing; install it as root, e.g." >&2
  echo "  sudo apt-get install fio      (Debian/Ubuntu)" >&2
  echo "  sudo dnf install fio          (Fedora)" >&2
  echo "Without it the benchmark's disk limit is a simple probe (labelled so in the table)." >&2
  exit 0
fi
echo "install-fio: installing fio with apt-get" >&2
apt_install fio
if command -v fio >/dev/null 2>&1; then
  echo "install-fio: $(fio --version)" >&2
else
  echo "install-fio: COULD NOT INSTALL fio: the disk limit will be a probe, not fio" >&2
fi
