// Sharded (many-sender) updates on a member: a trainer rank (PublisherRank,
// `source_`) sends the pieces of its shards the plan gives it; an engine
// receives every tensor whole, each piece straight into its registered
// buffer (or, for tensors handed to its callback, into a host buffer of the
// tensor, handed over once every piece landed). Every rank derives the same
// transfers from the plan (common/reshard/sharded_update.h); each piece's
// checksum travels after it and is checked before it counts. On a GPU (the
// NCCL plane) the moves go round by round over the device's memory, dense,
// into registered buffers only.
#include <cstring>
#include <set>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"
#include "common/xxhash.h"
#include "inference_side/plan_check.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {

namespace {
// Holdings and Wants alike: the full spec of each shard's tensor and the box held or wanted;
// with `digests` (Holdings, checksums on; one per shard, empty boxes aside), each box's
// holding_digest, for the publisher to compare replicas.
// `bloat`: tensors stated beyond those held (a test hook's, ControlFaults).
void shards_to_proto(const std::vector<ShardView>& shards, proto::Holdings::Builder h,
                     const std::map<size_t, uint64_t>& digests = {}, uint64_t bloat = 0) {
  const auto n = static_cast<unsigned>(shards.size() + bloat);
  auto tensors = h.initTensors(n);
  auto holds = h.initHolds(n);
  for (unsigned i = static_cast<unsigned>(shards.size()); i < n; ++i) {
    auto e = tensors[i];
    e.setName("bloat/" + std::to_string(i));
    e.setDtype("F32");
    e.initShape(1).set(0, 1);
    e.setNbytes(4);
    auto r = holds[i];
    r.setTensor(i);
    r.initOffsets(1).set(0, 0);
    r.initLengths(1).set(0, 1);
  }
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
    if (auto d = digests.find(i); d != digests.end()) {
      r.setDigest(d->second);
      r.setDigested(true);
    }
  }
}

// The digest of the part `shards` state, as rank 0 computes it from the
// Holdings shards_to_proto writes (HeldShapeDigest).
// Two calls' shards are the same tensors' same boxes at the same addresses.
bool same_memory(const std::vector<ShardView>& a, const std::vector<ShardView>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].local.data != b[i].local.data || a[i].offsets != b[i].offsets || a[i].full_shape != b[i].full_shape ||
        a[i].local.spec.shape != b[i].local.spec.shape || a[i].local.spec.dtype != b[i].local.spec.dtype ||
        a[i].local.spec.name != b[i].local.spec.name)
      return false;
  return true;
}

uint64_t part_digest(const std::vector<ShardView>& shards) {
  HeldShapeDigest named;
  for (uint32_t i = 0; i < shards.size(); ++i) {
    const ShardView& s = shards[i];
    const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
    named.tensor(s.local.spec.name, s.local.spec.dtype, full);
    const reshard::Region box = box_of(s, full);
    named.box(i, box.offsets, box.lengths);
  }
  return named.digest();
}
}  // namespace

Status SubscriberImpl::publish_refused(const Status& why, uint64_t step) {
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    holdings_.reset();
    part_taken_ = 0;
    seq = ++publish_seq_;
    active_seq_ = 0;
  }
  client_->send(control::make_message(client_epoch(), client_->incarnation(), [&](auto b) {
    auto h = b.initHoldings();
    h.setSeq(seq);
    h.setStep(step);
    h.setError(why.message().substr(0, 4096));
  }));
  return why;
}

// The xxh64 of each non-empty box of `shards`, or of the boxes `only` names.
Status SubscriberImpl::digest_boxes(const std::vector<ShardView>& shards, const std::vector<uint32_t>* only,
                                    std::map<size_t, uint64_t>& out) {
  auto digest = [&](size_t i) -> Status {
    const ShardView& s = shards[i];
    const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
    const reshard::Region box = box_of(s, full);
    if (box.empty()) return Status();
    auto d = reshard::holding_digest(s.local.data, static_cast<uint64_t>(box.elements()) * dtype_size(s.local.spec.dtype),
                                     s.local.device, publish_mem_.get());
    if (!d.ok()) return d.status().with_context("shard of '" + s.local.spec.name + "'");
    out[i] = *d;
    return Status();
  };
  if (!only)
    for (size_t i = 0; i < shards.size(); ++i) PC_RETURN_IF_ERROR(digest(i));
  else
    for (uint32_t i : *only)
      if (i < shards.size()) PC_RETURN_IF_ERROR(digest(i));
  return Status();
}

Status SubscriberImpl::publish(const std::vector<ShardView>& shards, uint64_t step, void* after_stream) {
  for (const auto& s : shards) {
    const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
    const reshard::Region box = box_of(s, full);
    if (s.local.device != device_)
      return publish_refused(invalid_argument("shard of '" + s.local.spec.name + "' is on " + s.local.device.to_string() +
                                              ", not on publisher.device " + device_.to_string()),
                             step);
    if (!box.inside(full))
      return publish_refused(invalid_argument("shard of '" + s.local.spec.name + "' " + box.to_string() + " is not inside its shape"), step);
    if (!box.empty() && !s.local.data)
      return publish_refused(invalid_argument("shard of '" + s.local.spec.name + "' has no data"), step);
  }
  // On a GPU, the caller's writes come first (digests and moves read the shards).
  if (publish_mem_) {
    Status s = publish_mem_->order_after(after_stream);
    if (s.ok()) s = publish_mem_->synchronize();
    if (!s.ok()) return publish_refused(s.with_context("waiting for the caller's writes on " + device_.to_string()), step);
  }
  const uint64_t part = part_digest(shards);
  uint64_t seq = 0, refer = 0;
  std::shared_ptr<const std::vector<uint32_t>> replicas;  // by reference: the boxes to digest
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    // The same part as the last call's, which its plan took: by reference.
    if (std::exchange(part_taken_, 0) == part && !lost_.bloats_holdings(step) && !lost_.replays_holdings()) {
      refer = part;
      if (replicated_.first == part) replicas = replicated_.second;
    }
  }
  std::map<size_t, uint64_t> digests;
  if (cfg_.data_plane.checksum != Checksum::kNone) {
    if (Status s = digest_boxes(shards, replicas.get(), digests); !s.ok()) return publish_refused(s, step);
  }
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    holdings_ = std::make_shared<const std::vector<ShardView>>(shards);
    seq = ++publish_seq_;
    active_seq_ = seq;
    if (lost_.forges_part(step)) refer = part ^ 0x5a5a;  // test hook: a part rank 0 never had
    part_sent_ = {seq, part};
  }
  auto message = control::make_message(client_epoch(), client_->incarnation(), [&](auto b) {
    auto h = b.initHoldings();
    h.setSeq(seq);
    h.setStep(step);
    if (!refer) return shards_to_proto(shards, h, digests, lost_.bloats_holdings(step));
    h.setShapeRef(refer);
    if (lost_.digests_past(step)) {  // test hook: a digest of a box the part does not have
      h.initDigests(1).set(0, 0);
      h.initDigestBoxes(1).set(0, static_cast<uint32_t>(shards.size()));
      return;
    }
    if (digests.empty()) return;
    if (!replicas) {
      auto list = h.initDigests(static_cast<unsigned>(shards.size()));
      for (const auto& [i, d] : digests) list.set(static_cast<unsigned>(i), d);
      return;
    }
    auto list = h.initDigests(static_cast<unsigned>(digests.size()));
    auto boxes = h.initDigestBoxes(static_cast<unsigned>(digests.size()));
    unsigned k = 0;
    for (const auto& [i, d] : digests) {
      boxes.set(k, static_cast<uint32_t>(i));
      list.set(k++, d);
    }
  });
  zmq::message_t replay;  // test hook: the last call's Holdings, sent again after this one's
  if (lost_.replays_holdings()) {
    std::lock_guard<std::mutex> lock(reg_mu_);
    replay.swap(replayed_holdings_);
    replayed_holdings_.copy(message);
  }
  client_->send(std::move(message));
  if (replay.size()) client_->send(std::move(replay));
  return Status();
}

Status SubscriberImpl::register_slice(const ShardView& slice) {
  const TensorSpec& local = slice.local.spec;
  const reshard::Region box = box_of(slice, slice.full_shape);
  TensorSpec full{local.name, local.dtype, slice.full_shape};
  if (local.name.empty()) return invalid_argument("a slice needs its tensor's name");
  if (!full.nbytes().ok()) return full.nbytes().status().with_context("slice of '" + local.name + "'");
  if (!box.inside(slice.full_shape))
    return invalid_argument("slice of '" + local.name + "' " + box.to_string() + " is not inside its shape " +
                            full.shape_string());
  if (!box.empty() && !slice.local.data) return invalid_argument("slice of '" + local.name + "' has no data pointer");
  if (slice.local.device != device_)
    return invalid_argument("slice of '" + local.name + "' is on " + slice.local.device.to_string() + " but worker '" +
                            id_ + "' receives on " + device_.to_string());
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    registry_.erase(local.name);  // a name is whole or a slice, the last registration wins
    slices_[local.name] = slice;
    ++registrations_;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    registered_since_update_ = true;
  }
  if (client_->joined()) send_wants();
  return Status();
}

// The engine's slices, to the publisher; none (after the last slice was
// registered whole again) once it had sent some: it wants every tensor whole.
void SubscriberImpl::send_wants() {
  std::vector<ShardView> slices;
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    if (slices_.empty() && !wants_seq_) return;
    for (const auto& [name, s] : slices_) slices.push_back(s);
    seq = ++wants_seq_;
  }
  client_->send(control::make_message(client_epoch(), client_->incarnation(), [&](auto b) {
    auto h = b.initWants();
    h.setSeq(seq);
    shards_to_proto(slices, h);
  }));
}

void SubscriberImpl::end_publish(uint64_t seq, bool ran) {
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    if (active_seq_ != seq) return;
    active_seq_ = 0;
    holdings_.reset();
  }
  if (!ran)
    client_->send(control::make_message(client_epoch(), client_->incarnation(), [&](auto b) {
      auto h = b.initHoldings();
      h.setSeq(seq);
      h.setWithdrawn(true);
    }));
  // A transfer of this call that is still under way reads the caller's
  // shards: it ends now, before the call returns (the call timed out, or
  // rank 0 ended it while this rank's part was stalled).
  uint64_t running = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running = receiving_version_;
  }
  if (!running) return;  // nothing reads them: the group stays usable
  abort_comm(id_ + ": its publish call ended before its update finished", running);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(30), [&] { return receiving_version_ != running; });
}

// The registrations now, as one snapshot shared by the moves until the next
// registration (reg_mu_ held): not a copy of 50,000 names each update.
std::shared_ptr<const SubscriberImpl::Registered> SubscriberImpl::registered() {
  if (!registered_ || registered_at_ != registrations_) {
    registered_ = std::make_shared<const Registered>(Registered{registry_, slices_});
    registered_at_ = registrations_;
  }
  return registered_;
}

// One sharded move on this rank, shared by move_sharded's steps: the plan's
// moves, the registrations taken for it, and where each tensor's pieces go.
struct SubscriberImpl::ShardedMove {
  explicit ShardedMove(const UpdatePlan& p) : plan(p) {}
  const UpdatePlan& plan;
  int rank = -1;
  std::shared_ptr<const reshard::ShardedMoves> moves;
  reshard::RankBuffers buffers;
  std::shared_ptr<const std::vector<ShardView>> holdings;  // a trainer rank's
  std::shared_ptr<const Registered> registered;            // an engine's
  std::map<std::string, std::vector<uint8_t>> handed;  // tensors for the callback, whole
  bool kept_copy = false;                              // those tensors are assembled in copy_
};

Status SubscriberImpl::move_sharded(const Job& job, Communicator* comm, bool& collective_done) {
  ShardedMove m(*job.plan);
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
  auto moves = sharded_cache_.moves(m.plan, world, names, {false, job.shape});
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
  if (held_index_.moves == m.moves && held_index_.holdings && same_memory(*held_index_.holdings, *m.holdings)) {
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
  const bool every_one_registered = !keeps_copies() && copies.empty() && m.handed.empty();
  wanted_index_ = every_one_registered ? WantedIndex{m.moves, m.registered, std::move(index)} : WantedIndex{};
  return Status();
}

// An engine: the slices registered now are those the plan was checked
// against (a registration since would make a piece miss its buffer).
Status SubscriberImpl::check_registrations(ShardedMove& m, Communicator* comm) {
  const UpdatePlan& plan = m.plan;
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
                  std::to_string(plan.version));
      return invalid_argument("the registration of '" + t.name + "' changed after plan v" +
                              std::to_string(plan.version) + " was accepted; nothing of it was written");
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
  for (size_t i = 0; i < m.plan.tensors.size(); ++i) {
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
