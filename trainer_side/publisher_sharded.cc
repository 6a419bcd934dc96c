// Many-sender updates on rank 0 (Publisher::weight_update_sharded), one
// call as named steps: this rank's part; the other trainer ranks' parts
// (their Holdings, publisher_holdings.cc) taken; one plan from all of them,
// checked before any byte moves (common/reshard/sharded_update.h); rank 0's
// own transfers. The plan, answer and Applied rounds are those of every
// update (publisher_update.cc).
#include <algorithm>
#include <map>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/units.h"
#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {
namespace {

// The group's members by rank, rank 0 first.
std::vector<std::string> rank_names(const std::vector<std::string>& group) {
  std::vector<std::string> names = {"publisher"};
  names.insert(names.end(), group.begin(), group.end());
  return names;
}

}  // namespace

void PublisherImpl::end_trainer_call(const std::string& id, uint64_t seq, const std::string& why) {
  server_.send_to({id}, control::make_message(groups_.epoch(), server_.incarnation(), [&](auto b) {
                    auto a = b.initAbandon();
                    a.setVersion(0);
                    a.setReason(why);
                    a.setHoldingsSeq(seq);
                  }));
}

void PublisherImpl::abandon_unplanned(uint64_t version, bool reserved, const std::string& why) {
  {
    // A version the update would have had: past the last one, within bounds
    // (a caller's invalid version is no engine's business).
    std::lock_guard<std::mutex> lock(mu_);
    if (!reserved && (version <= last_version_ || version > kMaxVersion)) return;
  }
  std::vector<std::string> engines;
  for (const auto& id : server_.live_ids())
    if (!is_job_source(id)) engines.push_back(id);
  server_.send_to(engines, control::make_message(groups_.epoch(), server_.incarnation(), [&](auto b) {
                    auto a = b.initAbandon();
                    a.setVersion(version);
                    a.setReason(why);
                  }));
}

void PublisherImpl::end_unplanned(uint64_t version, bool reserved, const Status& why) {
  if (why.ok()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (version == last_round_version_) return;  // its plan went out
  }
  abandon_unplanned(version, reserved, why.message());
}

// An engine that serves slices (its last Wants cut a tensor), of those not
// left out for them: the first one's id, or "" (mu_ held).
std::string PublisherImpl::slicing_engine_locked() const {
  for (const auto& [id, w] : wants_)
    if (w.slices() && !wants_refused_locked(id)) return id;
  return "";
}

bool PublisherImpl::is_trainer_rank(const std::string& id) const {
  for (int r = 1; r < cfg_.publisher.ranks; ++r)
    if (id == trainer_rank_id(r)) return true;
  return false;
}

// The one rule for who sends in a many-sender job: a trainer rank's id
// whose member said it is a source. Anyone else is an engine (receives,
// states wants, counts for deltas), whatever its Hello claimed.
bool PublisherImpl::is_job_source(const std::string& id) const {
  auto m = server_.member(id);
  return m && m->source && is_trainer_rank(id);
}

// Every trainer rank holds rows no other rank holds: one that is not in the
// group (never joined, lost, or left out in quarantine) is the cause of the
// update's failure, named as such before anything is planned, instead of
// the engine wants that nobody else holds.
Status PublisherImpl::every_trainer_rank_in_group() const {
  const auto excluded = groups_.excluded();
  std::string missing;
  std::lock_guard<std::mutex> lock(mu_);
  for (int r = 1; r < cfg_.publisher.ranks; ++r) {
    const std::string id = trainer_rank_id(r);
    if (std::find(group_.begin(), group_.end(), id) != group_.end()) continue;
    std::string why = server_.is_live(id) ? "not in the group" : "not joined";
    if (auto it = excluded.find(id); it != excluded.end()) why = "left out: " + it->second;
    missing += (missing.empty() ? "" : "; ") + id + " (" + why + ")";
  }
  if (missing.empty()) return Status();
  return unavailable("sharded update refused before any byte moved: trainer ranks hold rows no other rank holds, "
                     "and " + missing + "; its rows cannot be sent (publisher.ranks: " +
                     std::to_string(cfg_.publisher.ranks) + ")");
}

// One call, as named steps: this rank's part (transformed, checked,
// digested), the partner ranks' parts and the engines' Wants taken, one
// plan from all of them checked before any byte moves, then the rounds
// of every update (plan, move, Applied). A refusal before the plan ends
// the partner calls too.
UpdateResult PublisherImpl::weight_update_sharded(const std::vector<ShardView>& shards, const UpdateOptions& options) {
  if (update_mu_.held_by_me()) {
    UpdateResult r;
    r.tensors = shards.size();
    r.status = invalid_argument("weight_update_sharded: a streamed update is open on this thread");
    return r;
  }
  std::lock_guard<UpdateGate> ulock(update_mu_);
  if (!options.version) ++sharded_calls_;
  ShardedCall c{options, Clock::now()};
  c.r.tensors = shards.size();
  cap_ = c.t0 + cfg_.publisher.update_timeout;
  if (Status s = sharded_precondition(options); !s.ok()) return finish_sharded(c, s);
  // What travels (publisher.transforms, or the update's): this rank
  // transforms what it holds, held for the call; the other ranks theirs.
  const auto& rules = options.transforms ? *options.transforms : cfg_.publisher.transforms;
  transform::TransformedShards wire;
  const Status transformed = transform_own(shards, rules, options, wire, c.r);
  const std::vector<ShardView>& sent = rules.empty() ? shards : wire.views;
  c.r.tensors = sent.size();
  if (Status s = state_own_part(sent, c.own); !s.ok()) return finish_sharded(c, s);
  // The step this call publishes; every trainer rank's call of the same
  // step is its partner (counted on entry, whatever becomes of the call).
  c.step = options.version ? *options.version : sharded_calls_;
  {
    // A new call of a step refused before starts afresh: a partner's part
    // that comes now is this call's (or is ended by this call's refusal).
    std::lock_guard<std::mutex> lock(mu_);
    refused_steps_.erase(c.step);
  }
  if (!transformed.ok()) return refuse_sharded(c, transformed);
  if (Status s = ensure_group(); !s.ok()) return refuse_sharded(c, s);
  if (Status s = every_trainer_rank_in_group(); !s.ok()) return refuse_sharded(c, s);
  if (Status s = some_engine_in_group(); !s.ok()) return refuse_sharded(c, s);
  if (Status s = take_parts(c); !s.ok()) return refuse_sharded(c, s);
  auto plan = sharded_plan(c);
  if (!plan.ok()) return refuse_sharded(c, plan.status());
  // A plan lent by the kept one (plan_from_kept) goes back when the call
  // ends; a call that throws leaves nothing kept (the next plans afresh).
  UpdateResult r;
  try {
    r = run_planned(c, *plan, sent);
  } catch (...) {
    if (c.from_kept) kept_plan_.reset();
    throw;
  }
  if (c.from_kept && kept_plan_) kept_plan_->plan = std::move(*plan);
  return r;
}

// The call's plan checked, its moves found, its rounds run.
UpdateResult PublisherImpl::run_planned(ShardedCall& c, UpdatePlan& plan, const std::vector<ShardView>& sent) {
  if (cfg_.data_plane.checksum != Checksum::kNone)
    if (Status s = reshard::check_replicas_digested(plan, rank_names(c.group)); !s.ok())
      return refuse_sharded(c, s.with_context("refused before any byte moved"));
  auto moves = sharded_cache_.moves(plan, static_cast<int>(c.group.size() + 1), rank_names(c.group), {c.from_kept, 0});
  if (!moves.ok()) return refuse_sharded(c, moves.status().with_context("refused before any byte moved"));
  if (c.made) kept_plan_ = std::move(c.made);
  note_plan_shape(plan, sharded_cache_.last_was_cached());
  run_sharded(c, plan, *moves, sent);
  // Failed for good (a plan abandoned for a dense try of the same version
  // is not): every partner call ends now, also that of a trainer rank that
  // never started its part (its Commit was lost) or is stalled in it (it
  // aborts that transfer before its call returns). A call that ended on its
  // own part's outcome already is not touched (another seq).
  if (!c.r.status.ok())
    for (const auto& [id, h] : c.taken) end_trainer_call(id, h.seq, c.r.status.message());
  return finish_sharded(c, c.r.status);
}

UpdateResult PublisherImpl::finish_sharded(ShardedCall& c, const Status& status) {
  c.r.status = status;
  c.r.seconds = std::chrono::duration<double>(Clock::now() - c.t0).count();
  log_result(c.r);
  return std::move(c.r);
}

// What this rank's data plane and device allow: moves point to point, and
// on a GPU, reading the shards after the caller's stream.
Status PublisherImpl::sharded_precondition(const UpdateOptions& options) {
  if (std::string why =
          point_to_point_unavailable_reason(cfg_.data_plane.backend, cfg_.data_plane.local, cfg_.publisher.device);
      !why.empty()) {
    std::string says = "weight_update_sharded moves point to point (data_plane.backend: gloo or shm in host "
                       "memory, nccl in a GPU's): ";
    says += why;
    return unavailable(says);
  }
  if (!cfg_.publisher.device.is_cuda()) return Status();
  Status s = mem_->order_after(options.after_stream);
  return s.ok() ? s : s.with_context("weight_update_sharded: ordering after the caller's stream");
}

// This rank's shards as they travel under `rules` (publisher.transforms,
// or the update's, which must be every rank's): `wire` holds them for the
// call.
Status PublisherImpl::transform_own(const std::vector<ShardView>& shards, const std::vector<transform::Rule>& rules,
                                    const UpdateOptions& options, transform::TransformedShards& wire,
                                    UpdateResult& r) {
  if (!rules.empty() && cfg_.publisher.device.is_cuda())
    return invalid_argument(std::string("UpdateOptions::transforms on publisher.device ") +
                            cfg_.publisher.device.to_string() + ": " + transform::kCudaPending);
  // Also an empty list where publisher.transforms has rules: the other
  // ranks would send what this rank does not.
  if (options.transforms && cfg_.publisher.ranks > 1 && *options.transforms != cfg_.publisher.transforms)
    return invalid_argument("weight_update_sharded: UpdateOptions::transforms differ from "
                            "publisher.transforms, which the other trainer ranks apply: give every rank the "
                            "same rules in the config");
  if (rules.empty()) return Status();
  auto t = transform::apply_shards(shards, rules);
  if (!t.ok()) return t.status();
  wire = std::move(t.value());
  r.transformed = wire.transformed;
  return Status();
}

// This rank's own shards as the plan states them: on the publisher's
// device, each a box inside its tensor (the last call's statement while
// the shards are the same tensors' same boxes); with checksums, each box's
// xxh64 (compared with its replicas' on other ranks).
Status PublisherImpl::state_own_part(const std::vector<ShardView>& sent, OwnPart& own) {
  if (!own_shape_ || !own_shape_->stated_by(sent)) {
    auto shape = state_own_shape(sent);
    if (!shape.ok()) return shape.status();
    own_shape_ = std::move(*shape);
  }
  own.shape = own_shape_;
  for (size_t i = 0; i < sent.size(); ++i) {
    const ShardView& s = sent[i];
    const reshard::Region& box = own.shape->holds[i].second;
    std::string bad;
    if (s.local.device != cfg_.publisher.device)
      bad = "is on " + s.local.device.to_string() + ", not on publisher.device " + cfg_.publisher.device.to_string();
    else if (!box.empty() && !s.local.data) bad = "has no data pointer";
    if (!bad.empty()) return invalid_argument("shard of '" + s.local.spec.name + "' " + bad);
    if (cfg_.data_plane.checksum == Checksum::kNone || box.empty()) continue;
    auto digest = reshard::holding_digest(s.local.data, box.elements() * dtype_size(s.local.spec.dtype),
                                          s.local.device, mem_.get());
    if (!digest.ok()) return digest.status().with_context("shard of '" + s.local.spec.name + "'");
    own.digests[i] = *digest;
  }
  return Status();
}

// Each shard's full tensor and box, each box inside its tensor.
StatusOr<std::shared_ptr<const PublisherImpl::OwnShape>> PublisherImpl::state_own_shape(
    const std::vector<ShardView>& sent) {
  auto own = std::make_shared<OwnShape>();
  own->specs.reserve(sent.size());
  own->holds.reserve(sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    const ShardView& s = sent[i];
    TensorSpec full = s.local.spec;
    if (!s.full_shape.empty()) full.shape = s.full_shape;
    reshard::Region box{s.offsets.empty() ? std::vector<int64_t>(full.shape.size(), 0) : s.offsets,
                        s.local.spec.shape};
    if (!box.inside(full.shape))
      return invalid_argument("shard of '" + s.local.spec.name + "' " + box.to_string() +
                              " is not inside its shape " + full.type_string());
    own->specs.push_back(std::move(full));
    own->holds.emplace_back(static_cast<uint32_t>(i), std::move(box));
  }
  HeldShapeDigest named;
  for (const auto& t : own->specs) named.tensor(t.name, t.dtype, t.shape);
  for (const auto& [t, box] : own->holds) named.box(t, box.offsets, box.lengths);
  own->digest = named.digest();
  return std::shared_ptr<const OwnShape>(std::move(own));
}

// `shards` are the tensors and boxes this part states, in its order.
bool PublisherImpl::OwnShape::stated_by(const std::vector<ShardView>& shards) const {
  if (shards.size() != specs.size()) return false;
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardView& s = shards[i];
    const TensorSpec& t = specs[i];
    const reshard::Region& box = holds[i].second;
    if (s.local.spec.name != t.name || s.local.spec.dtype != t.dtype || s.local.spec.shape != box.lengths ||
        (s.full_shape.empty() ? s.local.spec.shape : s.full_shape) != t.shape)
      return false;
    if (s.offsets.empty() ? std::any_of(box.offsets.begin(), box.offsets.end(), [](int64_t o) { return o != 0; })
                          : s.offsets != box.offsets)
      return false;
  }
  return true;
}

// Whatever ends a call before its plan went out ends the partner calls
// too (their shards are free again), with the same reason: those whose
// part arrived (taken, or still pending for this step). The engines too:
// one waiting for this update (a vLLM worker inside its round) ends now,
// naming the reason, instead of at its timeout.
UpdateResult PublisherImpl::refuse_sharded(ShardedCall& c, const Status& why) {
  std::map<std::string, uint64_t> partners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = holdings_.begin(); it != holdings_.end();)
      if (it->second.step == c.step) {
        partners[it->first] = it->second.seq;
        it = holdings_.erase(it);
      } else {
        ++it;
      }
    for (const auto& [id, h] : c.taken) partners[id] = h.seq;
    RefusedStep& refused = refused_steps_[c.step];
    refused.why = why.message();
    for (const auto& [id, seq] : partners) refused.ended.insert(id);
    while (refused_steps_.size() > 16) refused_steps_.erase(refused_steps_.begin());
  }
  for (const auto& [id, seq] : partners) end_trainer_call(id, seq, why.message());
  abandon_unplanned(c.r.version ? c.r.version : c.options.version.value_or(next_version()), c.r.version != 0,
                    why.message());
  return finish_sharded(c, why);
}

// Every trainer rank of the group states its part (within update_timeout):
// taken into `c.taken`, with the group and its engines' slices. A part of
// an earlier step came too late for its update: that call is ended (its
// shards are free). One of the next step means this call is the late one:
// it fails, and the part waits for rank 0's next call, which realigns the
// ranks. One further ahead is no part a next call takes (a claim of step
// 2^62): it fails this call only, dropped with its rank's call, so that it
// fails no other.
Status PublisherImpl::take_parts(ShardedCall& c) {
  std::unique_lock<std::mutex> lock(mu_);
  c.group = group_;
  if (std::string why = point_to_point_unavailable_reason(cfg_.data_plane.backend, cfg_.data_plane.local,
                                                          cfg_.publisher.device, static_cast<int>(c.group.size() + 1));
      !why.empty())
    return unavailable("sharded update refused before any byte moved: " + why);
  std::vector<std::string> sources;
  for (const auto& id : group_)
    if (is_job_source(id)) sources.push_back(id);
  std::string ahead, ahead_id;
  auto waiting = [&] {
    std::vector<std::string> out;
    for (const auto& id : sources) {
      auto it = holdings_.find(id);
      if (it != holdings_.end() && it->second.step < c.step) {
        end_trainer_call(id, it->second.seq,
                         "rank 0 publishes step " + std::to_string(c.step) + " now; step " +
                             std::to_string(it->second.step) + " of " + id + " came after its update ended");
        holdings_.erase(it);
        it = holdings_.end();
      }
      if (it != holdings_.end() && it->second.step > c.step && ahead.empty()) {
        ahead = id + " publishes step " + std::to_string(it->second.step) + ", ahead of this call's step " +
                std::to_string(c.step) + " (every rank gives the same version, or none does)";
        ahead_id = id;
      }
      if (it == holdings_.end()) out.push_back(id);
    }
    return out;
  };
  cv_.wait_until(lock, cap_, [&] { return waiting().empty() || !ahead.empty() || stopped_ || !departed_.empty(); });
  const auto missing = waiting();
  if (!ahead.empty()) {
    const std::string why = "sharded update of step " + std::to_string(c.step) + " refused: " + ahead;
    if (auto it = holdings_.find(ahead_id); it != holdings_.end() && it->second.step - c.step > 1) {
      end_trainer_call(ahead_id, it->second.seq, why);
      holdings_.erase(it);
    }
    return aborted(why);
  }
  if (!departed_.empty()) {
    needs_reform_ = true;
    return aborted("sharded update abandoned before any byte moved: " + departed_);
  }
  if (!missing.empty())
    return timeout_error("update_timeout (" + format_duration(cfg_.publisher.update_timeout) +
                         ") passed before trainer ranks " + join_ids(missing) + " published their part; no byte moved");
  for (const auto& id : sources) {
    c.taken[id] = std::move(holdings_[id]);
    c.r.parts_referred += c.taken[id].referred && c.taken[id].error.empty();
    c.r.holdings_bytes += c.taken[id].bytes;
  }
  for (const auto& id : sources) holdings_.erase(id);
  for (const auto& id : group_)
    if (auto it = wants_.find(id); it != wants_.end() && it->second.slices()) c.wants[id] = it->second;
  return Status();
}

// The shape of the plan about to go, for its members that hold it
// (send_plan_frames): the digest is computed here, off the lock.
void PublisherImpl::note_plan_shape(const UpdatePlan& plan, bool same_as_last) {
  if (same_as_last && shape_generation_) return;  // plan_shape_ names it already
  ++shape_generation_;
  const PlanShape shape{shape_generation_, sharded_shape_digest(plan)};
  std::lock_guard<std::mutex> lock(mu_);
  plan_shape_ = shape;
}

// The rounds of every update over the plan and its moves (the last
// update's, where the shape is the same: tensors, regions, ranks; the
// replicas' digests compared afresh): delta or dense, plan and answers,
// rank 0's own transfers, Applied.
void PublisherImpl::run_sharded(ShardedCall& c, UpdatePlan& plan,
                                const std::shared_ptr<const reshard::ShardedMoves>& moves,
                                const std::vector<ShardView>& sent) {
  pause_before_plan(plan.version);
  decide_sharded_delta(plan, c.group, c.r);
  if (plan_round(plan, c.r)) {
    Status data = move_sharded(plan, moves, sent, c.own, c.options.after_stream, c.r);
    collect_applied(plan, data, c.r);
    // What crossed the data plane: every engine's received bytes (its
    // encodings, in a delta), as each reported them.
    c.r.wire_bytes = 0;
    for (const auto& o : c.r.subscribers)
      if (!is_job_source(o.worker_id)) c.r.wire_bytes += o.bytes;
  } else {
    strike_wants_contradicted(plan, c.wants, c.r);
    // Where its plan did not go out (a member left the group since it
    // formed), the engines hear of its end, as of a refusal above; where it
    // went out, they end with its round and end_unplanned does nothing.
    end_unplanned(plan.version, true, c.r.status);
  }
}

// Rank 0's transfers of a sharded update (its shards to the engines).
Status PublisherImpl::move_sharded(const UpdatePlan& plan, const std::shared_ptr<const reshard::ShardedMoves>& moves,
                                   const std::vector<ShardView>& shards, const OwnPart& own, void* after_stream,
                                   UpdateResult& r) {
  MoveState m = start_move();
  reshard::RankBuffers buffers;
  buffers.index = held_index(moves, shards, own);
  reshard::RunOptions run;
  run.checksums = plan.checksum != Checksum::kNone;
  run.delta_base = plan.delta_base;
  run.version = plan.version;
  run.delta_always = cfg_.publisher.delta == DeltaMode::kAlways;
  run.staging_limit = 2 * cfg_.data_plane.bucket_bytes;  // packed pieces and encodings: two buckets at a time
  // On a GPU: round by round over the device's memory, dense, the moves
  // after the caller's stream (the memory's copies are ordered already).
  run.memory = reshard::run_memory(*comm_, mem_.get());
  run.sent = cfg_.publisher.delta != DeltaMode::kOff && !run.memory ? &sent_ : nullptr;
  Status data;
  if (run.memory) data = comm_->order_after(after_stream);
  reshard::RunOptions::Stats stats;
  run.stats = &stats;
  run.schedule = &moves->schedule;  // kept with the moves for the next update of the same shape
  if (data.ok()) data = reshard::run_reshard(moves->plan, moves->rounds, 0, *comm_, buffers, cap_, run);
  m.sent = stats.wire_sent;
  r.delta = plan.delta_base != 0;
  return end_move(plan, m, data);
}

// Rank 0's buffer of each piece it sends: the last update's index while the
// moves, its part and its shards' addresses are the same.
std::shared_ptr<const reshard::BufferIndex> PublisherImpl::held_index(
    const std::shared_ptr<const reshard::ShardedMoves>& moves, const std::vector<ShardView>& shards,
    const OwnPart& own) {
  std::vector<const void*> data(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) data[i] = shards[i].local.data;
  if (held_index_.moves.lock() == moves && held_index_.shape == own.shape && held_index_.data == data)
    return held_index_.index;
  held_index_ = {moves, own.shape, std::move(data), reshard::held_buffers(*moves, shards, own.shape->holds)};
  return held_index_.index;
}

}  // namespace paramcast
