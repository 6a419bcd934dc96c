// Many-sender updates on rank 0 (Publisher::weight_update_sharded): the
// other trainer ranks' holdings (Holdings messages from PublisherRank
// members), one plan from all of them, checked before any byte moves
// (common/reshard/sharded_update.h), and rank 0's own transfers. The plan,
// answer and Applied rounds are those of every update (publisher.cc).
#include <algorithm>
#include <map>

#include "common/control/log_guard.h"
#include "common/control/messages.h"
#include "common/log.h"
#include "common/units.h"
#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"
#include "common/xxhash.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

namespace {

constexpr size_t kMaxHeldTensors = 1 << 20;
constexpr uint32_t kMaxRegionsPerTensor = 16;

std::string spec_text(const TensorSpec& t) {
  std::string s(dtype_name(t.dtype));
  s += "[";
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (d) s += ",";
    s += std::to_string(t.shape[d]);
  }
  s += "]";
  return s;
}

// One rank's shards as the plan's tensors and holdings: the full specs
// (agreeing with those already named), and the boxes held.
Status add_holdings(const std::string& who, int rank, uint64_t seq, const std::vector<TensorSpec>& specs,
                    const std::vector<std::pair<uint32_t, reshard::Region>>& holds,
                    const std::map<size_t, uint64_t>& digests, UpdatePlan& plan,
                    std::map<std::string, std::pair<size_t, std::string>>& index) {
  std::vector<int64_t> local(specs.size(), -1);
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    auto it = index.find(t.name);
    if (it == index.end()) {
      it = index.emplace(t.name, std::make_pair(plan.tensors.size(), who)).first;
      plan.tensors.push_back(t);
    } else {
      const TensorSpec& known = plan.tensors[it->second.first];
      if (known.dtype != t.dtype || known.shape != t.shape)
        return invalid_argument("tensor '" + t.name + "': " + who + " holds it as " + spec_text(t) + ", " +
                                it->second.second + " as " + spec_text(known));
    }
    local[i] = static_cast<int64_t>(it->second.first);
  }
  bool any = false;
  for (size_t i = 0; i < holds.size(); ++i) {
    const auto& [t, region] = holds[i];
    if (t >= specs.size()) return invalid_argument(who + " holds tensor #" + std::to_string(t) + " of " +
                                                   std::to_string(specs.size()) + " it named");
    plan.holders.push_back({rank, local[t], region.offsets, region.lengths, seq, std::nullopt});
    if (auto d = digests.find(i); d != digests.end()) plan.holders.back().digest = d->second;
    any = true;
  }
  if (!any) plan.holders.push_back({rank, -1, {}, {}, seq, std::nullopt});
  return Status();
}

// An engine's slices: for each tensor of the plan, the region it names
// (same dtype and full shape, else a mismatch naming it), or the whole.
Status add_wants(const std::string& who, int rank, const PublisherImpl::SourceHoldings& w, UpdatePlan& plan,
                 const std::map<std::string, std::pair<size_t, std::string>>& index) {
  if (!w.error.empty()) return invalid_argument(w.error);
  std::map<size_t, const reshard::Region*> mine;
  for (const auto& [t, region] : w.holds) {
    const TensorSpec& spec = w.tensors[t];
    auto it = index.find(spec.name);
    if (it == index.end()) continue;  // not in this update: its plan check names it
    const TensorSpec& known = plan.tensors[it->second.first];
    if (known.dtype != spec.dtype || known.shape != spec.shape)
      return invalid_argument("tensor '" + spec.name + "': " + who + " serves a slice of it as " + spec_text(spec) +
                              ", " + it->second.second + " holds it as " + spec_text(known));
    if (mine.count(it->second.first))
      return invalid_argument(who + " registered two slices of '" + spec.name + "'");
    mine[it->second.first] = &region;
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    auto it = mine.find(t);
    const reshard::Region region = it != mine.end() ? *it->second : reshard::Region::whole(plan.tensors[t].shape);
    plan.wanters.push_back({rank, static_cast<int64_t>(t), region.offsets, region.lengths});
  }
  return Status();
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

// A trainer rank's part of the next sharded update. Bounded: one pending
// entry per member (a newer one replaces it), its lists by the decode limits.
void PublisherImpl::on_holdings(const std::string& id, proto::Holdings::Reader h) {
  if (!is_job_source(id)) {
    server_.log_peer("unexpected message", "Holdings from '" + control::printable(id) +
                                               "', which is not a trainer rank of this job (publisher.ranks: " +
                                               std::to_string(cfg_.publisher.ranks) + "), ignored");
    return;
  }
  if (!h.getWithdrawn() && !newer_holdings(id, h.getSeq(), h.getStep())) return;
  SourceHoldings out = read_holdings(id, h);
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (h.getWithdrawn()) {
      // Its call ended (it gave up waiting): these shards may change or go.
      if (auto it = holdings_.find(id); it != holdings_.end() && it->second.seq <= h.getSeq()) holdings_.erase(it);
      return;
    }
    // Its part of a step this rank already refused: that call ends now.
    if (auto it = refused_steps_.find(out.step); it != refused_steps_.end() && it->second.ended.insert(id).second) {
      refused = it->second.why;
      if (it->second.ended.size() + 1 >= static_cast<size_t>(cfg_.publisher.ranks)) refused_steps_.erase(it);
    } else {
      holdings_[id] = std::move(out);
    }
  }
  if (!refused.empty()) return end_trainer_call(id, h.getSeq(), refused);
  cv_.notify_all();
}

// A rank's calls count up (Holdings.seq): a part counts only for the call
// it names, and one of a call this rank has already heard of (a delayed
// duplicate, a replay) is dropped, logged, never put in place of the part
// pending: the update in flight waits for none and ends none for it. The
// count is the process's (its control incarnation): a restarted rank
// counts from 1 again, one that rejoins goes on counting.
bool PublisherImpl::newer_holdings(const std::string& id, uint64_t seq, uint64_t step) {
  const auto m = server_.member(id);
  const uint64_t incarnation = m ? m->incarnation : 0;
  uint64_t last = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& [of, seen] = holdings_seq_[id];  // one entry per trainer rank (is_job_source)
    if (of != incarnation) seen = 0;        // another process: its calls count from 1
    of = incarnation;
    if (seq > seen) {
      seen = seq;
      return true;
    }
    last = seen;
  }
  server_.log_peer("stale holdings", id + "'s Holdings of its call " + std::to_string(seq) + " (step " +
                                         std::to_string(step) + ") dropped: its call " + std::to_string(last) +
                                         " came already, and a part counts only for the call it names");
  return false;
}

PublisherImpl::SourceHoldings PublisherImpl::read_holdings(const std::string& id, proto::Holdings::Reader h) const {
  SourceHoldings out;
  out.seq = h.getSeq();
  out.step = h.getStep();
  if (h.hasError() && h.getError().size() > 0) {  // the rank refused its own part
    out.error = id + " cannot publish its part: " + control::printable(h.getError().cStr(), 1024);
    return out;
  }
  // Bounded before anything is read: the plan's checks cost the square of
  // a tensor's regions, and a rank holds one box of a tensor, or a few.
  if (h.getTensors().size() > kMaxHeldTensors || h.getHolds().size() > kMaxHeldTensors * kMaxRegionsPerTensor) {
    out.error = id + " sent " + std::to_string(h.getTensors().size()) + " tensors and " +
                std::to_string(h.getHolds().size()) + " regions, more than the " + std::to_string(kMaxHeldTensors) +
                " tensors of " + std::to_string(kMaxRegionsPerTensor) + " regions each a rank may state";
    return out;
  }
  std::string bad;
  for (auto e : h.getTensors()) {
    TensorSpec t;
    t.name = e.getName().cStr();
    auto d = parse_dtype(e.getDtype().cStr());
    for (int64_t v : e.getShape()) t.shape.push_back(v);
    if (!d) bad = "tensor '" + control::printable(t.name) + "' has unknown dtype '" + control::printable(e.getDtype().cStr()) + "'";
    else t.dtype = *d;
    if (bad.empty() && !t.nbytes().ok()) bad = t.nbytes().status().message();
    out.tensors.push_back(std::move(t));
  }
  for (auto r : h.getHolds()) {
    reshard::Region region;
    for (int64_t v : r.getOffsets()) region.offsets.push_back(v);
    for (int64_t v : r.getLengths()) region.lengths.push_back(v);
    if (r.getTensor() >= out.tensors.size()) bad = "a region of tensor #" + std::to_string(r.getTensor());
    else if (!region.inside(out.tensors[r.getTensor()].shape))
      bad = "'" + control::printable(out.tensors[r.getTensor()].name) + "' " + region.to_string() +
            " outside its shape " + spec_text(out.tensors[r.getTensor()]);
    if (r.getDigested()) out.digests[out.holds.size()] = r.getDigest();
    out.holds.emplace_back(r.getTensor(), std::move(region));
  }
  // Bounded by name: a tensor stated under several entries is one tensor.
  std::map<std::string, uint32_t> per_tensor;
  for (const auto& t : out.tensors)
    if (per_tensor.count(t.name) && bad.empty()) bad = "'" + control::printable(t.name) + "' stated twice";
    else per_tensor[t.name] = 0;
  for (const auto& [t, region] : out.holds)
    if (t < out.tensors.size() && ++per_tensor[out.tensors[t].name] > kMaxRegionsPerTensor && bad.empty())
      bad = "more than " + std::to_string(kMaxRegionsPerTensor) + " regions of '" +
            control::printable(out.tensors[t].name) + "'";
  if (!bad.empty()) out.error = id + " sent regions the update cannot use: " + bad;
  return out;
}

UpdateResult PublisherImpl::weight_update_sharded(const std::vector<ShardView>& shards, const UpdateOptions& options) {
  UpdateResult r;
  r.tensors = shards.size();
  if (update_mu_.held_by_me()) {
    r.status = invalid_argument("weight_update_sharded: a streamed update is open on this thread");
    return r;
  }
  std::lock_guard<UpdateGate> ulock(update_mu_);
  if (!options.version) ++sharded_calls_;
  const auto t0 = Clock::now();
  cap_ = t0 + cfg_.publisher.update_timeout;
  auto done = [&](UpdateResult& res) -> UpdateResult {
    res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    log_result(res);
    return std::move(res);
  };
  if (std::string why =
          point_to_point_unavailable_reason(cfg_.data_plane.backend, cfg_.data_plane.local, cfg_.publisher.device);
      !why.empty()) {
    std::string says = "weight_update_sharded moves point to point (data_plane.backend: gloo or shm in host "
                       "memory, nccl in a GPU's): ";
    says += why;
    r.status = unavailable(says);
    return done(r);
  }
  // What travels (publisher.transforms, or the update's): this rank
  // transforms what it holds, held for the call; the other ranks theirs.
  const auto& rules = options.transforms ? *options.transforms : cfg_.publisher.transforms;
  // On a GPU, everything that reads the shards (transforms, digests, moves)
  // comes after the caller's stream.
  if (cfg_.publisher.device.is_cuda())
    if (Status s = mem_->order_after(options.after_stream); !s.ok()) {
      r.status = s.with_context("weight_update_sharded: ordering after the caller's stream");
      return done(r);
    }
  transform::TransformedShards wire;
  Status transformed;
  if (!rules.empty() && cfg_.publisher.device.is_cuda())
    transformed = invalid_argument(std::string("UpdateOptions::transforms on publisher.device ") +
                                   cfg_.publisher.device.to_string() + ": " + transform::kCudaPending);
  else if (options.transforms && cfg_.publisher.ranks > 1 && *options.transforms != cfg_.publisher.transforms)
    transformed = invalid_argument("weight_update_sharded: UpdateOptions::transforms differ from "
                                   "publisher.transforms, which the other trainer ranks apply: give every rank the "
                                   "same rules in the config");
  else if (!rules.empty()) {
    auto t = transform::apply_shards(shards, rules);
    if (t.ok()) wire = std::move(t.value());
    else transformed = t.status();
    r.transformed = wire.transformed;
  }
  const std::vector<ShardView>& sent = rules.empty() ? shards : wire.views;
  r.tensors = sent.size();
  // This rank's own shards: on the publisher's device, each a box inside its tensor.
  std::vector<TensorSpec> own_specs;
  std::vector<std::pair<uint32_t, reshard::Region>> own_holds;
  std::map<size_t, uint64_t> own_digests;  // with checksums: each box's xxh64, compared with its replicas'
  for (size_t i = 0; i < sent.size(); ++i) {
    const ShardView& s = sent[i];
    TensorSpec full = s.local.spec;
    if (!s.full_shape.empty()) full.shape = s.full_shape;
    reshard::Region box{s.offsets.empty() ? std::vector<int64_t>(full.shape.size(), 0) : s.offsets,
                        s.local.spec.shape};
    std::string bad;
    if (s.local.device != cfg_.publisher.device)
      bad = "is on " + s.local.device.to_string() + ", not on publisher.device " + cfg_.publisher.device.to_string();
    else if (!box.inside(full.shape)) bad = box.to_string() + " is not inside its shape " + spec_text(full);
    else if (!box.empty() && !s.local.data) bad = "has no data pointer";
    if (!bad.empty()) {
      r.status = invalid_argument("shard of '" + s.local.spec.name + "' " + bad);
      return done(r);
    }
    own_specs.push_back(full);
    if (cfg_.data_plane.checksum != Checksum::kNone && !box.empty()) {
      auto digest = reshard::holding_digest(s.local.data, static_cast<uint64_t>(box.elements()) * dtype_size(full.dtype),
                                            s.local.device, mem_.get());
      if (!digest.ok()) {
        r.status = digest.status().with_context("shard of '" + s.local.spec.name + "'");
        return done(r);
      }
      own_digests[own_holds.size()] = *digest;
    }
    own_holds.emplace_back(static_cast<uint32_t>(i), std::move(box));
  }
  // The step this call publishes; every trainer rank's call of the same
  // step is its partner (counted on entry, whatever becomes of the call).
  const uint64_t step = options.version ? *options.version : sharded_calls_;
  {
    // A new call of a step refused before starts afresh: a partner's part
    // that comes now is this call's (or is ended by this call's refusal).
    std::lock_guard<std::mutex> lock(mu_);
    refused_steps_.erase(step);
  }
  // Whatever ends this call before its plan went out ends the partner calls
  // too (their shards are free again), with the same reason: those whose
  // part arrived (taken, or still pending for this step).
  std::map<std::string, SourceHoldings> taken;
  auto refuse = [&](Status why) {
    r.status = why;
    std::map<std::string, uint64_t> partners;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = holdings_.begin(); it != holdings_.end();)
        if (it->second.step == step) {
          partners[it->first] = it->second.seq;
          it = holdings_.erase(it);
        } else {
          ++it;
        }
    }
    for (const auto& [id, h] : taken) partners[id] = h.seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RefusedStep& refused = refused_steps_[step];
      refused.why = why.message();
      for (const auto& [id, seq] : partners) refused.ended.insert(id);
      while (refused_steps_.size() > 16) refused_steps_.erase(refused_steps_.begin());
    }
    for (const auto& [id, seq] : partners) end_trainer_call(id, seq, why.message());
    // The engines too: one waiting for this update (a vLLM worker inside
    // its round) ends now, naming the reason, instead of at its timeout.
    abandon_unplanned(r.version ? r.version : options.version.value_or(next_version()), r.version != 0,
                      why.message());
    return done(r);
  };
  if (!transformed.ok()) return refuse(transformed);
  if (Status s = ensure_group(); !s.ok()) return refuse(s);
  if (Status s = every_trainer_rank_in_group(); !s.ok()) return refuse(s);
  if (Status s = some_engine_in_group(); !s.ok()) return refuse(s);
  // Every trainer rank of the group states its part (within update_timeout).
  std::vector<std::string> group;
  std::map<std::string, SourceHoldings> wants;
  {
    std::unique_lock<std::mutex> lock(mu_);
    group = group_;
    if (std::string why = point_to_point_unavailable_reason(cfg_.data_plane.backend, cfg_.data_plane.local,
                                                            cfg_.publisher.device, static_cast<int>(group.size() + 1));
        !why.empty()) {
      lock.unlock();
      return refuse(unavailable("sharded update refused before any byte moved: " + why));
    }
    std::vector<std::string> sources;
    for (const auto& id : group_)
      if (is_job_source(id)) sources.push_back(id);
    // A part of an earlier step came too late for its update: that call is
    // ended (its shards are free). One of the next step means this call is
    // the late one: it fails, and the part waits for rank 0's next call,
    // which realigns the ranks. One further ahead is no part a next call
    // takes (a claim of step 2^62): it fails this call only, dropped with
    // its rank's call, so that it fails no other.
    std::string ahead, ahead_id;
    auto waiting = [&] {
      std::vector<std::string> out;
      for (const auto& id : sources) {
        auto it = holdings_.find(id);
        if (it != holdings_.end() && it->second.step < step) {
          end_trainer_call(id, it->second.seq,
                           "rank 0 publishes step " + std::to_string(step) + " now; step " +
                               std::to_string(it->second.step) + " of " + id + " came after its update ended");
          holdings_.erase(it);
          it = holdings_.end();
        }
        if (it != holdings_.end() && it->second.step > step && ahead.empty()) {
          ahead = id + " publishes step " + std::to_string(it->second.step) + ", ahead of this call's step " +
                  std::to_string(step) + " (every rank gives the same version, or none does)";
          ahead_id = id;
        }
        if (it == holdings_.end()) out.push_back(id);
      }
      return out;
    };
    cv_.wait_until(lock, cap_,
                   [&] { return waiting().empty() || !ahead.empty() || stopped_ || !departed_.empty(); });
    const auto missing = waiting();
    if (!ahead.empty()) {
      const std::string why = "sharded update of step " + std::to_string(step) + " refused: " + ahead;
      if (auto it = holdings_.find(ahead_id); it != holdings_.end() && it->second.step - step > 1) {
        end_trainer_call(ahead_id, it->second.seq, why);
        holdings_.erase(it);
      }
      lock.unlock();
      return refuse(aborted(why));
    }
    if (!departed_.empty() || !missing.empty()) {
      Status why = !departed_.empty() ? aborted("sharded update abandoned before any byte moved: " + departed_)
                                      : timeout_error("update_timeout (" + format_duration(cfg_.publisher.update_timeout) +
                                                      ") passed before trainer ranks " + join_ids(missing) +
                                                      " published their part; no byte moved");
      if (!departed_.empty()) needs_reform_ = true;
      lock.unlock();
      return refuse(why);
    }
    for (const auto& id : sources) taken[id] = std::move(holdings_[id]);
    for (const auto& id : sources) holdings_.erase(id);
    for (const auto& id : group_)
      if (auto it = wants_.find(id); it != wants_.end() && it->second.slices()) wants[id] = it->second;
  }
  // One plan from every rank's holdings; checked whole before anything
  // moves. An engine whose Wants it cannot use is left out of the update
  // (the others form again without it), not the update.
  UpdatePlan shape;
  std::map<std::string, std::string> unusable;
  Status held = sharded_shape(group, own_specs, own_holds, own_digests, taken, wants, shape, unusable);
  if (held.ok() && !unusable.empty()) {
    held = leave_out_wants(unusable, wants, group);
    shape = UpdatePlan();
    unusable.clear();
    if (held.ok()) held = sharded_shape(group, own_specs, own_holds, own_digests, taken, wants, shape, unusable);
    if (held.ok() && !unusable.empty())
      held = invalid_argument("sharded update refused before any byte moved: " + unusable.begin()->second);
  }
  if (!held.ok()) return refuse(held);
  std::vector<std::string> names = {"publisher"};
  names.insert(names.end(), group.begin(), group.end());
  // Laid out as a streamed plan (no buckets: none is needed, and a hostile
  // size costs nothing), then marked sharded.
  auto plan = make_plan(shape.tensors, options, true, r);
  if (!plan.ok()) return refuse(plan.status());
  plan->streamed = false;
  plan->bucket_bytes = 0;
  plan->covered.clear();
  plan->sharded = true;
  plan->holders = std::move(shape.holders);
  plan->wanters = std::move(shape.wanters);
  r.buckets = 0;
  // The same shape as the last update (tensors, regions, ranks): its moves
  // as they were, without planning; the replicas' digests compared afresh.
  auto moves = sharded_cache_.moves(*plan, static_cast<int>(group.size() + 1), names);
  if (!moves.ok()) return refuse(moves.status().with_context("refused before any byte moved"));
  pause_before_plan(plan->version);
  decide_sharded_delta(*plan, group, r);
  if (plan_round(*plan, r)) {
    Status data = move_sharded(*plan, **moves, sent, own_holds, options.after_stream, r);
    collect_applied(*plan, data, r);
    // What crossed the data plane: every engine's received bytes (its
    // encodings, in a delta), as each reported them.
    r.wire_bytes = 0;
    for (const auto& o : r.subscribers)
      if (!is_job_source(o.worker_id)) r.wire_bytes += o.bytes;
  } else {
    strike_wants_contradicted(*plan, wants, r);
    // Where its plan did not go out (a member left the group since it
    // formed), the engines hear of its end, as of a refusal above; where it
    // went out, they end with its round and end_unplanned does nothing.
    end_unplanned(plan->version, true, r.status);
  }
  // Failed for good (a plan abandoned for a dense try of the same version
  // is not): every partner call ends now, also that of a trainer rank that
  // never started its part (its Commit was lost) or is stalled in it (it
  // aborts that transfer before its call returns). A call that ended on its
  // own part's outcome already is not touched (another seq).
  if (!r.status.ok())
    for (const auto& [id, h] : taken) end_trainer_call(id, h.seq, r.status.message());
  return done(r);
}

Status PublisherImpl::sharded_shape(const std::vector<std::string>& group, const std::vector<TensorSpec>& own_specs,
                                    const std::vector<std::pair<uint32_t, reshard::Region>>& own_holds,
                                    const std::map<size_t, uint64_t>& own_digests,
                                    const std::map<std::string, SourceHoldings>& taken,
                                    const std::map<std::string, SourceHoldings>& wants, UpdatePlan& shape,
                                    std::map<std::string, std::string>& unusable) const {
  std::map<std::string, std::pair<size_t, std::string>> index;
  Status held = add_holdings("publisher", 0, 0, own_specs, own_holds, own_digests, shape, index);
  for (size_t i = 0; i < group.size() && held.ok(); ++i) {
    auto it = taken.find(group[i]);
    if (it == taken.end()) continue;
    if (!it->second.error.empty()) held = invalid_argument(it->second.error);
    else
      held = add_holdings(group[i], static_cast<int>(i + 1), it->second.seq, it->second.tensors, it->second.holds,
                          it->second.digests, shape, index);
  }
  if (!held.ok()) return held.with_context("sharded update refused before any byte moved");
  // The engines' slices (tensor parallelism): each wants exactly its regions
  // of every tensor it names, and the others whole.
  for (size_t i = 0; i < group.size(); ++i) {
    auto it = wants.find(group[i]);
    if (it == wants.end() || taken.count(group[i])) continue;
    if (Status s = add_wants(group[i], static_cast<int>(i + 1), it->second, shape, index); !s.ok())
      unusable[group[i]] = s.message();
  }
  return Status();
}

// Rank 0's transfers of a sharded update (its shards to the engines).
Status PublisherImpl::move_sharded(const UpdatePlan& plan, const reshard::ShardedMoves& moves,
                                   const std::vector<ShardView>& shards,
                                   const std::vector<std::pair<uint32_t, reshard::Region>>& boxes,
                                   void* after_stream, UpdateResult& r) {
  MoveState m = start_move();
  auto index = std::make_shared<reshard::BufferIndex>();
  for (const auto& [i, box] : boxes) index->add(shards[i].local.spec.name, static_cast<uint8_t*>(shards[i].local.data), box);
  reshard::RankBuffers buffers;
  buffers.find = [index](const TensorSpec& t, const reshard::Region& region) { return index->find(t.name, region); };
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
  run.schedule = &moves.schedule;  // kept with the moves for the next update of the same shape
  if (data.ok()) data = reshard::run_reshard(moves.plan, moves.rounds, 0, *comm_, buffers, cap_, run);
  m.sent = stats.wire_sent;
  r.delta = plan.delta_base != 0;
  return end_move(plan, m, data);
}

}  // namespace paramcast
