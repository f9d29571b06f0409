#!/usr/bin/env bash
# slice-cost.sh - what one P3 slice costs, in CPU microseconds, on this machine (#28 item 4).
#
# It runs the same `tidewire train --sync p3` job twice per repetition, with small slices and
# with large ones, in alternating order, and reads the CPU time (user + system, of every rank:
# they are the command's children) and the report's counts: slices_pushed (one message each,
# from a worker) and broadcasts (one message each, back to a worker; a chunk is a run of
# slices). Everything else in the two jobs is the same (model, ranks, set-up, compute,
# bytes), so
#
#     cost per slice   = (CPU small - CPU large) / (slices small - slices large)
#     cost per message = (CPU small - CPU large) / (messages small - messages large)
#
# where messages = slices_pushed + broadcasts. The first is what one more slice costs the
# whole job (its push, its landing, its sum, its credit, and its share of the broadcasts,
# on both ends, kernel included). It also gives the transport sends one more slice costs
# (the report's tx_sends: a gathered sendmsg of several slices or frames counts once), a
# count the machine's load does not blur. It prints each repetition, their median, and the
# figure from each size's least CPU time.
#
# Usage: bench/slice-cost.sh [--model M] [--workers W] [--servers S] [--iters I]
#                            [--small P] [--large P] [--reps R] [--bin PATH] [--json FILE]
# Defaults: resnet-50, 2 workers, 1 server, 4 iterations, slices of 2,000 and 200,000
# parameters, 3 repetitions. Needs a release build of tidewire in cargo's target directory
# (ci/target-dir.sh), or --bin, and GNU time (/usr/bin/time; Debian's package `time`).
set -euo pipefail
CALLER=$PWD   # --bin and --json are taken from where it was called
cd "$(dirname "$0")/.."
. ci/target-dir.sh
MODEL=resnet-50; WORKERS=2; SERVERS=1; ITERS=4; SMALL=2000; LARGE=200000; REPS=3
JSON=$TARGET_DIR/slice-cost.json
T=$TARGET_DIR/release/tidewire
abs() { case "$1" in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --small) SMALL=$2; shift 2 ;;
    --large) LARGE=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --json) JSON=$(abs "$2"); shift 2 ;;
    --bin) T=$(abs "$2"); shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$T" ] || { echo "$T is missing: cargo build --release -p tidewire-cli --bin tidewire" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "/usr/bin/time is missing (Debian: apt-get install time)" >&2; exit 2; }
[ "$SMALL" -lt "$LARGE" ] || { echo "--small ($SMALL) must be below --large ($LARGE)" >&2; exit 2; }
[ "$REPS" -ge 1 ] || { echo "--reps must be at least 1, not $REPS" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run P: prints "cpu_s slices messages iteration_s sends" for one job with P-parameter slices.
run() {
  /usr/bin/time -f '%U %S' -o "$tmp/time" "$T" train --model "$MODEL" --workers "$WORKERS" \
    --servers "$SERVERS" --iters "$ITERS" --time-scale 0.05 --sync p3 --slice-params "$1" --json \
    >"$tmp/out" 2>"$tmp/err" || { echo "train --slice-params $1 failed:" >&2; tail -5 "$tmp/err" >&2; exit 1; }
  python3 - "$tmp/time" "$tmp/out" <<'EOF'
import json, sys
u, s = open(sys.argv[1]).read().split()[-2:]
d = json.load(open(sys.argv[2]))
print(float(u) + float(s), d["slices_pushed"], d["slices_pushed"] + d["broadcasts"], d["iteration_s"], d.get("tx_sends", 0))  # 0: a build before tx_sends
EOF
}

echo "slice cost: $MODEL, $WORKERS workers + $SERVERS servers, $ITERS iterations, p3 at $SMALL and $LARGE parameters a slice, $REPS reps"
printf '%4s %10s %10s %10s %10s %12s %12s %12s\n' rep "cpu small" "cpu large" "slices sm" "slices lg" "us/slice" "us/message" "sends/slice"
rows=()
for ((r = 1; r <= REPS; r++)); do
  if [ $((r % 2)) -eq 1 ]; then read -r cs ns ms is ss < <(run "$SMALL"); read -r cl nl ml il sl < <(run "$LARGE")
  else read -r cl nl ml il sl < <(run "$LARGE"); read -r cs ns ms is ss < <(run "$SMALL"); fi
  [ "$ns" -gt "$nl" ] && [ "$ms" -gt "$ml" ] \
    || { echo "the small slices gave no more slices ($ns, $ms messages) than the large ($nl, $ml)" >&2; exit 1; }
  per=$(awk -v a="$cs" -v b="$cl" -v n="$ns" -v m="$nl" 'BEGIN { printf "%.2f", (a - b) / (n - m) * 1e6 }')
  msg=$(awk -v a="$cs" -v b="$cl" -v n="$ms" -v m="$ml" 'BEGIN { printf "%.2f", (a - b) / (n - m) * 1e6 }')
  sends=$(awk -v a="$ss" -v b="$sl" -v n="$ns" -v m="$nl" 'BEGIN { printf "%.3f", (a - b) / (n - m) }')
  printf '%4d %10.2f %10.2f %10d %10d %12s %12s %12s\n' "$r" "$cs" "$cl" "$ns" "$nl" "$per" "$msg" "$sends"
  rows+=("{\"cpu_small_s\":$cs,\"cpu_large_s\":$cl,\"slices_small\":$ns,\"slices_large\":$nl,\"messages_small\":$ms,\"messages_large\":$ml,\"sends_small\":$ss,\"sends_large\":$sl,\"iteration_small_s\":$is,\"iteration_large_s\":$il,\"us_per_slice\":$per,\"us_per_message\":$msg,\"sends_per_slice\":$sends}")
done
# The median of the repetitions' figures, and the figure from each size's least CPU time
# (interference only ever adds CPU time: a busy machine, a first run's page faults).
summary=$(printf '%s\n' "${rows[@]}" | python3 -c '
import json, statistics, sys
r = [json.loads(l) for l in sys.stdin]
med = lambda k: statistics.median(x[k] for x in r)
d = min(x["cpu_small_s"] for x in r) - min(x["cpu_large_s"] for x in r)
print("%.2f %.2f %.2f %.2f %.3f" % (med("us_per_slice"), med("us_per_message"),
      d / (r[0]["slices_small"] - r[0]["slices_large"]) * 1e6,
      d / (r[0]["messages_small"] - r[0]["messages_large"]) * 1e6, med("sends_per_slice")))')
read -r mslice mmsg lslice lmsg msends <<<"$summary"
echo "median: $mslice us of CPU per slice, $mmsg us per message, $msends transport sends per slice"
echo "least CPU of each size: $lslice us per slice, $lmsg us per message"
mkdir -p "$(dirname "$JSON")"
(IFS=,; echo "{\"model\":\"$MODEL\",\"workers\":$WORKERS,\"servers\":$SERVERS,\"iters\":$ITERS,\"small\":$SMALL,\"large\":$LARGE,\"us_per_slice\":$mslice,\"us_per_message\":$mmsg,\"least_us_per_slice\":$lslice,\"least_us_per_message\":$lmsg,\"sends_per_slice\":$msends,\"reps\":[${rows[*]}]}") >"$JSON"
echo "json: $JSON"
