#!/usr/bin/env bash
# Collective bandwidth between two machines over a real, rate-limited network (issue 21's
# measurements): two machines from tools/netns-machines.sh (network namespaces on a bridge,
# each link shaped both ways by a tc token bucket of RATE; `none` leaves it uncapped), one
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
# FULL_SHARD and HYBRID_SHARD (or the strategies STRATEGIES names, space-separated) and prints
# each rank 0 result (step time, bytes sent inside shard groups and across machines, against
# the algorithms' theory).
set -euo pipefail
mode=collectives
if [ "${1:-}" = memory ]; then mode=memory; shift; fi
rate=${1:-1gbit}
max_mib=${2:-64}
iters=${3:-5}
steps=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
fsdp=${FSDP:-$here/../target/release/fsdp}
[ -x "$fsdp" ] || { echo "no $fsdp: cargo build --release -p fsdp-cli --features mpi,bench" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }

tag=$$
set_name=fsdpb$tag
m0=$set_name-m0 m1=$set_name-m1
shaped=$([ "$rate" = none ] && echo "" || echo "$rate")
cleanup() {
  if [ -n "$shaped" ]; then # what the shapers sent and dropped, for reading the figures
    for ns in "$m0" "$m1"; do tc -n "$ns" -s qdisc show dev eth0 2>/dev/null | sed "s/^/# $ns: /" >&2 || true; done
  fi
  "$here/netns-machines.sh" down "$set_name" 2
}
trap cleanup EXIT
machines=$("$here/netns-machines.sh" up "$set_name" 2 $shaped)
a0=$(echo "$machines" | awk 'NR == 1 { print $2 }')
on() { # on MACHINE CMD...: CMD on that machine under its own hostname
  local ns=$1; shift
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$ns" "$@"
}
worker=(bench collectives --worker --iters "$iters" --max_mib "$max_mib" --num_processes 2)

report() { sed -n 's/^\(\[rank0\]: \)\{0,1\}\({"benchmark".*\)$/\2/p' "$1" | tail -n 1; }
if [ "$mode" = memory ]; then
  echo "# link: veth, tc tbf rate $rate; 2 machines x 2 processes" >&2
  results=()
  for strategy in ${STRATEGIES:-FULL_SHARD HYBRID_SHARD}; do
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
