#!/usr/bin/env bash
# The soft-RoCE tier: builds the RDMA test binaries here (`--features rdma`),
# then runs them all inside one QEMU VM booted by ci/softroce-vm.sh, whose
# kernel has rdma_rxe: rxe0 and rxe1 on the two ends of a veth pair. The
# conformance suite runs across the veth (rxe1 -> rxe0) and on one device
# (rxe0 -> rxe0), plus the RDMA-only cases, `tidewire train` over RDMA, and
# tidewire-perf against Debian's perftest both ways (ci/perf-guest.sh).
#
# Ends with the plain line "N passed, M failed, K skipped". Exits non-zero if
# any test fails, or if any test skips inside the VM (TIDEWIRE_REQUIRE_RDMA=1
# turns a missing device into a failure, and a SKIPPED line is counted too).
#
# Needs root (or sudo) the first time, to apt-get install cmake and
# libclang-dev (to build sideway's verbs stubs) and the VM's packages.
#
# Binaries and the log go to cargo's target directory (ci/target-dir.sh). The VM
# sees this directory at the same path (it is shared when it lies outside the
# clone), and the guest scripts get the binaries' paths in TIDEWIRE_BIN and
# TIDEWIRE_PERF. The VM runs copies of them, in $TARGET_DIR/softroce-bin/.
#
# Usage: ci/test-rdma.sh [--build-only | --prebuilt]
#   --build-only  build and copy the binaries, then stop (ci/test.sh, in the foreground)
#   --prebuilt    run the VM on the copies --build-only made, without cargo (ci/test.sh
#                 runs this beside other tiers: a cargo call here would re-link
#                 release/tidewire under the tests that run it)
set -uo pipefail
MODE=all
case "${1:-}" in
  --build-only) MODE=build ;;
  --prebuilt) MODE=prebuilt ;;
  "") ;;
  *) echo "unknown option $1 (--build-only or --prebuilt)"; exit 2 ;;
esac
cd "$(dirname "$0")/.."
. ci/target-dir.sh
t0=$SECONDS

need=()
for p in cmake libclang-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then echo "missing ${need[*]} and not root: sudo apt-get install ${need[*]}"; exit 1; fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } </dev/null \
    || { echo "apt-get install ${need[*]} failed"; exit 1; }
fi

BIN_DIR=$TARGET_DIR/softroce-bin
if [ "$MODE" != prebuilt ]; then
# Every RDMA test executable, by cargo's JSON artifacts.
# TIDEWIRE_CARGO_SELECT: the packages and features to build with (ci/test.sh, which builds the
# workspace once with every feature, passes --workspace --all-features; these are its release
# test binaries, faster under TCG than a debug build).
read -ra select <<<"${TIDEWIRE_CARGO_SELECT:--p tidewire-transport -p tidewire-cli -p tidewire-bench --features tidewire-bench/rdma}"
mapfile -t BINS < <(cargo test --release "${select[@]}" --locked --no-run \
    --message-format=json-render-diagnostics </dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") \
       and m["target"]["name"] in ("rdma_conformance", "tidewire_transport"):
        print(m["executable"])')
[ ${#BINS[@]} -eq 2 ] || { echo "expected 2 RDMA test binaries, built ${#BINS[@]}: ${BINS[*]}"; exit 1; }
cargo build --release --locked -q "${select[@]}" --bin tidewire --bin tidewire-perf </dev/null \
  || { echo "release build of tidewire and tidewire-perf failed"; exit 1; }
for b in tidewire tidewire-perf; do
  [ -x "$TARGET_DIR/release/$b" ] || { echo "$TARGET_DIR/release/$b is missing after the build"; exit 1; }
done
# The VM runs copies: ci/test.sh runs the VM beside other tiers, and one of them (the
# README's `cargo run`, default features) links another tidewire in release/ meanwhile.
rm -rf "$BIN_DIR" && mkdir -p "$BIN_DIR" \
  && cp -f "$TARGET_DIR/release/tidewire" "$TARGET_DIR/release/tidewire-perf" "${BINS[@]}" "$BIN_DIR/" \
  || { echo "copying the binaries for the VM failed"; exit 1; }
echo "built in $((SECONDS - t0)) s, copied to $BIN_DIR: ${BINS[*]##*/} tidewire tidewire-perf"

fi
[ "$MODE" = build ] && exit 0
TW=$BIN_DIR/tidewire PERF=$BIN_DIR/tidewire-perf
mapfile -t BINS < <(ls "$BIN_DIR"/rdma_conformance-* "$BIN_DIR"/tidewire_transport-* 2>/dev/null)
[ ${#BINS[@]} -eq 2 ] && [ -x "$TW" ] && [ -x "$PERF" ] \
  || { echo "$BIN_DIR lacks the binaries (${BINS[*]:-none}): run ci/test-rdma.sh --build-only first"; exit 1; }

LOG=$TARGET_DIR/softroce-tests.log
# The guest sees the clone (the current directory) at the same path; a target
# directory elsewhere (CARGO_TARGET_DIR=/tmp/...) is shared too.
SHARE=()
case "$TARGET_DIR/" in "$PWD"/*) ;; *) SHARE=(--share "$TARGET_DIR") ;; esac
# The guest runs each binary one test at a time (the VM is emulated, and slow).
# 2400 s: with the host's tests tier and a build beside it, the VM was still in its
# fourth train run at 1500 s (CI of 754906c, 2026-11-29; each vgg19-mini iteration over
# rxe took about 60 s); the rest of CI takes about as long, so CI does not grow by it.
bash ci/softroce-vm.sh ${SHARE[@]+"${SHARE[@]}"} --mem 2048 --timeout "${SOFTROCE_TIMEOUT:-2400}" \
  --env RUST_BACKTRACE=1 --env TIDEWIRE_REQUIRE_RDMA=1 --env TIDEWIRE_REQUIRE_VGEM=1 --env RUST_LOG=warn \
  --env "TIDEWIRE_BIN=$TW" --env "TIDEWIRE_PERF=$PERF" -- \
  bash ci/rdma-guest.sh "${BINS[@]}" 2>&1 | tee "$LOG"
vm_rc=${PIPESTATUS[0]}

sum() { grep -Eo "test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed" "$LOG" | awk -v f="$1" '{s += $(f)} END {print s + 0}'; }
ran=$(sum 4); failed=$(sum 6)
skipped=$(grep -c "SKIPPED:" "$LOG")
passed=$((ran - skipped))
echo
echo "soft-RoCE tier: VM exit $vm_rc, $((SECONDS - t0)) s in all"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$vm_rc" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$skipped" -eq 0 ] && [ "$ran" -gt 0 ]
