#!/usr/bin/env bash
# compare-sync.sh - every `--sync` mode of `tidewire train` side by side, in one sitting,
# on loopback and under ci/netem bandwidth profiles: the "Never slower" benchmark.
#
# Usage: bench/compare-sync.sh [--cases "vgg19:3:1:- ..."] [--modes "wfbp fifo-ps sliced p3 hybrid full"]
#                              [--nets "loopback 1gbe 5gbe"] [--reps N] [--iters I] [--extra "ARGS"]
#                              [--out DIR] [--profile FILE|calibrate] [--enforce]
#   --cases  MODEL:WORKERS:SERVERS:BATCH, space-separated; SERVERS 0 is --colocate, BATCH - the
#            model's default (default: vgg19:3:1:- vgg19:4:0:- vgg19:4:1:128 resnet-50:2:2:-
#            alexnet:3:1:-)
#   --nets   loopback and/or ci/netem profiles (1gbe, 5gbe, ...; root, ip, tc and iperf3); a profile
#            that cannot run here is skipped with the reason
#   --reps   repetitions of every mode (default 3); the order of the modes rotates each repetition
#   --out    where raw.tsv, compare-sync.md, .json and .png go (default $TARGET_DIR/compare-sync/)
#   --profile  predict every run with `tidewire sim --profile` too and check train within 10% of
#            it (a `tidewire calibrate --out` file of this machine, or `calibrate` to measure one
#            first, into DIR/profile.json); the train runs take the same profile (--profile),
#            so that both decide from the same rates
#   --enforce  exit 1 when a check fails: full >= 0.95x the best other mode on every row;
#            full >= 1.3x wfbp on VGG19 at 1gbe; p3 >= 0.97x wfbp on loopback and at 5gbe; with
#            --profile, every run within 10% of the simulator's prediction
# Needs a release build of tidewire and tidewire-compare-sync (built here if missing).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/target-dir.sh
CASES="vgg19:3:1:- vgg19:4:0:- vgg19:4:1:128 resnet-50:2:2:- alexnet:3:1:-"
MODES="wfbp fifo-ps sliced p3 hybrid full"
NETS="loopback"
REPS=3
ITERS=4
EXTRA=""
OUT=$TARGET_DIR/compare-sync
ENFORCE=()
PROFILE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cases) CASES=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    --nets) NETS=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --extra) EXTRA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --enforce) ENFORCE=(--enforce); shift ;;
    --profile) PROFILE=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || { echo "--reps $REPS: give a positive count"; exit 2; }
[[ "$ITERS" =~ ^[1-9][0-9]*$ ]] || { echo "--iters $ITERS: give a positive count"; exit 2; }
mkdir -p "$OUT"
cargo build --release --locked -q -p tidewire-cli --bin tidewire -p tidewire-bench --bin tidewire-compare-sync </dev/null \
  || { echo "build failed"; exit 1; }
T=$TARGET_DIR/release/tidewire
C=$TARGET_DIR/release/tidewire-compare-sync
RAW=$OUT/raw.tsv
: >"$RAW"
SIM=()
# The predictions run each case as given: flags the runs take from --extra would be missing there.
if [ -n "$PROFILE" ] && [ -n "$EXTRA" ]; then
  echo "--profile with --extra: the simulator would not get \"$EXTRA\"; run them apart"; exit 2
fi
if [ "$PROFILE" = calibrate ]; then
  "$T" calibrate --out "$OUT/profile.json" || { echo "calibrate failed"; exit 1; }
  PROFILE=$OUT/profile.json
fi
if [ -n "$PROFILE" ]; then
  [ -r "$PROFILE" ] || { echo "--profile $PROFILE: not readable"; exit 2; }
  case "$PROFILE" in *[[:space:]]*)
    echo "--profile $PROFILE: a path with a space cannot reach train through --extra (it splits on spaces)"; exit 2 ;;
  esac
  SIM=(--sim "$OUT/sim.tsv")
  # train decides from the same rates as the simulator: without it each run measures its own
  # for 150 ms at start, and HybComm took the PS in train where the profile's rates took SFB
  # (VGG19 3 + 1, 2026-11-29: 39 samples/s against the simulator's 72 for SFB).
  EXTRA="--profile $PROFILE"
fi
echo "compare-sync: cases [$CASES], modes [$MODES], nets [$NETS], $REPS repetitions of $ITERS iterations; raw rows in $RAW"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
for net in $NETS; do
  cases=()
  for c in $CASES; do cases+=(--case "$c"); done
  if [ "$net" = loopback ]; then
    "$C" run --tidewire "$T" --net loopback "${cases[@]}" --modes "$MODES" --reps "$REPS" --iters "$ITERS" \
      --extra="$EXTRA" --raw "$RAW" || status=1
    continue
  fi
  why=""
  [ "$(id -u)" -eq 0 ] || why="not root"
  for tool in ip tc iperf3; do command -v "$tool" >/dev/null 2>&1 || why="${why:+$why; }no $tool"; done
  if [ -n "$why" ]; then
    echo "SKIP $net: the bandwidth harness needs root, ip, tc and iperf3 ($why)"
    continue
  fi
  for c in $CASES; do
    IFS=: read -r _ w s _ <<<"$c"
    nodes=$((s == 0 ? w : w + s))
    bash ci/netem/netem.sh run "$net" "$nodes" -- \
      "$C" run --tidewire "$T" --net "$net" --case "$c" --modes "$MODES" --reps "$REPS" --iters "$ITERS" \
      --extra="$EXTRA" --raw "$RAW" || status=1
  done
done
if [ -n "$PROFILE" ]; then
  "$C" predict --tidewire "$T" --profile "$PROFILE" --raw "$RAW" --out "$OUT/sim.tsv" --iters "$ITERS" || { status=1; SIM=(); }
fi
"$C" report "${SIM[@]}" --raw "$RAW" --md "$OUT/compare-sync.md" --json "$OUT/compare-sync.json" --png "$OUT/compare-sync.png" \
  "${ENFORCE[@]}" || status=1
echo "wrote $OUT/compare-sync.md, compare-sync.json, compare-sync.png"
exit $status
