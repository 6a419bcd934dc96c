// Factory of the shm data plane: host memory shared by the ranks of one host
// (the publisher and the engines beside it), one copy in and one copy out
// per rank instead of loopback TCP. Rank 0 (the publisher) is the only root.
#pragma once

#include <memory>

#include "common/data/communicator.h"

namespace paramcast::shm_backend {

// The root's `evidence` (may be null): the ranks that did not attach.
StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store,
                                               FormationEvidence* evidence = nullptr);
StatusOr<std::string> mint_bootstrap();

}  // namespace paramcast::shm_backend
