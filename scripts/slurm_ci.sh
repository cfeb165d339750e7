#!/usr/bin/env bash
# A real one-node Slurm cluster for the Slurm tests (tests/functional_tests/test_slurm_cluster.py).
#
# As root on Debian: installs slurm-wlm with apt-get (once), writes a slurm.conf for this host under a fresh
# temporary directory (no munge: AuthType=auth/none, CredType=cred/none; no cgroups: proctrack/linuxproc,
# task/none), starts slurmctld and slurmd in the foreground of this script (no systemd), waits until the node is
# idle, runs the tests marked `slurm`, and on exit (success, failure or Ctrl-C) cancels the jobs and stops every
# daemon it started. Nothing is written outside the temporary directory, so a second run starts from scratch.
#
#   bash scripts/slurm_ci.sh                 # the Slurm tests
#   bash scripts/slurm_ci.sh -k requeue      # extra arguments go to pytest
#   PYTHON=/path/to/python bash scripts/slurm_ci.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
WAIT_S=${SLURM_CI_WAIT_S:-60}

die() { echo "slurm_ci: $*" >&2; exit 1; }

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && return 0
  [ "$(id -u)" = 0 ] || die "installing slurm-wlm needs root (or install it first: apt-get install slurm-wlm)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Debian's packages register systemd units but, without systemd running, start nothing.
  apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null
}

refuse_running_cluster() {
  local running
  running=$(pgrep -x slurmctld; pgrep -x slurmd) || true
  [ -z "$running" ] || die "a slurmctld/slurmd is already running here (pids: $(echo "$running" | tr '\n' ' ')); \
stop it first: this script starts its own on the default ports 6817/6818"
}

# The configuration: this host as the only node, with at least the 2 CPUs the tests' 2-task jobs ask for.
write_conf() {
  local host=$1 cpus=$2 dir=$3
  cat >"$dir/slurm.conf" <<EOF
ClusterName=megatron-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job waits cred_expire seconds before it starts again (default 120).
AuthInfo=cred_expire=10
# ... and the scheduler then picks it up within sched_interval seconds (default 60).
SchedulerParameters=sched_interval=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  mkdir -p "$dir/state" "$dir/spool"
}

wait_for() {  # wait_for COMMAND...: retry COMMAND once a second for up to WAIT_S seconds; 1 on timeout
  local deadline=$((SECONDS + WAIT_S))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 1
  done
}

node_idle() { [ "$(sinfo -h -n "$HOST" -o %t 2>/dev/null)" = idle ]; }
queue_empty() { [ -z "$(squeue -h -o %i 2>/dev/null)" ]; }

show_logs() {
  for log in "$DIR/slurmctld.log" "$DIR/slurmd.log"; do
    [ -f "$log" ] && { echo "--- $log (last 30 lines)"; tail -n 30 "$log"; }
  done >&2
}

# Runs on every exit: cancel what is still queued, stop our daemons (TERM, then KILL after 10 s), then the
# job steps they left (slurmstepd processes that were not there before we started), then remove the directory.
cleanup() {
  local status=$?
  [ -z "${TESTS_PID:-}" ] || kill -TERM "$TESTS_PID" 2>/dev/null || true
  if [ -n "${CTLD_PID:-}${SLURMD_PID:-}" ]; then
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    WAIT_S=20 wait_for queue_empty || echo "slurm_ci: jobs still queued after 20 s; stopping anyway" >&2
  fi
  local pid
  for pid in ${SLURMD_PID:-} ${CTLD_PID:-}; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in ${SLURMD_PID:-} ${CTLD_PID:-}; do
    timeout 10 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
  for pid in $(pgrep -x slurmstepd || true); do
    grep -qx "$pid" <<<"$STEPD_BEFORE" || kill -KILL "$pid" 2>/dev/null || true
  done
  [ $status -eq 0 ] || show_logs
  [ -n "${DIR:-}" ] && rm -rf "$DIR"
  exit $status
}

main() {
  local start=$SECONDS
  install_slurm
  refuse_running_cluster
  HOST=$(hostname -s)
  # The node's name is also the rendezvous host the training ranks take from SLURM_NODELIST.
  getent hosts "$HOST" >/dev/null || die "this host's name $HOST does not resolve; add it to /etc/hosts"
  DIR=$(mktemp -d "${TMPDIR:-/tmp}/megatron-slurm.XXXXXX")
  STEPD_BEFORE=$(pgrep -x slurmstepd || true)
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  local cpus
  cpus=$(nproc)
  write_conf "$HOST" $((cpus > 2 ? cpus : 2)) "$DIR"
  export SLURM_CONF=$DIR/slurm.conf
  # In the foreground of a background job, so that their pids are ours; --pdeathsig stops them even when this
  # script is killed with SIGKILL and its trap cannot run.
  local guard=()
  setpriv --help 2>/dev/null | grep -q pdeathsig && guard=(setpriv --pdeathsig TERM)
  "${guard[@]}" slurmctld -D -i -f "$SLURM_CONF" >>"$DIR/slurmctld.out" 2>&1 &
  CTLD_PID=$!
  "${guard[@]}" slurmd -D -N "$HOST" -f "$SLURM_CONF" >>"$DIR/slurmd.out" 2>&1 &
  SLURMD_PID=$!
  wait_for node_idle || { show_logs; die "node $HOST not idle after ${WAIT_S}s: $(sinfo -h -o '%t %E' 2>&1)"; }
  echo "slurm_ci: Slurm $(sinfo -V | cut -d' ' -f2) up on $HOST in $((SECONDS - start))s (config $SLURM_CONF)"
  # In the background, so that a TERM to this script runs the cleanup at once (bash defers traps while a
  # foreground child runs).
  MEGATRON_SLURM_TESTS=1 PYTHON=$PYTHON "$PYTHON" -m pytest -q -rs -m slurm tests/functional_tests/test_slurm_cluster.py "$@" &
  TESTS_PID=$!
  wait "$TESTS_PID"
  echo "slurm_ci: done in $((SECONDS - start))s"
}

main "$@"
