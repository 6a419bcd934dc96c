// The Communicator interface's defaults: point-to-point where a backend has
// none of its own.
#include "common/data/communicator.h"

#include "common/data/work_state.h"

namespace paramcast {
namespace {
std::shared_ptr<Work> unsupported(Communicator* c, const std::string& what) {
  auto w = std::make_shared<data_internal::DeadlineWork>(c, 0, c->rank(), what);
  w->state->complete(unavailable(what + ": this data plane has no point-to-point moves (" +
                                 c->device().to_string() + ", world of " + std::to_string(c->world_size()) + ")"));
  return w;
}
}  // namespace

std::shared_ptr<Work> Communicator::send(const void*, size_t, int peer, uint32_t) {
  return unsupported(this, "send to rank " + std::to_string(peer));
}

std::shared_ptr<Work> Communicator::recv(void*, size_t, int peer, uint32_t) {
  return unsupported(this, "receive from rank " + std::to_string(peer));
}

}  // namespace paramcast
