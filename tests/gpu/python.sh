#!/usr/bin/env bash
# The GPU runbook's Python stage: builds the paramcast package for this
# machine's own python3 (the one that holds PyTorch; its version is not the
# build machine's) from what tests/gpu/pack.sh put in PACK/py, then runs
# tests/python with it: test_cuda.py (a trainer and engine processes on CUDA
# tensors over NCCL) and test_cuda_vllm.py (the vLLM backend's TP workers on
# CUDA) first, then the CPU suites, which check the build itself.
# Needs a C++20 compiler, Python's headers and pybind11 (pip's is enough) on
# this machine; no network.
# It fails when PyTorch sees no CUDA device (test_cuda.py would skip, and the
# stage would pass having run nothing on a GPU) unless ALLOW_NO_CUDA=1.
#   usage: python.sh [WORK_DIR]   (env: PYTHON=python3, NCCL_LIB_DIR=dir of libnccl.so.2,
#                                  CUDA_HOME=/usr/local/cuda (its lib64/libcudadevrt.a),
#                                  PYTEST_FILES="test_cuda.py ...", ALLOW_NO_CUDA=1)
set -euo pipefail
pack="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-${TMPDIR:-/tmp}/paramcast-python}"
py="${PYTHON:-python3}"
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
src="$pack/py/src"
unset LD_LIBRARY_PATH  # run.sh's puts the pack's older C++ runtime first: not for this compiler, nor for python
if [ ! -d "$src/python" ]; then echo "python.sh: $pack/py holds no sources: run it from a folder made by tests/gpu/pack.sh" >&2; exit 1; fi

include="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
pybind="$("$py" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || true)"
[ -e "$include/Python.h" ] || { echo "python.sh: no Python.h in $include ($("$py" --version))" >&2; exit 1; }
pybind_flags=()
if [ -n "$pybind" ]; then
  pybind_flags=(-isystem "$pybind")
elif [ ! -e /usr/include/pybind11/pybind11.h ]; then  # else Debian's pybind11-dev, on the default path
  echo "python.sh: no pybind11 ($py has no pybind11 module, and there is no /usr/include/pybind11)" >&2
  exit 1
fi
nccl="${NCCL_LIB_DIR:-}"
if [ -z "$nccl" ]; then
  nccl="$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
[ -e "$nccl/libnccl.so.2" ] || { echo "python.sh: no libnccl.so.2 (set NCCL_LIB_DIR)" >&2; exit 1; }

# The pack's libraries without its C++ runtime: python's (loaded with
# PyTorch) is the machine's, newer than the build machine's.
rm -rf "$work/paramcast" "$work/lib"  # this script's outputs only: WORK_DIR may hold other things
mkdir -p "$work/paramcast" "$work/lib"
for f in "$pack"/lib/*; do
  case "$(basename "$f")" in libstdc++.so*|libgcc_s.so*) ;; *) ln -s "$f" "$work/lib/" ;; esac
done
cp "$src"/python/paramcast/*.py "$work/paramcast/"
mkdir -p "$work/paramcast/integrations" && cp "$src"/python/paramcast/integrations/*.py "$work/paramcast/integrations/"

echo "python.sh: building paramcast/_core$suffix for $("$py" --version) with $(c++ --version | head -1)"
shared=()
for f in "$work"/lib/*.so*; do shared+=("$f"); done
t0=$SECONDS
c++ -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -w \
  -I"$src" -I"$pack/py/include" -isystem "$include" ${pybind_flags[@]+"${pybind_flags[@]}"} -isystem "$cuda_home/include" \
  "$src"/python/*.cc -o "$work/paramcast/_core$suffix" \
  -Wl,--start-group "$pack"/py/lib/*.a -Wl,--end-group \
  "${shared[@]}" "$nccl/libnccl.so.2" -L"$cuda_home/lib64" -lcudadevrt -lpthread -ldl -lrt \
  -Wl,-rpath,"$work/lib:$nccl"
echo "python.sh: built in $((SECONDS - t0)) s"

export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$work/lib:$nccl"
"$py" -c 'import paramcast, torch; print("python.sh: paramcast imports beside torch", torch.__version__)'
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  if [ "${ALLOW_NO_CUDA:-0}" != 1 ]; then
    echo "python.sh: PyTorch sees no CUDA device: test_cuda.py would run nothing (ALLOW_NO_CUDA=1 to go on)" >&2
    exit 1
  fi
  echo "python.sh: no CUDA device; ALLOW_NO_CUDA=1: the CUDA tests skip"
fi
cd "$src/tests/python"
failed=0
for f in ${PYTEST_FILES:-test_cuda.py test_cuda_vllm.py test_tensors.py test_config.py test_sync.py test_faults.py}; do
  echo "== pytest $f"
  "$py" -m pytest -q -rs -s -p no:cacheprovider "$f" || failed=1
done
exit $failed
