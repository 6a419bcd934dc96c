// connect_mesh: the Gloo full mesh of one group, connected within a deadline
// and with evidence of who could not be reached. Internal to the Gloo backend.
//
// Gloo's own connectFullMesh connects the pairs one after the other, each
// waiting up to five times the context's timeout, and says only that "a"
// pair failed: one member whose data port is blocked held a formation for
// 5 x init_timeout and left no trace of which member it was. Here:
//   - every peer gets a thread of its own that waits for its address in the
//     store and then connects the pair, so one missing address or one
//     unreachable peer costs the others nothing, and the whole mesh is
//     bounded by one deadline;
//   - once a pair failed, the others get 1 s more (healthy pairs connect in
//     milliseconds), so the failure is reported without waiting out the
//     deadline;
//   - a pair still connecting when the wait ends (the deadline, that grace,
//     or the store saying the formation is over, Store::cancelled) is left
//     to finish on its own, never closed mid-handshake (a reset can reach a
//     peer inside accept, and Gloo 5b14351 then terminates that peer): its
//     thread ends by Gloo's own bound, 1 s after the deadline, holding the
//     context until then; no thread touches the store after the call;
//   - the result names, by rank, the peers whose address never arrived, and
//     those that were unreachable: refused, reset, a malformed address, or
//     still not connected at the deadline after a fair try (1 s, or half the
//     time the mesh had). A pair cut short, or whose address came too late
//     for a fair try, is no evidence against anyone. When the formation
//     ended elsewhere, only definite failures are reported.
//   - a rank whose mesh failed keeps its pairs open 3 s more (at most until
//     the deadline): a peer still finishing its connect to it must not see
//     "connection closed by peer" and name it.
// Keys: "<prefix><rank>", each one rank's pair addresses for the others in
// rank order (Gloo's layout), so a member writes only its own rank's key.
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>

#include <memory>
#include <string>
#include <vector>

#include "common/data/communicator.h"
#include "common/data/store.h"

namespace paramcast::gloo_backend {

struct MeshResult {
  std::shared_ptr<::gloo::transport::Context> context;  // every pair connected; null otherwise
  std::vector<int> unreachable;                         // ranks whose pair did not connect
  std::vector<int> no_address;                          // ranks whose address never arrived
  std::string error;                                    // why, when context is null
};

// The Gloo context over a connected mesh (what connectFullMesh would have set up).
class MeshContext : public ::gloo::rendezvous::Context {
 public:
  MeshContext(int rank, int size, std::shared_ptr<::gloo::transport::Device> device,
              std::shared_ptr<::gloo::transport::Context> connected)
      : ::gloo::rendezvous::Context(rank, size) {
    device_ = std::move(device);
    transportContext_ = std::move(connected);
  }
};

// `names[r]`: rank r's name for messages (may be empty).
MeshResult connect_mesh(int rank, int size, const std::shared_ptr<::gloo::transport::Device>& device, Store& store,
                        const std::string& prefix, Deadline deadline, const std::vector<std::string>& names);

}  // namespace paramcast::gloo_backend
