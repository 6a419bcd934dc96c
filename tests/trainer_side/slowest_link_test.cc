// slowest_link() (trainer_side/slowest_link.h): the link to blame for a slow
// update, from per-link figures shaped as the publisher receives them.
#include <gtest/gtest.h>

#include "trainer_side/slowest_link.h"

namespace paramcast {
namespace {

constexpr double MB = 1e6;

// World 8, Gloo's binomial tree from rank 0: 0 -> {4, 2, 1}, 1 -> {5, 3},
// 2 -> {6}, 3 -> {7}.
std::map<int, InboundRate> tree(double fast) {
  return {{1, {0, fast}}, {2, {0, fast}}, {4, {0, fast}}, {3, {1, fast}},
          {5, {1, fast}}, {6, {2, fast}}, {7, {3, fast}}};
}

TEST(SlowestLinkTest, NoFiguresNamesNobody) {
  EXPECT_EQ(slowest_link({}), -1);
  EXPECT_EQ(slowest_link({{1, {0, 0}}}), -1);
}

TEST(SlowestLinkTest, OneSlowLeafIsNamed) {
  auto links = tree(100 * MB);
  links[6].rate = 5 * MB;
  EXPECT_EQ(slowest_link(links), 6);
}

// A slow leaf (7) slows the link into its parent (3) by back-pressure: the
// leaf is named, not its parent.
TEST(SlowestLinkTest, BackPressureIsFollowedDownToTheSlowLeaf) {
  auto links = tree(100 * MB);
  links[7].rate = 5 * MB;
  links[3].rate = 4.5 * MB;
  EXPECT_EQ(slowest_link(links), 7);
}

// Rank 1's own uplink is impaired: both of its children's links (3 and 5)
// are slow, through no fault of theirs. Rank 1 is named, not a child.
TEST(SlowestLinkTest, EveryLinkOutOfAParentSlowNamesTheParent) {
  auto links = tree(100 * MB);
  links[3].rate = 5 * MB;
  links[5].rate = 5.5 * MB;
  links[7].rate = 60 * MB;  // below 3, unaffected
  EXPECT_EQ(slowest_link(links), 1);
}

// One slow child of two: the child.
TEST(SlowestLinkTest, OneSlowChildOfTwoIsTheChild) {
  auto links = tree(100 * MB);
  links[5].rate = 5 * MB;
  EXPECT_EQ(slowest_link(links), 5);
}

// Every link out of the publisher slow: its own uplink.
TEST(SlowestLinkTest, EveryLinkOutOfThePublisherSlowNamesThePublisher) {
  std::map<int, InboundRate> links = {{1, {0, 5 * MB}}, {2, {0, 5.2 * MB}}, {3, {1, 80 * MB}}};
  EXPECT_EQ(slowest_link(links), 0);
}

// An only child cannot tell its parent's uplink from its own link: the child.
TEST(SlowestLinkTest, AnOnlyChildIsNamedItself) {
  auto links = tree(100 * MB);
  links[6].rate = 5 * MB;
  links[2].rate = 100 * MB;
  EXPECT_EQ(slowest_link(links), 6);
}

// Hostile figures: a cycle of parents ends within the bound.
TEST(SlowestLinkTest, ACycleOfParentsEnds) {
  std::map<int, InboundRate> links = {{1, {2, 5 * MB}}, {2, {1, 5 * MB}}};
  const int named = slowest_link(links);
  EXPECT_TRUE(named == 1 || named == 2);
}

}  // namespace
}  // namespace paramcast
