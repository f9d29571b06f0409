#!/usr/bin/env bash
# freq_experiment.sh - Nexus's quality-guided communication frequency on a real training run:
# examples/torch/digits.py with N processes (torchrun, Tidewire), three configurations per seed:
#   t1        every step exchanges (T = 1, BSP gradient averaging through the PS, --sfb false:
#             the reference quality);
#   guided    model averaging (--comm-mode average), T adjusted by the loss (--quality-guided:
#             proposals every --quality-period exchanges up to --comm-every-max, rejection beyond
#             --quality-tolerance, back to T = 1 at 85% of the run);
#   fixed     model averaging with a fixed, aggressive T (--aggressive, default 64).
# Each run writes a record (per-epoch test accuracy, T per step, exchanges and pushes counted by
# tidewire_stats()) to OUT/<config>-seed<S>.json; then examples/torch/plot_freq.py writes
# OUT/summary.json, OUT/summary.md and OUT/freq-digits.png (the PNG needs matplotlib: PLOT_PYTHON).
#
# Usage: examples/torch/freq_experiment.sh [--out DIR] [--procs N] [--seeds "0 1 2"] [--epochs E]
#                                          [--aggressive T] [-- DIGITS ARGS...]
# Default OUT: bench/results/freq-digits. PYTHON: an interpreter with torch, sklearn and tidewire
# (default: python3, or the bootstrap venv's); PLOT_PYTHON: one with matplotlib (default: PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=bench/results/freq-digits
PROCS=4
SEEDS="0 1 2 3 4"
EPOCHS=6
AGG=64
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --procs) PROCS=$2; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --aggressive) AGG=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
BOOT=/var/cache/tidewire-python/venv-bootstrap/bin/python
if [ -z "${PYTHON:-}" ]; then
  if python3 -c 'import torch, sklearn, tidewire' 2>/dev/null; then PYTHON=python3; else PYTHON=$BOOT; fi
fi
export TIDEWIRE_SECRET=${TIDEWIRE_SECRET:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
mkdir -p "$OUT"
run() { # config seed args...
  local name=$1 seed=$2; shift 2
  local port=$((20000 + RANDOM % 11000))
  echo "== $name seed $seed: $*"
  "$PYTHON" -m torch.distributed.run --nproc-per-node "$PROCS" --master-port "$port" examples/torch/digits.py \
    --epochs "$EPOCHS" --seed "$seed" --record "$OUT/$name-seed$seed.json" "$@" ${EXTRA[@]+"${EXTRA[@]}"} \
    2>&1 | grep -E "^(final|steps)"
}
for s in $SEEDS; do
  run t1 "$s" --comm-every 1 --sfb false
  run guided "$s" --comm-mode average --quality-guided
  run fixed "$s" --comm-mode average --comm-every "$AGG"
done
"${PLOT_PYTHON:-$PYTHON}" examples/torch/plot_freq.py "$OUT"
