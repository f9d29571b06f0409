#!/usr/bin/env bash
# Third device run (2026-11-27): AlexNet 12+4 wfbp/p3/full with more repetitions; compare_ddp at rest.
set -u
G=gpu-run
exec > >(tee -a "$OUT/run3.log") 2>&1
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site $G/*.whl && export PYTHONPATH=/tmp/site
el "load $(cut -d' ' -f1-3 /proc/loadavg)"
timeout 100 bash bench/torch/compare_ddp.sh --reps 2 --models fc --nets loopback --out-dir /tmp/ddp --python python3 2>&1 | grep -E "^\| loopback"
el "### alexnet 12+4"
timeout 130 $G/tidewire-compare-sync run --tidewire $G/tidewire --net loopback --case alexnet:12:4:- \
  --modes "wfbp p3 full" --reps 4 --iters 6 --timeout-s 40 --raw $OUT/raw3.tsv
$G/tidewire-compare-sync report --raw $OUT/raw3.tsv --md $OUT/compare-sync3.md --json /tmp/cs.json | head -8
el done
