// A control loop's own pauses are not its peer's silence. A loop that did
// not run for a while (its process descheduled on an overloaded machine,
// swapped out, stopped in a debugger, a VM paused) wakes up with its peers'
// heartbeats still in the kernel and in ZeroMQ's queues; judged at once,
// every peer would look silent for as long as the loop was away, and a
// publisher would expel its whole group for its own stall. The loop asks
// `away` at each turn and adds what it returns to each peer's last-heard
// time: silence counts only while the loop was listening. A peer that is
// really gone is still found, as late as the pause was long.
//
// Time the loop's thread spent running (its CPU time: handling a large or
// a hostile message) is no pause: a member that keeps the loop busy cannot
// keep a dead peer from being found.
#pragma once

#include <time.h>

#include <chrono>

namespace paramcast::control {

// The calling thread's CPU time.
inline std::chrono::nanoseconds thread_cpu_time() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

class LoopPause {
 public:
  using Clock = std::chrono::steady_clock;

  // `turn` is how often the loop turns when it runs (its poll timeout); a
  // gap between turns beyond `turn` plus `slack`, less the time the thread
  // ran, is a pause.
  LoopPause(Clock::duration turn, Clock::duration slack, Clock::time_point start = Clock::now(),
            std::chrono::nanoseconds cpu = thread_cpu_time())
      : limit_(turn + slack), last_(start), last_cpu_(cpu) {}

  // How long the loop was away since its last turn, beyond the turn it
  // expects and the time it ran; zero when it turned on time.
  Clock::duration away(Clock::time_point now, std::chrono::nanoseconds cpu = thread_cpu_time()) {
    const auto idle = (now - last_) - std::chrono::duration_cast<Clock::duration>(cpu - last_cpu_);
    last_ = now;
    last_cpu_ = cpu;
    return idle > limit_ ? idle - limit_ : Clock::duration::zero();
  }

 private:
  Clock::duration limit_;
  Clock::time_point last_;
  std::chrono::nanoseconds last_cpu_;
};

// `heard` moved on by `paused`, never past `now`.
inline LoopPause::Clock::time_point excuse(LoopPause::Clock::time_point heard, LoopPause::Clock::duration paused,
                                           LoopPause::Clock::time_point now) {
  return heard + paused < now ? heard + paused : now;
}

}  // namespace paramcast::control
