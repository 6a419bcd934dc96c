// attribute() (common/group/attribution.h): the member at fault named from
// every rank's evidence, never the members that tried to reach it.
#include <gtest/gtest.h>

#include "common/group/attribution.h"

#include <set>

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

// One failed pair between two members that every other rank reaches:
// either may be at fault, so neither is blamed; the pair is listed, and the
// next formation leaves one of them out, the other at the next turn.
TEST(AttributionTest, ASinglePairBetweenMembersIsUnresolvedAndTheyTakeTurns) {
  std::map<int, RankReport> r;
  r[1].unreachable = {2};
  r[2].unreachable = {1};
  const auto v = attribute(4, r, {0, 1, 2, 3});
  EXPECT_TRUE(v.blamed.empty());
  ASSERT_EQ(v.unresolved.size(), 1u);
  EXPECT_EQ(v.unresolved[0], std::make_pair(1, 2));
  EXPECT_EQ(v.left_out, std::vector<int>{2});
  EXPECT_EQ(attribute(4, r, {0, 1, 2, 3}, 1).left_out, std::vector<int>{1});
}

// Two members with valid identities say they cannot reach worker-1, which
// the publisher and the other members reach: nobody is named (two against
// four), worker-1 stays in, and the two accusers are the suspects left out.
TEST(AttributionTest, TwoColludersFramingAMemberAreLeftOutNotTheMember) {
  std::map<int, RankReport> r;
  r[4].unreachable = {1};
  r[5].unreachable = {1};
  for (uint64_t turn : {0u, 1u}) {
    const auto v = attribute(6, r, {0, 1, 2, 3, 4, 5}, turn);
    EXPECT_TRUE(v.blamed.empty());
    EXPECT_EQ(v.left_out, (std::vector<int>{4, 5})) << "turn " << turn;
    ASSERT_EQ(v.accusers.size(), 1u);
    EXPECT_EQ(v.accusers[0].accused, 1);
    EXPECT_EQ(v.accusers[0].reached_by, 3u);  // publisher, worker-2, worker-3
    const auto lines = describe_left_out(v, kNames);
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0],
              "worker-4, worker-5 said they could not reach worker-1, which 3 ranks reached: they are the suspects, "
              "left out of the next formation (not struck)");
  }
  // Rotating the victim changes nothing: the accusers are out each time.
  r[4].unreachable = {2};
  r[5].unreachable = {2};
  EXPECT_EQ(attribute(6, r, {0, 1, 2, 3, 4, 5}).left_out, (std::vector<int>{4, 5}));
}

// The mirror image: worker-3 claims it cannot reach worker-1 and worker-2,
// which were ready (their meshes, worker-3's pairs included, connected) and
// said nothing. They are no suspects of an accusation they never made:
// worker-3, the one side against two, is left out. (Before, the undirected
// pairs made worker-1 and worker-2 the "accusers" of worker-3, and one
// liar left two honest members out.)
TEST(AttributionTest, MembersWhoSaidNothingAreNeverTheSuspects) {
  std::map<int, RankReport> r;
  r[3].unreachable = {1, 2};
  for (uint64_t turn : {0u, 1u}) {
    const auto v = attribute(6, r, {0, 1, 2, 3, 4, 5}, turn);
    EXPECT_TRUE(v.blamed.empty());
    EXPECT_TRUE(v.accusers.empty());
    EXPECT_EQ(v.left_out, std::vector<int>{3}) << "turn " << turn;
  }
}

// Two members accuse worker-1; besides the publisher only worker-2 is
// complete (worker-3 failed without evidence: no word). Two against two,
// but the publisher's own working connection to worker-1 outweighs a
// peer's claim: the accusers are the suspects. (Before, the tie went to the
// sides, and the smaller, worker-1, was left out.)
TEST(AttributionTest, ThePublishersReachOutweighsATieOfAccusers) {
  std::map<int, RankReport> r;
  r[4].unreachable = {1};
  r[5].unreachable = {1};
  for (uint64_t turn : {0u, 1u}) {
    const auto v = attribute(6, r, {0, 1, 2, 4, 5}, turn);
    EXPECT_TRUE(v.blamed.empty());
    EXPECT_EQ(v.left_out, (std::vector<int>{4, 5})) << "turn " << turn;
  }
  // The publisher failing with another member (worker-3, at fault) leaves its reach of worker-1 as it is.
  r[0].unreachable = {3};
  const auto w = attribute(6, r, {0, 1, 2, 4, 5}, 0);
  EXPECT_EQ(w.accusers.size(), 1u);
}

// Two framers of worker-1 speak in different formations (the first time,
// worker-4's own mesh failed for real before it could say its word). Alone,
// each accusation is a tie that worker-1 loses every other turn; with the
// first one remembered (Verdict::lone -> `earlier`), the second accuser is
// the suspect, at either turn.
TEST(AttributionTest, AccusersWhoSpeakOneFormationAtATimeAreSuspectsTheSecondTime) {
  // Formation 1: ranks 0..5 = publisher, worker-1..5; worker-5 accuses
  // worker-1; worker-1, worker-2, worker-3 are complete.
  std::map<int, RankReport> first;
  first[5].unreachable = {1};
  const auto v1 = attribute(6, first, {1, 2, 3, 5}, 0);
  EXPECT_EQ(v1.left_out, std::vector<int>{5});  // a tie: this turn leaves the accuser out
  // Only what was said is remembered: worker-5 named worker-1, worker-1
  // (ready) named nobody.
  ASSERT_EQ(v1.lone.size(), 1u);
  EXPECT_EQ(v1.lone[0], std::make_pair(1, 5));
  // Formation 2 without worker-5: ranks 0..4 = publisher, worker-1..4;
  // worker-4 accuses worker-1. Without memory the tie now leaves worker-1 out.
  std::map<int, RankReport> second;
  second[4].unreachable = {1};
  EXPECT_EQ(attribute(5, second, {0, 1, 2, 3, 4}, 1).left_out, std::vector<int>{1});
  // worker-5, not in this formation, accused worker-1 before.
  const std::map<int, size_t> earlier = {{1, 1}};
  for (uint64_t turn : {0u, 1u}) {
    const auto v2 = attribute(5, second, {0, 1, 2, 3, 4}, turn, earlier);
    EXPECT_EQ(v2.left_out, std::vector<int>{4}) << "turn " << turn;
    EXPECT_TRUE(v2.sides.empty());
    ASSERT_EQ(v2.accusers.size(), 1u);
    EXPECT_EQ(v2.accusers[0].earlier, 1u);
    const auto lines = describe_left_out(v2, kNames);
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0],
              "worker-4 said it could not reach worker-1 (as 1 other member did in a recent formation), which 3 "
              "ranks reached: it is the suspect, left out of the next formation (not struck)");
  }
}

// What the memory must not do.
TEST(AttributionTest, RememberedAccusationsNeverOutweighWhatThisFormationShows) {
  // A pair that failed both ways (each named the other: a broken link, or a
  // liar and its victim alike) is not an accusation: nothing is remembered.
  std::map<int, RankReport> mutual;
  mutual[1].unreachable = {2};
  mutual[2].unreachable = {1};
  EXPECT_TRUE(attribute(5, mutual, {0, 1, 2, 3, 4}).lone.empty());
  // An accusation of the publisher is never remembered (it is never left out).
  std::map<int, RankReport> of_publisher;
  of_publisher[3].unreachable = {0};
  EXPECT_TRUE(attribute(5, of_publisher, {0, 1, 2, 3, 4}).lone.empty());
  // worker-4 names worker-1, which was ready and named nobody; a member not
  // here accused worker-4 before. The one who is silent (worker-1) is never
  // a suspect on the memory: the memory counts against worker-4's accuser
  // only when that accuser named it, and worker-1 named nobody.
  std::map<int, RankReport> r;
  r[4].unreachable = {1};
  const auto v = attribute(5, r, {0, 1, 2, 3, 4}, 0, {{4, 3}});
  for (int out : v.left_out) EXPECT_NE(out, 1);
  EXPECT_EQ(v.left_out, std::vector<int>{4});  // the tie, at this turn
  EXPECT_TRUE(v.accusers.empty());
  // The memory counts against the accused's reach: worker-1 reached by the
  // publisher (twice) and worker-2 only (worker-3 gave no word), accused by
  // worker-4 now and by two members not here: 1 + 2 >= 2 + 1, no suspect;
  // it is a tie again.
  const auto w = attribute(5, r, {0, 1, 2, 4}, 1, {{1, 2}});
  EXPECT_TRUE(w.accusers.empty());
  EXPECT_EQ(w.left_out, std::vector<int>{1});
  // With one member not here, 1 + 1 < 3: worker-4 is the suspect.
  EXPECT_EQ(attribute(5, r, {0, 1, 2, 4}, 1, {{1, 1}}).left_out, std::vector<int>{4});
  // Memory of a member most ranks could not reach either changes nothing:
  // it is named (step 2), and its accusers are witnesses.
  std::map<int, RankReport> broken;
  broken[4].unreachable = {1};
  broken[2].unreachable = {1};
  broken[3].unreachable = {1};
  const auto b = attribute(5, broken, {0, 1, 2, 3, 4}, 0, {{1, 1}});
  EXPECT_EQ(blamed(b), std::vector<int>{1});
  EXPECT_TRUE(b.accusers.empty());
  EXPECT_TRUE(b.left_out.empty());
}

// {worker-1, worker-2} and {worker-3, worker-4} cannot reach each other; the
// publisher reaches all four. One partition: nobody is named, one side is
// served, and the other at the next turn.
TEST(AttributionTest, ASymmetricPartitionIsOneAndTheSidesTakeTurns) {
  std::map<int, RankReport> r;
  r[1].unreachable = {3, 4};
  r[2].unreachable = {3, 4};
  r[3].unreachable = {1, 2};
  r[4].unreachable = {1, 2};
  const std::set<int> all = {0, 1, 2, 3, 4};
  const auto first = attribute(5, r, all, 0), second = attribute(5, r, all, 1);
  EXPECT_TRUE(first.blamed.empty());
  EXPECT_TRUE(second.blamed.empty());
  EXPECT_TRUE(first.accusers.empty());
  ASSERT_EQ(first.sides.size(), 1u);
  EXPECT_EQ(first.left_out, (std::vector<int>{3, 4}));
  EXPECT_EQ(second.left_out, (std::vector<int>{1, 2}));
  EXPECT_EQ(describe_left_out(first, kNames)[0],
            "{worker-1, worker-2} and {worker-3, worker-4} cannot reach each other on the data plane (either side may "
            "be at fault): the next formation leaves out {worker-3, worker-4} (not struck; on a tie the sides take "
            "turns)");
  // An uneven cut: most of the ranks that tried could not reach the smaller
  // side, which is named (step 2), whatever the turn; the larger side is served.
  r[5].unreachable = {1, 2};
  r[1].unreachable.push_back(5);
  r[2].unreachable.push_back(5);
  for (uint64_t turn : {0u, 1u}) {
    const auto v = attribute(6, r, {0, 1, 2, 3, 4, 5}, turn);
    EXPECT_EQ(blamed(v), (std::vector<int>{1, 2})) << turn;
    EXPECT_TRUE(v.left_out.empty()) << turn;
  }
}

// The publisher is never left out, whatever a member claims about it and
// whatever the turn: a member that says it could not reach the publisher is
// the side left out.
TEST(AttributionTest, ThePublisherIsNeverLeftOut) {
  std::map<int, RankReport> r;
  r[2].unreachable = {0};
  for (uint64_t turn : {0u, 1u}) EXPECT_EQ(attribute(4, r, {0, 1, 2, 3}, turn).left_out, std::vector<int>{2}) << turn;
  // A triangle with the publisher on it (not two sides).
  std::map<int, RankReport> t;
  t[1].unreachable = {0, 2};
  t[2].unreachable = {0, 1};
  for (uint64_t turn : {0u, 1u}) {
    const auto v = attribute(5, t, {0, 1, 2, 3, 4}, turn);
    for (int out : v.left_out) EXPECT_NE(out, 0) << turn;
  }
}

// The property the attribution is built for, over random groups: while fewer
// than half of the members lie, no honest member (every link between honest
// ranks works) is ever named, whatever the liars claim, whichever links they
// really break, whether they report or keep quiet. And a member whose data
// port is blocked (every rank fails with it) is always named.
TEST(AttributionTest, NoHonestMemberIsEverNamedWhileFewerThanHalfLie) {
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
  };
  int named_broken = 0;
  for (int round = 0; round < 20000; ++round) {
    const int members = 2 + static_cast<int>(next() % 9);  // 2..10, the publisher aside
    const int world = members + 1;
    const int liars = static_cast<int>(next() % static_cast<uint64_t>((members + 1) / 2));  // 2 * liars < members
    std::set<int> liar;
    while (static_cast<int>(liar.size()) < liars) liar.insert(1 + static_cast<int>(next() % static_cast<uint64_t>(members)));
    // Links a liar really breaks (its own; an honest rank reports them).
    std::set<std::pair<int, int>> broken;
    for (int l : liar)
      for (int p = 0; p < world; ++p)
        if (p != l && next() % 3 == 0) broken.insert({std::min(l, p), std::max(l, p)});
    std::map<int, RankReport> r;
    std::set<int> complete;
    for (int k = 0; k < world; ++k) {
      if (liar.count(k)) {
        for (int p = 0; p < world; ++p)
          if (p != k && next() % 2 == 0) (next() % 4 ? r[k].unreachable : r[k].no_address).push_back(p);
        if (next() % 2) complete.insert(k);
        continue;
      }
      for (int p = 0; p < world; ++p)
        if (p != k && broken.count({std::min(k, p), std::max(k, p)})) r[k].unreachable.push_back(p);
      complete.insert(k);
    }
    const auto v = attribute(world, r, complete, next());
    for (int out : v.left_out) ASSERT_NE(out, 0) << "the publisher left out; round " << round;
    for (const auto& b : v.blamed)
      ASSERT_TRUE(liar.count(b.rank)) << "honest rank " << b.rank << " named; round " << round << ", " << members
                                      << " members, " << liars << " liars";
    // A broken member instead of the liars: everyone fails with it.
    std::map<int, RankReport> down;
    const int dead = 1 + static_cast<int>(next() % static_cast<uint64_t>(members));
    std::set<int> ready;
    for (int k = 0; k < world; ++k)
      if (k != dead) {
        down[k].unreachable = {dead};
        ready.insert(k);
      }
    const auto w = attribute(world, down, ready, next());
    ASSERT_EQ(w.blamed.size(), 1u) << round;
    EXPECT_EQ(w.blamed[0].rank, dead);
    ++named_broken;
  }
  EXPECT_EQ(named_broken, 20000);
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
