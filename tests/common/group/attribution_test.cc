// attribute() (common/group/attribution.h): the member at fault named from
// every rank's evidence, never the members that tried to reach it.
#include <gtest/gtest.h>

#include "common/group/attribution.h"

namespace paramcast::group {
namespace {

std::vector<int> blamed(const Verdict& v) {
  std::vector<int> out;
  for (const auto& b : v.blamed) out.push_back(b.rank);
  return out;
}

const std::vector<std::string> kNames = {"publisher", "worker-1", "worker-2", "worker-3",
                                         "worker-4",  "worker-5", "worker-6", "worker-7"};

// Worker-5's data port is blocked: every rank failed with it, it with all.
TEST(AttributionTest, MemberEveryoneFailedWithIsNamedNotTheOthers) {
  std::map<int, RankReport> r;
  for (int k = 0; k < 8; ++k)
    if (k != 5) r[k].unreachable = {5};
  r[5].unreachable = {0, 1, 2, 3, 4, 6, 7};
  const auto v = attribute(8, r);
  EXPECT_EQ(blamed(v), std::vector<int>{5});
  EXPECT_TRUE(v.unresolved.empty());
  EXPECT_EQ(describe(v.blamed[0], kNames),
            "unreachable from publisher, worker-1, worker-2, worker-3, worker-4, worker-6, worker-7 on its data "
            "port");
}

// The same without the publisher's word (it gave up before its own connect
// failed): the members' evidence alone names worker-5.
TEST(AttributionTest, MembersEvidenceAloneIsEnough) {
  std::map<int, RankReport> r;
  r[1].unreachable = {5};
  r[6].unreachable = {5};
  r[7].no_address = {5};
  const auto v = attribute(8, r);
  ASSERT_EQ(blamed(v), std::vector<int>{5});
  EXPECT_EQ(describe(v.blamed[0], kNames),
            "unreachable from worker-1, worker-6 on its data port; its rendezvous address never reached worker-7");
}

TEST(AttributionTest, ThePublishersWordAloneIsEnough) {
  std::map<int, RankReport> r;
  r[0].no_address = {3};
  EXPECT_EQ(blamed(attribute(4, r)), std::vector<int>{3});
}

// A saboteur that claims honest peers are unreachable is on every edge it
// claims: it is the one named.
TEST(AttributionTest, AMemberThatBlamesOthersIsNamedItself) {
  std::map<int, RankReport> r;
  r[2].unreachable = {1, 3};
  const auto v = attribute(4, r);
  ASSERT_EQ(blamed(v), std::vector<int>{2});
  EXPECT_EQ(describe(v.blamed[0], kNames), "it could not reach worker-1, worker-3");
}

// One failed pair between two members: either may be at fault, so neither is
// blamed; the pair is listed.
TEST(AttributionTest, ASinglePairBetweenMembersIsUnresolved) {
  std::map<int, RankReport> r;
  r[1].unreachable = {2};
  r[2].unreachable = {1};
  const auto v = attribute(4, r);
  EXPECT_TRUE(v.blamed.empty());
  ASSERT_EQ(v.unresolved.size(), 1u);
  EXPECT_EQ(v.unresolved[0], std::make_pair(1, 2));
}

// Two culprits at once, and edges between them settled by either.
TEST(AttributionTest, TwoCulprits) {
  std::map<int, RankReport> r;
  for (int k : {0, 1, 2}) r[k].unreachable = {3, 4};
  r[3].unreachable = {0, 1, 2, 4};
  r[4].unreachable = {0, 1, 2, 3};
  const auto v = attribute(5, r);
  EXPECT_EQ(blamed(v), (std::vector<int>{3, 4}));
  EXPECT_TRUE(v.unresolved.empty());
}

// Hostile ranks in a report (out of range, self) are ignored.
TEST(AttributionTest, OutOfRangeAndSelfClaimsIgnored) {
  std::map<int, RankReport> r;
  r[1].unreachable = {1, -4, 99, 1 << 30};
  r[9].unreachable = {2};
  const auto v = attribute(3, r);
  EXPECT_TRUE(v.blamed.empty());
  EXPECT_TRUE(v.unresolved.empty());
}

// The publisher that reaches nobody (its own link is down) blames every
// member: the caller must not act on that alone (group_host.h).
TEST(AttributionTest, PublisherReachingNobodyBlamesAll) {
  std::map<int, RankReport> r;
  r[0].unreachable = {1, 2, 3};
  for (int k : {1, 2, 3}) r[k].unreachable = {0};
  EXPECT_EQ(blamed(attribute(4, r)), (std::vector<int>{1, 2, 3}));
}

}  // namespace
}  // namespace paramcast::group
