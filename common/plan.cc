#include "common/plan.h"

#include <unordered_set>

#include "common/xxhash.h"

namespace paramcast {

std::string UpdatePlan::bucket_tensor_names(size_t bucket) const {
  std::string out;
  const auto& pieces = buckets.at(bucket).pieces;
  for (size_t i = 0; i < pieces.size() && i < 4; ++i) out += (i ? ", " : "") + tensors[pieces[i].tensor].name;
  if (pieces.size() > 4) out += ", +" + std::to_string(pieces.size() - 4) + " more";
  return out;
}

std::string Mismatch::to_string() const {
  switch (kind) {
    case Kind::kMissingName: return "'" + name + "': registered by the subscriber but missing from the update";
    case Kind::kUnexpectedName: return "'" + name + "': in the update but not registered by the subscriber";
    case Kind::kShape: return "'" + name + "': shape expected " + expected + ", got " + got;
    case Kind::kDType: return "'" + name + "': dtype expected " + expected + ", got " + got;
    case Kind::kDevice: return "'" + name + "': device expected " + expected + ", got " + got;
    case Kind::kOther: break;
  }
  return "'" + name + "': expected " + expected + ", got " + got;
}

uint64_t manifest_hash(const std::vector<TensorSpec>& tensors) {
  Xxh64 h(0x5041524d43415354ULL);
  for (const auto& t : tensors) {
    h.update(t.name.data(), t.name.size() + 0);
    const char sep = 0;
    h.update(&sep, 1);
    const uint8_t d = static_cast<uint8_t>(t.dtype);
    h.update(&d, 1);
    const uint64_t rank = t.shape.size();
    h.update(&rank, sizeof rank);
    h.update(t.shape.data(), t.shape.size() * sizeof(int64_t));
  }
  return h.digest();
}

StatusOr<UpdatePlan> build_plan(uint64_t version, const std::vector<TensorSpec>& tensors,
                                const DataPlaneOptions& options) {
  UpdatePlan plan;
  plan.version = version;
  plan.tensors = tensors;
  plan.checksum = options.checksum;
  const uint64_t bucket = options.bucket_bytes;
  std::unordered_set<std::string> names;
  PlanBucket open;
  auto flush = [&] {
    if (!open.pieces.empty()) plan.buckets.push_back(std::move(open));
    open = PlanBucket();
  };
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name.empty()) return invalid_argument("tensor #" + std::to_string(i) + " has an empty name");
    if (!names.insert(t.name).second) return invalid_argument("tensor name '" + t.name + "' appears twice in the update");
    auto n = t.nbytes();
    if (!n.ok()) return n.status();
    plan.nbytes.push_back(*n);
    auto total = checked_add(plan.total_bytes, *n);
    if (!total) return invalid_argument("total update size overflows 64 bits at tensor '" + t.name + "'");
    plan.total_bytes = *total;
    if (*n >= options.direct_min_bytes && *n > 0) {
      for (uint64_t off = 0; off < *n; off += bucket) {
        const uint64_t len = std::min(bucket, *n - off);
        plan.buckets.push_back(PlanBucket{len, true, {PlanPiece{i, off, 0, len}}});
      }
      continue;
    }
    uint64_t at = (open.bytes + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
    if (!open.pieces.empty() && at + *n > bucket) {
      flush();
      at = 0;
    }
    open.pieces.push_back(PlanPiece{i, 0, at, *n});
    open.bytes = at + *n;
  }
  flush();
  plan.manifest_hash = manifest_hash(tensors);
  return plan;
}

}  // namespace paramcast
