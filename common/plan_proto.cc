#include "common/plan_proto.h"

#include <map>
#include <set>

#include "common/xxhash.h"

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

namespace {

unsigned ranks_of(const std::vector<UpdatePlan::Holding>& list) {
  std::set<int> ranks;
  for (const auto& h : list) ranks.insert(h.rank);
  return static_cast<unsigned>(ranks.size());
}

void holdings_to_proto(const std::vector<UpdatePlan::Holding>& list, capnp::List<proto::RankHoldings>::Builder ranks) {
  std::map<int, std::vector<const UpdatePlan::Holding*>> by_rank;
  for (const auto& h : list) by_rank[h.rank].push_back(&h);
  unsigned i = 0;
  for (const auto& [rank, holds] : by_rank) {
    auto r = ranks[i++];
    r.setRank(static_cast<uint32_t>(rank));
    r.setSeq(holds.front()->seq);
    unsigned n = 0;
    for (const auto* h : holds) n += h->tensor >= 0;
    auto list = r.initHolds(n);
    unsigned j = 0;
    for (const auto* h : holds) {
      if (h->tensor < 0) continue;
      auto e = list[j++];
      e.setTensor(static_cast<uint32_t>(h->tensor));
      auto off = e.initOffsets(static_cast<unsigned>(h->offsets.size()));
      for (size_t d = 0; d < h->offsets.size(); ++d) off.set(static_cast<unsigned>(d), h->offsets[d]);
      auto len = e.initLengths(static_cast<unsigned>(h->lengths.size()));
      for (size_t d = 0; d < h->lengths.size(); ++d) len.set(static_cast<unsigned>(d), h->lengths[d]);
    }
  }
}

// A sharded plan's holders: ranks in range and listed once, each region
// of its tensor's rank (bounds, overlaps and coverage are the many-sender
// plan's checks, common/reshard/).
Status regions_from_proto(capnp::List<proto::RankHoldings>::Reader list, const char* what, UpdatePlan& plan,
                          std::vector<UpdatePlan::Holding>& into) {
  const std::string where = "plan v" + std::to_string(plan.version);
  std::set<uint32_t> seen;
  for (auto r : list) {
    const std::string who = std::string(what) + " rank " + std::to_string(r.getRank());
    if (r.getRank() > kMaxShardedRank || !seen.insert(r.getRank()).second)
      return protocol_error(where + ": " + who + " is out of range or listed twice");
    if (r.getHolds().size() == 0) into.push_back({static_cast<int>(r.getRank()), -1, {}, {}, r.getSeq(), std::nullopt});
    for (auto h : r.getHolds()) {
      if (h.getTensor() >= plan.tensors.size())
        return protocol_error(where + ": " + who + " names tensor #" + std::to_string(h.getTensor()) + " of " +
                              std::to_string(plan.tensors.size()));
      const auto& spec = plan.tensors[h.getTensor()];
      if (h.getOffsets().size() != spec.shape.size() || h.getLengths().size() != spec.shape.size())
        return protocol_error(where + ": " + who + " gives '" + spec.name + "' a region of another rank than its shape's");
      UpdatePlan::Holding out{static_cast<int>(r.getRank()), h.getTensor(), {}, {}, r.getSeq(), std::nullopt};
      for (int64_t v : h.getOffsets()) out.offsets.push_back(v);
      for (int64_t v : h.getLengths()) out.lengths.push_back(v);
      into.push_back(std::move(out));
    }
  }
  return Status();
}

// A sharded plan's holders and wanters: ranks in range and listed once,
// each region of its tensor's rank (bounds, overlaps and coverage are the
// many-sender plan's checks, common/reshard/).
Status holders_from_proto(proto::Plan::Reader in, UpdatePlan& plan) {
  const std::string where = "plan v" + std::to_string(plan.version);
  if (plan.streamed || in.getBuckets().size() != 0)
    return protocol_error(where + ": a sharded plan is not streamed and lists no buckets");
  if (plan.delta_base >= plan.version)
    return protocol_error(where + ": a delta onto v" + std::to_string(plan.delta_base) + ", not an earlier version");
  PC_RETURN_IF_ERROR(regions_from_proto(in.getHolders(), "holder", plan, plan.holders));
  PC_RETURN_IF_ERROR(regions_from_proto(in.getWanters(), "wanting", plan, plan.wanters));
  bool zero = false;
  for (const auto& h : plan.holders) zero |= h.rank == 0;
  if (!zero) return protocol_error(where + ": a sharded plan lists no holdings of rank 0 (the publisher)");
  for (const auto& w : plan.wanters)
    for (const auto& h : plan.holders)
      if (w.rank == h.rank) return protocol_error(where + ": rank " + std::to_string(w.rank) + " both holds and wants");
  return Status();
}

// The holding ranks and their seqs, without regions (the reference form).
void holder_seqs_to_proto(const std::vector<UpdatePlan::Holding>& list, capnp::List<proto::RankHoldings>::Builder ranks) {
  std::map<int, uint64_t> seqs;
  for (const auto& h : list) seqs.emplace(h.rank, h.seq);
  unsigned i = 0;
  for (const auto& [rank, seq] : seqs) {
    ranks[i].setRank(static_cast<uint32_t>(rank));
    ranks[i++].setSeq(seq);
  }
}

StatusOr<Checksum> checksum_from_proto(proto::Plan::Reader in) {
  switch (in.getChecksum()) {
    case proto::ChecksumKind::NONE: return Checksum::kNone;
    case proto::ChecksumKind::XXH64: return Checksum::kXxh64;
    case proto::ChecksumKind::XXH64_BLOCKS: return Checksum::kXxh64Blocks;
    default: break;
  }
  return invalid_argument("plan v" + std::to_string(in.getVersion()) + " names checksum kind " +
                          std::to_string(static_cast<unsigned>(in.getChecksum())) +
                          ", this build knows none, xxh64 and xxh64-blocks");
}

}  // namespace

void plan_to_proto(const UpdatePlan& plan, proto::Plan::Builder out, uint64_t shape_ref) {
  out.setVersion(plan.version);
  out.setManifestHash(plan.manifest_hash);
  out.setTotalBytes(plan.total_bytes);
  out.setChecksum(plan.checksum == Checksum::kXxh64         ? proto::ChecksumKind::XXH64
                  : plan.checksum == Checksum::kXxh64Blocks ? proto::ChecksumKind::XXH64_BLOCKS
                                                            : proto::ChecksumKind::NONE);
  if (plan.sharded && shape_ref != 0) {
    out.setPartial(plan.partial);
    out.setDeltaBase(plan.delta_base);
    out.setSharded(true);
    out.setShapeRef(shape_ref);
    holder_seqs_to_proto(plan.holders, out.initHolders(ranks_of(plan.holders)));
    return;
  }
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
  out.setSharded(plan.sharded);
  if (!plan.sharded) return;
  holdings_to_proto(plan.holders, out.initHolders(ranks_of(plan.holders)));
  holdings_to_proto(plan.wanters, out.initWanters(ranks_of(plan.wanters)));
}


StatusOr<UpdatePlan> plan_from_proto(proto::Plan::Reader in) {
  UpdatePlan plan;
  plan.version = in.getVersion();
  plan.manifest_hash = in.getManifestHash();
  auto checksum = checksum_from_proto(in);
  if (!checksum.ok()) return checksum.status();
  plan.checksum = *checksum;
  if (in.getShapeRef() != 0)
    return protocol_error("plan v" + std::to_string(plan.version) + " refers to a plan by its shape (" +
                          digest_hex(in.getShapeRef()) + "), and this member holds none");
  if (in.getTensors().size() > kMaxPlanTensors)
    return protocol_error("plan v" + std::to_string(plan.version) + " names " + std::to_string(in.getTensors().size()) +
                          " tensors, more than the " + std::to_string(kMaxPlanTensors) + " an update may name");
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
  if (in.getSharded()) {
    plan.sharded = true;
    PC_RETURN_IF_ERROR(holders_from_proto(in, plan));
  } else if (plan.streamed) {
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

StatusOr<UpdatePlan> plan_by_reference(proto::Plan::Reader in, const UpdatePlan& kept) {
  const std::string where = "plan v" + std::to_string(in.getVersion()) + " (by reference to " +
                            digest_hex(in.getShapeRef()) + ")";
  if (!in.getSharded() || !kept.sharded || in.getTensors().size() != 0 || in.getWanters().size() != 0 ||
      in.getBuckets().size() != 0)
    return protocol_error(where + ": a reference names a sharded plan's shape and lists no tensors, regions or buckets");
  if (in.getManifestHash() != kept.manifest_hash || in.getTotalBytes() != kept.total_bytes)
    return protocol_error(where + ": its manifest hash or total bytes differ from the kept plan's");
  auto checksum = checksum_from_proto(in);
  if (!checksum.ok()) return checksum.status();
  // Every field of the kept plan but its regions (a copy of 50,000 tensors'
  // holders was a quarter of a trainer rank's CPU an update).
  UpdatePlan plan;
  plan.manifest_hash = kept.manifest_hash;
  plan.tensors = kept.tensors;
  plan.nbytes = kept.nbytes;
  plan.buckets = kept.buckets;
  plan.total_bytes = kept.total_bytes;
  plan.streamed = kept.streamed;
  plan.bucket_bytes = kept.bucket_bytes;
  plan.sharded = true;
  plan.covered = kept.covered;
  plan.version = in.getVersion();
  plan.checksum = *checksum;
  plan.partial = in.getPartial();
  plan.delta_base = in.getDeltaBase();
  if (plan.delta_base >= plan.version)
    return protocol_error(where + ": a delta onto v" + std::to_string(plan.delta_base) + ", not an earlier version");
  std::map<int, uint64_t> seqs;
  for (auto r : in.getHolders()) {
    if (r.getHolds().size() != 0 || !seqs.emplace(static_cast<int>(r.getRank()), r.getSeq()).second)
      return protocol_error(where + ": holder rank " + std::to_string(r.getRank()) + " is listed twice or with regions");
  }
  for (const auto& h : kept.holders)
    if (!seqs.count(h.rank))
      return protocol_error(where + ": holder rank " + std::to_string(h.rank) + " of the kept plan has no seq");
  if (seqs.size() != ranks_of(kept.holders))
    return protocol_error(where + ": it lists holder ranks the kept plan does not have");
  for (const auto& [rank, seq] : seqs) plan.holders.push_back({rank, -1, {}, {}, seq});
  return plan;
}

}  // namespace paramcast
