// Sharded (many-sender) updates on a member: a trainer rank (PublisherRank,
// `source_`) sends the pieces of its shards the plan gives it; an engine
// receives every tensor whole, each piece straight into its registered
// buffer (or, for tensors handed to its callback, into a host buffer of the
// tensor, handed over once every piece landed). Every rank derives the same
// transfers from the plan (common/reshard/sharded_update.h); each piece's
// xxh64 travels after it and is checked before it counts.
#include <cstring>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"
#include "inference_side/plan_check.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {

namespace {
reshard::Region box_of(const ShardView& s, const std::vector<int64_t>& full) {
  return {s.offsets.empty() ? std::vector<int64_t>(full.size(), 0) : s.offsets, s.local.spec.shape};
}
}  // namespace

Status SubscriberImpl::publish(const std::vector<ShardView>& shards) {
  for (const auto& s : shards) {
    const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
    const reshard::Region box = box_of(s, full);
    if (s.local.device.is_cuda())
      return invalid_argument("shard of '" + s.local.spec.name + "': sharded updates move host memory (Gloo)");
    if (!box.inside(full))
      return invalid_argument("shard of '" + s.local.spec.name + "' " + box.to_string() + " is not inside its shape");
    if (!box.empty() && !s.local.data) return invalid_argument("shard of '" + s.local.spec.name + "' has no data");
  }
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    holdings_ = shards;
    seq = ++publish_seq_;
  }
  client_->send(control::make_message(client_epoch(), client_->incarnation(), [&](auto b) {
    auto h = b.initHoldings();
    h.setSeq(seq);
    auto tensors = h.initTensors(static_cast<unsigned>(shards.size()));
    auto holds = h.initHolds(static_cast<unsigned>(shards.size()));
    for (size_t i = 0; i < shards.size(); ++i) {
      const ShardView& s = shards[i];
      const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
      const reshard::Region box = box_of(s, full);
      auto e = tensors[static_cast<unsigned>(i)];
      e.setName(s.local.spec.name);
      e.setDtype(std::string(dtype_name(s.local.spec.dtype)));
      auto shape = e.initShape(static_cast<unsigned>(full.size()));
      for (size_t d = 0; d < full.size(); ++d) shape.set(static_cast<unsigned>(d), full[d]);
      TensorSpec whole{s.local.spec.name, s.local.spec.dtype, full};
      e.setNbytes(whole.nbytes().ok() ? *whole.nbytes() : 0);
      auto r = holds[static_cast<unsigned>(i)];
      r.setTensor(static_cast<uint32_t>(i));
      auto off = r.initOffsets(static_cast<unsigned>(box.offsets.size()));
      for (size_t d = 0; d < box.offsets.size(); ++d) off.set(static_cast<unsigned>(d), box.offsets[d]);
      auto len = r.initLengths(static_cast<unsigned>(box.lengths.size()));
      for (size_t d = 0; d < box.lengths.size(); ++d) len.set(static_cast<unsigned>(d), box.lengths[d]);
    }
  }));
  return Status();
}

// A trainer rank takes sharded plans only, and only with its own holdings in
// them; an engine checks the tensors as for any plan, and needs host memory.
std::vector<Mismatch> SubscriberImpl::check_sharded(const UpdatePlan& plan) {
  std::vector<Mismatch> out;
  if (!plan.sharded) {
    out.push_back({Mismatch::Kind::kOther, "<plan>", "a sharded plan (this is trainer rank " + id_ + ")",
                   "a broadcast plan"});
    return out;
  }
  if (plan.delta_base) out.push_back({Mismatch::Kind::kOther, "<delta>", "a dense sharded plan", "a delta"});
  if (source_) return out;
  if (device_.is_cuda())
    out.push_back({Mismatch::Kind::kDevice, "<plan>", "host memory (sharded updates move over Gloo)",
                   device_.to_string()});
  std::lock_guard<std::mutex> lock(reg_mu_);
  auto more = check_plan(plan, registry_, bool(callback_));
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

Status SubscriberImpl::move_sharded(const Job& job, Communicator* comm, bool& collective_done) {
  const UpdatePlan& plan = *job.plan;
  int rank = -1, world = 0;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rank = rank_;
    world = world_;
    names = rank_names_;
  }
  sharded_received_ = 0;
  auto moves = reshard::sharded_moves(plan, world, names);
  if (!moves.ok()) {
    // The publisher checked this plan; a rank that cannot follow it fails
    // the update for all (its peers wait for it).
    comm->abort(id_ + " cannot follow sharded plan v" + std::to_string(plan.version) + ": " + moves.status().message());
    return moves.status();
  }
  reshard::RankBuffers buffers;
  std::vector<ShardView> holdings;
  std::map<std::string, TensorView> registry;
  std::map<std::string, std::vector<uint8_t>> handed;  // tensors for the callback, whole
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    holdings = holdings_;
    registry = registry_;
  }
  if (source_) {
    buffers.find = [&](const TensorSpec& t, const reshard::Region& region) -> reshard::LocalBuffer {
      for (const auto& s : holdings) {
        if (s.local.spec.name != t.name) continue;
        const reshard::Region box = box_of(s, t.shape);
        if (reshard::intersect(box, region) == region) return {static_cast<uint8_t*>(s.local.data), box};
      }
      return {};
    };
  } else {
    for (const auto& t : plan.tensors)
      if (!registry.count(t.name)) handed[t.name].resize(t.nbytes().ok() ? *t.nbytes() : 0);
    buffers.find = [&](const TensorSpec& t, const reshard::Region&) -> reshard::LocalBuffer {
      auto it = registry.find(t.name);
      if (it != registry.end()) return {static_cast<uint8_t*>(it->second.data), reshard::Region::whole(t.shape)};
      auto h = handed.find(t.name);
      if (h != handed.end()) return {h->second.data(), reshard::Region::whole(t.shape)};
      return {};
    };
  }
  reshard::RunOptions run;
  run.checksums = plan.checksum != Checksum::kNone;
  run.received = &sharded_received_;
  Status s = reshard::run_reshard(moves->plan, moves->rounds, rank, *comm, buffers, deadline(), run);
  collective_done = s.ok();
  if (!s.ok()) return s;
  // Every piece landed: the callback gets each of its tensors whole.
  for (const auto& t : plan.tensors) {
    auto h = handed.find(t.name);
    if (h == handed.end()) continue;
    if (!callback_) return internal_error("no callback for '" + t.name + "'");
    Status taken = callback_(TensorView{t, h->second.data(), Device{}});
    if (!taken.ok()) return taken.with_context("tensor callback for '" + t.name + "'");
  }
  return Status();
}

}  // namespace paramcast
