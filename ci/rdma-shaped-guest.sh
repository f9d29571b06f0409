#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (ci/rdma-guest.sh calls it): RDMA under the
# bandwidth harness's shaping. Soft-RoCE traffic from rxe1 to rxe0 leaves
# through veth1, so tc shapes it there, as ci/netem shapes TCP.
#   1. tidewire-perf write_bw rxe1 -> rxe0 for 3 s, unshaped;
#   2. tbf on veth1 at a quarter of that rate, and the same run again (once more if it
#      misses the band: the emulated VM shares the host's cores);
#   3. the shaped BW average must be within -15%/+5% of the tbf rate (RoCE v2
#      headers are about 6% of a 1024-byte-MTU packet, which tbf counts).
# Reports in libtest's format, so that ci/test-rdma.sh counts it.
set -u
P=${TIDEWIRE_PERF:-${CARGO_TARGET_DIR:-target}/release/tidewire-perf}
IP=${SOFTROCE_IP:-192.0.2.1}
DEV=veth1
tmp=$(mktemp -d)
trap 'tc qdisc del dev $DEV root 2>/dev/null; rm -rf "$tmp"' EXIT

# run PORT: the client's BW average (MB/sec, 2^20 B/s) of a 3 s write_bw; both sides' output on failure.
run() {
  $P write_bw -d rxe0 -s 65536 -D 3 -p "$1" >"$tmp/s" 2>&1 &
  local sp=$!
  sleep 0.5
  timeout 60 $P write_bw -d rxe1 -s 65536 -D 3 -p "$1" "$IP" >"$tmp/c" 2>&1
  local c=$?
  wait $sp
  local s=$?
  if [ $c -ne 0 ] || [ $s -ne 0 ]; then
    sed 's/^/[server] /' "$tmp/s" >&2; sed 's/^/[client] /' "$tmp/c" >&2
    return 1
  fi
  grep -E '^ +65536 +[0-9]+ ' "$tmp/c" | awk '{print $4}'
}

echo "### rdma_shaped::write_bw_under_tbf"
ok=0
if u=$(run 18600) && [ -n "$u" ]; then
  rate=$(awk -v u="$u" 'BEGIN { printf "%.0f", u * 1048576 * 8 / 4 }')
  tc qdisc replace dev $DEV root tbf rate "${rate}bit" burst 64kb latency 100ms
  tc -s qdisc show dev $DEV | head -2
  # The shaped run twice at most: the emulated VM shares the host's cores, and a run that
  # the host slowed (ci/test.sh runs this beside other tiers) is measured again.
  for port in 18601 18602; do
    if m=$(run $port) && [ -n "$m" ]; then
      r=$(awk -v m="$m" -v t="$rate" 'BEGIN { printf "%.3f", m * 1048576 * 8 / t }')
      echo "unshaped $u MB/sec; tbf on $DEV at $(awk -v t="$rate" 'BEGIN{printf "%.1f", t/1e6}') Mbit/s; shaped $m MB/sec = $r of the tbf rate"
      ok=$(awk -v r="$r" 'BEGIN { print (r >= 0.85 && r <= 1.05) ? 1 : 0 }')
    fi
    [ "$ok" = 1 ] && break
  done
fi
if [ "$ok" = 1 ]; then
  echo "test rdma_shaped::write_bw_under_tbf ... ok"
  echo "test result: ok. 1 passed; 0 failed; 0 ignored"
else
  echo "test rdma_shaped::write_bw_under_tbf ... FAILED (wanted the shaped run within -15%/+5% of the tbf rate)"
  echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
  exit 1
fi
