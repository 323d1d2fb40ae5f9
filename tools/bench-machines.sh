#!/usr/bin/env bash
# Collective bandwidth between two machines over a real, rate-limited network (issue 21's
# measurements): two network namespaces joined by a veth pair, each end's egress shaped by
# a tc token bucket (tbf: RATE, 512 KiB burst, which holds the largest GSO packet veth
# sends; `none` leaves the link uncapped; kernels without netem get no added delay), one
# process per machine, f32
# all-reduce / all-gather / reduce-scatter / broadcast up to MAX_MIB. Measures our TCP ring
# (one `fsdp launch` per machine) and MPI (mpirun, machine 1 started through
# tools/netns-rsh.sh) side by side, and prints each report's JSON with the link rate, so bus
# bandwidth reads as a fraction of the link. Needs root and an fsdp built with
# `--features mpi` (FSDP, default target/release/fsdp). Removes the namespaces on exit.
#
#   tools/bench-machines.sh [RATE] [MAX_MIB] [ITERS]     e.g. tools/bench-machines.sh 1gbit 64 5
#   tools/bench-machines.sh memory [RATE] [STEPS]
#
# `memory` instead trains `fsdp bench memory`'s BERT on 2 machines x 2 processes (one
# `fsdp launch` per machine: shared memory inside a machine, TCP between them) under
# FULL_SHARD and HYBRID_SHARD and prints each rank 0 result (step time, bytes sent inside
# shard groups and across machines, against the algorithms' theory).
set -euo pipefail
mode=collectives
if [ "${1:-}" = memory ]; then mode=memory; shift; fi
rate=${1:-1gbit}
max_mib=${2:-64}
iters=${3:-5}
steps=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
fsdp=${FSDP:-$here/../target/release/fsdp}
[ -x "$fsdp" ] || { echo "no $fsdp: cargo build --release -p fsdp-cli --features mpi" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }

tag=$$
m0=fsdpb$tag-m0 m1=fsdpb$tag-m1
a0=10.233.$((tag % 250)).1 a1=10.233.$((tag % 250)).2
cleanup() {
  if [ "$rate" != none ]; then # what the shaper sent and dropped, for reading the figures
    for ns in "$m0" "$m1"; do tc -n "$ns" -s qdisc show 2>/dev/null | sed "s/^/# $ns: /" >&2 || true; done
  fi
  ip netns del "$m0" 2>/dev/null || true
  ip netns del "$m1" 2>/dev/null || true
  rm -rf "/etc/netns/$m0" "/etc/netns/$m1"
}
trap cleanup EXIT
ip netns add "$m0"
ip netns add "$m1"
ip link add "vb${tag}a" type veth peer name "vb${tag}b"
for pair in "$m0:vb${tag}a:$a0" "$m1:vb${tag}b:$a1"; do
  IFS=: read -r ns dev addr <<<"$pair"
  ip link set "$dev" netns "$ns"
  ip -n "$ns" addr add "$addr/24" dev "$dev"
  ip -n "$ns" link set "$dev" up
  ip -n "$ns" link set lo up
  if [ "$rate" != none ]; then
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst 512kb latency 20ms
  fi
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "$a0" "$m0" "$a1" "$m1" > "/etc/netns/$ns/hosts"
done
on() { # on MACHINE CMD...: CMD on that machine under its own hostname
  local ns=$1; shift
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$ns" "$@"
}
worker=(bench collectives --worker --iters "$iters" --max_mib "$max_mib" --num_processes 2)

report() { sed -n 's/^\(\[rank0\]: \)\{0,1\}\({"benchmark".*\)$/\2/p' "$1" | tail -n 1; }
if [ "$mode" = memory ]; then
  echo "# link: veth, tc tbf rate $rate; 2 machines x 2 processes" >&2
  results=()
  for strategy in FULL_SHARD HYBRID_SHARD; do
    port=$((29600 + tag % 300))
    for i in 0 1; do
      ns=$([ $i = 0 ] && echo "$m0" || echo "$m1")
      FSDP_JOB_SECRET=bench-machines-$tag on "$ns" "$fsdp" launch --quiet --num_machines 2 \
        --num_processes 4 --machine_rank $i --main_process_ip "$a0" --main_process_port $port \
        "$fsdp" bench memory --worker "$strategy" --steps "$steps" > "/tmp/fsdpb$tag-mem-$i.out" 2>&1 &
    done
    wait
    line=$(sed -n 's/^\(\[rank0\]: \)\{0,1\}RESULT //p' "/tmp/fsdpb$tag-mem-0.out" | tail -n 1)
    [ -n "$line" ] || { echo "$strategy failed:" >&2; cat /tmp/fsdpb$tag-mem-*.out >&2; exit 1; }
    results+=("{\"strategy\":\"$strategy\",\"result\":$line}")
    rm -f /tmp/fsdpb$tag-mem-*.out
  done
  echo "{\"benchmark\":\"memory_across_machines\",\"link_rate\":\"$rate\",\"shaper\":\"tbf\",\"machines\":2,\"processes_per_machine\":2,\"runs\":[$(IFS=,; echo "${results[*]}")]}"
  exit 0
fi
echo "# link: veth, tc tbf rate $rate; 2 machines x 1 process" >&2
port=$((29600 + tag % 300))
secret=bench-machines-$tag
for i in 0 1; do
  ns=$([ $i = 0 ] && echo "$m0" || echo "$m1")
  FSDP_JOB_SECRET=$secret on "$ns" "$fsdp" launch --quiet --num_machines 2 --num_processes 2 \
    --machine_rank $i --main_process_ip "$a0" --main_process_port $port \
    --fsdp_comm_backend tcp "$fsdp" "${worker[@]}" > "/tmp/fsdpb$tag-tcp-$i.out" 2>&1 &
done
wait
tcp=$(report "/tmp/fsdpb$tag-tcp-0.out")
[ -n "$tcp" ] || { echo "TCP run failed:" >&2; cat /tmp/fsdpb$tag-tcp-*.out >&2; exit 1; }
grep -v '{"benchmark"' "/tmp/fsdpb$tag-tcp-0.out" >&2 || true

on "$m0" mpirun --allow-run-as-root --oversubscribe --bind-to none -n 2 --host "$m0:1,$m1:1" \
  --mca plm_rsh_agent "$here/netns-rsh.sh" --mca oob_tcp_if_include "$a0/24" \
  --mca btl self,tcp --mca btl_tcp_if_include "$a0/24" -x FSDP_COMM_BACKEND=mpi \
  "$fsdp" "${worker[@]}" > "/tmp/fsdpb$tag-mpi.out" 2>&1 || { cat "/tmp/fsdpb$tag-mpi.out" >&2; exit 1; }
mpi=$(report "/tmp/fsdpb$tag-mpi.out")
grep -v '{"benchmark"' "/tmp/fsdpb$tag-mpi.out" >&2 || true
rm -f /tmp/fsdpb$tag-*.out
echo "{\"benchmark\":\"collectives_across_machines\",\"link_rate\":\"$rate\",\"shaper\":\"tbf\",\"machines\":2,\"processes_per_machine\":1,\"tcp\":$tcp,\"mpi\":$mpi}"
