// Publisher: the trainer's side of ParamCast.
//
//   auto pub = Publisher::create(config);         // binds the control endpoint
//   pub.value()->start();                          // waits for subscribers, forms the group
//   UpdateResult r = pub.value()->weight_update(tensors);   // plan, broadcast, applied
//
// weight_update returns when every subscriber has applied the update, or with
// a Status naming each subscriber that failed and why (plan mismatches, lost
// members, checksum failures). A rejected plan moves no byte. Versions
// increase monotonically. Lost or restarted subscribers are handled by
// re-forming the group (a new epoch) at the next update.
//
// Thread-safety: all methods may be called from any thread; updates are
// serialized. One control thread owns the ZeroMQ socket (docs/protocol.md).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/control/member_event.h"
#include "common/plan.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

struct SubscriberOutcome {
  std::string worker_id;
  Status status;                     // OK when applied
  std::vector<Mismatch> mismatches;  // when the plan was rejected: the first 64 it named
  // What it received of this update (also when it failed) and how long its
  // receive took: rate() is the pace of its link as the group ran it. Zero
  // for a member that never reported (lost, or silent past update_timeout).
  uint64_t bytes = 0;
  double seconds = 0;
  double rate() const { return seconds > 0 ? static_cast<double>(bytes) / seconds : 0; }  // bytes/s
  // Bytes/s its inbound link sustained while it had bytes waiting, as its
  // parent in the broadcast tree measured it: unlike rate(), not paced by
  // the rest of the group, so the slow link stands out. 0: not known (NCCL).
  double link_rate = 0;
  // Shed from this update (publisher.on_slow_member: shed): its link ran
  // below the floor; it is dirty, and back in the group for the next update.
  // Its status says so; it does not fail the update.
  bool shed = false;
  // Refused the delta plan it had claimed it could take (a precommitted
  // plan: the others applied it). Its status says so; it does not fail the
  // update, and it gets dense updates until it applied one.
  bool refused_delta = false;
  // Alive, but never reported Applied within publisher.apply_timeout after
  // the data plane finished (on_member_loss: continue): named dirty, and
  // the update stands for the members that applied it.
  bool unconfirmed = false;
};

struct UpdateResult {
  Status status;  // OK when every (present) subscriber applied the update
  uint64_t version = 0;
  uint64_t epoch = 0;
  uint64_t bytes = 0;        // the tensors' bytes
  uint64_t wire_bytes = 0;   // what crossed the data plane, encodings included (delta updates: far less)
  // The control plane's plan messages, summed over the members they went
  // to: whole, and by reference (a sharded plan of a shape the member
  // applied before: Plan.shapeRef); plan_referred members got the latter.
  uint64_t plan_whole_bytes = 0;
  uint64_t plan_referred_bytes = 0;
  size_t plan_referred = 0;
  // A many-sender update: the plan was the last update's (the same parts,
  // Wants and group: nothing planned), and how many trainer ranks stated
  // their part by reference to the last one they sent (Holdings.shapeRef).
  bool plan_kept = false;
  size_t parts_referred = 0;
  // The trainer ranks' Holdings messages of this update, summed: a part by
  // reference is a few dozen bytes, plus 12 a box another rank holds too
  // where data_plane.checksum is on (Holdings.digestBoxes).
  uint64_t holdings_bytes = 0;
  bool delta = false;        // at least one bucket went as a delta
  // publisher.delta on and the update went dense: why ("worker-3 at v5",
  // "no baseline yet", "the manifest changed", ...). Empty otherwise.
  std::string dense_because;
  size_t tensors = 0;      // tensors that travelled (an fp8 tensor and its scales count two)
  size_t transformed = 0;  // the caller's tensors a transform changed (cast, fp8)
  size_t buckets = 0;
  double seconds = 0;
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
  // Where `seconds` went. `data_seconds`: the data plane, from this rank's
  // first byte to its last (the bytes ParamCast moved: data_gbps() is the
  // rate it achieved). `apply_seconds`: from then to the last Applied: the
  // engines' checks of what they received and their on_update_end (and, in
  // a tree, the last hops still landing), the slowest being `last_to_apply`.
  // The rest is the plan and the group.
  double data_seconds = 0;
  double apply_seconds = 0;
  std::string last_to_apply;
  double data_gbps() const { return data_seconds > 0 ? static_cast<double>(bytes) / data_seconds / 1e9 : 0; }
  std::vector<SubscriberOutcome> subscribers;
  std::vector<std::string> missing;  // expected but absent (on_member_loss: continue)
  std::vector<std::string> shed;     // cut from this update for a slow link (on_slow_member: shed)
  // Refused the delta plan they had claimed they could take: the update went
  // on for the others; each is named in `subscribers`, did not apply this
  // version, and gets dense updates until it applied one (docs/errors.md).
  std::vector<std::string> refused_delta;
  // Alive but silent on Applied within apply_timeout (on_member_loss:
  // continue): dirty until an update reaches them; each named in `subscribers`.
  std::vector<std::string> unconfirmed;
  // A many-sender update: engines left out of it because the update cannot
  // use their Wants (a region past a tensor's end, two slices of one tensor,
  // another shape, too many regions), each with why. The update goes on for
  // the others; such an engine stays out until it states other Wants.
  std::vector<std::pair<std::string, std::string>> left_out;
  // The plan went out without an accept round (publisher.reuse_validated_plan).
  bool precommitted = false;
  // The member whose inbound link was slowest (link_rate, followed down the
  // tree to the deepest link about as slow, since a slow link also slows the
  // links above it; rate() where no link figures exist), or its parent when
  // every link out of that parent (two or more) was about as slow: the
  // element they share ("publisher" for the publisher's own uplink). Empty
  // with no report: where to look when updates are slow.
  std::string slowest;
  bool ok() const { return status.ok(); }
};


// How an update is named in logs and tools: "update v5", or, for a call
// refused before a version was assigned to it (a check before its plan),
// "update (refused before a version was assigned)": never "v0", which no
// update has.
std::string update_label(uint64_t version);

// The largest version an update may have. A member that claims a version
// above this, or, once this publisher has published, above the last version
// it issued, is refused (named with the value and quarantined).
inline constexpr uint64_t kMaxVersion = (uint64_t{1} << 63) - 1;
// A publisher that has issued no version yet (a restarted one) resumes above
// the highest version a member in good standing holds, of those up to
// kResumeCeiling, or above it where another member holds a version within
// kCorroborationGap of the claim (a fleet of honest engines holds one
// version); never from kMaxVersion. Other claims are refused as above.
inline constexpr uint64_t kResumeCeiling = uint64_t{1} << 62;
inline constexpr uint64_t kCorroborationGap = uint64_t{1} << 20;

// Options of one weight_update.
struct UpdateOptions {
  // Must exceed the last published version; by default it is last + 1.
  std::optional<uint64_t> version;
  // CUDA tensors only: the stream (a cudaStream_t, opaque here so that this
  // header needs no CUDA) whose queued work produced the tensors. ParamCast's
  // copies and broadcasts are ordered after everything queued on it when
  // weight_update is called, so a tensor written there just before is never
  // sent stale. nullptr means the legacy default stream of the tensors'
  // device. Ignored for host tensors. A streamed update takes the stream of
  // each tensor with its send().
  void* after_stream = nullptr;
  // The update carries a subset of the engines' tensors (LoRA adapters, a
  // trainable subset): registered tensors it does not name keep their bytes,
  // and the engines are consistent at the new version. Without it, a
  // registered tensor missing from the update is a mismatch. Default: false
  bool partial = false;
  // What travels instead of the trainer's bytes, by tensor name, for this
  // update (common/transform/transform.h): replaces publisher.transforms;
  // an empty list sends every tensor as it is. Unset: publisher.transforms.
  std::optional<std::vector<transform::Rule>> transforms;
};

class PublisherImpl;
class SubscriberImpl;
struct StreamState;

// Update: one streamed update (Publisher::begin_update), planned from a
// manifest before any tensor exists; the trainer then hands over its tensors
// one at a time, in any order, as it gathers them, and each may be freed as
// soon as send() returns. Memory: the publisher's staging (2 buckets),
// whatever the model size.
//
//   auto u = pub->begin_update(manifest);    // every engine checked the plan
//   if (!u->ok()) return u->finish();        // rejected: no byte moved; finish() names every mismatch
//   for (...) { gather(t); u->send(t); free(t); }
//   UpdateResult r = u->finish();            // as weight_update's result
//
// A send() that fails (a name not in the manifest or sent twice, a wrong
// dtype, shape or device, the data plane) ends the update: later sends
// return the same error and finish() reports it. Destroying an Update that
// was not finished aborts it: the engines are left dirty at its version
// (their state says so: "dirty (vN incomplete, last consistent vM)"; bytes
// of the update may have landed) until the next update, which re-forms the
// group and makes them consistent again.
//
// Thread-safety: one thread at a time. The publisher runs no other update
// while an Update is open; it must not outlive its Publisher.
class Update {
 public:
  ~Update();
  Update(const Update&) = delete;
  Update& operator=(const Update&) = delete;

  // OK while the update can go on; else why it cannot (the plan was
  // rejected, a send failed, ...).
  Status status() const;
  bool ok() const { return status().ok(); }
  uint64_t version() const;
  // Places one tensor of the manifest (any order, each once). `after_stream`
  // (CUDA tensors): the stream that produced it, as UpdateOptions says.
  Status send(const TensorView& tensor, void* after_stream = nullptr);
  // Ends the update: every tensor of the manifest must have been sent.
  // Returns when every engine applied it, or naming each failure.
  UpdateResult finish();
  // Ends an unfinished update now (as the destructor does), with `why`.
  void abort(const std::string& why);

 private:
  friend class Publisher;
  Update(PublisherImpl* impl, std::unique_ptr<StreamState> state);
  PublisherImpl* impl_;
  std::unique_ptr<StreamState> state_;
};

struct PublisherStats {
  uint64_t epoch = 0;
  uint64_t published_version = 0;
  uint64_t dropped_frames = 0;      // malformed frames dropped
  uint64_t staging_peak_bytes = 0;  // peak staging memory of the send pipeline
  uint64_t baseline_bytes = 0;      // host memory held as the delta baseline (publisher.delta)
  uint64_t baseline_version = 0;    // the version it holds (0: none)
  int live_members = 0;
};

class Publisher {
 public:
  static StatusOr<std::unique_ptr<Publisher>> create(const Config& config);
  ~Publisher();

  // The bound control endpoint, with the real port when the config said "*".
  std::string endpoint() const;
  // Where metrics.listen serves the Prometheus page (http://HOST:PORT/metrics,
  // with the bound port), or empty when metrics are off.
  std::string metrics_endpoint() const;

  // Waits until the expected subscribers said Hello (join_timeout) and forms
  // the data-plane group.
  Status start();

  // Broadcasts `tensors` to every subscriber. `version` must exceed the last
  // one; by default it is last + 1.
  UpdateResult weight_update(const std::vector<TensorView>& tensors, std::optional<uint64_t> version = {});
  UpdateResult weight_update(const std::vector<TensorView>& tensors, const UpdateOptions& options);
  // A many-sender update (publisher.ranks > 1): every trainer rank of the
  // job publishes what it holds, at once; this is rank 0's call, the others
  // call PublisherRank::weight_update with theirs. The plan is made once
  // every trainer rank in the group sent its holdings for the same step
  // (options.version, given on every rank, or the count of calls without
  // one; within update_timeout): each byte of each tensor from exactly one rank, to
  // every engine, point to point (Gloo, or shm in host memory), and no rank gathers a tensor it
  // does not hold. A gap, an overlap or a disagreement between ranks is
  // refused before any byte moves, naming tensor, range and ranks. Dense
  // (no delta); checksums per transfer when publisher.checksum is on.
  UpdateResult weight_update_sharded(const std::vector<ShardView>& shards, const UpdateOptions& options = {});
  // Same, on a background thread; the views must stay valid until the future is ready.
  std::future<UpdateResult> weight_update_async(std::vector<TensorView> tensors,
                                                std::optional<uint64_t> version = {});
  std::future<UpdateResult> weight_update_async(std::vector<TensorView> tensors, UpdateOptions options);

  // A streamed update of the tensors `manifest` names (names, dtypes,
  // shapes; every tensor on publisher.device): the plan is checked by every
  // engine before this returns (a rejected one moves no byte: the Update is
  // not ok() and its finish() names every mismatch by engine). The tensors
  // then follow through Update::send. weight_update(tensors) is the same
  // update with every tensor at hand: its layout goes in the plan (packed
  // buckets of a flat buffer move in place, and a manifest the group
  // accepted before goes out precommitted).
  std::unique_ptr<Update> begin_update(const std::vector<TensorSpec>& manifest, const UpdateOptions& options = {});

  // The version weight_update gives an update when none is passed: one more
  // than the highest of the last published version and every live
  // subscriber's version (held, or dirty from an unfinished update), so that
  // versions never go backwards, also when a trainer restarts.
  uint64_t next_version() const;

  // Called on the updating thread after each bucket is on the wire, with the
  // bytes sent so far and the update's total: progress for long updates.
  void on_progress(std::function<void(uint64_t version, uint64_t sent, uint64_t total)> callback);

  // Membership events (joined, lost, ...) since the last call; nullopt when none.
  std::optional<MemberEvent> poll_event();
  PublisherStats stats() const;

  // Tells subscribers to leave and stops the control thread.
  void shutdown();

  // For the fuzzer and tests: runs one inbound control frame from `peer`
  // through the decoder and dispatcher on the calling thread.
  // `user`: in curve mode, the User-Id the frame arrives with (empty: no key).
  void inject_control_frame(const std::string& peer, const void* data, size_t size, const std::string& user = "");

 private:
  explicit Publisher(std::unique_ptr<PublisherImpl> impl);
  std::unique_ptr<PublisherImpl> impl_;
};

// PublisherRank: trainer rank r > 0 of a many-sender job (publisher.ranks >
// 1). It joins rank 0's publisher as member "trainer-<r>" and, on each
// weight_update, states what it holds and sends its part of the update
// straight to the engines (point to point), as rank 0 does in
// Publisher::weight_update_sharded: every rank of the job calls its publish
// once per update, with the shards it holds, and no rank gathers a tensor.
//
//   auto rank = PublisherRank::create(config, dist_rank);   // same YAML as rank 0
//   rank.value()->start();
//   UpdateResult r = rank.value()->weight_update(my_shards);  // this rank's part
//
// Its result is this rank's: OK once its own sends left (and were taken);
// rank 0's result names every member's outcome. Its shards are read only
// during its call: when the call returns, no plan uses them any more.
// Thread-safety: one call at a time; stop() from any thread ends a call.
class PublisherRank {
 public:
  static StatusOr<std::unique_ptr<PublisherRank>> create(const Config& config, int rank);
  ~PublisherRank();
  // Joins rank 0's publisher (connects; the group forms when rank 0 starts).
  Status start();
  // This rank's part of the next update: returns once it ran (its version
  // in the result), or with why not. Waits for rank 0's welcome first
  // (control.join_timeout), then at most publisher.update_timeout plus
  // control.heartbeat_timeout.
  // `step`: the version rank 0 publishes (UpdateOptions::version there);
  // every rank gives the same, or none does (then the calls pair by count).
  // Shards on a GPU (publisher.device): the call first waits for
  // `after_stream` (a cudaStream_t; null: the legacy default stream), after
  // which the caller's writes to them are done.
  UpdateResult weight_update(const std::vector<ShardView>& shards, std::optional<uint64_t> step = {},
                             void* after_stream = nullptr);
  void stop();
  const std::string& id() const { return id_; }
  // Bytes of the pieces this rank keeps to send deltas of (publisher.delta
  // on): what it sent last, at most its shards; 0 with delta off.
  uint64_t baseline_bytes() const;

 private:
  PublisherRank(std::unique_ptr<SubscriberImpl> impl, std::string id, const Config& config);
  std::unique_ptr<SubscriberImpl> impl_;
  std::string id_;
  std::string endpoint_;
  Millis bound_;
  Millis join_timeout_;
  uint64_t last_version_ = 0;
  uint64_t calls_ = 0;  // calls without a step
  std::vector<transform::Rule> rules_;  // publisher.transforms: applied to this rank's shards
  std::atomic<bool> stopped_{false};
};

}  // namespace paramcast
