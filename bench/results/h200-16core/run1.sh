#!/usr/bin/env bash
# Device run for #28 (2026-11-27): CUDA tests + sum vs torch, calibrate, train --aggregate auto,
# compare-sync on 16 cores, CUDA pytest, compare_ddp. Everything into $OUT (7 files).
set -u
G=gpu-run
L=$OUT/run.log
exec > >(tee -a "$L") 2>&1
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site $G/*.whl && export PYTHONPATH=/tmp/site
el "### gpu-bench"
timeout 150 bash ci/gpu-bench.sh $G/tidewire $G/tidewire_gpu-* $G/cuda-* 2>&1 | grep -v "^test .* ok$" | tail -40
el "### calibrate"
timeout 40 $G/tidewire calibrate --json > $OUT/calibrate.json 2>/dev/null || timeout 40 $G/tidewire calibrate > $OUT/calibrate.json
head -c 1500 $OUT/calibrate.json; echo
el "### train --aggregate auto"
timeout 60 $G/tidewire train --model resnet-50 --workers 4 --servers 2 --iters 3 --aggregate auto --verify 2>&1 | tail -15
timeout 60 $G/tidewire train --model vgg19 --workers 3 --servers 1 --iters 3 --aggregate gpu --verify 2>&1 | tail -8
el "### compare-sync 16 cores"
timeout 260 $G/tidewire-compare-sync run --tidewire $G/tidewire --net loopback --case vgg19:12:4:- --case resnet-50:12:4:- \
  --modes "wfbp p3 hybrid full" --reps 1 --iters 4 --timeout-s 90 --raw $OUT/raw.tsv
$G/tidewire-compare-sync report --raw $OUT/raw.tsv --md $OUT/compare-sync.md --json /tmp/cs.json
cat $OUT/compare-sync.md
el "### cuda pytest"
timeout 60 python3 -m pytest -q -x python/tests/test_optimizer.py -k cuda -s 2>&1 | tail -8
el "### compare_ddp fc loopback"
left=$(( 530 - ($(date +%s) - t0) ))
if [ $left -gt 60 ]; then
  timeout $left bash bench/torch/compare_ddp.sh --reps 1 --models fc --nets loopback --out-dir /tmp/ddp --python python3 2>&1 | tail -12
  cp /tmp/ddp/compare-ddp.md $OUT/ddp.md 2>/dev/null
else el "skipped compare_ddp: $left s left"; fi
el done
