// A JobLayout to and from its wire form (schemas/control.capnp,
// JobLayoutTable): the tensor list front-coded (a frontier model's names
// share most of their bytes with the name before), then the rules as small
// integers. layout_bytes() is the flat message as it would travel.
//
// Decoding trusts nothing: every count is bounded before anything is built
// from it (tensors, dimensions, names, ranks, meshes, placements, boxes),
// names are checked as they are rebuilt, and the tensor list must hash to
// the digest it came with; indices are left to check_layout(), which names
// what is wrong with tensor, range and ranks.
// Thread-safety: free functions over values.
#pragma once

#include <cstdint>
#include <vector>

#include "common/plan.h"
#include "common/reshard/layout.h"
#include "common/reshard/rank_plan.h"
#include "common/status.h"

namespace paramcast::reshard {

struct LayoutLimits {
  size_t max_tensors = kMaxPlanTensors;  // as many as one update may name
  size_t max_name_bytes = 1024;
  size_t max_dims = 8;
  size_t max_ranks = 1 << 16;
  size_t max_placements = 1 << 20;
  size_t max_mesh_ranks = 1 << 22;  // over all meshes
  size_t max_boxes = 1 << 20;       // explicit boxes over all placements
};

// xxh64 of the tensor list: names, dtypes, shapes, in order.
uint64_t tensors_digest(const std::vector<TensorSpec>& tensors);

// The message as it travels (a flat Cap'n Proto message).
std::vector<uint8_t> layout_bytes(const JobLayout& job);
// The PlanKey of `rank` in the job whose table is `bytes` (rank_plan.h).
PlanKey plan_key(const JobLayout& job, const std::vector<uint8_t>& bytes, int rank);
StatusOr<JobLayout> layout_from_bytes(const std::vector<uint8_t>& bytes, const LayoutLimits& limits = {});

}  // namespace paramcast::reshard
