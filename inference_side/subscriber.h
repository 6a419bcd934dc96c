// Subscriber: the inference engine's side of ParamCast.
//
//   auto sub = Subscriber::create(config, "worker-3");
//   sub.value()->register_tensor(view);        // (a) written in place
//   sub.value()->on_tensor(callback);          // (b) transform on load
//   sub.value()->start();                      // joins, heartbeats, reconnects
//
// Updates arrive on the subscriber's own threads. Every plan is checked
// against the registrations before any byte moves; a mismatch is reported to
// the publisher with every disagreement. The subscriber's weight state is
// `version N, consistent`, or `dirty` when an update began and did not finish.
// When the publisher is lost, the process and its buffers stay; the subscriber
// reconnects with backoff and joins whichever publisher comes back.
//
// Ordering contract: a subscriber reports Applied only after its
// on_update_end hook has returned, so when the publisher's weight_update
// returns OK, every engine has its bytes in place and has finished its
// post-processing.
//
// Thread-safety: register/on_* before start() or between updates; state(),
// next_report() from any thread. Callbacks run on the subscriber's data thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "common/config.h"
#include "common/plan.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

enum class WeightStateKind { kEmpty, kConsistent, kDirty };
const char* weight_state_name(WeightStateKind k);

struct WeightState {
  WeightStateKind kind = WeightStateKind::kEmpty;
  uint64_t version = 0;        // last version applied completely
  uint64_t dirty_version = 0;  // when dirty: the version that did not finish
  std::string to_string() const;  // "version 4, consistent" / "dirty (v5 incomplete, last consistent v4)"
};

// The outcome of one update as this subscriber saw it.
struct UpdateReport {
  uint64_t version = 0;
  Status status;
  uint64_t bytes = 0;
  double seconds = 0;
};

// Called for each tensor not registered as a destination. The view is valid
// only during the call: on CUDA, device work the callback queues that reads
// it (an asynchronous copy) must be complete when it returns, since the bytes
// are reused right after (the Python on_weights waits for torch's current
// stream for its callers).
using TensorCallback = std::function<Status(const TensorView& view)>;
using UpdateBeginHook = std::function<void(uint64_t version)>;
using RegistrationCheck = std::function<std::vector<Mismatch>()>;
// Runs after the update's bytes are in place (or the update failed), before
// this subscriber reports Applied. A non-OK Status fails the update: the
// publisher's result names this worker and carries the Status; the weight
// state becomes dirty.
using UpdateEndHook = std::function<Status(uint64_t version, const Status& status)>;

class SubscriberImpl;

class Subscriber {
 public:
  static StatusOr<std::unique_ptr<Subscriber>> create(const Config& config, const std::string& worker_id);
  ~Subscriber();

  // A destination buffer, written in place by every update that names it.
  // CUDA destinations are complete (device work synchronised) before
  // on_update_end runs and before Applied is sent.
  Status register_tensor(const TensorView& destination);
  // A slice of a tensor this engine serves (tensor parallelism): slice.local
  // holds the box starting at slice.offsets of the full tensor of
  // slice.full_shape (row-major; local.spec.name and dtype the full
  // tensor's), e.g. rows [t*n/k, (t+1)*n/k) of a column-parallel weight,
  // anywhere in the engine's memory (a row range of a fused qkv_proj). Only
  // many-sender (sharded) updates deliver slices: each piece of the slice
  // goes straight into it, and nothing else of the tensor reaches this
  // engine. Host memory, or the engine's GPU (NCCL).
  Status register_slice(const ShardView& slice);
  void on_tensor(TensorCallback callback);
  void on_update_begin(UpdateBeginHook hook);
  void on_update_end(UpdateEndHook hook);
  // Checked on the data thread before each update's transfer begins
  // (beside on_update_begin, never on the control thread, whose heartbeats
  // it must not hold up): whether the registered tensors still are where
  // they were registered. A binding whose tensors can move under it (a
  // torch tensor whose storage was replaced: share_memory_(), resize_(), a
  // new .data) returns a mismatch per moved tensor; this engine then fails
  // the update, naming each, with no byte written and its weights as they
  // were. Set before start().
  void check_registrations(RegistrationCheck check);
  // A hook that cannot fail (returns void).
  template <typename F>
    requires std::is_void_v<std::invoke_result_t<F&, uint64_t, const Status&>>
  void on_update_end(F hook) {
    on_update_end(UpdateEndHook([hook = std::move(hook)](uint64_t v, const Status& s) mutable {
      hook(v, s);
      return Status();
    }));
  }

  Status start();
  void stop();  // says Leave and stops the threads

  WeightState state() const;
  // Peak bytes of staging memory the receive pipeline has held.
  uint64_t staging_peak_bytes() const;
  bool joined() const;  // welcomed by a publisher right now
  // Where metrics.listen serves this engine's Prometheus page
  // (http://HOST:PORT/metrics, with the bound port), or empty when off.
  std::string metrics_endpoint() const;
  // The next finished update (applied or failed), waiting up to `timeout`.
  std::optional<UpdateReport> next_report(std::chrono::milliseconds timeout);

  // For the fuzzer and tests, before start(): runs one control frame from the
  // publisher through the decoder and dispatcher on the calling thread.
  void inject_control_frame(const void* data, size_t size);

 private:
  explicit Subscriber(std::unique_ptr<SubscriberImpl> impl);
  std::unique_ptr<SubscriberImpl> impl_;
};

}  // namespace paramcast
