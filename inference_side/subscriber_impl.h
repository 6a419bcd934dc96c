// SubscriberImpl: the update protocol on an inference engine's side, as
// orchestration of the rooms that do the work:
//
//   control::ControlClient    join, heartbeats, reconnect (control thread)
//   group::GroupMember        communicator per epoch, rendezvous over control
//   transfer::BucketReceiver  receive, verify and unpack the buckets
//   check_plan                can this engine take the plan?
//
// Files: subscriber.cc (lifecycle, the job queue and data thread, the weight
// state, the public handle); subscriber_control.cc (the control thread's
// handlers: Welcome, JoinGroup, Plan and its answer, Commit, Abandon, which
// hand data-plane work to the data thread); subscriber_announcements.cc (the
// per-bucket layouts and delta encodings the publisher announces, kept
// bounded and waited for); plan_check (check_plan); subscriber_sharded_publish.cc
// (what a member states before a sharded plan: a trainer rank's part, an
// engine's slices); subscriber_sharded.cc (a sharded plan on a member: a
// trainer rank sends from its shards, an engine receives each piece into its
// buffer or a host buffer for its callback); subscriber_sharded_check.cc;
// subscriber_metrics.cc; worker_main.cc (paramcast-worker).
//
// Threads: the client's control thread calls the Listener methods: it checks
// plans, answers them and queues jobs, never waiting on data. The data thread
// runs the jobs in order (join an epoch, receive an update), so heartbeats
// never wait for data. mu_ guards what both threads touch; it is never held
// while calling a communicator, a hook or the engine's callback.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "common/metrics/exposition.h"
#include "common/metrics/http_server.h"
#include "common/control/control_client.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/delta/baseline.h"
#include "common/reshard/sent_baseline.h"
#include "common/reshard/sharded_update.h"
#include "common/group/group_member.h"
#include "common/group/link_check.h"
#include "common/plan.h"
#include "common/transfer/bucket_receiver.h"
#include "inference_side/control_faults.h"
#include "inference_side/subscriber.h"

namespace paramcast {

// The box of its tensor a shard holds (or a slice receives), in a tensor of `full`.
inline reshard::Region box_of(const ShardView& s, const std::vector<int64_t>& full) {
  return {s.offsets.empty() ? std::vector<int64_t>(full.size(), 0) : s.offsets, s.local.spec.shape};
}

class SubscriberImpl : public control::ControlClient::Listener {
 public:
  // `source`: a trainer rank of a many-sender job (PublisherRank), which
  // sends its shards in sharded updates and takes no other plan.
  SubscriberImpl(const Config& config, std::string id, bool source = false);
  ~SubscriberImpl() override;

  Status register_tensor(const TensorView& destination);
  // A trainer rank's part of the next sharded update: sends Holdings
  // (subscriber_sharded_publish.cc). On a GPU it first waits for
  // `after_stream` (null: the legacy default stream).
  Status publish(const std::vector<ShardView>& shards, uint64_t step, void* after_stream = nullptr);
  Status check_shards(const std::vector<ShardView>& shards) const;
  Status publish_part(const std::vector<ShardView>& shards, uint64_t step,
                      std::shared_ptr<const std::vector<ShardView>> held, uint64_t part);
  // This rank cannot publish its part of `step`: tells rank 0 why (it
  // refuses the update at once, naming this rank), and returns `why`.
  Status publish_refused(const Status& why, uint64_t step);
  // Ends a trainer rank's call `seq`: no plan may use its shards any more.
  // `ran`: its update ran (its report came). Otherwise the publisher is told
  // (withdrawn), and a transfer still reading the shards is aborted and
  // waited for, so the caller may change or free them when this returns.
  void end_publish(uint64_t seq, bool ran);
  uint64_t publish_seq() const {
    std::lock_guard<std::mutex> lock(reg_mu_);
    return publish_seq_;
  }
  // The publish call whose part plan `version` took, as this rank accepted
  // it (0: none known): a call answers only reports of its own plans.
  uint64_t call_of(uint64_t version) const {
    std::lock_guard<std::mutex> lock(reg_mu_);
    auto it = planned_calls_.find(version);
    return it == planned_calls_.end() ? 0 : it->second;
  }
  Status register_slice(const ShardView& slice);
  void send_wants();  // the registered slices, to the publisher (any thread)
  Status start();
  void stop();
  WeightState state() const;
  bool joined() const { return client_->joined(); }
  uint64_t staging_peak() const;
  // metrics.listen (inference_side/subscriber_metrics.cc).
  std::string metrics_endpoint() const { return metrics_url_; }
  std::optional<UpdateReport> next_report(std::chrono::milliseconds timeout);
  void inject(const void* data, size_t size);

  TensorCallback callback_;
  UpdateBeginHook begin_hook_;
  RegistrationCheck registration_check_;  // set before start(); called on the data thread
  UpdateEndHook end_hook_;

  // control::ControlClient::Listener (control thread)
  void on_joined() override;
  void on_membership_lost(const std::string& why) override;
  void on_refused(const Status& why) override;
  void on_message(proto::Envelope::Reader envelope) override;
  control::WeightReport weight_report() override;

 private:
  Status start_metrics();
  std::string render_metrics() const;
  metrics::UpdateCounters counters_;  // every update's outcome, for /metrics
  std::unique_ptr<metrics::MetricsServer> metrics_;
  std::string metrics_url_;  // set once by start()
  struct Job {
    enum class Kind { kJoin, kReceive } kind;
    uint64_t epoch = 0;
    GroupOptions group;
    std::shared_ptr<UpdatePlan> plan;
    std::shared_ptr<const UpdatePlan> shape;  // a sharded plan's shape (SubscriberImpl::ShapeId)
    // Non-empty: a precommitted plan this subscriber cannot take. Its buckets
    // are received and dropped so that the collective completes; no tensor is
    // touched and the update is reported rejected with this text.
    std::string discard;
  };

  // Control thread.
  uint64_t client_epoch();
  void on_join_group(proto::Envelope::Reader env);
  void on_plan(proto::Envelope::Reader env);
  void answer_plan(uint64_t version, const std::vector<Mismatch>& mismatches);
  void on_commit(uint64_t epoch, uint64_t version);
  void abort_comm(const std::string& why, uint64_t only_version = 0);
  void push_job(Job job);
  // A sharded plan's shape, by the object that holds it: the kept whole
  // plan a plan by reference refers to, or the whole plan's own copy (which
  // becomes the kept one once accepted). Null for other plans.
  using ShapeId = std::shared_ptr<const UpdatePlan>;
  // Where `plan`'s regions (holders', wanters') are: a plan by reference
  // carries none (plan_by_reference), they are its shape's; any other plan
  // has its own.
  static const UpdatePlan& regions_of(const UpdatePlan& plan, const ShapeId& shape) { return shape ? *shape : plan; }
  std::vector<Mismatch> check(const UpdatePlan& plan, const ShapeId& shape = nullptr);

  // Data thread.
  void data_loop();
  void join(const Job& job);
  void receive(const Job& job);
  Status move(const Job& job, Communicator* comm, bool& collective_done);
  // A sharded plan (many senders): this rank's transfers over point-to-point
  // moves (inference_side/subscriber_sharded.cc).
  Status move_sharded(const Job& job, Communicator* comm, bool& collective_done);
  // Its steps, in order, over one move's state.
  struct ShardedMove;
  Status take_registrations(ShardedMove& m, Communicator* comm);
  void find_held(ShardedMove& m);
  Status find_wanted(ShardedMove& m, Communicator* comm);
  Status check_registrations(ShardedMove& m, Communicator* comm);
  Status run_moves(ShardedMove& m, Communicator* comm, bool& collective_done);
  Status hand_over(ShardedMove& m);
  // The checks of a sharded plan (subscriber_sharded_check.cc).
  std::vector<Mismatch> check_sharded(const UpdatePlan& plan, const ShapeId& shape);
  std::vector<Mismatch> check_not_sharded();
  void check_source_part(const UpdatePlan& plan, int rank, const ShapeId& shape, std::vector<Mismatch>& out);
  Status digest_boxes(const std::vector<ShardView>& shards, const std::vector<uint32_t>* only,
                      std::map<size_t, uint64_t>& out);
  void check_engine_part(const UpdatePlan& plan, int rank, const ShapeId& shape, std::vector<Mismatch>& out);
  void check_planned_slices(const UpdatePlan& plan, int rank, std::vector<Mismatch>& out) const;
  // A delta plan's "<delta>" mismatch when this engine cannot apply it now
  // (broadcast and sharded alike); nullopt when it can or the plan is dense.
  std::optional<Mismatch> delta_refusal(const UpdatePlan& plan);
  StatusOr<uint64_t> expected_checksum(uint64_t version, size_t bucket);
  using Next = transfer::BucketReceiver::Hooks::Next;
  StatusOr<Next> next_bucket(uint64_t version, size_t bucket, bool wait, PlanBucket& out);
  void on_layouts(proto::BucketLayouts::Reader layouts);
  void on_delta(proto::BucketDelta::Reader d);
  StatusOr<delta::Header> delta_header(uint64_t version, size_t bucket);
  bool keeps_copies() const;
  Status overflowed(uint64_t version) const;
  uint64_t combined_checksum(const UpdatePlan& plan);
  void report(const Job& job, const Status& s, uint64_t checksum, double seconds, uint64_t received,
              std::chrono::milliseconds receive_time, const std::vector<LinkStats>& links);

  const Config cfg_;
  const std::string id_;
  const bool source_;
  const Device device_;
  std::unique_ptr<control::ControlClient> client_;
  std::unique_ptr<group::GroupMember> group_;
  std::unique_ptr<DeviceMemory> mem_;                   // data thread only
  std::unique_ptr<DeviceMemory> publish_mem_;           // a trainer rank on a GPU: publish()'s (its caller's thread)
  std::unique_ptr<transfer::BucketReceiver> receiver_;  // data thread only
  // The last version of the tensors handed to the callback, kept to apply
  // deltas onto (subscriber.delta_baseline: host); data thread only, its
  // version read by the control thread under mu_ (copy_version_).
  delta::Baseline copy_;
  uint64_t copy_version_ = 0;    // guarded by mu_
  uint64_t copy_manifest_ = 0;   // guarded by mu_
  // A tensor was registered since the last whole update: its buffer does
  // not hold the version, so no delta until a dense update wrote it.
  bool registered_since_update_ = false;  // guarded by mu_
  // The version a delta can be applied onto now (0: none); mu_ held.
  uint64_t delta_base_locked() const;
  const transfer::FaultInjection faults_;
  ControlFaults lost_;  // test hook: control messages to lose
  zmq::message_t replayed_holdings_;  // PARAMCAST_FAULT_REPLAY_HOLDINGS: the last call's (reg_mu_)
  std::thread data_thread_;
  std::atomic<bool> stopping_{false};
  // Link checks the publisher asks for while this member is out of its
  // group (common/group/link_check.h).
  group::LinkCheckRunner link_checks_;
  // Round tracking reported in heartbeats (control::WeightReport).
  std::atomic<uint64_t> plan_seen_{0}, answered_{0}, commit_seen_{0}, applied_sent_{0};

  mutable std::mutex reg_mu_;
  std::map<std::string, TensorView> registry_;
  // A source's shards of the update it published (reg_mu_), shared with its move.
  std::shared_ptr<const std::vector<ShardView>> holdings_;
  // The last call's shards that passed its checks, and its part's digest
  // (reg_mu_): a call of the same shards (same_shards) takes them as they are.
  std::pair<std::shared_ptr<const std::vector<ShardView>>, uint64_t> last_part_;
  std::map<std::string, ShardView> slices_;  // an engine's registered slices (reg_mu_)
  uint64_t wants_seq_ = 0;                   // reg_mu_
  uint64_t publish_seq_ = 0;         // reg_mu_
  // A trainer rank's part by reference (Holdings.shapeRef): the call and
  // digest of the part it sent last, and the digest of the part the plan of
  // its last call took, which its next call may refer to (0: none; reg_mu_).
  std::pair<uint64_t, uint64_t> part_sent_{0, 0};
  uint64_t part_taken_ = 0;
  // The boxes of part `first` (indices in its shards' order) that the plan
  // which took it gave another holder too: a call by reference digests only
  // these (Holdings.digestBoxes; reg_mu_).
  std::pair<uint64_t, std::shared_ptr<const std::vector<uint32_t>>> replicated_;
  // Registrations so far (reg_mu_): a registration changes what a plan is
  // checked against.
  uint64_t registrations_ = 0;
  // An engine's registrations as a move takes them: one snapshot until the
  // next registration (reg_mu_).
  struct Registered {
    std::map<std::string, TensorView> registry;
    std::map<std::string, ShardView> slices;
  };
  std::shared_ptr<const Registered> registered();
  std::shared_ptr<const Registered> registered_;
  uint64_t registered_at_ = 0;
  // The sharded plan shape whose checks against the registrations (an
  // engine) or the part (a trainer rank) passed last, and what they were
  // checked against (reg_mu_): a plan by reference to it passes them again.
  struct CheckedShape {
    ShapeId shape;  // by identity: a fresh whole plan is never the last one
    uint64_t registrations = 0, part = 0;
    int rank = -1;
    bool partial = false;
    bool operator==(const CheckedShape&) const = default;
  };
  CheckedShape checked_;
  // The data-plane rank and names of the current epoch (for sharded plans;
  // set by join(), read under mu_).
  int rank_ = -1;
  int world_ = 0;
  std::vector<std::string> rank_names_;
  std::atomic<uint64_t> sharded_received_{0};
  // The last sharded plan's moves, reused while its shape holds (the data
  // thread's). Planned without the self-check: rank 0 made and checked the
  // same plan from the same manifests, and a member only follows it.
  reshard::ShardedMovesCache sharded_cache_{reshard::ReshardOptions{.forward = true, .validate = false}};
  // An engine's buffers for those moves, while its registrations are the
  // same snapshot and hold every tensor (no copy, nothing for the
  // callback): the data thread's.
  struct WantedIndex {
    std::shared_ptr<const reshard::ShardedMoves> moves;
    std::shared_ptr<const Registered> registered;
    std::shared_ptr<const reshard::BufferIndex> index;
  };
  WantedIndex wanted_index_;
  // A trainer rank's buffers for those moves, while its calls hold the same
  // shards in the same memory (the data thread's).
  struct HeldIndex {
    std::weak_ptr<const reshard::ShardedMoves> moves;  // not kept alive by this cache
    std::shared_ptr<const std::vector<ShardView>> holdings;
    std::shared_ptr<const reshard::BufferIndex> index;
  };
  HeldIndex held_index_;
  // The moves and registrations check_registrations last passed.
  std::pair<std::shared_ptr<const reshard::ShardedMoves>, std::shared_ptr<const Registered>> registrations_checked_;
  // A trainer rank's baseline: the pieces it sent last and as which
  // version (publisher.delta; data thread only, its size read anywhere).
  reshard::SentBaseline sent_;

 public:
  uint64_t sent_baseline_bytes() const { return sent_.bytes(); }

 private:
  bool receiving_sharded_ = false;  // mu_
  // A trainer rank: the publish call whose shards a plan may use now (0:
  // none; reg_mu_). Its shards are the caller's only during that call.
  uint64_t active_seq_ = 0;
  // The call each accepted plan took its part from, by version (the last 16).
  std::map<uint64_t, uint64_t> planned_calls_;

  mutable std::mutex mu_;  // shared state of both threads
  std::condition_variable cv_;
  Status fatal_;
  uint64_t epoch_ = 0;
  WeightState state_;
  std::deque<UpdateReport> reports_;
  std::chrono::milliseconds update_cap_{600000};  // the group's backstop: the publisher's update_timeout
  Deadline deadline_;                              // of the update being received
  Deadline deadline() {
    std::lock_guard<std::mutex> lock(mu_);
    return deadline_;
  }
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> checksums_;
  // Streamed plans: bucket layouts announced and not yet taken, and the
  // bucket count of each stream that ended (by version).
  std::map<std::pair<uint64_t, uint32_t>, PlanBucket> layouts_;
  std::map<uint64_t, uint64_t> stream_end_;
  std::map<std::pair<uint64_t, uint32_t>, delta::Header> deltas_;  // delta updates: bucket encodings announced
  uint64_t abandoned_version_ = 0;  // the last update the publisher abandoned
  uint64_t overflowed_version_ = 0;  // the last update whose announcements overflowed the pending bound
  uint64_t receiving_version_ = 0;
  std::shared_ptr<Communicator> comm_;        // abort() is called outside mu_
  std::shared_ptr<UpdatePlan> pending_plan_;  // control thread only
  std::shared_ptr<const UpdatePlan> pending_shape_;  // its shape (ShapeId; sharded)
  // The last whole sharded plan this member accepted, under its shape's
  // digest: a later plan may name it instead of listing it (Plan.shapeRef).
  // Control thread only.
  struct KeptShape {
    uint64_t digest = 0;
    std::shared_ptr<const UpdatePlan> plan;
  };
  KeptShape kept_shape_;
  StatusOr<UpdatePlan> read_plan(proto::Plan::Reader msg) const;

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
};

// Two calls' shards are the same tensors' same boxes at the same addresses
// on the same device (subscriber_sharded_publish.cc).
bool same_shards(const std::vector<ShardView>& a, const std::vector<ShardView>& b);

}  // namespace paramcast
