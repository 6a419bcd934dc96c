#!/usr/bin/env bash
# Configures (once) and builds ParamCast into a build directory; installs
# missing system packages first. Fast when re-run: ninja rebuilds only what
# changed.   usage: deploy/build.sh [BUILD_DIR] [CMAKE_ARGS...] [-- TARGETS...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/build}"
shift || true
cmake_args=()
targets=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; targets=("$@"); break; fi
  cmake_args+=("$1"); shift
done
bash "$root/deploy/install-deps.sh"
# Configure on the first run, and again whenever CMake arguments are given, so
# that they reach a build directory configured before (e.g. -DPARAMCAST_WERROR=ON).
if [ ! -f "$dir/build.ninja" ] || [ ${#cmake_args[@]} -gt 0 ]; then
  cmake -S "$root" -B "$dir" -G Ninja "${cmake_args[@]}" >/dev/null
fi
if [ ${#targets[@]} -gt 0 ]; then
  cmake --build "$dir" --target "${targets[@]}"
else
  cmake --build "$dir"
fi
