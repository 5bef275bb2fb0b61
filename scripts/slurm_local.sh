#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for the SLURM tests and `.ci/run`.
#
#   scripts/slurm_local.sh start    install (if missing), configure, start; waits until the node is idle
#   scripts/slurm_local.sh stop     stop slurmd and slurmctld started here
#   scripts/slurm_local.sh status   print sinfo; exit 0 only when the node is up
#
# Idempotent: `start` on a running cluster only checks it. Needs root (it writes /etc/slurm/slurm.conf
# and the munge key); it refuses to overwrite a slurm.conf it did not write.
#
# Knobs (environment): RESTAGE_SLURM_DIR (state, spool, logs; default /var/tmp/restage-slurm),
# RESTAGE_SLURM_CPUS (CPUs the node advertises; default max(8, nproc), so a test job can ask for several
# tasks on a 2-core machine: the jobs are tiny), RESTAGE_SLURM_PARTITION (default "restage").
set -euo pipefail
cd "$(dirname "$0")/.."

ACTION=${1:-status}
DIR=${RESTAGE_SLURM_DIR:-/var/tmp/restage-slurm}
PARTITION=${RESTAGE_SLURM_PARTITION:-restage}
CONF=/etc/slurm/slurm.conf
MARK="# written by restage scripts/slurm_local.sh"
HOST=$(hostname -s)
NCPU=$(nproc)
CPUS=${RESTAGE_SLURM_CPUS:-$(( NCPU > 8 ? NCPU : 8 ))}
# Leave 1 GiB to the system; a job that asks for no memory gets the default share.
MEM_MB=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 1024 ))

log() { echo "slurm_local: $*" >&2; }

node_state() { sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1 | tr -d '*~#$@'; }

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    log "$CONF exists and was not written by restage; refusing to overwrite it"
    exit 2
  fi
  mkdir -p /etc/slurm "$DIR/state" "$DIR/spool" "$DIR/log"
  local tmp
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
$MARK
ClusterName=restage-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# The node advertises RESTAGE_SLURM_CPUS CPUs even on a 2-core machine (test jobs sleep, they do not compute).
SlurmdParameters=config_overrides
# Requeue: submitit's checkpointing calls "scontrol requeue" on the pre-timeout signal.
JobRequeue=1
# Short kill grace and quick scheduling keep the scancel/requeue tests fast.
KillWait=5
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=20
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=30 DefaultTime=10 State=UP
EOF
  if ! cmp -s "$tmp" "$CONF" 2>/dev/null; then
    mv "$tmp" "$CONF"
    chmod 644 "$CONF"
    return 0  # changed
  fi
  rm -f "$tmp"
  return 1
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
  chmod 400 /etc/munge/munge.key
  munged --force
  for _ in $(seq 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    sleep 0.2
  done
  log "munged did not start"; exit 1
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  if [ "$(id -u)" != 0 ]; then log "start needs root"; exit 2; fi
  bash scripts/install_system.sh
  # srun --mpi=pmix (slurm.launcher=srun) needs the PMIx library that Slurm's plugin dlopens; slurmd
  # loads it at start, so it must be there before slurmd starts.
  if ! dpkg -s libpmix-dev >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libpmix2 libpmix-dev >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libpmix2 libpmix-dev >/dev/null; }
  fi
  local changed=0
  write_conf && changed=1
  start_munge
  if [ $changed = 1 ]; then
    # A new config: restart whatever this script started before so it is read.
    stop_daemons
  fi
  pid_alive "$DIR/slurmctld.pid" || slurmctld
  pid_alive "$DIR/slurmd.pid" || slurmd
  local state=""
  for _ in $(seq 150); do
    state=$(node_state || true)
    case "$state" in
      idle|mixed|allocated) log "node $HOST is $state (partition $PARTITION)"; return 0 ;;
      down|drain|drained|draining|fail)
        scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  log "node $HOST did not become idle (state '${state}'); see $DIR/log/"
  exit 1
}

stop_daemons() {
  local f
  for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
    if pid_alive "$f"; then
      local pid
      pid=$(cat "$f")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

case "$ACTION" in
  start) start ;;
  stop) stop_daemons; log "stopped" ;;
  status)
    sinfo 2>/dev/null || { log "not running"; exit 1; }
    case "$(node_state || true)" in idle|mixed|allocated) exit 0 ;; *) exit 1 ;; esac ;;
  *) log "usage: $0 start|stop|status"; exit 2 ;;
esac
