// Flight: the send side of the stream of broadcasts in progress on this
// rank. Internal to data/gloo.
//
// Broadcasts move in chunks, one after the other as one stream (schedule.h);
// each chunk goes to every child of this rank in the tree, at most `window`
// chunks ahead of what a child has taken. The flight counts, per child, the
// chunks posted (tagged with their broadcast) and taken, and from that says:
//  - whether another chunk may be posted (the window),
//  - which child the broadcast waits for, and since when it took nothing
//    (the stall check: no progress on that link for stall_timeout),
//  - what each link carried and for how long it had work (its rate).
// Gloo completes the sends to one peer in the order they were posted (the
// child posts its receives in stream order), so a completion from `rank` is
// always that child's oldest pending chunk.
//
// Thread-safety: none; the communicator guards it with its lock.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace paramcast::gloo_backend {

class Flight {
 public:
  using Clock = std::chrono::steady_clock;

  struct Child {
    int rank = -1;
    struct Chunk {
      uint64_t bytes;
      uint32_t op;  // the broadcast it belongs to
    };
    std::deque<Chunk> pending;        // posted, untaken chunks, oldest first
    uint64_t taken_bytes = 0;         // of the stream
    size_t taken_chunks = 0;
    Clock::time_point last_progress;  // last chunk taken, or when it got work while idle
    bool shed = false;                // ShedWatch: owed what is pending, nothing more
    uint64_t pending_bytes = 0;       // of the chunks in `pending`
  };

  Flight() = default;
  Flight(const std::vector<int>& children, Clock::time_point now) {
    for (int c : children) children_.push_back(Child{c, {}, 0, 0, now});
  }

  // No child not shed is owed `window` bytes or more: another chunk may go.
  bool window_open(uint64_t window) const {
    for (const auto& c : children_)
      if (!c.shed && c.pending_bytes >= window) return false;
    return true;
  }

  // One chunk of `bytes` of broadcast `op` posted to every child not shed;
  // returns to how many.
  size_t posted(uint64_t bytes, Clock::time_point now, uint32_t op = 0) {
    size_t n = 0;
    for (auto& c : children_) {
      if (c.shed) continue;
      if (c.pending.empty()) c.last_progress = now;  // the link's clock starts with its work
      c.pending.push_back({bytes, op});
      c.pending_bytes += bytes;
      ++pending_;
      ++n;
    }
    return n;
  }

  // A send to `rank` completed; returns its bytes and the time that link had
  // work since its previous progress (0 bytes if `rank` had nothing pending).
  struct Taken {
    uint64_t bytes = 0;
    Clock::duration busy{0};
    uint32_t op = 0;
  };
  Taken taken(int rank, Clock::time_point now) {
    for (auto& c : children_) {
      if (c.rank != rank || c.pending.empty()) continue;
      Taken t{c.pending.front().bytes, now - c.last_progress, c.pending.front().op};
      c.pending.pop_front();
      c.pending_bytes -= t.bytes;
      c.taken_bytes += t.bytes;
      ++c.taken_chunks;
      c.last_progress = now;
      --pending_;
      return t;
    }
    return Taken{};
  }

  size_t pending() const { return pending_; }
  // The broadcast of `rank`'s oldest pending chunk; false if none is pending.
  bool oldest(int rank, uint32_t* op) const {
    const Child* c = child(rank);
    if (!c || c->pending.empty()) return false;
    *op = c->pending.front().op;
    return true;
  }
  const std::vector<Child>& children() const { return children_; }
  // The child is shed: nothing more is posted to it, and the window no
  // longer waits for it; what it was already owed still drains (pending()
  // and the stall check count it), so the broadcast's memory is released
  // only once Gloo is done with it.
  void mark_shed(int rank) {
    for (auto& c : children_)
      if (c.rank == rank) c.shed = true;
  }
  // A shed child whose connection then ended (it learnt it was shed ahead of
  // chunks it had not asked for yet): what it was owed is dropped, Gloo
  // having let go of those sends with the pair. Returns the dropped chunks.
  std::deque<Child::Chunk> drop(int rank) {
    for (auto& c : children_) {
      if (c.rank != rank) continue;
      std::deque<Child::Chunk> out;
      out.swap(c.pending);
      pending_ -= out.size();
      c.pending_bytes = 0;
      return out;
    }
    return {};
  }
  bool is_shed(int rank) const {
    const Child* c = child(rank);
    return c && c->shed;
  }
  // Children not shed.
  bool any_active() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return !c.shed; });
  }
  const Child* child(int rank) const {
    for (const auto& c : children_)
      if (c.rank == rank) return &c;
    return nullptr;
  }

  // Bytes every child not shed has taken (0 when there is none).
  uint64_t min_taken_bytes() const {
    uint64_t m = UINT64_MAX;
    for (const auto& c : children_)
      if (!c.shed) m = std::min(m, c.taken_bytes);
    return m == UINT64_MAX ? 0 : m;
  }

  // The child with work whose link has gone longest without progress; null
  // when no send is pending.
  const Child* slowest() const {
    const Child* worst = nullptr;
    for (const auto& c : children_)
      if (!c.pending.empty() && (!worst || c.last_progress < worst->last_progress)) worst = &c;
    return worst;
  }

 private:
  std::vector<Child> children_;
  size_t pending_ = 0;
};

}  // namespace paramcast::gloo_backend
