// plan_reshard(): who sends which bytes to whom, when many trainer ranks
// each hold part of the model and many engine ranks each want part of it.
//
// Every rank states, per tensor, the full tensor's spec and what it holds
// (the whole tensor: a replica; or a region: an FSDP2/Megatron shard) and
// what it wants (the whole tensor, or a tensor-parallel slice). The plan
// intersects holdings with wants (as torch.distributed.checkpoint's
// resharding planner intersects saved and requested chunks) and returns the
// transfers: (from, to, tensor, region). It is checked as a whole before
// anything moves, and every disagreement is named with the tensor, the
// index range and the ranks:
//   - a tensor whose dtype or shape differs between two ranks;
//   - a holding or a want outside its tensor, or of the wrong rank;
//   - two holdings that overlap without being the same region (two ranks
//     claim the same rows); the same region held by several ranks is a set
//     of replicas, and one of them sends each byte;
//   - replicas whose digests of the region differ (a stale data-parallel
//     replica: its bytes would be mixed with the others');
//   - a wanted range that nobody holds (a gap);
//   - two wants of one rank that overlap.
// Load: each wanted piece is sent by the replica that has sent least so
// far. Replicas of a want: with `forward`, a piece several ranks want
// (rank t of each data-parallel replica) leaves its sender once and is
// forwarded along those ranks (a chain, its order rotated from piece to
// piece so that forwarding spreads), so a sender's link carries its shard
// about once; without it the sender sends it to each.
// validate_plan() checks any plan against the manifests independently:
// every wanted element arrives exactly once, from a rank that holds it or
// received it first; plan_reshard() runs it before returning.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/reshard/region.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::reshard {

struct Holding {
  std::string tensor;
  Region region;
};
using Want = Holding;

// What one rank of the job (a trainer rank or an engine rank) states.
struct RankManifest {
  int rank = -1;                     // unique in the job
  std::string name;                  // for messages: "trainer-1", "worker-3"
  std::vector<TensorSpec> tensors;   // the full specs of every tensor it names
  std::vector<Holding> holds;
  std::vector<Want> wants;
  // The xxh64 of a holding's bytes (by index in `holds`), where the rank
  // gave one. Replicas (ranks holding the same region) that gave different
  // digests hold different bytes: a mismatch, named, before anything moves.
  std::map<size_t, uint64_t> digests = {};
};

struct Transfer {
  int from = -1;
  int to = -1;
  uint32_t tensor = 0;  // index into ReshardPlan::tensors
  Region region;
  uint64_t bytes = 0;
  // The transfer that brought this region to `from` (a forward), or -1: the
  // sender holds it.
  int after = -1;
};

struct ReshardOptions {
  // Forward pieces several ranks want along them instead of sending each
  // its own copy. Default: true
  bool forward = true;
  // Check the plan made against the manifests (validate_plan) before
  // returning it: a third of the planning. A rank that follows a plan
  // another rank made and checked from the same manifests with this same
  // code (a member of a sharded update follows rank 0's) may skip it.
  // Default: true
  bool validate = true;
};

struct ReshardPlan {
  std::vector<TensorSpec> tensors;  // by name
  std::vector<Transfer> transfers;
  std::map<int, uint64_t> sent;      // bytes each rank sends (forwards included)
  std::map<int, uint64_t> received;  // bytes each rank receives
  // The fewest bytes the busiest link must carry (../shared LINK_LIMIT.md's
  // model, one link per rank and direction): every rank receives all it
  // wants; the holders of a wanted region send it at least once between
  // them (a replica its share).
  uint64_t least_busiest_bytes = 0;
  uint64_t busiest_bytes() const;
};

// The transfer a forward's chain starts with (`transfer` itself when it is
// no forward): its sender holds the piece. The hash that checks a piece
// comes from there, never from a rank that forwards it (a forwarder relays
// bytes it cannot vouch for). `plan` is a validated plan (after < index).
size_t chain_start(const ReshardPlan& plan, size_t transfer);

// Returns the plan, or INVALID_ARGUMENT listing every mismatch (first 16).
StatusOr<ReshardPlan> plan_reshard(const std::vector<RankManifest>& ranks, const ReshardOptions& options = {});
// Every wanted element delivered exactly once, each transfer from a rank that
// holds its region or received it before, inside the tensors' bounds.
Status validate_plan(const ReshardPlan& plan, const std::vector<RankManifest>& ranks);

}  // namespace paramcast::reshard
