#!/usr/bin/env bash
# Runs the registered-memory tests of tidewire-transport (Region, Lease, PinnedBuffer:
# transport/src/memory/) under Miri, which checks their unsafe code for undefined
# behaviour: aliasing (Stacked Borrows), data races between threads, out-of-bounds and
# use-after-free accesses. Under Miri a PinnedBuffer is a page-aligned heap allocation
# (Miri cannot mmap, mlock or madvise); tests that need those syscalls are ignored and
# listed as such below.
#
# It installs the nightly toolchain with the miri component when it is missing
# (idempotent: an installed nightly is left as it is), prepares Miri's sysroot, runs the
# tests, prints which ran, and exits non-zero if one failed or none ran.
#
# Usage: ci/miri.sh [test filter, default `memory::` | --install-only]
# MIRIFLAGS passes flags to Miri (e.g. MIRIFLAGS=-Zmiri-many-seeds=0..16).
set -euo pipefail
cd "$(dirname "$0")/.."

filter="${1:-memory::}"

if ! grep -q '^miri' <<<"$(rustup +nightly component list --installed 2>/dev/null)"; then
    echo "== miri: installing nightly with miri"
    rustup toolchain install nightly --profile minimal --component miri
fi
# `ci/miri.sh --install-only`: only that (ci/test.sh fetches it in the background).
[ "$filter" = "--install-only" ] && exit 0
cargo +nightly miri setup

log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
set +e
cargo +nightly miri test -p tidewire-transport --lib "$filter" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
elapsed=$(($(date +%s) - start))

echo
echo "== miri: tests of tidewire-transport matching '$filter' (build and run: ${elapsed} s)"
grep -E '^test .+ \.\.\. ' "$log" | sed 's/^test /   /' || true
grep -E '^test result:' "$log" | sed 's/^/   /' || true
if [ "$rc" -ne 0 ]; then
    echo "== miri: FAILED (exit $rc)"
    exit "$rc"
fi
if ! grep -qE '^test result: ok\. [1-9][0-9]* passed' "$log"; then
    echo "== miri: no test ran (filter '$filter')"
    exit 1
fi
echo "== miri: ok"
