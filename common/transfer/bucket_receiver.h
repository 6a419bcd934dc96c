// BucketReceiver: a receiving rank's half of the transfer pipeline.
//
// receive() follows the root's broadcasts of one UpdatePlan: bucket k+1 is
// received while bucket k is verified and unpacked. Each bucket lands where
// it costs least: straight in a registered destination (a direct bucket), in
// the destinations in place (a packed bucket whose destinations lie back to
// back), in a per-tensor assembly buffer (chunks of a large tensor without a
// destination), or in a staging slot that is then unpacked. Every tensor
// without a destination is handed to on_tensor once complete. With checksums
// on, each bucket is verified against expected_checksum(k) before unpack; a
// mismatch names the bucket and its tensors. On any failure the
// communicator is aborted and the issued broadcasts settle before a buffer
// is released; on success every registered destination is complete when
// receive() returns (copies synchronised). drop() follows the collective
// into staging only (a plan this rank refused) so the others complete.
// A streamed plan (common/plan.h) arrives without buckets: next_bucket()
// supplies each layout as the publisher announces it, checked against the
// plan before its broadcast is received, until the stream's end.
// A delta update (plan.delta_base, host memory) announces each bucket's
// encoding (delta_header): a delta lands in staging and is applied in place
// to the registered destinations, or to the engine's own copy of the last
// version (copy_of) for tensors handed to on_tensor, which then gets the
// whole tensor from the copy; every piece's resulting bytes are checked
// against the publisher's hash of the new version.
// Time: no bucket has a deadline of its own (the communicator fails a
// stalled link); a receive ends by `deadline`, the update's cap. received()
// tells, from any thread, how far the receive in progress got.
//
// Thread-safety: one call at a time (the subscriber's data thread).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <vector>

#include "common/data/communicator.h"
#include "common/delta/codec.h"
#include "common/data/device_memory.h"
#include "common/plan.h"
#include "common/transfer/fault_injection.h"

namespace paramcast::transfer {

class BucketReceiver {
 public:
  struct Hooks {
    // The publisher's checksum of bucket k (waits for it to arrive).
    std::function<StatusOr<uint64_t>(size_t bucket)> expected_checksum;
    // A complete tensor that has no destination; the view is valid during the call.
    std::function<Status(const TensorView&)> on_tensor;
    // Streamed plans: bucket k's layout as announced, waited for when
    // `wait` (up to the deadline). kEnded: the stream ended before k.
    enum class Next { kReady, kEnded, kNotYet };
    std::function<StatusOr<Next>(size_t k, bool wait, PlanBucket& out)> next_bucket;
    // Delta updates: bucket k's header (waits for it to arrive).
    std::function<StatusOr<delta::Header>(size_t k)> delta_header;
    // Where tensor t, which has no destination, is kept between updates
    // (the engine's copy of the last version), or null: its bytes are
    // written there and on_tensor is handed the copy.
    std::function<uint8_t*(uint32_t t)> copy_of;
  };

  BucketReceiver(DeviceMemory* memory, Device device, FaultInjection faults = {});

  // `destinations[i]` is where plan.tensors[i] goes, or null (on_tensor).
  // A streamed plan gains its buckets as they arrive.
  Status receive(UpdatePlan& plan, const std::vector<const TensorView*>& destinations, Communicator& comm,
                 const Hooks& hooks, Deadline deadline);
  Status drop(UpdatePlan& plan, Communicator& comm, const Hooks& hooks, Deadline deadline);
  // Bytes of the current (or last) receive or drop that have landed.
  uint64_t received() const { return received_; }
  void stop() { stopping_ = true; }

 private:
  struct Update;  // the state of one receive()
  StatusOr<Hooks::Next> have(Update& u, size_t k, bool wait);
  bool may_issue_ahead(const Update& u, size_t j, size_t k) const;
  Status issue(Update& u, size_t k);
  Status finish(Update& u, size_t k);
  Status verify(Update& u, size_t k);
  Status land_delta(Update& u, size_t k);
  Status check_pieces(Update& u, size_t k);
  uint8_t* kept(Update& u, uint32_t t);
  Status deliver(Update& u, size_t k);
  Status settle(Update& u, Status failure);

  DeviceMemory* const mem_;
  const Device device_;
  std::unique_ptr<delta::DeltaCodec> codec_;  // made by the first delta update
  Deadline deadline_;  // of the receive in progress
  std::atomic<uint64_t> received_{0};
  FaultInjection faults_;
  StagingPair staging_;
  std::atomic<bool> stopping_{false};
};

}  // namespace paramcast::transfer
