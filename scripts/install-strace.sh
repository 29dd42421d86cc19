#!/usr/bin/env bash
# Install strace, which chapters 2 and 3 use to show which files Orbax fsyncs and reads (where
# it is missing, or ptrace is forbidden, those cells print why and show less). Needs root and
# apt-get; elsewhere it says what to do. Idempotent. CI runs it (scripts/test.sh).
set -euo pipefail
. "$(dirname "$0")/apt.sh"
command -v strace >/dev/null 2>&1 && exit 0
if ! can_apt; then
  echo "install-strace: strace is missing (e.g. sudo apt-get install strace); chapters 2 and 3" >&2
  echo "  then skip their system-call traces" >&2
  exit 0
fi
apt_install strace
command -v strace >/dev/null 2>&1 || echo "install-strace: COULD NOT INSTALL strace" >&2
