// Which device a Device names, as this process sees it: a GPU named by UUID
// ("GPU-..." or "MIG-..." as nvidia-smi -L prints it) becomes the ordinal it
// has here (after CUDA_VISIBLE_DEVICES: a worker that sees one GPU has it as
// cuda:0). On the floor with tensor.h, below every room that runs on a
// device: the data plane (data/device_memory.h, data/nccl/) and the
// transforms (transform/cuda/) both resolve through it.
#pragma once

#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

// A CUDA device named by UUID, as the ordinal this process sees; any other
// device as it is. The error lists the UUIDs the process does see.
StatusOr<Device> resolve_device(const Device& device);
// resolve_device, or `device` unchanged when it cannot be resolved (the
// later create_device_memory then reports why).
Device resolve_device_or_keep(const Device& device);

}  // namespace paramcast
