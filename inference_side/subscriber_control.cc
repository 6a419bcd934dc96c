// The subscriber's control thread: what the publisher says (Welcome and
// membership, JoinGroup, Plan and its answer, Commit, Abandon, link checks,
// bucket checksums) handled as it arrives; the data-plane work it starts
// goes to the data thread as a Job (subscriber.cc). Nothing here blocks on
// the data plane: an abort of the communicator is the most it does.
#include <algorithm>

#include "common/control/messages.h"
#include "common/group/join_group.h"
#include "common/log.h"
#include "common/plan_proto.h"
#include "common/xxhash.h"
#include "inference_side/plan_check.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {
namespace {
proto::WeightState to_proto(WeightStateKind k) {
  switch (k) {
    case WeightStateKind::kEmpty: return proto::WeightState::EMPTY;
    case WeightStateKind::kConsistent: return proto::WeightState::CONSISTENT;
    case WeightStateKind::kDirty: return proto::WeightState::DIRTY;
  }
  return proto::WeightState::EMPTY;
}
}  // namespace

void SubscriberImpl::on_joined() {
  group_->on_joined();
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    part_taken_ = 0;  // a publisher that welcomes it keeps no part of its yet
  }
  send_wants();  // the publisher plans this engine's slices from them
  std::lock_guard<std::mutex> lock(mu_);
  PC_INFO(id_ << ": holding " << state_.to_string());
  cv_.notify_all();
}

void SubscriberImpl::on_membership_lost(const std::string& why) {
  // The control client has said why at its level: a publisher lost or an
  // expulsion warns, a publisher's announced leave (its normal end) informs.
  PC_INFO(id_ << ": " << why << "; keeping weights (" << state().to_string() << ") and rejoining");
  group_->on_unavailable(why);
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();  // a receive waiting for a checksum gives up
  abort_comm(why);
}

void SubscriberImpl::on_refused(const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  fatal_ = why;
  cv_.notify_all();
}

control::WeightReport SubscriberImpl::weight_report() {
  const WeightState st = state();
  control::WeightReport w{lost_.claimed_version(st.version), to_proto(st.kind), st.dirty_version};
  w.plan_version = plan_seen_;
  w.answered_version = answered_;
  w.commit_version = commit_seen_;
  w.applied_version = applied_sent_;
  bool sharded = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w.receiving_version = receiving_version_;
    w.delta_base = delta_base_locked();
    sharded = receiving_sharded_;
  }
  if (w.receiving_version && receiver_) w.received_bytes = sharded ? sharded_received_.load() : receiver_->received();
  return w;
}

void SubscriberImpl::on_message(proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  auto body = env.getBody();
  switch (body.which()) {
    case B::JOIN_GROUP: return on_join_group(env);
    case B::PLAN:
      if (lost_.loses("plan", body.getPlan().getVersion())) return;
      if (env.getEpoch() == client_epoch()) on_plan(env);
      return;
    case B::COMMIT:
      if (lost_.loses("commit", body.getCommit().getVersion())) return;
      return on_commit(env.getEpoch(), body.getCommit().getVersion());
    case B::BUCKET_CHECKSUMS: {
      auto c = body.getBucketChecksums();
      std::lock_guard<std::mutex> lock(mu_);
      uint32_t k = c.getFirst();
      for (uint64_t v : c.getValues()) checksums_[{c.getVersion(), k++}] = v;
      cv_.notify_all();
      return;
    }
    case B::BUCKET_LAYOUTS: return on_layouts(body.getBucketLayouts());
    case B::BUCKET_DELTA: return on_delta(body.getBucketDelta());
    case B::LINK_CHECK: {
      auto r = group::link_check_request(body.getLinkCheck());
      if (!r.ok()) {
        PC_WARN(id_ << ": ignored a LinkCheck: " << r.status().message());
        return;
      }
      return link_checks_.offer(std::move(*r));
    }
    case B::ABANDON: {
      auto a = body.getAbandon();
      {
        std::lock_guard<std::mutex> lock(mu_);
        abandoned_version_ = std::max(abandoned_version_, a.getVersion());
        cv_.notify_all();  // a receive waiting for a layout or checksum gives up
      }
      // A trainer rank's publish call waits for its part's outcome: rank 0
      // ends it (version 0, naming the call's seq) when its update ends
      // before any byte moved: refused before its plan, or a plan abandoned
      // for good. A plan abandoned for another try at the same version (a
      // delta an engine refused goes again, dense) leaves the call going.
      uint64_t calling = 0;
      {
        std::lock_guard<std::mutex> lock(reg_mu_);
        calling = active_seq_;
      }
      if (source_ && calling && a.getVersion() == 0 && a.getHoldingsSeq() == calling) {
        std::lock_guard<std::mutex> lock(mu_);
        reports_.push_back(UpdateReport{a.getVersion(), aborted(std::string("publisher abandoned the update: ") +
                                                                control::printable(a.getReason().cStr(), 512)),
                                        0, 0});
        cv_.notify_all();
      }
      // An engine that saw no plan of that update (refused on the publisher
      // before its plan) hears of its end here. One that saw the plan hears
      // of it as before (its data thread reports a committed one; a plan
      // abandoned before its commit may be tried again under the same
      // version, as a delta plan refused goes again dense).
      if (!source_ && a.getVersion() > 0 && plan_seen_ < a.getVersion()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_.version < a.getVersion()) {  // each refused attempt once (the publisher abandons it once)
          std::string why = "publisher abandoned update v";
          why += std::to_string(a.getVersion());
          why += " before any byte reached this engine: ";
          why += control::printable(a.getReason().cStr(), 512);
          reports_.push_back(UpdateReport{a.getVersion(), aborted(why), 0, 0});
          cv_.notify_all();
        }
      }
      if (pending_plan_ && pending_plan_->version == a.getVersion()) pending_plan_.reset();
      if (a.getVersion() == 0) return;  // no update was under way
      abort_comm(std::string("publisher abandoned the update: ") + a.getReason().cStr(), a.getVersion());
      return;
    }
    case B::GROUP_FAILED:  // the publisher ended that formation: stop joining it
      group_->abandon_formations(env.getEpoch(), std::string("publisher ended the formation of epoch ") +
                                                     std::to_string(env.getEpoch()));
      return;
    case B::STORE_VALUE: {
      auto v = body.getStoreValue();
      group_->on_store_value(v.getRequestId(),
                             std::string(reinterpret_cast<const char*>(v.getValue().begin()), v.getValue().size()));
      return;
    }
    default:
      PC_WARN(id_ << ": unexpected " << control::body_name(env) << " from the publisher ignored");
  }
}

uint64_t SubscriberImpl::client_epoch() {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

void SubscriberImpl::on_join_group(proto::Envelope::Reader env) {
  const uint64_t epoch = env.getEpoch();
  Job job;
  job.kind = Job::Kind::kJoin;
  job.epoch = epoch;
  job.group = group::group_options_from(env.getBody().getJoinGroup(), epoch, device_, cfg_.data_plane);
  abort_comm("superseded by epoch " + std::to_string(epoch));
  group_->abandon_formations(epoch - 1, "superseded by epoch " + std::to_string(epoch));
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch_ = epoch;
    rank_ = job.group.rank;  // a sharded plan is checked against this rank's wants on arrival
    world_ = job.group.world_size;
    rank_names_ = job.group.members;
    checksums_.clear();
    layouts_.clear();
    stream_end_.clear();
    deltas_.clear();
  }
  client_->set_epoch(epoch);
  push_job(std::move(job));
}

std::vector<Mismatch> SubscriberImpl::check(const UpdatePlan& plan, const ShapeId& shape) {
  if (plan.sharded || source_) return check_sharded(plan, shape);
  std::vector<Mismatch> out;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    out = check_plan(plan, registry_, bool(callback_));
  }
  if (auto refusal = delta_refusal(plan)) out.push_back(*refusal);
  return out;
}

// A delta applies onto the version it was computed against, and only
// that: this engine (and its copy, for the callback) must hold it.
std::optional<Mismatch> SubscriberImpl::delta_refusal(const UpdatePlan& plan) {
  if (!plan.delta_base) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  const bool holds = state_.kind == WeightStateKind::kConsistent && state_.version == plan.delta_base;
  const bool copy = !keeps_copies() || (copy_version_ == plan.delta_base && copy_manifest_ == plan.manifest_hash);
  if (holds && copy && delta_base_locked() == plan.delta_base && !lost_.refuses_delta()) return std::nullopt;
  std::string needs = "v";
  needs += std::to_string(plan.delta_base);
  needs += ", consistent";
  if (keeps_copies()) needs += ", with its copy for the callback";
  std::string holds_now = state_.to_string();
  if (holds && !copy) holds_now += ", its copy for the callback at another version";
  if (holds && registered_since_update_) holds_now += ", tensors registered since";
  return Mismatch{Mismatch::Kind::kOther, "<delta>", needs, holds_now};
}

void SubscriberImpl::on_plan(proto::Envelope::Reader env) {
  auto msg = env.getBody().getPlan();
  const uint64_t version = msg.getVersion();
  plan_seen_ = version;
  if (msg.getPrecommitted()) commit_seen_ = version;
  {
    // A new plan for a version an earlier Abandon (or overflow) named: that
    // was another attempt at this version (a restarted publisher counts
    // from the engines' versions again), not this one.
    std::lock_guard<std::mutex> lock(mu_);
    if (abandoned_version_ >= version) abandoned_version_ = 0;
    if (overflowed_version_ >= version) overflowed_version_ = 0;
    // A failure of this version still queued is an attempt refused before
    // its plan (no plan of it had come): this one is a new attempt.
    reports_.erase(std::remove_if(reports_.begin(), reports_.end(),
                                  [&](const UpdateReport& r) { return r.version == version && !r.status.ok(); }),
                   reports_.end());
  }
  auto plan = read_plan(msg);
  const bool by_reference = msg.getShapeRef() != 0;
  ShapeId shape;  // by reference: the kept plan; whole: its own copy, kept once accepted
  if (plan.ok() && plan->sharded) shape = by_reference ? kept_shape_.plan : std::make_shared<const UpdatePlan>(*plan);
  std::vector<Mismatch> mismatches;
  if (!plan.ok()) mismatches.push_back({Mismatch::Kind::kOther, "<plan>", "a well-formed plan", plan.status().message()});
  else mismatches = check(*plan, shape);
  if (plan.ok() && plan->sharded && !by_reference && mismatches.empty())
    kept_shape_ = {sharded_shape_digest(*plan), shape};
  if (!msg.getPrecommitted()) {
    if (mismatches.empty()) {
      pending_plan_ = std::make_shared<UpdatePlan>(std::move(plan.value()));
      pending_shape_ = shape;
    }
    answer_plan(version, mismatches);
    return;
  }
  if (!plan.ok()) {
    // Without a readable plan the bucket sizes are unknown and the
    // collective cannot be followed: it is failed for everyone.
    abort_comm("precommitted plan v" + std::to_string(version) + " is unreadable: " + plan.status().message());
    answer_plan(version, mismatches);
    return;
  }
  // The buckets are already on their way: receive now, into the tensors if
  // the plan fits, else into staging only to drop them.
  Job job;
  job.kind = Job::Kind::kReceive;
  job.epoch = env.getEpoch();
  job.plan = std::make_shared<UpdatePlan>(std::move(plan.value()));
  job.shape = shape;
  if (!mismatches.empty()) {
    job.discard = std::to_string(mismatches.size()) + " mismatches, first: " + mismatches[0].to_string();
    PC_WARN(id_ << ": rejected precommitted plan v" << version << " (" << job.discard
                << "); its buckets will be received and dropped");
    answer_plan(version, mismatches);
  }
  push_job(std::move(job));
}

// A plan as it came, or, by reference (Plan.shapeRef), the kept plan of
// that shape with this update's version and seqs.
StatusOr<UpdatePlan> SubscriberImpl::read_plan(proto::Plan::Reader msg) const {
  if (msg.getShapeRef() == 0) return plan_from_proto(msg);
  if (!kept_shape_.plan || kept_shape_.digest != msg.getShapeRef())
    return rejected("plan v" + std::to_string(msg.getVersion()) + " refers to a many-sender plan of shape " +
                               digest_hex(msg.getShapeRef()) + ", and this member holds " +
                               (kept_shape_.plan ? "shape " + digest_hex(kept_shape_.digest) : std::string("none")) +
                               " (it restarted, or refused that plan): the publisher sends the next one whole");
  return plan_by_reference(msg, *kept_shape_.plan);
}

// PlanAccept, or PlanReject with every mismatch.
void SubscriberImpl::answer_plan(uint64_t version, const std::vector<Mismatch>& mismatches) {
  const uint64_t epoch = client_epoch();
  if (lost_.loses("mute-answer", version)) return;  // test hook: stuck, silently
  if (lost_.loses("answer", version)) {  // test hook: as if the connection broke with it queued
    answered_ = version;
    return;
  }
  if (mismatches.empty()) {
    client_->send(control::make_message(epoch, client_->incarnation(), [&](auto b) {
      auto a = b.initPlanAccept();
      a.setVersion(version);
      a.setManifestHash(manifest_hash(pending_plan_->tensors));
    }));
    answered_ = version;
    return;
  }
  PC_WARN(id_ << ": rejected plan v" << version << " (" << mismatches.size()
              << " mismatches, first: " << mismatches[0].to_string() << ")");
  client_->send(control::make_message(epoch, client_->incarnation(), [&](auto b) {
    auto r = b.initPlanReject();
    r.setVersion(version);
    auto list = r.initMismatches(static_cast<unsigned>(mismatches.size()));
    for (size_t i = 0; i < mismatches.size(); ++i) {
      auto m = list[static_cast<unsigned>(i)];
      m.setKind(mismatch_kind_to_proto(mismatches[i].kind));
      m.setName(mismatches[i].name);
      m.setExpected(mismatches[i].expected);
      m.setGot(mismatches[i].got);
    }
  }));
  answered_ = version;
}

void SubscriberImpl::on_commit(uint64_t epoch, uint64_t version) {
  if (epoch != client_epoch() || !pending_plan_ || pending_plan_->version != version) return;
  commit_seen_ = version;
  Job job;
  job.kind = Job::Kind::kReceive;
  job.epoch = epoch;
  job.plan = std::move(pending_plan_);
  job.shape = pending_shape_;
  push_job(std::move(job));
}

}  // namespace paramcast
