#!/usr/bin/env bash
# Installs every system package ParamCast's build, tests and tools need on
# Debian 12 / Ubuntu 22.04+. Idempotent and non-interactive: packages already
# present are not touched, and apt runs only when something is missing.
#
# The CUDA Toolkit is not a Debian package; where it is installed (CUDA's
# standard prefix, or CUDA_HOME) and NCCL is not, NCCL comes from PyPI (the
# nvidia-nccl-cu13 wheel, the same NCCL the GPU machines run) into
# /opt/paramcast/nccl, where cmake/FindNCCL.cmake looks: the NCCL data plane
# then compiles and links in every build, and its tests skip, saying why,
# without a device. Without CUDA the build has the Gloo data plane only.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libzmq3-dev cppzmq-dev
  capnproto libcapnp-dev
  libyaml-cpp-dev
  libgtest-dev libgmock-dev
  libgloo-dev
  libcpp-httplib-dev         # metrics.listen: the Prometheus page over HTTP
  clang libclang-rt-14-dev   # libFuzzer and sanitizers for the fuzz target
  python3-dev pybind11-dev   # the paramcast Python package (python/)
  python3-torch python3-numpy python3-pytest   # its tests and examples
  python3-yaml               # tests/docs/check_docs.py reads the docs' YAML blocks
  python3-prometheus-client  # the metrics tests parse the page with it
  python3-venv python3-pip   # pip install . (tests/python/test_install.py)
)

missing=()
for p in "${packages[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing+=("$p")
done

# NCCL from PyPI where CUDA is present and NCCL is not (version pinned: the
# one the lent GPU machines carry, so that a build here links against what
# runs there).
nccl_prefix=/opt/paramcast/nccl
nccl_wheel="nvidia-nccl-cu13==2.28.9"
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
install_nccl() {
  [ -x "$cuda_home/bin/nvcc" ] || return 0
  [ -f "$cuda_home/include/nccl.h" ] || [ -f "${NCCL_HOME:-/nonexistent}/include/nccl.h" ] && return 0
  [ -f "$nccl_prefix/include/nccl.h" ] && [ -e "$nccl_prefix/lib/libnccl.so" ] && return 0
  local py pip_dir
  py="$(command -v python3)"
  echo "install-deps: NCCL from PyPI ($nccl_wheel) into $nccl_prefix"
  pip_dir="$(mktemp -d)"
  $SUDO "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$pip_dir" "$nccl_wheel"
  $SUDO mkdir -p "$nccl_prefix"
  $SUDO rm -rf "$nccl_prefix/include" "$nccl_prefix/lib"
  $SUDO cp -r "$pip_dir/nvidia/nccl/include" "$pip_dir/nvidia/nccl/lib" "$nccl_prefix/"
  $SUDO ln -sf libnccl.so.2 "$nccl_prefix/lib/libnccl.so"
  $SUDO rm -rf "$pip_dir"
}

# A current PyTorch (and transformers) for the python3 on PATH when it is not
# the distribution's: the Python tests run under both (tests/python), and
# the FSDP2 trainer test needs PyTorch >= 2.6. Pinned to the release the
# project is tested with.
current_python_pkgs=("torch==2.13.0" transformers numpy pytest prometheus-client scikit-build-core pybind11 build)
install_current_python() {
  local py
  py="$(command -v python3 || true)"
  [ -n "$py" ] && [ "$(readlink -f "$py")" != "$(readlink -f /usr/bin/python3)" ] || return 0
  "$py" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('torch', 'transformers', 'numpy', 'pytest', 'prometheus_client', 'scikit_build_core', 'pybind11', 'build')))" 2>/dev/null && return 0
  echo "install-deps: ${current_python_pkgs[*]} for $py"
  "$py" -m pip install --quiet --disable-pip-version-check "${current_python_pkgs[@]}"
}

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
if [ ${#missing[@]} -eq 0 ]; then
  install_nccl
  install_current_python
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  if [ -z "$SUDO" ]; then
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
install_nccl
install_current_python
echo "install-deps: done"
