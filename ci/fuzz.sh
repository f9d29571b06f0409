#!/usr/bin/env bash
# Builds the libFuzzer targets under fuzz/ (cargo fuzz, nightly) and runs each one briefly
# from its committed seed corpus (fuzz/corpus/<target>/seed-*, captured from real traffic
# by fuzz/examples/capture.rs), failing on the first crash, panic, timeout or leak.
#
# It installs what it needs when it is missing (idempotent and quiet: an installed nightly
# or cargo-fuzz is left as it is): the nightly toolchain (minimal profile) and cargo-fuzz;
# as root also cmake and libclang-dev (the `rdma` feature's build, which rdma_wire needs).
#
# Usage: ci/fuzz.sh [target...]           (default: every target in fuzz/Cargo.toml)
#   FUZZ_SECONDS=N  seconds per target (default 10)
#   FUZZ_RUNS=N     a fixed number of executions per target instead of a time
#   FUZZ_JOBS=N     targets run at once (default: the number of cores)
# Each target runs as one process (one libFuzzer job), FUZZ_JOBS of them at a time. New inputs go to a scratch corpus
# under the target directory, never into fuzz/corpus; a crash's reproducer is written to
# fuzz/artifacts/<target>/ and printed, with the command that replays it.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "== fuzz: $*"; }

# --- install (idempotent) ----------------------------------------------------
if ! grep -q '^nightly' <<<"$(rustup toolchain list 2>/dev/null)"; then
    say "installing the nightly toolchain (minimal profile)"
    rustup toolchain install nightly --profile minimal >/dev/null
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    say "installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi
missing=()
for p in cmake libclang-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        say "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        say "missing ${missing[*]} (the rdma feature's build) and not root: sudo apt-get install ${missing[*]}"
        exit 1
    fi
fi

# --- build -------------------------------------------------------------------
. ci/target-dir.sh
# cargo fuzz builds with its own flags (coverage instrumentation): keep it apart from the
# workspace's build. No sanitizer: the code under test is safe Rust, and a panic, an
# overflow (debug assertions are on) or an out-of-bounds index aborts the run by itself.
fuzz_dir=$TARGET_DIR/fuzz
unset CARGO_TARGET_DIR
opts=(--sanitizer none --target-dir "$fuzz_dir")
if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
start=$(date +%s)
cargo +nightly fuzz build "${opts[@]}"
say "built ${#targets[@]} targets in $(($(date +%s) - start)) s: ${targets[*]}"

# --- run ---------------------------------------------------------------------
if [ -n "${FUZZ_RUNS:-}" ]; then
    limit=(-runs="$FUZZ_RUNS")
else
    limit=(-max_total_time="${FUZZ_SECONDS:-10}")
fi
# The targets run side by side, one per core (FUZZ_JOBS to change): each still gets its
# FUZZ_SECONDS, and the tier takes half the time on two cores.
run_one() { # target: runs it, leaves its exit status in $fuzz_dir/$t.rc
    local t=$1 scratch=$fuzz_dir/corpus/$1 rc
    mkdir -p "$scratch"
    set +e
    cargo +nightly fuzz run "${opts[@]}" "$t" "$scratch" "fuzz/corpus/$t" -- \
        "${limit[@]}" -print_final_stats=1 >"$fuzz_dir/$t.log" 2>&1
    rc=$?
    echo "$rc" >"$fuzz_dir/$t.rc"
}
jobs_max=${FUZZ_JOBS:-$(nproc)}
[ "$jobs_max" -ge 1 ] 2>/dev/null || { say "FUZZ_JOBS must be a number of at least 1, not '$jobs_max'"; exit 2; }
for t in "${targets[@]}"; do
    rm -f "$fuzz_dir/$t.rc"
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    run_one "$t" &
done
wait
failed=()
for t in "${targets[@]}"; do
    log=$fuzz_dir/$t.log
    rc=$(cat "$fuzz_dir/$t.rc" 2>/dev/null || echo "no status")
    # A crashed run has no DONE line: the grep finds nothing, and that is not the script's failure.
    stats=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 | sed -E 's/^#([0-9]+)[[:space:]]+DONE[[:space:]]+/\1 runs, /' || true)
    if [ "$rc" = 0 ]; then
        say "$t: ok (${stats:-no stats})"
    else
        say "$t: FAILED (exit $rc); the end of $log:"
        tail -n 40 "$log"
        { grep -hoE 'fuzz/artifacts/[^ ]+' "$log" || true; } | sort -u | while read -r a; do
            say "reproducer: $a (replay: cargo +nightly fuzz run --sanitizer none $t $a)"
        done
        failed+=("$t")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    say "FAILED: ${failed[*]}"
    exit 1
fi
say "ok: ${#targets[@]} targets, no crash"
