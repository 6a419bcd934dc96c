#!/usr/bin/env bash
# Builds ParamCast with NCCL on (Release) and packs what the GPU runbook
# needs into one self-contained folder, for a GPU machine that has CUDA's
# driver, NCCL (the nvidia-nccl wheel's libnccl.so.2), PyTorch and CMake but
# no package registry and no network:
#   PACK/bin   the test and benchmark binaries (stripped)
#   PACK/lib   every shared library they need that is not the system's C
#              library, the CUDA driver or NCCL (from ldd): ZeroMQ, Cap'n
#              Proto, yaml-cpp, libstdc++, the CUDA runtime, ...
#   PACK/py    what tests/gpu/python.sh needs to build the Python package
#              for the machine's own python3 (its version and PyTorch are not
#              this machine's): the static libraries (position independent,
#              no LTO), the sources of python/ with the headers they include,
#              yaml-cpp's headers, tests/python and the example model
#   PACK/run.sh, PACK/python.sh, PACK/MANIFEST
# The folder must stay under 64 MiB. Test binaries find their helpers next
# to themselves (/proc/self/exe), so the folder runs from anywhere.
#   usage: tests/gpu/pack.sh [PACK_DIR] [BUILD_DIR]    (default build-gpu/pack, build-gpu)
#          PACK_NO_BUILD=1 tests/gpu/pack.sh PACK_DIR BUILD_DIR   (pack what BUILD_DIR holds)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
pack="${1:-$root/build-gpu/pack}"
build="${2:-$root/build-gpu}"
limit=$((64 * 1024 * 1024))
targets=(data_pieces_test cuda_memory_test communicator_test dataplane_rank bucket_pipeline_test transfer_rank
         reshard_exec_test reshard_rank sharded_nccl_test paramcast-trainer paramcast-worker paramcast-bench
         paramcast-gpu-bench)

if [ "${PACK_NO_BUILD:-0}" != 1 ]; then  # PACK_NO_BUILD=1: pack an existing build (tests/gpu/pack_test.sh)
  bash "$root/deploy/build.sh" "$build" -DPARAMCAST_WITH_NCCL=ON -DCMAKE_BUILD_TYPE=Release \
    -DPARAMCAST_BUILD_TESTS=ON -DPARAMCAST_BUILD_BENCH=ON -- "${targets[@]}"
fi

build="$(cd "$build" && pwd)"  # absolute: the header listing below runs from the source root
rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib"
for t in "${targets[@]}"; do
  cp "$build/bin/$t" "$pack/bin/"
  strip --strip-unneeded "$pack/bin/$t"
done
cp "$root/tests/gpu/run.sh" "$pack/run.sh"
cp "$root/tests/gpu/python.sh" "$pack/python.sh"

# The Python package's inputs. Its extension is compiled there, against that
# machine's Python headers and pybind11; of this tree, only the sources and
# headers python/*.cc reach are copied.
mkdir -p "$pack/py/lib" "$pack/py/include" "$pack/py/src"
for a in trainer_side/libparamcast_publisher.a inference_side/libparamcast_subscriber.a \
         common/libparamcast_common.a common/libparamcast_cuda_kernels.a schemas/libparamcast_schemas.a; do
  if [ ! -f "$build/$a" ]; then echo "pack.sh: $build/$a is missing (was the build configured with NCCL?)" >&2; exit 1; fi
  cp "$build/$a" "$pack/py/lib/"
done
strip --strip-debug "$pack"/py/lib/*.a
# The one third-party header set python/*.cc reaches (common/config.h's
# yaml-cpp); the public headers name no Cap'n Proto or ZeroMQ type.
cp -r /usr/include/yaml-cpp "$pack/py/include/"
py_include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
for f in "$root"/python/*.cc; do
  (cd "$root" && c++ -std=c++20 -I. -I"$build" -isystem "$py_include" -isystem /usr/local/cuda/include -MM "${f#"$root/"}") ||
    { echo "pack.sh: cannot list what $f includes (python3-dev and pybind11-dev: deploy/install-deps.sh)" >&2; exit 1; }
done | tr ' \\' '\n\n' | grep -E '\.(h|cc)$' | sort -u > "$pack/py/sources"
while read -r f; do
  case "$f" in
    "$build"/*) mkdir -p "$(dirname "$pack/py/src/${f#"$build/"}")"; cp "$f" "$pack/py/src/${f#"$build/"}" ;;  # generated
    /*) echo "pack.sh: python/ includes $f, outside the tree and the pack's headers" >&2; exit 1 ;;
    *) (cd "$root" && cp --parents "$f" "$pack/py/src/") ;;
  esac
done < "$pack/py/sources"
(cd "$root" && cp --parents python/paramcast/*.py python/paramcast/integrations/*.py tests/python/*.py examples/python/tinylm.py deploy/*.yaml "$pack/py/src/")

# Libraries to leave to the machine: glibc's (libc, libm, libpthread, libdl,
# librt, ld-linux), the CUDA driver (libcuda, libnvidia-*) and NCCL.
system_lib() {
  case "$1" in
    linux-vdso.so*|ld-linux*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*) return 0 ;;
    libcuda.so*|libnvidia-*|libnccl.so*) return 0 ;;
  esac
  return 1
}
missing=()
for b in "$pack"/bin/*; do
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    system_lib "$name" && continue
    if [ "$path" = "not" ]; then missing+=("$name (needed by $(basename "$b"))"); continue; fi
    [ -e "$pack/lib/$name" ] || cp -L "$path" "$pack/lib/$name"
  done < <(ldd "$b")
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'pack.sh: libraries not found by ldd: %s\n' "${missing[@]}" >&2
  exit 1
fi
strip --strip-unneeded "$pack"/lib/* 2>/dev/null || true

{
  echo "ParamCast GPU pack, $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown), built $(date -u +%FT%TZ)"
  echo "glibc here: $(ldd --version | head -1)"
  (cd "$pack" && find bin lib -type f -printf '%s %p\n' | sort -k2)
} > "$pack/MANIFEST"
size=$(du -sb "$pack" | cut -f1)
echo "pack.sh: $pack holds $(ls "$pack/bin" | wc -l) binaries and $(ls "$pack/lib" | wc -l) libraries, $((size / 1024 / 1024)) MiB"
if [ "$size" -ge "$limit" ]; then
  echo "pack.sh: $size bytes is over the 64 MiB limit" >&2
  exit 1
fi
