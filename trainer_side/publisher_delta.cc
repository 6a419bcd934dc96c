// Delta updates on the trainer's side: whether an update can go as a delta
// (every member at the baseline version, able to apply one), the baseline
// prepared for it, and each bucket's encoding announced to the group. The
// encoding itself is common/delta/; the buckets are BucketSender's and
// StreamSender's.
#include "common/control/messages.h"
#include "common/log.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

// Announces bucket k's encoding to the group, before its broadcast.
std::function<void(size_t, const delta::Header&)> PublisherImpl::delta_hook(const UpdatePlan& plan, const MoveState& m) {
  return [this, &plan, &m](size_t k, const delta::Header& h) {
    server_.send_to(m.group, control::make_message(m.epoch, server_.incarnation(), [&](auto b) {
                      auto d = b.initBucketDelta();
                      d.setVersion(plan.version);
                      d.setBucket(static_cast<uint32_t>(k));
                      d.setKind(static_cast<proto::DeltaKind>(static_cast<uint16_t>(h.kind)));
                      d.setUnit(h.unit);
                      d.setChanged(h.changed);
                      d.setWireBytes(h.wire_bytes);
                      d.setPieceHash(h.piece_hash == Checksum::kXxh64Blocks ? proto::ChecksumKind::XXH64_BLOCKS
                                                                            : proto::ChecksumKind::XXH64);
                      auto list = d.initPieceHashes(static_cast<unsigned>(h.piece_hashes.size()));
                      for (size_t i = 0; i < h.piece_hashes.size(); ++i)
                        list.set(static_cast<unsigned>(i), h.piece_hashes[i]);
                    }));
  };
}

// The baseline is kept (and deltas sent) with publisher.delta on, where the
// codec runs on the publisher's memory (host, or CUDA in a CUDA build).
bool PublisherImpl::keeps_baseline() const { return cfg_.publisher.delta != DeltaMode::kOff && codec_ != nullptr; }

// A delta goes only to a group whose every member holds the baseline
// version, consistent, and can apply one; anything else makes this update
// dense for the whole group (and says why), and the next can be a delta.
void PublisherImpl::decide_delta(UpdatePlan& plan, UpdateResult& r) {
  plan.delta_base = 0;
  baseline_fresh_ = false;
  if (cfg_.publisher.delta == DeltaMode::kOff) return;
  const uint64_t base = baseline_.version();
  std::string why;
  if (!keeps_baseline()) {
    why = "no delta codec for " + cfg_.publisher.device.to_string() + " memory in this build";
  } else if (baseline_.version() == 0) {
    why = "no baseline yet";
  } else if (baseline_.manifest_hash() != plan.manifest_hash) {
    why = "the manifest changed";
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : group_) {
      auto m = server_.member(id);
      if (!m) why = id + " gone";
      else if (!m->delta)
        why = id + " cannot apply deltas (a callback engine without subscriber.delta_baseline, or a CUDA engine "
                   "with a callback or without CUDA in its build)";
      else if (m->state == proto::WeightState::DIRTY)
        why = id + " dirty (v" + std::to_string(m->dirty_version) + " incomplete)";
      else if (m->state != proto::WeightState::CONSISTENT || m->weight_version != base)
        why = id + " at v" + std::to_string(m->state == proto::WeightState::CONSISTENT ? m->weight_version : 0);
      if (!why.empty()) break;
    }
  }
  if (keeps_baseline()) {
    // Written by this update; a baseline once every member applied it.
    if (Status s = baseline_.prepare(plan); s.ok()) {
      baseline_fresh_ = true;
    } else {
      PC_WARN("publisher: update v" << plan.version << ": " << s.message());
      if (why.empty()) why = s.message();
    }
  }
  if (why.empty()) {
    plan.delta_base = base;
    return;
  }
  r.dense_because = why;
  // The first update of a run has no baseline: that is no news.
  if (base == 0) PC_DEBUG("publisher: update v" << plan.version << ": dense (" << why << ")");
  else PC_INFO("publisher: update v" << plan.version << ": dense (" << why << ")");
}

}  // namespace paramcast
