#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (ci/test-rdma.sh starts it): every RDMA test
# binary given as an argument, one test at a time, then the README's main job
# end to end over RDMA: `tidewire train --verify` with transport auto, which
# must pick RDMA on rxe0. The end-to-end case reports in libtest's format so
# that ci/test-rdma.sh counts it with the rest. Then tidewire-perf against
# Debian's perftest, both ways (ci/perf-guest.sh), and RDMA under tc shaping
# on the veth (ci/rdma-shaped-guest.sh).
# The binaries: TIDEWIRE_BIN (ci/test-rdma.sh passes the path it built; by hand, the
# default is ${CARGO_TARGET_DIR:-target}/release/tidewire) and TIDEWIRE_PERF (perf-guest.sh).
set -u
T=${TIDEWIRE_BIN:-${CARGO_TARGET_DIR:-target}/release/tidewire}
rc=0
for b in "$@"; do
  echo "### $b"
  timeout 900 "$b" --test-threads=1 --nocapture --skip helper_server_process || rc=$?
done

echo "### tidewire train over RDMA (transport auto, rxe0 <-> rxe0, verified against one process)"
out=$(TIDEWIRE_TRANSPORT=auto timeout 600 "$T" train --model googlenet --workers 2 --servers 1 \
      --iters 3 --time-scale 0.05 --verify 2>&1)
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
echo "### tidewire doctor on rxe: the dmabuf and per-QP rate-limit probes"
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
echo "### tidewire-perf against perftest (ci/perf-guest.sh)"
bash ci/perf-guest.sh || rc=1
echo "### RDMA under a shaped veth (ci/rdma-shaped-guest.sh)"
bash ci/rdma-shaped-guest.sh || rc=1
exit $rc
