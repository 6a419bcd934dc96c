// UpdatePlan and Mismatch to and from their Cap'n Proto form (schemas/control.capnp).
// Apart from common/plan.h so that the public headers that use plans
// (trainer_side/publisher.h) never include Cap'n Proto.
//
// Thread-safety: free functions over values.
#pragma once

#include "common/plan.h"
#include "common/status.h"
#include "schemas/control.capnp.h"

namespace paramcast {

// A streamed plan's buckets are at most this large on the wire: a receiver
// stages two of them, so a hostile size must not make it allocate more.
inline constexpr uint64_t kMaxStreamedBucketBytes = 16ull << 30;
// The highest data-plane rank a sharded plan's holders may name.
inline constexpr uint32_t kMaxShardedRank = 65535;

// `shape_ref` non-zero (a sharded plan whose sharded_shape_digest it is):
// the reference form, for a member that holds a plan of that shape.
void plan_to_proto(const UpdatePlan& plan, proto::Plan::Builder out, uint64_t shape_ref = 0);
// One bucket's layout, as the Plan lists it or BucketLayouts announces it
// (unchecked: check_bucket in common/plan.h does that against the plan).
void bucket_to_proto(const PlanBucket& bucket, proto::Bucket::Builder out);
PlanBucket bucket_from_proto(proto::Bucket::Reader in);
// Reads and cross-checks a plan from the wire (pieces in range, sizes adding up, hash).
StatusOr<UpdatePlan> plan_from_proto(proto::Plan::Reader in);
// A plan in the reference form (Plan.shapeRef) read against `kept`, the
// member's plan of that shape (whose digest the caller matched): the kept
// tensors with this update's version, checksum and delta base, and each
// holding rank once with its seq and no region (tensor -1). The regions
// (holders' and wanters') stay the kept plan's: a member reads them there
// (its ShapeId), never copied an update. Refused where anything disagrees
// with `kept`.
StatusOr<UpdatePlan> plan_by_reference(proto::Plan::Reader in, const UpdatePlan& kept);

proto::MismatchKind mismatch_kind_to_proto(Mismatch::Kind k);
Mismatch::Kind mismatch_kind_from_proto(proto::MismatchKind k);

}  // namespace paramcast
