#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (ci/rdma-guest.sh calls it): tidewire-perf
# against Debian's perftest, both ways, over rxe1 -> rxe0 (across the veth).
#   - our client against perftest's server, and perftest's client against ours,
#     for write_bw, write_lat and send_bw (the acceptance cases) and for
#     read_bw, read_lat and send_lat;
#   - tidewire-perf on both sides with mismatched options: both must stop
#     with an error that names the difference, and neither may hang.
# Each case prints both sides' output and reports in libtest's format, so that
# ci/test-rdma.sh counts it with the rest. Sizes are small: the VM is emulated.
set -u
P=${TIDEWIRE_PERF:-${CARGO_TARGET_DIR:-target}/release/tidewire-perf}
SRV_IP=${SOFTROCE_IP:-192.0.2.1}
PORT=18515
pass=0; fail=0
out=$(mktemp -d)

# launch SERVER-CMD CLIENT-CMD CLIENT-TIMEOUT: runs both on the next port, prints both
# sides' output, and sets crc/src (exit codes) and el (seconds the client took).
launch() {
  local scmd=$1 ccmd=$2 tmo=$3
  PORT=$((PORT + 1))
  echo "--- server: $scmd -p $PORT"
  echo "--- client: $ccmd -p $PORT $SRV_IP"
  $scmd -p $PORT >"$out/s" 2>&1 &
  local sp=$!
  # perftest's client tries to connect once: wait until the server listens (up to 30 s; the
  # emulated VM is slow when the host is busy, and 0.5 s was once too little), not a fixed time.
  local i hex
  hex=$(printf '%04X' "$PORT")
  for ((i = 0; i < 300; i++)); do
    # A LISTEN socket (state 0A) on the port, IPv4 or IPv6.
    grep -qE ":$hex [0-9A-F]+:0000 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null && break
    kill -0 $sp 2>/dev/null || break
    sleep 0.1
  done
  local t0=$SECONDS
  timeout "$tmo" $ccmd -p $PORT "$SRV_IP" >"$out/c" 2>&1
  crc=$?; el=$((SECONDS - t0))
  # perftest has no timeouts of its own: give the server 20 s more, then kill it.
  timeout 20 tail --pid=$sp -f /dev/null
  kill -9 $sp 2>/dev/null
  wait $sp
  src=$?
  sed 's/^/[server] /' "$out/s"; sed 's/^/[client] /' "$out/c"
}

# case_ NAME SERVER-CMD CLIENT-CMD WANT-SERVER-ROW WANT-CLIENT-ROW
case_() {
  local name=$1 want_s=$4 want_c=$5
  echo "### $name"
  launch "$2" "$3" 120
  local ok=1 why=""
  [ $src -eq 0 ] || { ok=0; why+=" server exit $src;"; }
  [ $crc -eq 0 ] || { ok=0; why+=" client exit $crc;"; }
  # A table row: the size, the iterations, then numbers.
  local row='^ [0-9]+ +[0-9]+ +[0-9]+\.[0-9]+'
  if [ "$want_s" = 1 ] && ! grep -Eq "$row" "$out/s"; then ok=0; why+=" no result row from the server;"; fi
  if [ "$want_c" = 1 ] && ! grep -Eq "$row" "$out/c"; then ok=0; why+=" no result row from the client;"; fi
  if [ $ok = 1 ]; then
    echo "test perftest_interop::$name ... ok"; pass=$((pass + 1))
  else
    echo "test perftest_interop::$name ... FAILED ($why )"; fail=$((fail + 1))
  fi
}

# case_error NAME SERVER-CMD CLIENT-CMD PATTERN: both sides must fail, saying PATTERN, within the timeout.
case_error() {
  local name=$1 pat=$4
  echo "### $name"
  launch "$2" "$3" 60
  if [ $crc -ne 0 ] && [ $crc -ne 124 ] && [ $src -ne 0 ] && [ $src -ne 137 ] \
     && grep -qe "$pat" "$out/s" && grep -qe "$pat" "$out/c"; then
    echo "test perftest_interop::$name ... ok ($el s)"; pass=$((pass + 1))
  else
    echo "test perftest_interop::$name ... FAILED (client exit $crc, server exit $src; wanted both to fail saying '$pat')"
    fail=$((fail + 1))
  fi
}

S="-d rxe0"; C="-d rxe1"
PT="-x 1"   # perftest needs the GID index on RoCE; tidewire-perf picks it
for t in write_bw send_bw read_bw; do
  case_ "${t}_ours_client_perftest_server" "ib_$t $S $PT -s 65536 -n 200" "$P $t $C -s 65536 -n 200" 1 1
  case_ "${t}_perftest_client_ours_server" "$P $t $S -s 65536 -n 200" "ib_$t $C $PT -s 65536 -n 200" 1 1
done
for t in write_lat send_lat; do
  case_ "${t}_ours_client_perftest_server" "ib_$t $S $PT -s 2 -n 500" "$P $t $C -s 2 -n 500" 1 1
  case_ "${t}_perftest_client_ours_server" "$P $t $S -s 2 -n 500" "ib_$t $C $PT -s 2 -n 500" 1 1
done
# read_lat: only the reading client measures.
case_ "read_lat_ours_client_perftest_server" "ib_read_lat $S $PT -n 200" "$P read_lat $C -n 200" 0 1
case_ "read_lat_perftest_client_ours_server" "$P read_lat $S -n 200" "ib_read_lat $C $PT -n 200" 0 1
# Several sizes in one run, and the JSON output.
case_ "write_bw_all_sizes_ours_client_perftest_server" "ib_write_bw $S $PT -a -n 20" \
      "$P write_bw $C -a -n 20 --report_gbits --out_json=$out/wbw.json" 1 1
if python3 -c "import json,sys; d=json.load(open('$out/wbw.json')); r=d['all_results']; sys.exit(0 if len(r)==23 and r[-1]['MsgSize']==8388608 and r[-1]['BW_average']>0 else 1)"; then
  echo "test perftest_interop::json_has_23_rows ... ok"; pass=$((pass + 1))
else
  echo "test perftest_interop::json_has_23_rows ... FAILED"; cat "$out/wbw.json"; fail=$((fail + 1))
fi
# Duration mode (-D): the same exchange, the client's report at the end.
case_ "write_bw_duration_ours_client_perftest_server" "ib_write_bw $S $PT -D 2" "$P write_bw $C -D 2" 1 1
case_ "write_bw_duration_perftest_client_ours_server" "$P write_bw $S -D 2" "ib_write_bw $C $PT -D 2" 1 1
# Mismatched options between two tidewire-perf sides: named, at once.
case_error "mismatch_test_and_size_refused" "$P write_bw $S -s 4096 -n 200" "$P send_bw $C -s 65536 -n 200" \
  "run with different options"
case_error "mismatch_qps_refused" "$P write_bw $S -q 2 -n 200" "$P write_bw $C -n 200" "-q: ours"

rm -rf "$out"
echo "test result: $([ $fail -eq 0 ] && echo ok || echo FAILED). $pass passed; $fail failed; 0 ignored"
[ $fail -eq 0 ]
