#!/bin/bash
# A one-node SLURM cluster on this machine, for trying slurm/*.sbatch and for the `slurm` tests.
#
#   slurm/local-cluster.sh up       # install (Debian: slurmctld slurmd slurm-client munge), configure, start
#   slurm/local-cluster.sh status   # daemons and node state
#   slurm/local-cluster.sh down     # stop the daemons and delete the state folder
#   export SLURM_CONF="$(slurm/local-cluster.sh conf)"   # then sbatch / squeue / scontrol talk to it
#
# Everything lives in one state folder, UNICON_SLURM_DIR (default ${TMPDIR:-/tmp}/unicon-slurm):
# slurm.conf, a munge key and socket of our own, spool/state/log dirs and pid files. Nothing under
# /etc is written, so a real SLURM or munge on the machine is left alone: clients find this cluster
# only through SLURM_CONF. The node is `localhost` with CPUs=$(nproc); process tracking without
# cgroups (proctrack/linuxproc, task/none) so it runs in containers. Daemons run as the calling
# user, which must be root (slurmd starts job steps as the submitting user).
# `up` is idempotent: a running cluster is left as it is (its slurm.conf is kept); `up` after a
# crash restarts what is missing. Ports: UNICON_SLURM_PORT (slurmctld, default 6817) and +1 (slurmd).
set -euo pipefail

DIR="${UNICON_SLURM_DIR:-${TMPDIR:-/tmp}/unicon-slurm}"
PORT="${UNICON_SLURM_PORT:-6817}"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "local-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

pid_alive() {  # pid file -> 0 if it names a live process
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local missing=()
  for cmd in munged slurmctld slurmd sbatch; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}; installing ${PACKAGES[*]} needs root (apt-get)"
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install ${PACKAGES[*]}"
  log "installing ${PACKAGES[*]} (apt-get)"
  # Debian's packages try to start the daemons through the init system; in a container there is
  # none, and we start our own instances below anyway.
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 || die "apt-get update failed (no network to the Debian mirror?)"
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2 || die "apt-get install ${PACKAGES[*]} failed"
}

write_conf() {
  local cpus node_host
  # nproc honours OMP_NUM_THREADS (often 1 in tests); the node's CPUs are those we may run on
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
  node_host="$(hostname -s)"
  # slurmctld checks that SlurmctldHost is this machine's name; the address in brackets is where
  # clients and slurmd reach it. The node is called localhost (NodeHostname = the real name, which
  # slurmd matches itself by) and reached over loopback.
  cat >"$CONF" <<EOF
# Written by slurm/local-cluster.sh: a single-node cluster in $DIR
ClusterName=unicon-local
SlurmctldHost=$node_host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: works in containers and needs no cgroup.conf.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Requeue is what slurm/train.sbatch relies on; finished jobs stay visible to scontrol for 10 min.
JobRequeue=1
MinJobAge=600
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued (default 30).
KillWait=10
ReturnToService=2
SlurmdTimeout=60
NodeName=localhost NodeHostname=$node_host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_munge() {
  if pid_alive "$DIR/munge/munged.pid"; then return 0; fi
  [ -s "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none; }
  chmod 700 "$DIR/munge"
  chmod 400 "$DIR/munge/munge.key"
  # --force: munged otherwise refuses to run as root and a socket folder it does not own.
  munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
}

start_daemons() {
  export SLURM_CONF="$CONF"
  if ! pid_alive "$DIR/slurmctld.pid"; then
    # -c: a fresh controller state (no jobs from an earlier cluster in this folder)
    slurmctld -c -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  fi
  if ! pid_alive "$DIR/slurmd.pid"; then
    slurmd -f "$CONF" -N localhost || die "slurmd did not start; see $DIR/log/slurmd.log"
  fi
}

wait_idle() {  # the node answers and takes jobs
  local state=""
  for _ in $(seq 1 60); do
    state="$(SLURM_CONF="$CONF" sinfo -h -N -n localhost -o %T 2>/dev/null || true)"
    case "$state" in
      idle*|mixed*|allocated*) return 0 ;;
      down*|drain*) SLURM_CONF="$CONF" scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node not ready after 30 s (state: ${state:-no answer}); see $DIR/log/"
}

up() {
  [ "$(id -u)" -eq 0 ] || die "needs root (slurmd runs job steps as the submitting user)"
  install_packages
  mkdir -p "$DIR"/{state,spool,log,munge}
  if ! pid_alive "$DIR/slurmctld.pid"; then write_conf; fi  # a running cluster keeps its config
  start_munge
  start_daemons
  wait_idle
  log "up: $(SLURM_CONF="$CONF" sinfo -h -o '%P %D node(s) %c CPUs %T') -- export SLURM_CONF=$CONF"
}

down() {
  local f pid jobs
  if pid_alive "$DIR/slurmctld.pid"; then
    # Cancel jobs first: their steps live in slurmstepd processes that outlive slurmd.
    jobs="$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086  # one job id per word
      SLURM_CONF="$CONF" scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 60); do
        [ -z "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null || true)" ] && break
        sleep 0.5
      done
    fi
  fi
  for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    pid_alive "$f" || continue
    pid="$(cat "$f")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then log "pid $pid ($f) ignores SIGTERM; SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
  done
  rm -rf "$DIR"
  log "down"
}

status() {
  local f name
  for f in munge/munged.pid slurmctld.pid slurmd.pid; do
    name="$(basename "$f" .pid)"
    if pid_alive "$DIR/$f"; then echo "$name: running (pid $(cat "$DIR/$f"))"; else echo "$name: stopped"; fi
  done
  if pid_alive "$DIR/slurmctld.pid"; then
    SLURM_CONF="$CONF" sinfo -N -o '%N %P %c %T'
    SLURM_CONF="$CONF" squeue
    echo "export SLURM_CONF=$CONF"
  else
    return 3  # like `service status`: not running
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  conf) echo "$CONF" ;;
  *) echo "usage: $0 up|down|status|conf" >&2; exit 2 ;;
esac
