# Sourced by scripts/install-*.sh: the one way this project installs a Debian package.
# can_apt: true when we are root and apt-get exists (CI's fresh machine; a student's laptop
# usually is not, and the scripts then print what to run instead).
# apt_install PACKAGE...: install quietly, without recommends; refresh the package index only
# when the first try fails (a fresh image has none). Never fails: the caller checks the result
# and says what is missing, because every test that needs the package skips or degrades loudly.
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1; } ||
    true
}
