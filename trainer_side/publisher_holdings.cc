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
  for (const auto& [t, region] : w.holds) {
    const TensorSpec& spec = w.tensors[t];
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
  // Bounded before anything is read: no more tensors than an update may
  // name, and as many regions (a rank holds one box of a tensor, or a few,
  // and the plan's checks cost the square of a tensor's regions).
  if (h.getTensors().size() > kMaxPlanTensors || h.getHolds().size() > kMaxPlanTensors) {
    out.error = id + " sent " + std::to_string(h.getTensors().size()) + " tensors and " +
                std::to_string(h.getHolds().size()) + " regions, more than the " + std::to_string(kMaxPlanTensors) +
                " of each an update may name";
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
            " outside its shape " + out.tensors[r.getTensor()].type_string();
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

Status PublisherImpl::sharded_shape(const ShardedCall& c, UpdatePlan& shape,
                                    std::map<std::string, std::string>& unusable) const {
  const auto& group = c.group;
  const auto& taken = c.taken;
  const auto& wants = c.wants;
  std::map<std::string, std::pair<size_t, std::string>> index;
  Status held = add_holdings("publisher", 0, 0, c.own.specs, c.own.holds, c.own.digests, shape, index);
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

}  // namespace paramcast
