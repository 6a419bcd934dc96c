// Factory of the shm data plane: host memory shared by the ranks of one host
// (the publisher and the engines beside it), one copy in and one copy out
// per rank instead of loopback TCP. Rank 0 (the publisher) is the only root.
//
// Files: segment (a memfd of a 64 KiB header and two slots, handed to
// same-user readers over an abstract Unix socket, each presenting the secret
// only its rank was given: SCM_RIGHTS, SO_PEERCRED; the readers that never
// attached are the root's evidence); shm_communicator.cc (the two-slot ring
// of chunks, a futex word in the header, the abort word naming the rank to
// blame, dead peers by pid, a stalled reader after stall_timeout); p2p
// (point-to-point moves: one channel per ordered pair of ranks, up to 64
// ranks; the receiver posts wants in order, the sender streams a send once
// its tag is wanted; every word a peer writes checked; a thread of its
// own); futex.h; host_identity (boot id, user, network namespace: who counts
// as local); slots.h (the ring's slots: in the memfd, or for CUDA memory the
// root's device memory shared through CUDA IPC handles: cuda_slots.cc).
#pragma once

#include <memory>

#include "common/data/communicator.h"

namespace paramcast::shm_backend {

// The root's `evidence` (may be null): the ranks that did not attach.
StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store,
                                               FormationEvidence* evidence = nullptr);
StatusOr<std::string> mint_bootstrap();

}  // namespace paramcast::shm_backend
