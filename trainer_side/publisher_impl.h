// PublisherImpl: the update protocol on the trainer's side, as orchestration
// of the rooms that do the work:
//
//   control::ControlServer   who is a member, heartbeats, status (control thread)
//   group::GroupHost         epochs, ranks, bootstrap, rendezvous store
//   transfer::BucketSender   pack and broadcast the buckets
//   UpdateRound              what each member answered for the update in flight
//
// One weight_update: plan -> group -> check -> move -> applied.
//
// Files: publisher.cc (lifecycle, the control thread's handlers, the public
// handle); publisher_update.cc (the protocol's steps: plan, check, move);
// publisher_group.cc (start, who is wanted in a group and in which rank
// order (slow members at leaves), re-forming it within the update's
// deadline, again without members named on conclusive evidence or gone
// during the formation); publisher_outcomes.cc (every member's Applied,
// shed and unconfirmed members, link rates, a reader the shm root saw
// stall); publisher_stream.cc (Update: begin, send, finish, abort over the
// same steps); publisher_delta.cc (whether an update can go as a delta, its
// baseline, each bucket's BucketDelta); publisher_sharded.cc (many senders
// on rank 0: one call as named steps, one plan checked before any byte
// moves, rank 0's own transfers); publisher_holdings.cc (the other ranks'
// Holdings as they arrive, and the plan's shape from them and the engines'
// Wants); publisher_wants.cc (engines whose Wants are left out or struck); publisher_rank.cc (PublisherRank: trainer rank
// r > 0, a member built from the inference side's member machinery with
// holdings instead of registered buffers); publisher_metrics.cc (the
// /metrics page); update_gate.h (the update lock); update_round (what each
// member answered for the update in flight, the control messages its
// heartbeats show it lost, the outcomes); apply_deadline (apply_timeout:
// auto, from the members' own Applied times); slowest_link (where a slow update
// is slow: the slowest inbound link, followed down the tree, or the parent
// whose every outbound link was as slow); trainer_main.cc
// (paramcast-trainer).
//
// Threads: the caller's thread runs weight_update/start (serialized by
// update_mu_); the server's control thread calls the Listener methods, which
// only record answers and wake the caller (and abort a communicator on a
// member loss). mu_ guards what both threads touch; it may be held while
// calling the server (whose lock is a leaf), never while forming a group or
// waiting on the data plane.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <set>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "common/control/control_server.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/reaper.h"
#include "common/delta/baseline.h"
#include "common/delta/codec.h"
#include "common/group/group_host.h"
#include "common/metrics/exposition.h"
#include "common/metrics/http_server.h"
#include "common/reshard/sent_baseline.h"
#include "common/reshard/sharded_update.h"
#include "common/stream/stream_sender.h"
#include "common/transform/transform.h"
#include "common/transfer/bucket_sender.h"
#include "trainer_side/publisher.h"
#include "trainer_side/update_gate.h"
#include "trainer_side/apply_deadline.h"
#include "trainer_side/update_round.h"

namespace paramcast {

// "a, b, c", for messages that list worker ids.
std::string join_ids(const std::vector<std::string>& ids);

class PublisherImpl : public control::ControlServer::Listener {
 public:
  // What one move needs beside the plan: the group it goes to, its start,
  // the links' figures before it, and the bytes sent so far.
  // When the update in flight's data plane started and ended (update thread).
  Clock::time_point move_started_{}, move_ended_{};
  // Named by the last failed update (member -> why): probed before the next
  // formation (probe_data_suspects).
  std::map<std::string, std::string> data_suspects_;
  struct MoveState {
    std::vector<std::string> group;
    uint64_t epoch = 0;
    Clock::time_point t0;
    std::vector<LinkStats> links_before;
    uint64_t sent = 0;
  };

  // What a rank states it holds (or wants): the full specs of the tensors
  // and the boxes (index in tensors, box). Shared: a trainer rank's part is
  // kept for its calls that refer to it (Holdings.shapeRef).
  struct HeldShape {
    std::vector<TensorSpec> tensors;
    std::vector<std::pair<uint32_t, reshard::Region>> holds;
    uint64_t digest = 0;  // HeldShapeDigest (common/plan.h) of the above
  };
  // A trainer rank's Holdings or an engine's Wants, read and checked.
  struct SourceHoldings {
    uint64_t seq = 0;
    uint64_t step = 0;
    std::shared_ptr<const HeldShape> part = empty_part();
    std::map<size_t, uint64_t> digests;  // index in holds -> the xxh64 of its bytes, where the rank gave one
    std::string error;  // regions the update cannot use, in words
    bool referred = false;  // stated by reference to the rank's kept part
    uint64_t bytes = 0;     // the Holdings message's size
    // Wants only: it cuts at least one tensor (or sent regions the update cannot use).
    bool slices() const { return !part->holds.empty() || !error.empty(); }
    static std::shared_ptr<const HeldShape> empty_part();
  };
  // A trainer rank's last part stated whole, with the incarnation of the
  // process that stated it: what its later calls may refer to.
  struct KeptPart {
    uint64_t incarnation = 0;
    std::shared_ptr<const HeldShape> part;
  };
  explicit PublisherImpl(const Config& config);
  ~PublisherImpl() override;

  Status init();
  std::string endpoint() const { return server_.endpoint(); }
  std::string metrics_endpoint() const { return metrics_url_; }
  Status start();
  UpdateResult weight_update(const std::vector<TensorView>& tensors, const UpdateOptions& options);
  // Many-sender updates (publisher_sharded.cc).
  UpdateResult weight_update_sharded(const std::vector<ShardView>& shards, const UpdateOptions& options);
  // This rank's shards as the plan states them: each shard's full tensor
  // and its box (the same for every call that holds the same part), and
  // (with checksums) each box's xxh64 in this call.
  struct OwnShape {
    std::vector<TensorSpec> specs;
    std::vector<std::pair<uint32_t, reshard::Region>> holds;  // shard index, its box
    uint64_t digest = 0;                                      // HeldShapeDigest of specs and holds
    bool stated_by(const std::vector<ShardView>& shards) const;
  };
  struct OwnPart {
    std::shared_ptr<const OwnShape> shape;
    std::map<size_t, uint64_t> digests;  // index in holds -> xxh64
  };
  // What a sharded plan is made from, by identity: the same inputs as the
  // last plan's make no plan (only its version, seqs and digests anew).
  struct PlanInputs {
    std::vector<std::string> group;
    uint64_t own = 0;                                     // rank 0's part's digest
    std::vector<std::shared_ptr<const HeldShape>> parts;  // each member's part (trainer ranks), group order
    std::vector<std::shared_ptr<const HeldShape>> wants;  // each member's Wants (engines), group order
    bool partial = false;
    bool operator==(const PlanInputs&) const = default;
  };
  struct KeptPlan {
    PlanInputs inputs;
    // As made; lent to each call of the same inputs (plan_from_kept) and
    // given back when it ends: its version, delta base and the holders'
    // seqs and digests are each call's, all set anew by the next.
    UpdatePlan plan;
    std::vector<size_t> firsts;  // where each holding rank's holders begin in plan.holders, rank 0 first
  };
  // One weight_update_sharded call, as its steps pass it on.
  struct ShardedCall {
    ShardedCall(const UpdateOptions& o, Clock::time_point start) : options(o), t0(start) {}
    const UpdateOptions& options;
    Clock::time_point t0;
    uint64_t step = 0;  // the step every partner call publishes
    OwnPart own;
    std::vector<std::string> group;               // the group the update runs on, rank 1 first
    std::map<std::string, SourceHoldings> taken;  // the partner ranks' parts
    std::map<std::string, SourceHoldings> wants;  // the group's engines' slices
    UpdateResult r;
    std::optional<KeptPlan> made;  // the plan made for this call, kept once its moves are
    bool from_kept = false;        // the call's plan is kept_plan_'s
  };
  Status sharded_precondition(const UpdateOptions& options);
  Status transform_own(const std::vector<ShardView>& shards, const std::vector<transform::Rule>& rules,
                       const UpdateOptions& options, transform::TransformedShards& wire, UpdateResult& r);
  Status state_own_part(const std::vector<ShardView>& sent, OwnPart& own);
  static StatusOr<std::shared_ptr<const OwnShape>> state_own_shape(const std::vector<ShardView>& sent);
  Status take_parts(ShardedCall& c);
  StatusOr<UpdatePlan> sharded_plan(ShardedCall& c);
  Status plan_version(size_t tensors, const UpdateOptions& options, UpdateResult& r);
  PlanInputs plan_inputs(const ShardedCall& c) const;
  std::string plan_change(const PlanInputs& now) const;
  StatusOr<UpdatePlan> plan_from_kept(ShardedCall& c);
  UpdateResult run_planned(ShardedCall& c, UpdatePlan& plan, const std::vector<ShardView>& sent);
  void run_sharded(ShardedCall& c, UpdatePlan& plan, const std::shared_ptr<const reshard::ShardedMoves>& moves,
                   const std::vector<ShardView>& sent);
  UpdateResult refuse_sharded(ShardedCall& c, const Status& why);
  UpdateResult finish_sharded(ShardedCall& c, const Status& status);
  // Streamed updates (publisher_stream.cc): the update lock is held from
  // begin_stream until stream_finish or stream_abort.
  std::unique_ptr<StreamState> begin_stream(const std::vector<TensorSpec>& manifest, const UpdateOptions& options);
  Status stream_send(StreamState& st, const TensorView& tensor, void* after_stream);
  Status stream_send_wire(StreamState& st, const TensorView& tensor, void* after_stream);  // as it travels
  UpdateResult stream_finish(StreamState& st);
  void stream_abort(StreamState& st, const std::string& why);
  void release(StreamState& st);
  void set_progress(std::function<void(uint64_t, uint64_t, uint64_t)> callback);
  std::optional<MemberEvent> poll_event();
  PublisherStats stats() const;
  uint64_t next_version();
  void shutdown();
  void inject(const std::string& peer, const void* data, size_t size, const std::string& user);

  // control::ControlServer::Listener (control thread)
  void on_member_message(const std::string& id, proto::Envelope::Reader envelope) override;
  void on_member_event(const MemberEvent& event, int rank) override;

 private:
  StatusOr<UpdatePlan> make_plan(const std::vector<TensorSpec>& specs, const UpdateOptions& options, bool streamed,
                                 UpdateResult& r);
  Status check_tensors(const std::vector<TensorView>& tensors) const;
  // Logs `r` (and names in it the engines kept out for their Wants).
  void log_result(UpdateResult& r);
  // metrics.listen: the page /metrics serves (trainer_side/publisher_metrics.cc).
  Status start_metrics();
  std::string render_metrics() const;
  MoveState start_move();
  std::function<void(size_t, uint64_t)> checksum_hook(const UpdatePlan& plan, const MoveState& m);
  std::function<void(uint64_t, uint64_t)> progress_hook(const UpdatePlan& plan, MoveState& m);
  std::function<void(size_t, const delta::Header&)> delta_hook(const UpdatePlan& plan, const MoveState& m);
  Status end_move(const UpdatePlan& plan, const MoveState& m, Status data);
  void run(UpdatePlan& plan, const std::vector<TensorView>& tensors, const UpdateOptions& options,
           UpdateResult& r);
  Status ensure_group();
  void probe_data_suspects();  // before a formation (publisher_group.cc)
  // Forms the group of the wanted members by `cap`. When the failure names
  // members on conclusive evidence (now in quarantine), or members left or
  // were lost during it, forms again at once of the others of that
  // formation (a member that joined meanwhile waits for the next one), up
  // to `retries` times.
  Status form_group(Deadline cap, int retries = 3, const std::vector<std::string>* only = nullptr);
  std::vector<std::string> wanted_members(std::map<std::string, std::string>* excluded) const;
  bool send_plan(const UpdatePlan& plan, UpdateResult& r);
  bool check_plan(const UpdatePlan& plan, UpdateResult& r);
  Status move(const UpdatePlan& plan, const std::vector<TensorView>& tensors, void* after_stream, UpdateResult& r);
  // Delta updates: whether this update can go as a delta (sets
  // plan.delta_base) or why not, and the baseline prepared for it.
  void decide_delta(UpdatePlan& plan, UpdateResult& r);
  std::string delta_blocker_locked(const std::string& id, uint64_t base);
  // A sharded update: a delta onto the version every engine of the group
  // holds, where each sender has its pieces of it (publisher_sharded.cc).
  void decide_sharded_delta(UpdatePlan& plan, const std::vector<std::string>& group, UpdateResult& r);
  // Steps 3 with delta updates: sends the plan and, unless precommitted,
  // waits for the answers; a delta refused only as a delta (a member that
  // cannot take one right now) is planned again at once, dense. Returns
  // whether to go on to step 4.
  bool plan_round(UpdatePlan& plan, UpdateResult& r);
  void ready_baseline(const UpdatePlan& plan);
  bool keeps_baseline() const;
  void collect_applied(const UpdatePlan& plan, const Status& data, UpdateResult& r);
  // Step 5's wait (data plane ok): until every member waited for reported
  // Applied or publisher.apply_timeout ends (auto: apply_deadline.h, from
  // `start`). Returns the deadline's text for a silent member. mu_ held.
  // `waiting()`: who is waited for now (live, not shed).
  using Waiting = std::function<UpdateRound::IsLive()>;
  std::string wait_applied_locked(std::unique_lock<std::mutex>& lock, Clock::time_point start,
                                  const Waiting& waiting);
  // auto apply_timeout for the members still silent. mu_ held.
  ApplyBound auto_apply_bound_locked(Clock::time_point start, const UpdateRound::IsLive& waited_for) const;
  // "; slowest member: 'id' (N received)" from the members' heartbeats, or "".
  std::string slowest_receiver(uint64_t version) const;
  Deadline cap_;  // of the update in progress (update thread)
  std::vector<LinkStats> own_links_;  // what rank 0 sent per child during the last move (update thread)
  void set_link_rates(UpdateResult& r);
  // The members a parent in the tree shed during this update (its LinkStats,
  // or its Applied's links). Called with mu_ held.
  std::set<std::string> shed_members();
  // A member's parent in the broadcast tree of the plane it receives on
  // (the Gloo plane: the publisher and, in a mixed group, the members off
  // its host; -2 for a member on the shm plane, -1 for the root).
  std::function<int(int)> plane_parent() const;
  std::string slicing_engine_locked() const;
  void apply_unconfirmed(UpdateResult& r, Code& code);
  // on_slow_member: shed: the shed members' outcomes, and the update's code
  // without them. Called with mu_ held.
  void apply_shed(UpdateResult& r, const Status& data, Code& code);
  void note_data_suspects_locked(const UpdateResult& r);
  // Steps 2-5 of weight_update; whether the data plane carried the update.
  bool run_once(UpdatePlan& plan, const std::vector<TensorView>& tensors, const UpdateOptions& options,
                UpdateResult& r);
  // Who refused `plan`'s delta when every member did and nothing else
  // failed (a failed result); "" otherwise.
  std::string refused_by_every_member(const UpdatePlan& plan, const UpdateResult& r) const;
  // Members that refused a delta they claimed (precommitted plans): named
  // in `r`, the update goes on for the others. Returns those to strike.
  std::vector<std::string> apply_delta_refusals(const UpdatePlan& plan, UpdateResult& r, const Status& data,
                                                Code& code);
  // A refusal of `plan`'s delta: the member's claim is dropped until it
  // applied a dense version; a second refusal without a reason is a
  // strike. Returns whether to strike. mu_ held.
  bool note_delta_refusal(const SubscriberOutcome& o, const UpdatePlan& plan);
  // Quarantines members that refused a delta twice (without mu_).
  void strike_delta_refusers(const std::vector<std::string>& ids);
  void abandon_locked(uint64_t version, const std::string& reason);
  // A trainer rank's Holdings, an engine's Wants (control thread).
  void on_holdings(const std::string& id, proto::Holdings::Reader h);
  void on_wants(const std::string& id, proto::Holdings::Reader h);
  // A sharded update's shape: every rank's holdings (an error refuses the
  // update) and the engines' slices; an engine whose Wants it cannot use is
  // put in `unusable` (id -> why) instead (publisher_holdings.cc).
  Status sharded_shape(const ShardedCall& c, UpdatePlan& shape, std::map<std::string, std::string>& unusable,
                       std::vector<size_t>& firsts) const;
  // Leaves the engines in `unusable` out of the update in flight (the group
  // forms again without them; `group` becomes the new one) and out of later
  // formations until they state other Wants than those in `wants`
  // (publisher_wants.cc).
  Status leave_out_wants(const std::map<std::string, std::string>& unusable,
                         const std::map<std::string, SourceHoldings>& wants, std::vector<std::string>& group);
  // The live engines kept out for their Wants, each with why (mu_ held).
  std::vector<std::pair<std::string, std::string>> left_out_for_wants_locked() const;
  // Quarantines each engine whose refusal of `plan` contradicts, a second
  // time, the Wants it was planned from (`wants`), unchanged since
  // (publisher_wants.cc).
  void strike_wants_contradicted(const UpdatePlan& plan, const std::map<std::string, SourceHoldings>& wants,
                                 const UpdateResult& r);
  // Every engine's Wants are unusable: the update's refusal, naming why.
  static Status no_engine_takes(const std::map<std::string, std::string>& unusable);
  bool wants_refused_locked(const std::string& id) const;  // its Wants in force were refused (mu_ held)
  bool is_trainer_rank(const std::string& id) const;
  bool is_job_source(const std::string& id) const;  // a trainer rank's id, and its member a source
  // Ends trainer rank `id`'s publish call `seq` with `why` (an Abandon of
  // version 0 naming it).
  void end_trainer_call(const std::string& id, uint64_t seq, const std::string& why);
  Status every_trainer_rank_in_group() const;  // a sharded update: none missing from the group, or the cause
  Status some_engine_in_group() const;         // a sharded update: an engine to receive it, or UNAVAILABLE
  // Tells every live engine that update `version`, refused before its plan,
  // will not come (an Abandon of that version, `why`): one waiting for it
  // ends now. `reserved`: the plan had taken the version (else it must
  // exceed the last one).
  void abandon_unplanned(uint64_t version, bool reserved, const std::string& why);
  // The plain, streamed and sharded paths' failures: when no plan of
  // `version` went out (refused before it, the group did not form, or a
  // member left it before the plan), the engines hear of its end
  // (abandon_unplanned); one whose plan went out ends with its round.
  // Called with the update gate held (no other update chooses a version
  // meanwhile).
  void end_unplanned(uint64_t version, bool reserved, const Status& why);
  // Test hook (PARAMCAST_FAULT_PAUSE_BEFORE_PLAN): an update of `version`
  // pauses after its group was checked and before its plan goes out.
  void pause_before_plan(uint64_t version) const;
  Status move_sharded(const UpdatePlan& plan, const std::shared_ptr<const reshard::ShardedMoves>& moves,
                      const std::vector<ShardView>& shards, const OwnPart& own, void* after_stream, UpdateResult& r);
  std::shared_ptr<const reshard::BufferIndex> held_index(const std::shared_ptr<const reshard::ShardedMoves>& moves,
                                                          const std::vector<ShardView>& shards, const OwnPart& own);
  void on_heartbeat(const std::string& id);
  bool is_live(const std::string& id) const { return server_.is_live(id); }
  std::string silence() const;
  std::string waited(const char* name, Millis phase, Deadline until) const;
  std::vector<std::string> absent() const;
  uint64_t highest_member_version(std::string& who) const;
  std::map<std::string, uint64_t> standing_claims() const;
  std::string never_issued(const std::string& id, uint64_t v, const std::map<std::string, uint64_t>& claims) const;
  void refuse_impossible_versions();

  const Config cfg_;
  Reaper reaper_;  // releases communicators off the control thread and the caller (declared first: outlives them)
  control::ControlServer server_;
  group::GroupHost groups_;
  std::unique_ptr<DeviceMemory> mem_;
  std::unique_ptr<transfer::BucketSender> sender_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> streaming_{false};  // a streamed update holds update_mu_ (begin_stream to its end)

  mutable std::mutex mu_;  // shared with the control thread; guards everything below
  std::condition_variable cv_;
  std::deque<MemberEvent> events_;
  bool needs_reform_ = true;
  uint64_t formed_generation_ = 0;  // the membership the last formation read (ControlServer::live)
  // Each member's inbound link rate in the last update that measured it
  // (bytes/s): wanted_members() places slow members at leaves.
  std::map<std::string, double> link_rate_;
  std::vector<std::string> group_;  // members of the current epoch's group, ranks 1..n
  UpdateRound round_;
  std::shared_ptr<Communicator> active_comm_;  // the communicator of the update in flight
  // The manifest every member of `epoch` accepted in the last successful update.
  struct ValidatedManifest {
    uint64_t epoch;
    uint64_t hash;
    Checksum checksum;
    bool partial;
  };
  std::optional<ValidatedManifest> validated_;
  uint64_t published_version_ = 0;

  UpdateGate update_mu_;  // serializes updates; guards everything below
  std::shared_ptr<Communicator> comm_;
  uint64_t last_version_ = 0;
  std::function<void(uint64_t, uint64_t, uint64_t)> progress_;
  // The delta codec for the publisher's memory (made when delta is on);
  // declared before baseline_, whose storage it frees.
  std::unique_ptr<delta::DeltaCodec> codec_;
  metrics::UpdateCounters counters_;  // every update's outcome, for /metrics
  std::unique_ptr<metrics::MetricsServer> metrics_;  // stopped first in shutdown()
  std::string metrics_url_;  // set once by init()
  delta::Baseline baseline_;  // the last version every member applied (publisher.delta)
  bool baseline_fresh_ = false;  // the update in flight writes the baseline
  // Rank 0's baseline in a many-sender job: the pieces it sent last, as
  // which version (publisher.delta; its own shard at most, never the model).
  reshard::SentBaseline sent_;
  // Members that refused a delta they claimed they could take (guarded by
  // mu_): the version refused, how often, and whether their claim is
  // dropped (until they applied a dense version after it).
  struct DeltaRefusal {
    uint64_t version = 0;
    int count = 0;
    bool dropped = false;
  };
  std::map<std::string, DeltaRefusal> delta_refusals_;
  // A member of the current group left it (lost, left, or rejoined on a new
  // connection) since the group formed: why, naming it (guarded by mu_;
  // cleared by each formation). No update starts on that group.
  std::string departed_;
  // Each trainer rank's part of the next sharded update, until it is taken
  // (guarded by mu_; one entry per trainer rank).
  std::map<std::string, SourceHoldings> holdings_;
  // Each trainer rank's last part sent whole (mu_; one entry per trainer rank).
  std::map<std::string, KeptPart> kept_parts_;
  // Each trainer rank's last call heard of (Holdings.seq), and of which
  // process (its control incarnation).
  std::map<std::string, std::pair<uint64_t, uint64_t>> holdings_seq_;
  // The last sharded update's moves, reused while the shape holds (the
  // update thread's, under the update lock).
  reshard::ShardedMovesCache sharded_cache_;
  std::optional<KeptPlan> kept_plan_;  // the last sharded plan whose moves were found (update thread)
  std::shared_ptr<const OwnShape> own_shape_;  // this rank's part as its last call stated it (update thread)
  // Rank 0's buffers for the last moves: while the moves, its part and
  // its shards' addresses are the same (update thread).
  struct HeldIndex {
    std::weak_ptr<const reshard::ShardedMoves> moves;  // not kept alive by this cache
    std::shared_ptr<const OwnShape> shape;
    std::vector<const void*> data;
    std::shared_ptr<const reshard::BufferIndex> index;
  };
  HeldIndex held_index_;
  // Steps this rank refused before their plan (mu_): why, and the trainer
  // ranks whose call for it was ended. A rank whose part arrives after the
  // refusal is ended at once with the reason, not at its own timeout; its
  // next call for the same step (a retry) is taken, and so is any part once
  // this rank calls that step again. The last 16 steps.
  struct RefusedStep {
    std::string why;
    std::set<std::string> ended;
  };
  std::map<uint64_t, RefusedStep> refused_steps_;
  uint64_t sharded_calls_ = 0;  // weight_update_sharded calls without a version (update thread)
  std::map<std::string, SourceHoldings> wants_;  // each engine's slices (tensor parallelism), mu_
  // Engines whose Wants an update could not use (mu_): the seq of those
  // Wants, and why. Kept out of formations until they state other Wants
  // (publisher_wants.cc).
  struct RefusedWants {
    uint64_t seq = 0;
    std::string why;
  };
  std::map<std::string, RefusedWants> wants_refused_;
  // An engine's refusal of the slices its Wants of this seq asked for,
  // noted once (the second is a strike: strike_wants_contradicted).
  std::map<std::string, uint64_t> wants_contradicted_;
  ApplyHistory apply_history_;  // each member's recent Applied times (auto apply_timeout); mu_
  // Whether a trainer rank's Holdings name a call newer than any it sent
  // before (else dropped and logged). Takes mu_.
  bool newer_holdings(const std::string& id, uint64_t seq, uint64_t step);
  SourceHoldings read_holdings(const std::string& id, proto::Holdings::Reader h) const;
  static std::string read_part(proto::Holdings::Reader h, HeldShape& part, std::map<size_t, uint64_t>& digests);
  SourceHoldings held_by_reference(const std::string& id, proto::Holdings::Reader h);
  uint64_t last_round_version_ = 0;  // the version of the last round begun (mu_)
  // A sharded plan's shape: its digest (what Plan.shapeRef names) and a
  // generation that moves on whenever the shape's bytes differ from the
  // last plan's (ShardedMovesCache compares them byte for byte, so two
  // shapes of one digest are never taken for one). Set by the sharded path
  // for the plan about to go (plan_shape_), kept for the plan sent
  // (sent_shape_, with each recipient's incarnation) (mu_).
  struct PlanShape {
    uint64_t generation = 0;
    uint64_t digest = 0;  // 0: not a sharded plan
  };
  PlanShape plan_shape_, sent_shape_;
  uint64_t shape_generation_ = 0;  // update thread
  std::map<std::string, uint64_t> sent_incarnation_;
  // The shape each member applied last in that incarnation, so that the
  // next plan of that shape goes to it by reference; taken when a plan goes
  // to it, set again when it applies one (mu_).
  struct KnownShape {
    uint64_t incarnation = 0;
    PlanShape shape;
  };
  std::map<std::string, KnownShape> known_shapes_;
  void note_plan_shape(const UpdatePlan& plan, bool same_as_last);
  // send_plan's encoding: the plan whole to the members in `whole`, by
  // reference to the others; returns the seq to track it by.
  uint64_t send_plan_frames(const UpdatePlan& plan, uint64_t epoch, bool precommitted, UpdateResult& r);
  void note_shapes_applied_locked(const UpdateResult& r);
  transfer::FaultInjection faults_;  // test hooks (PARAMCAST_FAULT_*)
};

}  // namespace paramcast
