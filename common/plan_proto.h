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

void plan_to_proto(const UpdatePlan& plan, proto::Plan::Builder out);
// Reads and cross-checks a plan from the wire (pieces in range, sizes adding up, hash).
StatusOr<UpdatePlan> plan_from_proto(proto::Plan::Reader in);

proto::MismatchKind mismatch_kind_to_proto(Mismatch::Kind k);
Mismatch::Kind mismatch_kind_from_proto(proto::MismatchKind k);

}  // namespace paramcast
