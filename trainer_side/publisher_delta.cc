// Delta updates on the trainer's side: whether an update can go as a delta
// (every member at the baseline version, able to apply one), the baseline
// prepared for it, and each bucket's encoding announced to the group; a
// sharded update's delta base (decide_sharded_delta). The
// encoding itself is common/delta/; the buckets are BucketSender's and
// StreamSender's.
#include "common/control/log_guard.h"
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

// Why member `id` cannot take a delta onto `base` now ("" if it can): it
// left, refused a delta it claimed (until it applied a dense version and
// holds the base again), cannot apply deltas, or is not consistent at the
// base with buffers (or its callback's copy) still holding it. The one
// rule for broadcast and sharded updates alike.
std::string PublisherImpl::delta_blocker_locked(const std::string& id, uint64_t base) {
  auto m = server_.member(id);
  // A member that refused a delta it claimed has no claim until it
  // applied a dense version (that one, planned again, or a later one)
  // and holds the baseline again.
  auto refusal = delta_refusals_.find(id);
  if (m && refusal != delta_refusals_.end() && refusal->second.dropped && m->state == proto::WeightState::CONSISTENT &&
      m->weight_version >= refusal->second.version && m->weight_version == base && m->delta_base == base)
    refusal->second.dropped = false;
  if (!m) return id + " gone";
  if (refusal != delta_refusals_.end() && refusal->second.dropped)
    return id + " refused the delta of v" + std::to_string(refusal->second.version) +
           " it had claimed it could take (dense until it applied a dense version)";
  if (!m->delta)
    return id + " cannot apply deltas (a callback engine without subscriber.delta_baseline, or a CUDA engine "
                "with a callback or without CUDA in its build)";
  if (m->state == proto::WeightState::DIRTY) return id + " dirty (v" + std::to_string(m->dirty_version) + " incomplete)";
  if (m->state != proto::WeightState::CONSISTENT || m->weight_version != base)
    return id + " at v" + std::to_string(m->state == proto::WeightState::CONSISTENT ? m->weight_version : 0);
  if (m->delta_base != base)
    return id + " cannot apply a delta onto v" + std::to_string(base) +
           " now (a buffer registered since, or its callback's copy at another version)";
  return "";
}

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
    for (const auto& id : group_)
      if (why = delta_blocker_locked(id, base); !why.empty()) break;
  }
  if (keeps_baseline()) {
    // Written by this update; a baseline once every member applied it. A
    // new manifest's baseline is made once the plan is accepted
    // (ready_baseline): a refused plan leaves the old one as it was.
    baseline_fresh_ = true;
    if (baseline_.manifest_hash() == plan.manifest_hash) {
      if (Status s = baseline_.prepare(plan); !s.ok()) {
        baseline_fresh_ = false;
        PC_WARN("publisher: update v" << plan.version << ": " << s.message());
        if (why.empty()) why = s.message();
      }
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

// The baseline this update writes, once its plan was accepted (or went out
// precommitted): made for a new manifest now (the bytes of the old one are
// dropped only here).
void PublisherImpl::ready_baseline(const UpdatePlan& plan) {
  baseline_.begin_writing();
  if (!baseline_fresh_ || baseline_.manifest_hash() == plan.manifest_hash) return;
  if (Status s = baseline_.prepare(plan); !s.ok()) {
    baseline_fresh_ = false;
    PC_WARN("publisher: update v" << plan.version << ": " << s.message() << "; no baseline after it");
  }
}

namespace {
// A member whose only objection to a plan is that it cannot take it as a
// delta (check_plan's "<delta>" mismatch).
bool refused_only_the_delta(const SubscriberOutcome& o) {
  if (o.status.ok() || o.mismatches.empty()) return false;
  for (const auto& m : o.mismatches)
    if (m.name != "<delta>") return false;
  return true;
}
}  // namespace

std::string PublisherImpl::refused_by_every_member(const UpdatePlan& plan, const UpdateResult& r) const {
  if (!plan.delta_base || r.ok() || r.subscribers.empty()) return "";
  std::string who;
  for (const auto& o : r.subscribers) {
    if (!refused_only_the_delta(o)) return "";
    who += (who.empty() ? "" : ", ") + o.worker_id;
  }
  return who;
}

bool PublisherImpl::note_delta_refusal(const SubscriberOutcome& o, const UpdatePlan& plan) {
  auto m = server_.member(o.worker_id);
  if (!m || !m->delta) return false;  // it never claimed it could: no lie
  DeltaRefusal& d = delta_refusals_[o.worker_id];
  d.version = plan.version;
  d.dropped = true;
  // Its own answer says why: another version, dirty, a buffer registered
  // just before the plan, its callback's copy elsewhere (an honest race with
  // its heartbeat: no strike). Holding exactly the base, consistent, and
  // refusing it contradicts the claim: that counts.
  const std::string got = o.mismatches.front().got;
  const bool unexplained = got == "version " + std::to_string(plan.delta_base) + ", consistent";
  if (unexplained) ++d.count;
  PC_WARN("publisher: subscriber '" << o.worker_id << "' refused the delta of v" << plan.version
                                    << " it had claimed it could take (" << control::printable(got)
                                    << (unexplained ? "; unexplained refusal " + std::to_string(d.count) : "")
                                    << "); dense updates for it until it applied one");
  return d.count >= 2;
}

void PublisherImpl::strike_delta_refusers(const std::vector<std::string>& ids) {
  for (const auto& id : ids)
    groups_.quarantine(id, "refused twice, without a reason, deltas it claimed it could take (control-plane lie)");
}

// A precommitted delta plan that members refused although they claimed they
// could take it: its buckets went out, the others applied them. The update
// succeeds for those (the refusers named, not at this version), unless
// nobody applied it or something else failed too.
std::vector<std::string> PublisherImpl::apply_delta_refusals(const UpdatePlan& plan, UpdateResult& r,
                                                             const Status& data, Code& code) {
  std::vector<std::string> strike;
  if (!plan.delta_base) return strike;
  // A member that applied a delta after its claim came back refused
  // honestly (a buffer registered just before the plan, say): forgiven.
  for (const auto& o : r.subscribers)
    if (o.status.ok())
      if (auto d = delta_refusals_.find(o.worker_id); d != delta_refusals_.end() && !d->second.dropped)
        delta_refusals_.erase(d);
  if (code == Code::kOk) return strike;
  bool applied_any = false;
  for (const auto& o : r.subscribers) applied_any = applied_any || o.status.ok();
  for (auto& o : r.subscribers) {
    if (!refused_only_the_delta(o)) continue;
    if (note_delta_refusal(o, plan)) strike.push_back(o.worker_id);
    if (!data.ok() || !applied_any) continue;
    o.status = rejected("subscriber '" + o.worker_id + "' refused the delta of v" + std::to_string(plan.version) +
                        " onto v" + std::to_string(plan.delta_base) + " it had claimed it could take (" +
                        o.mismatches.front().to_string() + "); it did not apply v" + std::to_string(plan.version));
    o.refused_delta = true;
    r.refused_delta.push_back(o.worker_id);
  }
  if (!r.refused_delta.empty()) code = others_code(r.subscribers);
  return strike;
}

bool PublisherImpl::plan_round(UpdatePlan& plan, UpdateResult& r) {
  if (send_plan(plan, r) || (r.status.ok() && check_plan(plan, r))) {
    ready_baseline(plan);
    return true;
  }
  // No byte moved: the baseline still holds its version.
  if (baseline_fresh_) baseline_.restore();
  if (!plan.delta_base || r.status.code() != Code::kRejected) return false;
  std::string who;
  for (const auto& o : r.subscribers) {
    if (o.status.ok()) continue;
    if (!refused_only_the_delta(o)) return false;
    who += (who.empty() ? "" : ", ") + o.worker_id;
  }
  if (who.empty()) return false;
  std::vector<std::string> strike;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& o : r.subscribers)
      if (!o.status.ok() && note_delta_refusal(o, plan)) strike.push_back(o.worker_id);
  }
  // A second lie: out of the next group (this call goes on with this one).
  strike_delta_refusers(strike);
  // Refused only as a delta (its heartbeat had not said so yet): the same
  // version again, dense; the members took the Abandon of the first plan.
  for (const auto& o : r.subscribers)
    if (!o.status.ok()) {
      r.dense_because = who + " refused the delta (" + o.worker_id + ": " + control::printable(o.mismatches.front().got) + ")";
      break;
    }
  PC_INFO("publisher: update v" << plan.version << ": dense (" << r.dense_because << ")");
  plan.delta_base = 0;
  r.status = Status();
  r.subscribers.clear();
  if (baseline_fresh_ && !baseline_.prepare(plan).ok()) baseline_fresh_ = false;
  if (send_plan(plan, r) || (r.status.ok() && check_plan(plan, r))) {
    ready_baseline(plan);
    return true;
  }
  if (baseline_fresh_) baseline_.restore();
  return false;
}

// Every engine of the group (trainer ranks aside: they receive nothing)
// must hold one version, consistent, and be able to apply a delta onto it
// (delta_blocker_locked, as for a broadcast). Each sender then sends a
// delta of each piece it sent as that version, and the rest dense
// (common/reshard/executor.h): no rank keeps more than what it sends.
void PublisherImpl::decide_sharded_delta(UpdatePlan& plan, const std::vector<std::string>& group, UpdateResult& r) {
  plan.delta_base = 0;
  baseline_fresh_ = false;
  if (cfg_.publisher.delta == DeltaMode::kOff) return;
  if (cfg_.publisher.device.is_cuda()) {
    // The pieces of a sharded update on a GPU move round by round over NCCL,
    // dense (common/reshard/executor.h); no rank keeps a baseline there.
    r.dense_because = "a sharded update on " + cfg_.publisher.device.to_string() + " moves dense";
    return;
  }
  uint64_t base = 0;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : group) {
      if (is_job_source(id)) continue;
      auto m = server_.member(id);
      if (!base && m) base = m->state == proto::WeightState::CONSISTENT ? m->weight_version : 0;
      if (!base) why = id + " holds no version yet";
      else if (base >= plan.version) why = id + " at v" + std::to_string(base) + ", not before v" + std::to_string(plan.version);
      else why = delta_blocker_locked(id, base);
      if (!why.empty()) break;
    }
  }
  if (why.empty() && base) {
    plan.delta_base = base;
    return;
  }
  r.dense_because = why.empty() ? "no engine in the group" : why;
  if (base) PC_INFO("publisher: sharded update v" << plan.version << ": dense (" << r.dense_because << ")");
}

}  // namespace paramcast
