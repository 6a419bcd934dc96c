#include "inference_side/plan_check.h"

#include <string_view>
#include <unordered_set>

namespace paramcast {

std::vector<Mismatch> check_plan(const UpdatePlan& plan, const std::map<std::string, TensorView>& registry,
                                 bool has_callback) {
  std::vector<Mismatch> out;
  std::unordered_set<std::string_view> seen;  // views of the plan's names: no copy of each name an update
  seen.reserve(plan.tensors.size());
  for (const auto& t : plan.tensors) {
    auto it = registry.find(t.name);
    if (it == registry.end()) {
      if (!has_callback)
        out.push_back({Mismatch::Kind::kUnexpectedName, t.name, "no such tensor", "a tensor of shape " + t.shape_string()});
      continue;
    }
    seen.insert(t.name);
    const auto& reg = it->second.spec;
    if (reg.dtype != t.dtype)
      out.push_back({Mismatch::Kind::kDType, t.name, std::string(dtype_name(reg.dtype)), std::string(dtype_name(t.dtype))});
    if (reg.shape != t.shape) out.push_back({Mismatch::Kind::kShape, t.name, reg.shape_string(), t.shape_string()});
  }
  if (plan.partial) return out;  // a subset: the others keep their bytes
  for (const auto& [name, view] : registry)
    if (!seen.count(name))
      out.push_back({Mismatch::Kind::kMissingName, name, "a tensor of shape " + view.spec.shape_string(), "absent"});
  return out;
}

}  // namespace paramcast
