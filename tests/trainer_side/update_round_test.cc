// UpdateRound: what it takes from members' Applied link figures, which come
// from the network (docs/protocol.md "One update"): ranks of the group only,
// one entry per rank and member, bytes up to the plan's, a list no longer
// than the group, and no figure for a rank two members claim.
#include "trainer_side/update_round.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

namespace paramcast {
namespace {

constexpr uint64_t kEpoch = 3, kVersion = 7, kTotal = 1000;

struct Figure {
  uint32_t rank;
  uint64_t bytes;
  uint64_t busy_us;
};

// Records an Applied(ok) of this round from `id` carrying `links`.
bool applied(UpdateRound& round, const std::string& id, const std::vector<Figure>& links) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<proto::Envelope>();
  env.setEpoch(kEpoch);
  auto a = env.initBody().initApplied();
  a.setVersion(kVersion);
  a.setOk(true);
  a.setBytes(kTotal);
  auto list = a.initLinks(static_cast<unsigned>(links.size()));
  for (size_t i = 0; i < links.size(); ++i) {
    list[static_cast<unsigned>(i)].setRank(links[i].rank);
    list[static_cast<unsigned>(i)].setBytes(links[i].bytes);
    list[static_cast<unsigned>(i)].setBusyUs(links[i].busy_us);
  }
  return round.record(id, env.asReader());
}

class UpdateRoundTest : public ::testing::Test {
 protected:
  void SetUp() override { round_.begin(kEpoch, kVersion, {"a", "b", "c", "d"}, kTotal); }  // ranks 1..4
  UpdateRound round_;
};

TEST_F(UpdateRoundTest, TakesEachChildsFigureWithItsParent) {
  ASSERT_TRUE(applied(round_, "a", {{3, 1000, 2000}, {4, 500, 10}}));
  ASSERT_TRUE(applied(round_, "b", {}));
  const auto links = round_.reported_links();
  ASSERT_EQ(links.size(), 2u);
  EXPECT_EQ(links.at(3).parent, 1);
  EXPECT_EQ(links.at(3).link.bytes_sent, 1000u);
  EXPECT_EQ(links.at(3).link.send_busy, std::chrono::microseconds(2000));
  EXPECT_EQ(links.at(4).link.bytes_sent, 500u);
  EXPECT_EQ(links.at(4).link.send_busy, std::chrono::microseconds(10));  // microseconds: a fast link keeps its figure
}

TEST_F(UpdateRoundTest, HostileFiguresAreBoundedOrDropped) {
  // Rank 0 (the publisher), ranks past the group, a repeated rank, and bytes
  // beyond the plan's.
  ASSERT_TRUE(applied(round_, "b", {{0, 10, 10}, {99999, 10, 10}, {3, ~0ull, ~0ull}, {3, 1, 1}}));
  const auto links = round_.reported_links();
  ASSERT_EQ(links.size(), 1u);
  EXPECT_EQ(links.at(3).parent, 2);
  EXPECT_EQ(links.at(3).link.bytes_sent, kTotal);                               // not 2^64 - 1
  EXPECT_LE(links.at(3).link.send_busy, std::chrono::microseconds(1ull << 40));  // bounded
}

TEST_F(UpdateRoundTest, AListLongerThanTheGroupIsIgnoredWhole) {
  ASSERT_TRUE(applied(round_, "a", {{2, 1, 1}, {3, 1, 1}, {4, 1, 1}, {2, 1, 1}, {3, 1, 1}}));
  EXPECT_TRUE(round_.reported_links().empty());
}

TEST_F(UpdateRoundTest, ARankTwoMembersClaimGetsNoFigure) {
  ASSERT_TRUE(applied(round_, "a", {{3, 100, 100}, {4, 100, 100}}));
  ASSERT_TRUE(applied(round_, "b", {{3, 100, 1}}));  // b says rank 3's link is 100x faster
  const auto links = round_.reported_links();
  EXPECT_EQ(links.count(3), 0u);
  EXPECT_EQ(links.at(4).parent, 1);
}

TEST_F(UpdateRoundTest, FiguresOfAnotherVersionOrEpochAreNotTaken) {
  UpdateRound other;
  other.begin(kEpoch + 1, kVersion, {"a", "b"}, kTotal);
  EXPECT_FALSE(applied(other, "a", {{2, 10, 10}}));
  EXPECT_TRUE(other.reported_links().empty());
}

// A heartbeat whose Applied marker is at this version names a lost Applied,
// unless the marker was already there when the round began: an earlier
// attempt at the same version (a dense retry of a refused delta) left it.
TEST(UpdateRoundMarkersTest, AMarkerLeftByAnEarlierAttemptAtTheVersionIsNoEvidence) {
  control::Member hb;
  hb.applied_version = kVersion;
  hb.commit_version = kVersion;
  hb.ack_seq = 10;
  UpdateRound fresh;
  fresh.begin(kEpoch, kVersion, {"a"}, kTotal);
  fresh.sent_plan(1);
  fresh.sent_commit(1);
  EXPECT_NE(fresh.observe("a", hb).find("reported v" + std::to_string(kVersion) + " done but its Applied never arrived"),
            std::string::npos);
  UpdateRound retry;
  retry.begin(kEpoch, kVersion, {"a"}, kTotal, {{"a", UpdateRound::Markers{kVersion, kVersion, kVersion, kVersion}}});
  retry.sent_plan(1);
  retry.sent_commit(1);
  EXPECT_EQ(retry.observe("a", hb), "");
}

// A PlanReject listing 1,000 mismatches costs the publisher the first 64
// (the rest counted), and the failure names the first four and counts the
// rest, instead of a message of every one.
TEST(UpdateRoundRejectTest, AHugeRefusalIsKeptInPartAndCounted) {
  UpdateRound round;
  round.begin(kEpoch, kVersion, {"a"}, kTotal);
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<proto::Envelope>();
  env.setEpoch(kEpoch);
  auto pr = env.initBody().initPlanReject();
  pr.setVersion(kVersion);
  auto list = pr.initMismatches(1000);
  for (unsigned i = 0; i < 1000; ++i) {
    std::string name = "t";
    name += std::to_string(i);
    list[i].setName(name);
    list[i].setExpected("x");
    list[i].setGot("y");
  }
  ASSERT_TRUE(round.record("a", env.asReader()));
  Code code;
  const auto out = round.plan_outcomes([](const std::string&) { return true; }, "", code);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(code, Code::kRejected);
  EXPECT_EQ(out[0].mismatches.size(), UpdateRound::kKeptMismatches);
  const std::string& text = out[0].status.message();
  EXPECT_NE(text.find("'t3'"), std::string::npos) << text;
  EXPECT_EQ(text.find("'t4'"), std::string::npos) << text;
  EXPECT_NE(text.find("; and 996 more"), std::string::npos) << text;
  EXPECT_LT(text.size(), 400u) << text;
}

}  // namespace
}  // namespace paramcast
