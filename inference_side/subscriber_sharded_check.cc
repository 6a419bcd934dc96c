// A member's check of a sharded (many-sender) plan before it accepts it: a
// trainer rank takes sharded plans only, and only with its own holdings in
// them; an engine checks the tensors as for any plan (on a GPU: registered
// buffers only, no callback), and must be planned exactly the slices it
// registered (else a piece would not fit its buffer): its rank's wants in
// the plan, region by region.
//
// The checks of the plan's shape against the registrations (or a trainer
// rank's part) are the costly ones at 50,000 tensors; a plan by reference
// (Plan.shapeRef) to the very kept plan they last passed (by identity,
// never by digest), with the same registrations and part, passes them
// again without a walk (checked_).
#include <set>
#include <string_view>
#include <unordered_map>

#include "inference_side/plan_check.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {
namespace {

// The boxes of `shards` (indices in their order) that a holder other than
// `rank` holds too in `plan`: replicas, whose digests rank 0 compares.
std::vector<uint32_t> replicated_boxes(const UpdatePlan& plan, int rank, const std::vector<ShardView>& shards) {
  std::unordered_map<std::string_view, std::vector<std::pair<reshard::Region, uint32_t>>> mine;
  for (uint32_t i = 0; i < shards.size(); ++i) {
    const auto& full = shards[i].full_shape.empty() ? shards[i].local.spec.shape : shards[i].full_shape;
    mine[shards[i].local.spec.name].push_back({box_of(shards[i], full), i});
  }
  std::vector<bool> shared(shards.size(), false);
  for (const auto& h : plan.holders) {
    if (h.rank == rank || h.tensor < 0 || static_cast<size_t>(h.tensor) >= plan.tensors.size()) continue;
    auto it = mine.find(plan.tensors[static_cast<size_t>(h.tensor)].name);
    if (it == mine.end()) continue;
    for (const auto& [box, i] : it->second)
      if (box.offsets == h.offsets && box.lengths == h.lengths) shared[i] = true;
  }
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < shared.size(); ++i)
    if (shared[i]) out.push_back(i);
  return out;
}

}  // namespace

std::vector<Mismatch> SubscriberImpl::check_sharded(const UpdatePlan& plan, const ShapeId& shape) {
  std::vector<Mismatch> out;
  if (!plan.sharded) return check_not_sharded();
  if (lost_.refuses_slices()) {  // test hook: a lying engine
    std::lock_guard<std::mutex> lock(reg_mu_);
    if (!slices_.empty())
      out.push_back({Mismatch::Kind::kOther, slices_.begin()->first, "its slice", "PARAMCAST_FAULT_REFUSE_SLICES"});
  }
  // A trainer rank takes a delta plan as any: it sends a delta of each
  // piece it sent as the base version, the rest dense.
  if (!source_)
    if (auto refusal = delta_refusal(plan)) out.push_back(*refusal);
  int rank = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rank = rank_;
  }
  if (source_) check_source_part(plan, rank, shape, out);
  else check_engine_part(plan, rank, shape, out);
  return out;
}

// A broadcast plan: refused by a trainer rank and by an engine with slices.
std::vector<Mismatch> SubscriberImpl::check_not_sharded() {
  std::vector<Mismatch> out;
  std::lock_guard<std::mutex> lock(reg_mu_);
  if (source_)
    out.push_back({Mismatch::Kind::kOther, "<plan>", "a sharded plan (this is trainer rank " + id_ + ")",
                   "a broadcast plan"});
  for (const auto& [name, s] : slices_)
    out.push_back({Mismatch::Kind::kOther, name,
                   "a sharded (many-sender) plan: a slice " + box_of(s, s.full_shape).to_string() + " is registered",
                   "a broadcast plan, which carries the whole tensor"});
  return out;
}

// A trainer rank: only during a publish call, and only the shards of that
// call (a plan made from an older call's holdings would send bytes that
// changed), region by region.
void SubscriberImpl::check_source_part(const UpdatePlan& plan, int rank, const ShapeId& shape,
                                       std::vector<Mismatch>& out) {
  std::lock_guard<std::mutex> lock(reg_mu_);
  if (!active_seq_) {
    out.push_back({Mismatch::Kind::kOther, "<holdings>", "a publish call of " + id_ + " under way",
                   "none (its last call ended)"});
    return;
  }
  for (const auto& h : plan.holders)
    if (h.rank == rank && h.seq != active_seq_) {
      out.push_back({Mismatch::Kind::kOther, "<holdings>", "the part of publish call " + std::to_string(active_seq_),
                     "the part of call " + std::to_string(h.seq)});
      return;
    }
  const uint64_t part = part_sent_.first == active_seq_ ? part_sent_.second : 0;
  const CheckedShape now{shape, 0, part, rank, plan.partial};
  if (!(shape && part && checked_ == now)) {
    const UpdatePlan& regions = regions_of(plan, shape);
    std::set<std::pair<std::string, reshard::Region>> mine, planned;
    if (holdings_)
      for (const auto& h : *holdings_) {
        const auto& full = h.full_shape.empty() ? h.local.spec.shape : h.full_shape;
        mine.insert({h.local.spec.name, box_of(h, full)});
      }
    for (const auto& h : regions.holders)
      if (h.rank == rank && h.tensor >= 0)
        planned.insert({regions.tensors[static_cast<size_t>(h.tensor)].name, reshard::Region{h.offsets, h.lengths}});
    if (mine != planned) {
      out.push_back({Mismatch::Kind::kOther, "<holdings>",
                     std::to_string(mine.size()) + " regions of publish call " + std::to_string(active_seq_),
                     std::to_string(planned.size()) + " other regions for rank " + std::to_string(rank)});
      return;
    }
    // A partial plan need not name every holder: the next call digests every box.
    replicated_ = {};
    if (part && holdings_ && !plan.partial)
      replicated_ = {part, std::make_shared<const std::vector<uint32_t>>(replicated_boxes(regions, rank, *holdings_))};
  }
  if (!out.empty()) return;
  checked_ = now;                // a later plan by reference to it passes as this one
  if (part) part_taken_ = part;  // its next call may refer to it
  planned_calls_[plan.version] = active_seq_;
  while (planned_calls_.size() > 16) planned_calls_.erase(planned_calls_.begin());
}

// An engine: the plan's tensors against its registrations, and the plan's
// wants for its rank against the slices it registered.
void SubscriberImpl::check_engine_part(const UpdatePlan& plan, int rank, const ShapeId& shape,
                                       std::vector<Mismatch>& out) {
  std::lock_guard<std::mutex> lock(reg_mu_);
  const CheckedShape now{shape, registrations_, 0, rank, plan.partial};
  if (shape && checked_ == now) return;
  const size_t before = out.size();
  // On a GPU every piece lands in place: the callback's tensors are
  // assembled in host memory, which a sharded update on NCCL never writes.
  if (device_.is_cuda())
    for (const auto& t : plan.tensors)
      if (!registry_.count(t.name) && !slices_.count(t.name))
        out.push_back({Mismatch::Kind::kDevice, t.name,
                       "a buffer registered on " + device_.to_string() + " (a sharded update on a GPU lands in place)",
                       "the tensor callback"});
  // The names and full shapes as for any plan (a slice stands for its tensor).
  auto registry = registry_;
  for (const auto& [name, s] : slices_)
    registry[name] = TensorView{TensorSpec{name, s.local.spec.dtype, s.full_shape}, s.local.data, s.local.device};
  auto more = check_plan(plan, registry, bool(callback_));
  out.insert(out.end(), more.begin(), more.end());
  check_planned_slices(regions_of(plan, shape), rank, out);
  if (out.size() == before) checked_ = now;  // a later plan by reference to it passes as this one
}

// What the plan has this rank receive, against what it registered (reg_mu_ held).
void SubscriberImpl::check_planned_slices(const UpdatePlan& plan, int rank, std::vector<Mismatch>& out) const {
  std::map<std::string, reshard::Region> planned;
  bool listed = false;
  for (const auto& w : plan.wanters) {
    if (w.rank != rank) continue;
    listed = true;
    if (w.tensor >= 0) planned[plan.tensors[static_cast<size_t>(w.tensor)].name] = reshard::Region{w.offsets, w.lengths};
  }
  for (const auto& t : plan.tensors) {
    auto slice = slices_.find(t.name);
    const reshard::Region mine = slice != slices_.end() ? box_of(slice->second, t.shape) : reshard::Region::whole(t.shape);
    auto it = planned.find(t.name);
    const std::string got = !listed ? "the whole tensor (the plan lists no slices for rank " + std::to_string(rank) + ")"
                            : it == planned.end() ? "nothing"
                                                  : it->second.to_string();
    if (listed ? (it == planned.end() || !(it->second == mine)) : slice != slices_.end())
      out.push_back({Mismatch::Kind::kOther, t.name, "the slice " + mine.to_string() + " this engine registered", got});
  }
}

}  // namespace paramcast
