// Bundles (common/reshard/executor_steps.h, plan_bundles): the small pieces
// between a pair of ranks that travel as one message. Both ends derive
// them from the plan and rounds alone, so each pair's bundles must come out
// the same at either end; each a maximal run of the pair's held small
// pieces, consecutive in the pair's schedule order, within the caps; a
// relay, the forwards of a bundle whose pieces all go on to one rank, in
// that bundle's order.
// Pure: no process, no socket.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/reshard/executor_steps.h"

namespace paramcast::reshard {
namespace {

using detail::Bundle;
using detail::kBundleMax;
using detail::kBundlePieceMax;
using detail::plan_bundles;

// "trainer-3": built with += (GCC 12 reports a bogus -Wrestrict inside
// operator+ of a literal and a temporary string, GCC bug 105329).
std::string label(const char* prefix, int i) {
  std::string s = prefix;
  s += std::to_string(i);
  return s;
}

// `senders` trainer ranks holding FSDP shards (rows, torch.chunk's split) of
// `tensors` (rows x cols bf16 each), `engines` engine ranks wanting them whole.
ReshardPlan fsdp_plan(int senders, int engines, const std::vector<std::pair<int64_t, int64_t>>& tensors,
                      bool forward = true) {
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < tensors.size(); ++i)
    specs.push_back({label("t", static_cast<int>(i)), DType::kBF16, {tensors[i].first, tensors[i].second}});
  std::vector<RankManifest> ranks;
  for (int r = 0; r < senders + engines; ++r) {
    RankManifest m;
    m.rank = r;
    m.name = label(r < senders ? "trainer-" : "engine-", r);
    m.tensors = specs;
    for (const auto& t : specs) {
      if (r >= senders) {
        m.wants.push_back({t.name, Region::whole(t.shape)});
        continue;
      }
      const int64_t rows = t.shape[0], per = (rows + senders - 1) / senders;
      const int64_t start = std::min<int64_t>(rows, per * r), len = std::min<int64_t>(per, rows - start);
      if (len > 0) m.holds.push_back({t.name, Region::slice(t.shape, 0, start, len)});
    }
    ranks.push_back(std::move(m));
  }
  auto plan = plan_reshard(ranks, ReshardOptions{forward});
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  return plan.ok() ? *plan : ReshardPlan{};
}

// Each pair's transfers in schedule order.
std::map<std::pair<int, int>, std::vector<size_t>> pair_order(const ReshardPlan& plan,
                                                              const std::vector<Round>& rounds) {
  std::map<std::pair<int, int>, std::vector<size_t>> order;
  for (const Round& round : rounds)
    for (size_t i : round.transfers) order[{plan.transfers[i].from, plan.transfers[i].to}].push_back(i);
  return order;
}

bool small(const Transfer& x) { return x.after < 0 && x.bytes <= kBundlePieceMax; }

// Every rank's bundles: within the caps, a consecutive run of its pair's
// order that the next piece could not join, the same at both ends of the
// pair. `out`: the bundles by pair (as the sender derived them).
using ByPair = std::map<std::pair<int, int>, std::vector<Bundle>>;
void check_bundles(const ReshardPlan& plan, int world, ByPair& out) {
  const auto rounds = schedule_rounds(plan);
  const auto order = pair_order(plan, rounds);
  std::map<int, ByPair> at;  // rank -> pair -> bundles
  for (int r = 0; r < world; ++r)
    for (Bundle& b : plan_bundles(plan, rounds, r)) {
      const Transfer& first = plan.transfers[b.transfers.front()];
      EXPECT_TRUE(first.from == r || first.to == r);
      at[r][{first.from, first.to}].push_back(std::move(b));
    }
  for (const auto& [pair, list] : order) {
    const auto &from = at[pair.first][pair], &to = at[pair.second][pair];
    ASSERT_EQ(from.size(), to.size()) << pair.first << " -> " << pair.second;
    for (size_t k = 0; k < from.size(); ++k) {
      EXPECT_EQ(from[k].transfers, to[k].transfers);
      EXPECT_EQ(from[k].bytes, to[k].bytes);
      EXPECT_EQ(from[k].relay, to[k].relay);
      const Bundle& b = from[k];
      if (b.relay) continue;  // check_relays
      ASSERT_GE(b.transfers.size(), 2u);
      EXPECT_LE(b.bytes, kBundleMax);
      uint64_t bytes = 0;
      for (size_t i : b.transfers) {
        EXPECT_TRUE(small(plan.transfers[i]));
        bytes += plan.transfers[i].bytes;
      }
      EXPECT_EQ(bytes, b.bytes);
      // Consecutive in the pair's order; the next piece could not join it.
      const auto begin = std::find(list.begin(), list.end(), b.transfers.front());
      ASSERT_NE(begin, list.end());
      ASSERT_GE(static_cast<size_t>(list.end() - begin), b.transfers.size());
      EXPECT_TRUE(std::equal(b.transfers.begin(), b.transfers.end(), begin));
      const auto next = begin + static_cast<long>(b.transfers.size());
      if (next != list.end() && small(plan.transfers[*next])) {
        EXPECT_GT(b.bytes + plan.transfers[*next].bytes, kBundleMax);
      }
    }
  }
  for (const auto& [r, pairs] : at)
    for (const auto& [pair, list] : pairs)
      if (pair.first == r && !list.empty()) out[pair] = list;
}

// Every relay, as its forwarder derived it: its source is a bundle the
// forwarder received, and it holds the one forward of each of the source's
// pieces, in the source's order, the same region, all to one rank; a
// bundle whose pieces all go on to one rank has its relay. Returns the
// forwards in relays.
size_t check_relays(const ReshardPlan& plan, int world) {
  const auto rounds = schedule_rounds(plan);
  std::map<size_t, std::vector<size_t>> forwards;  // a transfer -> its forwards
  for (size_t i = 0; i < plan.transfers.size(); ++i)
    if (plan.transfers[i].after >= 0) forwards[static_cast<size_t>(plan.transfers[i].after)].push_back(i);
  size_t relayed = 0;
  for (int r = 0; r < world; ++r) {
    const std::vector<Bundle> mine = plan_bundles(plan, rounds, r);
    std::set<long> sources;
    for (const Bundle& b : mine) {
      if (!b.relay || plan.transfers[b.transfers.front()].from != r) continue;
      EXPECT_GE(b.source, 0);
      if (b.source < 0) continue;
      sources.insert(b.source);
      const Bundle& source = mine[static_cast<size_t>(b.source)];
      EXPECT_EQ(plan.transfers[source.transfers.front()].to, r);
      EXPECT_EQ(b.bytes, source.bytes);
      if (b.transfers.size() != source.transfers.size()) {
        ADD_FAILURE() << "a relay of " << b.transfers.size() << " forwards, its source " << source.transfers.size();
        continue;
      }
      for (size_t k = 0; k < b.transfers.size(); ++k) {
        const Transfer& f = plan.transfers[b.transfers[k]];
        EXPECT_EQ(f.after, static_cast<int>(source.transfers[k]));
        EXPECT_EQ(forwards[source.transfers[k]].size(), 1u);
        EXPECT_EQ(f.to, plan.transfers[b.transfers.front()].to);
        EXPECT_EQ(f.region, plan.transfers[source.transfers[k]].region);
      }
      relayed += b.transfers.size();
    }
    for (size_t k = 0; k < mine.size(); ++k) {  // a bundle received here that could go on whole does
      const Bundle& b = mine[k];
      if (plan.transfers[b.transfers.front()].to != r || sources.count(static_cast<long>(k))) continue;
      std::set<int> next;
      bool once = true;
      for (size_t i : b.transfers) {
        once = once && forwards[i].size() == 1;
        for (size_t f : forwards[i]) next.insert(plan.transfers[f].to);
      }
      EXPECT_FALSE(once && next.size() == 1) << "rank " << r << ": a bundle that could go on whole did not";
    }
  }
  return relayed;
}

// 2,000 tensors of a few hundred bytes from 3 trainer ranks to 2 and 3
// whole engines with forwarding: every sender's pieces to an engine go in
// a bundle or few, and each engine forwards them on in as many relays.
TEST(BundlesTest, BothEndsDeriveTheSameBundlesAndRelaysOfManySmallPiecesWithForwards) {
  std::vector<std::pair<int64_t, int64_t>> tensors;
  for (int i = 0; i < 2000; ++i) tensors.push_back({16 + i % 7, 8 + i % 5});
  tensors.push_back({1024, 1024});  // 2 MiB: shards of 683 KiB travel alone
  for (int engines : {2, 3}) {
    const ReshardPlan plan = fsdp_plan(3, engines, tensors);
    ByPair bundles;
    check_bundles(plan, 3 + engines, bundles);
    size_t bundled = 0, held = 0, forwarded = 0;
    for (const auto& [pair, list] : bundles)
      for (const Bundle& b : list) {
        EXPECT_EQ(b.relay, pair.first >= 3) << "trainer ranks hold, engines relay";
        if (!b.relay) bundled += b.transfers.size();
      }
    for (const Transfer& x : plan.transfers) {
      held += x.after < 0 && x.bytes <= kBundlePieceMax;
      forwarded += x.after >= 0 && x.bytes <= kBundlePieceMax;
    }
    EXPECT_GT(bundled, held * 9 / 10);
    EXPECT_GT(forwarded, 0u);
    EXPECT_GT(check_relays(plan, 3 + engines), forwarded * 9 / 10) << engines << " engines";
  }
}

// A pair's run of 128 KiB pieces is cut at 4 MiB: 100 pieces, 32 a bundle.
TEST(BundlesTest, ARunIsCutAtTheBundleCap) {
  std::vector<std::pair<int64_t, int64_t>> tensors(100, {256, 256});  // 128 KiB each
  const ReshardPlan plan = fsdp_plan(1, 1, tensors);
  ByPair bundles;
  check_bundles(plan, 2, bundles);
  ASSERT_EQ(bundles.size(), 1u);
  const auto& list = bundles.begin()->second;
  ASSERT_EQ(list.size(), 4u);
  EXPECT_EQ(list[0].transfers.size(), 32u);
  EXPECT_EQ(list[3].transfers.size(), 4u);
}

// Pieces over 256 KiB travel alone; so does a piece in a run of one.
TEST(BundlesTest, LargePiecesAndLonePiecesAreNoBundle) {
  const ReshardPlan big = fsdp_plan(2, 1, std::vector<std::pair<int64_t, int64_t>>(10, {1024, 512}));
  ByPair bundles;
  check_bundles(big, 3, bundles);
  EXPECT_TRUE(bundles.empty());
  const ReshardPlan one = fsdp_plan(1, 1, {{16, 16}});
  check_bundles(one, 2, bundles);
  EXPECT_TRUE(bundles.empty());
}

}  // namespace
}  // namespace paramcast::reshard
