#!/usr/bin/env bash
# Install what grade.sh isolates student code with: bubblewrap (bwrap), and setpriv/prlimit
# (util-linux, present on Debian/Ubuntu). Needs root and apt-get; elsewhere it says what to do.
# Idempotent: does nothing when bwrap is already installed. CI runs it (scripts/test.sh).
set -euo pipefail
. "$(dirname "$0")/apt.sh"
# cgroups: grade.sh makes one per parallel slot itself (autograder/cgroups.py, as root): cgroup v2
# with the cpu, memory and pids controllers, or v1's cpu, memory and pids hierarchies. Say so
# when neither is there (grade.sh then marks every result: CPU and memory bounded per process).
cg=/sys/fs/cgroup
if ! { grep -qw memory "$cg/cgroup.controllers" 2>/dev/null ||
       { [ -d "$cg/cpu" ] && [ -d "$cg/memory" ] && [ -d "$cg/pids" ]; }; }; then
  echo "install-sandbox: no usable cgroups at $cg (v2 controllers or v1 cpu/memory/pids): a" >&2
  echo "  submission's CPU and memory are bounded per process only (results are marked)" >&2
fi
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if ! can_apt; then
  echo "install-sandbox: bubblewrap is missing; install it as root, e.g." >&2
  echo "  sudo apt-get install bubblewrap      (Debian/Ubuntu)" >&2
  echo "  sudo dnf install bubblewrap          (Fedora)" >&2
  echo "Without it grade.sh still grades, but WITHOUT isolating student code (it warns)." >&2
  exit 0
fi
echo "install-sandbox: installing bubblewrap with apt-get" >&2
apt_install bubblewrap
if command -v bwrap >/dev/null 2>&1; then
  echo "install-sandbox: $(bwrap --version)" >&2
else
  echo "install-sandbox: COULD NOT INSTALL bubblewrap: grade.sh will not isolate student code" >&2
fi
