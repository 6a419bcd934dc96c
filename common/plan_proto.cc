#include "common/plan_proto.h"

namespace paramcast {

proto::MismatchKind mismatch_kind_to_proto(Mismatch::Kind k) {
  switch (k) {
    case Mismatch::Kind::kMissingName: return proto::MismatchKind::MISSING_NAME;
    case Mismatch::Kind::kUnexpectedName: return proto::MismatchKind::UNEXPECTED_NAME;
    case Mismatch::Kind::kShape: return proto::MismatchKind::SHAPE_MISMATCH;
    case Mismatch::Kind::kDType: return proto::MismatchKind::DTYPE_MISMATCH;
    case Mismatch::Kind::kDevice: return proto::MismatchKind::DEVICE_MISMATCH;
    case Mismatch::Kind::kOther: break;
  }
  return proto::MismatchKind::OTHER;
}

Mismatch::Kind mismatch_kind_from_proto(proto::MismatchKind k) {
  switch (k) {
    case proto::MismatchKind::MISSING_NAME: return Mismatch::Kind::kMissingName;
    case proto::MismatchKind::UNEXPECTED_NAME: return Mismatch::Kind::kUnexpectedName;
    case proto::MismatchKind::SHAPE_MISMATCH: return Mismatch::Kind::kShape;
    case proto::MismatchKind::DTYPE_MISMATCH: return Mismatch::Kind::kDType;
    case proto::MismatchKind::DEVICE_MISMATCH: return Mismatch::Kind::kDevice;
    default: break;
  }
  return Mismatch::Kind::kOther;
}

PlanBucket bucket_from_proto(proto::Bucket::Reader in) {
  PlanBucket bucket;
  bucket.bytes = in.getBytes();
  bucket.direct = in.getDirect();
  for (auto p : in.getPieces())
    bucket.pieces.push_back(PlanPiece{p.getTensor(), p.getTensorOffset(), p.getBucketOffset(), p.getLength()});
  return bucket;
}

void bucket_to_proto(const PlanBucket& src, proto::Bucket::Builder dst) {
  dst.setBytes(src.bytes);
  dst.setDirect(src.direct);
  auto pieces = dst.initPieces(static_cast<unsigned>(src.pieces.size()));
  for (size_t p = 0; p < src.pieces.size(); ++p) {
    auto d = pieces[static_cast<unsigned>(p)];
    d.setTensor(src.pieces[p].tensor);
    d.setTensorOffset(src.pieces[p].tensor_offset);
    d.setBucketOffset(src.pieces[p].bucket_offset);
    d.setLength(src.pieces[p].length);
  }
}

void plan_to_proto(const UpdatePlan& plan, proto::Plan::Builder out) {
  out.setVersion(plan.version);
  out.setManifestHash(plan.manifest_hash);
  out.setTotalBytes(plan.total_bytes);
  out.setChecksum(plan.checksum == Checksum::kXxh64         ? proto::ChecksumKind::XXH64
                  : plan.checksum == Checksum::kXxh64Blocks ? proto::ChecksumKind::XXH64_BLOCKS
                                                            : proto::ChecksumKind::NONE);
  auto tensors = out.initTensors(static_cast<unsigned>(plan.tensors.size()));
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const auto& t = plan.tensors[i];
    auto e = tensors[static_cast<unsigned>(i)];
    e.setName(t.name);
    e.setDtype(std::string(dtype_name(t.dtype)));
    auto shape = e.initShape(static_cast<unsigned>(t.shape.size()));
    for (size_t d = 0; d < t.shape.size(); ++d) shape.set(static_cast<unsigned>(d), t.shape[d]);
    e.setNbytes(plan.nbytes[i]);
  }
  auto buckets = out.initBuckets(static_cast<unsigned>(plan.buckets.size()));
  for (size_t b = 0; b < plan.buckets.size(); ++b) bucket_to_proto(plan.buckets[b], buckets[static_cast<unsigned>(b)]);
  out.setStreamed(plan.streamed);
  out.setBucketBytes(plan.bucket_bytes);
  out.setPartial(plan.partial);
  out.setDeltaBase(plan.delta_base);
}

StatusOr<UpdatePlan> plan_from_proto(proto::Plan::Reader in) {
  UpdatePlan plan;
  plan.version = in.getVersion();
  plan.manifest_hash = in.getManifestHash();
  switch (in.getChecksum()) {
    case proto::ChecksumKind::NONE: plan.checksum = Checksum::kNone; break;
    case proto::ChecksumKind::XXH64: plan.checksum = Checksum::kXxh64; break;
    case proto::ChecksumKind::XXH64_BLOCKS: plan.checksum = Checksum::kXxh64Blocks; break;
    default:
      return invalid_argument("plan v" + std::to_string(in.getVersion()) + " names checksum kind " +
                              std::to_string(static_cast<unsigned>(in.getChecksum())) +
                              ", this build knows none, xxh64 and xxh64-blocks");
  }
  for (auto e : in.getTensors()) {
    TensorSpec t;
    t.name = e.getName().cStr();
    auto d = parse_dtype(e.getDtype().cStr());
    if (!d) return protocol_error("plan v" + std::to_string(plan.version) + ": tensor '" + t.name +
                                  "' has unknown dtype '" + e.getDtype().cStr() + "'");
    t.dtype = *d;
    for (int64_t v : e.getShape()) t.shape.push_back(v);
    auto n = t.nbytes();
    if (!n.ok()) return protocol_error("plan v" + std::to_string(plan.version) + ": " + n.status().message());
    if (*n != e.getNbytes())
      return protocol_error("plan v" + std::to_string(plan.version) + ": tensor '" + t.name + "' says " +
                            std::to_string(e.getNbytes()) + " bytes but its shape makes " + std::to_string(*n));
    auto total = checked_add(plan.total_bytes, *n);
    if (!total)
      return protocol_error("plan v" + std::to_string(plan.version) + ": total size overflows 64 bits at tensor '" +
                            t.name + "'");
    plan.nbytes.push_back(*n);
    plan.total_bytes = *total;
    plan.tensors.push_back(std::move(t));
  }
  if (plan.total_bytes != in.getTotalBytes())
    return protocol_error("plan v" + std::to_string(plan.version) + ": total bytes disagree with the tensors");
  plan.streamed = in.getStreamed();
  plan.partial = in.getPartial();
  plan.delta_base = in.getDeltaBase();
  plan.bucket_bytes = in.getBucketBytes();
  std::vector<uint64_t> covered(plan.tensors.size(), 0);
  if (plan.streamed) {
    if (in.getBuckets().size() != 0)
      return protocol_error("plan v" + std::to_string(plan.version) + ": a streamed plan lists buckets");
    if (plan.bucket_bytes == 0 || plan.bucket_bytes > kMaxStreamedBucketBytes)
      return protocol_error("plan v" + std::to_string(plan.version) + ": streamed bucket size " +
                            std::to_string(plan.bucket_bytes) + " is not in 1.." +
                            std::to_string(kMaxStreamedBucketBytes));
    plan.covered = std::move(covered);
  } else {
    for (auto b : in.getBuckets()) {
      auto bucket = bucket_from_proto(b);
      PC_RETURN_IF_ERROR(check_bucket(plan, bucket, covered));
      plan.buckets.push_back(std::move(bucket));
    }
    for (size_t i = 0; i < covered.size(); ++i)
      if (covered[i] != plan.nbytes[i])
        return protocol_error("plan v" + std::to_string(plan.version) + ": buckets cover " +
                              std::to_string(covered[i]) + " of the " + std::to_string(plan.nbytes[i]) +
                              " bytes of '" + plan.tensors[i].name + "'");
  }
  if (manifest_hash(plan.tensors) != plan.manifest_hash)
    return protocol_error("plan v" + std::to_string(plan.version) + ": manifest hash does not match its tensors");
  return plan;
}

}  // namespace paramcast
