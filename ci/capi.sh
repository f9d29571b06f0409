#!/usr/bin/env bash
# The C ABI (capi/): builds libtidewire_c (release), checks that capi/include/tidewire.h is
# what cbindgen makes of the sources today, compiles the header on its own as C11 (and C++11
# where a C++ compiler exists) with every warning an error, links capi/examples/train.c
# against the shared library and against the static one, and trains on loopback: 2 processes
# under each scheme policy (and 2 workers + 1 server-only rank once). Every run must lower
# the loss a hundredfold, and every worker must print the same parameter checksum.
# Needs cc (build-essential) and python3 (to pick free ports).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/target-dir.sh

CFLAGS=(-std=c11 -Wall -Wextra -Werror -pedantic)
OUT=$TARGET_DIR/capi
mkdir -p "$OUT"
LIBDIR=$TARGET_DIR/release

# TIDEWIRE_CARGO_SELECT: the packages and features to build with (ci/test.sh builds the
# workspace once with every feature and passes --workspace --all-features: the library then
# has the rdma and cuda backends, which it probes at run time).
read -ra select <<<"${TIDEWIRE_CARGO_SELECT:--p tidewire-capi}"
echo "== build: cargo build --release ${select[*]}"
cargo build --release --locked -q "${select[@]}"
ls -l "$LIBDIR/libtidewire_c.so" "$LIBDIR/libtidewire_c.a"

echo "== header: capi/include/tidewire.h is current (cbindgen)"
cargo test --release --locked -q "${select[@]}" --test header

echo "== header alone: cc ${CFLAGS[*]}"
cat > "$OUT/header_only.c" <<'EOF'
#include "tidewire.h"
#include "tidewire.h" /* the include guard holds */
int main(void) {
  tw_config *cfg = tw_config_new();
  tw_config_free(cfg);
  return tw_version() && tw_error_name(TW_ERR_PANIC) ? 0 : 1;
}
EOF
cc "${CFLAGS[@]}" -Icapi/include -c "$OUT/header_only.c" -o "$OUT/header_only.o"
if command -v c++ >/dev/null 2>&1; then
  echo "== header alone: c++ -std=c++11 -Wall -Wextra -Werror -pedantic"
  c++ -std=c++11 -Wall -Wextra -Werror -pedantic -Icapi/include -x c++ -c "$OUT/header_only.c" \
    -o "$OUT/header_only_cxx.o"
else
  echo "== header alone as C++: skipped (no c++ compiler)"
fi

echo "== link: capi/examples/train.c against libtidewire_c.so and libtidewire_c.a"
cc "${CFLAGS[@]}" -O2 -Icapi/include capi/examples/train.c -L"$LIBDIR" -ltidewire_c \
  -Wl,-rpath,"$LIBDIR" -o "$OUT/train"
# The native libraries are what `cargo rustc --crate-type staticlib -- --print native-static-libs` lists.
cc "${CFLAGS[@]}" -O2 -Icapi/include capi/examples/train.c "$LIBDIR/libtidewire_c.a" \
  -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc -o "$OUT/train-static"
# ldd's output is captured before grep reads it: under pipefail, `ldd | grep -q` fails when grep
# exits at its first match and ldd, still writing, dies of SIGPIPE (CI saw exactly that).
deps=$(ldd "$OUT/train")
grep -q libtidewire_c.so <<<"$deps" || { echo "train is not linked to libtidewire_c.so:"; echo "$deps"; exit 1; }
deps=$(ldd "$OUT/train-static")
if grep -q libtidewire_c <<<"$deps"; then echo "train-static loads libtidewire_c:"; echo "$deps"; exit 1; fi

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

failures=0
# run NAME BINARY POLICY WORLD SERVERS
run() {
  local name=$1 bin=$2 policy=$3 world=$4 servers=$5 port r rc=0
  port=$(free_port)
  echo
  echo "== run $name: $world processes ($servers server-only), policy $policy, $(basename "$bin"), 127.0.0.1:$port"
  local pids=()
  for ((r = 0; r < world; r++)); do
    TIDEWIRE_RANK=$r TIDEWIRE_WORLD_SIZE=$world TIDEWIRE_SERVERS=$servers \
      TIDEWIRE_MASTER=127.0.0.1:$port TIDEWIRE_SECRET="capi-ci-$port" \
      timeout 120 "$bin" "$policy" 60 >"$OUT/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    if ! wait "${pids[$r]}"; then
      echo "rank $r failed:"
      rc=1
    fi
    sed "s/^/  [$r] /" "$OUT/$name.$r.log"
  done
  local sums
  sums=$(cat "$OUT/$name".*.log | sed -n 's/^rank [0-9]*: checksum \([0-9a-f]*\)$/\1/p' | sort | uniq -c)
  local workers=$((world - servers)) n distinct
  n=$(awk '{ s += $1 } END { print s + 0 }' <<<"$sums")
  distinct=$(grep -c . <<<"$sums" || true)
  if [ "$n" -ne "$workers" ]; then
    echo "FAIL $name: $n checksums from $workers workers"
    rc=1
  elif [ "$distinct" -ne 1 ]; then
    echo "FAIL $name: the workers' parameters differ:"
    echo "$sums"
    rc=1
  else
    echo "ok $name: $workers workers, the same checksum $(awk '{ print $2 }' <<<"$sums")"
  fi
  [ $rc -eq 0 ] || failures=$((failures + 1))
}

run hybrid "$OUT/train" hybrid 2 0
run ps "$OUT/train" ps 2 0
run sfb "$OUT/train-static" sfb 2 0
run server "$OUT/train-static" hybrid 3 1

echo
if [ $failures -ne 0 ]; then
  echo "capi: $failures run(s) failed"
  exit 1
fi
echo "capi: header current and C11-clean, train.c linked both ways, every run converged with equal checksums"
