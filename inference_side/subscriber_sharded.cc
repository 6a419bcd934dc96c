// Sharded (many-sender) updates on a member: a trainer rank (PublisherRank,
// `source_`) sends the pieces of its shards the plan gives it; an engine
// receives every tensor whole, each piece straight into its registered
// buffer (or, for tensors handed to its callback, into a host buffer of the
// tensor, handed over once every piece landed). Every rank derives the same
// transfers from the plan (common/reshard/sharded_update.h); each piece's
// checksum travels after it and is checked before it counts. On a GPU (the
// NCCL plane) the moves go round by round over the device's memory, dense,
// into registered buffers only. What a member states before the plan
// (Holdings, Wants): subscriber_sharded_publish.cc.
#include <cstring>
#include <set>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {

// One sharded move on this rank, shared by move_sharded's steps: the plan's
// moves, the registrations taken for it, and where each tensor's pieces go.
// `plan` is this update's (version, holders' seqs), `shape` the plan whose
// regions it has (itself, or the kept plan it refers to: plan_by_reference).
struct SubscriberImpl::ShardedMove {
  ShardedMove(const UpdatePlan& p, const UpdatePlan& s) : plan(p), shape(s) {}
  const UpdatePlan& plan;
  const UpdatePlan& shape;
  int rank = -1;
  std::shared_ptr<const reshard::ShardedMoves> moves;
  reshard::RankBuffers buffers;
  std::shared_ptr<const std::vector<ShardView>> holdings;  // a trainer rank's
  std::shared_ptr<const Registered> registered;            // an engine's
  std::map<std::string, std::vector<uint8_t>> handed;  // tensors for the callback, whole
  bool kept_copy = false;                              // those tensors are assembled in copy_
  bool every_one_registered = false;                   // an engine's: none for the callback
};

Status SubscriberImpl::move_sharded(const Job& job, Communicator* comm, bool& collective_done) {
  ShardedMove m(*job.plan, regions_of(*job.plan, job.shape));
  int world = 0;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    m.rank = rank_;
    world = world_;
    names = rank_names_;
  }
  sharded_received_ = 0;
  // The last update's, when of the same shape: known without a comparison
  // when the plan copies the very kept plan the moves were made for.
  auto moves = sharded_cache_.moves(m.shape, world, names, {false, job.shape});
  if (!moves.ok()) {
    // The publisher checked this plan; a rank that cannot follow it fails
    // the update for all (its peers wait for it).
    comm->abort(id_ + " cannot follow sharded plan v" + std::to_string(m.plan.version) + ": " +
                moves.status().message());
    return moves.status();
  }
  m.moves = std::move(*moves);
  if (Status s = take_registrations(m, comm); !s.ok()) return s;
  if (source_) {
    find_held(m);
  } else {
    if (Status s = find_wanted(m, comm); !s.ok()) return s;
    if (Status s = check_registrations(m, comm); !s.ok()) return s;
  }
  if (Status s = run_moves(m, comm, collective_done); !s.ok()) return s;
  return hand_over(m);
}

// The registrations as they are now, for this move. A trainer rank sends
// only the shards of the call the plan was made from. That call may have
// ended between this rank's accept and the Commit (it timed out waiting),
// and the caller's next call may hold other bytes (the next step) in the
// same buffers: those never go out under this plan, whose hashes and
// replica digests rank 0 checked for the old.
Status SubscriberImpl::take_registrations(ShardedMove& m, Communicator* comm) {
  uint64_t planned_seq = 0, active_seq = 0;
  if (source_)
    for (const auto& h : m.plan.holders)
      if (h.rank == m.rank) {
        planned_seq = h.seq;
        break;
      }
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    active_seq = active_seq_;
    m.holdings = holdings_;
    if (!source_) m.registered = registered();
  }
  if (!source_ || !planned_seq || planned_seq == active_seq) return Status();
  std::string why = id_ + " cannot send its part of sharded plan v" + std::to_string(m.plan.version) +
                    ": the plan took publish call " + std::to_string(planned_seq) + ", which ended before its commit (";
  why += active_seq ? "call " + std::to_string(active_seq) + " holds the caller's next shards now"
                    : "no call of this rank is under way";
  why += "); no byte of it was sent";
  comm->abort(why);
  return aborted(why);
}

// A trainer rank: each piece it sends from the shard that holds it; the
// last update's index while the moves and the shards' memory are the same.
void SubscriberImpl::find_held(ShardedMove& m) {
  std::vector<std::pair<uint32_t, reshard::Region>> boxes;
  if (!m.holdings) {  // no call's shards: a piece of this rank finds no buffer, and the run says so
    m.buffers.index = std::make_shared<const reshard::BufferIndex>(0);
    return;
  }
  if (held_index_.moves.lock() == m.moves && held_index_.holdings &&
      (held_index_.holdings == m.holdings || same_shards(*held_index_.holdings, *m.holdings))) {
    m.buffers.index = held_index_.index;
    return;
  }
  boxes.reserve(m.holdings->size());
  for (uint32_t i = 0; i < m.holdings->size(); ++i) {
    const ShardView& s = (*m.holdings)[i];
    boxes.emplace_back(i, box_of(s, s.full_shape.empty() ? s.local.spec.shape : s.full_shape));
  }
  m.buffers.index = reshard::held_buffers(*m.moves, *m.holdings, boxes);
  held_index_ = {m.moves, m.holdings, m.buffers.index};
}

// An engine: each tensor's pieces into its registered slice or buffer, or,
// for tensors for the callback, assembled whole: in the engine's copy of the
// last version when it keeps one (subscriber.delta_baseline: host; a delta
// applies onto it), else in buffers of this update.
Status SubscriberImpl::find_wanted(ShardedMove& m, Communicator* comm) {
  const UpdatePlan& plan = m.plan;
  // The same moves and registrations as an update whose every tensor had a
  // registered buffer: the same index (no walk of 50,000 names).
  if (wanted_index_.index && wanted_index_.moves == m.moves && wanted_index_.registered == m.registered) {
    m.buffers.index = wanted_index_.index;
    m.every_one_registered = true;
    return Status();
  }
  std::map<std::string, uint8_t*> copies;
  if (keeps_copies()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      copy_version_ = 0;  // being written
    }
    auto handed_here = [&](size_t i) {
      return !m.registered->registry.count(plan.tensors[i].name) && !m.registered->slices.count(plan.tensors[i].name);
    };
    if (Status c = copy_.prepare(plan, handed_here); c.ok()) {
      for (size_t i = 0; i < plan.tensors.size(); ++i)
        if (handed_here(i)) copies[plan.tensors[i].name] = copy_.tensor(i);
      m.kept_copy = true;
    } else {
      PC_WARN(id_ << ": " << c.message());
    }
  }
  try {
    for (const auto& t : plan.tensors)
      if (!m.registered->registry.count(t.name) && !m.registered->slices.count(t.name) && !copies.count(t.name))
        m.handed[t.name].resize(t.nbytes().ok() ? *t.nbytes() : 0);
  } catch (const std::bad_alloc&) {
    comm->abort(id_ + " has no host memory for the tensors its callback takes");
    return unavailable("no host memory for the " + std::to_string(m.handed.size()) +
                       " tensors handed to the callback (a sharded update assembles each whole first)");
  }
  // Each tensor's buffer, found once by name (not per piece): its slice,
  // its registration, the kept copy, or the buffer handed to the callback.
  auto index = std::make_shared<reshard::BufferIndex>(plan.tensors.size());
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorSpec& t = plan.tensors[i];
    if (auto sl = m.registered->slices.find(t.name); sl != m.registered->slices.end())
      index->add(i, static_cast<uint8_t*>(sl->second.local.data), box_of(sl->second, t.shape));
    else if (auto it = m.registered->registry.find(t.name); it != m.registered->registry.end())
      index->add(i, static_cast<uint8_t*>(it->second.data), reshard::Region::whole(t.shape));
    else if (auto c = copies.find(t.name); c != copies.end())
      index->add(i, c->second, reshard::Region::whole(t.shape));
    else if (auto h = m.handed.find(t.name); h != m.handed.end())
      index->add(i, h->second.data(), reshard::Region::whole(t.shape));
  }
  m.buffers.index = index;
  m.every_one_registered = !keeps_copies() && copies.empty() && m.handed.empty();
  wanted_index_ = m.every_one_registered ? WantedIndex{m.moves, m.registered, std::move(index)} : WantedIndex{};
  return Status();
}

// An engine: the slices registered now are those the plan was checked
// against (a registration since would make a piece miss its buffer).
Status SubscriberImpl::check_registrations(ShardedMove& m, Communicator* comm) {
  const UpdatePlan& plan = m.shape;  // its regions (the version: m.plan's)
  // The same registrations (one snapshot) under the same moves as the last
  // update, which passed: they pass again.
  if (registrations_checked_.first == m.moves && registrations_checked_.second == m.registered) return Status();
  std::map<std::string, reshard::Region> planned;
  for (const auto& w : plan.wanters)
    if (w.rank == m.rank && w.tensor >= 0)
      planned[plan.tensors[static_cast<size_t>(w.tensor)].name] = reshard::Region{w.offsets, w.lengths};
  for (const auto& t : plan.tensors) {
    auto sl = m.registered->slices.find(t.name);
    auto pl = planned.find(t.name);
    const bool fits = sl == m.registered->slices.end()
                          ? pl == planned.end() || pl->second == reshard::Region::whole(t.shape)
                          : pl != planned.end() && sl->second.local.spec.dtype == t.dtype &&
                                box_of(sl->second, t.shape) == pl->second;
    if (!fits) {
      comm->abort(id_ + ": its registration of '" + t.name + "' changed after it accepted plan v" +
                  std::to_string(m.plan.version));
      return invalid_argument("the registration of '" + t.name + "' changed after plan v" +
                              std::to_string(m.plan.version) + " was accepted; nothing of it was written");
    }
  }
  registrations_checked_ = {m.moves, m.registered};
  return Status();
}

// This rank's transfers of the plan, round by round; a failure ends its
// peers' wait for them.
Status SubscriberImpl::run_moves(ShardedMove& m, Communicator* comm, bool& collective_done) {
  const UpdatePlan& plan = m.plan;
  reshard::RunOptions run;
  run.checksums = plan.checksum != Checksum::kNone;
  run.received = &sharded_received_;
  run.delta_base = plan.delta_base;
  run.version = plan.version;
  run.delta_always = cfg_.publisher.delta == DeltaMode::kAlways;
  // On a GPU: round by round over the device's memory, dense.
  run.memory = reshard::run_memory(*comm, mem_.get());
  // A trainer rank keeps the pieces it sends (publisher.delta, as rank 0), in host memory.
  run.sent = source_ && cfg_.publisher.delta != DeltaMode::kOff && !run.memory ? &sent_ : nullptr;
  run.staging_limit = 2 * cfg_.data_plane.bucket_bytes;  // a trainer rank's packed pieces and encodings
  bool unsettled = false;
  run.unsettled = &unsettled;
  run.schedule = &m.moves->schedule;  // kept with the moves for the next update of the same shape
  Status s = reshard::run_reshard(m.moves->plan, m.moves->rounds, m.rank, *comm, m.buffers, deadline(), run);
  collective_done = s.ok();
  if (s.ok()) return s;
  comm->abort(s.message());  // its peers stop waiting for this rank's transfers
  // A receive that did not settle may still write into the callback's buffers.
  if (unsettled) {
    new std::map<std::string, std::vector<uint8_t>>(std::move(m.handed));  // deliberately leaked
    if (m.kept_copy) copy_.abandon();  // the copy's buffers too; the next update starts a new one
  }
  return s;
}

// Every piece landed: the callback gets each of its tensors whole, and the
// engine's copy is of this version.
Status SubscriberImpl::hand_over(ShardedMove& m) {
  for (size_t i = 0; !source_ && !m.every_one_registered && i < m.plan.tensors.size(); ++i) {
    const TensorSpec& t = m.plan.tensors[i];
    if (source_ || m.registered->registry.count(t.name) || m.registered->slices.count(t.name)) continue;
    const reshard::LocalBuffer whole = m.buffers.index->find(i, reshard::Region::whole(t.shape));
    if (!callback_) return internal_error("no callback for '" + t.name + "'");
    Status taken = callback_(TensorView{t, whole.data, Device{}});
    if (!taken.ok()) return taken.with_context("tensor callback for '" + t.name + "'");
  }
  if (m.kept_copy) {
    std::lock_guard<std::mutex> lock(mu_);
    copy_version_ = m.plan.version;
    copy_manifest_ = m.plan.manifest_hash;
  }
  return Status();
}

}  // namespace paramcast
