// UpdatePlan: what one weight update will move and how, decided by the
// publisher before any byte moves and checked by every subscriber.
//
// Layout: tensors at least `direct_min_bytes` large travel alone ("direct"
// buckets, straight from the trainer's buffer into a registered destination,
// no staging); a tensor larger than a bucket is split into bucket-sized
// direct chunks; smaller tensors are packed, 256-byte aligned, into buckets of
// at most `bucket_bytes`. The order of buckets is the order of broadcasts.
//
// A streamed plan (Publisher::begin_update) names its tensors up front but
// not its buckets: the publisher lays them out as the trainer hands it
// tensors, in arrival order, and announces each before its broadcast;
// add_streamed_bucket() checks and appends one, end_stream() checks that
// every tensor was covered. A partial plan carries a subset of the engines'
// tensors (the others keep their bytes).
//
// Thread-safety: plain values. The wire form is in common/plan_proto.h: this
// header reaches the public API (publisher.h) and names no Cap'n Proto type.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/xxhash.h"

namespace paramcast {

inline constexpr uint64_t kPackAlignment = 256;
// The most tensors one update may name: 262,144, 3.7 x the largest model
// this serves (Kimi-K2, about 70,000). A member's list longer than it (a
// trainer rank's Holdings, an engine's Wants, a Plan) is refused before
// anything is built from it, so that no one message can make its receiver
// build more than a job of this size would.
inline constexpr size_t kMaxPlanTensors = size_t{1} << 18;

struct PlanPiece {
  uint32_t tensor = 0;
  uint64_t tensor_offset = 0;
  uint64_t bucket_offset = 0;
  uint64_t length = 0;
};

struct PlanBucket {
  uint64_t bytes = 0;
  bool direct = false;
  std::vector<PlanPiece> pieces;
};

// A new field goes into plan_by_reference (common/plan_proto.cc) too: it
// copies a kept plan's fields but its regions.
struct UpdatePlan {
  uint64_t version = 0;
  uint64_t manifest_hash = 0;
  std::vector<TensorSpec> tensors;
  std::vector<uint64_t> nbytes;  // per tensor
  std::vector<PlanBucket> buckets;
  Checksum checksum = Checksum::kNone;
  uint64_t total_bytes = 0;
  bool streamed = false;      // buckets arrive one by one (add_streamed_bucket)
  uint64_t bucket_bytes = 0;  // streamed: no bucket is larger
  bool partial = false;       // a subset of the engines' tensors
  uint64_t delta_base = 0;    // non-zero: a delta update against this version (common/delta/)
  // A many-sender update (common/reshard/sharded_update.h): no buckets; the
  // trainer ranks listed here hold the tensors' bytes between them (a rank
  // with no region is listed too: it sends nothing), every other rank of the
  // group receives every tensor whole.
  struct Holding {
    int rank = 0;
    int64_t tensor = -1;  // -1: none (a trainer rank that holds nothing of this update)
    std::vector<int64_t> offsets, lengths;
    uint64_t seq = 0;  // holders: the trainer rank's publish call the regions came from
    // Holders, on the publisher only (never on the wire to engines): the
    // xxh64 of the region's bytes, where the rank gave one (checksums on).
    std::optional<uint64_t> digest = std::nullopt;
  };
  bool sharded = false;
  std::vector<Holding> holders;
  // Receiving ranks that want slices (tensor parallelism): each wants
  // exactly its listed regions; a receiving rank not listed wants every
  // tensor whole.
  std::vector<Holding> wanters;
  // The unit a delta of bucket k compares in: its tensors' smallest element size.
  uint32_t bucket_unit(size_t k) const;
  // Streamed plans: checks bucket `b` against the tensors (pieces inside
  // their tensor and the bucket, a tensor's bytes covered at most once, no
  // bucket above bucket_bytes) and appends it; and, once the publisher says
  // the stream ended, that every tensor was covered whole.
  Status add_streamed_bucket(PlanBucket b);
  Status end_stream() const;
  // Streamed plans: the largest bucket the stream can send (what each side
  // stages): its bucket size, or less for a small update (every tensor and
  // its alignment gap).
  uint64_t streamed_bucket_bound() const {
    return std::min<uint64_t>(bucket_bytes, total_bytes + tensors.size() * kPackAlignment);
  }
  std::vector<uint64_t> covered;  // streamed: bytes of each tensor laid out so far
  // Names of the tensors a bucket carries, for error messages ("a, b, c" / "+N more").
  std::string bucket_tensor_names(size_t bucket) const;
  // If the non-empty pieces of packed bucket `bucket` tile it without gaps
  // and their buffers lie back to back in memory in the same order (tensors
  // kept in one flat buffer or arena), returns the address of the first: the
  // bucket then moves in place, without staging. Every byte of the region
  // belongs to one of the tensors, so nothing else is read or written.
  // `buffer(tensor)` gives a tensor's buffer, or null when it has none.
  template <typename F>
  uint8_t* in_place_base(size_t bucket, F&& buffer) const {
    uint8_t* base = nullptr;
    uint64_t next_offset = 0;
    uint8_t* next_address = nullptr;
    for (const auto& p : buckets[bucket].pieces) {
      if (p.length == 0) continue;
      uint8_t* at = static_cast<uint8_t*>(buffer(p.tensor));
      if (!at || p.bucket_offset != next_offset) return nullptr;
      at += p.tensor_offset;
      if (base && at != next_address) return nullptr;
      if (!base) base = at;
      next_offset = p.bucket_offset + p.length;
      next_address = at + p.length;
    }
    // The pieces must reach the bucket's end: a bucket rounded up past its
    // last piece (an empty tensor last) would read or write past it.
    return next_offset == buckets[bucket].bytes ? base : nullptr;
  }
};

// One disagreement between a plan and what a subscriber can receive.
struct Mismatch {
  enum class Kind { kMissingName, kUnexpectedName, kShape, kDType, kDevice, kOther };
  Kind kind = Kind::kOther;
  std::string name;
  std::string expected;
  std::string got;
  std::string to_string() const;
  bool operator==(const Mismatch&) const = default;
};

uint64_t manifest_hash(const std::vector<TensorSpec>& tensors);

// A sharded plan's shape, the part its moves are derived from and that
// stays while the job does: its tensors (names, dtypes, shapes) and the
// holders' and wanters' regions (ranks, boxes), written out byte for byte
// (the holders' seqs and digests aside: they change with every call).
// ShardedMovesCache compares it; its xxh64 names a plan a member already
// holds, so that the next update of the same shape sends only that digest
// (Plan.shapeRef, docs/protocol.md).
void append_sharded_shape(const UpdatePlan& plan, std::string& out);
uint64_t sharded_shape_digest(const UpdatePlan& plan);

// The digest that names a trainer rank's stated part of a sharded update
// (its Holdings): each tensor's name, dtype and full shape, and each box it
// holds (the tensor's index in its list, offsets, lengths), in order. The
// rank that states a part and rank 0 that keeps it compute it alike, so
// that a later call stating the same part refers to it by this digest
// (Holdings.shapeRef). Tensors and boxes are hashed apart: their calls may
// interleave.
class HeldShapeDigest {
 public:
  HeldShapeDigest();
  void tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape);
  void box(uint32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths);
  uint64_t digest() const;  // never 0 (0 is "no reference" on the wire)

 private:
  Xxh64 tensors_;
  Xxh64 boxes_;
  uint64_t counts_[2] = {0, 0};
};

// Validates the specs (non-empty unique names, sizes without overflow) and lays out buckets.
StatusOr<UpdatePlan> build_plan(uint64_t version, const std::vector<TensorSpec>& tensors,
                                const DataPlaneOptions& options);
// The same checks for a streamed plan: the tensors only, buckets to follow.
StatusOr<UpdatePlan> build_streamed_plan(uint64_t version, const std::vector<TensorSpec>& tensors,
                                         const DataPlaneOptions& options);
// Checks one bucket's pieces against `plan`'s tensors (shared by received
// plans and streamed buckets); adds each piece's length to covered[tensor].
Status check_bucket(const UpdatePlan& plan, const PlanBucket& b, std::vector<uint64_t>& covered);

}  // namespace paramcast
