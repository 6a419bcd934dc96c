// What the other trainer ranks state for a many-sender update, on rank 0:
// their Holdings (each rank's part of a step, on the control thread:
// bounded, checked, the newest call of each rank kept) and, with the
// engines' Wants, the shape of the update's plan (publisher_sharded.cc
// runs the call).
#include <map>

#include "common/control/log_guard.h"
#include "common/control/messages.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

namespace {

constexpr uint32_t kMaxRegionsPerTensor = 16;

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
      if (plan.tensors.size() >= kMaxPlanTensors)
        return invalid_argument("the trainer ranks name more than the " + std::to_string(kMaxPlanTensors) +
                                " tensors an update may name (" + who + " adds '" + control::printable(t.name) + "' and more)");
      it = index.emplace(t.name, std::make_pair(plan.tensors.size(), who)).first;
      plan.tensors.push_back(t);
    } else {
      const TensorSpec& known = plan.tensors[it->second.first];
      if (known.dtype != t.dtype || known.shape != t.shape)
        return invalid_argument("tensor '" + t.name + "': " + who + " holds it as " + t.type_string() + ", " +
                                it->second.second + " as " + known.type_string());
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
  for (const auto& [t, region] : w.part->holds) {
    const TensorSpec& spec = w.part->tensors[t];
    auto it = index.find(spec.name);
    if (it == index.end()) continue;  // not in this update: its plan check names it
    const TensorSpec& known = plan.tensors[it->second.first];
    if (known.dtype != spec.dtype || known.shape != spec.shape)
      return invalid_argument("tensor '" + spec.name + "': " + who + " serves a slice of it as " + spec.type_string() +
                              ", " + it->second.second + " holds it as " + known.type_string());
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
  // A part the rank refused itself is read as such (its error), by reference or not.
  const bool own_error = h.hasError() && h.getError().size() > 0;
  SourceHoldings out = h.getShapeRef() && !own_error ? held_by_reference(id, h) : read_holdings(id, h);
  out.bytes = h.totalSize().wordCount * sizeof(capnp::word);
  const auto member = server_.member(id);
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!out.referred && out.error.empty() && !h.getWithdrawn() && member)  // what its next calls may refer to
      kept_parts_[id] = {member->incarnation, out.part};
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

std::shared_ptr<const PublisherImpl::HeldShape> PublisherImpl::SourceHoldings::empty_part() {
  static const auto none = std::make_shared<const HeldShape>();
  return none;
}

PublisherImpl::SourceHoldings PublisherImpl::read_holdings(const std::string& id, proto::Holdings::Reader h) const {
  SourceHoldings out;
  out.seq = h.getSeq();
  out.step = h.getStep();
  if (h.hasError() && h.getError().size() > 0) {  // the rank refused its own part
    out.error = id + " cannot publish its part: " + control::printable(h.getError().cStr(), 1024);
    return out;
  }
  // Bounded before anything is read: no more tensors than an update may
  // name, and as many regions (a rank holds one box of a tensor, or a few,
  // and the plan's checks cost the square of a tensor's regions).
  if (h.getTensors().size() > kMaxPlanTensors || h.getHolds().size() > kMaxPlanTensors) {
    out.error = id + " sent " + std::to_string(h.getTensors().size()) + " tensors and " +
                std::to_string(h.getHolds().size()) + " regions, more than the " + std::to_string(kMaxPlanTensors) +
                " of each an update may name";
    return out;
  }
  auto part = std::make_shared<HeldShape>();
  std::string bad = read_part(h, *part, out.digests);
  if (!bad.empty()) out.error = id + " sent regions the update cannot use: " + bad;
  out.part = std::move(part);
  return out;
}

// The tensors and boxes of a part stated whole (and each box's digest), and
// the part's digest; what is wrong with them, in words, or empty.
std::string PublisherImpl::read_part(proto::Holdings::Reader h, HeldShape& part, std::map<size_t, uint64_t>& digests) {
  std::string bad;
  HeldShapeDigest named;
  for (auto e : h.getTensors()) {
    TensorSpec t;
    t.name = e.getName().cStr();
    auto d = parse_dtype(e.getDtype().cStr());
    for (int64_t v : e.getShape()) t.shape.push_back(v);
    if (!d) bad = "tensor '" + control::printable(t.name) + "' has unknown dtype '" + control::printable(e.getDtype().cStr()) + "'";
    else t.dtype = *d;
    if (bad.empty() && !t.nbytes().ok()) bad = t.nbytes().status().message();
    named.tensor(t.name, t.dtype, t.shape);
    part.tensors.push_back(std::move(t));
  }
  for (auto r : h.getHolds()) {
    reshard::Region region;
    for (int64_t v : r.getOffsets()) region.offsets.push_back(v);
    for (int64_t v : r.getLengths()) region.lengths.push_back(v);
    if (r.getTensor() >= part.tensors.size()) bad = "a region of tensor #" + std::to_string(r.getTensor());
    else if (!region.inside(part.tensors[r.getTensor()].shape))
      bad = "'" + control::printable(part.tensors[r.getTensor()].name) + "' " + region.to_string() +
            " outside its shape " + part.tensors[r.getTensor()].type_string();
    if (r.getDigested()) digests[part.holds.size()] = r.getDigest();
    named.box(r.getTensor(), region.offsets, region.lengths);
    part.holds.emplace_back(r.getTensor(), std::move(region));
  }
  part.digest = named.digest();
  // Bounded by name: a tensor stated under several entries is one tensor.
  std::map<std::string, uint32_t> per_tensor;
  for (const auto& t : part.tensors)
    if (per_tensor.count(t.name) && bad.empty()) bad = "'" + control::printable(t.name) + "' stated twice";
    else per_tensor[t.name] = 0;
  for (const auto& [t, region] : part.holds)
    if (t < part.tensors.size() && ++per_tensor[part.tensors[t].name] > kMaxRegionsPerTensor && bad.empty())
      bad = "more than " + std::to_string(kMaxRegionsPerTensor) + " regions of '" +
            control::printable(part.tensors[t].name) + "'";
  return bad;
}

// A part stated by reference: the rank's kept part of that digest, stated
// by this very process, with this call's digests (one per kept box).
PublisherImpl::SourceHoldings PublisherImpl::held_by_reference(const std::string& id, proto::Holdings::Reader h) {
  SourceHoldings out;
  out.seq = h.getSeq();
  out.step = h.getStep();
  out.referred = true;
  const auto m = server_.member(id);
  KeptPart kept;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = kept_parts_.find(id); it != kept_parts_.end()) kept = it->second;
  }
  const std::string call = id + "'s part of its call " + std::to_string(out.seq);
  if (!kept.part || !m || kept.incarnation != m->incarnation || kept.part->digest != h.getShapeRef()) {
    out.error = call + " refers to its part " + digest_hex(h.getShapeRef()) + ", which rank 0 does not keep (" +
                (kept.part && m && kept.incarnation == m->incarnation ? "it keeps " + digest_hex(kept.part->digest)
                                                                      : std::string("none from this process")) +
                "); its next call states its part whole";
    return out;
  }
  const auto digests = h.getDigests();
  const auto boxes = h.getDigestBoxes();
  const size_t held = kept.part->holds.size();
  if (h.getTensors().size() || h.getHolds().size() ||
      (boxes.size() ? boxes.size() != digests.size() : digests.size() && digests.size() != held)) {
    out.error = call + " by reference carries " + std::to_string(h.getTensors().size()) + " tensors, " +
                std::to_string(h.getHolds().size()) + " regions, " + std::to_string(digests.size()) + " digests and " +
                std::to_string(boxes.size()) + " digest boxes (expected none, none, and 0 or one digest per kept " +
                "region (" + std::to_string(held) + ") or per box named)";
    return out;
  }
  for (unsigned k = 0; k < digests.size(); ++k) {
    const size_t i = boxes.size() ? boxes[k] : k;
    if (i >= held || (k && boxes.size() && i <= boxes[k - 1])) {
      out.error = call + " by reference digests box " + std::to_string(i) +
                  (i >= held ? ", past its " + std::to_string(held) + " boxes"
                             : " after box " + std::to_string(boxes[k - 1]) + " (the boxes increase)") +
                  "; its next call states its part whole";
      out.digests.clear();
      return out;
    }
    if (!kept.part->holds[i].second.empty()) out.digests.emplace_hint(out.digests.end(), i, digests[k]);
  }
  out.part = std::move(kept.part);
  return out;
}

Status PublisherImpl::sharded_shape(const ShardedCall& c, UpdatePlan& shape,
                                    std::map<std::string, std::string>& unusable, std::vector<size_t>& firsts) const {
  const auto& group = c.group;
  const auto& taken = c.taken;
  const auto& wants = c.wants;
  std::map<std::string, std::pair<size_t, std::string>> index;
  firsts = {0};
  Status held = add_holdings("publisher", 0, 0, c.own.shape->specs, c.own.shape->holds, c.own.digests, shape, index);
  for (size_t i = 0; i < group.size() && held.ok(); ++i) {
    auto it = taken.find(group[i]);
    if (it == taken.end()) continue;
    firsts.push_back(shape.holders.size());
    if (!it->second.error.empty()) held = invalid_argument(it->second.error);
    else
      held = add_holdings(group[i], static_cast<int>(i + 1), it->second.seq, it->second.part->tensors, it->second.part->holds,
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

// The update's plan: every rank's holdings and the engines' slices, one
// plan checked whole before anything moves. An engine whose Wants it cannot
// use is left out of the update (the others form again without it), not
// the update. Laid out as a streamed plan (no buckets: none is needed, and
// a hostile size costs nothing), then marked sharded. The same inputs as
// the last plan's (kept_plan_) make no plan: only its version, the
// holders' seqs and their digests are new.
StatusOr<UpdatePlan> PublisherImpl::sharded_plan(ShardedCall& c) {
  PlanInputs inputs = plan_inputs(c);
  if (kept_plan_ && kept_plan_->inputs == inputs) return plan_from_kept(c);
  if (kept_plan_) PC_INFO("publisher: a sharded plan made afresh: " << plan_change(inputs));
  // The kept plan serves only while its moves are the moves cache's last:
  // this plan replaces them, whether or not it is kept itself (an engine
  // left out for its Wants makes a plan that is not).
  kept_plan_.reset();
  UpdatePlan shape;
  std::map<std::string, std::string> unusable;
  std::vector<size_t> firsts;
  Status held = sharded_shape(c, shape, unusable, firsts);
  const bool keep = held.ok() && unusable.empty();
  if (held.ok() && !unusable.empty()) {
    held = leave_out_wants(unusable, c.wants, c.group);
    shape = UpdatePlan();
    unusable.clear();
    if (held.ok()) held = sharded_shape(c, shape, unusable, firsts);
    if (held.ok() && !unusable.empty())
      held = invalid_argument("sharded update refused before any byte moved: " + unusable.begin()->second);
  }
  if (!held.ok()) return held;
  auto plan = make_plan(shape.tensors, c.options, true, c.r);
  if (!plan.ok()) return plan.status();
  plan->streamed = false;
  plan->bucket_bytes = 0;
  plan->covered.clear();
  plan->sharded = true;
  plan->holders = std::move(shape.holders);
  plan->wanters = std::move(shape.wanters);
  c.r.buckets = 0;
  if (keep) c.made = KeptPlan{std::move(inputs), *plan, std::move(firsts)};
  return plan;
}

// What the call's plan is made from: the group, rank 0's part's digest,
// each trainer rank's part and each engine's Wants (the objects rank 0
// read: a new message is a new input, even if it states the same).
PublisherImpl::PlanInputs PublisherImpl::plan_inputs(const ShardedCall& c) const {
  PlanInputs in{c.group, c.own.shape->digest, {}, {}, c.options.partial};
  for (const auto& id : c.group) {
    auto t = c.taken.find(id);
    auto w = c.wants.find(id);
    in.parts.push_back(t != c.taken.end() && t->second.error.empty() ? t->second.part : nullptr);
    in.wants.push_back(w != c.wants.end() ? w->second.part : nullptr);
  }
  return in;
}

// Why the kept plan does not serve `now`, in words (for the log).
std::string PublisherImpl::plan_change(const PlanInputs& now) const {
  const PlanInputs& was = kept_plan_->inputs;
  if (was.group != now.group) return "the group changed";
  if (was.own != now.own) return "rank 0's part changed";
  for (size_t i = 0; i < now.group.size(); ++i) {
    if (was.parts[i] != now.parts[i]) return now.group[i] + " stated another part";
    if (was.wants[i] != now.wants[i]) return now.group[i] + " stated other Wants";
  }
  return now.partial ? "the update is partial" : "the update is whole";
}

// The kept plan for this call: its version, and each holder's seq and
// digests of this call (rank 0's own, then each trainer rank's in group
// order, as sharded_shape laid them out).
StatusOr<UpdatePlan> PublisherImpl::plan_from_kept(ShardedCall& c) {
  KeptPlan& kept = *kept_plan_;
  if (Status s = plan_version(kept.plan.tensors.size(), c.options, c.r); !s.ok()) return s;
  UpdatePlan plan = std::move(kept.plan);  // lent for the call (weight_update_sharded gives it back)
  plan.version = c.r.version;
  last_version_ = c.r.version;
  c.r.bytes = plan.total_bytes;
  c.r.buckets = 0;
  c.from_kept = c.r.plan_kept = true;
  size_t source = 0;
  auto refresh = [&](uint64_t seq, const std::map<size_t, uint64_t>& digests) {
    const size_t begin = kept.firsts[source];
    const size_t end = ++source < kept.firsts.size() ? kept.firsts[source] : plan.holders.size();
    for (size_t i = begin; i < end; ++i) {
      plan.holders[i].seq = seq;
      auto d = digests.find(i - begin);
      plan.holders[i].digest = d != digests.end() ? std::optional<uint64_t>(d->second) : std::nullopt;
    }
  };
  refresh(0, c.own.digests);
  for (const auto& id : c.group)
    if (auto it = c.taken.find(id); it != c.taken.end()) refresh(it->second.seq, it->second.digests);
  return plan;
}

}  // namespace paramcast
