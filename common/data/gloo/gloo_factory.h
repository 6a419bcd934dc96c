// Factory of the Gloo data plane: host memory over Gloo's TCP transport.
// Used where there is no GPU, and as the reference backend in CI.
#pragma once

#include <memory>

#include "common/data/communicator.h"

namespace paramcast::gloo_backend {

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store);

}  // namespace paramcast::gloo_backend
