#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair (root needed).
#
#   ci/netns.sh up [ID]        create xfA-ID / xfB-ID, veth vA-ID <-> vB-ID, 10.77.N.1/24 and
#                              10.77.N.2/24 (N from ID); prints one JSON line describing them
#   ci/netns.sh down ID        delete both namespaces (the veth pair goes with them); idempotent
#   ci/netns.sh link ID up|down   bring host A's end of the link up or down (a cut cable)
#   ci/netns.sh rate ID RATE|off  shape host A's outgoing traffic to RATE (tc tbf, e.g. 40mbit): a slow
#                              WAN link, so a transfer is surely still running when a fault is injected
#
# Traffic stays inside the two namespaces: nothing is routed out of them.
set -euo pipefail

cmd=${1:-}
id=${2:-$(printf '%04x' $((RANDOM % 65536)))}
if ! [[ $id =~ ^[0-9a-f]{1,6}$ ]]; then
  echo "netns.sh: ID must be 1-6 hex digits, got '$id'" >&2
  exit 2
fi
ns_a="xfA-$id" ns_b="xfB-$id" dev_a="vA-$id" dev_b="vB-$id"
net=$((16#$id % 250 + 1))
addr_a="10.77.$net.1" addr_b="10.77.$net.2"

down() {
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
  ip link del "$dev_a" 2>/dev/null || true
}

case "$cmd" in
  up)
    trap 'down' ERR
    ip netns add "$ns_a"
    ip netns add "$ns_b"
    ip link add "$dev_a" type veth peer name "$dev_b"
    ip link set "$dev_a" netns "$ns_a"
    ip link set "$dev_b" netns "$ns_b"
    ip -n "$ns_a" addr add "$addr_a/24" dev "$dev_a"
    ip -n "$ns_b" addr add "$addr_b/24" dev "$dev_b"
    for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
    ip -n "$ns_a" link set "$dev_a" up
    ip -n "$ns_b" link set "$dev_b" up
    trap - ERR
    printf '{"id":"%s","ns_a":"%s","ns_b":"%s","dev_a":"%s","dev_b":"%s","addr_a":"%s","addr_b":"%s"}\n' \
      "$id" "$ns_a" "$ns_b" "$dev_a" "$dev_b" "$addr_a" "$addr_b"
    ;;
  down)
    down
    ;;
  link)
    state=${3:?link needs up or down}
    ip -n "$ns_a" link set "$dev_a" "$state"
    ;;
  rate)
    rate=${3:?rate needs RATE (e.g. 40mbit) or off}
    if [ "$rate" = off ]; then
      ip netns exec "$ns_a" tc qdisc del dev "$dev_a" root 2>/dev/null || true
    else
      ip netns exec "$ns_a" tc qdisc replace dev "$dev_a" root tbf rate "$rate" burst 64kb latency 2s
    fi
    ;;
  *)
    echo "usage: $0 up [ID] | down ID | link ID up|down | rate ID RATE|off" >&2
    exit 2
    ;;
esac
