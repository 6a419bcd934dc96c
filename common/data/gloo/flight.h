// Flight: the send side of one broadcast in progress on this rank. Internal
// to data/gloo.
//
// The broadcast moves in chunks; each chunk goes to every child of this rank
// in the tree, at most `window` chunks ahead of what a child has taken. The
// flight counts, per child, the chunks posted and taken, and from that says:
//  - whether another chunk may be posted (the window),
//  - which child the broadcast waits for, and since when it took nothing
//    (the stall check: no progress on that link for stall_timeout),
//  - what each link carried and for how long it had work (its rate).
// Gloo completes the sends to one peer in the order they were posted, so a
// completion from `rank` is always that child's oldest pending chunk.
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
    std::deque<uint64_t> pending;     // lengths of posted, untaken chunks, oldest first
    uint64_t taken_bytes = 0;         // of this broadcast
    size_t taken_chunks = 0;
    Clock::time_point last_progress;  // last chunk taken, or when it got work while idle
    bool shed = false;                // ShedWatch: owed what is pending, nothing more
  };

  Flight() = default;
  Flight(const std::vector<int>& children, Clock::time_point now) {
    for (int c : children) children_.push_back(Child{c, {}, 0, 0, now});
  }

  bool window_open(size_t window) const {
    for (const auto& c : children_)
      if (!c.shed && c.pending.size() >= window) return false;
    return true;
  }

  // One chunk of `bytes` posted to every child not shed.
  void posted(uint64_t bytes, Clock::time_point now) {
    for (auto& c : children_) {
      if (c.shed) continue;
      if (c.pending.empty()) c.last_progress = now;  // the link's clock starts with its work
      c.pending.push_back(bytes);
      ++pending_;
    }
  }

  // A send to `rank` completed; returns its bytes and the time that link had
  // work since its previous progress (0 bytes if `rank` had nothing pending).
  struct Taken {
    uint64_t bytes = 0;
    Clock::duration busy{0};
  };
  Taken taken(int rank, Clock::time_point now) {
    for (auto& c : children_) {
      if (c.rank != rank || c.pending.empty()) continue;
      Taken t{c.pending.front(), now - c.last_progress};
      c.pending.pop_front();
      c.taken_bytes += t.bytes;
      ++c.taken_chunks;
      c.last_progress = now;
      --pending_;
      return t;
    }
    return Taken{};
  }

  size_t pending() const { return pending_; }
  // The child is shed: nothing more is posted to it, and the window no
  // longer waits for it; what it was already owed still drains (pending()
  // and the stall check count it), so the broadcast's memory is released
  // only once Gloo is done with it.
  void mark_shed(int rank) {
    for (auto& c : children_)
      if (c.rank == rank) c.shed = true;
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

  // Chunks every child not shed has taken (0 when there is none).
  size_t min_taken_chunks() const {
    size_t m = SIZE_MAX;
    for (const auto& c : children_)
      if (!c.shed) m = std::min(m, c.taken_chunks);
    return m == SIZE_MAX ? 0 : m;
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
