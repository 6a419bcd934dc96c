#include "trainer_side/publisher.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/control/messages.h"
#include "common/control/wakeup.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/log.h"
#include "common/xxhash.h"

namespace paramcast {

const char* member_event_name(MemberEvent::Kind k) {
  switch (k) {
    case MemberEvent::Kind::kJoined: return "joined";
    case MemberEvent::Kind::kRejoined: return "rejoined";
    case MemberEvent::Kind::kLost: return "lost";
    case MemberEvent::Kind::kLeft: return "left";
  }
  return "?";
}

namespace {
struct Member {
  std::string id;
  uint64_t incarnation = 0;
  std::string host;
  uint32_t pid = 0;
  Device device;
  Clock::time_point last_seen;
  uint64_t weight_version = 0;
  proto::WeightState state = proto::WeightState::EMPTY;
  int rank = -1;
  bool lost = false;
};

struct PlanAnswer {
  bool accepted = false;
  std::vector<Mismatch> mismatches;
};
struct AppliedAnswer {
  bool ok = false;
  uint64_t bytes = 0;
  Status status;
};
struct PendingProbe {
  std::string peer;
  std::string id;
  uint64_t incarnation;
  Clock::time_point arrived;
  std::string who;
};
struct ParkedGet {
  std::string peer;
  uint64_t request_id;
  std::string key;
};

std::string join_ids(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ", ") + id;
  return s;
}
}  // namespace

class PublisherImpl {
 public:
  explicit PublisherImpl(const Config& config)
      : cfg_(config), router_(ctx_, zmq::socket_type::router), incarnation_(control::new_incarnation()) {}

  ~PublisherImpl() { shutdown(); }

  Status init() {
    try {
      // A new connection under a worker id takes it over: subscribers connect
      // under their id only after a probe showed the id is free (or theirs),
      // so this serves restarts and reconnects, never duplicates. ZMTP
      // heartbeats drop connections of processes that stopped answering.
      router_.set(zmq::sockopt::router_handover, 1);
      router_.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(cfg_.control.heartbeat_interval.count()));
      router_.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(cfg_.control.heartbeat_timeout.count()));
      router_.set(zmq::sockopt::router_mandatory, 1);
      router_.set(zmq::sockopt::linger, 0);
      router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(cfg_.control.max_message_bytes + 1024));
      router_.bind(cfg_.control.endpoint);
      endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return unavailable("cannot bind control endpoint " + cfg_.control.endpoint + ": " + e.what());
    }
    auto mem = create_device_memory(cfg_.publisher.device);
    if (!mem.ok()) return mem.status();
    mem_ = std::move(mem.value());
    thread_ = std::thread([this] { control_loop(); });
    PC_INFO("publisher: listening on " << endpoint_ << " (" << backend_name(cfg_.data_plane.backend) << ", expects "
                                       << cfg_.expected_count() << " subscribers)");
    return Status();
  }

  std::string endpoint() const { return endpoint_; }

  void shutdown() {
    if (stopped_.exchange(true)) return;
    cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, m] : members_)
        if (!m.lost) send_locked(id, control::make_message(epoch_, incarnation_, [](auto b) {
                                   b.initLeave().setReason("publisher shutting down");
                                 }));
      flush_on_stop_ = true;
    }
    cv_.notify_all();
    wake_.notify();
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> ulock(update_mu_);
    comm_.reset();
  }

  // ---------------------------------------------------------------- start()
  Status start() {
    std::lock_guard<std::mutex> ulock(update_mu_);
    const auto deadline = Clock::now() + cfg_.control.join_timeout;
    std::vector<std::string> missing;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, deadline, [&] { return missing_locked().empty() || stopped_; });
      missing = missing_locked();
    }
    if (!missing.empty()) {
      const std::string what = "join_timeout (" + std::to_string(cfg_.control.join_timeout.count()) +
                               "ms) passed with subscribers missing: " + join_ids(missing);
      if (cfg_.publisher.on_missing_at_start == MissingAtStartPolicy::kFail || live_count() == 0)
        return timeout_error(what);
      PC_WARN("publisher: " << what << "; starting with those present (they are admitted when they join)");
    }
    return form_group();
  }

  // ---------------------------------------------------------- weight_update
  UpdateResult weight_update(const std::vector<TensorView>& tensors, std::optional<uint64_t> version) {
    std::lock_guard<std::mutex> ulock(update_mu_);
    const auto t0 = Clock::now();
    tensors_ = tensors;
    UpdateResult r = run_update(tensors, version);
    tensors_.clear();
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!r.ok()) PC_WARN("publisher: update v" << r.version << " failed: " << r.status.to_string());
    return r;
  }

  std::optional<MemberEvent> poll_event() {
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.empty()) return std::nullopt;
    MemberEvent e = events_.front();
    events_.pop_front();
    return e;
  }

  PublisherStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    PublisherStats s;
    s.epoch = epoch_;
    s.published_version = published_version_;
    s.dropped_frames = dropped_frames_;
    s.staging_peak_bytes = mem_ ? mem_->peak() : 0;
    for (auto& [id, m] : members_) s.live_members += !m.lost;
    return s;
  }

 private:
  // ------------------------------------------------------------ membership
  int live_count() {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (auto& [id, m] : members_) n += !m.lost;
    return n;
  }

  std::vector<std::string> missing_locked() const {
    std::vector<std::string> missing;
    if (!cfg_.publisher.subscriber_ids.empty()) {
      for (const auto& id : cfg_.publisher.subscriber_ids) {
        auto it = members_.find(id);
        if (it == members_.end() || it->second.lost) missing.push_back(id);
      }
    } else {
      // Any ids may join: name the lost members first, then count the rest.
      int live = 0;
      for (auto& [id, m] : members_) live += !m.lost;
      const int absent = cfg_.expected_count() - live;
      for (auto& [id, m] : members_)
        if (m.lost && static_cast<int>(missing.size()) < absent) missing.push_back(id);
      for (int i = static_cast<int>(missing.size()); i < absent; ++i)
        missing.push_back("<unnamed subscriber " + std::to_string(live + i + 1) + " of " +
                          std::to_string(cfg_.expected_count()) + ">");
    }
    return missing;
  }

  Status form_group() {
    std::vector<std::string> group;
    uint64_t epoch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, m] : members_) {
        m.rank = -1;
        if (!m.lost) group.push_back(id);
      }
      if (group.empty()) return unavailable("no live subscriber to form a group with");
      epoch = ++epoch_;
      group_ = group;
      for (size_t i = 0; i < group.size(); ++i) members_[group[i]].rank = static_cast<int>(i + 1);
      ready_.clear();
      group_failed_.clear();
      needs_reform_ = false;
    }
    comm_.reset();
    auto bootstrap = mint_bootstrap(cfg_.data_plane.backend, epoch);
    if (!bootstrap.ok()) return fail_group(bootstrap.status());
    const int world = static_cast<int>(group.size()) + 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < group.size(); ++i) {
        send_locked(group[i], control::make_message(epoch, incarnation_, [&](auto b) {
          auto j = b.initJoinGroup();
          j.setRank(static_cast<uint32_t>(i + 1));
          j.setWorldSize(static_cast<uint32_t>(world));
          j.setBackend(cfg_.data_plane.backend == Backend::kNccl ? proto::Backend::NCCL : proto::Backend::GLOO);
          j.setBootstrap(kj::arrayPtr(reinterpret_cast<const kj::byte*>(bootstrap->data()), bootstrap->size()));
          auto members = j.initMembers(static_cast<unsigned>(world));
          members.set(0, "publisher");
          for (size_t k = 0; k < group.size(); ++k) members.set(static_cast<unsigned>(k + 1), group[k]);
          j.setInitTimeoutMs(static_cast<uint32_t>(cfg_.data_plane.init_timeout.count()));
          j.setOpTimeoutMs(static_cast<uint32_t>(cfg_.data_plane.timeout.count()));
        }));
      }
    }
    wake_.notify();
    GroupOptions go;
    go.epoch = epoch;
    go.rank = 0;
    go.world_size = world;
    go.backend = cfg_.data_plane.backend;
    go.bootstrap = *bootstrap;
    go.device = cfg_.publisher.device;
    go.init_timeout = cfg_.data_plane.init_timeout;
    go.op_timeout = cfg_.data_plane.timeout;
    go.gloo_hostname = cfg_.data_plane.gloo_hostname;
    go.gloo_interface = cfg_.data_plane.gloo_interface;
    LocalStore store(this);
    auto comm = create_communicator(go, store);
    const auto deadline = Clock::now() + cfg_.data_plane.init_timeout;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] {
      if (!group_failed_.empty() || stopped_) return true;
      for (const auto& id : group)
        if (members_[id].lost || !ready_.count(id)) return members_[id].lost;
      return true;
    });
    std::vector<std::string> problems;
    for (const auto& id : group) {
      if (group_failed_.count(id)) problems.push_back(id + ": " + group_failed_[id]);
      else if (members_[id].lost) problems.push_back(id + ": lost during group formation");
      else if (!ready_.count(id)) problems.push_back(id + ": not ready within init_timeout");
    }
    lock.unlock();
    if (!comm.ok()) problems.push_back("publisher: " + comm.status().message());
    if (!problems.empty()) {
      std::string msg = "group of epoch " + std::to_string(epoch) + " failed to form: ";
      for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
      return fail_group(unavailable(msg));
    }
    comm_ = std::move(comm.value());
    PC_INFO("publisher: group epoch " << epoch << " formed: publisher + " << group.size() << " subscribers ("
                                      << backend_name(cfg_.data_plane.backend) << ")");
    return Status();
  }

  Status fail_group(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    needs_reform_ = true;
    return s;
  }

  // ---------------------------------------------------------------- update
  UpdateResult run_update(const std::vector<TensorView>& tensors, std::optional<uint64_t> version) {
    UpdateResult r;
    r.version = version.value_or(last_version_ + 1);
    r.tensors = tensors.size();
    if (version && *version <= last_version_) {
      r.status = invalid_argument("version " + std::to_string(*version) + " does not exceed the last version " +
                                  std::to_string(last_version_));
      return r;
    }
    std::vector<TensorSpec> specs;
    specs.reserve(tensors.size());
    for (const auto& t : tensors) {
      if (t.device != cfg_.publisher.device) {
        r.status = invalid_argument("tensor '" + t.spec.name + "' is on " + t.device.to_string() +
                                    " but publisher.device is " + cfg_.publisher.device.to_string());
        return r;
      }
      specs.push_back(t.spec);
    }
    auto plan = build_plan(r.version, specs, cfg_.data_plane);
    if (!plan.ok()) {
      r.status = plan.status();
      return r;
    }
    for (size_t i = 0; i < tensors.size(); ++i)
      if (plan->nbytes[i] > 0 && tensors[i].data == nullptr) {
        r.status = invalid_argument("tensor '" + tensors[i].spec.name + "' has no data pointer");
        return r;
      }
    r.bytes = plan->total_bytes;
    r.buckets = plan->buckets.size();
    last_version_ = r.version;  // a version is never reused, even when its update fails

    // Re-form the group when membership changed since the last one.
    bool reform;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reform = needs_reform_ || !comm_;
    }
    if (reform) {
      Status s = wait_for_members_to_return(r);
      if (s.ok()) s = form_group();
      if (!s.ok()) {
        r.status = s;
        return r;
      }
    }
    std::vector<std::string> group;
    uint64_t epoch;
    bool precommitted = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      group = group_;
      epoch = epoch_;
      r.missing = missing_locked();
      plan_answers_.clear();
      applied_.clear();
      update_version_ = r.version;
      // Every member of this epoch accepted this manifest already: no round trip.
      precommitted = cfg_.publisher.reuse_validated_plan && validated_manifest_ &&
                     validated_manifest_->epoch == epoch && validated_manifest_->hash == plan->manifest_hash &&
                     validated_manifest_->checksum == plan->checksum;
      validated_manifest_.reset();  // set again only when this update succeeds everywhere
      capnp::MallocMessageBuilder builder;
      auto env = builder.initRoot<proto::Envelope>();
      env.setEpoch(epoch);
      env.setIncarnation(incarnation_);
      auto plan_msg = env.initBody().initPlan();
      plan_to_proto(*plan, plan_msg);
      plan_msg.setPrecommitted(precommitted);
      r.precommitted = precommitted;
      zmq::message_t frame = control::encode(builder);
      for (const auto& id : group) {
        zmq::message_t copy;
        copy.copy(frame);
        send_locked(id, std::move(copy));
      }
    }
    r.epoch = epoch;
    wake_.notify();
    const auto deadline = Clock::now() + cfg_.publisher.update_timeout;

    // 1. Every subscriber checks the plan before any byte moves. A
    // precommitted plan is checked by each subscriber on arrival instead.
    std::vector<std::string> lost;
    if (precommitted) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& id : group) {
        SubscriberOutcome o;
        o.worker_id = id;
        r.subscribers.push_back(std::move(o));
      }
      active_comm_ = comm_;
    } else {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, deadline, [&] {
        for (const auto& id : group)
          if (!plan_answers_.count(id) && !members_[id].lost && !stopped_) return false;
        return true;
      });
      bool rejected_any = false;
      for (const auto& id : group) {
        SubscriberOutcome o;
        o.worker_id = id;
        if (members_[id].lost) {
          o.status = peer_lost("subscriber '" + id + "' was lost (silent for " +
                               std::to_string(cfg_.control.heartbeat_timeout.count()) + "ms)");
          lost.push_back(id);
        } else if (!plan_answers_.count(id)) {
          o.status = timeout_error("subscriber '" + id + "' did not answer the plan before update_timeout");
          lost.push_back(id);
        } else if (!plan_answers_[id].accepted) {
          o.mismatches = plan_answers_[id].mismatches;
          std::string text;
          for (const auto& m : o.mismatches) text += (text.empty() ? "" : "; ") + m.to_string();
          o.status = rejected("subscriber '" + id + "' rejected the plan: " + text);
          rejected_any = true;
        }
        r.subscribers.push_back(std::move(o));
      }
      if (rejected_any || !lost.empty()) {
        abandon_locked(group, epoch, r.version,
                       rejected_any ? "plan rejected" : "a member was lost before the update started");
        if (!lost.empty()) needs_reform_ = true;
      }
      if (rejected_any || !lost.empty()) {
        lock.unlock();
        wake_.notify();
        r.status = summarize(r, rejected_any ? Code::kRejected : Code::kPeerLost,
                             "update v" + std::to_string(r.version) + " abandoned before any byte moved");
        return r;
      }
      for (const auto& id : group)
        send_locked(id, control::make_message(epoch, incarnation_, [&](auto b) { b.initCommit().setVersion(r.version); }));
      active_comm_ = comm_;
    }
    wake_.notify();

    // 2. Broadcast the buckets.
    Status data = send_buckets(*plan, epoch);
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_comm_.reset();
    }
    if (!data.ok()) comm_->abort(data.message());

    // 3. Wait for every Applied. After a data failure, wait at most one
    // heartbeat timeout more so that the members that died are named.
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto until = data.ok() ? deadline
                                   : std::min(deadline, Clock::now() + cfg_.control.heartbeat_timeout +
                                                            cfg_.control.heartbeat_interval);
      cv_.wait_until(lock, until, [&] {
        for (const auto& id : group)
          if (!applied_.count(id) && !members_[id].lost && !stopped_) return false;
        return true;
      });
      bool all_ok = data.ok();
      for (auto& o : r.subscribers) {
        const auto& id = o.worker_id;
        if (applied_.count(id)) {
          o.bytes = applied_[id].bytes;
          o.status = applied_[id].status;
          const auto answer = plan_answers_.find(id);
          if (answer != plan_answers_.end()) o.mismatches = answer->second.mismatches;  // a precommitted plan rejected
        } else if (members_[id].lost) {
          o.status = peer_lost("subscriber '" + id + "' was lost during update v" + std::to_string(r.version) +
                               " (silent for " + std::to_string(cfg_.control.heartbeat_timeout.count()) + "ms)");
        } else {
          o.status = timeout_error("subscriber '" + id + "' did not report applied v" + std::to_string(r.version) +
                                   (data.ok() ? " before update_timeout" : " after the data plane failed"));
        }
        all_ok = all_ok && o.status.ok();
      }
      if (!all_ok) {
        needs_reform_ = true;
        abandon_locked(group, epoch, r.version, "update failed");
      } else {
        published_version_ = r.version;
        validated_manifest_ = ValidatedManifest{epoch, plan->manifest_hash, plan->checksum};
      }
      lock.unlock();
      wake_.notify();
      if (!all_ok) {
        comm_.reset();
        Code code = data.ok() ? Code::kInternal : data.code();
        for (const auto& o : r.subscribers)
          if (!o.status.ok()) {
            code = o.status.code();
            if (code == Code::kPeerLost) break;
          }
        r.status = summarize(r, code, "update v" + std::to_string(r.version) + " failed" +
                                          (data.ok() ? "" : " (publisher data plane: " + data.message() + ")"));
        return r;
      }
    }
    if (!r.missing.empty())
      PC_WARN("publisher: update v" << r.version << " applied without missing subscribers: " << join_ids(r.missing));
    return r;
  }

  // Tells every live member of `group` that has not applied `version` to give it up.
  void abandon_locked(const std::vector<std::string>& group, uint64_t epoch, uint64_t version,
                      const std::string& reason) {
    for (const auto& id : group) {
      if (members_[id].lost) continue;
      const auto a = applied_.find(id);
      if (a != applied_.end() && a->second.ok) continue;  // it holds the version already
      send_locked(id, control::make_message(epoch, incarnation_, [&](auto b) {
        auto m = b.initAbandon();
        m.setVersion(version);
        m.setReason(reason);
      }));
    }
  }

  Status summarize(const UpdateResult& r, Code code, const std::string& head) {
    std::string msg = head;
    int failed = 0;
    for (const auto& o : r.subscribers)
      if (!o.status.ok()) msg += (failed++ ? "; " : ": ") + o.status.message();
    return Status(code, msg);
  }

  // Before re-forming, give lost members up to one heartbeat timeout to come back.
  Status wait_for_members_to_return(UpdateResult& r) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, Clock::now() + cfg_.control.heartbeat_timeout,
                   [&] { return missing_locked().empty() || stopped_; });
    auto missing = missing_locked();
    if (!missing.empty() && cfg_.publisher.on_member_loss == MemberLossPolicy::kFail)
      return peer_lost("subscribers missing (on_member_loss: fail): " + join_ids(missing));
    return Status();
  }

  // Packs bucket k+1 while bucket k is on the wire; at most two in flight.
  Status send_buckets(const UpdatePlan& plan, uint64_t epoch) {
    const size_t n = plan.buckets.size();
    auto source = [&](uint32_t t) { return tensors_[t].data; };
    std::vector<uint8_t*> in_place_at(n, nullptr);
    uint64_t staging_bytes = 0;
    for (size_t k = 0; k < n; ++k) {
      if (plan.buckets[k].direct) continue;
      in_place_at[k] = plan.in_place_base(k, source);
      if (!in_place_at[k]) staging_bytes = std::max(staging_bytes, plan.buckets[k].bytes);
    }
    PC_RETURN_IF_ERROR(staging_.reserve(mem_.get(), staging_bytes));
    std::vector<std::shared_ptr<Work>> works(n);
    for (size_t k = 0; k < n; ++k) {
      if (k >= 2) {
        PC_RETURN_IF_ERROR(works[k - 2]->wait(Clock::now() + cfg_.data_plane.timeout));
        report_progress(plan, k - 2);
      }
      const auto& b = plan.buckets[k];
      uint8_t* ptr;
      if (b.direct) {
        const auto& p = b.pieces[0];
        ptr = static_cast<uint8_t*>(tensors_[p.tensor].data) + p.tensor_offset;
      } else if (uint8_t* base = in_place_at[k]) {
        ptr = base;  // the trainer's tensors already lie in bucket layout (a flat parameter buffer)
      } else {
        ptr = staging_.slot(k);
        std::vector<DeviceMemory::CopyOp> ops;
        ops.reserve(b.pieces.size());
        for (const auto& p : b.pieces)
          ops.push_back({ptr + p.bucket_offset, static_cast<const uint8_t*>(tensors_[p.tensor].data) + p.tensor_offset,
                         p.length});
        PC_RETURN_IF_ERROR(mem_->copy_many(ops));
      }
      if (plan.checksum == Checksum::kXxh64) {
        auto sum = mem_->checksum(ptr, b.bytes);
        if (!sum.ok()) return sum.status();
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& id : group_)
          send_locked(id, control::make_message(epoch, incarnation_, [&](auto m) {
            auto c = m.initBucketChecksums();
            c.setVersion(plan.version);
            c.setFirst(static_cast<uint32_t>(k));
            c.initValues(1).set(0, *sum);
          }));
        wake_.notify();
      }
      works[k] = comm_->broadcast(ptr, b.bytes, 0);
      if (fault_stall_after_bucket_ == static_cast<int64_t>(k) &&
          (fault_stall_version_ == 0 || fault_stall_version_ == plan.version)) {
        // Test hook (PARAMCAST_FAULT_STALL_AFTER_BUCKET): hang mid-update, as a
        // wedged trainer would, until the process is killed or shut down.
        PC_WARN("publisher: fault injection: stalling after bucket " << k << " of v" << plan.version);
        while (!stopped_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return aborted("publisher stopped mid-update (fault injection)");
      }
    }
    for (size_t k = n >= 2 ? n - 2 : 0; k < n; ++k) {
      PC_RETURN_IF_ERROR(works[k]->wait(Clock::now() + cfg_.data_plane.timeout));
      report_progress(plan, k);
    }
    return Status();
  }

  void report_progress(const UpdatePlan& plan, size_t done_bucket) {
    if (!progress_) return;
    uint64_t sent = 0;
    for (size_t k = 0; k <= done_bucket; ++k) sent += plan.buckets[k].bytes;
    progress_(plan.version, std::min(sent, plan.total_bytes), plan.total_bytes);
  }

  // ----------------------------------------------------- rank 0's own store
  class LocalStore : public Store {
   public:
    explicit LocalStore(PublisherImpl* p) : p_(p) {}
    Status set(const std::string& key, const std::string& value) override {
      {
        std::lock_guard<std::mutex> lock(p_->mu_);
        p_->store_[key] = value;
        p_->answer_parked_gets();  // subscribers may already be waiting for this key
      }
      p_->cv_.notify_all();
      p_->wake_.notify();
      return Status();
    }
    StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
      std::unique_lock<std::mutex> lock(p_->mu_);
      if (!p_->cv_.wait_for(lock, timeout, [&] { return p_->store_.count(key) > 0; }))
        return timeout_error("rendezvous key '" + key + "' not set within " + std::to_string(timeout.count()) + "ms");
      return p_->store_[key];
    }

   private:
    PublisherImpl* p_;
  };

  // ------------------------------------------------------- control thread
  void send_locked(const std::string& peer, zmq::message_t frame) { outbox_.emplace_back(peer, std::move(frame)); }

  void flush_outbox() {
    std::deque<std::pair<std::string, zmq::message_t>> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out.swap(outbox_);
    }
    for (auto& [peer, frame] : out) {
      try {
        if (!router_.send(zmq::buffer(peer), zmq::send_flags::sndmore | zmq::send_flags::dontwait) ||
            !router_.send(frame, zmq::send_flags::dontwait))
          PC_DEBUG("publisher: could not send to '" << peer << "' (queue full)");
      } catch (const zmq::error_t& e) {
        PC_DEBUG("publisher: could not send to '" << peer << "': " << e.what());
      }
    }
  }

  void control_loop() {
    auto next_beat = Clock::now();
    for (;;) {
      zmq::pollitem_t items[] = {{router_.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, wake_.fd(), ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(std::max<int64_t>(1, cfg_.control.heartbeat_interval.count() / 4)));
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) PC_ERROR("publisher: poll failed: " << e.what());
      }
      if (items[1].revents & ZMQ_POLLIN) wake_.drain();
      flush_outbox();
      if (flush_on_stop_) return;
      for (int i = 0; i < 1000; ++i) {
        zmq::message_t id, payload;
        if (!router_.recv(id, zmq::recv_flags::dontwait)) break;
        bool more = router_.get(zmq::sockopt::rcvmore);
        if (!more) {
          note_dropped(id.to_string(), "frame without payload");
          continue;
        }
        (void)router_.recv(payload, zmq::recv_flags::none);
        if (router_.get(zmq::sockopt::rcvmore)) {
          zmq::message_t extra;
          while (router_.get(zmq::sockopt::rcvmore)) (void)router_.recv(extra, zmq::recv_flags::none);
          note_dropped(id.to_string(), "message of more than one frame");
          continue;
        }
        handle(id.to_string(), payload);
      }
      const auto now = Clock::now();
      settle_probes(now);
      if (now >= next_beat) {
        next_beat = now + cfg_.control.heartbeat_interval;
        check_liveness(now);
      }
      flush_outbox();
    }
  }

  void inject(const std::string& peer, const void* data, size_t size) {
    zmq::message_t frame(data, size);
    handle(peer, frame);
    std::lock_guard<std::mutex> lock(mu_);
    if (outbox_.size() > 1024) outbox_.clear();
    if (events_.size() > 1024) events_.clear();
  }

  void note_dropped(const std::string& peer, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    ++dropped_frames_;
    PC_WARN("publisher: dropped frame from peer '" << peer << "': " << why);
  }

  void check_liveness(Clock::time_point now) {
    std::shared_ptr<Communicator> to_abort;
    std::string why;
    {
    std::lock_guard<std::mutex> lock(mu_);
    bool changed = false;
    for (auto& [id, m] : members_) {
      if (m.lost) continue;
      if (now - m.last_seen > cfg_.control.heartbeat_timeout) {
        m.lost = true;
        changed = true;
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - m.last_seen).count();
        PC_WARN("publisher: subscriber '" << id << "' lost: silent for " << ms << "ms (heartbeat_timeout "
                                          << cfg_.control.heartbeat_timeout.count() << "ms)");
        events_.push_back({MemberEvent::Kind::kLost, id, "silent for " + std::to_string(ms) + "ms"});
        if (m.rank > 0) {
          needs_reform_ = true;
          to_abort = active_comm_;
          why = "subscriber '" + id + "' lost";
        }
        continue;
      }
      send_locked(id, control::make_message(epoch_, incarnation_, [&](auto b) {
        auto h = b.initHeartbeat();
        h.setWeightVersion(published_version_);
        h.setState(proto::WeightState::CONSISTENT);
      }));
    }
    if (changed) cv_.notify_all();
    }
    if (to_abort) to_abort->abort(why);
  }

  void reject(const std::string& peer, uint64_t target, proto::RejectCode code, const std::string& text,
              uint32_t peer_version = 0) {
    send_locked(peer, control::make_message(epoch_, incarnation_, [&](auto b) {
      auto r = b.initReject();
      r.setCode(code);
      r.setText(text);
      r.setPublisherProtocolVersion(proto::PROTOCOL_VERSION);
      r.setPeerProtocolVersion(peer_version);
      r.setTargetIncarnation(target);
    }));
  }

  void handle(const std::string& peer, const zmq::message_t& payload) {
    control::DecodeLimits limits;
    limits.max_bytes = cfg_.control.max_message_bytes;
    auto decoded = control::decode(payload.data(), payload.size(), limits);
    if (!decoded.ok()) {
      note_dropped(peer, decoded.status().message());
      return;
    }
    try {
      dispatch(peer, decoded.value()->envelope());
    } catch (const kj::Exception& e) {
      note_dropped(peer, std::string("malformed message: ") + e.getDescription().cStr());
    }
    cv_.notify_all();
    std::shared_ptr<Communicator> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c.swap(abort_after_dispatch_);
    }
    if (c) c->abort("subscriber '" + peer + "' left");
  }

  void dispatch(const std::string& peer, proto::Envelope::Reader env) {
    using B = proto::Envelope::Body;
    auto body = env.getBody();
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t inc = env.getIncarnation();
    if (body.which() == B::STATUS_REQUEST) {
      status_reply(peer, body.getStatusRequest().getRequestId());
      return;
    }
    if (body.which() == B::HELLO) {
      hello(peer, inc, body.getHello());
      return;
    }
    auto it = members_.find(peer);
    if (it == members_.end() || it->second.incarnation != inc || it->second.lost) {
      if (body.which() != B::LEAVE)
        reject(peer, inc, proto::RejectCode::NOT_MEMBER,
               it != members_.end() && it->second.lost
                   ? "'" + peer + "' was declared lost and expelled from the group: say Hello again"
                   : "'" + peer + "' is not a member: say Hello first");
      return;
    }
    Member& m = it->second;
    m.last_seen = Clock::now();
    const bool current = env.getEpoch() == epoch_;
    switch (body.which()) {
      case B::HEARTBEAT: {
        auto h = body.getHeartbeat();
        m.weight_version = h.getWeightVersion();
        m.state = h.getState();
        break;
      }
      case B::GROUP_READY:
        if (current) ready_.insert(peer);
        break;
      case B::GROUP_FAILED:
        if (current) group_failed_[peer] = body.getGroupFailed().getReason().cStr();
        break;
      case B::PLAN_ACCEPT:
        if (current && body.getPlanAccept().getVersion() == update_version_) plan_answers_[peer].accepted = true;
        break;
      case B::PLAN_REJECT: {
        auto pr = body.getPlanReject();
        if (!current || pr.getVersion() != update_version_) break;
        PlanAnswer a;
        for (auto mm : pr.getMismatches())
          a.mismatches.push_back(Mismatch{mismatch_kind_from_proto(mm.getKind()), mm.getName().cStr(),
                                          mm.getExpected().cStr(), mm.getGot().cStr()});
        plan_answers_[peer] = std::move(a);
        break;
      }
      case B::APPLIED: {
        auto a = body.getApplied();
        if (!current || a.getVersion() != update_version_) break;
        AppliedAnswer ans;
        ans.ok = a.getOk();
        ans.bytes = a.getBytes();
        if (!ans.ok)
          ans.status = Status(static_cast<Code>(a.getErrorCode()), "subscriber '" + peer + "': " + a.getError().cStr());
        applied_[peer] = ans;
        if (ans.ok) {
          m.weight_version = a.getVersion();
          m.state = proto::WeightState::CONSISTENT;
        } else if (ans.status.code() != Code::kRejected) {  // a rejected plan leaves the tensors as they were
          m.state = proto::WeightState::DIRTY;
        }
        break;
      }
      case B::STORE_SET:
        store_[body.getStoreSet().getKey().cStr()] =
            std::string(reinterpret_cast<const char*>(body.getStoreSet().getValue().begin()),
                        body.getStoreSet().getValue().size());
        answer_parked_gets();
        break;
      case B::STORE_GET:
        parked_.push_back({peer, body.getStoreGet().getRequestId(), body.getStoreGet().getKey().cStr()});
        answer_parked_gets();
        break;
      case B::LEAVE:
        m.lost = true;
        events_.push_back({MemberEvent::Kind::kLeft, peer, body.getLeave().getReason().cStr()});
        PC_INFO("publisher: subscriber '" << peer << "' left: " << body.getLeave().getReason().cStr());
        if (m.rank > 0) {
          needs_reform_ = true;
          // A member that already applied the update in flight forwarded every
          // byte it had to; only an unfinished one breaks the collective.
          const auto a = applied_.find(peer);
          if (a == applied_.end() || !a->second.ok) abort_after_dispatch_ = active_comm_;
        }
        break;
      default:
        PC_WARN("publisher: unexpected " << control::body_name(env) << " from '" << peer << "' ignored");
    }
  }

  void answer_parked_gets() {
    for (auto it = parked_.begin(); it != parked_.end();) {
      auto s = store_.find(it->key);
      if (s == store_.end()) {
        ++it;
        continue;
      }
      send_locked(it->peer, control::make_message(epoch_, incarnation_, [&](auto b) {
        auto v = b.initStoreValue();
        v.setRequestId(it->request_id);
        v.setKey(it->key);
        v.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(s->second.data()), s->second.size()));
      }));
      it = parked_.erase(it);
    }
  }

  void hello(const std::string& peer, uint64_t inc, proto::Hello::Reader h) {
    const std::string id = h.getWorkerId().cStr();
    if (h.getProtocolVersion() != proto::PROTOCOL_VERSION) {
      PC_WARN("publisher: rejected '" << id << "': protocol version " << h.getProtocolVersion() << ", publisher speaks "
                                      << proto::PROTOCOL_VERSION);
      reject(peer, inc, proto::RejectCode::VERSION_MISMATCH,
             "protocol version mismatch: subscriber speaks " + std::to_string(h.getProtocolVersion()) +
                 ", publisher speaks " + std::to_string(proto::PROTOCOL_VERSION),
             h.getProtocolVersion());
      return;
    }
    const bool probe = peer != id;
    if (probe && peer.rfind("probe/" + id + "/", 0) != 0) {
      reject(peer, inc, proto::RejectCode::UNKNOWN_ID,
             "worker id '" + id + "' differs from the connection's routing identity '" + peer + "'");
      return;
    }
    const auto& ids = cfg_.publisher.subscriber_ids;
    if (!ids.empty() && std::find(ids.begin(), ids.end(), id) == ids.end()) {
      PC_WARN("publisher: rejected unknown worker id '" << id << "'");
      reject(peer, inc, proto::RejectCode::UNKNOWN_ID,
             "worker id '" + id + "' is not in publisher.subscribers (" + join_ids(ids) + ")");
      return;
    }
    const auto now = Clock::now();
    auto it = members_.find(id);
    if (probe) {
      // Another process holds this id while a live connection still carries
      // it: that is a duplicate, and the first keeps its place. A restarted
      // process finds the old connection gone (the router cannot route to it).
      if (it != members_.end() && !it->second.lost && it->second.incarnation != inc) {
        // Decide once the member had two heartbeat intervals to show it lives.
        probes_.push_back({peer, id, inc, now, std::string(h.getHost().cStr()) + " pid " + std::to_string(h.getPid())});
        return;
      }
      if (it == members_.end() && ids.empty() && !has_free_slot_locked()) {
        reject(peer, inc, proto::RejectCode::UNKNOWN_ID,
               "the deployment expects " + std::to_string(cfg_.expected_count()) + " subscribers and all are present");
        return;
      }
      welcome(peer, inc, /*probe=*/true);
      return;
    }
    MemberEvent::Kind kind = MemberEvent::Kind::kJoined;
    if (it != members_.end()) {
      Member& m = it->second;
      if (m.incarnation == inc && !m.lost) {  // a repeated Hello: answer it again
        m.last_seen = now;
        welcome(peer, inc);
        return;
      }
      kind = MemberEvent::Kind::kRejoined;
    } else if (ids.empty()) {
      if (!has_free_slot_locked()) {
        reject(peer, inc, proto::RejectCode::UNKNOWN_ID,
               "the deployment expects " + std::to_string(cfg_.expected_count()) + " subscribers and all are present");
        return;
      }
    }
    Member m;
    m.id = id;
    m.incarnation = inc;
    m.host = h.getHost().cStr();
    m.pid = h.getPid();
    m.device = control::get_device(h.getDevice());
    m.last_seen = now;
    m.weight_version = h.getWeightVersion();
    m.state = h.getState();
    const bool was_in_group = it != members_.end() && it->second.rank > 0;
    members_[id] = m;
    if (epoch_ > 0 || was_in_group) needs_reform_ = true;
    events_.push_back({kind, id, std::string(h.getHost().cStr()) + " pid " + std::to_string(h.getPid())});
    PC_INFO("publisher: subscriber '" << id << "' " << member_event_name(kind) << " (" << h.getHost().cStr() << " pid "
                                      << h.getPid() << ", " << m.device.to_string() << ", holds v"
                                      << m.weight_version << " " << control::state_name(m.state) << ")");
    welcome(peer, inc);
  }

  bool has_free_slot_locked() const {
    int live = 0;
    for (auto& [mid, mm] : members_) live += !mm.lost;
    return live < cfg_.expected_count();
  }

  // Probes for an id held by a member: a live member is heard from within two
  // heartbeat intervals, and then the newcomer is a duplicate; a dead one is
  // not, and the newcomer (a restart) may proceed.
  void settle_probes(Clock::time_point now) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto p = probes_.begin(); p != probes_.end();) {
      auto it = members_.find(p->id);
      const bool gone = it == members_.end() || it->second.lost || it->second.incarnation == p->incarnation;
      const bool alive = !gone && it->second.last_seen > p->arrived;
      if (!gone && !alive && now - p->arrived < 2 * cfg_.control.heartbeat_interval) {
        ++p;
        continue;
      }
      if (alive) {
        const Member& m = it->second;
        PC_WARN("publisher: rejected duplicate worker id '" << p->id << "' from " << p->who << " (held by " << m.host
                                                            << " pid " << m.pid << ")");
        reject(p->peer, p->incarnation, proto::RejectCode::DUPLICATE_ID,
               "worker id '" + p->id + "' is already used by a live subscriber (" + m.host + " pid " +
                   std::to_string(m.pid) + ")");
      } else {
        welcome(p->peer, p->incarnation, /*probe=*/true);
      }
      p = probes_.erase(p);
    }
  }

  void welcome(const std::string& peer, uint64_t inc, bool probe = false) {
    send_locked(peer, control::make_message(epoch_, incarnation_, [&](auto b) {
      auto w = b.initWelcome();
      w.setProbe(probe);
      w.setProtocolVersion(proto::PROTOCOL_VERSION);
      w.setHeartbeatIntervalMs(static_cast<uint32_t>(cfg_.control.heartbeat_interval.count()));
      w.setHeartbeatTimeoutMs(static_cast<uint32_t>(cfg_.control.heartbeat_timeout.count()));
      w.setPublisherIncarnation(incarnation_);
    }));
  }

  void status_reply(const std::string& peer, uint64_t request_id) {
    const auto now = Clock::now();
    send_locked(peer, control::make_message(epoch_, incarnation_, [&](auto b) {
      auto s = b.initStatusReply();
      s.setRequestId(request_id);
      s.setEpoch(epoch_);
      s.setPublishedVersion(published_version_);
      s.setExpected(static_cast<uint32_t>(cfg_.expected_count()));
      s.setBackend(cfg_.data_plane.backend == Backend::kNccl ? proto::Backend::NCCL : proto::Backend::GLOO);
      auto list = s.initMembers(static_cast<unsigned>(members_.size()));
      unsigned i = 0;
      for (auto& [id, m] : members_) {
        auto e = list[i++];
        e.setWorkerId(id);
        e.setRank(m.lost ? -1 : m.rank);
        e.setWeightVersion(m.weight_version);
        e.setState(m.state);
        e.setLastHeartbeatAgeMs(
            static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now - m.last_seen).count()));
        e.setHost(m.host);
        e.setPid(m.pid);
        control::set_device(e.initDevice(), m.device);
        e.setLost(m.lost);
      }
    }));
  }

  Config cfg_;
  zmq::context_t ctx_;
  zmq::socket_t router_;
  std::string endpoint_;
  control::Wakeup wake_;
  const uint64_t incarnation_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> flush_on_stop_{false};

  mutable std::mutex mu_;  // guards everything below, shared with the control thread
  std::condition_variable cv_;
  std::map<std::string, Member> members_;
  std::deque<std::pair<std::string, zmq::message_t>> outbox_;
  std::deque<MemberEvent> events_;
  std::map<std::string, std::string> store_;
  std::vector<ParkedGet> parked_;
  std::vector<PendingProbe> probes_;
  uint64_t epoch_ = 0;
  std::vector<std::string> group_;
  bool needs_reform_ = true;
  std::set<std::string> ready_;
  std::map<std::string, std::string> group_failed_;
  std::map<std::string, PlanAnswer> plan_answers_;
  // The manifest every member of `epoch` accepted in the last successful update.
  struct ValidatedManifest {
    uint64_t epoch;
    uint64_t hash;
    Checksum checksum;
  };
  std::optional<ValidatedManifest> validated_manifest_;
  std::map<std::string, AppliedAnswer> applied_;
  uint64_t update_version_ = 0;
  uint64_t published_version_ = 0;
  uint64_t dropped_frames_ = 0;
  std::shared_ptr<Communicator> active_comm_;  // the communicator of the update in flight
  std::shared_ptr<Communicator> abort_after_dispatch_;

  // Owned by the updating thread (update_mu_).
  std::mutex update_mu_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<DeviceMemory> mem_;
  StagingPair staging_;
  uint64_t last_version_ = 0;
  std::vector<TensorView> tensors_;  // the update in progress
  std::function<void(uint64_t, uint64_t, uint64_t)> progress_;

 public:
  int64_t fault_stall_after_bucket_ = -1;
  uint64_t fault_stall_version_ = 0;  // 0: any version

  friend class Publisher;
};

Publisher::Publisher(std::unique_ptr<PublisherImpl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() { impl_->shutdown(); }

StatusOr<std::unique_ptr<Publisher>> Publisher::create(const Config& config) {
  if (std::string why = backend_unavailable_reason(config.data_plane.backend); !why.empty())
    return unavailable(std::string("data_plane.backend ") + backend_name(config.data_plane.backend) +
                       " cannot run here: " + why);
  auto impl = std::make_unique<PublisherImpl>(config);
  if (const char* f = std::getenv("PARAMCAST_FAULT_STALL_AFTER_BUCKET")) {
    // "K" (bucket K of every update) or "V:K" (bucket K of version V).
    const char* colon = std::strchr(f, ':');
    impl->fault_stall_version_ = colon ? std::strtoull(f, nullptr, 10) : 0;
    impl->fault_stall_after_bucket_ = std::atoll(colon ? colon + 1 : f);
  }
  PC_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

std::string Publisher::endpoint() const { return impl_->endpoint(); }
Status Publisher::start() { return impl_->start(); }

UpdateResult Publisher::weight_update(const std::vector<TensorView>& tensors, std::optional<uint64_t> version) {
  return impl_->weight_update(tensors, version);
}

std::future<UpdateResult> Publisher::weight_update_async(std::vector<TensorView> tensors,
                                                         std::optional<uint64_t> version) {
  return std::async(std::launch::async, [this, t = std::move(tensors), version] { return weight_update(t, version); });
}

std::optional<MemberEvent> Publisher::poll_event() { return impl_->poll_event(); }
void Publisher::on_progress(std::function<void(uint64_t, uint64_t, uint64_t)> callback) {
  std::lock_guard<std::mutex> lock(impl_->update_mu_);
  impl_->progress_ = std::move(callback);
}
PublisherStats Publisher::stats() const { return impl_->stats(); }
void Publisher::shutdown() { impl_->shutdown(); }
void Publisher::inject_control_frame(const std::string& peer, const void* data, size_t size) {
  impl_->inject(peer, data, size);
}

}  // namespace paramcast
