// PlanCheck: whether this engine can take an UpdatePlan, decided before any
// byte moves. Every registered destination must appear with the same dtype
// and shape; a tensor without a destination needs a tensor callback. Returns
// every disagreement, not just the first.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/plan.h"
#include "common/tensor.h"

namespace paramcast {

std::vector<Mismatch> check_plan(const UpdatePlan& plan, const std::map<std::string, TensorView>& registry,
                                 bool has_callback);

}  // namespace paramcast
