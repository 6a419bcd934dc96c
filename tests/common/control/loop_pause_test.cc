// LoopPause: a control loop's own pause is told apart from its turns.
#include "common/control/loop_pause.h"

#include <gtest/gtest.h>

namespace paramcast::control {
namespace {

using Ms = std::chrono::milliseconds;

TEST(LoopPauseTest, TurnsOnTimeAreNoPause) {
  const auto t0 = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  LoopPause p(Ms(25), Ms(100), t0);
  EXPECT_EQ(p.away(t0 + Ms(25)), Ms(0));
  EXPECT_EQ(p.away(t0 + Ms(150)), Ms(0));  // 125 ms: the turn plus its slack, not beyond
}

TEST(LoopPauseTest, AGapBeyondTurnAndSlackIsAPauseOfItsExcess) {
  const auto t0 = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  LoopPause p(Ms(25), Ms(100), t0);
  EXPECT_EQ(p.away(t0 + Ms(3125)), Ms(3000));
  EXPECT_EQ(p.away(t0 + Ms(3150)), Ms(0));  // counted once: the next turn is on time again
}

TEST(LoopPauseTest, AnExcusedPeerIsNeverHeardAfterNow) {
  const auto now = LoopPause::Clock::time_point{} + std::chrono::hours(1);
  EXPECT_EQ(excuse(now - Ms(4000), Ms(3000), now), now - Ms(1000));
  EXPECT_EQ(excuse(now - Ms(500), Ms(3000), now), now);
}

}  // namespace
}  // namespace paramcast::control
