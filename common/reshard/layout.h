// JobLayout: a many-sender job stated by rule, not by list.
//
// plan_reshard() takes one region per tensor per rank: at 45k-70k tensors
// on 64-256 ranks that is millions of regions, tens of MiB on the wire and
// minutes of planning. Here the same job is a table of a few rules: each
// tensor names one Placement over the ranks that hold it and one over the
// ranks that want it, and each Placement is arithmetic over a Mesh:
//   - Shard(dim) over `parts` ranks, torch.chunk's split (each part
//     ceil(n / parts) rows, the last ones short or empty), of each fused
//     segment along dim separately (a vLLM merged weight's gate|up);
//     parts = 1 is the whole tensor;
//   - repeated over `replicas` copies (data-parallel trainer replicas,
//     engine replicas);
//   - explicit boxes, one rank each, for what the rules cannot say.
// FSDP2 Shard(0) over M ranks, a TP slice t of T, experts whole on their
// EP rank, Replicate: each is one Placement, shared by every tensor that
// lies the same way, so the table is O(tensors) small integers plus
// O(distinct placements x mesh sizes).
//
// check_layout() checks the whole job in O(tensors + placements x mesh):
// every wanted element held by someone, holders that never overlap (by
// construction for rules, checked for explicit boxes), ranks in the group,
// segments that add up; each problem named with tensor, range and ranks.
// expand() writes the job as plan_reshard()'s explicit manifests: the
// reference the property tests compare rank_plan() (rank_plan.h) with.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/reshard/region.h"
#include "common/reshard/reshard_plan.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::reshard {

// The ranks a rule spreads a tensor over: `parts` ranks share each copy,
// `replicas` copies; ranks[q * parts + j] holds (or wants) part j of copy q.
struct Mesh {
  int parts = 1;
  int replicas = 1;
  std::vector<int> ranks;
  bool operator==(const Mesh&) const = default;
};

// One explicit box and the one rank that holds (or wants) it.
struct RankBox {
  int rank = -1;
  Region box;
  bool operator==(const RankBox&) const = default;
};

// How a tensor lies over its mesh: the rule, or explicit boxes.
struct Placement {
  uint32_t mesh = 0;
  int dim = 0;                    // Shard(dim); any dim when parts = 1
  std::vector<int64_t> segments;  // fused segments along dim (sizes); empty: one, the whole dim
  std::vector<RankBox> boxes;     // non-empty: explicit (mesh, dim, segments unused)
  bool is_explicit() const { return !boxes.empty(); }
  bool operator==(const Placement&) const = default;
};

inline constexpr uint32_t kNobody = 0xffffffffu;

struct JobLayout {
  std::vector<TensorSpec> tensors;      // the job's tensor list
  std::vector<std::string> rank_names;  // by data-plane rank: its size is the group's
  std::vector<Mesh> meshes;
  std::vector<Placement> placements;
  std::vector<uint32_t> held;    // per tensor: its placement over the ranks that hold it
  std::vector<uint32_t> wanted;  // per tensor: over the ranks that want it, or kNobody
  int world() const { return static_cast<int>(rank_names.size()); }
  std::string name(int rank) const;
};

// One segment of a placement along its dim: [start, start + size).
struct Segment {
  int64_t start = 0;
  int64_t size = 0;
};
// The segments of `p` for a tensor of `shape` (one, the whole dim, when
// `p` states none).
std::vector<Segment> segments_of(const Placement& p, const std::vector<int64_t>& shape);
// torch.chunk's rows of part j of `parts` in a segment: [first, first + n).
Segment chunk_of(const Segment& s, int parts, int j);
// The box part j of a rule placement keeps of segment s (may be empty).
Region part_box(const Placement& p, const std::vector<int64_t>& shape, const Segment& s, int parts, int j);

// Every problem of the job (first 16 listed), INVALID_ARGUMENT; OK if none.
Status check_layout(const JobLayout& job);

// The same job as explicit manifests, one per rank (tests, the reference).
std::vector<RankManifest> expand(const JobLayout& job);

}  // namespace paramcast::reshard
