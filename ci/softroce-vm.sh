#!/usr/bin/env bash
# softroce-vm.sh - run real Soft-RoCE (kernel rdma_rxe) tests inside a throw-away
# QEMU VM that boots Debian's stock bookworm kernel.  For hosts whose own kernel
# has no RDMA support (CONFIG_INFINIBAND unset, modules disabled).
#
# Usage:  softroce-vm.sh [options] [-- COMMAND [ARGS...]]
#
#   The guest gets a veth pair that exists only inside it (the VM has no NIC),
#   veth0 = 192.0.2.1 with rxe0 on it, veth1 = 192.0.2.2 with rxe1 on it.
#   With no COMMAND: runs the built-in smoke test (ibv_devinfo, ibv_rc_pingpong,
#   perftest ib_{write,read,send}_{bw,lat}, rping).  With COMMAND: runs it in the
#   guest as root, in the host's current directory (shared into the guest), with
#   SOFTROCE_DEV/_GID_INDEX/_IP (rxe0) and SOFTROCE_DEV2/_GID_INDEX2/_IP2 (rxe1)
#   in its environment, and exits with its exit status.
#
# Options:
#   --share DIR    also make host DIR visible, read-write, at the same path in the
#                  guest (repeatable).  /usr and /etc are always shared read-only,
#                  the current directory read-write (unless under /usr or /etc).
#   --no-cwd       do not share the current directory
#   --env VAR[=V]  pass VAR (its host value, or V) to COMMAND (repeatable)
#   --accel A      auto (default) | tcg | kvm.  auto = KVM when a hardware KVM
#                  module (kvm_intel/kvm_amd) is loaded, else TCG; a KVM boot
#                  that fails falls back to TCG.
#   --cpus N       guest vCPUs (default: host cores, at most 4)
#   --mem MB       guest memory (default 1024)
#   --timeout S    kill the VM after S seconds (default 900)
#   --no-install   fail instead of apt-get installing missing packages
#   --keep-run     keep the per-run directory (console log, guest script)
#
# Environment: SOFTROCE_CACHE (default <script dir>/cache): kernel + initramfs
#   SOFTROCE_KERNEL_PKG  e.g. linux-image-6.1.0-56-amd64 (default: what
#                        linux-image-amd64 depends on; remembered in the cache)
#   SOFTROCE_MACHINE     q35 (default) | microvm (~0.5-1 s faster boot)
#   SOFTROCE_CPU         QEMU -cpu model (default: max under TCG, host under KVM)
#   SOFTROCE_APPEND      extra kernel command line
#   SOFTROCE_BOOT_TIMEOUT (90) / SOFTROCE_BOOT_TRIES (2): boot watchdog + retries
#   SOFTROCE_CONSOLE_PREFIX  prefix of guest console lines on stdout ("  | ")
#
# Exit status: COMMAND's (or the smoke test's) status; 124 VM timeout;
# 125 setup failure / VM produced no result; 130/143 on SIGINT/SIGTERM.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${SOFTROCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-softroce}
ACCEL=auto
CPUS=$(nproc); [ "$CPUS" -gt 4 ] && CPUS=4
MEM=1024
TIMEOUT=900
INSTALL=1
KEEP_RUN=0
SHARE_CWD=1
SHARES=()
ENVS=()
log() { printf '[softroce-vm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 125; }

while [ $# -gt 0 ]; do
  case "$1" in
    --share) SHARES+=("$(cd "$2" && pwd)"); shift 2 ;;
    --no-cwd) SHARE_CWD=0; shift ;;
    --env) ENVS+=("$2"); shift 2 ;;
    --accel) ACCEL=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --keep-run) KEEP_RUN=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,41p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
done
GUEST_CMD=("$@")
T_START=$(date +%s.%N)

# ---------------------------------------------------------------- packages
# Host packages, all from Debian bookworm main:
#   qemu-system-x86   the emulator (TCG; KVM where usable)
#   busybox-static    /init and the tools of the initramfs
#   kmod              depmod / modprobe --show-depends for the module subset
#   iproute2          ip, rdma (run inside the guest from the shared /usr)
#   libibverbs1 ibverbs-providers ibverbs-utils perftest rdmacm-utils
#                     verbs, the rxe user-space provider, ibv_*, ib_*_bw/lat, rping
# The guest kernel (linux-image-6.1.0-NN-amd64) is only fetched with
# `apt-get download` and unpacked into the cache; it is never installed.
PKGS=(qemu-system-x86 busybox-static kmod iproute2 libibverbs1 ibverbs-providers
      ibverbs-utils perftest rdmacm-utils)
need=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || die "missing packages: ${need[*]}"
  log "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq </dev/null || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${need[@]}" </dev/null >/dev/null \
    || die "apt-get install ${need[*]} failed"
fi

# ---------------------------------------------------------------- guest kernel
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9          # concurrent runs: one builds the cache
resolve_kpkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
KPKG=${SOFTROCE_KERNEL_PKG:-$(cat "$CACHE/kernel-pkg" 2>/dev/null || true)}
KVER=${KPKG#linux-image-}
if [ -z "$KPKG" ] || [ ! -f "$CACHE/$KPKG/.done" ]; then
  fetch_kernel() { # $1 = package; downloads + unpacks into $CACHE/$1
    local d=$CACHE/$1
    rm -rf "$d"; mkdir -p "$d/deb"
    (cd "$d/deb" && apt-get download "$1" </dev/null >/dev/null 2>&1) || return 1
    dpkg-deb -x "$d"/deb/*.deb "$d/root" && rm -rf "$d/deb"
  }
  if [ -z "$KPKG" ]; then KPKG=$(resolve_kpkg); fi
  if [ -z "$KPKG" ] || ! { log "fetching guest kernel $KPKG (apt-get download)"; fetch_kernel "$KPKG"; }; then
    # stale or missing package lists (Debian drops superseded kernel ABIs)
    apt-get update -qq </dev/null || true
    [ -n "${SOFTROCE_KERNEL_PKG:-}" ] || KPKG=$(resolve_kpkg)
    [ -n "$KPKG" ] || die "cannot resolve linux-image-amd64"
    log "fetching guest kernel $KPKG (apt-get download, after apt-get update)"
    fetch_kernel "$KPKG" || die "apt-get download $KPKG failed"
  fi
  KVER=${KPKG#linux-image-}
  KDIR=$CACHE/$KPKG
  [ -f "$KDIR/root/lib/modules/$KVER/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko" ] \
    || die "$KPKG has no rdma_rxe.ko"
  depmod -b "$KDIR/root" "$KVER"
  # Uncompressed vmlinux (it has a PVH entry note): QEMU boots it directly, which
  # skips the real-mode setup and the in-guest xz decompression (~1 s under TCG).
  python3 - "$KDIR/root/boot/vmlinuz-$KVER" "$KDIR/vmlinux" <<'EOF' || true
import lzma, sys
d = open(sys.argv[1], 'rb').read()
off = d.find(b'\xfd7zXZ\x00')
if off >= 0:
    out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(d[off:])
    if out[:4] == b'\x7fELF':
        open(sys.argv[2], 'wb').write(out)
EOF
  touch "$KDIR/.done"
  [ -n "${SOFTROCE_KERNEL_PKG:-}" ] || echo "$KPKG" > "$CACHE/kernel-pkg"
fi
KDIR=$CACHE/$KPKG
if [ -f "$KDIR/vmlinux" ]; then KERNEL=$KDIR/vmlinux; else KERNEL=$KDIR/root/boot/vmlinuz-$KVER; fi

# ---------------------------------------------------------------- initramfs
# busybox + the module subset + /init.  /usr and /etc come from the host over
# 9p, so everything the tests run is the host's own (Debian) user space.
MODS=(virtio_pci virtio_mmio 9pnet_virtio 9p veth dummy crc32_generic crc32-pclmul
      rdma_rxe ib_uverbs rdma_ucm sch_tbf vgem)
INITRD=$CACHE/initramfs-$KVER.cpio
INITRD_STAMP="v8 ${MODS[*]} $(stat -c %Y /bin/busybox)"
if [ ! -f "$INITRD" ] || [ "$(cat "$INITRD.stamp" 2>/dev/null)" != "$INITRD_STAMP" ]; then
  log "building initramfs"
  IR=$(mktemp -d "$CACHE/ir.XXXXXX")
  mkdir -p "$IR"/{bb,proc,sys,dev,usr,etc,tmp,run,root,var,softroce}
  ln -s usr/bin "$IR/bin"; ln -s usr/sbin "$IR/sbin"; ln -s usr/lib64 "$IR/lib64"
  ln -s ../tmp "$IR/var/tmp"; ln -s ../run "$IR/var/run"
  cp /bin/busybox "$IR/bb/busybox"
  for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$IR/bb/$a"; done
  # Modules (+ dependencies) go to the initramfs' own /lib/modules/$KVER with a
  # depmod'ed modules.dep, so that ONE busybox 'modprobe -a' loads them all
  # (every process start costs 25-150 ms under TCG).  /init then turns /lib
  # into the usual usrmerge symlink to usr/lib.
  MD="$IR/lib/modules/$KVER"; mkdir -p "$MD"
  for m in "${MODS[@]}"; do
    modprobe -d "$KDIR/root" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
  done | awk '!seen[$0]++' | while read -r ko; do
    rel=${ko#"$KDIR/root/lib/modules/$KVER/"}
    mkdir -p "$MD/$(dirname "$rel")"; cp "$ko" "$MD/$rel"
  done
  cp "$KDIR/root/lib/modules/$KVER"/modules.{builtin,builtin.modinfo,order} "$MD/"
  depmod -b "$IR" "$KVER"
  echo "${MODS[*]}" > "$IR/bb/modules.list"
  cat > "$IR/bb/modprobe-log" <<'EOF'
#!/bb/sh
echo "softroce-vm: kernel asked for module: $*" > /dev/console
exit 1
EOF
  chmod +x "$IR/bb/modprobe-log"
  cat > "$IR/init" <<'EOF'
#!/bb/sh
export PATH=/bb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo /bb/modprobe-log > /proc/sys/kernel/modprobe
fail() { echo "softroce-vm-init: FATAL: $*"; echo "SOFTROCE_VM_RESULT rc=125"; poweroff -f; }
ts() { read -r up _ < /proc/uptime; echo "softroce-vm-init: $up $*"; }
ts start
read -r mods < /bb/modules.list
modprobe -a $mods || fail "modprobe $mods"
rm -rf /lib && ln -s usr/lib /lib
ts modules loaded
O="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$O,ro,cache=loose" hostusr /usr || fail "mount /usr"
mount -t 9p -o "$O,ro,cache=loose" hostetc /etc || fail "mount /etc"
mount -t 9p -o "$O,cache=mmap" softroce /softroce || fail "mount run dir"
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
while read -r tag path; do
  [ -n "$tag" ] || continue
  mkdir -p "$path" && mount -t 9p -o "$O,cache=mmap" "$tag" "$path" || fail "mount $path"
done < /softroce/shares
ts mounts done
hostname softroce-vm
ip link set lo up
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/bb HOME=/root TERM=dumb
echo "SOFTROCE_VM_READY uptime=$(cut -d' ' -f1 /proc/uptime)"
/usr/bin/bash /softroce/guest.sh
rc=$?
echo "$rc" > /softroce/rc
sync
umount /softroce 2>/dev/null
echo "SOFTROCE_VM_RESULT rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
poweroff -f
EOF
  chmod +x "$IR/init"
  (cd "$IR" && find . | /bin/busybox cpio -o -H newc -R 0:0 2>/dev/null > "$INITRD.tmp") || die "cpio failed"
  mv "$INITRD.tmp" "$INITRD"; echo "$INITRD_STAMP" > "$INITRD.stamp"
  rm -rf "$IR"
fi

flock -u 9; exec 9>&-

# ---------------------------------------------------------------- per-run dir
RUN=$(mktemp -d "${TMPDIR:-/tmp}/softroce-run.XXXXXX")
QPID=
cleanup() {
  local rc=$?
  if [ -n "$QPID" ] && kill -0 "$QPID" 2>/dev/null; then   # only the qemu we started
    kill "$QPID" 2>/dev/null; sleep 1; kill -9 "$QPID" 2>/dev/null || true
  fi
  if [ "$KEEP_RUN" = 1 ]; then log "run dir kept: $RUN"; else rm -rf "$RUN"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

MACHINE=${SOFTROCE_MACHINE:-q35}
case "$MACHINE" in microvm*) VIRTIO_9P=virtio-9p-device ;; *) VIRTIO_9P=virtio-9p-pci ;; esac
FSDEV=()
add_share() { # id tag path ro|rw
  local ro=""; [ "$4" = ro ] && ro=",readonly=on"
  FSDEV+=(-fsdev "local,id=$1,path=$3,security_model=none,multidevs=remap$ro"
          -device "$VIRTIO_9P,fsdev=$1,mount_tag=$2")
}
add_share fsusr hostusr /usr ro
add_share fsetc hostetc /etc ro
add_share fsrun softroce "$RUN" rw
CWD=$(pwd)
if [ "$SHARE_CWD" = 1 ]; then
  case "$CWD" in /|/usr|/usr/*|/etc|/etc/*) ;; *) SHARES=("$CWD" ${SHARES[@]+"${SHARES[@]}"}) ;; esac
fi
: > "$RUN/shares"
i=0
for d in ${SHARES[@]+"${SHARES[@]}"}; do
  add_share "fsx$i" "x$i" "$d" rw; echo "x$i $d" >> "$RUN/shares"; i=$((i + 1))
done

# ---------------------------------------------------------------- guest script
guest_setup() { cat <<'EOF'
set -u
# --- rxe setup (runs in the guest).  A veth pair that exists only inside the
# guest (it has no NIC; 192.0.2.0/24 is TEST-NET-1), one rxe device per end.
# Every process start costs ~0.1 s under TCG, so batch the ip/rdma commands.
#
# Both veth ends are in one network namespace (rxe in 6.1 has its UDP socket in
# the initial netns only), so by default traffic between 192.0.2.1 and .2 is
# routed via 'lo' and an rxe1->rxe0 QP fails at RTR (no L2 address).  Policy
# routing sends what a local socket/QP sends *from* one end's address to the
# other's out of the owning veth; accept_local lets the far end accept packets
# whose source address is local; static neighbours avoid ARP.
for c in all default; do
  echo 1 > /proc/sys/net/ipv4/conf/$c/accept_local; echo 0 > /proc/sys/net/ipv4/conf/$c/rp_filter
done
ip -batch - <<'IPCMDS' || { echo "ip setup failed"; exit 90; }
link add veth0 address 02:00:c0:00:02:01 type veth peer name veth1 address 02:00:c0:00:02:02
addr add 192.0.2.1/24 dev veth0
addr add 192.0.2.2/24 dev veth1
link set veth0 up
link set veth1 up
rule add pref 100 lookup local
rule del pref 0 lookup local
rule add pref 10 iif lo from 192.0.2.2 to 192.0.2.1 lookup 101
rule add pref 11 iif lo from 192.0.2.1 to 192.0.2.2 lookup 102
route add 192.0.2.1/32 dev veth1 src 192.0.2.2 table 101
route add 192.0.2.2/32 dev veth0 src 192.0.2.1 table 102
neigh replace 192.0.2.1 lladdr 02:00:c0:00:02:01 dev veth1 nud permanent
neigh replace 192.0.2.2 lladdr 02:00:c0:00:02:02 dev veth0 nud permanent
IPCMDS
for c in veth0 veth1; do
  echo 1 > /proc/sys/net/ipv4/conf/$c/accept_local; echo 0 > /proc/sys/net/ipv4/conf/$c/rp_filter
done
rdma -b - <<'RDMACMDS' || { echo "rdma link add failed"; exit 90; }
link add rxe0 type rxe netdev veth0
link add rxe1 type rxe netdev veth1
RDMACMDS
gid_index() { # dev gid -> index of that GID if it is a RoCE v2 GID (bash builtins only)
  local i g t
  for i in 0 1 2 3 4 5 6 7; do
    g=; t=
    read -r g < /sys/class/infiniband/$1/ports/1/gids/$i 2>/dev/null || continue
    read -r t < /sys/class/infiniband/$1/ports/1/gid_attrs/types/$i 2>/dev/null || true
    [ "$g" = "$2" ] && [ "$t" = "RoCE v2" ] && { echo $i; return 0; }
  done
  return 1
}
G0=; G1=
for n in $(seq 1 100); do
  s0=; s1=
  read -r s0 < /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null || true
  read -r s1 < /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null || true
  if [ "$s0" = "4: ACTIVE" ] && [ "$s1" = "4: ACTIVE" ]; then
    G0=$(gid_index rxe0 0000:0000:0000:0000:0000:ffff:c000:0201) &&
    G1=$(gid_index rxe1 0000:0000:0000:0000:0000:ffff:c000:0202) && break
  fi
  sleep 0.1
done
[ -n "$G0" ] && [ -n "$G1" ] || { echo "rxe ports/GIDs not ready"; rdma link show; exit 91; }
export SOFTROCE_DEV=rxe0 SOFTROCE_GID_INDEX=$G0 SOFTROCE_IP=192.0.2.1
export SOFTROCE_DEV2=rxe1 SOFTROCE_GID_INDEX2=$G1 SOFTROCE_IP2=192.0.2.2
read -r up _ < /proc/uptime
echo "SOFTROCE_RXE_READY uptime=$up: rxe0 gid[$G0] 192.0.2.1 on veth0, rxe1 gid[$G1] 192.0.2.2 on veth1"
EOF
}

smoke_test() { cat <<'EOF'
# --- built-in smoke test (runs in the guest)
FAILS=0
# Wait until a server listens: "tcp:PORT" (perftest / ibv_rc_pingpong exchange
# QP data over TCP) or "cm" (an rdma_cm listener, which /proc/net/tcp never shows).
wait_listen() {
  local hex
  for _ in $(seq 1 100); do
    case "$1" in
      tcp:*) hex=$(printf ':%04X' "${1#tcp:}")
             awk -v p="$hex" 'NR>1 && $4=="0A" && substr($2, length($2)-4)==p {f=1} END{exit !f}' \
               /proc/net/tcp /proc/net/tcp6 && return 0 ;;
      cm) grep -q 'state LISTEN' <<<"$(rdma resource show cm_id 2>/dev/null)" && return 0 ;;
    esac
    sleep 0.1
  done
  return 1
}
NOISE='^ *(-{5,}|\*+|\* Waiting.*)$|Dual-port|Number of qps|Connection type|PCIe relax|ibv_wr\* API|CQ Moderation|Link type|Max inline|Data ex. method|rdma_cm QPs|^ *$'
# pair NAME TIMEOUT WAIT "server cmd" "client cmd": server in background, client in foreground
pair() {
  local name=$1 to=$2 w=$3 srv=$4 cli=$5 t0 t1 src crc spid
  echo; echo "=== $name"
  echo "--- server: $srv"; echo "--- client: $cli"
  t0=$(date +%s.%N)
  timeout "$to" $srv > /tmp/srv.log 2>&1 &
  spid=$!
  wait_listen "$w" || echo "(server not seen listening; trying anyway)"
  timeout "$to" $cli > /tmp/cli.log 2>&1; crc=$?
  wait $spid; src=$?
  t1=$(date +%s.%N)
  grep -vE "$NOISE" /tmp/srv.log | sed 's/^/[server] /'
  grep -vE "$NOISE" /tmp/cli.log | sed 's/^/[client] /'
  echo "=== $name: server rc=$src client rc=$crc ($(awk "BEGIN{printf \"%.2f\", $t1-$t0}")s)"
  [ "$src" = 0 ] && [ "$crc" = 0 ]
}
D=$SOFTROCE_DEV G=$SOFTROCE_GID_INDEX IP=$SOFTROCE_IP
D2=$SOFTROCE_DEV2 G2=$SOFTROCE_GID_INDEX2 IP2=$SOFTROCE_IP2

echo; echo "=== ibv_devices"; ibv_devices || FAILS=$((FAILS+1))
echo; echo "=== ibv_devinfo -d $D"; ibv_devinfo -d "$D" || FAILS=$((FAILS+1))
echo "GID table of $D:"; for i in 0 1 2 3; do
  [ -r /sys/class/infiniband/$D/ports/1/gids/$i ] && echo "  [$i] $(cat /sys/class/infiniband/$D/ports/1/gids/$i) $(cat /sys/class/infiniband/$D/ports/1/gid_attrs/types/$i 2>/dev/null)"; done

pair "ibv_rc_pingpong $D<->$D (same rxe device: rxe's internal loopback path)" 60 tcp:18515 \
  "ibv_rc_pingpong -d $D -g $G -n 1000" \
  "ibv_rc_pingpong -d $D -g $G -n 1000 $IP" || FAILS=$((FAILS+1))

pair "ibv_rc_pingpong $D2 -> $D (two rxe devices: RoCEv2/UDP packets cross veth1<->veth0)" 60 tcp:18515 \
  "ibv_rc_pingpong -d $D -g $G -n 1000" \
  "ibv_rc_pingpong -d $D2 -g $G2 -n 1000 $IP" || FAILS=$((FAILS+1))

pair "ib_write_bw $D2 -> $D (64 KiB messages)" 120 tcp:18515 \
  "ib_write_bw -d $D -x $G -s 65536 -n 1000 --report_gbits" \
  "ib_write_bw -d $D2 -x $G2 -s 65536 -n 1000 --report_gbits $IP" || FAILS=$((FAILS+1))

pair "ib_write_lat $D2 -> $D (2-byte messages)" 120 tcp:18515 \
  "ib_write_lat -d $D -x $G -s 2 -n 2000" \
  "ib_write_lat -d $D2 -x $G2 -s 2 -n 2000 $IP" || FAILS=$((FAILS+1))

pair "ib_read_bw $D2 -> $D (64 KiB messages)" 120 tcp:18515 \
  "ib_read_bw -d $D -x $G -s 65536 -n 1000 --report_gbits" \
  "ib_read_bw -d $D2 -x $G2 -s 65536 -n 1000 --report_gbits $IP" || FAILS=$((FAILS+1))

pair "ib_send_bw $D2 -> $D (64 KiB messages)" 120 tcp:18515 \
  "ib_send_bw -d $D -x $G -s 65536 -n 1000 --report_gbits" \
  "ib_send_bw -d $D2 -x $G2 -s 65536 -n 1000 --report_gbits $IP" || FAILS=$((FAILS+1))

# rdma_cm: the client must bind its source address (-I) to end up on rxe1;
# unbound, the route to a local address resolves to rxe0 (same device).
pair "rping (rdma_cm) $IP2 -> $IP, 50 pings" 60 cm \
  "rping -s -a $IP -C 50" \
  "rping -c -I $IP2 -a $IP -C 50 -V" || FAILS=$((FAILS+1))

pair "ib_write_bw -R (QPs connected by rdma_cm; unbound client, so $D<->$D)" 120 cm \
  "ib_write_bw -d $D -R -s 65536 -n 1000 --report_gbits" \
  "ib_write_bw -d $D -R -s 65536 -n 1000 --report_gbits $IP" || FAILS=$((FAILS+1))

echo; echo "=== rxe packet counters"
grep -H . /sys/class/infiniband/rxe*/ports/1/hw_counters/{sent_pkts,rcvd_pkts,retry_exceeded_err,completer_retry_err} 2>/dev/null
echo; echo "=== guest memory"; free -m
echo; echo "=== smoke test: $FAILS failure(s)"
[ "$FAILS" = 0 ]
EOF
}

{
  guest_setup
  for e in ${ENVS[@]+"${ENVS[@]}"}; do
    case "$e" in *=*) printf 'export %q\n' "$e" ;; *) printf 'export %q\n' "$e=${!e-}" ;; esac
  done
  if [ ${#GUEST_CMD[@]} -gt 0 ]; then
    printf 'cd %q 2>/dev/null || cd /\n' "$CWD"
    printf 'exec'; printf ' %q' "${GUEST_CMD[@]}"; printf '\n'
  else
    smoke_test
  fi
} > "$RUN/guest.sh"

# ---------------------------------------------------------------- accelerator
ACCEL_REQ=$ACCEL
if [ "$ACCEL" = auto ]; then
  # A hardware KVM module is required: on hosts whose /dev/kvm comes from
  # kvm_pvm (e.g. Firecracker VMs with nested PVM) an ordinary kernel runs
  # under instruction emulation, far slower than TCG.
  if [ -r /dev/kvm ] && [ -w /dev/kvm ] && { [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; }; then
    ACCEL=kvm
  else
    ACCEL=tcg
  fi
fi
set_accel_args() {
  case "$ACCEL" in
    kvm) ACCEL_ARGS=(-accel kvm -cpu "${SOFTROCE_CPU:-host}") ;;
    # 'max' = every feature TCG emulates (QEMU 7.2: up to AVX2, pclmulqdq, aes)
    tcg) ACCEL_ARGS=(-accel tcg,thread=multi -cpu "${SOFTROCE_CPU:-max}") ;;
    *) die "bad --accel $ACCEL" ;;
  esac
}
set_accel_args

# ---------------------------------------------------------------- boot
CONSOLE=$RUN/console.log
# quiet serial console, no reboot loop on panic, and switches that take ~1 s
# off a TCG boot (crypto / kprobe / KDF self-tests, zeroing every allocation)
APPEND="console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init random.trust_cpu=on 8250.nr_uarts=1"
APPEND+=" mitigations=off tsc=reliable no_timer_check i8042.noaux i8042.nokbd init_on_alloc=0"
APPEND+=" cryptomgr.notests initcall_blacklist=init_kprobe_trace,crypto_kdf108_init"
# microvm has no HPET/PM timer: when the PIT-based TSC calibration fails (it
# does, now and then, on a loaded TCG host) the guest hangs.  Give it the TSC
# rate (under TCG the guest TSC runs at the host's rate).
if [ "${MACHINE#microvm}" != "$MACHINE" ] && [ "$ACCEL" = tcg ]; then
  khz=$(awk -F: '/^cpu MHz/{printf "%d", $2 * 1000; exit}' /proc/cpuinfo)
  [ -n "$khz" ] && APPEND+=" tsc_early_khz=$khz"
fi
APPEND+=" ${SOFTROCE_APPEND:-}"
BOOT_TIMEOUT=${SOFTROCE_BOOT_TIMEOUT:-90}   # no "ready" line by then: kill, retry
BOOT_TRIES=${SOFTROCE_BOOT_TRIES:-2}
now() { date +%s.%N; }
QEMU_HWM_KB=0
boot_vm() { # -> 0 qemu exited by itself; 2 boot watchdog fired; 124 overall timeout
  local waited=0 tailpid hwm
  : > "$CONSOLE"; rm -f "$RUN/rc"
  T_BOOT=$(now); READY_AT=
  qemu-system-x86_64 "${ACCEL_ARGS[@]}" -machine "$MACHINE" -smp "$CPUS" -m "$MEM" \
    -nodefaults -no-user-config -display none -nic none -no-reboot \
    -chardev file,id=con,path="$CONSOLE" -serial chardev:con \
    -kernel "$KERNEL" -initrd "$INITRD" -append "$APPEND" \
    "${FSDEV[@]}" </dev/null >"$RUN/qemu.out" 2>&1 &
  QPID=$!
  # guest console -> our stdout, CR stripped (the serial tty writes CRLF)
  tail -n +1 -F -s 0.1 --pid=$QPID "$CONSOLE" 2>/dev/null \
    | awk -v p="${SOFTROCE_CONSOLE_PREFIX-  | }" '{ sub(/\r$/, ""); print p $0; fflush() }' &
  tailpid=$!
  while kill -0 "$QPID" 2>/dev/null; do
    hwm=$(awk '/^VmHWM/{print $2}' "/proc/$QPID/status" 2>/dev/null || true)
    [ -n "$hwm" ] && QEMU_HWM_KB=$hwm
    if [ -z "$READY_AT" ] && grep -q SOFTROCE_VM_READY "$CONSOLE" 2>/dev/null; then READY_AT=$(now); fi
    if [ -z "$READY_AT" ] && [ "$waited" -ge $((BOOT_TIMEOUT * 5)) ]; then
      log "no ready line after ${BOOT_TIMEOUT}s, killing qemu pid $QPID"
      kill "$QPID" 2>/dev/null; wait "$QPID" 2>/dev/null; QPID=; wait "$tailpid" 2>/dev/null
      return 2
    fi
    if [ "$waited" -ge $((TIMEOUT * 5)) ]; then
      log "timeout after ${TIMEOUT}s, killing qemu pid $QPID"
      kill "$QPID" 2>/dev/null; wait "$QPID" 2>/dev/null; QPID=; wait "$tailpid" 2>/dev/null
      return 124
    fi
    sleep 0.2; waited=$((waited + 1))
  done
  wait "$QPID" 2>/dev/null; QPID=
  wait "$tailpid" 2>/dev/null
  return 0
}
try=1
while :; do
  log "booting $KVER ($ACCEL, $MACHINE, $CPUS vCPU, ${MEM} MiB), timeout ${TIMEOUT}s"
  st=0; boot_vm || st=$?
  [ -s "$RUN/qemu.out" ] && sed 's/^/  qemu: /' "$RUN/qemu.out" >&2
  if [ -z "$READY_AT" ] && [ "$st" != 124 ]; then          # never got to /init's ready line
    if [ "$ACCEL" = kvm ] && [ "$ACCEL_REQ" = auto ]; then
      log "KVM boot failed; falling back to TCG"; ACCEL=tcg; set_accel_args; continue
    fi
    if [ "$st" = 2 ] && [ "$try" -lt "$BOOT_TRIES" ]; then
      try=$((try + 1)); log "retrying boot ($try/$BOOT_TRIES)"; continue
    fi
  fi
  break
done
[ "$st" = 0 ] || exit "$st"
T_END=$(now)
[ -n "$READY_AT" ] || READY_AT=$T_END
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", a - b}'; }
log "timings: host prep $(secs "$T_BOOT" "$T_START")s, qemu start to guest ready $(secs "$READY_AT" "$T_BOOT")s, guest work $(secs "$T_END" "$READY_AT")s, total $(secs "$T_END" "$T_START")s; qemu peak RSS $((QEMU_HWM_KB / 1024)) MiB"
if [ -f "$RUN/rc" ]; then
  rc=$(cat "$RUN/rc")
  log "guest command exited with $rc"
  exit "$rc"
fi
rc=$(sed -n 's/.*SOFTROCE_VM_RESULT rc=\([0-9]*\).*/\1/p' "$CONSOLE" | tail -1)
log "VM ended without writing a result (console rc=${rc:-none})"
exit "${rc:-125}"
