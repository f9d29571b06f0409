#!/usr/bin/env bash
# The Python package (python/: tidewire, tidewire._native, tidewire.torch): builds the wheel
# with maturin (release) and runs its tests (python/tests, pytest -v) in a venv cached
# outside the clone.
#
# The cache directory: TIDEWIRE_PYTHON_CACHE when set, else /var/cache/tidewire-python as
# root, else ${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-python. In it:
#   venv-<key>/   the venv, created once per key: a hash of python/requirements-ci.txt and
#                 the interpreter's version (a half-made venv is rebuilt);
#   pip/          PIP_CACHE_DIR, so torch's ~3 GB download happens once.
# The wheel goes to $TARGET_DIR/python-wheels/ (TARGET_DIR from ci/target-dir.sh) and is
# installed into the venv with --force-reinstall. PYTHON picks the interpreter (default
# python3). Every phase prints how long it took. Works from a fresh clone as root
# (installs python3-venv with apt-get where `python3 -m venv` is missing). Arguments after
# `--` are a command to run afterwards with the venv's python (PATH and $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."

t_all=$SECONDS
phase_t0=$SECONDS
phase_name=
phase() { # name: ends the previous phase (printing its time) and starts this one
  if [ -n "$phase_name" ]; then
    echo "---- python.sh: $phase_name took $((SECONDS - phase_t0)) s"
  fi
  phase_name=$1
  phase_t0=$SECONDS
  [ -z "$phase_name" ] || echo "---- python.sh: $phase_name"
}

PY=${PYTHON:-python3}
if [ -n "${TIDEWIRE_PYTHON_CACHE:-}" ]; then CACHE=$TIDEWIRE_PYTHON_CACHE
elif [ "$(id -u)" -eq 0 ]; then CACHE=/var/cache/tidewire-python
else CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tidewire-python; fi
mkdir -p "$CACHE"
export PIP_CACHE_DIR=$CACHE/pip
export PIP_DISABLE_PIP_VERSION_CHECK=1
REQ=python/requirements-ci.txt

phase "venv"
command -v "$PY" >/dev/null 2>&1 || { echo "no $PY on PATH (set PYTHON=...)"; exit 1; }
pyver=$("$PY" -c 'import sys; print(sys.version.split()[0])')
key=$({ cat "$REQ"; echo "python $pyver"; echo "layout 1"; } | sha256sum | cut -c1-16)
VENV=$CACHE/venv-$key
if [ -f "$VENV/.complete" ] && [ -x "$VENV/bin/python" ]; then
  echo "cached venv $VENV (python $pyver, $REQ unchanged)"
else
  rm -rf "$VENV"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "$PY -m venv failed: installing python3-venv"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      "$PY" -m venv "$VENV"
    else
      echo "$PY -m venv failed: install your distribution's venv package (Debian: python3-venv)"; exit 1
    fi
  fi
  echo "installing $REQ into $VENV (pip cache $PIP_CACHE_DIR)"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off -r "$REQ"
  touch "$VENV/.complete"
fi
"$VENV/bin/python" -c 'import torch, numpy, maturin; print("torch", torch.__version__, "| numpy", numpy.__version__)' \
  2>/dev/null || "$VENV/bin/python" -c 'import torch, numpy; print("torch", torch.__version__, "| numpy", numpy.__version__)'
# `ci/python.sh --venv-only`: only the cached venv (ci/test.sh fetches it in the background
# while it compiles, since it is mostly a download).
if [ "${1:-}" = "--venv-only" ]; then phase ""; exit 0; fi

phase "build (maturin, release)"
. ci/target-dir.sh
WHEELS=$TARGET_DIR/python-wheels
rm -rf "$WHEELS"
"$VENV/bin/maturin" build --release --locked -m python/Cargo.toml -i "$VENV/bin/python" -o "$WHEELS"
wheel=$(ls "$WHEELS"/tidewire-*.whl | head -n 1)
echo "built $wheel ($(du -h "$wheel" | cut -f1))"

phase "install"
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
# The tests must import the installed package, not python/tidewire from the clone.
(cd / && "$VENV/bin/python" -c 'import tidewire, tidewire.torch; print("tidewire", tidewire.__version__, "from", tidewire.__file__)')

phase "pytest"
# test_checkpoint.py reads the checkpoints `tidewire train` writes.
# TIDEWIRE_CARGO_SELECT: which packages and features to build it with (ci/test.sh builds
# the workspace once with every feature, and passes --workspace --all-features).
read -ra select <<<"${TIDEWIRE_CARGO_SELECT:--p tidewire-cli}"
cargo build --release --locked -q "${select[@]}" --bin tidewire
export TIDEWIRE_CLI=$TARGET_DIR/release/tidewire
"$VENV/bin/python" -m pytest -v -rs -p no:cacheprovider --durations=10 python/tests
# Commands after `--` run with this venv's python first on PATH (and as $PYTHON), e.g.
# `ci/python.sh -- bash examples/torch/check_digits.sh`.
if [ "${1:-}" = "--" ] && [ $# -gt 1 ]; then
  shift
  phase "$*"
  PATH="$VENV/bin:$PATH" PYTHON="$VENV/bin/python" "$@"
fi
phase ""
echo "---- python.sh: all phases took $((SECONDS - t_all)) s"
