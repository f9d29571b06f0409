#!/usr/bin/env bash
# compare-tcp.sh - tidewire-perf over the io_uring TCP transport against iperf3,
# on loopback, side by side, in one run.
#
# Usage: bench/compare-tcp.sh [--json FILE] [--png FILE] [--reps N] [--secs S] [--sizes "65536 1048576"] [--enforce]
#
# For each repetition and size it runs `tidewire-perf --transport tcp write_bw -D S`
# (one-sided writes of SIZE bytes into the server's registered region, 128 in
# flight) and `iperf3 -t S -l SIZE` (one stream), alternating which goes first.
# It prints the medians in MB/sec (2^20 bytes/s, perftest's unit), the ratio
# ours/iperf3, and writes the same JSON as compare-perftest.sh (the peer's key
# is "iperf3") and a PNG. The acceptance check: write_bw at 1 MiB >= 0.9x iperf3.
# Traffic stays on 127.0.0.1. Needs iperf3 (Debian: apt-get install iperf3).
# Binaries and outputs are in cargo's target directory (ci/target-dir.sh: CARGO_TARGET_DIR
# when set, else ./target): $TARGET_DIR/compare-tcp/.
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/target-dir.sh
OUT=$TARGET_DIR/compare-tcp
JSON=$OUT/compare-tcp.json
PNG=$OUT/compare-tcp.png
REPS=3
SECS=3
SIZES="65536 1048576"
ENFORCE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON=$2; shift 2 ;;
    --png) PNG=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --secs) SECS=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --enforce) ENFORCE=(--enforce); shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || { echo "--reps $REPS: give a positive count"; exit 2; }
[[ "$SECS" =~ ^[1-9][0-9]*$ ]] || { echo "--secs $SECS: give whole seconds"; exit 2; }
command -v iperf3 >/dev/null || { echo "iperf3 is missing (Debian: apt-get install iperf3)"; exit 1; }
mkdir -p "$OUT"
cargo build --release --locked -q -p tidewire-bench --bin tidewire-perf --bin tidewire-perf-report </dev/null \
  || { echo "build failed"; exit 1; }
P=$TARGET_DIR/release/tidewire-perf
RAW=$OUT/raw.tsv
: >"$RAW"
port=$((20000 + RANDOM % 20000))
row='^ [0-9]+ +[0-9]+ +[0-9]+\.[0-9]+'

ours() { # size -> MB/sec
  port=$((port + 1))
  $P write_bw --transport tcp -s "$1" -D "$SECS" -p $port >"$OUT/s.txt" 2>&1 &
  local sp=$!
  sleep 0.3
  timeout $((SECS + 60)) $P write_bw --transport tcp -s "$1" -D "$SECS" -p $port 127.0.0.1 >"$OUT/c.txt" 2>&1
  local rc=$?
  timeout 20 tail --pid=$sp -f /dev/null; kill -9 $sp 2>/dev/null; wait $sp 2>/dev/null
  local line; line=$(grep -E "$row" "$OUT/c.txt" | tail -1)
  [ $rc -eq 0 ] && [ -n "$line" ] || { echo "tidewire-perf failed (exit $rc): $(tail -3 "$OUT/c.txt")" >&2; return 1; }
  awk '{print $4}' <<<"$line"
}

peer() { # size -> MB/sec (received)
  port=$((port + 1))
  iperf3 -s -1 -p $port -B 127.0.0.1 >/dev/null 2>&1 &
  local sp=$!
  sleep 0.3
  local j; j=$(timeout $((SECS + 60)) iperf3 -c 127.0.0.1 -p $port -t "$SECS" -l "$1" -J 2>&1)
  local rc=$?
  wait $sp 2>/dev/null
  [ $rc -eq 0 ] || { echo "iperf3 failed (exit $rc)" >&2; return 1; }
  python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8 / 1048576)' <<<"$j"
}

for rep in $(seq 1 "$REPS"); do
  for s in $SIZES; do
    if [ $((rep % 2)) -eq 1 ]; then order="iperf3 ours"; else order="ours iperf3"; fi
    for tool in $order; do
      if [ "$tool" = ours ]; then v=$(ours "$s"); else v=$(peer "$s"); fi
      [ -n "$v" ] && printf 'write_bw\t%s\t%s\t%s\t%s\n' "$s" "$tool" "$rep" "$v" >>"$RAW"
      printf 'rep %s %8s B %-7s %s MB/sec\n' "$rep" "$s" "$tool" "${v:-FAILED}"
    done
  done
done
echo
echo "medians of $REPS repetitions, $SECS s each (tidewire-perf --transport tcp write_bw vs iperf3, one stream, loopback):"
"$TARGET_DIR/release/tidewire-perf-report" --input "$RAW" --json "$JSON" --png "$PNG" "${ENFORCE[@]}" --check write_bw:1048576:ge:0.9
