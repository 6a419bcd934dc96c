#include "inference_side/subscriber.h"

#include <algorithm>

#include "common/control/messages.h"
#include "common/data/shm/host_identity.h"
#include "common/group/join_group.h"
#include "common/log.h"
#include "common/plan_proto.h"
#include "common/units.h"
#include "common/xxhash.h"
#include "inference_side/plan_check.h"
#include "inference_side/subscriber_impl.h"
#include "paramcast/build_config.h"

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
// Whether this engine can apply deltas: a CUDA engine needs a build with
// CUDA and registered buffers (its callback gets dense updates).
bool delta_capable(const Config& cfg, Device device, bool callback) {
  if (device.is_cuda()) return PARAMCAST_HAVE_NCCL && !callback;
  return !callback || cfg.subscriber.delta_baseline;
}

control::ClientOptions client_options(const Config& cfg, const std::string& id, Device device, bool callback,
                                      bool source, control::ClientAuth auth = {}) {
  control::ClientOptions o;
  o.auth = std::move(auth);
  o.control = cfg.control;
  o.worker_id = id;
  o.device = device;
  o.capabilities = {"xxh64"};
  if (callback) o.capabilities.push_back("callback");
  // Deltas are applied in place (host or CUDA buffers, the latter on the
  // device), or onto the engine's own copy of the last version for its
  // callback (host memory only; kept only when configured).
  if (delta_capable(cfg, device, callback) && !source) o.capabilities.push_back("delta");
  if (source) o.capabilities.push_back("source");  // a trainer rank (PublisherRank): it sends, never receives
  o.wait_out_duplicate_id = source;                 // its id is its rank's: it comes back to it
  o.capabilities.push_back("link_check");           // it answers LinkCheck (common/group/link_check.h)
  // data_plane.local: this member may read the publisher's shared memory.
  if (cfg.data_plane.local && !device.is_cuda()) o.host_identity = shm_backend::host_identity();
  if (const char* v = std::getenv("PARAMCAST_TEST_PROTOCOL_VERSION"))
    o.protocol_version_override = static_cast<uint32_t>(std::atoi(v));
  return o;
}
}  // namespace

SubscriberImpl::SubscriberImpl(const Config& cfg, std::string id, bool source)
    : cfg_(cfg),
      id_(std::move(id)),
      source_(source),
      // A trainer rank's device is its shards' (publisher.device); a GPU may be named by UUID.
      device_(resolve_device_or_keep(source ? cfg.publisher.device : cfg.device_for_worker(id_))),
      client_(std::make_unique<control::ControlClient>(client_options(cfg_, id_, device_, false, source), this)),
      group_(std::make_unique<group::GroupMember>(id_, *client_)),
      faults_(transfer::FaultInjection::from_env()),
      lost_(ControlFaults::from_env()),
      link_checks_(id_, cfg.data_plane.gloo_hostname, cfg.data_plane.gloo_interface) {}

SubscriberImpl::~SubscriberImpl() { stop(); }

Status SubscriberImpl::register_tensor(const TensorView& d) {
  auto n = d.spec.nbytes();
  if (!n.ok()) return n.status();
  if (*n > 0 && !d.data) return invalid_argument("destination '" + d.spec.name + "' has no data pointer");
  if (d.device != device_)
    return invalid_argument("destination '" + d.spec.name + "' is on " + d.device.to_string() + " but worker '" + id_ +
                            "' receives on " + device_.to_string());
  bool was_slice = false;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    registry_[d.spec.name] = d;
    ++registrations_;
    was_slice = slices_.erase(d.spec.name) > 0;  // a name is whole or a slice: the last registration wins
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    registered_since_update_ = true;
  }
  if (was_slice && client_ && client_->joined()) send_wants();  // the publisher plans it whole again
  return Status();
}

uint64_t SubscriberImpl::delta_base_locked() const {
  if (state_.kind != WeightStateKind::kConsistent || registered_since_update_ ||
      !delta_capable(cfg_, device_, bool(callback_)))
    return 0;
  if (keeps_copies() && copy_version_ != state_.version) return 0;
  return state_.version;
}

Status SubscriberImpl::start() {
  if (cfg_.control.endpoint.find('*') != std::string::npos)
    return invalid_argument("control.endpoint '" + cfg_.control.endpoint +
                            "' has a wildcard: a member connects to the endpoint the publisher bound "
                            "(Publisher::endpoint(), or paramcast-worker --endpoint)");
  auto mem = create_device_memory(device_);
  if (!mem.ok()) return mem.status();
  mem_ = std::move(mem.value());
  if (source_ && device_.is_cuda()) {
    auto own = create_device_memory(device_);
    if (!own.ok()) return own.status();
    publish_mem_ = std::move(own.value());
  }
  receiver_ = std::make_unique<transfer::BucketReceiver>(mem_.get(), device_, faults_);
  auto auth = control::client_auth(cfg_.auth, id_);
  if (!auth.ok()) return auth.status();
  // The capabilities are known now that the callbacks are set.
  client_ = std::make_unique<control::ControlClient>(
      client_options(cfg_, id_, device_, bool(callback_), source_, *auth), this);
  group_ = std::make_unique<group::GroupMember>(id_, *client_);
  PC_RETURN_IF_ERROR(start_metrics());  // before joining: a port in use fails start() with nothing begun
  data_thread_ = std::thread([this] { data_loop(); });
  client_->start();
  return Status();
}

void SubscriberImpl::stop() {
  if (stopping_.exchange(true)) return;
  metrics_.reset();
  if (receiver_) receiver_->stop();
  group_->on_unavailable("subscriber stopping");
  abort_comm("subscriber stopping");
  // Take each lock once so that a thread between its predicate check and
  // its wait cannot miss the notification.
  { std::lock_guard<std::mutex> lock(jobs_mu_); }
  jobs_cv_.notify_all();
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
  client_->stop();
  if (data_thread_.joinable()) data_thread_.join();
  link_checks_.stop();
}

WeightState SubscriberImpl::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

uint64_t SubscriberImpl::staging_peak() const { return mem_ ? mem_->peak() : 0; }

std::optional<UpdateReport> SubscriberImpl::next_report(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !reports_.empty() || !fatal_.ok() || stopping_; })) return std::nullopt;
  if (reports_.empty()) return UpdateReport{0, fatal_.ok() ? aborted(id_ + " stopping") : fatal_, 0, 0};
  UpdateReport r = reports_.front();
  reports_.pop_front();
  return r;
}

void SubscriberImpl::inject(const void* data, size_t size) {
  client_->inject(data, size);
  std::lock_guard<std::mutex> lock(mu_);
  reports_.clear();
  std::lock_guard<std::mutex> jlock(jobs_mu_);
  jobs_.clear();
}

// Aborts the current communicator without holding mu_ (an abort signals the
// backend's connections; the control thread must keep heartbeating).
void SubscriberImpl::abort_comm(const std::string& why, uint64_t only_version) {
  std::shared_ptr<Communicator> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (only_version && receiving_version_ != only_version) return;
    c = comm_;
  }
  if (c) c->abort(why);
}

void SubscriberImpl::push_job(Job job) {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    jobs_.push_back(std::move(job));
  }
  jobs_cv_.notify_all();
}

// -------------------------------------------------------------- data thread
void SubscriberImpl::data_loop() {
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

void SubscriberImpl::join(const Job& job) {
  std::shared_ptr<Communicator> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old.swap(comm_);
  }
  old.reset();  // outside mu_; its teardown runs on the reaper thread
  auto comm = group_->join(job.group);
  if (!comm.ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (job.epoch == epoch_) {  // else superseded while forming
    comm_ = std::move(comm.value());
    update_cap_ = job.group.op_timeout;
  }
}

void SubscriberImpl::receive(const Job& job) {
  const UpdatePlan& plan = *job.plan;
  const bool taking = job.discard.empty();
  if (faults_.receive_pause_version == plan.version && faults_.receive_pause_ms) {  // test hook
    PC_WARN(id_ << ": pausing " << faults_.receive_pause_ms << " ms before receiving v" << plan.version
                << " (PARAMCAST_FAULT_PAUSE_BEFORE_RECEIVE)");
    std::this_thread::sleep_for(Millis(faults_.receive_pause_ms));
  }
  // The binding's word on its tensors (no lock held: it may take its own).
  std::vector<Mismatch> moved;
  if (taking && registration_check_ && !source_) moved = registration_check_();
  const auto t0 = Clock::now();
  std::shared_ptr<Communicator> comm;
  bool abandoned = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    comm = comm_;
    // The publisher abandoned this version after its Commit and before its
    // transfer began here: nothing is written, and the weights stay what
    // they were. (Checked under the lock the Abandon is recorded under: one
    // that comes later finds the receive under way and ends it.)
    abandoned = taking && abandoned_version_ >= plan.version;
    receiving_version_ = plan.version;
    receiving_sharded_ = plan.sharded;
    deadline_ = t0 + update_cap_;  // the publisher's update_timeout: it gives up then too
    if (taking && !abandoned && moved.empty()) {
      state_.kind = WeightStateKind::kDirty;
      state_.dirty_version = plan.version;
    }
  }
  if (abandoned) {
    const std::string why = "the publisher abandoned v" + std::to_string(plan.version) +
                            " before its transfer began here; nothing was written";
    if (comm) comm->abort(id_ + ": " + why);  // its peers may have started: the collective is half-done
    report(job, aborted(why), 0, 0.0, 0, std::chrono::milliseconds(0), {});
    PC_WARN(id_ << ": " << why << "; state " << state().to_string());
    return;
  }
  if (!moved.empty()) {
    std::string why = "registered tensors moved since they were registered, so v" + std::to_string(plan.version) +
                      " cannot land where they are; nothing of it was written: ";
    for (size_t i = 0; i < moved.size(); ++i) why += (i ? "; " : "") + moved[i].to_string();
    if (comm) comm->abort(id_ + ": " + why);  // its peers stop waiting for this rank
    report(job, invalid_argument(why), 0, 0.0, 0, std::chrono::milliseconds(0), {});
    PC_WARN(id_ << ": " << why << "; state " << state().to_string());
    return;
  }
  if (begin_hook_ && taking) begin_hook_(plan.version);
  bool collective_done = false;  // the communicator is still in step with the group
  const auto links_before = comm ? comm->link_stats() : std::vector<LinkStats>{};
  Status s = move(job, comm.get(), collective_done);
  const auto links = comm ? link_delta(links_before, comm->link_stats()) : std::vector<LinkStats>{};
  const auto received_in = Clock::now() - t0;
  const uint64_t checksum = s.ok() ? combined_checksum(plan) : 0;
  // The engine's post-processing ends before Applied: the publisher's OK
  // means every engine is done. A failing hook fails the update.
  if (end_hook_ && taking) {
    Status hook = end_hook_(plan.version, s);
    if (s.ok() && !hook.ok()) s = hook.with_context("on_update_end hook");
  }
  report(job, s, checksum, std::chrono::duration<double>(Clock::now() - t0).count(),
         plan.sharded ? sharded_received_.load() : receiver_->received(),
         std::chrono::duration_cast<std::chrono::milliseconds>(received_in), links);
  // A failed update leaves the collective half-done: this communicator is finished.
  if (!collective_done && comm) comm->abort("update v" + std::to_string(plan.version) + " failed");
  if (s.ok()) PC_DEBUG(id_ << ": applied v" << plan.version << " (" << plan.total_bytes << " bytes)");
  else PC_WARN(id_ << ": update v" << plan.version << " failed, state " << state().to_string() << ": " << s.message());
}

// Receives the buckets into the engine's tensors, or drops them (a plan this worker refused).
Status SubscriberImpl::move(const Job& job, Communicator* comm, bool& collective_done) {
  const UpdatePlan& plan = *job.plan;
  if (!comm) return aborted("no communicator for epoch " + std::to_string(job.epoch));
  if (!job.discard.empty() && plan.sharded) {
    // Its senders wait for this rank: the update fails for all, naming it.
    comm->abort(id_ + " cannot take sharded plan v" + std::to_string(plan.version) + ": " + job.discard);
    return rejected("precommitted sharded plan v" + std::to_string(plan.version) + " does not fit this worker (" +
                    job.discard + "); no tensor was written");
  }
  if (!job.discard.empty()) {
    transfer::BucketReceiver::Hooks hooks;
    hooks.next_bucket = [&](size_t k, bool wait, PlanBucket& b) { return next_bucket(plan.version, k, wait, b); };
    hooks.delta_header = [&](size_t k) { return delta_header(plan.version, k); };
    Status s = receiver_->drop(*job.plan, *comm, hooks, deadline());
    collective_done = s.ok();
    if (!s.ok()) return s;
    return rejected("precommitted plan v" + std::to_string(plan.version) + " does not fit this worker (" +
                    job.discard + "); its buckets were received and dropped, no tensor was written");
  }
  if (plan.sharded) return move_sharded(job, comm, collective_done);
  std::vector<const TensorView*> dest(plan.tensors.size(), nullptr);
  std::map<std::string, TensorView> registry;
  {
    std::lock_guard<std::mutex> lock(reg_mu_);
    registry = registry_;
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    auto it = registry.find(plan.tensors[i].name);
    if (it != registry.end()) dest[i] = &it->second;
  }
  transfer::BucketReceiver::Hooks hooks;
  hooks.expected_checksum = [&](size_t k) { return expected_checksum(plan.version, k); };
  hooks.on_tensor = callback_;
  hooks.next_bucket = [&](size_t k, bool wait, PlanBucket& b) { return next_bucket(plan.version, k, wait, b); };
  hooks.delta_header = [&](size_t k) { return delta_header(plan.version, k); };
  if (keeps_copies()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      copy_version_ = 0;  // being written
    }
    // Copies of the tensors the callback gets (no destination), kept when
    // the manifest is the same. Without memory for them, this update still
    // lands (the callback gets whole tensors as without a copy); the next
    // delta is refused (copy_version_ stays 0).
    if (Status c = copy_.prepare(plan, [&](size_t i) { return dest[i] == nullptr; }); c.ok())
      hooks.copy_of = [&](uint32_t t) { return copy_.tensor(t); };
    else
      PC_WARN(id_ << ": " << c.message());
  }
  Status s = receiver_->receive(*job.plan, dest, *comm, hooks, deadline());
  if (s.ok() && keeps_copies() && hooks.copy_of) {
    std::lock_guard<std::mutex> lock(mu_);
    copy_version_ = plan.version;
    copy_manifest_ = plan.manifest_hash;
  }
  collective_done = s.ok();
  return s;
}

StatusOr<uint64_t> SubscriberImpl::expected_checksum(uint64_t version, size_t bucket) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_pair(version, static_cast<uint32_t>(bucket));
  if (!cv_.wait_until(lock, deadline_, [&] { return checksums_.count(key) || stopping_ || !client_->joined(); }))
    return timeout_error("checksum of bucket " + std::to_string(bucket) + " never arrived within update_timeout (" +
                         format_duration(update_cap_) + ")");
  if (!checksums_.count(key))
    return stopping_ ? aborted("subscriber stopping")
                     : peer_lost("publisher lost before the checksum of bucket " + std::to_string(bucket) + " arrived");
  return checksums_[key];
}

uint64_t SubscriberImpl::combined_checksum(const UpdatePlan& plan) {
  if (plan.checksum == Checksum::kNone) return 0;
  Xxh64 h;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    auto it = checksums_.find({plan.version, static_cast<uint32_t>(k)});
    uint64_t v = it == checksums_.end() ? 0 : it->second;
    h.update(&v, sizeof v);
  }
  return h.digest();
}

// Records the outcome (weight state, report) and tells the publisher: Applied.
void SubscriberImpl::report(const Job& job, const Status& s, uint64_t checksum, double seconds, uint64_t received,
                            std::chrono::milliseconds receive_time, const std::vector<LinkStats>& links) {
  const UpdatePlan& plan = *job.plan;
  uint64_t delta_base = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    receiving_version_ = 0;
    for (auto it = checksums_.begin(); it != checksums_.end();)
      it = it->first.first <= plan.version ? checksums_.erase(it) : std::next(it);
    for (auto it = layouts_.begin(); it != layouts_.end();)
      it = it->first.first <= plan.version ? layouts_.erase(it) : std::next(it);
    for (auto it = deltas_.begin(); it != deltas_.end();)
      it = it->first.first <= plan.version ? deltas_.erase(it) : std::next(it);
    stream_end_.erase(stream_end_.begin(), stream_end_.upper_bound(plan.version));
    if (s.ok()) {
      state_.kind = WeightStateKind::kConsistent;
      state_.version = plan.version;
      state_.dirty_version = 0;
      if (!plan.partial) registered_since_update_ = false;  // every registered tensor now holds it
    }
    delta_base = delta_base_locked();
  }
  // The report reaches next_report() only after Applied is queued: a caller
  // that stops once it saw the report must not drop the Applied.
  auto publish_report = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    reports_.push_back(UpdateReport{plan.version, s, s.ok() ? plan.total_bytes : 0, seconds});
    cv_.notify_all();
  };
  // Counted before Applied leaves: a scrape after the publisher's result sees it.
  counters_.record(s, seconds, s.ok() ? plan.total_bytes : 0, 0);
  if (lost_.loses("mute-applied", plan.version)) return publish_report();  // test hook: stuck, silently
  if (lost_.loses("applied", plan.version)) {  // test hook: as if the connection broke with it queued
    applied_sent_ = plan.version;
    return publish_report();
  }
  client_->send(control::make_message(job.epoch, client_->incarnation(), [&](auto b) {
    auto a = b.initApplied();
    a.setVersion(plan.version);
    a.setOk(s.ok());
    // A sharded plan: what this member received (its slices, or nothing
    // for a trainer rank), not the model's size.
    a.setBytes(plan.sharded ? received : s.ok() ? plan.total_bytes : std::min(received, plan.total_bytes));
    a.setReceiveMs(static_cast<uint64_t>(receive_time.count()));
    a.setDeltaBase(delta_base);
    // Test hook: forged link claims (PARAMCAST_FAULT_CLAIM_SHED).
    std::vector<LinkStats> claimed = links;
    if (!lost_.claimed_shed().empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t r = 0; r < rank_names_.size(); ++r)
        if (lost_.claimed_shed().count(rank_names_[r])) {
          LinkStats l;
          l.peer = static_cast<int>(r);
          l.shed = true;
          claimed.push_back(l);
        }
    }
    const auto& links_out = claimed;
    auto list = a.initLinks(static_cast<unsigned>(links_out.size()));
    for (size_t i = 0; i < links_out.size(); ++i) {
      list[static_cast<unsigned>(i)].setRank(static_cast<uint32_t>(links_out[i].peer));
      list[static_cast<unsigned>(i)].setBytes(links_out[i].bytes_sent);
      list[static_cast<unsigned>(i)].setBusyUs(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(links_out[i].send_busy).count()));
      list[static_cast<unsigned>(i)].setShed(links_out[i].shed);
    }
    a.setChecksum(checksum);
    if (!s.ok()) {
      a.setError(s.message());
      a.setErrorCode(static_cast<uint32_t>(s.code()));
    }
  }));
  applied_sent_ = plan.version;
  publish_report();
}

// ------------------------------------------------------------ public handle
Subscriber::Subscriber(std::unique_ptr<SubscriberImpl> impl) : impl_(std::move(impl)) {}
Subscriber::~Subscriber() { impl_->stop(); }

StatusOr<std::unique_ptr<Subscriber>> Subscriber::create(const Config& config, const std::string& worker_id) {
  if (worker_id.empty()) return invalid_argument("worker id is empty");
  note_log_worker(worker_id);
  return std::unique_ptr<Subscriber>(new Subscriber(std::make_unique<SubscriberImpl>(config, worker_id)));
}

Status Subscriber::register_tensor(const TensorView& d) { return impl_->register_tensor(d); }
Status Subscriber::register_slice(const ShardView& s) { return impl_->register_slice(s); }
void Subscriber::on_tensor(TensorCallback cb) { impl_->callback_ = std::move(cb); }
void Subscriber::on_update_begin(UpdateBeginHook h) { impl_->begin_hook_ = std::move(h); }
void Subscriber::check_registrations(RegistrationCheck c) { impl_->registration_check_ = std::move(c); }
void Subscriber::on_update_end(UpdateEndHook h) { impl_->end_hook_ = std::move(h); }
Status Subscriber::start() { return impl_->start(); }
void Subscriber::stop() { impl_->stop(); }
WeightState Subscriber::state() const { return impl_->state(); }
uint64_t Subscriber::staging_peak_bytes() const { return impl_->staging_peak(); }
bool Subscriber::joined() const { return impl_->joined(); }
std::string Subscriber::metrics_endpoint() const { return impl_->metrics_endpoint(); }
std::optional<UpdateReport> Subscriber::next_report(std::chrono::milliseconds t) { return impl_->next_report(t); }
void Subscriber::inject_control_frame(const void* data, size_t size) { impl_->inject(data, size); }

}  // namespace paramcast
