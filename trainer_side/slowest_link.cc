#include "trainer_side/slowest_link.h"

#include <cstddef>

namespace paramcast {

int slowest_link(const std::map<int, InboundRate>& links) {
  constexpr double kAbout = 1.25;
  int slowest = -1;
  for (const auto& [rank, l] : links)
    if (l.rate > 0 && (slowest < 0 || l.rate < links.at(slowest).rate)) slowest = rank;
  if (slowest < 0) return -1;
  for (std::size_t hops = 0; hops < links.size(); ++hops) {  // bounded: figures come from the network
    int next = -1;
    for (const auto& [rank, l] : links)
      if (l.parent == slowest && l.rate > 0 && l.rate <= kAbout * links.at(slowest).rate &&
          (next < 0 || l.rate < links.at(next).rate))
        next = rank;
    if (next < 0) break;
    slowest = next;
  }
  const InboundRate& named = links.at(slowest);
  int siblings = 0;
  bool all_slow = true;
  for (const auto& [rank, l] : links) {
    if (l.parent != named.parent) continue;
    ++siblings;
    all_slow = all_slow && l.rate > 0 && l.rate <= kAbout * named.rate;
  }
  return siblings >= 2 && all_slow ? named.parent : slowest;
}

}  // namespace paramcast
