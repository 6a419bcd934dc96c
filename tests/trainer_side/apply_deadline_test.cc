// publisher.apply_timeout: auto (trainer_side/apply_deadline.h): the bound
// from a member's own Applied times and its peers' in this update.
#include "trainer_side/apply_deadline.h"

#include <gtest/gtest.h>

namespace paramcast {
namespace {

using std::chrono::milliseconds;

// Its first update: the ceiling, however fast its peers were (an engine of
// another kind may apply 100x slower than they do, honestly).
TEST(AutoApplyBoundTest, AMembersFirstApplyWaitsTheCeiling) {
  for (auto peers : {std::optional<milliseconds>{}, std::optional<milliseconds>{milliseconds(120)}}) {
    const ApplyBound b = auto_apply_bound(std::nullopt, peers);
    EXPECT_EQ(b.bound, ApplyRule::kCeiling);
    EXPECT_NE(b.why.find("the ceiling: no Applied of this member yet"), std::string::npos) << b.why;
  }
}

TEST(AutoApplyBoundTest, FastPeersAndAFastRecordGiveTheFloor) {
  const ApplyBound b = auto_apply_bound(milliseconds(40), milliseconds(120));
  EXPECT_EQ(b.bound, ApplyRule::kFloor);
  EXPECT_EQ(b.why, "auto: 15.000 s, the floor; 8 x the slowest Applied of this update (120.000 ms)");
}

TEST(AutoApplyBoundTest, AMemberSlowerThanItsPeersHasItsOwnRecordTimesTheFactor) {
  const ApplyBound b = auto_apply_bound(milliseconds(5000), milliseconds(100));
  EXPECT_EQ(b.bound, milliseconds(40000));
  EXPECT_EQ(b.why, "auto: 40.000 s, 8 x its own slowest Applied of its last 8 updates (5.000 s)");
}

TEST(AutoApplyBoundTest, SlowPeersRaiseTheBoundUpToTheCeiling) {
  EXPECT_EQ(auto_apply_bound(milliseconds(10), milliseconds(3000)).bound, milliseconds(24000));
  const ApplyBound b = auto_apply_bound(milliseconds(10), milliseconds(9000));
  EXPECT_EQ(b.bound, ApplyRule::kCeiling);
  EXPECT_NE(b.why.find(", the ceiling; 8 x the slowest Applied of this update (9.000 s)"), std::string::npos) << b.why;
}

TEST(ApplyHistoryTest, KeepsTheLastUpdatesOfEachMemberAndForgetsOneThatLeft) {
  ApplyHistory h;
  EXPECT_FALSE(h.slowest("worker-1"));
  h.record("worker-1", milliseconds(900));
  for (size_t i = 0; i < ApplyRule::kHistory; ++i) h.record("worker-1", milliseconds(100 + i));
  EXPECT_EQ(h.slowest("worker-1"), milliseconds(100 + ApplyRule::kHistory - 1)) << "900 ms fell out of the window";
  h.record("worker-2", milliseconds(50));
  h.forget("worker-1");
  EXPECT_FALSE(h.slowest("worker-1"));
  EXPECT_EQ(h.slowest("worker-2"), milliseconds(50));
}

}  // namespace
}  // namespace paramcast
