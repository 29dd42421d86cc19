#!/usr/bin/env bash
# Grade a class on a Slurm cluster: three jobs, each waiting for the one before it.
#   1. fill  (fill-cache.sbatch)   the compilation cache, once: each lab's source notebook graded
#   2. array (grade-shard.sbatch)  N tasks, task I runs grade.sh --shard I/N    (afterany: 1)
#   3. merge (merge.sbatch)        grade.sh merge of the N slices into RESULTS  (afterok: 2)
#
#   bash autograder/slurm/submit.sh SUBMISSIONS --out RESULTS [--shards N] [--cpus C] [--wait]
#        [--sbatch "OPTIONS"] [-- GRADE_SH_OPTIONS...]
#
# SUBMISSIONS (a folder of <student>/<lab>/<lab>.ipynb, or a .zip) and this repository must be
# on a file system every node sees. RESULTS gets what one `grade.sh SUBMISSIONS --out RESULTS`
# writes; the slices, work folders and job logs go to RESULTS.parts/. --shards N: tasks in the
# array (default: one per 25 submissions). --cpus C: cores per task, its grade.sh -j (default
# 2). --sbatch: options for every sbatch (--partition, --account, --time, --mem...). --wait:
# return when the merge has ended, with its exit code, and print the summary. After `--`:
# grade.sh options (--lab, --source, --timeout, --wall, --memory, --compile-cache...).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
die() { echo "submit: $*" >&2; exit 2; }
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

SUBS="" RESULTS="" SHARDS="" CPUS=2 WAIT=0 SBATCH_OPTS=""
GRADE=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) RESULTS="${2:?--out wants a folder}"; shift 2 ;;
    --shards) SHARDS="${2:?--shards wants a number}"; shift 2 ;;
    --cpus) CPUS="${2:?--cpus wants a number}"; shift 2 ;;
    --sbatch) SBATCH_OPTS="${2?--sbatch wants options}"; shift 2 ;;
    --wait) WAIT=1; shift ;;
    --) shift; GRADE=("$@"); break ;;
    -*) die "unknown option $1 (grade.sh's options go after --; see --help)" ;;
    *) [ -z "$SUBS" ] || die "one SUBMISSIONS folder or zip, got '$SUBS' and '$1'"; SUBS="$1"; shift ;;
  esac
done
[ -n "$SUBS" ] || { usage >&2; die "no SUBMISSIONS given"; }
[ -n "$RESULTS" ] || die "--out RESULTS is needed (where the merged results go)"
[ -e "$SUBS" ] || die "$SUBS does not exist"
for a in "${GRADE[@]+"${GRADE[@]}"}"; do
  case "$a" in
    --out|--out=*|--work|--work=*|--shard|--shard=*|-j|--jobs|--jobs=*|-j[0-9]*)
      die "grade.sh's $a is set by submit.sh (--out, --cpus, --shards)" ;;
  esac
done
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "--cpus wants a positive number, got '$CPUS'"
command -v sbatch >/dev/null 2>&1 || die "sbatch is not on PATH (run this on a Slurm login node)"

SUBS="$(realpath "$SUBS")"
RESULTS="$(realpath -m "$RESULTS")"
PARTS="$RESULTS.parts"
MARK=".minickpt-grading"  # what grade.sh leaves in the folders it may empty (autograder/grade.py)
if [ -d "$RESULTS" ] && [ -n "$(ls -A "$RESULTS")" ] && [ ! -e "$RESULTS/$MARK" ]; then
  die "$RESULTS holds files grade.sh did not write; choose another --out"
fi
if [ -e "$PARTS" ]; then
  [ -e "$PARTS/.minickpt-slurm" ] || die "$PARTS exists and was not made by submit.sh"
  rm -rf "$PARTS"
fi

# the labs: those of the class (a folder), so the fill job fills only theirs
LABS=()
if [ -d "$SUBS" ]; then
  count=0
  for nb in "$SUBS"/*/*/*.ipynb; do
    [ -f "$nb" ] || continue
    lab="$(basename "$(dirname "$nb")")"
    [ "$(basename "$nb")" = "$lab.ipynb" ] || continue
    count=$((count + 1))
    case " ${LABS[*]-} " in *" $lab "*) ;; *) LABS+=("$lab") ;; esac
  done
  [ "$count" -gt 0 ] || die "no <student>/<lab>/<lab>.ipynb in $SUBS"
  [ -n "$SHARDS" ] || SHARDS=$(( (count + 24) / 25 ))
fi
SHARDS="${SHARDS:-8}"
[[ "$SHARDS" =~ ^[1-9][0-9]*$ ]] || die "--shards wants a positive number, got '$SHARDS'"
FILL_LABS=()
case " ${GRADE[*]-} " in
  *" --lab "*|*" --lab="*) ;;  # grade.sh's own --lab choice, passed on below
  *) for lab in "${LABS[@]+"${LABS[@]}"}"; do FILL_LABS+=(--lab "$lab"); done ;;
esac

# the environment, once, here: not raced for by N tasks starting together
bash "$ROOT/scripts/bootstrap.sh"
mkdir -p "$PARTS/logs"
echo "made by autograder/slurm/submit.sh for $RESULTS; emptied by its next run" > "$PARTS/.minickpt-slurm"

# shellcheck disable=SC2206  # --sbatch is a list of options, split on spaces
EXTRA=($SBATCH_OPTS)
common=(--parsable --cpus-per-task="$CPUS" --chdir="$PARTS" "${EXTRA[@]+"${EXTRA[@]}"}")
fill=$(sbatch "${common[@]}" --output="$PARTS/logs/fill.out" \
  "$HERE/fill-cache.sbatch" "$ROOT" "$PARTS" \
  "${FILL_LABS[@]+"${FILL_LABS[@]}"}" "${GRADE[@]+"${GRADE[@]}"}")
fill="${fill%%;*}"
array=$(sbatch "${common[@]}" --array="1-$SHARDS" --dependency="afterany:$fill" \
  --output="$PARTS/logs/shard-%a.out" \
  "$HERE/grade-shard.sbatch" "$ROOT" "$SUBS" "$PARTS" "$SHARDS" "${GRADE[@]+"${GRADE[@]}"}")
array="${array%%;*}"
wait_opt=()
[ "$WAIT" = 1 ] && wait_opt=(--wait)
echo "$fill $array" > "$PARTS/jobs"
echo "submit: fill job $fill, array $array (${SHARDS} task(s) of $CPUS core(s)); results in $RESULTS"
echo "submit: watch with: squeue -j $fill,$array    logs: $PARTS/logs/"
rc=0
merge=$(sbatch "${common[@]}" --cpus-per-task=1 --dependency="afterok:$array" \
  --kill-on-invalid-dep=yes --output="$PARTS/logs/merge.out" "${wait_opt[@]+"${wait_opt[@]}"}" \
  "$HERE/merge.sbatch" "$ROOT" "$PARTS" "$SHARDS" "$RESULTS") || rc=$?
merge="${merge%%;*}"
echo "$fill $array $merge" > "$PARTS/jobs"
if [ "$WAIT" = 1 ]; then
  [ -f "$RESULTS/summary.txt" ] && cat "$RESULTS/summary.txt"
  echo "submit: merge job $merge ended with exit $rc; results in $RESULTS"
  exit "$rc"
fi
echo "submit: merge job $merge; when it has ended: cat $RESULTS/summary.txt"
