// publisher.apply_timeout: auto (apply_deadline.h).
#include "trainer_side/apply_deadline.h"

#include <algorithm>

#include "common/units.h"

namespace paramcast {

ApplyBound auto_apply_bound(std::optional<ApplyMillis> own, std::optional<ApplyMillis> peers) {
  using R = ApplyRule;
  ApplyBound out;
  if (!own) {  // its first: an engine slower than its peers by nature is not failed for it
    out.bound = R::kCeiling;
    out.why = "auto: " + format_duration(out.bound) + ", the ceiling: no Applied of this member yet";
    return out;
  }
  const bool from_own = own && (!peers || *own >= *peers);
  const ApplyMillis seen = from_own ? *own : *peers;
  const ApplyMillis scaled = seen * R::kFactor;
  out.bound = std::clamp(scaled, R::kFloor, R::kCeiling);
  const std::string basis = std::to_string(R::kFactor) + " x " +
                            (from_own ? "its own slowest Applied of its last " + std::to_string(R::kHistory) + " updates"
                                      : std::string("the slowest Applied of this update")) +
                            " (" + format_duration(seen) + ")";
  out.why = "auto: " + format_duration(out.bound) +
            (scaled < R::kFloor ? ", the floor; " : scaled > R::kCeiling ? ", the ceiling; " : ", ") + basis;
  return out;
}

void ApplyHistory::record(const std::string& id, ApplyMillis took) {
  auto& d = taken_[id];
  d.push_back(took);
  while (d.size() > ApplyRule::kHistory) d.pop_front();
}

std::optional<ApplyMillis> ApplyHistory::slowest(const std::string& id) const {
  auto it = taken_.find(id);
  if (it == taken_.end() || it->second.empty()) return std::nullopt;
  return *std::max_element(it->second.begin(), it->second.end());
}

}  // namespace paramcast
