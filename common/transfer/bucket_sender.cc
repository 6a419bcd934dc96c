#include "common/transfer/bucket_sender.h"

#include <thread>

#include "common/log.h"

namespace paramcast::transfer {

BucketSender::BucketSender(DeviceMemory* memory, std::chrono::milliseconds op_timeout, FaultInjection faults)
    : mem_(memory), op_timeout_(op_timeout), faults_(faults) {}

Status BucketSender::send(const UpdatePlan& plan, const std::vector<TensorView>& tensors, Communicator& comm,
                          const Hooks& hooks, void* after_stream) {
  PC_RETURN_IF_ERROR(mem_->order_after(after_stream));
  const size_t n = plan.buckets.size();
  auto source = [&](uint32_t t) { return tensors[t].data; };
  std::vector<uint8_t*> in_place_at(n, nullptr);
  uint64_t staging_bytes = 0;
  for (size_t k = 0; k < n; ++k) {
    if (plan.buckets[k].direct) continue;
    in_place_at[k] = plan.in_place_base(k, source);
    if (!in_place_at[k]) staging_bytes = std::max(staging_bytes, plan.buckets[k].bytes);
  }
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, staging_bytes));
  std::vector<std::shared_ptr<Work>> works(n);
  uint64_t sent = 0;
  for (size_t k = 0; k < n; ++k) {
    if (k >= 2) PC_RETURN_IF_ERROR(finish(plan, k - 2, *works[k - 2], hooks, sent));
    auto ptr = stage(plan, k, tensors, in_place_at[k]);
    if (!ptr.ok()) return ptr.status();
    if (plan.checksum == Checksum::kXxh64) {
      auto sum = mem_->checksum(*ptr, plan.buckets[k].bytes);
      if (!sum.ok()) return sum.status();
      if (hooks.on_checksum) hooks.on_checksum(k, *sum);
    }
    works[k] = comm.broadcast(*ptr, plan.buckets[k].bytes, 0);
    if (faults_.stalls_after(plan.version, k)) {
      // Hang mid-update, as a wedged trainer would, until stopped.
      PC_WARN("publisher: fault injection: stalling after bucket " << k << " of v" << plan.version);
      while (!stopping_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return aborted("publisher stopped mid-update (fault injection)");
    }
  }
  for (size_t k = n >= 2 ? n - 2 : 0; k < n; ++k) PC_RETURN_IF_ERROR(finish(plan, k, *works[k], hooks, sent));
  return Status();
}

// Where bucket k's bytes are sent from: the tensor itself (direct), the
// tensors in place, or a staging slot packed now.
StatusOr<uint8_t*> BucketSender::stage(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                                       uint8_t* in_place) {
  const auto& b = plan.buckets[k];
  if (b.direct) {
    const auto& p = b.pieces[0];
    return static_cast<uint8_t*>(tensors[p.tensor].data) + p.tensor_offset;
  }
  if (in_place) return in_place;
  uint8_t* slot = staging_.slot(k);
  std::vector<DeviceMemory::CopyOp> ops;
  ops.reserve(b.pieces.size());
  for (const auto& p : b.pieces)
    ops.push_back({slot + p.bucket_offset, static_cast<const uint8_t*>(tensors[p.tensor].data) + p.tensor_offset,
                   p.length});
  PC_RETURN_IF_ERROR(mem_->copy_many(ops));
  return slot;
}

Status BucketSender::finish(const UpdatePlan& plan, size_t k, Work& work, const Hooks& hooks, uint64_t& sent) {
  PC_RETURN_IF_ERROR(work.wait(Clock::now() + op_timeout_)
                         .with_context("bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
  sent += plan.buckets[k].bytes;
  if (hooks.on_progress) hooks.on_progress(std::min(sent, plan.total_bytes), plan.total_bytes);
  return Status();
}

}  // namespace paramcast::transfer
