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

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/plan.h"
#include "common/reshard/executor.h"
#include "common/reshard/reshard_plan.h"
#include "common/reshard/schedule.h"

namespace paramcast::reshard {

namespace detail {
struct RankSchedule;
}

struct ShardedMoves {
  ShardedMoves() = default;
  ShardedMoves(ShardedMoves&&) = default;  // by_name's views stay in the moved tensors
  ShardedMoves(const ShardedMoves&) = delete;
  ShardedMoves& operator=(const ShardedMoves&) = delete;

  ReshardPlan plan;  // its tensors are the UpdatePlan's, in its order (a transfer's tensor: the plan's index)
  std::vector<Round> rounds;
  std::vector<int> receivers;  // the ranks that receive (every rank but the holders)
  // Each tensor's index by its name (views of plan.tensors' names, which a
  // move of the moves leaves in place): made once with the moves, for
  // every update that finds its buffers by name.
  std::unordered_map<std::string_view, size_t> by_name;
  // This process's rank's schedule of these moves (RunOptions::schedule),
  // kept with them while the cache keeps them: set by the run that derives
  // it (one owner, as the cache).
  mutable std::shared_ptr<const detail::RankSchedule> schedule;
};

// `names[r]` names rank r in messages ("publisher", worker ids); ranks
// without a name are "rank r". `options` go to plan_reshard().
StatusOr<ShardedMoves> sharded_moves(const UpdatePlan& plan, int world, const std::vector<std::string>& names,
                                     const ReshardOptions& options = {});

// Where the data plane's checksums are on, every replica (a holder of the
// same non-empty box of a tensor as another) must come with its digest: a
// rank by reference digests only the boxes its last plan gave another holder
// (Holdings.digestBoxes), so a box that a changed part now shares has none.
// Rank 0's check before the plan goes out; names the holder without one.
Status check_replicas_digested(const UpdatePlan& plan, const std::vector<std::string>& names);

// A sending rank's buffers (RankBuffers::index): `boxes` (a shard's index
// in `shards`, the box of its tensor it holds), by the index in the moves'
// plan of the shard's tensor.
std::shared_ptr<const BufferIndex> held_buffers(const ShardedMoves& moves, const std::vector<ShardView>& shards,
                                                const std::vector<std::pair<uint32_t, Region>>& boxes);

// A rank's last ShardedMoves, kept for the next update of the same shape:
// the same tensors, the same holders' and wanters' regions, the same ranks
// under the same names. Such an update takes the moves as they are, without
// planning (4 s a rank for 50k tensors on 4 trainer ranks): only the
// replicas' digests, which change with every version, are compared afresh
// (rank 0 has them). Anything else plans again. The shape is compared byte
// for byte, or known by the caller (KnownShape), never by a hash: a hostile
// holder cannot forge a match. Not thread-safe: one owner (the update
// thread, an engine's data thread).
struct KnownShape {
  bool same_as_kept = false;
  std::shared_ptr<const void> shape;
};
class ShardedMovesCache {
 public:
  // `options`: how it plans (a member follows rank 0's checked plan, and
  // plans without the self-check: ReshardOptions::validate).
  explicit ShardedMovesCache(ReshardOptions options = {}) : options_(options) {}
  // What the caller knows of `plan`'s shape, which spares the comparison:
  // `same_as_kept`, it is the kept moves' shape (rank 0 made it from the
  // same inputs: its kept plan); or `shape`, the object whose shape it has
  // (a member's kept whole plan, which a plan by reference copies), the
  // same object as the kept moves were made or compared for, under the
  // same ranks and names. Never a digest: a hostile holder could forge one.
  StatusOr<std::shared_ptr<const ShardedMoves>> moves(const UpdatePlan& plan, int world,
                                                      const std::vector<std::string>& names, KnownShape known = {});
  // Whether the last moves() took the kept moves (for tests and logs).
  bool last_was_cached() const { return cached_; }

 private:
  ReshardOptions options_;
  std::string shape_;
  std::shared_ptr<const void> owner_;  // the object whose shape the kept moves are of, where a caller told it
  int world_ = 0;
  std::vector<std::string> names_;
  std::shared_ptr<const ShardedMoves> kept_;
  bool cached_ = false;
};

}  // namespace paramcast::reshard
