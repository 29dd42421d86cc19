#!/usr/bin/env bash
# A real single-node Slurm on localhost, from Debian's packages (slurm-wlm, munge), for
# tests/test_slurm.py and for trying autograder/slurm/ without a cluster. Needs root.
#   bash scripts/install-slurm.sh start [STATE_DIR]   install if missing, configure, start; wait
#                                                      until `sinfo` shows the node idle
#   bash scripts/install-slurm.sh stop  [STATE_DIR]   cancel its jobs, stop its daemons, remove STATE_DIR
#   bash scripts/install-slurm.sh env   [STATE_DIR]   the line to eval so that sbatch & co talk to it
# Nothing outside STATE_DIR (default /tmp/minickpt-slurm) is configured: slurm.conf lives there
# and clients find it through SLURM_CONF, so an existing /etc/slurm is never touched. munged,
# slurmctld and slurmd run from there with their own socket, spool, state, pid and log files;
# the controller and the node are this host at 127.0.0.1. No cgroups (proctrack/linuxproc,
# task/none): it runs in a container. Only the daemons this script started (their pid files)
# are stopped.
set -euo pipefail
. "$(dirname "$0")/apt.sh"
cmd="${1:-start}"
STATE="$(realpath -m "${2:-${MINICKPT_SLURM_STATE:-/tmp/minickpt-slurm}}")"
CONF="$STATE/slurm.conf"
NODE="$(hostname -s)"
CTLD_PORT="${MINICKPT_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${MINICKPT_SLURMD_PORT:-6818}"
say() { echo "install-slurm: $*" >&2; }

stop_pid() {  # stop_pid PIDFILE NAME: TERM, up to 20 s, then KILL; only that pid
  local f="$1" pid
  [ -s "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    say "stopped $2 (pid $pid)"
  fi
  rm -f "$f"
}

case "$cmd" in
  env)
    echo "export SLURM_CONF=$CONF"
    exit 0 ;;
  stop)
    if [ -f "$CONF" ] && command -v scancel >/dev/null 2>&1; then
      SLURM_CONF="$CONF" timeout 20 scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pid "$STATE/run/slurmd.pid" slurmd
    stop_pid "$STATE/run/slurmctld.pid" slurmctld
    stop_pid "$STATE/munge/munged.pid" munged
    case "$STATE" in /|/tmp|/root|/home) say "refusing to remove $STATE"; exit 1 ;; esac
    rm -rf "$STATE"
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop|env [STATE_DIR]" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || { say "needs root (the daemons, the munge key, the job's users)"; exit 1; }
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 ||
   ! command -v munged >/dev/null 2>&1 || ! command -v sbatch >/dev/null 2>&1; then
  can_apt || { say "slurm-wlm and munge are missing, and apt-get is not usable here"; exit 1; }
  say "installing slurm-wlm and munge with apt-get (about a minute)"
  apt_install slurm-wlm munge
  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 ||
    { say "apt-get install slurm-wlm munge failed"; exit 1; }
fi
if [ -s "$STATE/run/slurmctld.pid" ] && kill -0 "$(cat "$STATE/run/slurmctld.pid")" 2>/dev/null; then
  say "already running from $STATE (stop it first: $0 stop $STATE)"
  exit 1
fi

rm -rf "$STATE"
mkdir -p "$STATE"/{ctld,spool,run,log,munge,munge-socket}
chmod 755 "$STATE"
if ! runuser -u munge -- test -x "$STATE"; then
  say "the munge user cannot reach $STATE: every folder above it must be world-searchable" \
      "(chmod o+x), e.g. a folder in /tmp"
  rm -rf "$STATE"
  exit 1
fi

# munge: a key of our own (0400 in a 0700 folder), its socket in STATE_DIR (a folder every
# job's user may enter), run as the munge user
chown munge: "$STATE/munge" "$STATE/munge-socket"
chmod 700 "$STATE/munge"
chmod 755 "$STATE/munge-socket"
runuser -u munge -- mungekey --create --keyfile "$STATE/munge/munge.key" --force
chmod 400 "$STATE/munge/munge.key"
SOCK="$STATE/munge-socket/munge.socket"
runuser -u munge -- munged --socket "$SOCK" --key-file "$STATE/munge/munge.key" \
  --pid-file "$STATE/munge/munged.pid" --log-file "$STATE/munge/munged.log" \
  --seed-file "$STATE/munge/munged.seed"
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.2; done
[ -S "$SOCK" ] || { say "munged did not start: $(tail -3 "$STATE/munge/munged.log")"; exit 1; }
munge --socket "$SOCK" -n | unmunge --socket "$SOCK" >/dev/null ||
  { say "munge does not decode its own credential"; exit 1; }

CPUS="$(nproc)"
MEM_MB="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
cat > "$CONF" <<EOF
# written by scripts/install-slurm.sh: one node, this host, at 127.0.0.1
ClusterName=minickpt
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
KillWait=10
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$CONF"
slurmctld -f "$CONF" || { say "slurmctld did not start: $(tail -5 "$STATE/log/slurmctld.log")"; exit 1; }
slurmd -f "$CONF" -N "$NODE" || { say "slurmd did not start: $(tail -5 "$STATE/log/slurmd.log")"; exit 1; }
for _ in $(seq 120); do
  state="$(sinfo -h -N -n "$NODE" -o %t 2>/dev/null || true)"
  [ "$state" = idle ] && break
  sleep 0.5
done
if [ "$state" != idle ]; then
  say "the node is '${state:-not listed}' after 60 s, not idle:"
  tail -5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
  exit 1
fi
say "Slurm $(sinfo -V | awk '{print $2}') is up: node $NODE idle, $CPUS CPU(s), ${MEM_MB} MB;" \
    "eval \"\$($0 env $STATE)\" to use it"
