#!/usr/bin/env bash
# Machines on a real network, made of network namespaces (the multi-machine tests and
# benchmarks use them; needs root):
#
#   tools/netns-machines.sh up NAME N [RATE]   N machines NAME-m0 .. NAME-m{N-1}
#   tools/netns-machines.sh down NAME N
#
# `up` makes a switch namespace NAME-sw holding a bridge, and N machine namespaces, each
# joined to the bridge by a veth pair whose machine end is `eth0` with address
# 10.234.S.(i+1)/24 (S from NAME) and nothing else; every machine gets a hosts file naming
# all of them (`ip netns exec` shows /etc/netns/NS/hosts as /etc/hosts), and, with RATE
# (e.g. 1gbit), a token-bucket limit on both directions of its link (tbf, 512 KiB burst:
# this kernel may lack netem, so no added delay). It prints one line per machine:
# `NAME-mI ADDRESS`. Nothing is added to the namespace it runs in (the veths are made
# there under temporary names and moved at once). `down` removes everything `up` made.
set -euo pipefail
cmd=${1:-}; name=${2:-}; n=${3:-}
[ -n "$cmd" ] && [ -n "$name" ] && [ -n "$n" ] || { echo "usage: $0 up NAME N [RATE] | down NAME N" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 3; }

down() {
  for i in $(seq 0 $((n - 1))); do
    ip netns del "$name-m$i" 2>/dev/null || true
    rm -rf "/etc/netns/$name-m$i"
  done
  ip netns del "$name-sw" 2>/dev/null || true
}
if [ "$cmd" = down ]; then down; exit 0; fi
[ "$cmd" = up ] || { echo "unknown command $cmd" >&2; exit 2; }
rate=${4:-}
subnet=$(( $(printf '%s' "$name" | cksum | cut -d' ' -f1) % 250 + 1 ))
trap 'down' ERR
ip netns add "$name-sw"
ip -n "$name-sw" link add br0 type bridge
ip -n "$name-sw" link set br0 up
hosts="127.0.0.1 localhost"
for i in $(seq 0 $((n - 1))); do hosts="$hosts
10.234.$subnet.$((i + 1)) $name-m$i"; done
shape() { # shape NETNS DEV: the link's rate limit on DEV's egress
  [ -z "$rate" ] || tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst 512kb latency 20ms
}
for i in $(seq 0 $((n - 1))); do
  ns=$name-m$i
  tmp=fvm$$x$i
  ip netns add "$ns"
  ip link add "${tmp}a" type veth peer name "${tmp}b"
  ip link set "${tmp}a" netns "$ns"
  ip link set "${tmp}b" netns "$name-sw"
  ip -n "$ns" link set "${tmp}a" name eth0
  ip -n "$name-sw" link set "${tmp}b" name "p$i"
  ip -n "$name-sw" link set "p$i" master br0
  ip -n "$name-sw" link set "p$i" up
  ip -n "$ns" addr add "10.234.$subnet.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  shape "$ns" eth0
  shape "$name-sw" "p$i"
  mkdir -p "/etc/netns/$ns"
  printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"
  echo "$ns 10.234.$subnet.$((i + 1))"
done
