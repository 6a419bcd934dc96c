// LoopPause: a control loop's own pause is told apart from its turns.
#include "common/control/loop_pause.h"

#include <gtest/gtest.h>

namespace paramcast::control {
namespace {

using Ms = std::chrono::milliseconds;

TEST(LoopPauseTest, TurnsOnTimeAreNoPause) {
  const auto t0 = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  LoopPause p(Ms(25), Ms(100), t0, Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(25), Ms(0)), Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(150), Ms(0)), Ms(0));  // 125 ms: the turn plus its slack, not beyond
}

TEST(LoopPauseTest, AGapBeyondTurnAndSlackIsAPauseOfItsExcess) {
  const auto t0 = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  LoopPause p(Ms(25), Ms(100), t0, Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(3125), Ms(0)), Ms(3000));
  EXPECT_EQ(p.away(t0 + Ms(3150), Ms(0)), Ms(0));  // counted once: the next turn is on time again
}

// A turn that took 3 s because the loop's thread ran (a hostile message
// that takes long to handle) is no pause: a busy loop must not keep a dead
// peer alive.
TEST(LoopPauseTest, TimeTheThreadRanIsNoPause) {
  const auto t0 = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  LoopPause p(Ms(25), Ms(100), t0, Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(3125), Ms(3000)), Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(6250), Ms(4000)), Ms(2000));  // ran 1 s of these 3.1 s: the rest was away
}

TEST(LoopPauseTest, ThreadCpuTimeGrowsWhileTheThreadRuns) {
  const auto before = thread_cpu_time();
  volatile uint64_t x = 0;
  for (int i = 0; i < 20000000; ++i) x = x + static_cast<uint64_t>(i);
  EXPECT_GT(thread_cpu_time(), before);
}

TEST(LoopPauseTest, AnExcusedPeerIsNeverHeardAfterNow) {
  const auto now = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  EXPECT_EQ(excuse(now - Ms(4000), Ms(3000), now), now - Ms(1000));
  EXPECT_EQ(excuse(now - Ms(500), Ms(3000), now), now);
}

}  // namespace
}  // namespace paramcast::control
