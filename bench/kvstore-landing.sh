#!/usr/bin/env bash
# kvstore-landing.sh - a server's landing memory against P1 under --sync kvstore (#33 item 2).
#
# The design's bound: a server's memory for incoming gradients is credits x slot size x
# peers, never P1 x model size. It runs `tidewire sim --sync kvstore` for P1 = 2..16 workers
# and a fixed number of servers, and prints, per P1, the landing region of one server (what
# `train` allocates and registers for incoming gradients: the simulator's Nodes report the
# same region_bytes the runtime allocates), the same per worker (flat when the bound holds),
# and the simulated iteration. It exits 1 if the landing memory per worker is not the same
# at every P1.
#
# Usage: bench/kvstore-landing.sh [--model M] [--servers S] [--from P] [--to P] [--iters I]
#                                 [--bin PATH] [--json FILE]
# Defaults: vgg19, 4 servers, P1 from 2 to 16, 2 iterations. Needs a release build of
# tidewire in cargo's target directory (ci/target-dir.sh), or --bin.
set -euo pipefail
CALLER=$PWD   # --bin and --json are taken from where it was called
cd "$(dirname "$0")/.."
. ci/target-dir.sh
MODEL=vgg19; SERVERS=4; FROM=2; TO=16; ITERS=2
JSON=$TARGET_DIR/kvstore-landing.json
T=$TARGET_DIR/release/tidewire
abs() { case "$1" in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    --from) FROM=$2; shift 2 ;;
    --to) TO=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --json) JSON=$(abs "$2"); shift 2 ;;
    --bin) T=$(abs "$2"); shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$T" ] || { echo "$T is missing: cargo build --release -p tidewire-cli --bin tidewire" >&2; exit 2; }
[ "$FROM" -ge 1 ] && [ "$FROM" -le "$TO" ] || { echo "--from $FROM must be 1 to --to $TO" >&2; exit 2; }
[ "$ITERS" -ge 1 ] || { echo "--iters must be at least 1, not $ITERS" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for ((p = FROM; p <= TO; p++)); do
  "$T" sim --model "$MODEL" --workers "$p" --servers "$SERVERS" --sync kvstore --iters "$ITERS" --json \
    >"$tmp/sim-$p.json" 2>"$tmp/err" || { echo "sim with $p workers failed:" >&2; tail -5 "$tmp/err" >&2; exit 1; }
done
python3 - "$tmp" "$FROM" "$TO" "$MODEL" "$SERVERS" "$JSON" <<'EOF'
import json, sys
tmp, lo, hi, model, servers, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
rows = []
print(f"kvstore landing memory: {model}, {servers} servers")
print(f"{'P1':>4} {'MB/server':>10} {'MB/worker':>10} {'iteration s':>12}")
for p in range(lo, hi + 1):
    d = json.load(open(f"{tmp}/sim-{p}.json"))
    land = d["landing_bytes_per_server"]
    rows.append({"workers": p, "servers": int(servers), "landing_bytes_per_server": land,
                 "landing_bytes_per_worker": land // p, "iteration_s": d["iteration_s"]})
    print(f"{p:>4} {land / 1e6:>10.1f} {land / p / 1e6:>10.2f} {d['iteration_s']:>12.4f}")
json.dump({"model": model, "rows": rows}, open(out, "w"), indent=1)
per = {r["landing_bytes_per_worker"] for r in rows}
if len(per) != 1 or any(r["landing_bytes_per_server"] != r["workers"] * min(per) for r in rows):
    sys.exit(f"landing memory per worker is not flat in P1: {sorted(per)}")
print(f"flat: {min(per) / 1e6:.2f} MB per worker at every P1 (written to {out})")
EOF
