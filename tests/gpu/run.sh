#!/usr/bin/env bash
# The GPU runbook: tests and benchmark figures in one call, under 10 minutes,
# with no install step and no network. Runs from a folder made by
# tests/gpu/pack.sh (this script is copied into it), or from the source tree
# (then it uses build-gpu/pack, packing first if there is none).
#
# Stages, each bounded and run even when an earlier one failed:
#   gpu_info      the CUDA runtime's device count (not nvidia-smi), nvidia-smi -L
#   data_pieces   host logic of the pipeline (checksums, pool, reaper, ordering)
#   cuda_memory   device checksum vs host, 10,000-piece gather, stream ordering,
#                 one-rank NCCL communicator (warm-up, order_after, abort), the
#                 CUDA delta codec and the CUDA quantizer against the host's
#   fp8_bench     the CUDA quantizer's rate on 256 MiB of BF16 against a
#                 device-to-device cudaMemcpy (its last 4 lines: cast and fp8)
#   gloo_suite    data-plane conformance on Gloo (the pack itself works)
#   nccl_suite    data-plane conformance on NCCL, 8 ranks (NCCL_DEBUG=INFO),
#                 point to point on 6 (ncclSend/ncclRecv groups, a killed rank)
#   reshard_nccl  the many-sender plan over NCCL, buffers on the GPU
#   sharded_nccl  many-sender updates end to end: trainer ranks and engines
#                 as processes, rows and slices on the GPU, over NCCL
#   gpu_bench     memcpy vs pack/unpack, xxh64-blocks rate, per-bucket overhead
#   bench_nccl_*  weight_update vs raw ncclBroadcast, separate and arena layouts
#   python        the Python package built for this machine's python3 and
#                 PyTorch (python.sh), then tests/python: a CUDA trainer and
#                 CUDA engine processes over NCCL, then the CPU suites
# With fewer GPUs than ranks, ranks share GPUs: each gets its own NCCL_HOSTID
# (set by the tests and the bench) and NCCL_SOCKET_IFNAME=lo. Every log lands
# in OUT_DIR; a summary closes the run; exit 1 if any stage failed.
#   usage: run.sh [OUT_DIR]   (env: SIZE=1GiB REPEATS=3 for the weight_update bench,
#                              STAGES="nccl_suite python" to run only those stages,
#                              NCCL_REPEAT=N to run the NCCL suite N times)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -d "$here/bin" ]; then
  pack="$here"
else
  pack="${PACK:-$here/../../build-gpu/pack}"
  if [ ! -d "$pack/bin" ]; then
    echo "== no pack at $pack: packing (needs the build dependencies)"
    bash "$here/pack.sh" "$pack" || { echo "run.sh: packing failed" >&2; exit 1; }
  fi
  pack="$(cd "$pack" && pwd)"
fi
out="${1:-$pack/results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
bin="$pack/bin"

# NCCL: the nvidia-nccl wheel's libnccl.so.2, else the usual places.
find_nccl() {
  local d
  d=$(python3 - 2>/dev/null <<'PY'
import importlib, os
for name in ("nvidia.nccl", "nvidia.nccl.lib"):
    try:
        m = importlib.import_module(name)
    except Exception:
        continue
    bases = list(getattr(m, "__path__", []))
    if getattr(m, "__file__", None):
        bases.append(os.path.dirname(m.__file__))
    for b in bases:
        for lib in (os.path.join(b, "lib"), b):
            if os.path.exists(os.path.join(lib, "libnccl.so.2")):
                print(lib)
                raise SystemExit
PY
)
  if [ -n "$d" ]; then echo "$d"; return; fi
  for sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null) \
            /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
    if [ -e "$sp/nvidia/nccl/lib/libnccl.so.2" ]; then echo "$sp/nvidia/nccl/lib"; return; fi
  done
  d=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
  if [ -n "$d" ]; then dirname "$d"; return; fi
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu /usr/local/lib; do
    if [ -e "$d/libnccl.so.2" ]; then echo "$d"; return; fi
  done
}
nccl_dir="$(find_nccl)"
export LD_LIBRARY_PATH="$pack/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== pack $pack; NCCL from ${nccl_dir:-nowhere (NCCL stages will fail)}; logs in $out"

summary=()
failed=0
known="gpu_info data_pieces cuda_memory fp8_bench gloo_suite nccl_suite reshard_nccl sharded_nccl shm_cuda gpu_bench bench_nccl_separate bench_nccl_arena python"
for name in ${STAGES:-}; do
  if [[ " $known " != *" $name "* ]]; then echo "run.sh: STAGES names '$name'; the stages are: $known" >&2; exit 2; fi
done
# stage NAME SECONDS CMD...: runs bounded, logs to OUT/NAME.log, never stops the run.
stage() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if [ -n "${STAGES:-}" ] && [ "$name" != gpu_info ] && [[ " $STAGES " != *" $name "* ]]; then
    summary+=("$(printf '%-18s not run (STAGES)' "$name")")
    return
  fi
  echo "== $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 4 "$out/$name.log" | sed 's/^/   /'
  if [ $rc -eq 0 ]; then
    summary+=("$(printf '%-18s ok      %4ds' "$name" $((SECONDS - t0)))")
  else
    failed=1
    summary+=("$(printf '%-18s FAILED  %4ds  rc=%d%s  %s' "$name" $((SECONDS - t0)) $rc \
      "$([ $rc -eq 124 ] && echo ' (timed out)')" "$out/$name.log")")
  fi
}

stage gpu_info 30 bash -c "'$bin/paramcast-gpu-bench' --devices; nvidia-smi -L || true"
gpus=$(head -1 "$out/gpu_info.log" 2>/dev/null | tr -dc 0-9)
gpus=${gpus:-0}
echo "   CUDA runtime sees $gpus GPU(s)"
if [ "$gpus" -lt 8 ]; then
  export NCCL_SOCKET_IFNAME=lo
  echo "   fewer than 8 GPUs: 8 ranks share them (distinct NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo)"
fi
export NCCL_DEBUG=${NCCL_DEBUG:-INFO}
export NCCL_DEBUG_FILE="$out/nccl.%h.%p.log"

stage data_pieces 60 "$bin/data_pieces_test"
stage cuda_memory 120 "$bin/cuda_memory_test"
# The figures print last, so that the stage's tail shows them.
stage fp8_bench 60 bash -c "out=\$('$bin/cuda_memory_test' --gtest_also_run_disabled_tests \
  --gtest_filter='CudaFp8Rate.*' 2>&1); rc=\$?; echo \"\$out\"; echo \"\$out\" | grep '^fp8_bench'; exit \$rc"
stage gloo_suite 60 "$bin/communicator_test" --gtest_filter='*/gloo'
stage nccl_suite 180 "$bin/communicator_test" --gtest_filter='*/nccl' --gtest_repeat="${NCCL_REPEAT:-1}"
# The many-sender plan over NCCL: trainer and engine ranks as processes, the
# buffers on the GPU, round by round (ncclSend/ncclRecv groups).
stage reshard_nccl 120 "$bin/reshard_exec_test" --gtest_filter='ReshardExecTest.OnNccl*'
# Many-sender updates end to end: paramcast-trainer ranks with their rows on
# the GPU, paramcast-worker engines (whole tensors, TP slices) over NCCL.
stage sharded_nccl 300 "$bin/sharded_nccl_test"
# The shm plane on CUDA memory: engines on the trainer's GPU through CUDA IPC.
stage shm_cuda 90 "$bin/communicator_test" --gtest_filter='ShmOnCudaTest.*:*/shm'
stage gpu_bench 60 "$bin/paramcast-gpu-bench" --size 256MiB --repeats 10 --json "$out/gpu_bench.json"
for layout in separate arena; do
  stage "bench_nccl_$layout" 90 "$bin/paramcast-bench" --backend nccl --world 8 --gpus "$(( gpus > 0 ? gpus : 1 ))" \
    --size "${SIZE:-1GiB}" --repeats "${REPEATS:-3}" --layout "$layout" --checksum xxh64-blocks \
    --json "$out/bench_nccl_$layout.json"
done

stage python 360 env NCCL_LIB_DIR="$nccl_dir" bash "$pack/python.sh"

echo "== summary ($SECONDS s in all; logs and JSON in $out)"
printf '   %s\n' "${summary[@]}" | tee "$out/SUMMARY"
exit $failed
