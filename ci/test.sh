#!/usr/bin/env bash
# Tidewire's test entry point (the README's test command, and what .ci/run calls).
#
# It installs what it needs with apt-get (idempotently), then runs every tier:
#   1. format    cargo fmt --check
#   2. lint      cargo clippy --all-targets --all-features -D warnings
#   3. sans-io   the engine core's dependency tree holds no I/O crate, and the library's
#                (`tidewire`) none of the command's (clap, indicatif, tracing-subscriber)
#   3b. layout   no import cycles between the modules of any crate (ci/import-cycles.py), and at
#                least one assertion per function in the engine outside tests (ci/assert-density.py)
#   3c. docs     the book (docs/, mdBook; mdbook installed by cargo when missing) builds into
#                $TARGET_DIR/book, and no relative link or #anchor of the README, python/README.md,
#                the book's sources or the built book is broken (ci/check-links.py; external
#                links are counted, not fetched)
#   3a. build    cargo build --release --workspace --all-features --all-targets, once: every
#                later tier runs what it built (scripts get TIDEWIRE_CARGO_SELECT="--workspace
#                --all-features", so cargo finds their builds done). Downloads (torch's venv,
#                nightly with miri, NVRTC wheels) run in the background from the start.
#   4. tests     cargo test --release --workspace --all-features: unit tests, the engine's
#                deterministic simulation (tier 2) and its randomized jobs (200 VOPR seeds),
#                conformance on TCP, the embedding API, and end-to-end `tidewire train`
#                clusters (VGG19 --verify with 1, 2 and 4 workers, the configurations that used
#                to crash, every sync mode, lowered transport limits, SSP, killed and frozen
#                workers), doc tests
#   4a. assertions  the engine and the simulator in the debug profile, where the engine's
#                debug_asserts and per-input invariant checks run: their tests, and 1000 VOPR seeds
#   4b. miri     the unsafe code of registered memory under Miri (ci/miri.sh)
#   4c. fuzz     every fuzz target (fuzz/, cargo fuzz) 10 s from its seed corpus, one per core
#                at a time, no crash (ci/fuzz.sh)
#   5. doctor    tidewire doctor runs and explains itself
#   6. example   examples/mlp: 3 processes train an MLP; the loss curve equals one process's
#   6b. capi     the C ABI: header current and -pedantic clean, train.c on loopback processes (ci/capi.sh)
#   6c. python   the Python package: cached venv with torch, maturin wheel, pytest (ci/python.sh),
#                and examples/torch/check_digits.sh (4 torchrun processes >= 95%, equal to 1 process)
#   7. train     the README's main job, short: tidewire train on the embedded default
#   8. bench     grad_ready-to-wire latency and the idle cost of a session (tidewire-handin),
#                short loopback comparison against iperf3 and std::net, tidewire-perf over TCP
#                against iperf3 (bench/compare-tcp.sh, one short round, with its plot), the
#                single-node engine overhead, and CPU aggregation against a STREAM triad
#                (informational: performance is judged from full bench runs)
#   9. rdma-fallback  an `rdma` build where libibverbs is missing falls back to TCP and says why
#   9a. no-uring io_uring denied by a seccomp filter on the test processes (ci/no-uring.c, as
#                Docker's default profile does): the conformance suite, the hostile-peer cases and
#                the allocation test on the portable backend, `tidewire train --verify` (it must
#                say it runs portable and why) and `tidewire doctor` explaining that io_uring is
#                unusable and what is used instead; as root, train and doctor again with
#                kernel.io_uring_disabled=2 (restored by a trap on any exit)
#   9b. netem    the bandwidth harness (ci/netem/): every profile measured with iperf3 between
#                namespaces within 10% of its target (dilated above half the ceiling), and
#                `tidewire train` under it against `tidewire sim`: between -10% and +20% (4 nodes, 1 and 2 GbE;
#                its fastest of 2 runs, and up to 8 while it is over)
#   9c. papers   bench/papers in simulation: Poseidon's and P3's figures regenerated into
#                $TARGET_DIR/papers/, failing if one of the papers' effects does not show; and
#                `tidewire sim` of VGG19 on 256 nodes for 3 iterations, with its wall time
#  10. soft-roce  ci/test-rdma.sh: the RDMA conformance suite and RDMA-only cases on real rxe
#                devices in a QEMU VM, `tidewire train --verify` over RDMA, and tidewire-perf
#                against Debian's perftest both ways (ci/perf-guest.sh), doctor's rxe probes, and
#                RDMA write_bw through tbf on the VM's veth within -15%/+5% of the tbf rate.
#                It runs in the background beside tiers 4 to 9a (one QEMU process, about one
#                core, where those leave one idle much of the time), and ends before netem.
#  11. nvrtc     the CUDA aggregation kernels compiled by NVRTC, CUDA 12's and CUDA 13's (pip's
#                libnvrtc wheels; no GPU needed)
#  12. gpu       with a GPU: the CUDA tests (kernels bitwise against the CPU), and bench aggregate
# The GPU tier says here when it skips, and why.
# It ends with the plain line "N passed, M failed, K skipped" and exits non-zero on any failure.
# What it builds, and the reports the tiers write, go to cargo's target directory (TARGET_DIR,
# from ci/target-dir.sh: CARGO_TARGET_DIR when set, else ./target).
set -uo pipefail
cd "$(dirname "$0")/.."

passed=0; failed=0; skipped=0
results=()
# TIDEWIRE_CI_ONLY=a,b,...: run only those tiers (while working on them; the summary says
# how many others did not run). CI runs them all.
not_run=0
only_skips() { # name: true when TIDEWIRE_CI_ONLY leaves this tier out
  [ -n "${TIDEWIRE_CI_ONLY:-}" ] && [[ ",$TIDEWIRE_CI_ONLY," != *",$1,"* ]]
}
record() { # name, exit status, seconds it ran, log[, how]: the tier's summary line
  local name=$1 rc=$2 secs=$3 log=$4 how=${5:-}
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1)); results+=("PASS  $name ($secs s$how)")
  else
    failed=$((failed + 1)); results+=("FAIL  $name ($secs s$how)")
    # The summary says why too, in the last lines the tier printed (a CI page may show
    # only the summary).
    local why
    while IFS= read -r why; do results+=("        | ${why:0:200}"); done \
      < <(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -n 6)
    failed_logs+=("$name:$log")
  fi
}
tier() { # name, command...
  local name=$1; shift
  if only_skips "$name"; then not_run=$((not_run + 1)); return 0; fi
  echo
  echo "==================== tier: $name ===================="
  local t0=$SECONDS rc
  # The tier's output goes to the terminal and to its log; the summary repeats the end
  # of a failed tier's log, so that a CI page showing only the end still says why.
  local log=${TIER_LOGS:-/tmp}/$name.log
  # $! before: a background fetch's pid is not tee's.
  local bg_before=${!:-}
  "$@" > >(tee "$log") 2>&1
  rc=$?
  # tee ends when the last writer closes; a background process the tier left holding the
  # pipe must not hold the run, so wait for it at most 5 s. (bash sets $! for a process
  # substitution only in some cases, e.g. not when the command is an external program.)
  local tee_pid=${!:-} i
  if [ -n "$tee_pid" ] && [ "$tee_pid" != "$bg_before" ]; then
    for ((i = 0; i < 50; i++)); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
  else
    sleep 0.2
  fi
  record "$name" "$rc" "$((SECONDS - t0))" "$log"
}
# A tier that runs beside the ones after it, for a tier that keeps about one core busy
# while the others leave one idle for much of their time (soft-roce: one QEMU process,
# 107% CPU, beside the tests tier's 130-170%). Its log is printed when tier_join waits for
# it; its time is its own wall time.
declare -A BG_TIER=()
tier_bg() { # name, command...
  local name=$1; shift
  if only_skips "$name"; then not_run=$((not_run + 1)); return 0; fi
  local log=${TIER_LOGS:-/tmp}/$name.log
  echo
  echo "==================== tier: $name (starts in the background; its log follows when it ends) ===================="
  # Its own wall time, taken where it runs (the join may come long after it ended).
  ( s=$SECONDS; "$@"; rc=$?; echo $((SECONDS - s)) >"$log.secs"; exit $rc ) >"$log" 2>&1 </dev/null &
  BG_TIER[$name]=$!
}
tier_join() { # name: waits for tier_bg's tier and records it
  local name=$1 pid rc t_wait=$SECONDS
  [ -n "${BG_TIER[$name]:-}" ] || return 0
  pid=${BG_TIER[$name]}
  unset "BG_TIER[$name]"
  local log=${TIER_LOGS:-/tmp}/$name.log
  echo
  echo "==================== tier: $name (ran in the background) ===================="
  wait "$pid"; rc=$?
  cat "$log"
  local took
  took=$(cat "$log.secs" 2>/dev/null) || took="?"
  echo "---- $name ran $took s in the background; waited $((SECONDS - t_wait)) s for it here"
  record "$name" "$rc" "$took" "$log" ", in the background"
}
failed_logs=()
skip() { # name, reason
  echo
  echo "==================== tier: $1 ===================="
  echo "SKIPPED: $2"
  skipped=$((skipped + 1)); results+=("SKIP  $1: $2")
}

# --- setup -----------------------------------------------------------------
need_pkgs=()
command -v iperf3 >/dev/null 2>&1 || need_pkgs+=(iperf3)
# pip fetches libnvrtc (the CUDA kernels' compiler, CUDA 12's and 13's) for the nvrtc tier.
command -v pip3 >/dev/null 2>&1 || need_pkgs+=(python3-pip)
command -v cc >/dev/null 2>&1 || need_pkgs+=(build-essential)
# sideway (the `rdma` feature, built by --all-features) compiles rdma-core stubs with cmake
# and generates bindings with libclang; libibverbs1 + ibverbs-providers are what it loads at
# run time (the rdma-fallback tier hides them again to prove the TCP fallback).
# fonts-dejavu-core: the font tidewire-perf-report draws its plots with.
# The soft-RoCE tier's VM (ci/softroce-vm.sh) needs qemu-system-x86 busybox-static kmod
# ibverbs-utils perftest rdmacm-utils, and the python tier python3-venv: all in one apt-get
# call here rather than three later.
for p in cmake libclang-dev libibverbs1 ibverbs-providers fonts-dejavu-core iproute2 \
         qemu-system-x86 busybox-static kmod ibverbs-utils perftest rdmacm-utils python3-venv; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "installing: ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null \
      || { echo "apt-get install ${need_pkgs[*]} failed"; exit 1; }
  else
    echo "missing packages ${need_pkgs[*]}, and not root: run 'sudo apt-get install ${need_pkgs[*]}' or run this script as root"
    exit 1
  fi
fi
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy || { echo "rustfmt/clippy missing and rustup could not add them"; exit 1; }
fi
export CARGO_TERM_COLOR=never
. ci/target-dir.sh
TIER_LOGS=$TARGET_DIR/ci-logs
mkdir -p "$TIER_LOGS"

# --- fetched in the background ------------------------------------------------
# What is mostly a download starts now and overlaps the compiling: torch and the test venv
# (~3 GB, once), the nightly toolchain with miri (miri and fuzz tiers) and CUDA's NVRTC
# wheels (nvrtc tier). The tier that needs one waits for it (await_fetch) and prints its log.
declare -A FETCH_PID=()
fetch() { # name, command...
  local name=$1; shift
  "$@" >"$TIER_LOGS/fetch-$name.log" 2>&1 </dev/null &
  FETCH_PID[$name]=$!
  echo "fetching in the background: $name (log $TIER_LOGS/fetch-$name.log)"
}
await_fetch() { # name: waits for it, prints its log, and returns its status
  local name=$1 rc t0=$SECONDS
  [ -n "${FETCH_PID[$name]:-}" ] || return 0
  wait "${FETCH_PID[$name]}"; rc=$?
  unset "FETCH_PID[$name]"
  echo "---- background fetch $name: exit $rc (waited $((SECONDS - t0)) s here); its log:"
  cat "$TIER_LOGS/fetch-$name.log"
  echo "---- end of $name's log"
  return $rc
}
# NVRTC needs no GPU: compile the aggregation kernels with pip's libnvrtc of CUDA 12 and of
# CUDA 13 in turn (each cached outside the clone, in a directory named after its pin), in both
# modes, for the lowest architecture that NVRTC lists and for what a compute 8.0 and a 9.0
# device get from it, and check the PTX (no FMA in deterministic mode, float4 loads). The test
# must run, not skip, and must say it loaded the NVRTC of the major version installed.
if [ "$(id -u)" -eq 0 ]; then NVRTC_DIR=${TIDEWIRE_NVRTC_DIR:-/var/cache/tidewire-nvrtc}
else NVRTC_DIR=${TIDEWIRE_NVRTC_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-nvrtc}; fi
# "pip requirement | the wheel's directory holding libnvrtc.so.MAJOR | MAJOR". CUDA 13's wheel
# is nvidia-cuda-nvrtc (nvidia-cuda-nvrtc-cu13 on PyPI is a deprecated stub that refuses to build).
NVRTC_WHEELS=(
  "nvidia-cuda-nvrtc-cu12==12.8.93|nvidia/cuda_nvrtc/lib|12"
  "nvidia-cuda-nvrtc==13.0.88|nvidia/cu13/lib|13"
)
nvrtc_fetch() { # requirement, lib dir inside the wheel, CUDA major: the wheel, unpacked (once)
  local req=$1 sub=$2 major=$3
  local dest=$NVRTC_DIR/${req/==/-}
  local lib=$dest/$sub
  if [ ! -e "$lib/libnvrtc.so.$major" ]; then
    echo "installing $req into $dest"
    local tmp; tmp=$(mktemp -d)
    if ! pip3 download --no-deps --quiet -d "$tmp/dl" "$req"; then
      echo "NVRTC $major: CANNOT INSTALL $req: 'pip3 download' failed (no network or no such version on the index; see pip's message above)"
      rm -rf "$tmp"; return 1
    fi
    local whl=("$tmp"/dl/*.whl)
    if [ ! -f "${whl[0]}" ] || ! python3 -m zipfile -e "${whl[0]}" "$tmp/x" \
       || [ ! -e "$tmp/x/$sub/libnvrtc.so.$major" ]; then
      echo "NVRTC $major: CANNOT INSTALL $req: no wheel, or it does not unpack to $sub/libnvrtc.so.$major (its layout: $(ls "$tmp"/dl 2>&1))"
      rm -rf "$tmp"; return 1
    fi
    # Moved into place whole, so an interrupted install is never taken for a cached one.
    mkdir -p "$NVRTC_DIR" && rm -rf "$dest" && mv "$tmp/x" "$dest" || { rm -rf "$tmp"; return 1; }
    rm -rf "$tmp"
  fi
  # cudarc (built for CUDA 12.8) looks for libnvrtc.so, .so.12, .so.11, ...: not .so.13, which is
  # all CUDA 13's wheel has. Give it the unversioned name a toolkit install also has.
  ln -sfn "libnvrtc.so.$major" "$lib/libnvrtc.so"
}
nvrtc_fetch_all() {
  local w req sub major rc=0
  for w in "${NVRTC_WHEELS[@]}"; do
    IFS='|' read -r req sub major <<<"$w"
    nvrtc_fetch "$req" "$sub" "$major" || rc=1
  done
  return $rc
}
fetch python bash ci/python.sh --venv-only
fetch nvrtc nvrtc_fetch_all
command -v rustup >/dev/null 2>&1 && fetch nightly bash ci/miri.sh --install-only

# --- one build ----------------------------------------------------------------
# Every tier after `build` runs what `build` compiled: the whole workspace, every feature
# (rdma and cuda are probed at run time), release, all targets. Scripts that build for
# themselves take the same selection from TIDEWIRE_CARGO_SELECT, so cargo finds it done
# instead of compiling another feature set. Only lint (clippy), the engine's
# debug-assertion tier, miri, fuzz, the python wheel (maturin), the README's `cargo run`
# and the GPU tier compile anything else.
export TIDEWIRE_CARGO_SELECT="--workspace --all-features"
# The release profile keeps line tables for perf (Cargo.toml: debug = 1); CI has no use for
# them: a cold build of everything took 248 s without them against 272 s with, here. Every
# cargo call below inherits this, so they all share the one build.
export CARGO_PROFILE_RELEASE_DEBUG=${CARGO_PROFILE_RELEASE_DEBUG:-0}
ALL=(--release --locked -q --workspace --all-features)
TW=$TARGET_DIR/release/tidewire
test_bins() { # target names...: the paths of those test binaries of the one build
  cargo test "${ALL[@]}" --no-run --message-format=json 2>/dev/null | python3 -c 'import json, sys
want = set(sys.argv[1:])
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
       and m["target"]["name"] in want:
        print(m["executable"])' "$@"
}

# --- tiers -----------------------------------------------------------------
tier format cargo fmt --all --check
tier lint cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
tier build cargo build --release --locked --workspace --all-features --all-targets

sans_io() {
  local bad
  bad=$(cargo tree -p tidewire-engine -e normal,build --prefix none --locked \
        | grep -E '^(io-uring|sideway|rdma-mummy-sys|cudarc|tidewire-transport|tidewire-gpu|libc) ' | sort -u)
  if [ -n "$bad" ]; then echo "tidewire-engine depends on I/O crates:"; echo "$bad"; return 1; fi
  echo "tidewire-engine's dependency tree has no I/O crate"
  # The library a training program embeds compiles none of the CLI's dependencies
  # (they belong to tidewire-cli, in cli/).
  bad=$(cargo tree -p tidewire -e normal --prefix none --locked \
        | grep -E '^(clap|indicatif|tracing-subscriber) ' | sort -u)
  if [ -n "$bad" ]; then echo "the tidewire library depends on CLI crates:"; echo "$bad"; return 1; fi
  echo "tidewire's dependency tree has no clap, indicatif or tracing-subscriber"
}
tier sans-io sans_io

# No two modules of a crate import each other, directly or in a ring (ci/import-cycles.py;
# re-exports are not imports). --map prints each crate's module map. And the engine keeps at
# least one assertion per function outside tests (ci/assert-density.py; its debug_asserts run
# in every debug test, the VOPR's included).
tier layout bash -c 'python3 ci/import-cycles.py && python3 ci/assert-density.py --check'

# The book (docs/): mdBook builds it, and ci/check-links.py checks every relative link and
# anchor of the README and the book, in the sources and in the built pages. mdbook is
# installed once with cargo (from crates.io; without its `serve` and `watch` features, so
# without tokio and axum) and found again in cargo's bin directory or on the PATH.
MDBOOK_VERSION=0.5.4
docs() {
  local mdbook= m v
  for m in "${CARGO_HOME:-$HOME/.cargo}/bin/mdbook" "$(command -v mdbook)"; do
    [ -n "$m" ] && v=$("$m" --version 2>/dev/null) && [[ $v == "mdbook v0.5."* ]] && { mdbook=$m; break; }
  done
  if [ -z "$mdbook" ]; then
    echo "installing mdbook $MDBOOK_VERSION (cargo install, once)"
    cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search \
      || { echo "cargo install mdbook $MDBOOK_VERSION failed (it needs crates.io)"; return 1; }
    mdbook=${CARGO_HOME:-$HOME/.cargo}/bin/mdbook
  fi
  "$mdbook" --version || return 1
  rm -rf "$TARGET_DIR/book"
  "$mdbook" build docs --dest-dir "$TARGET_DIR/book" || return 1
  python3 ci/check-links.py --html "$TARGET_DIR/book"
}
tier docs docs

# Real soft-RoCE: rdma_rxe in a QEMU VM (this kernel has no RDMA); see ci/test-rdma.sh. It
# runs beside the tiers from tests to no-uring (none of them judges a time or a rate; bench's
# figures are informational) and ends before netem, which judges rates. Its own rate check
# (tbf) compares two runs in the VM, and measures the shaped one twice before it fails.
# Its cargo calls run here, before the tests start (a cargo call re-links release/tidewire,
# which the tests run); the VM runs copies of the binaries.
if ! only_skips soft-roce; then
  bash ci/test-rdma.sh --build-only >"$TIER_LOGS/soft-roce-build.log" 2>&1 </dev/null
  softroce_build_rc=$?
fi
softroce() {
  cat "$TIER_LOGS/soft-roce-build.log"
  [ "$softroce_build_rc" -eq 0 ] || { echo "ci/test-rdma.sh --build-only failed (exit $softroce_build_rc)"; return 1; }
  bash ci/test-rdma.sh --prebuilt
}
tier_bg soft-roce softroce

# Every test of the workspace, on the release build of the `build` tier (the VOPR at its
# default 200 seeds: the assertions tier runs 1000 with the engine's assertions on).
tier tests cargo test --release --workspace --all-features --locked --no-fail-fast
# The engine and the simulator again in the debug profile, where the engine's debug_asserts
# and its per-input invariant checks run: unit tests, the deterministic simulation and the
# randomized jobs (sim/tests/vopr.rs: 1000 seeds here, 200 by default).
# No debug info there (CARGO_PROFILE_DEV_DEBUG=0): a failed assertion still names its file and
# line, and the build takes 63 s instead of 77 s here.
tier assertions env TIDEWIRE_VOPR_SEEDS="${TIDEWIRE_VOPR_SEEDS:-1000}" CARGO_PROFILE_DEV_DEBUG=0 \
  cargo test --locked -p tidewire-engine -p tidewire-sim --lib --tests --no-fail-fast

# Miri checks the unsafe code of registered memory (Region, Lease, PinnedBuffer) for undefined
# behaviour, data races included; ci/miri.sh installs nightly with miri when it is missing.
miri() { await_fetch nightly; bash ci/miri.sh; }
tier miri miri

# libFuzzer on every decoder that reads a peer's bytes (fuzz/: frames and stream reassembly,
# the handshake both sides, rendezvous lines, RDMA wire and notices, perftest's out-of-band
# messages, the engine's messages), 10 s each from the committed seed corpus; any crash
# fails. ci/fuzz.sh installs nightly and cargo-fuzz when they are missing.
if command -v rustup >/dev/null 2>&1; then
  fuzz() { await_fetch nightly; FUZZ_SECONDS="${FUZZ_SECONDS:-10}" bash ci/fuzz.sh; }
  tier fuzz fuzz
else
  skip fuzz "rustup is not installed: cargo fuzz needs the nightly toolchain, which ci/fuzz.sh installs with rustup"
fi

doctor() {
  "$TW" doctor && "$TW" doctor --json >/dev/null
}
tier doctor doctor

# (The binary the build tier made: `cargo run` takes no --workspace.)
tier example timeout 600 "$TARGET_DIR/release/examples/mlp" --procs 3 --steps 30

# The C ABI (capi/): libtidewire_c, tidewire.h current and clean as C11/C++11, examples/train.c
# linked shared and static, trained on loopback processes with equal checksums (ci/capi.sh).
tier capi timeout 900 bash ci/capi.sh

# The Python package (python/): a cached venv with torch from PyPI, the wheel built by maturin,
# pytest (real processes: quirks, SFB against autograd, DDP/gloo side by side, error paths;
# the CUDA cases skip loudly without a GPU), then examples/torch's digits check under torchrun.
python_tier() {
  await_fetch python || return 1
  timeout 1200 bash ci/python.sh -- bash examples/torch/check_digits.sh
}
tier python python_tier

train() {
  timeout 600 cargo run --release --locked -q -- train --model googlenet --workers 4 --servers 2 --iters 5 \
    --time-scale 0.2 --verify
}
tier train train

bench() {
  cargo build "${ALL[@]}" --bin tidewire-loopback --bin tidewire-overhead --bin tidewire-handin --bin tidewire \
    || return 1
  timeout 300 "$TARGET_DIR/release/tidewire-handin" --iters 2000 --idle-secs 3 --json "$TARGET_DIR/handin.json" \
    || return 1
  timeout 300 "$TARGET_DIR/release/tidewire-loopback" compare --runs 3 --secs 1 --iters 3000 \
      --json "$TARGET_DIR/loopback-compare.json" \
    && timeout 300 "$TARGET_DIR/release/tidewire-overhead" --model googlenet --reps 1 --iters 5 \
      --json "$TARGET_DIR/overhead.json" \
    && timeout 300 bash bench/compare-tcp.sh --reps 1 --secs 1 \
    && timeout 300 "$TW" bench aggregate --json > "$TARGET_DIR/aggregate.json" \
    && grep -E '"(cpu_sum_gbps|triad_gbps|ratio)"' "$TARGET_DIR/aggregate.json"
}
tier bench bench

# A binary built with `rdma`, run where libibverbs cannot be loaded: it must fall back to
# TCP and say why. A private mount namespace hides the library (root only).
rdma_fallback() {
  local lib out
  lib=$(readlink -f /usr/lib/x86_64-linux-gnu/libibverbs.so.1) || return 1
  cargo build "${ALL[@]}" --bin tidewire || return 1
  out=$(unshare -m sh -c "mount --bind /dev/null '$lib' && '$TARGET_DIR/release/tidewire' doctor && \
        timeout 300 '$TARGET_DIR/release/tidewire' train --model googlenet --workers 2 --servers 1 --iters 2 \
        --time-scale 0.05" 2>&1)
  local rc=$?
  echo "$out" | grep -E 'libibverbs|^transport|default transport|mean iteration'
  [ $rc -eq 0 ] && grep -q 'transport tcp: falling back to io_uring TCP: RDMA unavailable: libibverbs.so.1 cannot be loaded' <<<"$out" \
    && grep -q 'mean iteration' <<<"$out"
}
if [ "$(id -u)" -eq 0 ] && command -v unshare >/dev/null 2>&1; then
  tier rdma-fallback rdma_fallback
else
  skip rdma-fallback "hiding libibverbs needs root (a private mount namespace); run ci/test.sh as root"
fi

# Life without io_uring: deny it machine-wide with kernel.io_uring_disabled=2 (restored to its
# previous value on any exit, by a trap in the subshell), then run the portable backend's
# conformance suite, the selection's fallback, a verified train and doctor. Everything is
# built before io_uring is denied (cargo and rustc do not need it, but the window stays short).
# Runs "$@" with io_uring denied: by a seccomp filter on the command and its children
# (ci/no-uring.c, as Docker's default profile does; nothing else on the machine is
# affected), or, with NO_URING=sysctl, by kernel.io_uring_disabled=2 (restored by a trap).
denied() {
  if [ "${NO_URING:-seccomp}" = sysctl ]; then
    local prev rc
    prev=$(cat /proc/sys/kernel/io_uring_disabled) || return 1
    (
      trap 'sysctl -qw kernel.io_uring_disabled='"$prev"' && echo "kernel.io_uring_disabled restored to '"$prev"'"' EXIT
      sysctl -qw kernel.io_uring_disabled=2 || exit 1
      "$@"
    )
  else
    "$TARGET_DIR/no-uring" "$@"
  fi
}
no_uring_train_doctor() { # what doctor must name as the reason
  local why=$1 out rc
  out=$(denied timeout 600 "$TARGET_DIR/release/tidewire" train --model googlenet --workers 4 --servers 2 --iters 3 \
        --time-scale 0.05 --verify 2>&1)
  rc=$?
  echo "$out" | grep -E '^transport|mean iteration|verify'
  [ $rc -eq 0 ] || { echo "$out" | tail -20; echo "train failed without io_uring"; return 1; }
  grep -q '^transport portable: .*io_uring unavailable.*using the portable epoll TCP backend' <<<"$out" \
    || { echo "train did not report the portable transport and why"; return 1; }
  grep -q 'bit for bit' <<<"$out" || { echo "train did not verify"; return 1; }
  out=$(denied "$TARGET_DIR/release/tidewire" doctor 2>&1)
  echo "$out" | grep -E 'io_uring|portable|default transport'
  grep -q "NO .*io_uring .*$why" <<<"$out" || { echo "doctor did not say why io_uring is unusable ($why)"; return 1; }
  grep -q 'default transport (auto): portable epoll TCP: io_uring is unusable' <<<"$out" \
    || { echo "doctor did not say what is used instead"; return 1; }
}
no_uring() {
  cc -O2 -Wall -o "$TARGET_DIR/no-uring" ci/no-uring.c || return 1
  cargo build "${ALL[@]}" --bin tidewire || return 1
  local tests
  tests=$(test_bins tidewire_transport portable_conformance tcp_hostile steady_alloc) || return 1
  [ -n "$tests" ] || { echo "no test binaries built"; return 1; }
  # Proof that the filter bites: io_uring is refused in the denied process.
  # (Captured first: under pipefail, `doctor | grep -q` is false when doctor dies of SIGPIPE.)
  local doctor_out
  doctor_out=$(denied "$TARGET_DIR/release/tidewire" doctor 2>&1 || true)
  if ! grep -q '^\[io_uring\]' <<<"$doctor_out"; then
    echo "doctor printed no io_uring section under the denial:"; echo "$doctor_out"; return 1
  fi
  if grep -q '^  ok   io_uring' <<<"$doctor_out"; then
    echo "io_uring still works under the denial"; return 1
  fi
  echo "== seccomp (as Docker's default profile): the portable suite, hostile peers, allocations, the fallback"
  local t
  for t in $tests; do
    case "$t" in
      */tcp_hostile-*) denied "$t" -q portable:: || return 1 ;;
      */steady_alloc-*) denied "$t" -q portable || return 1 ;;
      */tidewire_transport-*) denied "$t" -q select:: || return 1 ;;
      *) denied "$t" -q || return 1 ;;
    esac
  done
  echo "== seccomp: train --verify and doctor"
  no_uring_train_doctor 'seccomp' || return 1
  if [ "$(id -u)" -eq 0 ] && command -v sysctl >/dev/null 2>&1 && [ -w /proc/sys/kernel/io_uring_disabled ]; then
    echo "== kernel.io_uring_disabled=2: train --verify and doctor"
    NO_URING=sysctl no_uring_train_doctor 'io_uring_disabled=2' || return 1
  else
    echo "NOTE: the kernel.io_uring_disabled=2 half is skipped: it needs root and a writable sysctl (Linux 6.6+)"
  fi
}
if ! command -v cc >/dev/null 2>&1; then
  skip no-uring "no C compiler for the seccomp wrapper (ci/no-uring.c); apt-get install build-essential"
else
  tier no-uring no_uring
fi

# soft-roce ends here: netem's and papers' figures are taken with nothing beside them.
tier_join soft-roce

# The bandwidth harness: network namespaces and tc (root only).
netem() {
  cargo build "${ALL[@]}" --bin tidewire || return 1
  timeout 300 bash ci/netem/netem.sh check && timeout 600 bash ci/netem/crosscheck.sh
}
if [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
  tier netem netem
else
  skip netem "the bandwidth harness needs root, ip and tc (network namespaces and shaping); run ci/test.sh as root"
fi

papers() {
  cargo build "${ALL[@]}" --bin tidewire --bin tidewire-papers || return 1
  timeout 600 "$TARGET_DIR/release/tidewire-papers" --out "$TARGET_DIR/papers" --check || return 1
  # Scale: 256 nodes (about 5 M events an iteration; 3 iterations, 38 s here on one thread).
  timeout 300 "$TARGET_DIR/release/tidewire" sim --model vgg19 --nodes 256 --iters 3 --bandwidth 10gbit
}
tier papers papers

nvrtc_one() { # requirement, lib dir inside the wheel, CUDA major
  local req=$1 sub=$2 major=$3
  local lib=$NVRTC_DIR/${req/==/-}/$sub
  nvrtc_fetch "$req" "$sub" "$major" || return 1
  local out bin
  # The gpu crate's unit tests, from the one build (the cuda feature is in it).
  bin=$(test_bins tidewire_gpu) && [ -n "$bin" ] || { echo "no tidewire_gpu test binary in the build"; return 1; }
  out=$(LD_LIBRARY_PATH=$lib "$bin" kernels_compile_with_nvrtc --nocapture 2>&1)
  local rc=$?
  echo "$out" | grep -E 'kernels_compile|SKIPPED|test result|panicked'
  [ $rc -eq 0 ] && ! grep -q SKIPPED <<<"$out" \
    && grep -q 'test cuda::nvrtc_tests::kernels_compile_with_nvrtc ... ok' <<<"$out" || return 1
  grep -q "kernels_compile_with_nvrtc: NVRTC $major\." <<<"$out" \
    || { echo "NVRTC $major: the test loaded another NVRTC than $lib's (a libnvrtc.so earlier on the library path?)"; return 1; }
}
nvrtc() {
  local w req sub major rc=0
  await_fetch nvrtc || echo "(the background fetch failed: each wheel is tried again below)"
  for w in "${NVRTC_WHEELS[@]}"; do
    IFS='|' read -r req sub major <<<"$w"
    echo "--- CUDA $major's NVRTC ($req)"
    nvrtc_one "$req" "$sub" "$major" || { echo "FAILED: the kernels with CUDA $major's NVRTC ($req)"; rc=1; }
  done
  return $rc
}
tier nvrtc nvrtc

# On a machine with a GPU: the CUDA tests must run (a skip fails), and the GPU bench.
gpu() {
  local out
  # The gpu crate's tests from the one build (the cuda feature is in it): its unit tests
  # and tests/cuda.rs.
  local bins b rc=0
  bins=$(test_bins tidewire_gpu cuda) && [ -n "$bins" ] || { echo "no tidewire-gpu test binaries in the build"; return 1; }
  for b in $bins; do out+=$("$b" --nocapture 2>&1)$'\n' || rc=1; done
  echo "$out" | grep -E '^test |SKIPPED|test result|panicked'
  [ $rc -eq 0 ] && ! grep -q 'SKIPPED: .*no CUDA driver' <<<"$out" || return 1
  "$TW" bench aggregate
}
if command -v nvidia-smi >/dev/null 2>&1; then
  tier gpu gpu
else
  skip gpu "no GPU on this machine (nvidia-smi not found): the CUDA tests were built and skipped with their reason in the tests tier, and the kernels were compiled by NVRTC in the nvrtc tier"
fi

# --- summary ---------------------------------------------------------------
# A background fetch no tier waited for (TIDEWIRE_CI_ONLY) ends before the script does.
for f in "${!FETCH_PID[@]}"; do await_fetch "$f" >/dev/null || echo "background fetch $f failed"; done
echo
for f in "${failed_logs[@]}"; do
  echo
  echo "==================== the end of failed tier ${f%%:*} (${f#*:}) ===================="
  tail -n 40 "${f#*:}"
done
echo
echo "==================== summary ===================="
printf '%s\n' "${results[@]}"
[ "$not_run" -eq 0 ] || echo "NOT A FULL RUN: TIDEWIRE_CI_ONLY=$TIDEWIRE_CI_ONLY left $not_run tiers out"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
