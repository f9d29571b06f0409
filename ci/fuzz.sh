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
# Each target runs as one process (one libFuzzer job). New inputs go to a scratch corpus
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
failed=()
for t in "${targets[@]}"; do
    scratch=$fuzz_dir/corpus/$t
    mkdir -p "$scratch"
    log=$fuzz_dir/$t.log
    set +e
    cargo +nightly fuzz run "${opts[@]}" "$t" "$scratch" "fuzz/corpus/$t" -- \
        "${limit[@]}" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    # A crashed run has no DONE line: the grep finds nothing, and that is not the script's failure.
    stats=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 | sed -E 's/^#([0-9]+)[[:space:]]+DONE[[:space:]]+/\1 runs, /' || true)
    if [ $rc -eq 0 ]; then
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
