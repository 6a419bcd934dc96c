// Factory of the NCCL data plane: CUDA device memory over NCCL.
// Compiled whenever CUDA and NCCL are found (PARAMCAST_HAVE_NCCL), with or
// without a GPU present; create() reports a clear error when there is none.
//
// Files: nccl_communicator.cc (non-blocking init with a warm-up broadcast,
// deadlines via ncclCommGetAsyncError: a stall is no broadcast completed for
// stall_timeout; order_after by stream events; Works woken by
// cudaLaunchHostFunc); abort_reaper.h (ncclCommAbort on a thread of its own:
// abort never blocks); nccl_check.h (the one NCCL/CUDA result wrapper);
// device_guard.h (the caller's current device restored); cuda_memory.cc
// (pooled staging, copy stream); kernels.cu (gather packing, xxh64-blocks
// digests, the delta codec's piece hashes).
#pragma once

#include <memory>
#include <string>

#include "common/data/communicator.h"

namespace paramcast::nccl_backend {

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store);
// ncclGetUniqueId as bytes (works without a GPU).
StatusOr<std::string> unique_id();
// Number of visible CUDA devices (0 when none or no driver).
int cuda_device_count();

}  // namespace paramcast::nccl_backend
