#!/usr/bin/env bash
# regen.sh - regenerate bench/papers/: EVAL.md, results.json and the PNG plots.
#
# Usage: bench/papers/regen.sh [tidewire-papers options...]
#
# Builds tidewire and tidewire-papers, simulates Poseidon's and P3's figures at the
# papers' scale with `tidewire sim`, and, as root, runs `tidewire train` under the
# bandwidth harness (ci/netem/) for the P3 figure. Not root: the harness runs are
# skipped, and EVAL.md says so. The binaries are in cargo's target directory
# (ci/target-dir.sh: CARGO_TARGET_DIR when set, else ./target); tidewire-papers finds
# tidewire beside itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
. ci/target-dir.sh
cargo build --release --locked -p tidewire-cli --bin tidewire -p tidewire-bench --bin tidewire-papers
args=(--out bench/papers)
if [ "$(id -u)" = 0 ]; then
  args+=(--train)
else
  echo "regen.sh: SKIPPED the harness runs (tidewire train under ci/netem): they need root" >&2
fi
exec "$TARGET_DIR/release/tidewire-papers" "${args[@]}" "$@"
