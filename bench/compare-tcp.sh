#!/usr/bin/env bash
# compare-tcp.sh - tidewire-perf over the io_uring TCP transport and over the portable
# (epoll) TCP transport against iperf3, on loopback, side by side, in one run; and the
# portable backend's 64 B message round trip against a blocking std::net ping-pong.
#
# Usage: bench/compare-tcp.sh [--json FILE] [--png FILE] [--reps N] [--secs S] [--sizes "65536 1048576"] [--enforce]
#
# For each repetition and size it runs `tidewire-perf --transport tcp write_bw -D S`
# (one-sided writes of SIZE bytes into the server's registered region, 128 in
# flight) and `iperf3 -t S -l SIZE` (one stream), alternating which goes first.
# It prints the medians in MB/sec (2^20 bytes/s, perftest's unit), the ratio
# ours/iperf3, and writes the same JSON as compare-perftest.sh (the peer's key
# is "iperf3") and a PNG. The acceptance check: write_bw at 1 MiB >= 0.9x iperf3.
# The portable backend (`tidewire-perf --transport portable`) is measured in the same
# rounds; its medians and ratios are printed after the report (target >= 0.9x iperf3
# at 1 MiB), then `tidewire-loopback --backend portable rtt` against `std-rtt` at 64 B
# (median round trip, target <= 1.1x std), with the default busy poll and sleeping at once
# (--busy-poll-us 0, as the blocking std peer sleeps), both informational.
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
# TIDEWIRE_CARGO_SELECT: the packages and features to build with (ci/test.sh builds the
# workspace once with every feature and passes --workspace --all-features).
read -ra select <<<"${TIDEWIRE_CARGO_SELECT:--p tidewire-bench}"
cargo build --release --locked -q "${select[@]}" --bin tidewire-perf --bin tidewire-perf-report \
  --bin tidewire-loopback </dev/null \
  || { echo "build failed"; exit 1; }
P=$TARGET_DIR/release/tidewire-perf
RAW=$OUT/raw.tsv
: >"$RAW"
RAW_PORTABLE=$OUT/raw-portable.tsv
: >"$RAW_PORTABLE"
port=$((20000 + RANDOM % 11000))
row='^ [0-9]+ +[0-9]+ +[0-9]+\.[0-9]+'

ours() { # size [transport] -> MB/sec
  port=$((port + 1))
  local tr=${2:-tcp}
  $P write_bw --transport "$tr" -s "$1" -D "$SECS" -p $port >"$OUT/s.txt" 2>&1 &
  local sp=$!
  sleep 0.3
  timeout $((SECS + 60)) $P write_bw --transport "$tr" -s "$1" -D "$SECS" -p $port 127.0.0.1 >"$OUT/c.txt" 2>&1
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
    if [ $((rep % 2)) -eq 1 ]; then order="iperf3 ours portable"; else order="portable ours iperf3"; fi
    for tool in $order; do
      case $tool in
        ours) v=$(ours "$s") ;;
        portable) v=$(ours "$s" portable) ;;
        *) v=$(peer "$s") ;;
      esac
      if [ "$tool" = portable ]; then
        [ -n "$v" ] && printf 'write_bw\t%s\t%s\t%s\t%s\n' "$s" "$tool" "$rep" "$v" >>"$RAW_PORTABLE"
      else
        [ -n "$v" ] && printf 'write_bw\t%s\t%s\t%s\t%s\n' "$s" "$tool" "$rep" "$v" >>"$RAW"
      fi
      printf 'rep %s %8s B %-8s %s MB/sec\n' "$rep" "$s" "$tool" "${v:-FAILED}"
    done
  done
done
echo
echo "medians of $REPS repetitions, $SECS s each (tidewire-perf --transport tcp write_bw vs iperf3, one stream, loopback):"
"$TARGET_DIR/release/tidewire-perf-report" --input "$RAW" --json "$JSON" --png "$PNG" "${ENFORCE[@]}" --check write_bw:1048576:ge:0.9
rc=$?

# The portable backend against the same iperf3 rounds (informational).
echo
echo "portable (epoll) backend: tidewire-perf --transport portable write_bw vs iperf3, medians of $REPS:"
python3 - "$RAW" "$RAW_PORTABLE" <<'PY'
import statistics, sys
rows = [l.split('\t') for f in sys.argv[1:] for l in open(f) if l.strip()]
for size in sorted({int(r[1]) for r in rows}):
    med = lambda tool: statistics.median([float(r[4]) for r in rows if int(r[1]) == size and r[2] == tool] or [float('nan')])
    p, i, u = med('portable'), med('iperf3'), med('ours')
    print(f"  {size:>8} B  portable {p:9.1f} MB/sec  io_uring {u:9.1f}  iperf3 {i:9.1f}  portable/iperf3 {p / i:.2f}"
          + ("  (target >= 0.9)" if size == 1048576 else ""))
PY

# The portable backend's 64 B round trip against a blocking std::net ping-pong (informational),
# in the transport's two ways of waiting: its default (TcpConfig::busy_poll, 100 us of polling
# before it sleeps) and sleeping in epoll_wait at once (--busy-poll-us 0), as the blocking std
# peer sleeps in recv. Busy polling needs a spare core per side: on a loaded 2-core machine it
# is slower, not faster.
L=$TARGET_DIR/release/tidewire-loopback
rtt() { timeout 120 "$@" | grep -oE 'median [0-9.]+' | awk '{print $2}'; }
polls=(); sleeps=(); stds=()
for rep in $(seq 1 "$REPS"); do
  a=$(rtt "$L" --backend portable rtt --size 64 --iters 20000)
  z=$(rtt "$L" --backend portable --busy-poll-us 0 rtt --size 64 --iters 20000)
  b=$(rtt "$L" std-rtt --size 64 --iters 20000)
  printf 'rep %s 64 B round trip: portable (default busy poll) %s us, portable (sleeping) %s us, std %s us\n' \
    "$rep" "${a:-FAILED}" "${z:-FAILED}" "${b:-FAILED}"
  polls+=("${a:-nan}"); sleeps+=("${z:-nan}"); stds+=("${b:-nan}")
done
python3 - "${polls[*]}" "${sleeps[*]}" "${stds[*]}" <<'PY'
import statistics, sys
a, z, b = ([float(x) for x in arg.split()] for arg in sys.argv[1:4])
ma, mz, mb = statistics.median(a), statistics.median(z), statistics.median(b)
print(f"64 B round trip, medians: std ping-pong {mb:.2f} us; portable {ma:.2f} us with its default busy poll "
      f"(ratio {ma / mb:.2f}), {mz:.2f} us sleeping at once (ratio {mz / mb:.2f}) (target <= 1.1)")
PY
exit $rc
