// What a member states for sharded (many-sender) updates, before any plan:
// a trainer rank (PublisherRank, `source_`) its part of each step (publish:
// Holdings, whole or by reference, with the digests rank 0 compares), an
// engine the slices it wants (register_slice, send_wants: Wants).
// subscriber_sharded.cc moves the pieces once a plan took them.
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

}  // namespace

bool same_shards(const std::vector<ShardView>& a, const std::vector<ShardView>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].local.data != b[i].local.data || a[i].local.device != b[i].local.device || a[i].offsets != b[i].offsets ||
        a[i].full_shape != b[i].full_shape || a[i].local.spec.shape != b[i].local.spec.shape ||
        a[i].local.spec.dtype != b[i].local.spec.dtype || a[i].local.spec.name != b[i].local.spec.name)
      return false;
  return true;
}

namespace {
// The digest of the part `shards` state, as rank 0 computes it from the
// Holdings shards_to_proto writes (HeldShapeDigest).
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
  // The same shards as the last call's that passed (the same tensors' same
  // boxes at the same addresses, on the same device): its checks, its copy
  // and its part's digest hold (no copy of 50,000 views a call).
  std::shared_ptr<const std::vector<ShardView>> held;
  uint64_t part = 0;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    std::tie(held, part) = last_part_;
  }
  if (!held || !same_shards(*held, shards)) {
    if (Status s = check_shards(shards); !s.ok()) return publish_refused(s, step);
    held = std::make_shared<const std::vector<ShardView>>(shards);
    part = part_digest(shards);
  }
  // On a GPU, the caller's writes come first (digests and moves read the shards).
  if (publish_mem_) {
    Status s = publish_mem_->order_after(after_stream);
    if (s.ok()) s = publish_mem_->synchronize();
    if (!s.ok()) return publish_refused(s.with_context("waiting for the caller's writes on " + device_.to_string()), step);
  }
  return publish_part(shards, step, std::move(held), part);
}

// A call's shards: each on this rank's device, its box inside its tensor, with data.
Status SubscriberImpl::check_shards(const std::vector<ShardView>& shards) const {
  for (const auto& s : shards) {
    const auto& full = s.full_shape.empty() ? s.local.spec.shape : s.full_shape;
    const reshard::Region box = box_of(s, full);
    if (s.local.device != device_)
      return invalid_argument("shard of '" + s.local.spec.name + "' is on " + s.local.device.to_string() +
                              ", not on publisher.device " + device_.to_string());
    if (!box.inside(full))
      return invalid_argument("shard of '" + s.local.spec.name + "' " + box.to_string() + " is not inside its shape");
    if (!box.empty() && !s.local.data)
      return invalid_argument("shard of '" + s.local.spec.name + "' has no data");
  }
  return Status();
}

// A call's part, stated (whole, or by reference to the last one's) once its shards passed.
Status SubscriberImpl::publish_part(const std::vector<ShardView>& shards, uint64_t step,
                                    std::shared_ptr<const std::vector<ShardView>> held, uint64_t part) {
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
    holdings_ = held;
    last_part_ = {std::move(held), part};
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

}  // namespace paramcast
