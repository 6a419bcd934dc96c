#include "common/reshard/schedule.h"

#include <algorithm>
#include <map>
#include <unordered_map>

namespace paramcast::reshard {

namespace {

// The rounds a rank's link is busy in, as "the next round to try" links
// (union-find with path compression, in a map: memory proportional to the
// rank's transfers, not to the number of rounds).
class BusyRounds {
 public:
  // The first round >= r in which this link is free.
  size_t first_free(size_t r) {
    size_t at = r;
    for (auto it = next_.find(at); it != next_.end(); it = next_.find(at)) at = it->second;
    // Path compression: every round passed on the way points past them.
    for (auto it = next_.find(r); it != next_.end() && it->second != at; it = next_.find(r)) {
      r = it->second;
      it->second = at;
    }
    return at;
  }
  void take(size_t r) { next_[r] = r + 1; }

 private:
  std::unordered_map<size_t, size_t> next_;
};

}  // namespace

// Each transfer goes into the earliest round from its chain's turn on where
// its sender's and its receiver's links are both free: found by jumping to
// each link's next free round in turn (never scanning the rounds between),
// so scheduling costs about O(transfers) map operations, not transfers x rounds.
std::vector<Round> schedule_rounds(const ReshardPlan& plan) {
  const auto& xs = plan.transfers;
  std::vector<size_t> depth(xs.size(), 0);  // place in its chain (after precedes: indices increase)
  for (size_t i = 0; i < xs.size(); ++i)
    if (xs[i].after >= 0) depth[i] = depth[static_cast<size_t>(xs[i].after)] + 1;
  std::vector<size_t> order(xs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return depth[a] != depth[b] ? depth[a] < depth[b] : xs[a].bytes > xs[b].bytes;
  });
  std::vector<Round> rounds;
  std::unordered_map<int, BusyRounds> sending, receiving;
  std::vector<size_t> round_of(xs.size(), 0);
  for (size_t i : order) {
    BusyRounds& out = sending[xs[i].from];
    BusyRounds& in = receiving[xs[i].to];
    size_t r = xs[i].after >= 0 ? round_of[static_cast<size_t>(xs[i].after)] + 1 : 0;
    for (size_t s = out.first_free(r);; s = out.first_free(r)) {
      r = in.first_free(s);
      if (r == s) break;
    }
    if (r >= rounds.size()) rounds.resize(r + 1);
    rounds[r].transfers.push_back(i);
    rounds[r].longest = std::max(rounds[r].longest, xs[i].bytes);
    out.take(r);
    in.take(r);
    round_of[i] = r;
  }
  return rounds;
}

uint64_t schedule_bytes(const std::vector<Round>& rounds) {
  uint64_t total = 0;
  for (const auto& r : rounds) total += r.longest;
  return total;
}

}  // namespace paramcast::reshard
