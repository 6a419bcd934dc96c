// ShedWatch: which children this rank sheds (publisher.on_slow_member: shed).
// Internal to data/gloo.
//
// A child's link is judged by the rate it sustained while it had bytes
// waiting (its busy time, as Flight counts it, plus the wait in progress), so
// a link idle between buckets is not slow, and a sibling's pace does not
// count. Each time the child accumulates `window` more busy time, its rate
// over that stretch is compared with the floor: below it, the child is shed.
// Only a leaf of the broadcast tree is shed (the communicator asks only for
// leaves): its failure takes nobody else with it, and placement
// (wanted_members) puts slow members at leaves.
//
// What shedding does is the communicator's (tree_schedule.cc, abort.cc):
// nothing more posted to the child (Flight::mark_shed), in this broadcast
// or any later one; what it was owed drains, or is dropped if its
// connection ends first (Flight::drop); a kShed notice to it on the
// sentinel slot; LinkStats::shed for the publisher's verdict.
//
// Thread-safety: none; the communicator guards it with its lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace paramcast::gloo_backend {

class ShedWatch {
 public:
  using Clock = std::chrono::steady_clock;

  ShedWatch() = default;
  ShedWatch(int world, uint64_t floor_bytes_per_s, Clock::duration window)
      : floor_(static_cast<double>(floor_bytes_per_s)), window_(window), marks_(static_cast<size_t>(world)) {}

  bool enabled() const { return floor_ > 0 && window_.count() > 0; }
  bool shed(int rank) const { return marks_.at(static_cast<size_t>(rank)).shed; }

  struct Verdict {
    bool shed = false;
    double rate = 0;            // bytes/s over the stretch judged
    Clock::duration over{0};    // that stretch of busy time
  };
  // `rank`'s link so far: bytes it took and its busy time, cumulative.
  Verdict observe(int rank, uint64_t bytes, Clock::duration busy) {
    Mark& m = marks_.at(static_cast<size_t>(rank));
    Verdict v;
    if (!enabled() || m.shed || busy - m.busy < window_) return v;
    v.over = busy - m.busy;
    v.rate = static_cast<double>(bytes - m.bytes) / std::chrono::duration<double>(v.over).count();
    m.busy = busy;
    m.bytes = bytes;
    v.shed = m.shed = v.rate < floor_;
    return v;
  }

  double floor() const { return floor_; }
  Clock::duration window() const { return window_; }

 private:
  struct Mark {
    Clock::duration busy{0};
    uint64_t bytes = 0;
    bool shed = false;
  };
  double floor_ = 0;
  Clock::duration window_{0};
  std::vector<Mark> marks_;
};

}  // namespace paramcast::gloo_backend
