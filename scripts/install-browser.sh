#!/usr/bin/env bash
# Install the browser the site test (tests/test_site.py) opens every page in: Debian's chromium
# and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver). Needs root and apt-get;
# elsewhere it says what to do, and the browser test skips with the same advice.
# Idempotent: does nothing when both are already installed. CI runs it (scripts/test.sh).
set -euo pipefail
. "$(dirname "$0")/apt.sh"
have() { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }
if have; then
  exit 0
fi
if ! can_apt; then
  echo "install-browser: chromium and chromium-driver are missing; install them as root, e.g." >&2
  echo "  sudo apt-get install chromium chromium-driver      (Debian/Ubuntu)" >&2
  echo "Without them tests/test_site.py skips its browser checks (the site still builds)." >&2
  exit 0
fi
echo "install-browser: installing chromium and chromium-driver with apt-get (about a minute)" >&2
pkgs=(chromium chromium-driver)
apt_install "${pkgs[@]}"
if have; then
  echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null | head -1)" >&2
else
  echo "install-browser: COULD NOT INSTALL chromium/chromium-driver: the browser test skips" >&2
fi
