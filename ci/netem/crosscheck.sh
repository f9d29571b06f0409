#!/usr/bin/env bash
# crosscheck.sh - `tidewire train` under the bandwidth harness against `tidewire sim`
# with the same model, nodes, bandwidth and iterations: the iteration times must
# agree within 15%.
#
# Usage: ci/netem/crosscheck.sh [--model M] [--nodes N] [--iters I] [--runs R] [--profiles "1gbe 2gbe"] [--json FILE]
#
# For each profile it sets up N namespaces shaped to the profile (ci/netem/netem.sh run),
# runs `tidewire train --colocate` with one rank per namespace, then `tidewire sim` at the
# rate the links were shaped to, and compares their `iteration_s`. A dilated profile runs
# both with `--time-scale D`. `train` runs R times (default 2) and its fastest run counts:
# four ranks share this machine's two cores, so interference only ever slows `train`
# (a 5-iteration run at 2 GbE read 0.857 s once and 0.982 s another time).
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
PROFILES="1gbe 2gbe"
JSON=$TARGET_DIR/netem-crosscheck.json
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --profiles) PROFILES=$2; shift 2 ;;
    --json) JSON=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
T=$TARGET_DIR/release/tidewire
[ -x "$T" ] || { echo "$T is missing: build first with cargo build --release -p tidewire-cli --bin tidewire"; exit 2; }
mkdir -p "$(dirname "$JSON")"
rows=()
fail=0
printf '%-8s %-10s %5s %12s %12s %8s  %s\n' profile model nodes "train s/it" "sim s/it" "diff" verdict
for p in $PROFILES; do
  tr=""; runs=""
  for ((k = 0; k < RUNS; k++)); do
    out=$(bash ci/netem/netem.sh run "$p" "$NODES" -- sh -c '
      exec "$0" train --model "$1" --workers "$2" --colocate --iters "$3" --json \
        --time-scale "$NETEM_DILATION" --netns "$NETEM_NS" --netns-addrs "$NETEM_ADDRS" \
        && true' "$T" "$MODEL" "$NODES" "$ITERS" 2>/tmp/crosscheck.err)
    rc=$?
    if [ $rc -ne 0 ]; then
      echo "train under $p failed (exit $rc):"; tail -5 /tmp/crosscheck.err; fail=1; tr=""; break
    fi
    one=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["iteration_s"])' <<<"$out")
    runs+="${runs:+ }$one"
    tr=$(awk -v a="$tr" -v b="$one" 'BEGIN { print (a == "" || b + 0 < a + 0) ? b : a }')
  done
  [ -n "$tr" ] || continue
  # The harness says what it shaped to, and the dilation.
  rate=$(grep -o '[0-9.]* Gbit/s per NIC' /tmp/crosscheck.err | awk '{print $1}')
  d=$(grep -o 'dilation [0-9]*' /tmp/crosscheck.err | awk '{print $2}')
  sim=$("$T" sim --model "$MODEL" --nodes "$NODES" --iters "$ITERS" --bandwidth "${rate}gbit" \
        --time-scale "$d" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["iteration_s"])')
  diff=$(awk -v a="$tr" -v b="$sim" 'BEGIN { printf "%+.1f%%", (a - b) / b * 100 }')
  ok=$(awk -v a="$tr" -v b="$sim" 'BEGIN { r = (a - b) / b; if (r < 0) r = -r; print (r <= 0.15) ? "PASS" : "FAIL" }')
  [ "$ok" = PASS ] || fail=1
  printf '%-8s %-10s %5s %12.4f %12.4f %8s  %s (shaped %s Gbit/s, dilation %s; train runs: %s)\n' "$p" "$MODEL" "$NODES" "$tr" "$sim" "$diff" "$ok" "$rate" "$d" "$runs"
  rows+=("{\"profile\":\"$p\",\"model\":\"$MODEL\",\"nodes\":$NODES,\"shaped_gbps\":$rate,\"dilation\":$d,\"train_iteration_s\":$tr,\"sim_iteration_s\":$sim,\"pass\":$([ "$ok" = PASS ] && echo true || echo false)}")
done
(IFS=,; echo "{\"rows\":[${rows[*]}]}") >"$JSON"
echo "json: $JSON"
exit $fail
