// Factory of the NCCL data plane: CUDA device memory over NCCL.
// Compiled whenever CUDA and NCCL are found (PARAMCAST_HAVE_NCCL), with or
// without a GPU present; create() reports a clear error when there is none.
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
