// publisher.apply_timeout: auto (the default): how long a member's Applied
// may take once the publisher's data plane finished, derived from what the
// fleet itself takes, so that a member that never reports costs well under
// a minute and an honest slow one is not failed.
//
// A member's bound is kFactor times the longer of (a) its own slowest
// Applied over its last kHistory updates and (b) the slowest Applied of this
// update so far (its peers applied the same bytes), at least kFloor and at
// most kCeiling. Before its own first Applied is known it is kCeiling: an
// engine slower than its peers by nature (another kind of engine, a longer
// on_update_end) is not failed on its first update. So among engines that
// apply in 0.1 s, one that stops reporting is named kFloor (15 s) after the
// data plane ended; one whose apply has always taken 5 s has 40 s. Pure: no
// clock, no lock.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <string>

namespace paramcast {

using ApplyMillis = std::chrono::milliseconds;

struct ApplyBound {
  ApplyMillis bound{0};
  std::string why;  // "auto: 15.000 s, the floor; 8 x the slowest Applied of this update (0.120 s)"
};

struct ApplyRule {
  static constexpr ApplyMillis kFloor{15000};
  static constexpr ApplyMillis kCeiling{60000};
  static constexpr int kFactor = 8;
  static constexpr size_t kHistory = 8;
};

// `own`: the member's slowest recent Applied; `peers`: the slowest of this
// update so far (each after the data plane ended).
ApplyBound auto_apply_bound(std::optional<ApplyMillis> own, std::optional<ApplyMillis> peers);

// Each member's last ApplyRule::kHistory Applied times (one owner: the
// update thread, under the publisher's lock). A member that leaves is
// forgotten, so it holds one entry per member at most.
class ApplyHistory {
 public:
  void record(const std::string& id, ApplyMillis took);
  std::optional<ApplyMillis> slowest(const std::string& id) const;
  void forget(const std::string& id) { taken_.erase(id); }

 private:
  std::map<std::string, std::deque<ApplyMillis>> taken_;
};

}  // namespace paramcast
