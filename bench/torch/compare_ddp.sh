#!/usr/bin/env bash
# compare_ddp.sh - PyTorch DDP (gloo) against Tidewire's DistributedOptimizer, side by
# side in the same processes (bench/torch/compare_ddp.py), on loopback and under the
# ci/netem bandwidth harness, for the FC-heavy and the convolution-heavy model of
# examples/torch/vgg_fc.py; repeated, summarized as JSON and a markdown table.
#
# Usage: bench/torch/compare_ddp.sh [--procs N] [--reps R] [--models "fc conv"] [--nets "loopback 1gbe"]
#                                   [--out-dir DIR] [--python PY] [-- COMPARE_DDP ARGS...]
#   --procs   ranks (default 4)
#   --reps    runs per (network, model) (default 3); each run has its own timed blocks
#   --nets    loopback (all ranks on 127.0.0.1) and/or ci/netem profiles (1gbe, 2gbe, ...):
#             one network namespace per rank on a star shaped with tc tbf, so every byte
#             between ranks crosses the shaped links. Needs root. Dilated profiles are
#             refused (this benchmark cannot slow torch's compute down).
#   --out-dir where compare-ddp.json, compare-ddp.md and compare-ddp-raw.tsv go
#             (default: cargo's target directory, $TARGET_DIR/compare-ddp/; the committed
#             copies are in bench/results/)
#   --python  an interpreter that imports torch and tidewire (default: python3 if it does,
#             else the newest venv of ci/python.sh that does, with PYTHONPATH as given)
#   --summarize WORKDIR   run nothing: summarize an earlier run's WORKDIR (printed at its start)
# Arguments after -- go to every compare_ddp.py (e.g. -- --steps 5 --blocks 4 --batch 32).
#
# Ranks are launched here with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (gloo's
# rendezvous; Tidewire's sessions listen on MASTER_PORT + 1000 + i, chosen by the package),
# GLOO_SOCKET_IFNAME (v0 in a namespace, lo on loopback) and one TIDEWIRE_SECRET per run.
# A run whose parameters are not allclose, or that fails, is reported and makes the exit
# status 1; its figures are kept out of the summary.
set -uo pipefail
CMDLINE="bench/torch/compare_ddp.sh $*"
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

# Inner mode: started by ci/netem/netem.sh run inside its environment (NETEM_NS, NETEM_ADDRS).
if [ "${1:-}" = "--inner-netem" ]; then
  shift
  PY=$1; N=$2; OUT=$3; LOGDIR=$4; shift 4
  [ "${NETEM_DILATION:-1}" = 1 ] || { echo "profile $NETEM_PROFILE runs dilated (D = $NETEM_DILATION): not supported here" >&2; exit 2; }
  read -r -a NS <<<"$NETEM_NS"
  read -r -a ADDRS <<<"$NETEM_ADDRS"
  port=$((20000 + RANDOM % 11000))
  pids=()
  for ((r = 0; r < N; r++)); do
    ip netns exec "${NS[$r]}" env RANK=$r LOCAL_RANK=0 WORLD_SIZE=$N MASTER_ADDR="${ADDRS[0]}" MASTER_PORT=$port \
      GLOO_SOCKET_IFNAME=v0 OMP_NUM_THREADS=1 timeout 900 "$PY" "$ROOT/bench/torch/compare_ddp.py" --out "$OUT" "$@" \
      >"$LOGDIR/rank$r.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  exit $rc
fi

. ci/target-dir.sh
PROCS=4
REPS=3
MODELS="fc conv"
NETS="loopback 1gbe"
OUTDIR=$TARGET_DIR/compare-ddp
PY=""
ARGS=()
SUMMARIZE=""
RUNS_TOTAL=
while [ $# -gt 0 ]; do
  case "$1" in
    --procs) PROCS=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --nets) NETS=$2; shift 2 ;;
    --out-dir) OUTDIR=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --summarize) SUMMARIZE=$2; shift 2 ;;
    --) shift; ARGS=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if python3 -c 'import torch, tidewire.torch' 2>/dev/null; then PY=$(command -v python3)
  else
    # The venv ci/python.sh built (in its cache directory, the newest that imports both).
    if [ -n "${TIDEWIRE_PYTHON_CACHE:-}" ]; then cache=$TIDEWIRE_PYTHON_CACHE
    elif [ "$(id -u)" -eq 0 ]; then cache=/var/cache/tidewire-python
    else cache=${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-python; fi
    for v in $(ls -td "$cache"/venv-*/ 2>/dev/null); do
      if "${v}bin/python" -c 'import torch, tidewire.torch' 2>/dev/null; then PY=${v}bin/python; break; fi
    done
    PY=${PY:-python3}
  fi
fi
"$PY" -c 'import torch, tidewire.torch' || { echo "$PY cannot import torch and tidewire.torch (build it: bash ci/python.sh, or set PYTHONPATH)"; exit 1; }
mkdir -p "$OUTDIR"
fail=0
if [ -n "$SUMMARIZE" ]; then
  WORK=$SUMMARIZE; RUNS=$WORK/runs; REPS=0
  [ -f "$WORK/cmdline" ] && CMDLINE=$(cat "$WORK/cmdline")
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/compare-ddp.XXXXXX")
  RUNS=$WORK/runs
  mkdir -p "$RUNS"
  echo "$CMDLINE" >"$WORK/cmdline"
  echo "runs and logs in $WORK"
fi

for rep in $(seq 1 "$REPS"); do
  for net in $NETS; do
    for model in $MODELS; do
      tag="$net-$model-rep$rep"
      logs=$WORK/logs/$tag
      mkdir -p "$logs"
      out=$RUNS/$tag.json
      export TIDEWIRE_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
      common=(--model "$model" --label "$net" ${ARGS[@]+"${ARGS[@]}"})
      start=$(date +%s)
      load=$(cut -d' ' -f1 /proc/loadavg)  # others' work on this machine shows here
      if [ "$net" = loopback ]; then
        # Below the kernel's ephemeral range (32768-60999), ports + 1000 + rank included:
        # a port in that range can be some connection's local port when rank 0 binds it.
        port=$((20000 + RANDOM % 11000))
        pids=()
        for ((r = 0; r < PROCS; r++)); do
          env RANK=$r LOCAL_RANK=$r WORLD_SIZE=$PROCS MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GLOO_SOCKET_IFNAME=lo \
            OMP_NUM_THREADS=1 timeout 900 "$PY" bench/torch/compare_ddp.py --out "$out" "${common[@]}" \
            >"$logs/rank$r.log" 2>&1 &
          pids+=($!)
        done
        rc=0
        for p in "${pids[@]}"; do wait "$p" || rc=$?; done
      else
        [ "$(id -u)" -eq 0 ] || { echo "--nets $net needs root (network namespaces)"; exit 2; }
        bash ci/netem/netem.sh run "$net" "$PROCS" -- \
          bash "$0" --inner-netem "$PY" "$PROCS" "$out" "$logs" "${common[@]}" 2>"$logs/netem.log"
        rc=$?
        grep -h 'namespaces on a' "$logs/netem.log" | tail -1
      fi
      took=$(($(date +%s) - start))
      if [ $rc -ne 0 ] || [ ! -s "$out" ]; then
        echo "$tag: FAILED (exit $rc, $took s); last lines of rank 0:"; tail -5 "$logs/rank0.log"
        fail=1
        rm -f "$out"
        continue
      fi
      printf '%s\t%s\n' "$tag" "$load" >>"$WORK/load.tsv"
      echo "$tag ($took s, load $load at start): $(grep -h 'samples/s, ratio' "$logs/rank0.log" | tail -1)"
    done
  done
done

"$PY" - "$RUNS" "$OUTDIR" "$PROCS" "$REPS" "$CMDLINE" <<'PY' || fail=1
import datetime, glob, json, os, statistics, sys
runs_dir, outdir, procs, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import tidewire
pkg = {"tidewire_version": tidewire.__version__, "tidewire_from": os.path.dirname(tidewire.__file__)}
runs = []
load_file = os.path.join(os.path.dirname(runs_dir), "load.tsv")
loads = dict(l.split("\t") for l in open(load_file).read().split("\n") if l) if os.path.exists(load_file) else {}
for f in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
    d = json.load(open(f))
    d["load1_at_start"] = float(loads.get(os.path.basename(f)[:-5], "nan"))
    runs.append(d)
if not runs:
    print("no run finished"); sys.exit(1)
raw = ["net\tmodel\trep\tsystem\tblock\tseconds\tsamples_s"]
for f in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
    d = json.load(open(f))
    rep = f.rsplit("-rep", 1)[1].split(".")[0]
    for b in d["block_times"]:
        raw.append(f"{d['label']}\t{d['model']}\t{rep}\t{b['system']}\t{b['block']}\t{b['seconds']:.4f}\t{b['samples_s']:.2f}")
rows, bad = [], 0
order = lambda d: (d["label"] != "loopback", d["label"], d["model"] != "fc")
keys = sorted({(d["label"], d["model"]) for d in runs}, key=lambda k: order({"label": k[0], "model": k[1]}))
for net, model in keys:
    rs = [d for d in runs if (d["label"], d["model"]) == (net, model)]
    ok = [d for d in rs if d["allclose"] and d["tidewire_ranks_identical"]]
    bad += len(rs) - len(ok)
    if not ok:
        continue
    ratios = [d["ratio"] for d in ok]
    med = statistics.median
    schemes = ok[0].get("tidewire_stats", {}).get("schemes", {})
    rows.append({
        "net": net, "model": model, "params": ok[0]["params"], "world": ok[0]["world"],
        "batch_per_rank": ok[0]["batch_per_rank"], "reps": len(ok),
        "timed_steps_per_rep": ok[0]["blocks"] * ok[0]["steps_per_block"],
        "gloo_samples_s_median": med(d["gloo_samples_s"] for d in ok),
        "tidewire_samples_s_median": med(d["tidewire_samples_s"] for d in ok),
        "ratio_median": med(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
        "gloo_samples_s": [d["gloo_samples_s"] for d in ok], "tidewire_samples_s": [d["tidewire_samples_s"] for d in ok],
        "load1_at_start": [d["load1_at_start"] for d in ok],
        "load1_min": min(d["load1_at_start"] for d in ok), "load1_max": max(d["load1_at_start"] for d in ok),
        "block_ratio_min": min(min(t / g for t, g in zip(d["block_samples_s"]["tidewire"], d["block_samples_s"]["gloo"])) for d in ok),
        "block_ratio_max": max(max(t / g for t, g in zip(d["block_samples_s"]["tidewire"], d["block_samples_s"]["gloo"])) for d in ok),
        "allclose_all": all(d["allclose"] for d in rs),
        "max_abs_diff": max(d["max_abs_diff"] for d in ok),
        "allclose_margin_max": max(d["allclose_margin"] for d in ok),
        "rtol": ok[0]["rtol"], "atol": ok[0]["atol"],
        "sfb_layers": sorted(k for k, v in schemes.items() if v == "sfb"),
        "transport": ok[0].get("tidewire_stats", {}).get("transport"),
    })
first = runs[0]
summary = {
    "date": datetime.date.today().isoformat(),
    "command": sys.argv[5],
    "procs": procs, "reps_requested": reps or None, **pkg,
    "settings": {k: first[k] for k in ("batch_per_rank", "warmup", "steps_per_block", "blocks", "apply", "sfb",
                                        "prefetch", "threads", "lr", "momentum", "seed", "rtol", "atol", "torch")},
    "rows": rows, "failed_or_not_close_runs": bad,
}
os.makedirs(outdir, exist_ok=True)
json.dump(summary, open(os.path.join(outdir, "compare-ddp.json"), "w"), indent=1)
open(os.path.join(outdir, "compare-ddp-raw.tsv"), "w").write("\n".join(raw) + "\n")
s = first
md = [f"# Tidewire vs PyTorch DDP (gloo), {procs} ranks, side by side", "",
      f"{summary['date']}; {procs} processes x {s['batch_per_rank']} samples, {s['threads']} torch thread each, "
      f"apply={s['apply']}, sfb={s['sfb']}, SGD lr {s['lr']} momentum {s['momentum']}, torch {s['torch']}. "
      f"Per run: {s['warmup']} untimed steps per system, then {s['blocks']} alternating blocks of "
      f"{s['steps_per_block']} steps each. Throughput = all ranks' samples / the timed blocks' time; "
      f"ratio = Tidewire / gloo; the spread is over runs (min..max) and over single blocks.", "",
      f"Command: `{summary['command']}`.", "",
      "| network | model | params | runs | gloo samples/s | Tidewire samples/s | ratio (median) | ratio min..max (runs) | block ratios min..max | allclose (max abs diff) | SFB layers | load at start |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    md.append(f"| {r['net']} | {r['model']} | {r['params'] / 1e6:.2f} M | {r['reps']} | {r['gloo_samples_s_median']:.1f} | "
              f"{r['tidewire_samples_s_median']:.1f} | **{r['ratio_median']:.2f}** | {r['ratio_min']:.2f}..{r['ratio_max']:.2f} | "
              f"{r['block_ratio_min']:.2f}..{r['block_ratio_max']:.2f} | {'yes' if r['allclose_all'] else 'NO'} "
              f"({r['max_abs_diff']:.1e}) | {', '.join(r['sfb_layers']) or '-'} | {r['load1_min']:.1f}..{r['load1_max']:.1f} |")
md += ["", f"allclose: Tidewire's against DDP's parameters after the run's last step, on every rank, "
       f"rtol {s['rtol']:g}, atol {s['atol']:g}. Runs that failed or were not close: {bad}.",
       "", "Load at start: the 1-minute load average when each run began (the machine's other work "
       "shows there; this benchmark's 4 ranks alone bring it near 4). Medians are over runs; the gloo and "
       "Tidewire medians are taken separately, so their quotient need not equal the median ratio."]
open(os.path.join(outdir, "compare-ddp.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
print(f"\nwrote {outdir}/compare-ddp.json, compare-ddp.md, compare-ddp-raw.tsv")
sys.exit(1 if bad else 0)
PY
exit $fail
