#!/usr/bin/env bash
# A real SLURM cluster for tests, from Debian's packages (slurmctld, slurmd, slurm-client,
# munge; tools/install-cluster-packages.sh installs them). Runs as root.
#
#   tools/slurm-cluster.sh start DIR PORT[,SLURMD_PORT] [NODE...]   NODE = name:address[:netns]
#   tools/slurm-cluster.sh stop DIR
#
# `start` writes DIR/slurm.conf (use it with SLURM_CONF=DIR/slurm.conf), starts munged with a
# key of its own, slurmctld on the first node's address (in that node's network namespace,
# if it has one) on PORT, and one slurmd per node (slurmd -N name, on SLURMD_PORT, else
# PORT+1, inside the
# node's namespace under the node's name as hostname, so its tasks are on a host of their
# own), then waits until every node is idle. Without NODE: one node, this host
# at 127.0.0.1. ProctrackType=proctrack/linuxproc and TaskPlugin=task/none need no cgroups,
# so the cluster starts in seconds. `stop` ends every daemon it started (by the pid files
# in DIR) and leaves DIR's logs.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start DIR PORT [NODE...] | stop DIR" >&2; exit 2; }

stop() {
  for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null || true)
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "unknown command $cmd" >&2; exit 2; }
IFS=, read -r port slurmd_port <<<"${3:?PORT}"
slurmd_port=${slurmd_port:-$((port + 1))}
shift 3
nodes=("$@")
[ ${#nodes[@]} -gt 0 ] || nodes=("$(hostname -s):127.0.0.1")
for b in munged slurmctld slurmd srun; do
  command -v "$b" >/dev/null || { echo "$b is not installed (tools/install-cluster-packages.sh)" >&2; exit 3; }
done

mkdir -p "$dir" && chmod 700 "$dir"
in_ns() { # in_ns NETNS CMD...: CMD in the node's namespace, or here without one
  local ns=$1; shift
  if [ -n "$ns" ]; then ip netns exec "$ns" "$@"; else "$@"; fi
}
# `ip netns exec` mounts a sysfs of the namespace over /sys, hiding the cgroup hierarchies
# slurmd's cgroup plugin initializes with even under proctrack/linuxproc: mount this host's
# again (type, mount point, options as /proc/mounts lists them) in that private mount space.
cgroups=$(awk '$3 == "cgroup" || $3 == "cgroup2" { print $3, $2, $4 }' /proc/mounts)
cgroup_root=$(awk '$2 == "/sys/fs/cgroup" { print $3 }' /proc/mounts | head -n 1)
remount_cgroups='
  if [ "$FSDP_CGROUP_ROOT" = tmpfs ]; then mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup; fi
  printf "%s\n" "$FSDP_CGROUPS" | while read -r type dir opts; do
    [ -n "$type" ] || continue
    mkdir -p "$dir" && mount -t "$type" -o "$opts" "$type" "$dir"
  done'
# PMIx (srun --mpi=pmix) keeps each step's files under $dir/pmix, named by job and step
# only: every node sees its own directory there (a bind mount in its private mount space).
node_pmix='mkdir -p "$FSDP_PMIX-$0" && mount --bind "$FSDP_PMIX-$0" "$FSDP_PMIX"'
as_node() { # as_node NAME NETNS CMD...: CMD in the node's namespace under its own hostname
  local name=$1 ns=$2; shift 2
  if [ -n "$ns" ]; then
    FSDP_CGROUPS=$cgroups FSDP_CGROUP_ROOT=$cgroup_root FSDP_PMIX=$dir/pmix ip netns exec "$ns" unshare --uts \
      sh -c "$remount_cgroups; $node_pmix"'; hostname "$0"; exec "$@"' "$name" "$@"
  else
    "$@"
  fi
}

# munge: its own key and socket, so it neither needs nor touches the system's.
[ -f "$dir/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge.key"; chmod 400 "$dir/munge.key"; }
munged --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munged.log" --seed-file="$dir/munge.seed" 2>>"$dir/munged.log"

IFS=: read -r ctl_name ctl_addr ctl_ns <<<"${nodes[0]}"
# At least 4 CPUs a node (the config overrides what slurmd finds), so tests may start more
# tasks than this machine has cores.
cpus=$(nproc); [ "$cpus" -ge 4 ] || cpus=4
{
  echo "ClusterName=fsdp"
  echo "SlurmctldHost=${ctl_name}(${ctl_addr})"
  echo "SlurmctldPort=${port}"
  echo "SlurmdPort=${slurmd_port}"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  echo "AuthInfo=socket=${dir}/munge.sock"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "MpiDefault=none"
  echo "StateSaveLocation=${dir}/ctld"
  echo "SlurmdSpoolDir=${dir}/spool-%n"
  echo "SlurmctldPidFile=${dir}/slurmctld.pid"
  echo "SlurmdPidFile=${dir}/slurmd-%n.pid"
  echo "SlurmctldLogFile=${dir}/slurmctld.log"
  echo "SlurmdLogFile=${dir}/slurmd-%n.log"
  echo "SchedulerType=sched/builtin"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_CPU"
  echo "ReturnToService=2"
  echo "SlurmdParameters=config_overrides"
  echo "SlurmdTimeout=30"
  echo "InactiveLimit=0"
  echo "KillWait=5"
  echo "MinJobAge=60"
  for n in "${nodes[@]}"; do
    IFS=: read -r name addr _ <<<"$n"
    echo "NodeName=${name} NodeHostname=${name} NodeAddr=${addr} CPUs=${cpus} State=UNKNOWN"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} > "$dir/slurm.conf"
mkdir -p "$dir/ctld" "$dir/pmix"
echo "PMIxCliTmpDirBase=$dir/pmix" > "$dir/mpi.conf"
export SLURM_CONF="$dir/slurm.conf"

as_node "$ctl_name" "$ctl_ns" slurmctld -f "$SLURM_CONF" -i
for n in "${nodes[@]}"; do
  IFS=: read -r name _ ns <<<"$n"
  mkdir -p "$dir/spool-$name"
  as_node "$name" "$ns" slurmd -f "$SLURM_CONF" -N "$name"
done

# Every node idle within 30 s, or say why.
for _ in $(seq 300); do
  states=$(in_ns "$ctl_ns" sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
  [ "$states" = "idle " ] && exit 0
  sleep 0.1
done
echo "SLURM did not come up (node states: ${states:-none}); logs in $dir" >&2
tail -n 5 "$dir"/*.log >&2 || true
stop
exit 1
