// StreamSender: the root's half of a streamed update (Publisher::begin_update).
//
// The trainer hands tensors over one at a time, in any order, as it gathers
// them (a sharded trainer never holds the whole model). Each send() places
// the tensor and returns once its bytes are staged or on the wire, so the
// caller may free or overwrite it at once:
//   - a tensor of at least direct_min_bytes goes straight from the caller's
//     buffer, in bucket-sized chunks, and send() waits for its broadcasts;
//   - a smaller one is copied into the open staging bucket (256-byte
//     aligned); when the next does not fit, the bucket is sealed: its layout
//     is announced (on_layout, before its broadcast, so that receivers know
//     what arrives), its checksum computed, and it is broadcast while the
//     other staging slot fills.
// Buckets are therefore laid out in arrival order. The extra memory is the
// two staging slots (2 x bucket_bytes), allocated once, whatever the model
// size. finish() seals the last bucket, announces the end, and waits for
// every broadcast. A failure aborts the communicator and waits for issued
// work to settle before the slots may be reused, as BucketSender does.
//
// The receiving half is BucketReceiver with a next_bucket source: each
// announced layout is checked against the plan (UpdatePlan::
// add_streamed_bucket, end_stream) before its broadcast is received.
//
// Thread-safety: one thread at a time (the Update's owner).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/delta/baseline.h"
#include "common/delta/codec.h"
#include "common/plan.h"
#include "common/transfer/staging_slots.h"

namespace paramcast::stream {

class StreamSender {
 public:
  struct Hooks {
    // Bucket k's layout, before its broadcast is issued; `end`: no bucket follows.
    std::function<void(size_t k, const PlanBucket* bucket, bool end)> on_layout;
    // Bucket k's checksum (checksums on), once computed.
    std::function<void(size_t k, uint64_t checksum)> on_checksum;
    // Bytes that have left this rank so far, of the update's total.
    std::function<void(uint64_t sent, uint64_t total)> on_progress;
    // Delta updates, as BucketSender's: the baseline moves to the stream's
    // bytes; with plan->delta_base set each bucket is encoded against it
    // (a large tensor's chunks are staged first) and announced.
    delta::Baseline* baseline = nullptr;
    delta::DeltaCodec* codec = nullptr;
    bool delta_always = false;
    std::function<void(size_t k, const delta::Header&)> on_delta;
  };

  StreamSender(DeviceMemory* memory, StagingPair* staging);

  // Starts the stream of `plan` (a streamed plan: tensors, no buckets; its
  // buckets are appended as they are sealed). `direct_min_bytes`: the
  // smallest tensor that skips staging.
  Status begin(UpdatePlan* plan, Communicator* comm, Hooks hooks, Deadline deadline, uint64_t direct_min_bytes);
  // Places plan->tensors[index] (checked by the caller: known, not sent yet,
  // its spec) from `data`. `after_stream`: the CUDA stream that produced it.
  Status send(uint32_t index, const void* data, void* after_stream);
  // Seals the open bucket, announces the end, waits for every broadcast.
  Status finish();
  // Ends a stream that will not finish: aborts the communicator with
  // `why`, waits for issued work to settle. Idempotent.
  void abort(const std::string& why);
  uint64_t sent_bytes() const { return sent_; }
  uint64_t wire_bytes() const { return wire_; }
  size_t delta_buckets() const { return delta_buckets_; }

 private:
  Status seal();
  Status issue(uint8_t* from, PlanBucket bucket, bool staged);
  Status send_direct(uint32_t index, const uint8_t* src, uint64_t n);
  bool encoding() const { return plan_->delta_base != 0 && hooks_.baseline && hooks_.codec; }
  Status wait_slot();
  Status complete(size_t k);
  Status fail(Status s);

  DeviceMemory* const mem_;
  StagingPair* const staging_;
  UpdatePlan* plan_ = nullptr;
  Communicator* comm_ = nullptr;
  Hooks hooks_;
  Deadline deadline_;
  uint64_t direct_min_ = 0;
  PlanBucket open_;            // the bucket being filled, in slots_.next_slot()
  transfer::StagingSlots slots_;  // which staging slot each staged bucket uses
  std::vector<std::shared_ptr<Work>> works_;  // per bucket; reset once complete
  std::vector<uint64_t> bytes_;               // per bucket
  size_t done_ = 0;                           // buckets [0, done_) complete
  uint64_t sent_ = 0;
  uint64_t wire_ = 0;
  size_t delta_buckets_ = 0;
  Status failed_;
};

}  // namespace paramcast::stream
