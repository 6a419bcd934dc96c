#include "common/reshard/schedule.h"

#include <algorithm>
#include <map>
#include <set>

namespace paramcast::reshard {

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
  std::vector<std::set<int>> sending, receiving;  // per round
  std::vector<size_t> round_of(xs.size(), 0);
  for (size_t i : order) {
    size_t r = xs[i].after >= 0 ? round_of[static_cast<size_t>(xs[i].after)] + 1 : 0;
    while (r < rounds.size() && (sending[r].count(xs[i].from) || receiving[r].count(xs[i].to))) ++r;
    if (r == rounds.size()) {
      rounds.emplace_back();
      sending.emplace_back();
      receiving.emplace_back();
    }
    rounds[r].transfers.push_back(i);
    rounds[r].longest = std::max(rounds[r].longest, xs[i].bytes);
    sending[r].insert(xs[i].from);
    receiving[r].insert(xs[i].to);
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
