#include "common/plan.h"

#include <algorithm>
#include <string_view>
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

namespace {
void put(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
void put_u64(std::string& out, uint64_t v) { put(out, &v, sizeof v); }
void put_list(std::string& out, const std::vector<int64_t>& v) {
  put_u64(out, v.size());
  put(out, v.data(), v.size() * sizeof(int64_t));
}
}  // namespace

void append_sharded_shape(const UpdatePlan& plan, std::string& out) {
  put_u64(out, plan.tensors.size());
  for (const auto& t : plan.tensors) {
    put_u64(out, t.name.size());
    out += t.name;
    put_u64(out, static_cast<uint64_t>(t.dtype));
    put_list(out, t.shape);
  }
  for (const auto* list : {&plan.holders, &plan.wanters}) {
    put_u64(out, list->size());
    for (const auto& h : *list) {
      put_u64(out, static_cast<uint64_t>(h.rank));
      put_u64(out, static_cast<uint64_t>(h.tensor));
      put_list(out, h.offsets);
      put_list(out, h.lengths);
    }
  }
}

uint64_t sharded_shape_digest(const UpdatePlan& plan) {
  std::string shape;
  append_sharded_shape(plan, shape);
  return xxh64(shape.data(), shape.size(), 0x5348415045ULL);
}

HeldShapeDigest::HeldShapeDigest() : tensors_(0x48454c44ULL), boxes_(0x424f58ULL) {}

void HeldShapeDigest::tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
  const uint64_t head[3] = {name.size(), static_cast<uint64_t>(dtype), shape.size()};
  tensors_.update(head, sizeof head);
  tensors_.update(name.data(), name.size());
  tensors_.update(shape.data(), shape.size() * sizeof(int64_t));
  ++counts_[0];
}

void HeldShapeDigest::box(uint32_t tensor, const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths) {
  const uint64_t head[3] = {tensor, offsets.size(), lengths.size()};
  boxes_.update(head, sizeof head);
  boxes_.update(offsets.data(), offsets.size() * sizeof(int64_t));
  boxes_.update(lengths.data(), lengths.size() * sizeof(int64_t));
  ++counts_[1];
}

uint64_t HeldShapeDigest::digest() const {
  const uint64_t parts[4] = {tensors_.digest(), boxes_.digest(), counts_[0], counts_[1]};
  const uint64_t d = xxh64(parts, sizeof parts);
  return d ? d : 1;
}

namespace {
// The specs' checks and per-tensor sizes, shared by both kinds of plan.
// `each(i, nbytes)` runs for every tensor once checked.
template <typename F>
StatusOr<UpdatePlan> plan_tensors(uint64_t version, const std::vector<TensorSpec>& tensors,
                                  const DataPlaneOptions& options, F&& each) {
  UpdatePlan plan;
  plan.version = version;
  plan.tensors = tensors;
  plan.checksum = options.checksum;
  std::unordered_set<std::string_view> names;  // views of `tensors`' names: no copy of each name an update
  names.reserve(tensors.size());
  plan.nbytes.reserve(tensors.size());
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
    each(plan, i, *n);
  }
  plan.manifest_hash = manifest_hash(tensors);
  return plan;
}
}  // namespace

StatusOr<UpdatePlan> build_streamed_plan(uint64_t version, const std::vector<TensorSpec>& tensors,
                                         const DataPlaneOptions& options) {
  auto plan = plan_tensors(version, tensors, options, [](UpdatePlan&, uint32_t, uint64_t) {});
  if (!plan.ok()) return plan;
  plan->streamed = true;
  // Whole 256-byte blocks, as build_plan's chunks; a packed tensor larger
  // than a bucket has one of its own.
  uint64_t bucket = std::max(kPackAlignment, options.bucket_bytes / kPackAlignment * kPackAlignment);
  for (uint64_t n : plan->nbytes)
    if (n < options.direct_min_bytes) bucket = std::max(bucket, (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment);
  plan->bucket_bytes = bucket;
  plan->covered.assign(plan->tensors.size(), 0);
  return plan;
}

Status check_bucket(const UpdatePlan& plan, const PlanBucket& b, std::vector<uint64_t>& covered) {
  const std::string v = "plan v" + std::to_string(plan.version);
  if (b.pieces.empty()) return protocol_error(v + ": a bucket without pieces");
  if (b.direct && (b.pieces.size() != 1 || b.pieces[0].length != b.bytes))
    return protocol_error(v + ": direct bucket must be one whole piece");
  size_t added = 0;  // pieces counted in `covered` so far: taken back if the bucket is refused
  auto refuse = [&](const std::string& why) {
    for (size_t i = 0; i < added; ++i) covered[b.pieces[i].tensor] -= b.pieces[i].length;
    return protocol_error(v + ": " + why);
  };
  for (const auto& piece : b.pieces) {
    if (piece.tensor >= plan.tensors.size())
      return refuse("piece names tensor #" + std::to_string(piece.tensor) + " of " + std::to_string(plan.tensors.size()));
    auto tend = checked_add(piece.tensor_offset, piece.length);
    auto bend = checked_add(piece.bucket_offset, piece.length);
    if (!tend || !bend || *tend > plan.nbytes[piece.tensor] || *bend > b.bytes)
      return refuse("piece of tensor '" + plan.tensors[piece.tensor].name + "' lies outside its tensor or bucket");
    // covered <= nbytes and length <= nbytes, so the sum is checked too.
    auto now = checked_add(covered[piece.tensor], piece.length);
    if (!now || *now > plan.nbytes[piece.tensor])
      return refuse("buckets cover more than the " + std::to_string(plan.nbytes[piece.tensor]) + " bytes of '" +
                    plan.tensors[piece.tensor].name + "'");
    // Each tensor's pieces follow each other (no byte covered twice, none
    // skipped), and a packed piece is a whole tensor.
    if (piece.tensor_offset != covered[piece.tensor])
      return refuse("piece of tensor '" + plan.tensors[piece.tensor].name + "' starts at byte " +
                    std::to_string(piece.tensor_offset) + ", expected " + std::to_string(covered[piece.tensor]));
    if (!b.direct && piece.length != plan.nbytes[piece.tensor])
      return refuse("packed piece of tensor '" + plan.tensors[piece.tensor].name + "' carries " +
                    std::to_string(piece.length) + " of its " + std::to_string(plan.nbytes[piece.tensor]) + " bytes");
    covered[piece.tensor] += piece.length;
    ++added;
  }
  return Status();
}

uint32_t UpdatePlan::bucket_unit(size_t k) const {
  uint64_t unit = 8;
  for (const auto& p : buckets[k].pieces) unit = std::min<uint64_t>(unit, dtype_size(tensors[p.tensor].dtype));
  // Every piece (and the bucket) must be whole units, whatever a peer's layout says.
  auto whole = [&](uint64_t u) {
    if (buckets[k].bytes % u) return false;
    for (const auto& p : buckets[k].pieces)
      if (p.bucket_offset % u || p.length % u) return false;
    return true;
  };
  while (unit > 1 && !whole(unit)) unit /= 2;
  return static_cast<uint32_t>(std::max<uint64_t>(unit, 1));
}

Status UpdatePlan::add_streamed_bucket(PlanBucket b) {
  if (!streamed) return internal_error("add_streamed_bucket on a plan that lists its buckets");
  if (b.bytes > streamed_bucket_bound())
    return protocol_error("plan v" + std::to_string(version) + ": streamed bucket " + std::to_string(buckets.size()) +
                          " of " + std::to_string(b.bytes) + " bytes exceeds the plan's bucket size " +
                          std::to_string(streamed_bucket_bound()));
  PC_RETURN_IF_ERROR(check_bucket(*this, b, covered));
  buckets.push_back(std::move(b));
  return Status();
}

Status UpdatePlan::end_stream() const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (covered[i] != nbytes[i])
      return protocol_error("plan v" + std::to_string(version) + ": the stream ended with " +
                            std::to_string(covered[i]) + " of the " + std::to_string(nbytes[i]) + " bytes of '" +
                            tensors[i].name + "' sent");
  return Status();
}

StatusOr<UpdatePlan> build_plan(uint64_t version, const std::vector<TensorSpec>& tensors,
                                const DataPlaneOptions& options) {
  // Chunks of a large tensor are whole 256-byte blocks (every element size divides them).
  const uint64_t bucket = std::max(kPackAlignment, options.bucket_bytes / kPackAlignment * kPackAlignment);
  PlanBucket open;
  auto flush = [&](UpdatePlan& plan) {
    if (!open.pieces.empty()) plan.buckets.push_back(std::move(open));
    open = PlanBucket();
  };
  auto plan = plan_tensors(version, tensors, options, [&](UpdatePlan& plan, uint32_t i, uint64_t n) {
    if (n >= options.direct_min_bytes && n > 0) {
      for (uint64_t off = 0; off < n; off += bucket) {
        const uint64_t len = std::min(bucket, n - off);
        plan.buckets.push_back(PlanBucket{len, true, {PlanPiece{i, off, 0, len}}});
      }
      return;
    }
    uint64_t at = (open.bytes + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
    if (!open.pieces.empty() && at + n > bucket) {
      flush(plan);
      at = 0;
    }
    open.pieces.push_back(PlanPiece{i, 0, at, n});
    open.bytes = at + n;
  });
  if (plan.ok()) flush(*plan);
  return plan;
}

}  // namespace paramcast
