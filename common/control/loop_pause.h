// A control loop's own pauses are not its peer's silence. A loop that did
// not run for a while (its process descheduled on an overloaded machine,
// swapped out, stopped in a debugger, a VM paused) wakes up with its peers'
// heartbeats still in the kernel and in ZeroMQ's queues; judged at once,
// every peer would look silent for as long as the loop was away, and a
// publisher would expel its whole group for its own stall. The loop asks
// `away` at each turn and adds what it returns to each peer's last-heard
// time: silence counts only while the loop was listening. A peer that is
// really gone is still found, as late as the pause was long.
#pragma once

#include <chrono>

namespace paramcast::control {

class LoopPause {
 public:
  using Clock = std::chrono::steady_clock;

  // `turn` is how often the loop turns when it runs (its poll timeout); a
  // gap between turns beyond `turn` plus `slack` is a pause.
  LoopPause(Clock::duration turn, Clock::duration slack, Clock::time_point start = Clock::now())
      : limit_(turn + slack), last_(start) {}

  // How long the loop was away since its last turn, beyond the turn it
  // expects; zero when it turned on time.
  Clock::duration away(Clock::time_point now) {
    const auto gap = now - last_;
    last_ = now;
    return gap > limit_ ? gap - limit_ : Clock::duration::zero();
  }

 private:
  Clock::duration limit_;
  Clock::time_point last_;
};

// `heard` moved on by `paused`, never past `now`.
inline LoopPause::Clock::time_point excuse(LoopPause::Clock::time_point heard, LoopPause::Clock::duration paused,
                                           LoopPause::Clock::time_point now) {
  return heard + paused < now ? heard + paused : now;
}

}  // namespace paramcast::control
