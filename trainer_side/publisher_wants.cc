// An engine's Wants on rank 0 (tensor parallelism: the slices it serves):
// kept per engine, taken at update boundaries (the Wants in force when a
// plan is made are those it is checked against; a newer one waits for the
// next update), and, where an update cannot use them, the engine left out
// of that update and of later formations until it states others, never
// the update itself (publisher_sharded.cc plans with them).
#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "common/control/messages.h"
#include "common/log.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

// An engine's slices: kept until it sends others or leaves; one entry per
// member.
void PublisherImpl::on_wants(const std::string& id, proto::Holdings::Reader h) {
  if (!server_.member(id) || is_job_source(id)) return;
  SourceHoldings out = read_holdings(id, h);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = wants_.find(id);
  if (it != wants_.end() && it->second.seq > out.seq) return;  // an older snapshot, overtaken
  // Regions no plan can use (outside their tensor, too many): left out at
  // the next formation, without a plan to find it.
  if (!out.error.empty()) {
    const bool again = wants_refused_locked(id);  // said once per run of refused Wants
    wants_refused_[id] = {out.seq, out.error};
    if (!again)
      PC_WARN("publisher: leaving " << id << " out of the next updates until it states other Wants: " << out.error);
  }
  // An empty one (it serves every tensor whole again) is kept too, for its
  // seq: an older snapshot that arrives after it must not come back.
  wants_[id] = std::move(out);
}

// Its Wants in force are those refused (it stated no others since).
bool PublisherImpl::wants_refused_locked(const std::string& id) const {
  auto refused = wants_refused_.find(id);
  auto it = wants_.find(id);
  return refused != wants_refused_.end() && it != wants_.end() && it->second.seq == refused->second.seq;
}

std::vector<std::pair<std::string, std::string>> PublisherImpl::left_out_for_wants_locked() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [id, refused] : wants_refused_) {
    if (!wants_refused_locked(id) || !server_.is_live(id)) continue;
    out.emplace_back(id, "its Wants cannot be used (" + refused.why + "); it is left out until it states others");
  }
  return out;
}

Status PublisherImpl::leave_out_wants(const std::map<std::string, std::string>& unusable,
                                      const std::map<std::string, SourceHoldings>& wants,
                                      std::vector<std::string>& group) {
  std::vector<std::string> rest;
  bool engine_left = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : group_)
      if (!unusable.count(id)) {
        rest.push_back(id);
        engine_left = engine_left || !is_job_source(id);
      }
    // No engine can take this plan: the trainer's tensors disagree with all
    // of them (a dtype changed), so the update is refused, naming why, and
    // no engine is held out of the next one.
    if (!engine_left) return no_engine_takes(unusable);
    for (const auto& [id, why] : unusable)
      if (auto it = wants.find(id); it != wants.end()) wants_refused_[id] = {it->second.seq, why};
  }
  for (const auto& [id, why] : unusable)
    PC_WARN("publisher: leaving " << id << " out of this update, and of the next ones until it states other Wants: "
                                  << why);
  // The others form again at once, within the update's deadline: one
  // engine's Wants cost this update a formation, not the update.
  if (Status s = form_group(cap_, 3, &rest); !s.ok()) return s;
  if (Status s = every_trainer_rank_in_group(); !s.ok()) return s;
  if (Status s = some_engine_in_group(); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  group = group_;
  return Status();
}

Status PublisherImpl::no_engine_takes(const std::map<std::string, std::string>& unusable) {
  std::string what;
  size_t shown = 0;
  for (const auto& [id, why] : unusable) {
    if (++shown > 3) break;
    what += (what.empty() ? "" : "; ") + id + ": " + why;
  }
  if (unusable.size() > 3) what += "; and " + std::to_string(unusable.size() - 3) + " more";
  return invalid_argument("sharded update refused before any byte moved: no engine can take its plan (" + what +
                          "); correct the trainer's tensors or the engines' Wants");
}

// An engine that refused a sharded plan over the slices its Wants asked
// for, Wants it has not changed since, contradicts itself. Once can be a
// race (a registration the control thread checked a moment before the
// Wants it causes went out); twice over the same Wants cannot: an honest
// engine's next plan is made from its newer Wants. So the second such
// refusal quarantines it, as a delta liar's second refusal does, and it
// costs the others two updates. A refusal naming a tensor the plan lacks,
// or one it does not slice, is no lie (the trainer's tensors do not match).
void PublisherImpl::strike_wants_contradicted(const UpdatePlan& plan, const std::map<std::string, SourceHoldings>& wants,
                                              const UpdateResult& r) {
  std::optional<std::set<std::string>> in_plan;  // the plan's names, read once an engine's refusal is weighed
  auto planned_name = [&](const std::string& name) {
    if (!in_plan) {
      in_plan.emplace();
      for (const auto& t : plan.tensors) in_plan->insert(t.name);
    }
    return in_plan->count(name) > 0;
  };
  std::vector<std::pair<std::string, std::string>> strike;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& o : r.subscribers) {
      const auto planned = wants.find(o.worker_id);
      const auto now = wants_.find(o.worker_id);
      if (o.status.code() != Code::kRejected || o.mismatches.empty() || planned == wants.end() ||
          now == wants_.end() || now->second.seq != planned->second.seq)
        continue;
      std::set<std::string> sliced;
      const HeldShape& part = *planned->second.part;
      for (const auto& [tensor, region] : part.holds)
        if (tensor < part.tensors.size()) sliced.insert(part.tensors[tensor].name);
      bool contradicts = true;
      for (const auto& m : o.mismatches)
        contradicts &= m.kind != Mismatch::Kind::kMissingName && sliced.count(m.name) && planned_name(m.name);
      if (!contradicts) continue;
      const uint64_t seq = planned->second.seq;
      if (std::exchange(wants_contradicted_[o.worker_id], seq) != seq) continue;  // the first: noted
      wants_contradicted_.erase(o.worker_id);
      strike.emplace_back(o.worker_id, "refused sharded plan v" + std::to_string(plan.version) +
                                           " and the one before it, which gave it exactly the slices its Wants (seq " +
                                           std::to_string(seq) + ") asked for (" + o.mismatches.front().to_string() + ")");
    }
  }
  for (const auto& [id, why] : strike) groups_.quarantine(id, why);
}

}  // namespace paramcast
