// sharded_moves(): the transfers of a sharded UpdatePlan (a many-sender
// update), as every rank of the group derives them from the plan it got.
//
// The plan lists what each trainer rank holds (UpdatePlan::holders) and the
// slices the engines with tensor parallelism want (UpdatePlan::wanters);
// every other rank of the group wants every tensor whole. From those manifests
// plan_reshard() picks the transfers (one sender per byte, replicas sharing
// the sending, pieces several engines want forwarded along them) and
// schedule_rounds() orders them. Both are deterministic, so the publisher
// and each member compute the same moves from the same plan, and the
// publisher's own run (before the plan goes out) is the check that refuses
// a gap, an overlap or a disagreement, naming tensor, range and ranks.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <string>
#include <vector>

#include "common/plan.h"
#include "common/reshard/reshard_plan.h"
#include "common/reshard/schedule.h"

namespace paramcast::reshard {

struct ShardedMoves {
  ReshardPlan plan;
  std::vector<Round> rounds;
  std::vector<int> receivers;  // the ranks that receive (every rank but the holders)
};

// `names[r]` names rank r in messages ("publisher", worker ids); ranks
// without a name are "rank r".
StatusOr<ShardedMoves> sharded_moves(const UpdatePlan& plan, int world, const std::vector<std::string>& names);

}  // namespace paramcast::reshard
