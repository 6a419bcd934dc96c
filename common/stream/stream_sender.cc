#include "common/stream/stream_sender.h"

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "common/transfer/settle.h"

namespace paramcast::stream {

StreamSender::StreamSender(DeviceMemory* memory, StagingPair* staging) : mem_(memory), staging_(staging) {}

Status StreamSender::begin(UpdatePlan* plan, Communicator* comm, Hooks hooks, Deadline deadline,
                           uint64_t direct_min_bytes) {
  plan_ = plan;
  comm_ = comm;
  hooks_ = std::move(hooks);
  deadline_ = deadline;
  direct_min_ = std::max<uint64_t>(direct_min_bytes, 1);
  open_ = PlanBucket();
  slots_.reset();
  works_.clear();
  bytes_.clear();
  done_ = 0;
  sent_ = 0;
  wire_ = 0;
  delta_buckets_ = 0;
  failed_ = Status();
  // Staging for packed buckets only (a stream of large tensors needs none),
  // or for every bucket when they are encoded as deltas.
  uint64_t packed_max = encoding() ? plan->streamed_bucket_bound() : 0;
  for (uint64_t n : plan->nbytes)
    if (n < direct_min_) packed_max = std::max(packed_max, n);
  if (packed_max == 0) return Status();
  return fail(staging_->reserve(mem_, std::max(packed_max, plan->streamed_bucket_bound())));
}

Status StreamSender::send(uint32_t index, const void* data, void* after_stream) {
  if (!failed_.ok()) return failed_;
  const uint64_t n = plan_->nbytes[index];
  // The tensor was produced on the caller's stream: copies and broadcasts
  // that read it wait for that stream (a no-op for host memory).
  PC_RETURN_IF_ERROR(fail(mem_->order_after(after_stream)));
  PC_RETURN_IF_ERROR(fail(comm_->order_after(after_stream)));
  const auto* src = static_cast<const uint8_t*>(data);
  if (n >= direct_min_) return send_direct(index, src, n);
  uint64_t at = (open_.bytes + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
  if (!open_.pieces.empty() && at + n > plan_->bucket_bytes) {
    PC_RETURN_IF_ERROR(seal());
    at = 0;
  }
  if (open_.pieces.empty()) PC_RETURN_IF_ERROR(wait_slot());  // its last broadcast has left
  if (n > 0) {
    uint8_t* slot = staging_->slot(slots_.next_slot());
    PC_RETURN_IF_ERROR(fail(mem_->copy_many({{slot + at, src, n}})));
    // Staged means the caller's buffer is no longer read (CUDA: copy done).
    PC_RETURN_IF_ERROR(fail(mem_->synchronize()));
  }
  open_.pieces.push_back(PlanPiece{index, 0, at, n});
  open_.bytes = at + n;
  return Status();
}

// A large tensor: its chunks go straight from the caller's buffer (staged
// first when encoded as deltas), and it may be freed once they are on the wire.
Status StreamSender::send_direct(uint32_t index, const uint8_t* src, uint64_t n) {
  for (uint64_t off = 0; off < n; off += plan_->bucket_bytes) {
    const uint64_t len = std::min(plan_->bucket_bytes, n - off);
    PlanBucket chunk{len, true, {PlanPiece{index, off, 0, len}}};
    if (!encoding()) {
      PC_RETURN_IF_ERROR(issue(const_cast<uint8_t*>(src) + off, std::move(chunk), false));
      continue;
    }
    // The chunk takes the slot the open bucket would fill next (sealed first).
    PC_RETURN_IF_ERROR(seal());
    PC_RETURN_IF_ERROR(wait_slot());
    uint8_t* at = staging_->slot(slots_.next_slot());
    PC_RETURN_IF_ERROR(fail(mem_->copy_many({{at, src + off, len}})));
    PC_RETURN_IF_ERROR(fail(mem_->synchronize()));
    PC_RETURN_IF_ERROR(issue(at, std::move(chunk), true));
  }
  for (size_t k = done_; k < works_.size(); ++k) PC_RETURN_IF_ERROR(complete(k));
  // The caller may free the tensor now: its copy into the baseline is done.
  if (hooks_.baseline) PC_RETURN_IF_ERROR(fail(mem_->synchronize()));
  return Status();
}

Status StreamSender::finish() {
  if (!failed_.ok()) return failed_;
  PC_RETURN_IF_ERROR(seal());
  if (hooks_.on_layout) hooks_.on_layout(works_.size(), nullptr, true);
  for (size_t k = done_; k < works_.size(); ++k) PC_RETURN_IF_ERROR(complete(k));
  if (hooks_.baseline) PC_RETURN_IF_ERROR(fail(mem_->synchronize()));
  return Status();
}

// The open bucket is broadcast from its slot; the next one fills the other.
Status StreamSender::seal() {
  if (open_.pieces.empty()) return Status();
  PlanBucket b = std::move(open_);
  open_ = PlanBucket();
  return issue(staging_->slot(slots_.next_slot()), std::move(b), true);
}

// Announces bucket k, starts its checksum, broadcasts it. `staged`: it is
// sent from the next staging slot (else from the caller's buffer). With a baseline
// its bytes become the baseline's; encoded as a delta (in place in its
// slot), its header is announced and the encoding broadcast instead.
Status StreamSender::issue(uint8_t* from, PlanBucket bucket, bool staged) {
  const size_t k = works_.size();
  if (staged) slots_.take(k);
  uint64_t bytes = bucket.bytes;
  PC_RETURN_IF_ERROR(fail(plan_->add_streamed_bucket(bucket)));
  const PlanBucket& b = plan_->buckets.back();
  if (hooks_.on_layout) hooks_.on_layout(k, &b, false);
  if (encoding()) {
    std::vector<delta::Segment> segments;
    segments.reserve(b.pieces.size());
    for (const auto& p : b.pieces)
      segments.push_back({from + p.bucket_offset, hooks_.baseline->tensor(p.tensor) + p.tensor_offset, p.bucket_offset,
                          p.length});
    auto encoded = hooks_.codec->encode(segments, b.bytes, plan_->bucket_unit(k), hooks_.delta_always, from);
    if (!encoded.ok()) return fail(encoded.status().with_context("delta encoding of bucket " + std::to_string(k)));
    const delta::Header& h = *encoded;
    if (mem_->stream() && h.wire_bytes) PC_RETURN_IF_ERROR(fail(comm_->order_after(mem_->stream())));
    if (hooks_.on_delta) hooks_.on_delta(k, h);
    if (delta::sent_against_baseline(h.kind)) ++delta_buckets_;
    wire_ += h.wire_bytes;
    works_.push_back(h.wire_bytes ? comm_->broadcast(from, h.wire_bytes, 0) : nullptr);
    bytes_.push_back(b.bytes);
    return Status();
  }
  if (hooks_.baseline) {  // queued on the copy stream for CUDA, beside the broadcast
    std::vector<DeviceMemory::CopyOp> ops;
    for (const auto& p : b.pieces)
      if (p.length) ops.push_back({hooks_.baseline->tensor(p.tensor) + p.tensor_offset, from + p.bucket_offset, p.length});
    PC_RETURN_IF_ERROR(fail(mem_->copy_many(ops)));
  }
  wire_ += bytes;
  if (staged && mem_->stream()) PC_RETURN_IF_ERROR(fail(comm_->order_after(mem_->stream())));
  const int sum_slot = static_cast<int>(k % 2);
  if (plan_->checksum != Checksum::kNone)
    PC_RETURN_IF_ERROR(fail(mem_->checksum_start(sum_slot, from, bytes, plan_->checksum)));
  works_.push_back(comm_->broadcast(from, bytes, 0));
  bytes_.push_back(bytes);
  if (plan_->checksum != Checksum::kNone) {
    auto sum = mem_->checksum_result(sum_slot);
    if (!sum.ok()) return fail(sum.status().with_context("checksum of bucket " + std::to_string(k)));
    if (hooks_.on_checksum) hooks_.on_checksum(k, *sum);
  }
  return Status();
}

// The next staging slot's last broadcast has left (staging_slots.h).
Status StreamSender::wait_slot() {
  const auto blocker = slots_.blocker();
  if (!blocker) return Status();
  for (size_t k = done_; k <= *blocker; ++k) PC_RETURN_IF_ERROR(complete(k));
  return Status();
}

// Waits for bucket k (buckets complete in issue order: every earlier one is done).
Status StreamSender::complete(size_t k) {
  if (k < done_) return Status();
  Status s = !works_[k] ? Status()  // an unchanged bucket of a delta update: nothing was broadcast
                        : works_[k]->wait(deadline_).with_context("bucket " + std::to_string(k) + " of v" +
                                                     std::to_string(plan_->version) + " (tensors " +
                                                     plan_->bucket_tensor_names(k) + ")");
  if (!s.ok()) return fail(s);
  works_[k].reset();
  sent_ += bytes_[k];
  done_ = k + 1;
  if (hooks_.on_progress) hooks_.on_progress(std::min(sent_, plan_->total_bytes), plan_->total_bytes);
  return Status();
}

// The first failure sticks: the communicator is aborted (the collective is
// half-done) and issued work settles before the staging slots may be reused.
Status StreamSender::fail(Status s) {
  if (s.ok() || !failed_.ok()) return s.ok() ? s : failed_;
  failed_ = s;
  abort(s.message());
  return s;
}

void StreamSender::abort(const std::string& why) {
  if (failed_.ok()) failed_ = aborted(why);
  if (!comm_) return;
  comm_->abort(why);
  if (!transfer::settle_works(works_, *mem_, deadline_)) {
    PC_WARN("publisher: in-flight work did not settle after a failure; its staging buffers are let go, not reused");
    staging_->abandon();
  }
  comm_ = nullptr;
}

}  // namespace paramcast::stream
