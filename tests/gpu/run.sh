#!/usr/bin/env bash
# The NCCL suite and GPU benchmark, for a machine with one or more GPUs.
# Builds with PARAMCAST_WITH_NCCL=ON, runs the data-plane conformance suite on
# NCCL (8 ranks; when there are fewer GPUs than ranks, several ranks share a
# GPU: each process gets its own NCCL_HOSTID and NCCL uses the loopback socket
# transport), then the benchmark on NCCL.
#   usage: tests/gpu/run.sh [OUT_DIR]     (SIZE=1GiB REPEATS=5 to change the bench)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/build-gpu/results}"
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
echo "== GPUs: ${gpus}"; nvidia-smi -L || true
if [ "${gpus:-0}" -lt 8 ]; then
  export NCCL_SOCKET_IFNAME=lo
  echo "fewer than 8 GPUs: ranks share GPUs (distinct NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo)"
fi
if command -v apt-get >/dev/null && [ "$(id -u)" -eq 0 ]; then bash "$root/deploy/install-deps.sh"; fi
bash "$root/deploy/build.sh" "$root/build-gpu" -DPARAMCAST_WITH_NCCL=ON -DPARAMCAST_BUILD_TESTS=ON \
  -- communicator_test dataplane_rank paramcast-bench
set -o pipefail
"$root/build-gpu/bin/communicator_test" --gtest_filter='*nccl*:*gloo*' 2>&1 | tee "$out/nccl_suite.log"
"$root/build-gpu/bin/paramcast-bench" --backend nccl --world 8 --gpus "${gpus:-1}" --size "${SIZE:-1GiB}" \
  --repeats "${REPEATS:-5}" --layout separate --json "$out/bench_nccl.json" 2>&1 | tee "$out/bench_nccl.log"
"$root/build-gpu/bin/paramcast-bench" --backend nccl --world 8 --gpus "${gpus:-1}" --size "${SIZE:-1GiB}" \
  --repeats "${REPEATS:-5}" --layout arena --json "$out/bench_nccl_arena.json" 2>&1 | tee "$out/bench_nccl_arena.log"
