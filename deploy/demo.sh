#!/usr/bin/env bash
# The local demo: builds what it needs, then runs one trainer publishing a
# 291-tensor synthetic LLM to seven workers on this machine over Gloo; every
# worker verifies every byte of every version. Extra arguments are passed to
# `paramcast launch` (e.g. another deployment file instead of the default).
# PARAMCAST_BUILD_DIR builds elsewhere than build/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PARAMCAST_BUILD_DIR:-$root/build}"
# The build prints nothing until it is done (its output goes to a log): say
# what it does and how long it takes first. Measured on 2 cores, from an
# empty build directory with the packages installed: 311 s (the three tools
# and the libraries they link, CUDA kernels included, on a loaded machine).
if [ -x "$build/bin/paramcast" ]; then
  echo "demo: building paramcast, paramcast-trainer and paramcast-worker into $build (only what changed since the last build)"
else
  echo "demo: building paramcast, paramcast-trainer and paramcast-worker into $build (first build: about 5 minutes on 2 cores; seconds when re-run)"
fi
mkdir -p "$build"
started=$SECONDS
if ! bash "$root/deploy/build.sh" "$build" -- paramcast paramcast-trainer paramcast-worker >"$build/demo-build.log" 2>&1; then
  tail -n 30 "$build/demo-build.log" >&2
  echo "demo: the build failed (above: the end of $build/demo-build.log)" >&2
  exit 1
fi
echo "demo: built in $((SECONDS - started)) s; starting 1 trainer and 7 workers"
exec "$build/bin/paramcast" launch "${1:-$root/deploy/local-cpu.yaml}"
