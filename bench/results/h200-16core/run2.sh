#!/usr/bin/env bash
# Second device run (2026-11-27): CUDA test summaries, compare-sync with 3 repetitions, compare_ddp x2.
set -u
G=gpu-run
exec > >(tee -a "$OUT/run2.log") 2>&1
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site $G/*.whl && export PYTHONPATH=/tmp/site
el "### CUDA tests"
timeout 120 bash ci/gpu-bench.sh $G/tidewire $G/tidewire_gpu-* $G/cuda-* > /tmp/gb.log 2>&1; echo "gpu-bench rc $?"
grep -E "^### |test result|FAILED|panicked|wanted" /tmp/gb.log
el "### compare-sync 16 cores, 3 reps"
timeout 330 $G/tidewire-compare-sync run --tidewire $G/tidewire --net loopback --case vgg19:12:4:- --case resnet-50:12:4:- --case alexnet:12:4:- \
  --modes "wfbp p3 hybrid full" --reps 3 --iters 6 --timeout-s 60 --raw $OUT/raw2.tsv
$G/tidewire-compare-sync report --raw $OUT/raw2.tsv --md $OUT/compare-sync2.md --json /tmp/cs.json
cat $OUT/compare-sync2.md
left=$(( 500 - ($(date +%s) - t0) ))
el "### compare_ddp fc loopback ($left s left)"
if [ $left -gt 70 ]; then
  timeout $left bash bench/torch/compare_ddp.sh --reps 2 --models fc --nets loopback --out-dir /tmp/ddp --python python3 2>&1 | tail -8
  cp /tmp/ddp/compare-ddp.md $OUT/ddp2.md 2>/dev/null
fi
el done
