// Point-to-point sends and receives (see gloo_communicator.h): the data
// plane's moves between two ranks, beside the broadcast stream.
#include <gloo/common/error.h>
#include <gloo/types.h>

#include "common/data/gloo/gloo_communicator.h"
#include "common/data/gloo/schedule.h"
#include "common/data/gloo/sigpipe_blocked.h"
#include "common/units.h"

namespace paramcast::gloo_backend {
namespace {
constexpr auto kForever = std::chrono::hours(24 * 365);
}  // namespace

std::shared_ptr<Work> GlooCommunicator::send(const void* data, size_t bytes, int peer, uint32_t tag) {
  return p2p(const_cast<void*>(data), bytes, peer, tag, true);
}

std::shared_ptr<Work> GlooCommunicator::recv(void* data, size_t bytes, int peer, uint32_t tag) {
  return p2p(data, bytes, peer, tag, false);
}

std::shared_ptr<Work> GlooCommunicator::p2p(void* data, size_t bytes, int peer, uint32_t tag, bool send) {
  const std::string what = (send ? "send to " : "receive from ") + who(peer);
  auto [work, finished] =
      data_internal::start_p2p(this, options_.epoch, options_.rank, options_.world_size, peer, bytes, group() + what);
  if (finished) return work;
  auto op = std::make_shared<P2p>();
  op->send = send;
  op->peer = peer;
  op->bytes = bytes;
  op->state = work->state;
  op->buffer = context_->createUnboundBuffer(data, bytes);
  SigpipeBlocked blocked;  // posting writes to the peer
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.ok()) {
    work->state->complete(aborted(group() + what + ": the communicator is unusable: " + error_.to_string()));
    return work;
  }
  const uint64_t slot = ::gloo::Slot::build(kP2pSlotPrefix, tag);
  const P2pKey key{peer, send};
  p2p_[key].push_back(op);
  try {
    if (send) op->buffer->send(peer, slot, 0, bytes);
    else op->buffer->recv(peer, slot, 0, bytes);
  } catch (const std::exception& e) {
    // The pair is broken: the runner fails the communicator, and only then
    // does this Work complete (with the others), so that the caller's next
    // operation finds the communicator failed (kAborted), as the interface says.
    report_failure_locked(peer_lost(group() + what + " failed: " + e.what()));
    return work;
  }
  if (!p2p_threads_.count(key)) p2p_threads_.emplace(key, std::thread([this, key] { complete_p2p(key); }));
  cv_.notify_all();
  return work;
}

// Takes the completions of one peer and direction, oldest first, for as
// long as the communicator lives. A kick (after a failure) sends it back to
// waiting for stop_: fail() completed the Works. A broken pair is reported
// to the runner, which fails the communicator naming the peer.
void GlooCommunicator::complete_p2p(P2pKey key) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& queue = p2p_[key];
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (error_.ok() && !queue.empty()); });
    if (stop_) return;
    std::shared_ptr<P2p> op = queue.front();
    lock.unlock();
    bool finished = false;
    std::string broke;
    try {
      finished = op->send ? op->buffer->waitSend(nullptr, kForever) : op->buffer->waitRecv(nullptr, kForever);
    } catch (const std::exception& e) {
      broke = e.what();
      if (broke.empty()) broke = "connection failed";
    }
    lock.lock();
    if (!broke.empty()) {
      report_failure_locked(peer_lost(group() + (op->send ? "sending to " : "receiving from ") + who(key.first) +
                                      " failed: " + broke));
      continue;  // the failure completes it; wait for stop_
    }
    if (!finished || !error_.ok()) continue;  // kicked: fail() completed it
    auto& link = links_[static_cast<size_t>(key.first)];
    (op->send ? link.bytes_sent : link.bytes_received) += op->bytes;
    op->done = true;
    queue.pop_front();
    op->state->complete(Status());
  }
}

}  // namespace paramcast::gloo_backend
