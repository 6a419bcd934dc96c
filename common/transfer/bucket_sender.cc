#include "common/transfer/bucket_sender.h"

#include <cstring>
#include <thread>

#include "common/log.h"
#include "common/transfer/issue_ahead.h"
#include "common/transfer/settle.h"
#include "common/transfer/staging_slots.h"

namespace paramcast::transfer {

BucketSender::BucketSender(DeviceMemory* memory, FaultInjection faults) : mem_(memory), faults_(faults) {}

Status BucketSender::send(const UpdatePlan& plan, const std::vector<TensorView>& tensors, Communicator& comm,
                          const Hooks& hooks, Deadline deadline, void* after_stream) {
  deadline_ = deadline;
  wire_bytes_ = 0;
  delta_buckets_ = 0;
  const bool encode = plan.delta_base != 0 && hooks.baseline && hooks.codec;
  // Packing (copy stream) and direct/in-place broadcasts (the communicator's
  // stream) both read the caller's tensors: both wait for the caller's stream.
  PC_RETURN_IF_ERROR(mem_->order_after(after_stream));
  PC_RETURN_IF_ERROR(comm.order_after(after_stream));
  const size_t n = plan.buckets.size();
  auto source = [&](uint32_t t) { return tensors[t].data; };
  std::vector<uint8_t*> in_place_at(n, nullptr);
  uint64_t staging_bytes = 0;
  for (size_t k = 0; k < n; ++k) {
    // A delta is encoded into staging, whatever kind of bucket it is.
    if (encode) staging_bytes = std::max(staging_bytes, plan.buckets[k].bytes);
    if (encode || plan.buckets[k].direct) continue;
    in_place_at[k] = plan.in_place_base(k, source);
    if (!in_place_at[k]) staging_bytes = std::max(staging_bytes, plan.buckets[k].bytes);
  }
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, staging_bytes));
  std::vector<std::shared_ptr<Work>> works(n);
  uint64_t sent = 0;
  size_t finished = 0;  // buckets [0, finished) completed, in order
  auto finish_to = [&](size_t upto) -> Status {
    for (; finished < upto; ++finished)
      PC_RETURN_IF_ERROR(finish(plan, finished, works[finished].get(), hooks, sent));
    return Status();
  };
  StagingSlots slots;  // which staging slot each bucket that needs one uses (staging_slots.h)
  for (size_t k = 0; k < n; ++k) {
    // In flight after issuing k: at most kIssueAhead buckets, or
    // kIssueAheadStaged with checksums (their slot is k % 2). A bucket that
    // needs a staging slot (every bucket of a delta update, which is encoded
    // there; a packed one not in place) waits for the slot's last user.
    const bool staged = encode || (!plan.buckets[k].direct && !in_place_at[k]);
    const size_t ahead = plan.checksum != Checksum::kNone ? kIssueAheadStaged : kIssueAhead;
    size_t upto = k + 1 > ahead ? k + 1 - ahead : 0;
    if (staged && slots.blocker()) upto = std::max(upto, *slots.blocker() + 1);
    Status s = finish_to(upto);
    uint8_t* slot = s.ok() && staged ? staging_.slot(slots.take(k)) : nullptr;
    if (s.ok())
      s = encode ? issue_delta(plan, k, tensors, slot, comm, hooks, works[k])
                 : issue(plan, k, tensors, in_place_at[k], slot, comm, hooks, works[k]);
    if (!s.ok()) return settle(comm, works, s);
    if (faults_.stalls_after(plan.version, k)) {
      // Hang mid-update, as a wedged trainer would, until stopped.
      PC_WARN("publisher: fault injection: stalling after bucket " << k << " of v" << plan.version);
      while (!stopping_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return settle(comm, works, aborted("publisher stopped mid-update (fault injection)"));
    }
  }
  if (Status s = finish_to(n); !s.ok()) return settle(comm, works, s);
  // The baseline's copies (queued on the copy stream for CUDA) are done.
  if (hooks.baseline) PC_RETURN_IF_ERROR(mem_->synchronize());
  return Status();
}

// Stages bucket k, starts its checksum, and broadcasts it once packed: the
// broadcast waits on the device for the packing only, so the checksum runs
// beside it. The checksum is handed on as soon as it is known.
Status BucketSender::issue(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                           uint8_t* in_place, uint8_t* slot, Communicator& comm, const Hooks& hooks,
                           std::shared_ptr<Work>& work) {
  auto ptr = stage(plan, k, tensors, in_place, slot);
  if (!ptr.ok()) return ptr.status();
  if (mem_->stream()) PC_RETURN_IF_ERROR(comm.order_after(mem_->stream()));
  const uint64_t bytes = plan.buckets[k].bytes;
  const int sum_slot = static_cast<int>(k % 2);
  if (plan.checksum != Checksum::kNone) PC_RETURN_IF_ERROR(mem_->checksum_start(sum_slot, *ptr, bytes, plan.checksum));
  work = comm.broadcast(*ptr, bytes, 0);
  wire_bytes_ += bytes;
  PC_RETURN_IF_ERROR(keep_baseline(plan, k, tensors, hooks));
  if (plan.checksum != Checksum::kNone) {
    auto sum = mem_->checksum_result(sum_slot);
    if (!sum.ok()) return sum.status().with_context("checksum of bucket " + std::to_string(k));
    if (hooks.on_checksum) hooks.on_checksum(k, *sum);
  }
  return Status();
}

// Bucket k of a delta update: encoded against the baseline into its
// staging slot (the baseline moves to the new bytes as it goes), its header
// announced, and the encoding broadcast (nothing for an unchanged bucket).
// The pieces' hashes in the header verify it end to end, in place of a
// bucket checksum.
Status BucketSender::issue_delta(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                                 uint8_t* out, Communicator& comm, const Hooks& hooks, std::shared_ptr<Work>& work) {
  const auto& b = plan.buckets[k];
  std::vector<delta::Segment> segments;
  segments.reserve(b.pieces.size());
  for (const auto& p : b.pieces)
    segments.push_back({static_cast<const uint8_t*>(tensors[p.tensor].data) + p.tensor_offset,
                        hooks.baseline->tensor(p.tensor) + p.tensor_offset, p.bucket_offset, p.length});
  auto encoded = hooks.codec->encode(segments, b.bytes, plan.bucket_unit(k), hooks.delta_always, out);
  if (!encoded.ok()) return encoded.status().with_context("delta encoding of bucket " + std::to_string(k));
  const delta::Header& h = *encoded;
  // The encoding was written on the copy stream (CUDA): the broadcast waits for it.
  if (mem_->stream() && h.wire_bytes) PC_RETURN_IF_ERROR(comm.order_after(mem_->stream()));
  if (hooks.on_delta) hooks.on_delta(k, h);
  if (delta::sent_against_baseline(h.kind)) ++delta_buckets_;
  wire_bytes_ += h.wire_bytes;
  work = h.wire_bytes ? comm.broadcast(out, h.wire_bytes, 0) : nullptr;
  return Status();
}

// A dense bucket of an update that keeps a baseline: its bytes become the
// baseline's (copied beside the broadcast, which reads them too; queued on
// the copy stream for CUDA).
Status BucketSender::keep_baseline(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                                   const Hooks& hooks) {
  if (!hooks.baseline) return Status();
  std::vector<DeviceMemory::CopyOp> ops;
  for (const auto& p : plan.buckets[k].pieces)
    if (p.length)
      ops.push_back({hooks.baseline->tensor(p.tensor) + p.tensor_offset,
                     static_cast<const uint8_t*>(tensors[p.tensor].data) + p.tensor_offset, p.length});
  return mem_->copy_many(ops);
}

// Where bucket k's bytes are sent from: the tensor itself (direct), the
// tensors in place, or a staging slot packed now (queued, not waited on).
StatusOr<uint8_t*> BucketSender::stage(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                                       uint8_t* in_place, uint8_t* slot) {
  const auto& b = plan.buckets[k];
  if (b.direct) {
    const auto& p = b.pieces[0];
    return static_cast<uint8_t*>(tensors[p.tensor].data) + p.tensor_offset;
  }
  if (in_place) return in_place;
  std::vector<DeviceMemory::CopyOp> ops;
  ops.reserve(b.pieces.size());
  for (const auto& p : b.pieces)
    ops.push_back({slot + p.bucket_offset, static_cast<const uint8_t*>(tensors[p.tensor].data) + p.tensor_offset,
                   p.length});
  PC_RETURN_IF_ERROR(mem_->copy_many(ops));
  return slot;
}

Status BucketSender::finish(const UpdatePlan& plan, size_t k, Work* work, const Hooks& hooks, uint64_t& sent) {
  if (work)  // none: an unchanged bucket of a delta update
    PC_RETURN_IF_ERROR(work->wait(deadline_)
                           .with_context("bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
  sent += plan.buckets[k].bytes;
  if (hooks.on_progress) hooks.on_progress(std::min(sent, plan.total_bytes), plan.total_bytes);
  return Status();
}

// A failed send leaves the collective half-done: the communicator is aborted
// (the group must re-form anyway), and the send returns only once no issued
// broadcast or queued copy still reads the staging slots (a Work waits for
// its communicator's abort to finish). If that cannot be confirmed before
// the deadline, the slots are let go, not reused.
Status BucketSender::settle(Communicator& comm, std::vector<std::shared_ptr<Work>>& works, Status failure) {
  comm.abort(failure.message());
  if (!settle_works(works, *mem_, deadline_)) {
    PC_WARN("publisher: in-flight work did not settle after a failure; its staging buffers are let go, not reused");
    staging_.abandon();
  }
  return failure;
}

}  // namespace paramcast::transfer
