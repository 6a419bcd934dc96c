// Factory of the Gloo data plane: host memory over Gloo's TCP transport.
// Used where there is no GPU, and as the reference backend in CI.
#pragma once

#include <memory>

#include "common/data/communicator.h"

namespace paramcast::gloo_backend {

// The full mesh connects within options.init_timeout (mesh.h); when it does
// not, `evidence` (if given) gets the ranks this one could not reach.
StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store,
                                               FormationEvidence* evidence = nullptr);

}  // namespace paramcast::gloo_backend
