#!/usr/bin/env bash
# ctest gpu_pack: packs this build tree with tests/gpu/pack.sh (no rebuild),
# moves the folder elsewhere, and runs the pack's host and Gloo tests from it
# with a bare environment (only the pack's libraries), as the GPU machine
# would. Fails if the folder is 64 MiB or more or a library is missing.
#   usage: pack_test.sh BUILD_DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$1"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/paramcast-pack-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
PACK_NO_BUILD=1 bash "$here/pack.sh" "$tmp/made" "$build"
mv "$tmp/made" "$tmp/moved"  # nothing may point back into the build tree's pack path
test -f "$tmp/moved/MANIFEST" && test -x "$tmp/moved/run.sh"
for b in "$tmp"/moved/bin/*; do
  deps="$(env -i LD_LIBRARY_PATH="$tmp/moved/lib" ldd "$b" || true)"  # captured: no SIGPIPE under pipefail
  if grep -v 'libcuda\.\|libnccl\.' <<< "$deps" | grep 'not found' >&2; then
    echo "pack_test: $b misses a library" >&2
    exit 1
  fi
done
cd "$tmp"
env -i PATH=/usr/bin:/bin HOME="$tmp" LD_LIBRARY_PATH="$tmp/moved/lib" \
  "$tmp/moved/bin/data_pieces_test" --gtest_filter='OrderingTest.*:BucketChecksumTest.*'
env -i PATH=/usr/bin:/bin HOME="$tmp" LD_LIBRARY_PATH="$tmp/moved/lib" \
  "$tmp/moved/bin/communicator_test" --gtest_filter='*EightRanksBroadcastBitExact/gloo'
env -i PATH=/usr/bin:/bin HOME="$tmp" LD_LIBRARY_PATH="$tmp/moved/lib" \
  "$tmp/moved/bin/reshard_exec_test" --gtest_filter='*RoundByRoundOverAMemoryMegatron*'
echo "pack_test: the packed folder runs the Gloo tests"
