#!/usr/bin/env bash
# check_digits.sh - examples/torch/digits.py with 4 processes under torchrun (Tidewire)
# against the same job in one process (plain torch, the same global batch), in
# --deterministic-check mode, and checks:
#   - the 4-process run's final test accuracy >= 0.95;
#   - the loss curves agree within 1e-6 at every step (the max difference is printed);
#   - every rank's final parameter hash is the same.
# The 1-process run's hash is printed beside them (equal only if the sums round alike).
#
# Usage: examples/torch/check_digits.sh [--procs N] [--out DIR] [--tol 1e-6] [--min-acc 0.95] [-- DIGITS ARGS...]
#   e.g. examples/torch/check_digits.sh -- --apply server --sfb true
# PYTHON (default: python3 on PATH, or the bootstrap venv's) must import torch, sklearn and tidewire.
# TIDEWIRE_SECRET is generated when unset. Exit status 0 when every check passes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROCS=4
OUT=${TMPDIR:-/tmp}/tidewire-digits
TOL=1e-6
MIN_ACC=0.95
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --procs) PROCS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --tol) TOL=$2; shift 2 ;;
    --min-acc) MIN_ACC=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
BOOT=/var/cache/tidewire-python/venv-bootstrap/bin/python
if [ -z "${PYTHON:-}" ]; then
  if python3 -c 'import torch, sklearn, tidewire' 2>/dev/null; then PYTHON=python3; else PYTHON=$BOOT; fi
fi
export TIDEWIRE_SECRET=${TIDEWIRE_SECRET:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
mkdir -p "$OUT"
PORT=$((20000 + RANDOM % 11000))

echo "== $PROCS processes, Tidewire (torchrun, master port $PORT)"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$PROCS" --master-port "$PORT" \
  examples/torch/digits.py --deterministic-check --out "$OUT/tidewire-$PROCS.json" ${EXTRA[@]+"${EXTRA[@]}"}
echo "== 1 process, plain torch"
"$PYTHON" examples/torch/digits.py --procs 1 --deterministic-check --out "$OUT/reference-1.json" \
  ${EXTRA[@]+"${EXTRA[@]}"}

"$PYTHON" - "$OUT/tidewire-$PROCS.json" "$OUT/reference-1.json" "$TOL" "$MIN_ACC" <<'PY'
import json, sys
many, one = (json.load(open(f)) for f in sys.argv[1:3])
tol, min_acc = float(sys.argv[3]), float(sys.argv[4])
fails = []
n = many["procs"]
if len(many["loss"]) != len(one["loss"]):
    fails.append(f"{len(many['loss'])} steps against {len(one['loss'])}")
d = [abs(a - b) for a, b in zip(many["loss"], one["loss"])]
worst = max(range(len(d)), key=d.__getitem__)
print(f"loss curves: {len(d)} steps, max |{n}-proc - 1-proc| = {d[worst]:.3e} at step {worst} "
      f"({many['loss'][worst]:.9f} vs {one['loss'][worst]:.9f}); tolerance {tol:g}")
over = sum(x > tol for x in d)
if over:
    fails.append(f"{over} of {len(d)} steps differ by more than {tol:g} (first at step {next(i for i, x in enumerate(d) if x > tol)})")
print(f"test accuracy: {n} processes {many['test_accuracy']:.4f}, 1 process {one['test_accuracy']:.4f}; minimum {min_acc}")
if many["test_accuracy"] < min_acc:
    fails.append(f"accuracy {many['test_accuracy']:.4f} < {min_acc}")
h = many["param_sha256"]
print(f"final parameter SHA-256 per rank: " + ", ".join(f"rank {r} {x[:16]}" for r, x in enumerate(h)))
print(f"1-process reference:              {one['param_sha256'][0][:16]} "
      f"({'equal to' if one['param_sha256'][0] == h[0] else 'differs from'} the ranks', for information)")
if len(h) != n or len(set(h)) != 1:
    fails.append(f"the ranks' parameter hashes differ ({len(set(h))} distinct of {len(h)})")
if fails:
    print("FAIL: " + "; ".join(fails))
    sys.exit(1)
print(f"PASS: accuracy, loss curves within {tol:g}, identical parameters on all {n} ranks")
PY
