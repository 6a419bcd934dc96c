// Point-to-point moves on the shm plane (p2p.h for the design).
#include "common/data/shm/p2p.h"

#include <algorithm>
#include <cstring>

#include "common/data/shm/futex.h"
#include "common/data/shm/segment.h"

namespace paramcast::shm_backend {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(10);
constexpr auto kLivenessEvery = std::chrono::milliseconds(100);

struct Want {
  uint64_t tag;
  uint64_t bytes;
};
constexpr size_t kControlWords = 4 + 3 * kP2pChunks;
constexpr uint64_t kWants = (kP2pControlBytes - kControlWords * sizeof(uint64_t)) / sizeof(Want);

std::string op_name(bool send, uint32_t tag, size_t bytes, const std::string& peer) {
  std::string s = send ? "send to " : "receive from ";
  s += peer;
  s += " (tag ";
  s += std::to_string(tag);
  s += ", ";
  s += std::to_string(bytes);
  s += " bytes)";
  return s;
}

}  // namespace

// A channel's control page. The receiver writes `posted` and the wants, the
// sender `taken`, `published` and the chunks' descriptions, the receiver
// `consumed`; each side reads the other's words with acquire and checks them.
struct P2pPlane::Control {
  std::atomic<uint64_t> posted;     // receiver: wants written
  std::atomic<uint64_t> taken;      // sender: wants taken, in order
  std::atomic<uint64_t> published;  // sender: chunks written
  std::atomic<uint64_t> consumed;   // receiver: chunks copied out
  uint64_t chunk_tag[kP2pChunks];
  uint64_t chunk_offset[kP2pChunks];
  uint64_t chunk_len[kP2pChunks];
  Want want[kWants];
};

P2pPlane::P2pPlane(const GroupOptions& options, uint8_t* area, std::atomic<uint32_t>* wake, Group group)
    : options_(options), area_(area), wake_(wake), group_(std::move(group)) {
  static_assert(sizeof(Control) <= kP2pControlBytes, "a channel's control must fit its page");
  peers_.resize(static_cast<size_t>(options_.world_size));
}

P2pPlane::~P2pPlane() { stop(); }

void P2pPlane::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Never started, or stopped before taking them: nothing touches these buffers.
  for (auto& op : incoming_) op->state->complete(aborted("communicator destroyed"));
}

P2pPlane::Control& P2pPlane::control(int from, int to) const {
  const uint64_t index = static_cast<uint64_t>(from) * static_cast<uint64_t>(options_.world_size) + to;
  return *reinterpret_cast<Control*>(area_ + index * kP2pChannelBytes);
}

uint8_t* P2pPlane::chunk(int from, int to, uint64_t index) const {
  return reinterpret_cast<uint8_t*>(&control(from, to)) + kP2pControlBytes + (index % kP2pChunks) * kP2pChunkBytes;
}

std::shared_ptr<Work> P2pPlane::post(Communicator* comm, void* data, size_t bytes, int peer, uint32_t tag,
                                     bool send) {
  const std::string what = op_name(send, tag, bytes, group_.who(peer));
  auto [work, finished] = data_internal::start_p2p(comm, options_.epoch, options_.rank, options_.world_size, peer,
                                                   bytes, "shm data plane: " + what);
  if (finished) return work;
  auto op = std::make_shared<Op>();
  op->send = send;
  op->peer = peer;
  op->tag = tag;
  op->data = static_cast<uint8_t*>(data);
  op->bytes = bytes;
  op->state = work->state;
  op->deadline = Clock::now() + options_.op_timeout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok() || stop_) {
      work->state->complete(aborted("shm data plane: " + what + ": the communicator is unusable: " +
                                    (error_.ok() ? std::string("stopped") : error_.to_string())));
      return work;
    }
    incoming_.push_back(std::move(op));
    pending_.fetch_add(1, std::memory_order_acq_rel);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  cv_.notify_all();
  bump(&wake_[options_.rank]);  // the thread may be waiting on its futex word
  return work;
}

bool P2pPlane::busy() const {
  if (pending_.load(std::memory_order_acquire) > 0) return true;
  for (int peer = 0; peer < options_.world_size; ++peer) {
    if (peer == options_.rank) continue;
    const Control& c = control(options_.rank, peer);
    if (c.posted.load(std::memory_order_acquire) != c.taken.load(std::memory_order_acquire)) return true;
  }
  return false;
}

void P2pPlane::fail_all(const Status& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = error;
  }
  cv_.notify_all();
  bump(&wake_[options_.rank]);
}

// Counted out before its Work completes: a caller woken by the completion
// that then leaves must find this rank idle (else its leaving would fail
// the group for a move that is done).
void P2pPlane::finish(OpPtr& op, const Status& status) {
  pending_.fetch_sub(1, std::memory_order_acq_rel);
  op->state->complete(status);
  op.reset();
}

void P2pPlane::complete_all(const Status& error) {
  for (auto& p : peers_) {
    for (auto* q : {&p.sends, &p.unposted, &p.posted})
      for (auto& op : *q) finish(op, error);
    p.sends.clear();
    p.unposted.clear();
    p.posted.clear();
    if (p.sending) finish(p.sending, error);
  }
}

void P2pPlane::run() {
  auto next_liveness = Clock::now() + kLivenessEvery;
  for (;;) {
    Status failed;
    bool stop;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stop_ || !incoming_.empty() || pending_.load(std::memory_order_acquire) > 0 || !error_.ok();
      });
      for (auto& op : incoming_) {
        Peer& p = peers_[static_cast<size_t>(op->peer)];
        (op->send ? p.sends : p.unposted).push_back(std::move(op));
      }
      incoming_.clear();
      failed = error_;
      stop = stop_;
    }
    if (!failed.ok() || stop) {
      // The thread is the one that touches the buffers: it lets them go here.
      complete_all(failed.ok() ? aborted("communicator destroyed") : failed);
      if (stop) return;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !incoming_.empty(); });  // posts after a failure complete at once
      continue;
    }
    const uint32_t seen = wake_[options_.rank].load(std::memory_order_acquire);
    bool progress = false;
    for (int peer = 0; peer < options_.world_size; ++peer) {
      if (peer == options_.rank) continue;
      Peer& p = peers_[static_cast<size_t>(peer)];
      progress |= serve_out(peer, p);
      progress |= serve_in(peer, p);
    }
    // The checks run between waits, and on a timer while bytes flow (a
    // stuck move beside a streaming one still meets its deadline).
    if ((!progress || Clock::now() >= next_liveness) && !watch(next_liveness)) continue;
    if (!progress && pending_.load(std::memory_order_acquire) > 0) futex_wait(&wake_[options_.rank], seen, kPoll);
  }
}

// This rank's sends to `peer`: takes the peer's next want once a send of its
// tag is queued, then writes its bytes into the free chunks.
bool P2pPlane::serve_out(int peer, Peer& p) {
  Control& c = control(options_.rank, peer);
  bool progress = false;
  if (!p.sending) {
    if (p.sends.empty()) return false;  // (the channel's pages stay untouched until this rank sends on it)
    const uint64_t taken = c.taken.load(std::memory_order_relaxed);  // this rank's own word
    const uint64_t posted = c.posted.load(std::memory_order_acquire);
    if (posted == taken) return false;
    if (posted - taken > kWants) {
      group_.fail(protocol_error("shm data plane: " + group_.who(peer) + " says it posted " + std::to_string(posted) +
                                 " receives from this rank, which took " + std::to_string(taken) +
                                 " (at most " + std::to_string(kWants) + " wait at once)"),
                  peer);
      return false;
    }
    const Want want = c.want[taken % kWants];  // copied once: the peer may rewrite it
    auto it = std::find_if(p.sends.begin(), p.sends.end(), [&](const OpPtr& op) { return op->tag == want.tag; });
    if (it == p.sends.end()) return false;  // not issued here yet
    if ((*it)->bytes != want.bytes) {
      std::string why = "shm data plane: ";
      why += op_name(true, (*it)->tag, (*it)->bytes, group_.who(peer));
      why += ": that rank receives ";
      why += std::to_string(want.bytes);
      why += " bytes under this tag (the ranks' moves differ)";
      group_.fail(protocol_error(why), peer);
      return false;
    }
    p.sending = std::move(*it);
    p.sends.erase(it);
    c.taken.store(taken + 1, std::memory_order_release);
    progress = true;
  }
  Op& op = *p.sending;
  while (op.done < op.bytes) {
    const uint64_t published = c.published.load(std::memory_order_relaxed);  // this rank's own word
    const uint64_t consumed = c.consumed.load(std::memory_order_acquire);
    if (consumed > published) {
      group_.fail(protocol_error("shm data plane: " + group_.who(peer) + " says it copied out " +
                                 std::to_string(consumed) + " chunks of the " + std::to_string(published) +
                                 " this rank wrote to it"),
                  peer);
      return false;
    }
    if (published - consumed >= static_cast<uint64_t>(kP2pChunks)) break;  // both chunks still the peer's
    const size_t len = std::min<size_t>(kP2pChunkBytes, op.bytes - op.done);
    const uint64_t slot = published % kP2pChunks;
    std::memcpy(chunk(options_.rank, peer, published), op.data + op.done, len);
    c.chunk_tag[slot] = op.tag;
    c.chunk_offset[slot] = op.done;
    c.chunk_len[slot] = len;
    c.published.store(published + 1, std::memory_order_release);
    op.done += len;
    bump(&wake_[peer]);
    progress = true;
  }
  if (op.done == op.bytes) finish(p.sending, Status());  // every byte in the channel: the buffer is free
  return progress;
}

// This rank's receives from `peer`: posts them as wants while the ring has
// room, and copies the peer's chunks out into the front one.
bool P2pPlane::serve_in(int peer, Peer& p) {
  Control& c = control(peer, options_.rank);
  bool progress = false;
  while (!p.unposted.empty()) {
    const uint64_t posted = c.posted.load(std::memory_order_relaxed);  // this rank's own word
    const uint64_t taken = c.taken.load(std::memory_order_acquire);
    if (taken > posted) {
      group_.fail(protocol_error("shm data plane: " + group_.who(peer) + " says it took " + std::to_string(taken) +
                                 " of the " + std::to_string(posted) + " receives this rank posted"),
                  peer);
      return false;
    }
    if (posted - taken >= kWants) break;
    const Op& op = *p.unposted.front();
    c.want[posted % kWants] = Want{op.tag, op.bytes};
    c.posted.store(posted + 1, std::memory_order_release);
    p.posted.push_back(std::move(p.unposted.front()));
    p.unposted.pop_front();
    bump(&wake_[peer]);
    progress = true;
  }
  while (!p.posted.empty()) {
    const uint64_t consumed = c.consumed.load(std::memory_order_relaxed);  // this rank's own word
    const uint64_t published = c.published.load(std::memory_order_acquire);
    if (published == consumed) break;
    Op& op = *p.posted.front();
    const uint64_t slot = consumed % kP2pChunks;
    const uint64_t tag = c.chunk_tag[slot], offset = c.chunk_offset[slot], len = c.chunk_len[slot];
    const size_t want_len = std::min<size_t>(kP2pChunkBytes, op.bytes - op.done);
    if (published - consumed > static_cast<uint64_t>(kP2pChunks) || tag != op.tag || offset != op.done ||
        len != want_len) {
      std::string why = "shm data plane: ";
      why += op_name(false, op.tag, op.bytes, group_.who(peer));
      why += ": chunk ";
      why += std::to_string(consumed);
      why += " carries ";
      why += std::to_string(len);
      why += " bytes at ";
      why += std::to_string(offset);
      why += " of tag ";
      why += std::to_string(tag);
      why += ", this rank expected ";
      why += std::to_string(want_len);
      why += " bytes at ";
      why += std::to_string(op.done);
      if (published - consumed > static_cast<uint64_t>(kP2pChunks)) {
        why += " (and ";
        why += std::to_string(published - consumed);
        why += " chunks published at once)";
      }
      group_.fail(protocol_error(why), peer);
      return false;
    }
    std::memcpy(op.data + op.done, chunk(peer, options_.rank, consumed), len);
    op.done += len;
    c.consumed.store(consumed + 1, std::memory_order_release);
    bump(&wake_[peer]);
    progress = true;
    if (op.done == op.bytes) {
      finish(p.posted.front(), Status());
      p.posted.pop_front();
    }
  }
  return progress;
}

// Between waits, and every kLivenessEvery while bytes flow: the group's
// failure; every 100 ms also each operation's op_timeout and the peers whose
// processes this rank can see (the root sees every reader's, so a reader
// that dies while two others wait on it is named by the root's plane as
// long as the root has a move pending). Returns false when the group failed
// (the thread then completes everything with that failure).
bool P2pPlane::watch(std::chrono::steady_clock::time_point& next_liveness) {
  if (!group_.failure().ok()) return false;  // the communicator handed the failure to fail_all
  const auto now = Clock::now();
  if (now < next_liveness) return true;
  next_liveness = now + kLivenessEvery;
  for (int peer = 0; peer < options_.world_size; ++peer) {
    if (peer == options_.rank) continue;
    Peer& p = peers_[static_cast<size_t>(peer)];
    const Op* late = p.sending && now >= p.sending->deadline ? p.sending.get() : nullptr;
    for (const auto* q : {&p.posted, &p.sends, &p.unposted})
      for (const auto& op : *q)
        if (!late && now >= op->deadline) late = op.get();
    if (late) {
      group_.fail(timeout_error("shm data plane: " + op_name(late->send, late->tag, late->bytes, group_.who(peer)) +
                                " did not finish within op_timeout"),
                  options_.rank);
      return false;
    }
  }
  // A dead peer is at fault only for what it still owes this rank: a send
  // to it nobody will take, or a receive from it whose bytes are not in the
  // channel (a sender that finished and exited left its last chunks there).
  for (int peer = 0; peer < options_.world_size; ++peer) {
    if (peer == options_.rank) continue;
    Peer& p = peers_[static_cast<size_t>(peer)];
    const bool sending = p.sending || !p.sends.empty();
    bool receiving = !p.posted.empty() || !p.unposted.empty();
    if (receiving && !sending) {
      const Control& c = control(peer, options_.rank);
      receiving = c.published.load(std::memory_order_acquire) == c.consumed.load(std::memory_order_relaxed);
    }
    if ((sending || receiving) && !group_.alive(peer)) {
      group_.fail(peer_lost("shm data plane: " + group_.who(peer) + " is gone (its process exited)"), peer);
      return false;
    }
  }
  return true;
}

}  // namespace paramcast::shm_backend
