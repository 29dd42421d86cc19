#!/usr/bin/env bash
# Check the version ranges pyproject.toml promises, at both ends:
#   bash scripts/versions.sh newest    the newest releases the package index serves today
#   bash scripts/versions.sh oldest    the library's and the notebooks' own dependencies
#                                      ([project] dependencies, the colab and fast extras: numpy,
#                                      jax, ml_dtypes, flax, optax, orbax-checkpoint, msgpack,
#                                      matplotlib, isal) at the floor each range admits, like
#                                      uv's --resolution lowest-direct; the tools (Jupyter,
#                                      nbgrader, pytest ...) and everything else newest. (The
#                                      tools' floors are not installable with today's pip:
#                                      ipykernel 6.0.0's metadata is invalid for pip >= 24.1.)
# Each builds its own environment in .versions/<mode>/venv (kept: a re-run reuses it unless
# pyproject.toml changed), installs minickpt[course,dev] into it, and runs
#   1. the library tests (tests/, without the grading, course and notebook tests),
#   2. every chapter top to bottom (tests/test_notebooks.py),
#   3. every lab solution in a plain kernel (tests/test_course.py, as students run them),
# and writes .versions/<mode>/report.md: the versions installed and what passed, with the
# date, as a line for the version table in docs/versions.md. CPU-heavy (tens of minutes): run it before
# a release, not in CI (CI installs constraints.txt). Extra arguments go to every pytest run
# (e.g. -x, or -k 'not crash'). PYTHON=python3.12 picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
shift || true
case "$mode" in
  newest|oldest) ;;
  *) echo "usage: bash scripts/versions.sh newest|oldest [pytest args...]" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
dir=".versions/$mode"
venv="$dir/venv"
mkdir -p "$dir"

# The floors: every ">=" of [project] dependencies and the colab and fast extras, as "==".
"$PY" - "$mode" > "$dir/pins.txt" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + [d for extra in ("colab", "fast")
                                  for d in project["optional-dependencies"][extra]]
seen = {}
for d in deps:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*", d.split(";")[0])
    if m:
        name = m.group(1).lower().replace("_", "-")
        seen[name] = m.group(2)
if sys.argv[1] == "oldest":
    for name, floor in sorted(seen.items()):
        print(f"{name}=={floor}")
EOF

want="$(cat pyproject.toml "$dir/pins.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
  echo "versions: installing minickpt[course,dev] ($mode) into $venv" >&2
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
        -c "$dir/pins.txt" -e ".[course,dev]" > "$dir/install.log" 2>&1; then
    echo "versions: the $mode environment cannot be installed; see $dir/install.log" >&2
    tail -20 "$dir/install.log" >&2
    printf '| %s | install failed (%s) |\n' "$mode" "$(date -u +%F)" > "$dir/report.md"
    exit 1
  fi
  echo "$want" > "$venv/.stamp"
fi

export PATH="$PWD/$venv/bin:$PATH" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
unset XLA_FLAGS
versions="$("$venv/bin/python" - <<'EOF'
from importlib.metadata import version
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes"]
print(", ".join(f"{n} {version(n)}" for n in names))
EOF
)"
echo "versions ($mode): $versions"

library=$(ls tests/test_*.py | grep -v -E 'test_(grading_|course|notebooks|site)' | tr '\n' ' ')
declare -A result
run() {  # name, then the pytest arguments
  local name="$1"; shift
  echo "versions ($mode): $name" >&2
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  local tail_line
  tail_line="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|no tests ran|error' "$dir/$name.log" | tail -1)"
  result[$name]="$( [ $rc -eq 0 ] && echo "pass" || echo "FAIL" ): ${tail_line//=/}"
  echo "  $name: ${result[$name]}" >&2
  return $rc
}
status=0
run library $library "$@" || status=1
run chapters tests/test_notebooks.py -k chapter_runs_top_to_bottom "$@" || status=1
run labs tests/test_course.py -k plain_kernel "$@" || status=1

{
  echo "| $mode | $versions | library: ${result[library]} | chapters: ${result[chapters]} |" \
       "labs: ${result[labs]} | $(date -u +%F) |"
} | tee "$dir/report.md"
exit $status
