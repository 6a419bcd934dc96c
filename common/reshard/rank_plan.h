// rank_plan(): one rank's sends and receives of a JobLayout, computed by
// that rank alone, in time and memory proportional to its own share.
//
// The geometry is arithmetic on the layout's rules: for each tensor this
// rank holds a part of, the wanted parts that part meets (a range of part
// indices along the sharded dim, per segment); for each tensor it wants a
// part of, the held parts that meet it. Every choice both ends of a move
// must agree on is a pure function of (tensor, parts, segments), so the
// sender and the receiver of a piece derive the same move without asking
// anyone:
//   - which replica of the holders sends it: (tensor + wanted part +
//     wanted segment) mod holder replicas, spreading the sending;
//   - the chain of wanter replicas it travels along (it leaves its holder
//     once, each replica forwards it to the next): replicas in order,
//     rotated by (tensor + both parts + both segments) mod wanter replicas,
//     so that each replica is last in its share of the chains;
//   - the order of a pair's moves: by (depth, tensor, segments, parts), the
//     same on both ends; consecutive small moves of a pair at the same
//     depth travel together (pair_batches), and a batch of depth d only
//     relays pieces that arrived at depth d - 1: no cycle of waits.
// The whole job's check (check_layout) and these per-rank plans together
// are what plan_reshard() + validate_plan() are for explicit manifests; the
// property tests (tests/common/reshard/layout_test.cc) hold the two to the
// same pieces.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/reshard/layout.h"

namespace paramcast::reshard {

// One piece between this rank and a peer (ranks, parts and depths below
// 2^16, segments below 2^8: check_layout's bounds): the meeting of the holder's part
// `held_part` (segment `held_segment`) and the wanter's part `want_part`
// (segment `want_segment`) of `tensor`. For explicit placements the part is
// the box's index and the segment 0.
// 24 bytes: a rank of a DeepSeek-scale job keeps millions of these.
struct Move {
  uint64_t bytes = 0;
  uint32_t tensor = 0;
  uint16_t peer = 0;   // the receiver of a send, the sender of a receive
  uint16_t depth = 0;  // hops before this one: 0 = the holder sends it
  uint16_t held_part = 0, want_part = 0;
  uint8_t held_segment = 0, want_segment = 0;
  bool operator==(const Move&) const = default;
};

struct RankPlan {
  int rank = -1;
  std::vector<Move> sends;     // by (peer, depth, tensor, segments, parts): forwards are sends at depth > 0
  std::vector<Move> receives;  // the same order
  uint64_t bytes_out = 0;
  uint64_t bytes_in = 0;
};

// `job` must have passed check_layout().
RankPlan rank_plan(const JobLayout& job, int rank);

// The region of `tensor` a move carries.
Region move_region(const JobLayout& job, const Move& move);
// The rank that holds the piece (the chain's start): whose hash checks it.
int move_holder(const JobLayout& job, const Move& move);

// A run of consecutive moves of one pair (same peer, same depth) that
// travel as one message: [first, first + count) of a RankPlan's sends or
// receives. A move of at least `bucket_bytes` travels alone.
struct Batch {
  size_t first = 0;
  size_t count = 0;
  uint64_t bytes = 0;
};
std::vector<Batch> pair_batches(const std::vector<Move>& moves, uint64_t bucket_bytes);

// A rank's last plan, kept for the next update of the same job: an update
// names the digests of its tensor list and of its whole layout table
// (layout_proto.h), and a rank whose cache holds a plan of the same
// digests takes it as it is, without planning. Any change (a tensor
// renamed or reshaped, an engine registering other slices, a rank
// leaving, the EP map moving experts) changes a digest: the cache says
// which, and the rank plans again. Not thread-safe: one owner.
struct PlanKey {
  uint64_t tensors = 0;  // tensors_digest() of the job's tensor list
  uint64_t layout = 0;   // xxh64 of the layout table's wire bytes (rules, ranks, tensors)
  int rank = -1;
  bool operator==(const PlanKey&) const = default;
};
class PlanCache {
 public:
  // The cached plan for `key`, or null with `why` saying what changed.
  const RankPlan* find(const PlanKey& key, std::string* why) const;
  const RankPlan& put(const PlanKey& key, RankPlan plan);

 private:
  PlanKey key_;
  RankPlan plan_;
  bool full_ = false;
};

}  // namespace paramcast::reshard
