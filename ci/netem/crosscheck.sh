#!/usr/bin/env bash
# crosscheck.sh - `tidewire train` under the bandwidth harness against `tidewire sim`
# with the same model, nodes, bandwidth and iterations: train's iteration time must lie
# between 10% under and 20% over the simulator's.
#
# The band is one-sided on purpose. The simulator models an ideal machine: every rank
# has its own CPU and TCP shares a link perfectly. Here four ranks share two cores and
# their flows share tbf queues, so train's mean lands above it; its fastest steady
# iterations land on it (2026-11-23, ResNet-50 at 1 GbE: sim 1.457 s, train's mean
# 1.66-1.75 s over three runs, its fastest iteration 1.467 s). Each row prints train's
# fastest steady iteration beside its mean. A train faster than the model by more than
# 10%, or slower by more than 20%, means the two disagree about the protocol.
#
# Usage: ci/netem/crosscheck.sh [--model M] [--nodes N] [--iters I] [--runs R] [--max-runs X]
#                               [--profiles "1gbe 2gbe"] [--json FILE]
#
# For each profile it sets up N namespaces shaped to the profile (ci/netem/netem.sh run),
# runs `tidewire train --colocate` with one rank per namespace, then `tidewire sim` at the
# rate the links were shaped to, and compares their `iteration_s`. A dilated profile runs
# both with `--time-scale D`. `train` runs R times (default 2) and its fastest run counts:
# four ranks share this machine's two cores, so interference only ever slows `train`
# (a 5-iteration run at 2 GbE read 0.857 s once and 0.982 s another time; at 1 GbE on a
# quiet machine, 1.576 s then 1.272 s then 1.174 s against the sim's 1.151 s). While the
# fastest is still over the band, it runs again, up to X runs in all (default 8): a CI
# machine shared with other jobs slows every run for a while, and only a train that no
# run brings into the band is a disagreement. The table says how many runs it took.
# Needs root, and a built tidewire (cargo build --release -p tidewire-cli --bin tidewire) in
# cargo's target directory (ci/target-dir.sh: CARGO_TARGET_DIR when set, else ./target),
# where the JSON goes too by default.
set -uo pipefail
cd "$(dirname "$0")/../.."
. ci/target-dir.sh
MODEL=resnet-50
NODES=4
ITERS=10
RUNS=2
MAX_RUNS=8
PROFILES="1gbe 2gbe"
JSON=$TARGET_DIR/netem-crosscheck.json
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --max-runs) MAX_RUNS=$2; shift 2 ;;
    --profiles) PROFILES=$2; shift 2 ;;
    --json) JSON=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
T=$TARGET_DIR/release/tidewire
[ -x "$T" ] || { echo "$T is missing: build first with cargo build --release -p tidewire-cli --bin tidewire"; exit 2; }
mkdir -p "$(dirname "$JSON")"
rows=()
fail=0
# in_band TRAIN SIM: train's iteration time between 10% under and 20% over the sim's.
in_band() { awk -v a="$1" -v b="$2" 'BEGIN { r = (a - b) / b; exit !(r >= -0.10 && r <= 0.20) }'; }
# over_band TRAIN SIM: more than 20% over (another run may still come in; one under cannot).
over_band() { awk -v a="$1" -v b="$2" 'BEGIN { exit !((a - b) / b > 0.20) }'; }
printf '%-8s %-10s %5s %12s %12s %8s  %s\n' profile model nodes "train s/it" "sim s/it" "diff" verdict
for p in $PROFILES; do
  tr=""; runs=""; fastest=""
  sim=""
  for ((k = 0; k < (RUNS > MAX_RUNS ? RUNS : MAX_RUNS); k++)); do
    # After RUNS runs, go on only while the fastest is over the band (see the top).
    if [ "$k" -ge "$RUNS" ] && [ -n "$sim" ] && ! over_band "$tr" "$sim"; then break; fi
    out=$(bash ci/netem/netem.sh run "$p" "$NODES" -- sh -c '
      exec "$0" train --model "$1" --workers "$2" --colocate --iters "$3" --json \
        --time-scale "$NETEM_DILATION" --netns "$NETEM_NS" --netns-addrs "$NETEM_ADDRS" \
        && true' "$T" "$MODEL" "$NODES" "$ITERS" 2>/tmp/crosscheck.err)
    rc=$?
    if [ $rc -ne 0 ]; then
      echo "train under $p failed (exit $rc):"; tail -5 /tmp/crosscheck.err; fail=1; tr=""; break
    fi
    # The run's mean, and its fastest steady iteration (not the first, which has no
    # synchronization before it, nor the last, which waits for the job's end).
    one=""; steady=""
    read -r one steady < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
it = [x["seconds"] for x in d["per_iteration"][1:-1]] or [d["iteration_s"]]
print(d["iteration_s"], min(it))' <<<"$out")
    [ -n "${one:-}" ] || { echo "train under $p printed no report (its JSON):"; tail -5 /tmp/crosscheck.err; fail=1; tr=""; break; }
    runs+="${runs:+ }$(printf '%.4f' "$one")"
    if [ -z "$tr" ] || awk -v a="$one" -v b="$tr" 'BEGIN { exit !(a + 0 < b + 0) }'; then tr=$one; fastest=$steady; fi
    if [ -z "$sim" ]; then
      # The harness says what it shaped to, and the dilation.
      rate=$(grep -o '[0-9.]* Gbit/s per NIC' /tmp/crosscheck.err | awk '{print $1}')
      d=$(grep -o 'dilation [0-9]*' /tmp/crosscheck.err | awk '{print $2}')
      sim=$("$T" sim --model "$MODEL" --nodes "$NODES" --iters "$ITERS" --bandwidth "${rate}gbit" \
            --time-scale "$d" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["iteration_s"])') \
        || { echo "sim under $p failed"; fail=1; tr=""; break; }
    fi
  done
  [ -n "$tr" ] || continue
  diff=$(awk -v a="$tr" -v b="$sim" 'BEGIN { printf "%+.1f%%", (a - b) / b * 100 }')
  ok=FAIL; in_band "$tr" "$sim" && ok=PASS
  [ "$ok" = PASS ] || fail=1
  printf '%-8s %-10s %5s %12.4f %12.4f %8s  %s (shaped %s Gbit/s, dilation %s; train runs: %s; fastest steady iteration %.4f s)\n' "$p" "$MODEL" "$NODES" "$tr" "$sim" "$diff" "$ok" "$rate" "$d" "$runs" "$fastest"
  rows+=("{\"profile\":\"$p\",\"model\":\"$MODEL\",\"nodes\":$NODES,\"shaped_gbps\":$rate,\"dilation\":$d,\"train_iteration_s\":$tr,\"train_fastest_iteration_s\":$fastest,\"sim_iteration_s\":$sim,\"pass\":$([ "$ok" = PASS ] && echo true || echo false)}")
done
(IFS=,; echo "{\"rows\":[${rows[*]}]}") >"$JSON"
echo "json: $JSON"
exit $fail
