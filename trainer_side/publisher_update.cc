// The update protocol's steps on the trainer's side (PublisherImpl): one
// weight_update from the caller's tensors to every member's Applied:
//
//   1. plan    make_plan, check_tensors, the version (next_version, never_issued)
//   2. group   ensure_group (publisher_group.cc)
//   3. check   send_plan, check_plan: every member's PlanAccept, or Abandon
//   4. move    move, start_move, end_move: the buckets on the data plane
//   5. applied collect_applied (publisher_outcomes.cc), log_result
//
// run() retries steps 2-5 when a group broke before any byte moved. The
// publisher's lifecycle, the control thread's handlers and the public handle
// are in publisher.cc.
#include <algorithm>
#include <thread>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/plan_proto.h"
#include "common/units.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

// ------------------------------------------------------------ weight_update
UpdateResult PublisherImpl::weight_update(const std::vector<TensorView>& tensors, const UpdateOptions& options) {
  if (update_mu_.held_by_me()) {  // waiting for the stream this thread holds open would never end
    UpdateResult r;
    r.tensors = tensors.size();
    r.status = invalid_argument("weight_update: a streamed update is open on this thread (finish or abort it first)");
    return r;
  }
  if (cfg_.publisher.ranks > 1) {  // the other trainer ranks would wait for a plan naming their part
    UpdateResult r;
    r.tensors = tensors.size();
    r.status = invalid_argument("publisher.ranks is " + std::to_string(cfg_.publisher.ranks) +
                                ": every trainer rank publishes its part (weight_update_sharded on rank 0, "
                                "PublisherRank::weight_update on the others)");
    return r;
  }
  if (const auto& rules = options.transforms ? *options.transforms : cfg_.publisher.transforms; !rules.empty()) {
    // What travels: the transformed tensors (cast, fp8 and its scales), held
    // for this call; the rest as the caller's own bytes.
    auto wire = cfg_.publisher.device.is_cuda()
                    ? StatusOr<transform::Transformed>(invalid_argument(
                          std::string("UpdateOptions::transforms on publisher.device ") +
                          cfg_.publisher.device.to_string() + ": " + transform::kCudaPending))
                    : transform::apply_all(tensors, rules);
    if (!wire.ok()) {
      UpdateResult r;
      r.tensors = tensors.size();
      r.status = wire.status();
      PC_WARN("publisher: update refused before any byte moved: " << r.status.to_string());
      // Under the update gate, as every version is chosen: an update that
      // takes this version next has not sent its plan yet.
      std::lock_guard<UpdateGate> held(update_mu_);
      end_unplanned(options.version ? *options.version : next_version(), false, r.status);
      return r;
    }
    UpdateOptions as_is = options;
    as_is.transforms = std::vector<transform::Rule>{};
    UpdateResult r = weight_update(wire->views, as_is);
    r.transformed = wire->transformed;
    if (r.status.code() == Code::kRejected && wire->transformed > 0 && !r.subscribers.empty()) {
      std::string hint = r.status.message();
      hint += " (publisher.transforms changed ";
      hint += std::to_string(wire->transformed);
      hint += " tensors: an engine registers what travels, e.g. <name> as F8_E4M3 and <name>_scale_inv as F32 "
              "for fp8; docs/transforms.md)";
      r.status = Status(r.status.code(), hint);
    }
    return r;
  }
  {
    // Engines with tensor parallelism want their slices only: a broadcast
    // would carry every byte to every engine rank (and they refuse it), so
    // the update goes point to point, this rank holding every tensor whole.
    std::unique_lock<std::mutex> lock(mu_);
    if (!slicing_engine_locked().empty() &&
        point_to_point_unavailable_reason(cfg_.data_plane.backend, cfg_.data_plane.local, cfg_.publisher.device)
            .empty()) {
      lock.unlock();
      std::vector<ShardView> whole;
      whole.reserve(tensors.size());
      for (const auto& t : tensors) whole.push_back(ShardView{t, {}, {}});
      return weight_update_sharded(whole, options);
    }
  }
  std::lock_guard<UpdateGate> ulock(update_mu_);
  const auto t0 = Clock::now();
  cap_ = t0 + cfg_.publisher.update_timeout;  // plan, move and applied all end by then
  UpdateResult r;
  r.tensors = tensors.size();
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back(t.spec);
  Status checked = check_tensors(tensors);
  auto plan = checked.ok() ? make_plan(specs, options, false, r) : StatusOr<UpdatePlan>(checked);
  if (plan.ok()) run(*plan, tensors, options, r);
  else r.status = plan.status();
  if (!r.ok())  // refused before its plan, or the group did not form: the engines waiting for it stop
    end_unplanned(plan.ok() ? plan->version : r.version ? r.version : options.version ? *options.version : next_version(),
                  plan.ok(), r.status);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  log_result(r);
  return r;
}

void PublisherImpl::log_result(UpdateResult& r) {
  {
    // Every update names the engines kept out of it for their Wants.
    std::lock_guard<std::mutex> lock(mu_);
    r.left_out = left_out_for_wants_locked();
  }
  static const char* kModes[] = {"off", "auto", "always"};
  // A many-sender job's rank 0 keeps the pieces it sends, not the model.
  const bool sharded = cfg_.publisher.ranks > 1 || sent_.bytes() > 0;
  server_.set_delta_figures({kModes[static_cast<int>(cfg_.publisher.delta)], sharded ? sent_.bytes() : baseline_.bytes(),
                             sharded ? (r.ok() ? r.version : 0) : baseline_.version(),
                             r.bytes, r.wire_bytes});
  counters_.record(r.status, r.seconds, r.bytes, r.wire_bytes, r.data_seconds, r.apply_seconds);
  if (!r.ok()) {
    PC_WARN("publisher: " << update_label(r.version) << " failed: " << r.status.to_string());
  }
  for (const auto& [id, why] : r.left_out)
    PC_WARN("publisher: " << update_label(r.version) << ": " << id << " left out: " << why);
  if (r.ok() && (!r.missing.empty() || !r.shed.empty() || !r.unconfirmed.empty())) {
    PC_WARN("publisher: update v" << r.version << " applied to "
                                  << r.subscribers.size() - r.shed.size() - r.unconfirmed.size() << " of "
                                  << cfg_.expected_count() << " subscribers"
                                  << (r.missing.empty() ? "" : "; missing: " + join_ids(r.missing))
                                  << (r.shed.empty() ? "" : "; shed (link below publisher.slow_member_floor): " +
                                                                join_ids(r.shed))
                                  << (r.unconfirmed.empty() ? "" : "; no Applied within apply_timeout (dirty): " +
                                                                       join_ids(r.unconfirmed)));
  }
}

// 1. Plan: checks the caller's tensors and lays out the buckets (a streamed
// plan: the tensors only). The version is reserved even when the update
// fails later: it is never reused.
StatusOr<UpdatePlan> PublisherImpl::make_plan(const std::vector<TensorSpec>& specs, const UpdateOptions& options,
                                              bool streamed, UpdateResult& r) {
  if (Status s = plan_version(specs.size(), options, r); !s.ok()) return s;
  auto plan = streamed ? build_streamed_plan(r.version, specs, cfg_.data_plane)
                       : build_plan(r.version, specs, cfg_.data_plane);
  if (!plan.ok()) return plan.status();
  plan->partial = options.partial;
  r.bytes = plan->total_bytes;
  r.buckets = plan->buckets.size();
  last_version_ = r.version;
  return plan;
}

// The next update's version (r.version), of `tensors` tensors.
Status PublisherImpl::plan_version(size_t tensors, const UpdateOptions& options, UpdateResult& r) {
  // Versions never go backwards, also across publisher restarts: the floor is
  // the highest version a subscriber in good standing reports holding or
  // having tried, of the versions it can hold (refuse_impossible_versions).
  refuse_impossible_versions();
  std::string holder;
  const uint64_t held = highest_member_version(holder);
  const uint64_t floor = std::max(last_version_, held);
  r.version = options.version.value_or(floor + 1);
  r.tensors = tensors;
  if (tensors > kMaxPlanTensors)
    return invalid_argument("an update of " + std::to_string(tensors) + " tensors: more than the " +
                            std::to_string(kMaxPlanTensors) + " one update may name (kMaxPlanTensors): send them "
                            "as several partial updates (UpdateOptions::partial)");
  if (options.version && *options.version > kMaxVersion)
    return invalid_argument("version " + std::to_string(*options.version) + " exceeds the largest version, " +
                            std::to_string(kMaxVersion));
  if (floor >= kMaxVersion)
    return invalid_argument("no version is left above v" + std::to_string(floor) + " (the largest is " +
                            std::to_string(kMaxVersion) + ")");
  if (options.version && *options.version <= floor)
    return invalid_argument("version " + std::to_string(*options.version) + " does not exceed " +
                            (held > last_version_ ? "version " + std::to_string(held) + " held by subscriber '" +
                                                        holder + "' (versions never go backwards)"
                                                  : "the last version " + std::to_string(last_version_)));
  return Status();
}

// The caller's tensors of a weight_update: on the publisher's device, with data.
Status PublisherImpl::check_tensors(const std::vector<TensorView>& tensors) const {
  for (const auto& t : tensors) {
    if (t.device != cfg_.publisher.device)
      return invalid_argument("tensor '" + t.spec.name + "' is on " + t.device.to_string() +
                              " but publisher.device is " + cfg_.publisher.device.to_string());
    auto n = t.spec.nbytes();
    if (n.ok() && *n > 0 && t.data == nullptr)
      return invalid_argument("tensor '" + t.spec.name + "' has no data pointer");
  }
  return Status();
}

uint64_t PublisherImpl::next_version() {
  std::string who;
  if (update_mu_.held_by_me()) return std::max(last_version_, highest_member_version(who)) + 1;  // inside a stream
  std::lock_guard<UpdateGate> ulock(update_mu_);
  return std::max(last_version_, highest_member_version(who)) + 1;
}

// What each member in good standing (live, not in quarantine) holds or left
// dirty: the claims the floor may come from.
std::map<std::string, uint64_t> PublisherImpl::standing_claims() const {
  std::map<std::string, uint64_t> claims;
  const auto excluded = groups_.excluded();
  for (const auto& id : server_.live_ids()) {
    auto m = server_.member(id);
    if (m && !excluded.count(id)) claims[id] = std::max(m->weight_version, m->dirty_version);
  }
  return claims;
}

// Why `id`'s claim of `v` (one of `claims`) is a version this publisher can
// show it never issued; empty where the claim may be true. A member may hold
// (or have tried) any version this publisher issued. A publisher that has
// issued none yet (a restarted one) cannot tell an honest member's version
// from a made-up one, and bounds what one claim can cost: it takes a claim
// up to kResumeCeiling, one above only beside another member's claim within
// kCorroborationGap of it (a fleet of honest engines holds one version, give
// or take the updates one missed), and never kMaxVersion (nothing
// would be left to publish). So no one member takes more than half the
// versions, nor all of them.
std::string PublisherImpl::never_issued(const std::string& id, uint64_t v,
                                        const std::map<std::string, uint64_t>& claims) const {
  if (last_version_) return v > last_version_ ? "its last is v" + std::to_string(last_version_) : std::string();
  if (v > kMaxVersion) return "the largest is " + std::to_string(kMaxVersion);
  if (v == kMaxVersion) return "the largest, which would leave no version to publish";
  if (v <= kResumeCeiling) return "";
  for (const auto& [other, w] : claims)
    if (other != id && (w < v ? v - w : w - v) <= kCorroborationGap) return "";
  return "it has issued none yet, and takes a version above " + std::to_string(kResumeCeiling) +
         " only where another member holds one within " + std::to_string(kCorroborationGap) + " of it";
}

// A member that claims a version this publisher never issued lies (or is
// confused): it is named with the value, quarantined, and the next group
// forms without it; its claim never sets the next version.
void PublisherImpl::refuse_impossible_versions() {
  const auto claims = standing_claims();
  for (const auto& [id, v] : claims) {
    const std::string never = never_issued(id, v, claims);
    if (never.empty()) continue;
    const std::string why = "claims version " + std::to_string(v) + ", which this publisher never issued (" + never + ")";
    PC_WARN("publisher: refusing subscriber '" << id << "': it " << why);
    groups_.quarantine(id, why);
    std::lock_guard<std::mutex> lock(mu_);
    needs_reform_ = true;
  }
}

// The highest claim the floor may come from: of a member in good standing,
// and one this publisher cannot show it never issued.
uint64_t PublisherImpl::highest_member_version(std::string& who) const {
  uint64_t highest = 0;
  const auto claims = standing_claims();
  for (const auto& [id, v] : claims)
    if (v > highest && never_issued(id, v, claims).empty()) {
      highest = v;
      who = id;
    }
  return highest;
}

void PublisherImpl::run(UpdatePlan& plan, const std::vector<TensorView>& tensors, const UpdateOptions& options,
                        UpdateResult& r) {
  if (!run_once(plan, tensors, options, r)) return;
  // A precommitted delta that every member refused although each claimed it
  // could take it: nothing was applied, and their claims are dropped now.
  // The same version again, dense, in this call.
  const std::string refused = refused_by_every_member(plan, r);
  if (refused.empty()) return;
  PC_WARN("publisher: update v" << r.version << ": every member refused the delta (" << refused
                                << "); sending it again, dense");
  UpdateResult again;
  again.version = r.version;
  again.tensors = r.tensors;
  again.bytes = r.bytes;
  again.buckets = r.buckets;
  r = std::move(again);
  run_once(plan, tensors, options, r);
  // Why it is dense (the retry's own reason, a baseline the refused attempt
  // used up, follows from this).
  r.dense_because = "every member refused the delta (" + refused + ")";
}

// Steps 2-5 of one update. Returns whether the data plane carried it
// (even if members then failed it).
bool PublisherImpl::run_once(UpdatePlan& plan, const std::vector<TensorView>& tensors, const UpdateOptions& options,
                             UpdateResult& r) {
  if (Status s = ensure_group(); !s.ok()) {  // 2. group
    r.status = s;
    return false;
  }
  pause_before_plan(plan.version);
  decide_delta(plan, r);
  if (!plan_round(plan, r)) return false;  // 3. check
  Status data = move(plan, tensors, options.after_stream, r);  // 4. move
  collect_applied(plan, data, r);     // 5. applied
  return data.ok();
}

void PublisherImpl::pause_before_plan(uint64_t version) const {
  if (faults_.pause_version != version) return;  // test hook: membership may change meanwhile
  PC_WARN("publisher: fault injection: pausing v" << version << " for " << faults_.pause_ms << " ms");
  std::this_thread::sleep_for(std::chrono::milliseconds(faults_.pause_ms));
}

// Sends the plan to every member; returns whether it went out precommitted
// (every member of this epoch accepted this manifest already: no round trip).
// Sends nothing (r.status says why) when a member left the group since it
// formed.
bool PublisherImpl::send_plan(const UpdatePlan& plan, UpdateResult& r) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t epoch = groups_.epoch();
  if (!departed_.empty()) {
    // The group changed after it was checked (ensure_group) and before this
    // plan: a member that left it would never take these broadcasts, and
    // waiting for it would last stall_timeout. The next update re-forms.
    r.epoch = epoch;
    r.status = aborted("update v" + std::to_string(r.version) + " abandoned before any byte moved: " + departed_ +
                       "; the next update forms a new group");
    return false;
  }
  // A sharded delta always goes through the answer round: an engine that
  // cannot take it answers PlanReject and the same version goes again dense
  // with every trainer rank (plan_round). Precommitted, it could only abort
  // the moves, which relay others' pieces through it, and fail the update
  // for every engine. (A broadcast member drops what it refused instead.)
  const bool precommitted = cfg_.publisher.reuse_validated_plan && validated_ && validated_->epoch == epoch &&
                            validated_->hash == plan.manifest_hash && validated_->checksum == plan.checksum &&
                            validated_->partial == plan.partial && !(plan.sharded && plan.delta_base);
  validated_.reset();  // set again only when this update succeeds everywhere
  r.epoch = epoch;
  r.precommitted = precommitted;
  r.missing = absent();
  // Another attempt at the version of the last round (a dense re-plan of a
  // refused delta): the markers its members' heartbeats carry may be the
  // earlier attempt's, so none counts as evidence of a lost message in this
  // one (its phase deadlines still hold).
  std::map<std::string, UpdateRound::Markers> before;
  if (r.version == last_round_version_)
    for (const auto& id : group_) before[id] = {r.version, r.version, r.version, r.version};
  last_round_version_ = r.version;
  round_.begin(epoch, r.version, group_, plan.total_bytes, std::move(before));
  const uint64_t seq = send_plan_frames(plan, epoch, precommitted, r);
  round_.sent_plan(seq);
  if (precommitted) {
    round_.sent_commit(seq);
    for (const auto& id : round_.group()) r.subscribers.push_back(SubscriberOutcome{id, Status(), {}, 0});
    active_comm_ = comm_;
  }
  return precommitted;
}

// The plan to the round's members, mu_ held: whole, or, to a member that
// applied a sharded plan of the same shape (generation and digest) in its
// present incarnation, by reference (Plan.shapeRef: the version, the seqs,
// the digest). A member's record is taken as the plan goes, and set again
// when it applies it (note_shapes_applied_locked).
uint64_t PublisherImpl::send_plan_frames(const UpdatePlan& plan, uint64_t epoch, bool precommitted, UpdateResult& r) {
  sent_shape_ = plan.sharded ? plan_shape_ : PlanShape{};
  sent_incarnation_.clear();
  std::vector<std::string> whole, referred;
  for (const auto& id : round_.group()) {
    auto known = known_shapes_.find(id);
    const auto m = server_.member(id);
    if (m) sent_incarnation_[id] = m->incarnation;
    const bool holds = sent_shape_.digest != 0 && known != known_shapes_.end() && m &&
                       known->second.incarnation == m->incarnation &&
                       known->second.shape.generation == sent_shape_.generation &&
                       known->second.shape.digest == sent_shape_.digest;
    (holds ? referred : whole).push_back(id);
    if (known != known_shapes_.end()) known_shapes_.erase(known);
  }
  r.plan_whole_bytes = r.plan_referred_bytes = 0;  // this attempt's (a dense retry sends again)
  uint64_t seq = 0;
  for (const auto* ids : {&whole, &referred}) {
    if (ids->empty()) continue;
    capnp::MallocMessageBuilder builder;
    auto env = builder.initRoot<proto::Envelope>();
    env.setEpoch(epoch);
    env.setIncarnation(server_.incarnation());
    auto msg = env.initBody().initPlan();
    plan_to_proto(plan, msg, ids == &referred ? sent_shape_.digest : 0);
    msg.setPrecommitted(precommitted);
    auto frame = control::encode(builder);
    (ids == &referred ? r.plan_referred_bytes : r.plan_whole_bytes) += frame.size() * ids->size();
    seq = std::max(seq, server_.send_to(*ids, frame));  // tracked from the later one: both are out by then
  }
  r.plan_referred = referred.size();
  return seq;
}

// Waits for every PlanAccept/PlanReject; on any rejection or loss abandons
// the update before any byte moved. Returns whether to go on.
bool PublisherImpl::check_plan(const UpdatePlan& plan, UpdateResult& r) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto live = [this](const std::string& id) { return is_live(id); };
  // Bounded by plan_timeout (an answer takes one round trip) and the cap.
  const auto until = std::min(cap_, Clock::now() + cfg_.publisher.plan_timeout);
  cv_.wait_until(lock, until, [&] { return round_.plan_answered(live) || stopped_ || !departed_.empty(); });
  Code code;
  r.subscribers = round_.plan_outcomes(live, silence(), code, waited("plan_timeout", cfg_.publisher.plan_timeout, until));
  if (!departed_.empty()) {  // it will not take the broadcasts: none start (and it is why answers are missing)
    abandon_locked(plan.version, departed_);
    round_.end();
    r.status = aborted("update v" + std::to_string(r.version) + " abandoned before any byte moved: " + departed_ +
                       "; the next update forms a new group");
    return false;
  }
  if (code != Code::kOk) {
    abandon_locked(plan.version, code == Code::kRejected   ? "plan rejected"
                                 : code == Code::kPeerLost ? "a member was lost before the update started"
                                                           : "a member did not answer the plan");
    if (code != Code::kRejected) needs_reform_ = true;
    round_.end();
    r.status = summarize_outcomes(r.subscribers, code,
                                  "update v" + std::to_string(r.version) + " abandoned before any byte moved");
    return false;
  }
  if (faults_.commit_pause_version == plan.version) {  // test hook: a trainer rank's call may end meanwhile
    PC_WARN("publisher: fault injection: pausing v" << plan.version << " for " << faults_.commit_pause_ms
                                                    << " ms before its commit");
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(faults_.commit_pause_ms));
    lock.lock();
  }
  round_.sent_commit(server_.send_to(round_.group(),
                                     control::make_message(groups_.epoch(), server_.incarnation(),
                                                           [&](auto b) { b.initCommit().setVersion(plan.version); })));
  active_comm_ = comm_;
  return true;
}

// 4. Move: the buckets go out; checksums travel on the control channel.
Status PublisherImpl::move(const UpdatePlan& plan, const std::vector<TensorView>& tensors, void* after_stream,
                           UpdateResult& r) {
  MoveState m = start_move();
  transfer::BucketSender::Hooks hooks;
  hooks.on_checksum = checksum_hook(plan, m);
  hooks.on_progress = progress_hook(plan, m);
  if (baseline_fresh_) {
    hooks.baseline = &baseline_;
    hooks.codec = codec_.get();
    hooks.delta_always = cfg_.publisher.delta == DeltaMode::kAlways;
    hooks.on_delta = delta_hook(plan, m);
  }
  Status data = end_move(plan, m, sender_->send(plan, tensors, *comm_, hooks, cap_, after_stream));
  r.wire_bytes = sender_->wire_bytes();
  r.delta = sender_->delta_buckets() > 0;
  return data;
}

PublisherImpl::MoveState PublisherImpl::start_move() {
  MoveState m;
  m.epoch = groups_.epoch();
  {
    std::lock_guard<std::mutex> lock(mu_);
    m.group = round_.group();
  }
  m.t0 = Clock::now();
  move_started_ = m.t0;
  move_ended_ = {};
  m.links_before = comm_->link_stats();
  return m;
}

std::function<void(size_t, uint64_t)> PublisherImpl::checksum_hook(const UpdatePlan& plan, const MoveState& m) {
  return [this, &plan, &m](size_t k, uint64_t sum) {
    server_.send_to(m.group, control::make_message(m.epoch, server_.incarnation(), [&](auto b) {
                      auto c = b.initBucketChecksums();
                      c.setVersion(plan.version);
                      c.setFirst(static_cast<uint32_t>(k));
                      c.initValues(1).set(0, sum);
                    }));
  };
}

std::function<void(uint64_t, uint64_t)> PublisherImpl::progress_hook(const UpdatePlan& plan, MoveState& m) {
  return [this, &plan, &m](uint64_t sent, uint64_t total) {
    m.sent = sent;
    if (progress_) progress_(plan.version, sent, total);
  };
}

// After the last byte left (or the data plane failed): the links' figures,
// and on a failure the communicator aborted and the members told.
Status PublisherImpl::end_move(const UpdatePlan& plan, const MoveState& m, Status data) {
  move_ended_ = Clock::now();
  own_links_ = link_delta(m.links_before, comm_->link_stats());
  if (data.code() == Code::kTimeout && Clock::now() >= cap_) {
    // The cap, not a stalled link: say how far the update got, and how fast.
    const auto took = Clock::now() - m.t0;
    const double secs = std::chrono::duration<double>(took).count();
    data = timeout_error("update_timeout (" + format_duration(cfg_.publisher.update_timeout) + ") passed with " +
                         format_bytes(m.sent) + " of " + format_bytes(plan.total_bytes) + " sent to every member in " +
                         format_duration(took) + " (" +
                         format_bytes(secs > 0 ? static_cast<uint64_t>(static_cast<double>(m.sent) / secs) : 0) +
                         "/s)" + slowest_receiver(plan.version) + ": " + data.message());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_comm_.reset();
  }
  if (!data.ok()) {
    comm_->abort(data.message());
    // Members blocked behind a stopped or dead peer give up now, not when
    // their own data plane notices.
    std::lock_guard<std::mutex> lock(mu_);
    abandon_locked(plan.version, "publisher data plane failed: " + data.message());
  }
  return data;
}

}  // namespace paramcast
