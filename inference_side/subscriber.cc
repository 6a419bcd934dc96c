#include "inference_side/subscriber.h"

#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common/control/messages.h"
#include "common/control/wakeup.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/log.h"
#include "common/plan.h"
#include "common/xxhash.h"

namespace paramcast {

const char* weight_state_name(WeightStateKind k) {
  switch (k) {
    case WeightStateKind::kEmpty: return "empty";
    case WeightStateKind::kConsistent: return "consistent";
    case WeightStateKind::kDirty: return "dirty";
  }
  return "?";
}

std::string WeightState::to_string() const {
  switch (kind) {
    case WeightStateKind::kEmpty: return "empty (no update applied)";
    case WeightStateKind::kConsistent: return "version " + std::to_string(version) + ", consistent";
    case WeightStateKind::kDirty:
      return "dirty (v" + std::to_string(dirty_version) + " incomplete, last consistent v" + std::to_string(version) + ")";
  }
  return "?";
}

namespace {
proto::WeightState to_proto(WeightStateKind k) {
  switch (k) {
    case WeightStateKind::kEmpty: return proto::WeightState::EMPTY;
    case WeightStateKind::kConsistent: return proto::WeightState::CONSISTENT;
    case WeightStateKind::kDirty: return proto::WeightState::DIRTY;
  }
  return proto::WeightState::EMPTY;
}

struct Job {
  enum class Kind { kJoin, kReceive } kind;
  uint64_t epoch = 0;
  GroupOptions group;
  std::shared_ptr<UpdatePlan> plan;
  // Non-empty: a precommitted plan this subscriber cannot take. Its buckets
  // are received and dropped so that the collective completes; no tensor is
  // touched and the update is reported rejected with this text.
  std::string discard;
};
}  // namespace

class SubscriberImpl {
 public:
  SubscriberImpl(const Config& cfg, std::string id)
      : cfg_(cfg), id_(std::move(id)), device_(cfg.device_for_worker(id_)), incarnation_(control::new_incarnation()) {}
  ~SubscriberImpl() { stop(); }

  Status register_tensor(const TensorView& d) {
    auto n = d.spec.nbytes();
    if (!n.ok()) return n.status();
    if (*n > 0 && !d.data) return invalid_argument("destination '" + d.spec.name + "' has no data pointer");
    if (d.device != device_)
      return invalid_argument("destination '" + d.spec.name + "' is on " + d.device.to_string() + " but worker '" +
                              id_ + "' receives on " + device_.to_string());
    std::lock_guard<std::mutex> lock(reg_mu_);
    registry_[d.spec.name] = d;
    return Status();
  }

  Status start() {
    auto mem = create_device_memory(device_);
    if (!mem.ok()) return mem.status();
    mem_ = std::move(mem.value());
    control_thread_ = std::thread([this] { control_loop(); });
    data_thread_ = std::thread([this] { data_loop(); });
    return Status();
  }

  void stop() {
    if (stopping_.exchange(true)) return;
    abort_comm("subscriber stopping");
    // Take each lock once so that a thread between its predicate check and
    // its wait cannot miss the notification.
    { std::lock_guard<std::mutex> lock(jobs_mu_); }
    jobs_cv_.notify_all();
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
    wake_.notify();
    if (control_thread_.joinable()) control_thread_.join();
    if (data_thread_.joinable()) data_thread_.join();
  }

  WeightState state() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
  }
  bool joined() const {
    std::lock_guard<std::mutex> lock(mu_);
    return member_;
  }
  uint64_t staging_peak() const { return mem_ ? mem_->peak() : 0; }
  Status fatal() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fatal_;
  }

  std::optional<UpdateReport> next_report(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !reports_.empty() || !fatal_.ok(); })) return std::nullopt;
    if (reports_.empty()) return UpdateReport{0, fatal_, 0, 0};
    UpdateReport r = reports_.front();
    reports_.pop_front();
    return r;
  }

  void inject(const void* data, size_t size) {
    zmq::message_t frame(data, size);
    handle(frame);
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.clear();
    reports_.clear();
    std::lock_guard<std::mutex> jlock(jobs_mu_);
    jobs_.clear();
  }

  TensorCallback callback_;
  UpdateBeginHook begin_hook_;
  UpdateEndHook end_hook_;

 private:
  // ------------------------------------------------------- control thread
  // Joining takes two Hellos: one from a throw-away probe identity, which the
  // publisher can always answer (duplicate id, unknown id, version mismatch),
  // then one from the worker-id connection that carries the membership.
  enum class Phase { kProbing, kJoining, kMember };

  std::unique_ptr<zmq::socket_t> make_socket(const std::string& identity) {
    auto s = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
    s->set(zmq::sockopt::routing_id, identity);
    s->set(zmq::sockopt::linger, 0);
    s->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(cfg_.control.max_message_bytes + 1024));
    s->set(zmq::sockopt::reconnect_ivl, 100);
    s->set(zmq::sockopt::reconnect_ivl_max, static_cast<int>(cfg_.control.reconnect_backoff_max.count()));
    s->connect(cfg_.control.endpoint);
    return s;
  }

  void send_on(zmq::socket_t& socket, zmq::message_t frame) {
    try {
      if (!socket.send(frame, zmq::send_flags::dontwait)) PC_DEBUG(id_ << ": control send queue full");
    } catch (const zmq::error_t& e) {
      PC_DEBUG(id_ << ": control send failed: " << e.what());
    }
  }
  void send(zmq::message_t frame) {
    if (dealer_) send_on(*dealer_, std::move(frame));  // before the first probe answer there is nothing to say
  }

  void flush_outbox() {
    std::deque<zmq::message_t> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out.swap(outbox_);
    }
    for (auto& f : out) send(std::move(f));
  }

  zmq::message_t hello_message() {
    WeightState st = state();
    return control::make_message(0, incarnation_, [&](auto b) {
      auto h = b.initHello();
      h.setProtocolVersion(protocol_version_override_ ? protocol_version_override_ : proto::PROTOCOL_VERSION);
      h.setWorkerId(id_);
      h.setEngineId(id_);
      char host[256] = {0};
      gethostname(host, sizeof host - 1);
      h.setHost(host);
      h.setPid(static_cast<uint32_t>(getpid()));
      control::set_device(h.initDevice(), device_);
      auto caps = h.initCapabilities(callback_ ? 2 : 1);
      caps.set(0, "xxh64");
      if (callback_) caps.set(1, "callback");
      h.setWeightVersion(st.version);
      h.setState(to_proto(st.kind));
    });
  }

  void control_loop() {
    char nonce[24];
    std::snprintf(nonce, sizeof nonce, "%016llx", static_cast<unsigned long long>(incarnation_));
    const std::string probe_identity = "probe/" + id_ + "/" + nonce;
    // The worker-id connection opens only once a probe was answered, so a
    // duplicate never connects under an id that a live member holds.
    probe_ = make_socket(probe_identity);
    phase_ = Phase::kProbing;
    auto backoff = std::chrono::milliseconds(100);
    auto next_hello = Clock::now();
    auto next_beat = Clock::now();
    auto last_heard = Clock::now();
    while (!stopping_) {
      std::vector<zmq::pollitem_t> items = {{nullptr, wake_.fd(), ZMQ_POLLIN, 0}};
      if (dealer_) items.push_back({dealer_->handle(), 0, ZMQ_POLLIN, 0});
      if (probe_) items.push_back({probe_->handle(), 0, ZMQ_POLLIN, 0});
      try {
        zmq::poll(items.data(), items.size(),
                  std::chrono::milliseconds(std::max<int64_t>(1, cfg_.control.heartbeat_interval.count() / 4)));
      } catch (const zmq::error_t&) {
      }
      if (items[0].revents & ZMQ_POLLIN) wake_.drain();
      flush_outbox();
      for (zmq::socket_t* socket : {probe_.get(), dealer_.get()}) {
        for (int i = 0; socket && i < 1000; ++i) {
          zmq::message_t msg;
          if (!socket->recv(msg, zmq::recv_flags::dontwait)) break;
          last_heard = Clock::now();
          handle(msg);
          if (socket == probe_.get() && phase_ != Phase::kProbing) break;  // probe answered
        }
        if (probe_ && phase_ != Phase::kProbing) {
          probe_.reset();
          if (!dealer_) dealer_ = make_socket(id_);
          next_hello = Clock::now();
          break;
        }
      }
      flush_outbox();  // answers (PlanAccept, StoreSet, ...) leave now, not after the next poll
      const auto now = Clock::now();
      if (!fatal().ok()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;  // rejected for good: the process reports it and decides
      }
      if (phase_ != Phase::kMember && now >= next_hello) {
        if (phase_ == Phase::kProbing && !probe_) probe_ = make_socket(probe_identity);
        send_on(phase_ == Phase::kProbing ? *probe_ : *dealer_, hello_message());
        next_hello = now + backoff;
        backoff = std::min(backoff * 2, cfg_.control.reconnect_backoff_max);
      }
      if (phase_ == Phase::kMember && now >= next_beat) {
        next_beat = now + cfg_.control.heartbeat_interval;
        WeightState st = state();
        send(control::make_message(epoch_, incarnation_, [&](auto b) {
          auto h = b.initHeartbeat();
          h.setWeightVersion(st.version);
          h.setState(to_proto(st.kind));
          h.setDirtyVersion(st.dirty_version);
        }));
      }
      if (phase_ == Phase::kMember && now - last_heard > cfg_.control.heartbeat_timeout) {
        PC_WARN(id_ << ": publisher lost (silent for "
                    << std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard).count()
                    << "ms); keeping weights (" << state().to_string() << ") and reconnecting");
        lose_membership("publisher lost");
      }
      if (phase_ == Phase::kProbing && rejoin_requested_) {
        rejoin_requested_ = false;
        // The worker-id connection stays; ZeroMQ reconnects it on its own.
        probe_ = make_socket(probe_identity);
        backoff = std::chrono::milliseconds(100);
        next_hello = now;
      }
    }
    if (phase_ == Phase::kMember)
      send(control::make_message(epoch_, incarnation_, [](auto b) { b.initLeave().setReason("subscriber stopping"); }));
    probe_.reset();
    dealer_.reset();
  }

  void lose_membership(const std::string& why) {
    phase_ = Phase::kProbing;
    rejoin_requested_ = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      member_ = false;
      store_failed_ = true;
      cv_.notify_all();
    }
    abort_comm(why);
  }

  // Aborts the current communicator without holding mu_ (Gloo's close may wait
  // for its I/O thread, and the control thread must keep heartbeating).
  void abort_comm(const std::string& why, uint64_t only_version = 0) {
    std::shared_ptr<Communicator> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (only_version && receiving_version_ != only_version) return;
      c = comm_;
    }
    if (c) c->abort(why);
  }

  void handle(const zmq::message_t& msg) {
    control::DecodeLimits limits;
    limits.max_bytes = cfg_.control.max_message_bytes;
    auto decoded = control::decode(msg.data(), msg.size(), limits);
    if (!decoded.ok()) {
      PC_WARN(id_ << ": dropped frame from the publisher: " << decoded.status().message());
      return;
    }
    try {
      dispatch(decoded.value()->envelope());
    } catch (const kj::Exception& e) {
      PC_WARN(id_ << ": dropped malformed message from the publisher: " << e.getDescription().cStr());
    }
  }

  void dispatch(proto::Envelope::Reader env) {
    using B = proto::Envelope::Body;
    auto body = env.getBody();
    switch (body.which()) {
      case B::WELCOME: {
        if (body.getWelcome().getProbe()) {
          if (phase_ == Phase::kProbing) phase_ = Phase::kJoining;
          return;
        }
        phase_ = Phase::kMember;
        std::lock_guard<std::mutex> lock(mu_);
        if (!member_) PC_INFO(id_ << ": joined publisher at " << cfg_.control.endpoint << " holding " << state_.to_string());
        member_ = true;
        store_failed_ = false;
        cv_.notify_all();
        return;
      }
      case B::REJECT: {
        auto r = body.getReject();
        if (r.getTargetIncarnation() != 0 && r.getTargetIncarnation() != incarnation_) return;
        if (r.getCode() == proto::RejectCode::NOT_MEMBER || r.getCode() == proto::RejectCode::STALE_EPOCH) {
          if (phase_ != Phase::kMember) return;  // already joining again
          PC_WARN(id_ << ": publisher says: " << r.getText().cStr() << "; rejoining");
          lose_membership("expelled by the publisher");
          return;
        }
        std::lock_guard<std::mutex> lock(mu_);
        fatal_ = rejected(std::string("publisher rejected worker '") + id_ + "': " + r.getText().cStr());
        PC_ERROR(id_ << ": " << fatal_.message());
        cv_.notify_all();
        return;
      }
      case B::LEAVE:
        PC_INFO(id_ << ": publisher left (" << body.getLeave().getReason().cStr() << "); will rejoin when one is back");
        lose_membership("publisher left");
        return;
      case B::HEARTBEAT:
        return;
      case B::STATUS_REPLY:
        return;
      default:
        break;
    }
    if (!joined()) return;
    switch (body.which()) {
      case B::JOIN_GROUP: {
        auto j = body.getJoinGroup();
        Job job;
        job.kind = Job::Kind::kJoin;
        job.epoch = env.getEpoch();
        job.group.epoch = env.getEpoch();
        job.group.rank = static_cast<int>(j.getRank());
        job.group.world_size = static_cast<int>(j.getWorldSize());
        job.group.backend = j.getBackend() == proto::Backend::NCCL ? Backend::kNccl : Backend::kGloo;
        job.group.bootstrap.assign(reinterpret_cast<const char*>(j.getBootstrap().begin()), j.getBootstrap().size());
        job.group.device = device_;
        job.group.init_timeout = std::chrono::milliseconds(j.getInitTimeoutMs());
        job.group.op_timeout = std::chrono::milliseconds(j.getOpTimeoutMs());
        job.group.gloo_hostname = cfg_.data_plane.gloo_hostname;
        job.group.gloo_interface = cfg_.data_plane.gloo_interface;
        abort_comm("superseded by epoch " + std::to_string(env.getEpoch()));
        {
          std::lock_guard<std::mutex> lock(mu_);
          epoch_ = env.getEpoch();
          checksums_.clear();
        }
        push_job(std::move(job));
        return;
      }
      case B::PLAN: {
        if (env.getEpoch() != epoch_) return;
        auto plan = plan_from_proto(body.getPlan());
        std::vector<Mismatch> mismatches;
        uint64_t version = body.getPlan().getVersion();
        const bool precommitted = body.getPlan().getPrecommitted();
        if (!plan.ok()) mismatches.push_back({Mismatch::Kind::kOther, "<plan>", "a well-formed plan", plan.status().message()});
        else mismatches = validate(*plan);
        if (precommitted) {
          if (plan.ok()) {
            // The buckets are already on their way: receive now, into the
            // tensors if the plan fits, else into staging only to drop them.
            Job job;
            job.kind = Job::Kind::kReceive;
            job.epoch = epoch_;
            job.plan = std::make_shared<UpdatePlan>(std::move(plan.value()));
            if (!mismatches.empty()) {
              job.discard = std::to_string(mismatches.size()) + " mismatches, first: " + mismatches[0].to_string();
              PC_WARN(id_ << ": rejected precommitted plan v" << version << " (" << job.discard
                          << "); its buckets will be received and dropped");
            }
            push_job(std::move(job));
          } else {
            // Without a readable plan the bucket sizes are unknown and the
            // collective cannot be followed: it is failed for everyone.
            abort_comm("precommitted plan v" + std::to_string(version) + " is unreadable: " + plan.status().message());
          }
          if (mismatches.empty()) return;  // accepted: no answer until Applied
        }
        if (mismatches.empty()) {
          pending_plan_ = std::make_shared<UpdatePlan>(std::move(plan.value()));
          queue(control::make_message(epoch_, incarnation_, [&](auto b) {
            auto a = b.initPlanAccept();
            a.setVersion(version);
            a.setManifestHash(manifest_hash(pending_plan_->tensors));
          }));
        } else {
          PC_WARN(id_ << ": rejected plan v" << version << " (" << mismatches.size() << " mismatches, first: "
                      << mismatches[0].to_string() << ")");
          queue(control::make_message(epoch_, incarnation_, [&](auto b) {
            auto r = b.initPlanReject();
            r.setVersion(version);
            auto list = r.initMismatches(static_cast<unsigned>(mismatches.size()));
            for (size_t i = 0; i < mismatches.size(); ++i) {
              auto m = list[static_cast<unsigned>(i)];
              m.setKind(mismatch_kind_to_proto(mismatches[i].kind));
              m.setName(mismatches[i].name);
              m.setExpected(mismatches[i].expected);
              m.setGot(mismatches[i].got);
            }
          }));
        }
        return;
      }
      case B::COMMIT: {
        if (env.getEpoch() != epoch_ || !pending_plan_ || pending_plan_->version != body.getCommit().getVersion())
          return;
        Job job;
        job.kind = Job::Kind::kReceive;
        job.epoch = epoch_;
        job.plan = std::move(pending_plan_);
        push_job(std::move(job));
        return;
      }
      case B::BUCKET_CHECKSUMS: {
        auto c = body.getBucketChecksums();
        std::lock_guard<std::mutex> lock(mu_);
        uint32_t k = c.getFirst();
        for (uint64_t v : c.getValues()) checksums_[{c.getVersion(), k++}] = v;
        cv_.notify_all();
        return;
      }
      case B::ABANDON: {
        auto a = body.getAbandon();
        if (pending_plan_ && pending_plan_->version == a.getVersion()) pending_plan_.reset();
        abort_comm(std::string("publisher abandoned the update: ") + a.getReason().cStr(), a.getVersion());
        return;
      }
      case B::STORE_VALUE: {
        auto v = body.getStoreValue();
        std::lock_guard<std::mutex> lock(mu_);
        store_values_[v.getRequestId()] =
            std::string(reinterpret_cast<const char*>(v.getValue().begin()), v.getValue().size());
        cv_.notify_all();
        return;
      }
      default:
        PC_WARN(id_ << ": unexpected " << control::body_name(env) << " from the publisher ignored");
    }
  }

  std::vector<Mismatch> validate(const UpdatePlan& plan) {
    std::vector<Mismatch> out;
    std::lock_guard<std::mutex> lock(reg_mu_);
    std::unordered_map<std::string, bool> seen;
    for (const auto& t : plan.tensors) {
      auto it = registry_.find(t.name);
      if (it == registry_.end()) {
        if (!callback_) out.push_back({Mismatch::Kind::kUnexpectedName, t.name, "no such tensor", "a tensor of shape " + t.shape_string()});
        continue;
      }
      seen[t.name] = true;
      const auto& reg = it->second.spec;
      if (reg.dtype != t.dtype)
        out.push_back({Mismatch::Kind::kDType, t.name, std::string(dtype_name(reg.dtype)), std::string(dtype_name(t.dtype))});
      if (reg.shape != t.shape) out.push_back({Mismatch::Kind::kShape, t.name, reg.shape_string(), t.shape_string()});
    }
    for (const auto& [name, view] : registry_)
      if (!seen.count(name)) out.push_back({Mismatch::Kind::kMissingName, name, "a tensor of shape " + view.spec.shape_string(), "absent"});
    return out;
  }

  void queue(zmq::message_t m) {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.push_back(std::move(m));
  }
  void queue_and_wake(zmq::message_t m) {
    queue(std::move(m));
    wake_.notify();
  }

  void push_job(Job job) {
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      jobs_.push_back(std::move(job));
    }
    jobs_cv_.notify_all();
  }

  // ---------------------------------------------------------- data thread
  class RemoteStore : public Store {
   public:
    explicit RemoteStore(SubscriberImpl* s) : s_(s) {}
    Status set(const std::string& key, const std::string& value) override {
      s_->queue_and_wake(control::make_message(s_->epoch_, s_->incarnation_, [&](auto b) {
        auto m = b.initStoreSet();
        m.setKey(key);
        m.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(value.data()), value.size()));
      }));
      return Status();
    }
    StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
      uint64_t id;
      {
        std::lock_guard<std::mutex> lock(s_->mu_);
        id = ++s_->next_request_;
      }
      s_->queue_and_wake(control::make_message(s_->epoch_, s_->incarnation_, [&](auto b) {
        auto m = b.initStoreGet();
        m.setRequestId(id);
        m.setKey(key);
      }));
      std::unique_lock<std::mutex> lock(s_->mu_);
      if (!s_->cv_.wait_for(lock, timeout, [&] { return s_->store_values_.count(id) || s_->store_failed_ || s_->stopping_; }))
        return timeout_error("rendezvous key '" + key + "' not available within " + std::to_string(timeout.count()) + "ms");
      if (!s_->store_values_.count(id)) return peer_lost("publisher lost while waiting for rendezvous key '" + key + "'");
      std::string v = std::move(s_->store_values_[id]);
      s_->store_values_.erase(id);
      return v;
    }

   private:
    SubscriberImpl* s_;
  };

  void data_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(jobs_mu_);
        jobs_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) break;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      if (job.kind == Job::Kind::kJoin) join(job);
      else receive(job);
    }
    std::shared_ptr<Communicator> last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last.swap(comm_);
    }
  }

  void join(const Job& job) {
    std::shared_ptr<Communicator> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      old.swap(comm_);
    }
    old.reset();  // joins its I/O thread outside mu_
    RemoteStore store(this);
    auto comm = create_communicator(job.group, store);
    std::lock_guard<std::mutex> lock(mu_);
    if (job.epoch != epoch_) return;  // superseded while forming
    if (!comm.ok()) {
      PC_WARN(id_ << ": group epoch " << job.epoch << " failed: " << comm.status().message());
      outbox_.push_back(control::make_message(job.epoch, incarnation_, [&](auto b) {
        auto f = b.initGroupFailed();
        f.setRank(static_cast<uint32_t>(job.group.rank));
        f.setReason(comm.status().to_string());
      }));
    } else {
      comm_ = std::move(comm.value());
      PC_INFO(id_ << ": rank " << job.group.rank << " of " << job.group.world_size << " in group epoch " << job.epoch);
      outbox_.push_back(control::make_message(job.epoch, incarnation_, [&](auto b) {
        b.initGroupReady().setRank(static_cast<uint32_t>(job.group.rank));
      }));
    }
    wake_.notify();
  }

  // Where bucket k lands: a registered destination (direct), a staging slot, or a
  // per-tensor assembly buffer (a chunk of a large tensor that has no destination).
  void receive(const Job& job) {
    const UpdatePlan& plan = *job.plan;
    const auto t0 = Clock::now();
    std::shared_ptr<Communicator> comm;
    {
      std::lock_guard<std::mutex> lock(mu_);
      comm = comm_;
      receiving_version_ = plan.version;
      if (job.discard.empty()) {
        state_.kind = WeightStateKind::kDirty;
        state_.dirty_version = plan.version;
      }
    }
    if (begin_hook_ && job.discard.empty()) begin_hook_(plan.version);
    Status s;
    bool collective_done = false;  // the communicator is still in step with the group
    if (!comm) {
      s = aborted("no communicator for epoch " + std::to_string(job.epoch));
    } else if (!job.discard.empty()) {
      s = drop_buckets(plan, comm.get());
      collective_done = s.ok();
      if (s.ok())
        s = rejected("precommitted plan v" + std::to_string(plan.version) + " does not fit this worker (" +
                     job.discard + "); its buckets were received and dropped, no tensor was written");
    } else {
      s = receive_buckets(plan, comm.get());
      collective_done = s.ok();
    }
    uint64_t combined = 0;
    if (s.ok()) {
      Xxh64 h;
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < plan.buckets.size(); ++k) {
        auto it = checksums_.find({plan.version, static_cast<uint32_t>(k)});
        uint64_t v = it == checksums_.end() ? 0 : it->second;
        h.update(&v, sizeof v);
      }
      combined = plan.checksum == Checksum::kXxh64 ? h.digest() : 0;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      receiving_version_ = 0;
      for (auto it = checksums_.begin(); it != checksums_.end();)
        it = it->first.first <= plan.version ? checksums_.erase(it) : std::next(it);
      if (s.ok()) {
        state_.kind = WeightStateKind::kConsistent;
        state_.version = plan.version;
        state_.dirty_version = 0;
      }
      outbox_.push_back(control::make_message(job.epoch, incarnation_, [&](auto b) {
        auto a = b.initApplied();
        a.setVersion(plan.version);
        a.setOk(s.ok());
        a.setBytes(s.ok() ? plan.total_bytes : 0);
        a.setChecksum(combined);
        if (!s.ok()) {
          a.setError(s.message());
          a.setErrorCode(static_cast<uint32_t>(s.code()));
        }
      }));
      reports_.push_back(UpdateReport{plan.version, s, s.ok() ? plan.total_bytes : 0, secs});
      cv_.notify_all();
    }
    wake_.notify();
    // A failed update leaves the collective half-done: this communicator is finished.
    if (!collective_done && comm) comm->abort("update v" + std::to_string(plan.version) + " failed");
    if (s.ok()) PC_DEBUG(id_ << ": applied v" << plan.version << " (" << plan.total_bytes << " bytes)");
    else PC_WARN(id_ << ": update v" << plan.version << " failed, state " << state().to_string() << ": " << s.message());
    if (end_hook_ && job.discard.empty()) end_hook_(plan.version, s);
  }

  // Follows the collective of a plan this worker rejected: every bucket lands
  // in staging and is dropped.
  Status drop_buckets(const UpdatePlan& plan, Communicator* comm) {
    uint64_t largest = 0;
    for (const auto& b : plan.buckets) largest = std::max(largest, b.bytes);
    PC_RETURN_IF_ERROR(staging_.reserve(mem_.get(), largest));
    for (size_t k = 0; k < plan.buckets.size(); ++k)
      PC_RETURN_IF_ERROR(comm->broadcast(staging_.slot(k), plan.buckets[k].bytes, 0)
                             ->wait(Clock::now() + cfg_.data_plane.timeout)
                             .with_context("dropped bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
    return Status();
  }

  Status receive_buckets(const UpdatePlan& plan, Communicator* comm) {
    const size_t n = plan.buckets.size();
    std::unordered_map<uint32_t, TensorView> dest;
    {
      std::lock_guard<std::mutex> lock(reg_mu_);
      for (uint32_t i = 0; i < plan.tensors.size(); ++i) {
        auto it = registry_.find(plan.tensors[i].name);
        if (it != registry_.end()) dest[i] = it->second;
      }
    }
    auto registered = [&](uint32_t t) -> void* {
      auto d = dest.find(t);
      return d == dest.end() ? nullptr : d->second.data;
    };
    std::vector<uint8_t*> in_place_at(n, nullptr);
    uint64_t staging_bytes = 0;
    for (size_t k = 0; k < n; ++k) {
      const auto& b = plan.buckets[k];
      if (!b.direct) in_place_at[k] = plan.in_place_base(k, registered);
      const bool staged = b.direct ? !dest.count(b.pieces[0].tensor) && b.bytes == plan.nbytes[b.pieces[0].tensor]
                                   : in_place_at[k] == nullptr;
      if (staged) staging_bytes = std::max(staging_bytes, b.bytes);
    }
    PC_RETURN_IF_ERROR(staging_.reserve(mem_.get(), staging_bytes));
    std::map<uint32_t, StagingBuffer> assembly;  // large callback tensors, by tensor index
    std::vector<std::shared_ptr<Work>> works(n);
    std::vector<uint8_t*> where(n);
    std::vector<bool> in_place(n, false);
    auto issue = [&](size_t k) -> Status {
      const auto& b = plan.buckets[k];
      const auto& p0 = b.pieces[0];
      if (b.direct && dest.count(p0.tensor)) {
        where[k] = static_cast<uint8_t*>(dest[p0.tensor].data) + p0.tensor_offset;
      } else if (b.direct && b.bytes != plan.nbytes[p0.tensor]) {
        auto& buf = assembly[p0.tensor];
        if (!buf.data()) {
          auto p = mem_->allocate(plan.nbytes[p0.tensor]);
          if (!p.ok()) return p.status();
          buf = StagingBuffer(mem_.get(), *p, plan.nbytes[p0.tensor]);
        }
        where[k] = buf.data() + p0.tensor_offset;
      } else if (uint8_t* base = in_place_at[k]) {
        where[k] = base;  // the engine's destinations lie in bucket layout: no staging, no unpack
        in_place[k] = true;
      } else {
        where[k] = staging_.slot(k);
      }
      works[k] = comm->broadcast(where[k], b.bytes, 0);
      return Status();
    };
    auto finish = [&](size_t k) -> Status {
      const auto& b = plan.buckets[k];
      PC_RETURN_IF_ERROR(works[k]->wait(Clock::now() + cfg_.data_plane.timeout)
                             .with_context("bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
      if (fault_corrupt_bucket_ == static_cast<int64_t>(k) && b.bytes > 0) {
        // Test hook (PARAMCAST_FAULT_CORRUPT_BUCKET): flip one received bit, once.
        fault_corrupt_bucket_ = -1;
        uint8_t byte;
        PC_RETURN_IF_ERROR(mem_->copy(&byte, where[k], 1));
        byte ^= 0x01;
        PC_RETURN_IF_ERROR(mem_->copy(where[k], &byte, 1));
      }
      if (plan.checksum == Checksum::kXxh64) {
        auto got = mem_->checksum(where[k], b.bytes);
        if (!got.ok()) return got.status();
        uint64_t expected;
        {
          std::unique_lock<std::mutex> lock(mu_);
          const auto key = std::make_pair(plan.version, static_cast<uint32_t>(k));
          if (!cv_.wait_for(lock, cfg_.data_plane.timeout,
                            [&] { return checksums_.count(key) || stopping_ || !member_; }))
            return timeout_error("checksum of bucket " + std::to_string(k) + " never arrived");
          if (!checksums_.count(key))
            return stopping_ ? aborted("subscriber stopping")
                             : peer_lost("publisher lost before the checksum of bucket " + std::to_string(k) + " arrived");
          expected = checksums_[key];
        }
        if (*got != expected) {
          char buf[64];
          std::snprintf(buf, sizeof buf, "expected %016llx, got %016llx", static_cast<unsigned long long>(expected),
                        static_cast<unsigned long long>(*got));
          return data_corrupt("checksum mismatch in bucket " + std::to_string(k) + " of v" +
                              std::to_string(plan.version) + " (tensors " + plan.bucket_tensor_names(k) + "): " + buf +
                              (in_place[k] || (b.direct && dest.count(b.pieces[0].tensor))
                                   ? "; the destinations hold the bad bytes"
                                   : "; nothing was unpacked"));
        }
      }
      std::vector<DeviceMemory::CopyOp> unpack;
      for (const auto& p : b.pieces) {
        auto d = dest.find(p.tensor);
        if (d != dest.end() && !b.direct && !in_place[k])
          unpack.push_back({static_cast<uint8_t*>(d->second.data) + p.tensor_offset, where[k] + p.bucket_offset, p.length});
      }
      PC_RETURN_IF_ERROR(mem_->copy_many(unpack));
      for (const auto& p : b.pieces) {
        const auto& spec = plan.tensors[p.tensor];
        if (dest.count(p.tensor)) continue;
        if (p.tensor_offset + p.length != plan.nbytes[p.tensor]) continue;  // tensor not complete yet
        TensorView view;
        view.spec = spec;
        view.device = device_;
        auto a = assembly.find(p.tensor);
        view.data = a != assembly.end() ? a->second.data() : where[k] + p.bucket_offset;
        if (callback_) {
          Status cs = callback_(view);
          if (!cs.ok()) return cs.with_context("tensor callback for '" + spec.name + "'");
        }
        if (a != assembly.end()) assembly.erase(a);
      }
      return Status();
    };
    if (n > 0) PC_RETURN_IF_ERROR(issue(0));
    for (size_t k = 0; k < n; ++k) {
      if (k + 1 < n) PC_RETURN_IF_ERROR(issue(k + 1));
      PC_RETURN_IF_ERROR(finish(k));
      if (fault_stall_after_bucket_ == static_cast<int64_t>(k) &&
          (fault_stall_version_ == 0 || fault_stall_version_ == plan.version)) {
        // Test hook (PARAMCAST_FAULT_STALL_AFTER_BUCKET): a wedged engine.
        PC_WARN(id_ << ": fault injection: stalling after bucket " << k << " of v" << plan.version);
        while (!stopping_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return aborted("subscriber stopped mid-update (fault injection)");
      }
    }
    return Status();
  }

  Config cfg_;
  const std::string id_;
  const Device device_;
  const uint64_t incarnation_;
  zmq::context_t ctx_;
  std::unique_ptr<zmq::socket_t> dealer_;  // identity = worker id; carries the membership
  std::unique_ptr<zmq::socket_t> probe_;   // identity = probe/<id>/<nonce>; only while joining
  Phase phase_ = Phase::kProbing;         // control thread only
  bool rejoin_requested_ = false;
  control::Wakeup wake_;
  std::thread control_thread_, data_thread_;
  std::atomic<bool> stopping_{false};

  std::mutex reg_mu_;
  std::map<std::string, TensorView> registry_;

  mutable std::mutex mu_;  // shared state of both threads
  std::condition_variable cv_;
  bool member_ = false;
  Status fatal_;
  uint64_t epoch_ = 0;
  WeightState state_;
  std::deque<zmq::message_t> outbox_;
  std::deque<UpdateReport> reports_;
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> checksums_;
  std::map<uint64_t, std::string> store_values_;
  uint64_t next_request_ = 0;
  bool store_failed_ = false;
  uint64_t receiving_version_ = 0;
  std::shared_ptr<Communicator> comm_;  // abort() is called outside mu_: it may block briefly
  std::shared_ptr<UpdatePlan> pending_plan_;  // control thread only

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;

  std::unique_ptr<DeviceMemory> mem_;  // data thread only
  StagingPair staging_;

 public:
  int64_t fault_corrupt_bucket_ = -1;
  int64_t fault_stall_after_bucket_ = -1;
  uint64_t fault_stall_version_ = 0;  // 0: any version
  uint32_t protocol_version_override_ = 0;
};

Subscriber::Subscriber(std::unique_ptr<SubscriberImpl> impl) : impl_(std::move(impl)) {}
Subscriber::~Subscriber() { impl_->stop(); }

StatusOr<std::unique_ptr<Subscriber>> Subscriber::create(const Config& config, const std::string& worker_id) {
  if (worker_id.empty()) return invalid_argument("worker id is empty");
  auto impl = std::make_unique<SubscriberImpl>(config, worker_id);
  if (const char* f = std::getenv("PARAMCAST_FAULT_CORRUPT_BUCKET")) impl->fault_corrupt_bucket_ = std::atoll(f);
  if (const char* f = std::getenv("PARAMCAST_FAULT_STALL_AFTER_BUCKET")) {
    // "K" (bucket K of every update) or "V:K" (bucket K of version V).
    const char* colon = std::strchr(f, ':');
    impl->fault_stall_version_ = colon ? std::strtoull(f, nullptr, 10) : 0;
    impl->fault_stall_after_bucket_ = std::atoll(colon ? colon + 1 : f);
  }
  if (const char* v = std::getenv("PARAMCAST_TEST_PROTOCOL_VERSION")) impl->protocol_version_override_ = std::atoi(v);
  return std::unique_ptr<Subscriber>(new Subscriber(std::move(impl)));
}

Status Subscriber::register_tensor(const TensorView& d) { return impl_->register_tensor(d); }
void Subscriber::on_tensor(TensorCallback cb) { impl_->callback_ = std::move(cb); }
void Subscriber::on_update_begin(UpdateBeginHook h) { impl_->begin_hook_ = std::move(h); }
void Subscriber::on_update_end(UpdateEndHook h) { impl_->end_hook_ = std::move(h); }
Status Subscriber::start() { return impl_->start(); }
void Subscriber::stop() { impl_->stop(); }
WeightState Subscriber::state() const { return impl_->state(); }
uint64_t Subscriber::staging_peak_bytes() const { return impl_->staging_peak(); }
bool Subscriber::joined() const { return impl_->joined(); }
std::optional<UpdateReport> Subscriber::next_report(std::chrono::milliseconds t) { return impl_->next_report(t); }
void Subscriber::inject_control_frame(const void* data, size_t size) { impl_->inject(data, size); }

}  // namespace paramcast
