// What the publisher announces per bucket during an update, on an engine:
// a streamed plan's layouts and a delta update's encodings. The control
// thread keeps them (bounded) as they arrive; the data thread waits for each
// as its receive reaches that bucket, and gives up when the update is
// abandoned, the publisher lost, or the bound overflowed.
#include "common/log.h"
#include "common/plan_proto.h"
#include "common/units.h"
#include "inference_side/subscriber_impl.h"

namespace paramcast {

// A streamed plan's bucket layouts, kept until the data thread takes them.
// Bounded: a publisher cannot make this member hold more than
// kMaxPendingLayouts of them (the data thread takes each as it goes).
void SubscriberImpl::on_layouts(proto::BucketLayouts::Reader l) {
  constexpr size_t kMaxPendingLayouts = 1 << 16;
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t k = l.getFirst();
  for (auto b : l.getBuckets()) {
    if (layouts_.size() >= kMaxPendingLayouts) {
      PC_WARN(id_ << ": more than " << kMaxPendingLayouts << " bucket layouts pending; v" << l.getVersion()
                  << " bucket " << k << " and later dropped, the update fails");
      overflowed_version_ = std::max(overflowed_version_, l.getVersion());
      break;
    }
    layouts_[{l.getVersion(), k++}] = bucket_from_proto(b);
  }
  if (l.getEnd()) stream_end_[l.getVersion()] = k;
  cv_.notify_all();
}

// A delta update's bucket encoding, kept until the data thread takes it
// (bounded as the layouts are).
void SubscriberImpl::on_delta(proto::BucketDelta::Reader d) {
  constexpr size_t kMaxPendingDeltas = 1 << 16;
  delta::Header h;
  h.kind = static_cast<delta::Kind>(static_cast<uint8_t>(d.getKind()));
  h.unit = d.getUnit();
  h.changed = d.getChanged();
  h.wire_bytes = d.getWireBytes();
  h.piece_hashes.reserve(d.getPieceHashes().size());
  for (uint64_t v : d.getPieceHashes()) h.piece_hashes.push_back(v);
  // Any other kind is none, which no engine's memory checks: refused on use.
  h.piece_hash = d.getPieceHash() == proto::ChecksumKind::XXH64        ? Checksum::kXxh64
                 : d.getPieceHash() == proto::ChecksumKind::XXH64_BLOCKS ? Checksum::kXxh64Blocks
                                                                         : Checksum::kNone;
  std::lock_guard<std::mutex> lock(mu_);
  if (deltas_.size() >= kMaxPendingDeltas) {
    PC_WARN(id_ << ": more than " << kMaxPendingDeltas << " bucket encodings pending; v" << d.getVersion()
                << " bucket " << d.getBucket() << " dropped, the update fails");
    overflowed_version_ = std::max(overflowed_version_, d.getVersion());
    cv_.notify_all();
    return;
  }
  deltas_[{d.getVersion(), d.getBucket()}] = std::move(h);
  cv_.notify_all();
}

StatusOr<delta::Header> SubscriberImpl::delta_header(uint64_t version, size_t bucket) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_pair(version, static_cast<uint32_t>(bucket));
  auto gone = [&] {
    return stopping_ || !client_->joined() || abandoned_version_ >= version || overflowed_version_ >= version;
  };
  if (!cv_.wait_until(lock, deadline_, [&] { return deltas_.count(key) || gone(); }))
    return timeout_error("the encoding of bucket " + std::to_string(bucket) + " of v" + std::to_string(version) +
                         " never arrived within update_timeout (" + format_duration(update_cap_) + ")");
  auto it = deltas_.find(key);
  if (it == deltas_.end()) {
    if (stopping_) return aborted("subscriber stopping");
    if (overflowed_version_ >= version) return overflowed(version);
    if (abandoned_version_ >= version) return aborted("the publisher abandoned v" + std::to_string(version));
    return peer_lost("publisher lost before the encoding of bucket " + std::to_string(bucket) + " arrived");
  }
  delta::Header h = std::move(it->second);
  deltas_.erase(it);
  return h;
}

Status SubscriberImpl::overflowed(uint64_t version) const {
  std::string what = "update v";  // appended, not "v" + ...: GCC 12's -Wrestrict false positive at -O3
  what += std::to_string(version);
  return protocol_error(what + ": the publisher announced more buckets than this member keeps pending (65536); "
                               "raise data_plane.bucket_size");
}

// Copies for the callback are host memory: a CUDA engine keeps none (its
// callback gets dense updates).
bool SubscriberImpl::keeps_copies() const { return callback_ && cfg_.subscriber.delta_baseline && !device_.is_cuda(); }

StatusOr<SubscriberImpl::Next> SubscriberImpl::next_bucket(uint64_t version, size_t bucket, bool wait,
                                                            PlanBucket& out) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_pair(version, static_cast<uint32_t>(bucket));
  auto ready = [&] {
    auto end = stream_end_.find(version);
    return layouts_.count(key) || (end != stream_end_.end() && end->second <= bucket);
  };
  auto gone = [&] {
    return stopping_ || !client_->joined() || abandoned_version_ >= version || overflowed_version_ >= version;
  };
  if (!ready() && !wait) return Next::kNotYet;
  if (!cv_.wait_until(lock, deadline_, [&] { return ready() || gone(); }))
    return timeout_error("the layout of streamed bucket " + std::to_string(bucket) + " of v" + std::to_string(version) +
                         " never arrived within update_timeout (" + format_duration(update_cap_) + ")");
  if (auto it = layouts_.find(key); it != layouts_.end()) {
    out = std::move(it->second);
    layouts_.erase(it);
    return Next::kReady;
  }
  if (ready()) return Next::kEnded;
  if (stopping_) return aborted("subscriber stopping");
  if (overflowed_version_ >= version) return overflowed(version);
  if (abandoned_version_ >= version) return aborted("the publisher abandoned v" + std::to_string(version));
  return peer_lost("publisher lost before the layout of streamed bucket " + std::to_string(bucket) + " arrived");
}

}  // namespace paramcast
