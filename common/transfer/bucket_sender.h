// BucketSender: the root's half of the transfer pipeline.
//
// send() moves one UpdatePlan's buckets from the caller's tensors through a
// Communicator: bucket k+1 is packed while bucket k is on the wire (two
// staging slots, at most two broadcasts in flight). A direct bucket goes
// straight from the tensor's buffer; a packed bucket whose tensors lie back
// to back in memory (a flat parameter buffer, a weight arena) goes in place.
// With checksums on, each bucket's checksum (data/bucket_checksum.h) is
// computed beside its broadcast (on the copy stream for CUDA) and handed to
// on_checksum once known. Written once for host and CUDA memory
// (DeviceMemory). Ordering: packing and broadcasts wait, on the device, for
// `after_stream`; a broadcast waits for its bucket's packing; no host wait
// per pack. A failing send returns only after its in-flight work settled.
// Time: no bucket has a deadline of its own (a slow link that keeps moving
// is not a failure: the communicator fails a stalled one); the whole send
// ends by `deadline`, the update's cap.
//
// Thread-safety: one send() at a time; stop() from any thread ends a stall
// injected for tests.
//
// The room's files: bucket_sender and bucket_receiver (the receiving half:
// bucket k+1 received while k is verified and unpacked; direct, in place,
// assembly of chunks, staging; the tensor callback; a refused plan's
// buckets dropped); issue_ahead.h (buckets that land in place are issued up
// to 32 ahead on both sides, so the data plane always holds the next
// broadcasts); staging_slots.h (the one rule for which of its two staging
// slots a bucket uses, on every side and for every kind of bucket: the
// buckets that need a slot take them in turn, each waiting only for the
// slot's previous user); settle.h; fault_injection.h (test hooks from the
// environment).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

#include "common/data/communicator.h"
#include "common/delta/baseline.h"
#include "common/delta/codec.h"
#include "common/data/device_memory.h"
#include "common/plan.h"
#include "common/transfer/fault_injection.h"

namespace paramcast::transfer {

class BucketSender {
 public:
  struct Hooks {
    // Bucket k's checksum (checksums on), once computed (after its broadcast
    // was issued).
    std::function<void(size_t bucket, uint64_t checksum)> on_checksum;
    // Bucket k has left this rank: bytes sent so far of the update's total.
    std::function<void(uint64_t sent, uint64_t total)> on_progress;
    // Delta updates. Non-null: the baseline moves to this update's bytes
    // (prepared for its plan). With plan.delta_base set, each bucket is
    // encoded against it by `codec` (common/delta/codec.h: on the device
    // for CUDA memory) into staging and on_delta tells its header before
    // its broadcast (none for an unchanged bucket); `delta_always`: a delta
    // whenever smaller.
    delta::Baseline* baseline = nullptr;
    delta::DeltaCodec* codec = nullptr;
    bool delta_always = false;
    std::function<void(size_t bucket, const delta::Header&)> on_delta;
  };
  // What the last send() put on the wire (encodings included), and how many
  // of its buckets went as deltas (encoded against the baseline, or unchanged).
  uint64_t wire_bytes() const { return wire_bytes_; }
  size_t delta_buckets() const { return delta_buckets_; }

  explicit BucketSender(DeviceMemory* memory, FaultInjection faults = {});

  // `tensors[i]` holds plan.tensors[i]. Returns the first failure, naming the
  // bucket. `after_stream`: the caller's CUDA stream that produced the tensors
  // (DeviceMemory::order_after); ignored for host memory.
  Status send(const UpdatePlan& plan, const std::vector<TensorView>& tensors, Communicator& comm,
              const Hooks& hooks, Deadline deadline, void* after_stream = nullptr);
  void stop() { stopping_ = true; }
  // The two staging slots, shared with the publisher's streamed updates
  // (stream::StreamSender) so that either kind stays within 2 buckets.
  StagingPair& staging() { return staging_; }

 private:
  Status issue(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors, uint8_t* in_place,
               uint8_t* slot, Communicator& comm, const Hooks& hooks, std::shared_ptr<Work>& work);
  Status settle(Communicator& comm, std::vector<std::shared_ptr<Work>>& works, Status failure);
  StatusOr<uint8_t*> stage(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors,
                           uint8_t* in_place, uint8_t* slot);
  Status finish(const UpdatePlan& plan, size_t k, Work* work, const Hooks& hooks, uint64_t& sent);
  Status issue_delta(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors, uint8_t* out,
                     Communicator& comm, const Hooks& hooks, std::shared_ptr<Work>& work);
  Status keep_baseline(const UpdatePlan& plan, size_t k, const std::vector<TensorView>& tensors, const Hooks& hooks);

  DeviceMemory* const mem_;
  Deadline deadline_;  // of the send in progress
  const FaultInjection faults_;
  StagingPair staging_;
  std::atomic<bool> stopping_{false};
  uint64_t wire_bytes_ = 0;
  size_t delta_buckets_ = 0;
};

}  // namespace paramcast::transfer
