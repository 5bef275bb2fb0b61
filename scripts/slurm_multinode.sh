#!/usr/bin/env bash
# A multi-node SLURM cluster on this one machine, for tests/multinode and `.ci/run`.
#
#   scripts/slurm_multinode.sh start    create the nodes, configure, start; waits until every node is idle
#   scripts/slurm_multinode.sh stop     stop the daemons, remove the namespaces, bridges and /etc/hosts lines
#   scripts/slurm_multinode.sh status   print sinfo; exit 0 only when every node is up
#   scripts/slurm_multinode.sh kill-node NAME   kill the node's slurmd and every process in its namespace
#   scripts/slurm_multinode.sh start-node NAME  (re)start one node's slurmd (after kill-node)
#
# Each node rmn1..rmnN is a slurmd in its own network namespace (`ip netns`): eth0 is a veth on the host
# bridge rmbr0 (10.77.0.0/24; the host is 10.77.0.1 and runs slurmctld), and eth1 a veth on a second bridge
# rmbr1 (10.78.0.0/24) that only the nodes are on: an extra interface, so the job must pin the right one.
# The nodes' traffic stays between these namespaces and the host (no route out, no NAT). Each slurmd runs
# under `unshare --uts --mount`: its own host name (socket.gethostname() == node name inside every task) and
# its own mount table, in which $DIR/unshared is a private directory on every node but the first (the
# first, where a job's driver runs, sees the host's: the sbatch files submitit writes there must reach it) (and $DIR/nodetmp the node's
# TmpFS, where PMIx puts its per-step directories: named by job and step only, they collide on a shared /tmp) (the "results directory that
# the nodes do not share" of the tests); everything else, munge's socket and the results directories
# included, is the one shared file system. The node names resolve through lines added to /etc/hosts.
#
# Devices: each node pretends to have two GPUs: Slurm GRES `gpu` backed by two stub device nodes per node, so
# that SLURM itself sets CUDA_VISIBLE_DEVICES for a job that asks for --gpus-per-node=2, exactly as on a GPU
# cluster; the CPU torch build then falls back to gloo. TaskPlugin=task/affinity binds each task to its
# cores (cgroups are not used: this machine's cgroup file system cannot be delegated to slurmd).
#
# Scale nodes: rmn4..rmn5 (after the NODES above) form a second partition, multinode-scale, for the scale
# matrix's runs of 4 or 8 ranks per node (tests/multinode/test_layout_scale_multinode.py). Each declares 8 CPUs
# and 8 stub GPUs on this machine's cores (SlurmdParameters=config_overrides: slurmd takes the declared CPUs, not
# the hardware's), so an 8-rank-per-node job is granted as on an 8-GPU node. Binding a task to cores the machine
# does not have fails ("Unable to layout tasks on given cpus"), so those jobs bind nothing: restage binds no
# cores when a node has fewer than one per rank (launch.job.cpus_per_rank), and Open MPI starts its daemons with
# --cpu-bind=none. The first NODES nodes keep their 2 CPUs and 2 GPUs, so the other tests' jobs fill a node (and
# queue for one) exactly as before; config_overrides changes nothing for a node declared as it is.
#
# Own config ($DIR/slurm.conf, SLURM_CONF must point at it), ports 6917/6918, state dirs and node names:
# it coexists with scripts/slurm_local.sh's one-node cluster. Needs root. Knobs: RESTAGE_MULTINODE_DIR
# (default /var/tmp/restage-multinode), RESTAGE_MULTINODE_NODES (default 3), RESTAGE_MULTINODE_SCALE_NODES
# (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

ACTION=${1:-status}
DIR=${RESTAGE_MULTINODE_DIR:-/var/tmp/restage-multinode}
NODES=${RESTAGE_MULTINODE_NODES:-3}
SCALE_NODES=${RESTAGE_MULTINODE_SCALE_NODES:-2}
TOTAL=$((NODES + SCALE_NODES))
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
PARTITION=multinode
SCALE_PARTITION=multinode-scale
SCALE_CPUS=8  # and as many stub GPUs: one rank per GPU, up to 8 per node
# getconf, not nproc: nproc obeys OMP_NUM_THREADS, which the test runner sets to 1.
CPUS=$(getconf _NPROCESSORS_ONLN)
HOSTS_MARK="# restage-multinode"
CTLD_ADDR=10.77.0.1
CTLD_HOST=$(hostname -s)  # slurmctld checks that it runs on SlurmctldHost

log() { echo "slurm_multinode: $*" >&2; }
node_name() { echo "rmn$1"; }
node_pid_file() { echo "$DIR/$1/slurmd.pid"; }
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

make_network() {
  local b
  for b in rmbr0 rmbr1; do
    ip link show "$b" >/dev/null 2>&1 || ip link add "$b" type bridge
    ip link set "$b" up
  done
  # Not `ip ... | grep -q`: with pipefail, grep's early exit can fail the pipeline (SIGPIPE) and the test.
  local addrs
  addrs=$(ip -o addr show dev rmbr0)
  [[ $addrs == *"$CTLD_ADDR/24"* ]] || ip addr add "$CTLD_ADDR/24" dev rmbr0
  local i name
  for i in $(seq 1 "$TOTAL"); do
    name=$(node_name "$i")
    [ -e "/var/run/netns/$name" ] || ip netns add "$name"
    if ! ip link show "rmv${i}a" >/dev/null 2>&1; then
      ip link add "rmv${i}a" type veth peer name "rmv${i}b"
      ip link set "rmv${i}b" netns "$name"
      ip netns exec "$name" ip link set "rmv${i}b" name eth0
      ip link set "rmv${i}a" master rmbr0 up
      ip netns exec "$name" ip addr add "10.77.0.$((10 + i))/24" dev eth0
      ip netns exec "$name" ip link set eth0 up
      ip netns exec "$name" ip link set lo up
    fi
    if ! ip link show "rmw${i}a" >/dev/null 2>&1; then
      ip link add "rmw${i}a" type veth peer name "rmw${i}b"
      ip link set "rmw${i}b" netns "$name"
      ip netns exec "$name" ip link set "rmw${i}b" name eth1
      ip link set "rmw${i}a" master rmbr1 up
      ip netns exec "$name" ip addr add "10.78.0.$((10 + i))/24" dev eth1
      ip netns exec "$name" ip link set eth1 up
    fi
  done
  local line
  for i in $(seq 1 "$TOTAL"); do
    line="10.77.0.$((10 + i)) $(node_name "$i") $HOSTS_MARK"
    grep -qxF "$line" /etc/hosts || echo "$line" >>/etc/hosts
  done
}

remove_network() {
  local i
  for i in $(seq 1 "$TOTAL"); do
    ip netns del "$(node_name "$i")" 2>/dev/null || true
    ip link del "rmv${i}a" 2>/dev/null || true
    ip link del "rmw${i}a" 2>/dev/null || true
  done
  ip link del rmbr0 2>/dev/null || true
  ip link del rmbr1 2>/dev/null || true
  if grep -qF "$HOSTS_MARK" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite it in place.
    local kept
    kept=$(grep -vF "$HOSTS_MARK" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
  fi
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/dev" "$DIR/unshared" "$DIR/nodetmp" "$DIR/results"
  local i
  # slurmd wants GRES files to be device nodes: stubs with the numbers of /dev/null (1,3) and /dev/zero (1,5).
  local g
  for g in $(seq 0 $((SCALE_CPUS - 1))); do
    [ -c "$DIR/dev/gpu$g" ] || { rm -f "$DIR/dev/gpu$g"; mknod "$DIR/dev/gpu$g" c 1 $((g % 2 ? 5 : 3)); }
  done
  local mem_mb=2048
  local tmp
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# written by restage scripts/slurm_multinode.sh
ClusterName=restage-multinode
SlurmctldHost=$CTLD_HOST($CTLD_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The scale nodes' declared CPUs, not the hardware's (see the top of this script).
SlurmdParameters=config_overrides
MpiDefault=none
GresTypes=gpu
ReturnToService=2
JobRequeue=1
# Job ids of their own: easier to tell from slurm_local.sh's cluster in shared places.
FirstJobId=100000
TmpFS=$DIR/nodetmp
# A lost node is declared DOWN quickly (the node-loss test), and jobs on it are ended then.
SlurmdTimeout=10
KillWait=5
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=10
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/%n/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=6917
SlurmdPort=6918
SrunPortRange=61000-61999
NodeName=rmn[1-$NODES] NodeAddr=10.77.0.[11-$((10 + NODES))] CPUs=$CPUS RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
PartitionName=$PARTITION Nodes=rmn[1-$NODES] Default=YES MaxTime=30 DefaultTime=10 State=UP
EOF
  # NodeAddr ranges need a hostlist expression per node: write them one by one instead.
  sed -i "/^NodeName=/d" "$tmp"
  local cpus gpus name
  : >"$DIR/gres.conf.new"
  for i in $(seq 1 "$TOTAL"); do
    name=$(node_name "$i")
    if [ "$i" -le "$NODES" ]; then cpus=$CPUS gpus=2; else cpus=$SCALE_CPUS gpus=$SCALE_CPUS; fi
    echo "NodeName=$name NodeAddr=10.77.0.$((10 + i)) CPUs=$cpus RealMemory=$mem_mb Gres=gpu:$gpus State=UNKNOWN" >>"$tmp"
    echo "NodeName=$name Name=gpu File=$DIR/dev/gpu[0-$((gpus - 1))]" >>"$DIR/gres.conf.new"
  done
  if [ "$SCALE_NODES" -gt 0 ]; then
    echo "PartitionName=$SCALE_PARTITION Nodes=rmn[$((NODES + 1))-$TOTAL] MaxTime=30 DefaultTime=10 State=UP" >>"$tmp"
  fi
  echo "PMIxCliTmpDirBase=$DIR/nodetmp" >"$DIR/mpi.conf"
  local changed=1
  if cmp -s "$tmp" "$CONF" 2>/dev/null && cmp -s "$DIR/gres.conf.new" "$DIR/gres.conf"; then
    changed=0; rm -f "$tmp" "$DIR/gres.conf.new"
  else
    mv "$tmp" "$CONF"; chmod 644 "$CONF"; mv "$DIR/gres.conf.new" "$DIR/gres.conf"
  fi
  for i in $(seq 1 "$TOTAL"); do mkdir -p "$DIR/$(node_name "$i")/spool" "$DIR/$(node_name "$i")/tmp" "$DIR/private/$(node_name "$i")"; done
  return $((1 - changed))
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
  chmod 400 /etc/munge/munge.key
  munged --force
  for _ in $(seq 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    sleep 0.2
  done
  log "munged did not start"; exit 1
}

start_node() {
  local name=$1
  pid_alive "$(node_pid_file "$name")" && return 0
  rm -f "$(node_pid_file "$name")"
  # Own host name and mount table; $DIR/unshared is this node's private directory.
  # nsenter, not `ip netns exec`: the latter remounts /sys, which hides /sys/fs/cgroup from slurmd.
  nsenter --net="/var/run/netns/$name" unshare --uts --mount --propagation private sh -c "
    hostname $name
    [ $name = rmn1 ] || mount --bind $DIR/private/$name $DIR/unshared
    mount --bind $DIR/$name/tmp $DIR/nodetmp
    exec slurmd -N $name -f $CONF" </dev/null >>"$DIR/log/start-$name.log" 2>&1
  for _ in $(seq 50); do pid_alive "$(node_pid_file "$name")" && return 0; sleep 0.1; done
  log "slurmd of $name did not start; see $DIR/log/slurmd-$name.log"; exit 1
}

kill_node() {
  local name=$1 pids
  # Every process in the node's network namespace: slurmd, slurmstepd, the ranks.
  pids=$(ip netns pids "$name" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  rm -f "$(node_pid_file "$name")"
}

node_states() { sinfo -h -p "$PARTITION,$SCALE_PARTITION" -N -o "%N %T" 2>/dev/null | tr -d '*~#$@'; }

wait_idle() {
  local want=$1 up="" i
  for _ in $(seq 200); do
    up=$(node_states | awk '$2 ~ /^(idle|mixed|allocated)$/' | wc -l)
    [ "$up" -ge "$want" ] && return 0
    for i in $(node_states | awk '$2 ~ /^(down|drain|drained|draining|fail)$/ {print $1}'); do
      scontrol update NodeName="$i" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 0.3
  done
  log "only $up of $want nodes came up: $(node_states | tr '\n' ' '); see $DIR/log/"
  exit 1
}

start() {
  if [ "$(id -u)" != 0 ]; then log "start needs root"; exit 2; fi
  bash scripts/install_system.sh
  if ! dpkg -s libpmix-dev >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libpmix2 libpmix-dev >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libpmix2 libpmix-dev >/dev/null; }
  fi
  make_network
  if write_conf; then stop_daemons; fi  # a new config: restart what this script started
  start_munge
  pid_alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
  local i
  for i in $(seq 1 "$TOTAL"); do start_node "$(node_name "$i")"; done
  wait_idle "$TOTAL"
  log "$TOTAL nodes up: $(node_states | tr '\n' ' ')(SLURM_CONF=$CONF)"
}

stop_daemons() {
  local i
  for i in $(seq 1 "$TOTAL"); do kill_node "$(node_name "$i")"; done
  if pid_alive "$DIR/slurmctld.pid"; then
    local pid
    pid=$(cat "$DIR/slurmctld.pid")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$DIR/slurmctld.pid"
}

case "$ACTION" in
  start) start ;;
  stop) stop_daemons; remove_network; log "stopped" ;;
  status)
    sinfo -p "$PARTITION,$SCALE_PARTITION" 2>/dev/null || { log "not running"; exit 1; }
    [ "$(node_states | awk '$2 ~ /^(idle|mixed|allocated)$/' | wc -l)" -ge "$TOTAL" ] ;;
  kill-node) kill_node "${2:?node name}" ;;
  start-node) start_node "${2:?node name}" ;;
  *) log "usage: $0 start|stop|status|kill-node NAME|start-node NAME"; exit 2 ;;
esac
