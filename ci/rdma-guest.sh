#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (ci/test-rdma.sh starts it): every RDMA test
# binary given as an argument, one test at a time, then the README's main job
# end to end over RDMA: `tidewire train --verify` with transport auto, which
# must pick RDMA on rxe0, and the one-protocol runs scaled down (vgg19-mini).
# The end-to-end cases report in libtest's format so that ci/test-rdma.sh
# counts them with the rest. Then tidewire-perf against
# Debian's perftest, both ways (ci/perf-guest.sh), and RDMA under tc shaping
# on the veth (ci/rdma-shaped-guest.sh).
# The binaries: TIDEWIRE_BIN (ci/test-rdma.sh passes the path it built; by hand, the
# default is ${CARGO_TARGET_DIR:-target}/release/tidewire) and TIDEWIRE_PERF (perf-guest.sh).
set -u
T=${TIDEWIRE_BIN:-${CARGO_TARGET_DIR:-target}/release/tidewire}
rc=0
for b in "$@"; do
  echo "### $b (at $SECONDS s)"
  timeout 900 "$b" --test-threads=1 --nocapture --skip helper_server_process || rc=$?
done

# Under TCG one layer's sync takes 19 to 44 s with the host quiet (GoogLeNet, 2026-11-29),
# and passed train's default 60 s wait once while the host's own tests ran beside the VM:
# each wait gets 150 s here (a hung run still ends long before its 600 s bound, and the four
# runs' worst case stays inside the VM's own time limit).
echo "### tidewire train over RDMA (transport auto, rxe0 <-> rxe0, verified against one process; at $SECONDS s)"
out=$(TIDEWIRE_TRANSPORT=auto timeout 600 "$T" train --model googlenet --workers 2 --servers 1 \
      --iters 3 --time-scale 0.05 --timeout-s 150 --verify 2>&1)
trc=$?
echo "$out"
if [ $trc -eq 0 ] && grep -q '^transport rdma: RDMA device rxe' <<<"$out" && ! grep -q '^transport tcp' <<<"$out" \
   && grep -q 'bit for bit' <<<"$out"; then
  echo "test train_over_rdma_auto_verified ... ok"
  echo "test result: ok. 1 passed; 0 failed; 0 ignored"
else
  echo "test train_over_rdma_auto_verified ... FAILED (exit $trc; wanted 'transport rdma' and a verified run)"
  echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
  rc=1
fi
# The one-protocol runs, scaled down for the emulated VM, over RDMA: a VGG19-shaped model
# (vgg19-mini, 2.1M parameters) with one server; with two servers, so fc6's 467 KB factor
# blocks go over RDMA's 64 KiB message cap as fragments, with at most 4 requests in flight per
# queue pair; and colocated SSP, whose ranks stay until every peer that needs them is done.
# Each must run on RDMA, exit 0, log no WARN or ERROR, and (BSP) verify bit for bit.
rdma_train() { # name, flags...
  local name=$1; shift
  echo "### tidewire train over RDMA: $* (at $SECONDS s)"
  local out trc
  out=$(TIDEWIRE_TRANSPORT=rdma timeout 600 "$T" train --model vgg19-mini --iters 2 --time-scale 0.05 --timeout-s 150 "$@" 2>&1)
  trc=$?
  echo "$out"
  local want_verify=0
  [[ " $* " == *" --verify "* ]] && want_verify=1
  if [ $trc -eq 0 ] && grep -q '^transport rdma: RDMA device rxe' <<<"$out" \
     && ! grep -q 'logged .* warnings or errors' <<<"$out" \
     && { [ $want_verify -eq 0 ] || grep -q 'bit for bit' <<<"$out"; }; then
    echo "test $name ... ok"
    echo "test result: ok. 1 passed; 0 failed; 0 ignored"
  else
    echo "test $name ... FAILED (exit $trc; wanted transport rdma, no warnings, and a verified run where asked)"
    echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
    rc=1
  fi
}
rdma_train train_over_rdma_vgg19_shaped_one_server_verified --workers 2 --servers 1 --verify
rdma_train train_over_rdma_factors_over_the_message_cap_verified --workers 2 --servers 2 \
  --max-outstanding 4 --verify
rdma_train train_over_rdma_colocated_ssp_finishes --workers 3 --colocate --consistency ssp:1

echo "### tidewire doctor on rxe: the dmabuf and per-QP rate-limit probes (at $SECONDS s)"
out=$(timeout 120 "$T" doctor 2>&1)
echo "$out"
if grep -q 'rdma rxe0 dmabuf' <<<"$out" && grep -q 'rdma rxe0 rate limit' <<<"$out" \
   && grep -q 'no packet pacing' <<<"$out"; then
  echo "test doctor_probes_rate_limit_and_dmabuf_on_rxe ... ok"
  echo "test result: ok. 1 passed; 0 failed; 0 ignored"
else
  echo "test doctor_probes_rate_limit_and_dmabuf_on_rxe ... FAILED (wanted rxe0's dmabuf and rate-limit lines, pacing absent)"
  echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
  rc=1
fi
echo "### tidewire-perf against perftest (ci/perf-guest.sh; at $SECONDS s)"
bash ci/perf-guest.sh || rc=1
echo "### RDMA under a shaped veth (ci/rdma-shaped-guest.sh; at $SECONDS s)"
bash ci/rdma-shaped-guest.sh || rc=1
exit $rc
