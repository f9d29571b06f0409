#!/usr/bin/env bash
# On a GPU machine (e.g. the device tool's), from binaries built elsewhere with
# --features cuda: the CUDA tests, `tidewire bench aggregate --json`, and torch's
# equivalent sum on the same GPU in the same run (bench/gpu/torch_sum.py).
#   bash ci/gpu-bench.sh [TIDEWIRE_BIN] [TEST_BIN...]
# TIDEWIRE_BIN defaults to the target directory's release/tidewire (ci/target-dir.sh:
# cargo's, or ${CARGO_TARGET_DIR:-target} where there is no cargo).
# libnvrtc and libcublas come from the CUDA toolkit or from pip's nvidia-* wheels
# (torch's): their lib directories are added to LD_LIBRARY_PATH when found.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then bin=$1; shift; else . ci/target-dir.sh; bin=$TARGET_DIR/release/tidewire; fi
for d in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
for s in site.getsitepackages():
    for lib in glob.glob(os.path.join(s, "nvidia", "*", "lib")):
        print(lib)
PY
); do LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d; done
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
for t in "$@"; do echo "### $t"; "$t" --test-threads=1 --nocapture || rc=1; done
echo "### tidewire bench aggregate"
"$bin" doctor | sed -n '/\[cuda\]/,/^$/p'
"$bin" bench aggregate --json > "${OUT:-.}/aggregate.json" || rc=1
cat "${OUT:-.}/aggregate.json"
echo "### torch, same GPU, same run"
python3 bench/gpu/torch_sum.py | tee "${OUT:-.}/torch.json" || rc=1
python3 - "${OUT:-.}/aggregate.json" "${OUT:-.}/torch.json" <<'PY' || rc=1
import json, sys
ours = json.load(open(sys.argv[1]))["gpu"]
torch = json.load(open(sys.argv[2]))
print(f"sum kernel / d2d copy: {ours['ratio_vs_copy']:.3f} (>= 0.8 wanted); bitwise = cpu: {ours['matches_cpu_bitwise']}")
ours_gbps = ours["sum_gbps"]
for k in ("stacked", "inplace"):
    print(f"ours (acc +=) / torch {k}, GB/s counted as ours: {ours_gbps / torch[k + '_gbps_as_ours']:.3f}")
# Operation for operation, time per sum (torch's time over ours: > 1 is ours faster).
print(f"fresh sum (acc = sum), torch.sum(X, 0, out=acc) ms / ours ms: {torch['stacked_ms'] / ours['fresh_sum_ms']:.3f} (>= 1.0 wanted)")
print(f"accumulate (acc += sum), torch sum+add_ ms / ours ms: {torch['accumulate_ms'] / ours['sum_ms']:.3f} (>= 1.0 wanted)")
PY
exit $rc
