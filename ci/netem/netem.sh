#!/usr/bin/env bash
# netem.sh - a bandwidth harness of network namespaces: one namespace per node,
# a star through a bridge in a hub namespace, tc tbf shaping on both ends of
# every node's veth (its upload on the node side, its download on the hub side),
# so each node has a full-duplex NIC of the profile's rate.
#
# Usage:
#   ci/netem/netem.sh check [PROFILE...]     measure each profile with iperf3 between two
#                                            namespaces; pass if within 10% of its target
#                                            (up to three measurements each)
#   ci/netem/netem.sh calibrate              the unshaped ceiling of one TCP stream here
#   ci/netem/netem.sh run PROFILE NODES -- COMMAND...
#                                            set up NODES namespaces (tw<run>-n0 ...), shaped
#                                            to PROFILE, run COMMAND in the root namespace with
#                                            NETEM_NS (names), NETEM_ADDRS, NETEM_RATE_BPS and
#                                            NETEM_DILATION in its environment, then tear down
#   ci/netem/netem.sh profiles               list the profiles and their rates
#
# Profiles: 1gbe 2gbe 5gbe 10gbe 20gbe 30gbe 40gbe ib-fdr (56 Gbit/s) ib-edr (100) ib-hdr (200).
# One TCP stream on this kind of machine tops out near 10 Gbit/s, so a profile
# above half the measured ceiling runs time-dilated: the links get rate / D and
# the workload must run its compute D times slower (`tidewire train --time-scale D`),
# which keeps the ratio of compute to communication. D is the smallest integer
# that brings the rate to half the ceiling or below; it is printed.
#
# Every namespace, veth and bridge lives in namespaces this script creates, and a
# trap deletes them on any exit. Traffic never leaves them. Needs root, iproute2,
# tc (iproute2) and iperf3.
set -euo pipefail

RUN="tw$$"
HUB="${RUN}-hub"
NODES_NS=()
CEILING_FILE=${NETEM_CEILING_FILE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-netem-ceiling}
log() { printf '[netem %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 2; }

declare -A RATE_GBIT=([1gbe]=1 [2gbe]=2 [5gbe]=5 [10gbe]=10 [20gbe]=20 [30gbe]=30 [40gbe]=40
                      [ib-fdr]=56 [ib-edr]=100 [ib-hdr]=200)
ORDER=(1gbe 2gbe 5gbe 10gbe 20gbe 30gbe 40gbe ib-fdr ib-edr ib-hdr)

teardown() {
  local ns
  for ns in "${NODES_NS[@]}" "$HUB"; do
    ip netns del "$ns" 2>/dev/null || true
  done
}
CHILD=""
trap teardown EXIT
# A signal stops the command too (it runs in the background so that the trap fires at once).
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; exit 130' INT
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; exit 143' TERM

need() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces and tc)"
  for c in ip tc iperf3; do command -v $c >/dev/null || die "$c is missing (Debian: apt-get install iproute2 iperf3)"; done
}

# up N: the hub with its bridge, and N node namespaces 10.77.0.1 ... on it.
up() {
  local n=$1 i
  ip netns add "$HUB"
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 mtu 65535 up
  ip -n "$HUB" link set lo up
  for ((i = 0; i < n; i++)); do
    local ns="${RUN}-n$i"
    ip netns add "$ns"
    NODES_NS+=("$ns")
    ip link add v0 netns "$ns" type veth peer name "b$i" netns "$HUB"
    ip -n "$HUB" link set "b$i" mtu 65535 master br0 up
    ip -n "$ns" link set v0 mtu 65535 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.77.$((i / 250)).$((i % 250 + 1))/16" dev v0
  done
}

addr_of() { echo "10.77.$(($1 / 250)).$(($1 % 250 + 1))"; }

# shape BPS: tbf on every node's v0 (upload) and the hub's b<i> (download).
shape() {
  local bps=$1 i
  # Burst: 10 ms of traffic, at least two 64 KiB packets (tbf drops a packet larger than its burst).
  local burst=$((bps / 8 / 100)); [ $burst -lt 262144 ] && burst=262144
  for ((i = 0; i < ${#NODES_NS[@]}; i++)); do
    tc -n "${NODES_NS[$i]}" qdisc replace dev v0 root tbf rate "${bps}bit" burst "$burst" latency 100ms
    tc -n "$HUB" qdisc replace dev "b$i" root tbf rate "${bps}bit" burst "$burst" latency 100ms
  done
}

# iperf3 from node 1 to node 0 for SECS: bits/s received.
measure() {
  local secs=${1:-3}
  ip netns exec "${NODES_NS[0]}" iperf3 -s -1 -B "$(addr_of 0)" >/dev/null 2>&1 &
  local sp=$!
  sleep 0.4
  local j
  j=$(ip netns exec "${NODES_NS[1]}" timeout $((secs + 30)) iperf3 -c "$(addr_of 0)" -t "$secs" -J 2>&1) \
    || { kill $sp 2>/dev/null; die "iperf3 between namespaces failed: $(tail -3 <<<"$j")"; }
  wait $sp 2>/dev/null || true
  python3 -c 'import json,sys; print(int(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]))' <<<"$j"
}

calibrate() {
  up 2
  local c; c=$(measure 3)
  mkdir -p "$(dirname "$CEILING_FILE")"
  echo "$c" >"$CEILING_FILE"
  log "ceiling of one unshaped TCP stream between namespaces: $(awk -v c="$c" 'BEGIN{printf "%.2f", c/1e9}') Gbit/s (saved in $CEILING_FILE)"
  teardown; NODES_NS=()
  echo "$c"
}

ceiling() {
  if [ -s "$CEILING_FILE" ]; then cat "$CEILING_FILE"; else calibrate; fi
}

# dilation TARGET_BPS CEILING_BPS: the smallest D with TARGET / D <= CEILING / 2.
dilation() { awk -v t="$1" -v c="$2" 'BEGIN { d = t / (c / 2); d = (d <= 1) ? 1 : int(d) + ((d > int(d)) ? 1 : 0); print d }'; }

profile_bps() {
  local p=$1
  [ -n "${RATE_GBIT[$p]:-}" ] || die "unknown profile '$p' (known: ${ORDER[*]})"
  awk -v g="${RATE_GBIT[$p]}" 'BEGIN { printf "%.0f", g * 1e9 }'
}

cmd=${1:-}; shift || true
case "$cmd" in
  profiles)
    for p in "${ORDER[@]}"; do printf '%-8s %4s Gbit/s\n' "$p" "${RATE_GBIT[$p]}"; done ;;
  calibrate)
    need; rm -f "$CEILING_FILE"; calibrate >/dev/null ;;
  check)
    need
    profiles=("$@"); [ ${#profiles[@]} -gt 0 ] || profiles=("${ORDER[@]}")
    for p in "${profiles[@]}"; do profile_bps "$p" >/dev/null; done
    rm -f "$CEILING_FILE"
    c=$(calibrate)
    up 2
    fail=0
    printf '%-8s %10s %9s %14s %14s %7s  %s\n' profile "target" dilation "shaped to" "measured" "error" verdict
    for p in "${profiles[@]}"; do
      t=$(profile_bps "$p"); d=$(dilation "$t" "$c"); r=$((t / d))
      shape "$r"
      # Up to three measurements: a shaper that works reads within 10% on a quiet
      # moment, and this machine's two cores are shared (a busy neighbour can slow one
      # 3-second iperf3 run); a shaper that lets too much through fails all three.
      tries=""
      for attempt in 1 2 3; do
        m=$(measure 3)
        e=$(awk -v m="$m" -v r="$r" 'BEGIN { printf "%+.1f%%", (m - r) / r * 100 }')
        ok=$(awk -v m="$m" -v r="$r" 'BEGIN { print ((m - r) / r <= 0.10 && (r - m) / r <= 0.10) ? "PASS" : "FAIL" }')
        tries+="${tries:+, }$e"
        [ "$ok" = PASS ] && break
      done
      [ "$ok" = PASS ] || fail=1
      note=""; [ "$attempt" -gt 1 ] && note=" (measurements: $tries)"
      printf '%-8s %6.1f Gb/s %8dx %9.3f Gb/s %9.3f Gb/s %7s  %s%s\n' "$p" "$(awk -v t="$t" 'BEGIN{print t/1e9}')" "$d" \
        "$(awk -v r="$r" 'BEGIN{print r/1e9}')" "$(awk -v m="$m" 'BEGIN{print m/1e9}')" "$e" "$ok" "$note"
    done
    echo "ceiling $(awk -v c="$c" 'BEGIN{printf "%.2f", c/1e9}') Gbit/s; profiles above half of it run time-dilated (compute x D)"
    exit $fail ;;
  run)
    need
    [ $# -ge 3 ] || die "usage: netem.sh run PROFILE NODES -- COMMAND..."
    p=$1; n=$2; shift 2
    [ "${1:-}" = "--" ] && shift
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 1000 ] || die "NODES: give 1 to 1000"
    [ $# -gt 0 ] || die "no COMMAND given"
    t=$(profile_bps "$p"); c=$(ceiling); d=$(dilation "$t" "$c"); r=$((t / d))
    up "$n"; shape "$r"
    log "$n namespaces on a $p star: $(awk -v r="$r" 'BEGIN{printf "%.3f", r/1e9}') Gbit/s per NIC each way, dilation $d"
    addrs=(); for ((i = 0; i < n; i++)); do addrs+=("$(addr_of $i)"); done
    env NETEM_NS="${NODES_NS[*]}" NETEM_ADDRS="${addrs[*]}" NETEM_RATE_BPS=$r NETEM_DILATION=$d NETEM_PROFILE=$p "$@" &
    CHILD=$!
    set +e
    wait "$CHILD"
    rc=$?
    CHILD=""
    exit $rc
    ;;
  ""|-h|--help) sed -n '2,28p' "$0" ;;
  *) die "unknown command '$cmd' (check, calibrate, run, profiles)" ;;
esac
