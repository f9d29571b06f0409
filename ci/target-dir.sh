# Sourced (not run) by the scripts under ci/ and bench/ that build with cargo and then
# run what they built. Sets TARGET_DIR to cargo's target directory, as an absolute path:
# the one `cargo metadata` reports (CARGO_TARGET_DIR, or build.target-dir from a
# .cargo/config.toml, or ./target); without cargo on this machine (a device that got
# binaries built elsewhere), ${CARGO_TARGET_DIR:-target}. Binaries are then
# "$TARGET_DIR/release/<name>". The scripts that run inside the soft-RoCE VM have no
# cargo: they get their binaries' paths in TIDEWIRE_BIN and TIDEWIRE_PERF instead.
# Expects the current directory to be the repository's root.
tidewire_target_dir() {
  local d=
  if command -v cargo >/dev/null 2>&1; then
    d=$(cargo metadata --format-version 1 --no-deps 2>/dev/null </dev/null \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null) || d=
  fi
  [ -n "$d" ] || d=${CARGO_TARGET_DIR:-target}
  mkdir -p "$d" && (cd "$d" && pwd)
}
TARGET_DIR=$(tidewire_target_dir) || { echo "cannot resolve cargo's target directory" >&2; exit 1; }
