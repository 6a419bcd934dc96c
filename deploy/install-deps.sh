#!/usr/bin/env bash
# Installs every system package ParamCast's build, tests and tools need on
# Debian 12 / Ubuntu 22.04+. Idempotent and non-interactive: packages already
# present are not touched, and apt runs only when something is missing.
#
# The CUDA Toolkit and NCCL are not Debian packages; the build uses them when
# found (CUDA's standard prefix, or NCCL_HOME / CUDA_HOME) and otherwise builds
# the Gloo data plane only (see PARAMCAST_WITH_NCCL in the README).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libzmq3-dev cppzmq-dev
  capnproto libcapnp-dev
  libyaml-cpp-dev
  libgtest-dev libgmock-dev
  libgloo-dev
  clang libclang-rt-14-dev   # libFuzzer and sanitizers for the fuzz target
  python3-dev pybind11-dev   # the paramcast Python package (python/)
  python3-torch python3-numpy python3-pytest   # its tests and examples
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
