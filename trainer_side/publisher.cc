// The publisher's lifecycle (PublisherImpl: init, shutdown), the control
// thread's handlers (member messages, heartbeats, member events) and the
// public handle (Publisher). The update protocol's steps are in
// publisher_update.cc; forming a group in publisher_group.cc; the outcomes of
// an update in publisher_outcomes.cc.
#include "trainer_side/publisher.h"

#include <algorithm>
#include <thread>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/units.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

std::string update_label(uint64_t version) {
  return version ? "update v" + std::to_string(version) : std::string("update (refused before a version was assigned)");
}

std::string join_ids(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ", ") + id;
  return s;
}

namespace {
control::ServerOptions server_options(const Config& cfg) {
  control::ServerOptions o;
  o.control = cfg.control;
  // The other trainer ranks of a many-sender job are members too.
  o.subscriber_ids = cfg.publisher.subscriber_ids;
  for (int r = 1; r < cfg.publisher.ranks; ++r)
    (o.subscriber_ids.empty() ? o.reserved_ids : o.subscriber_ids).push_back(trainer_rank_id(r));
  o.subscriber_count = cfg.expected_count() + cfg.publisher.ranks - 1;
  o.backend = cfg.data_plane.backend;
  o.auth = cfg.auth;
  return o;
}
}  // namespace

PublisherImpl::PublisherImpl(const Config& config)
    : cfg_([&] {
        Config c = config;
        c.publisher.device = resolve_device_or_keep(c.publisher.device);  // a GPU named by UUID
        return c;
      }()),
      server_(server_options(config)),
      groups_(config, server_) {}

PublisherImpl::~PublisherImpl() { shutdown(); }

Status PublisherImpl::init() {
  auto mem = create_device_memory(cfg_.publisher.device);
  if (!mem.ok()) return mem.status();
  mem_ = std::move(mem.value());
  faults_ = transfer::FaultInjection::from_env();
  sender_ = std::make_unique<transfer::BucketSender>(mem_.get(), faults_);
  if (cfg_.publisher.delta != DeltaMode::kOff) {
    // Where the codec cannot run (CUDA tensors in a build without CUDA),
    // updates go dense, saying why (decide_delta).
    auto codec = delta::create_codec(mem_.get(), cfg_.publisher.device, cfg_.publisher.delta_baseline);
    if (codec.ok()) {
      codec_ = std::move(*codec);
      delta::DeltaCodec* c = codec_.get();
      baseline_.set_storage([c](size_t n) { return c->allocate_baseline(n); }, [c](uint8_t* p) { c->free_baseline(p); });
    } else {
      PC_WARN("publisher: delta updates off: " << codec.status().message());
    }
  }
  PC_RETURN_IF_ERROR(start_metrics());
  PC_RETURN_IF_ERROR(server_.start(this));
  PC_INFO("publisher: listening on " << server_.endpoint() << " (" << backend_name(cfg_.data_plane.backend)
                                     << ", expects " << cfg_.expected_count() << " subscribers)");
  return Status();
}

void PublisherImpl::shutdown() {
  if (stopped_.exchange(true)) return;
  metrics_.reset();
  if (sender_) sender_->stop();
  groups_.stop();
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
  server_.stop("publisher shutting down");
  if (streaming_) {
    // A streamed update is open: its owner holds the update lock until it
    // finishes or is destroyed. Its broadcasts fail now, and it ends by itself.
    std::shared_ptr<Communicator> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = active_comm_;
    }
    if (c) c->abort("publisher shutting down");
    return;
  }
  std::lock_guard<UpdateGate> ulock(update_mu_);
  comm_.reset();
}

// "within plan_timeout (5s)", or "before update_timeout" when the cap came first.
std::string PublisherImpl::waited(const char* name, Millis phase, Deadline until) const {
  if (until >= cap_) return "before update_timeout (" + format_duration(cfg_.publisher.update_timeout) + ")";
  return std::string("within ") + name + " (" + format_duration(phase) + ")";
}

std::string PublisherImpl::silence() const {
  return "silent for " + std::to_string(cfg_.control.heartbeat_timeout.count()) + "ms";
}

// ---------------------------------------------------------- control thread
void PublisherImpl::on_member_message(const std::string& id, proto::Envelope::Reader env) {
  if (groups_.on_message(id, env)) return;
  using B = proto::Envelope::Body;
  if (env.getBody().which() == B::HEARTBEAT) return on_heartbeat(id);
  if (env.getBody().which() == B::HOLDINGS) return on_holdings(id, env.getBody().getHoldings());
  if (env.getBody().which() == B::WANTS) return on_wants(id, env.getBody().getWants());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!round_.record(id, env)) {
      if (env.getBody().which() != B::APPLIED && env.getBody().which() != B::PLAN_ACCEPT &&
          env.getBody().which() != B::PLAN_REJECT)
        server_.log_peer("unexpected message",
                         std::string("unexpected ") + control::body_name(env) + " from '" + id + "' ignored");
      return;
    }
    if (env.getBody().which() == B::APPLIED) {
      auto a = env.getBody().getApplied();
      const bool refused = a.getErrorCode() == static_cast<uint32_t>(Code::kRejected);
      server_.set_member_last_update(id, a.getVersion(), a.getOk(), a.getBytes(), a.getReceiveMs());
      if (a.getOk()) server_.set_member_weights(id, a.getVersion(), proto::WeightState::CONSISTENT, a.getDeltaBase());
      else if (!refused) server_.set_member_weights(id, 0, proto::WeightState::DIRTY);  // a refused plan wrote nothing
    }
  }
  cv_.notify_all();
}

// A heartbeat may show that a member lost a Plan or Commit (or that its
// answer was lost): the round stops waiting for it, and a member that never
// got its Commit cannot take part in the broadcast, which is aborted now.
void PublisherImpl::on_heartbeat(const std::string& id) {
  auto row = server_.member(id);
  if (!row) return;
  std::shared_ptr<Communicator> to_abort;
  std::string missed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (round_.version() == 0) return;
    missed = round_.observe(id, *row);
    if (!missed.empty()) PC_WARN("publisher: " << missed);
    if (!missed.empty() && round_.committed()) to_abort = active_comm_;
  }
  cv_.notify_all();  // the round may have changed (a lost Applied counts as applied)
  if (to_abort) to_abort->abort(missed);
}

void PublisherImpl::on_member_event(const MemberEvent& event, int rank) {
  std::shared_ptr<Communicator> to_abort;
  // A member's strikes stay with its id when it rejoins (GroupHost): a
  // member that restarts after each failure is not forgiven for it.
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(event);
    // A member that joins anew states its slices anew (Wants after Welcome):
    // none kept from before, and none kept for ids gone (bounded).
    wants_.erase(event.worker_id);
    wants_refused_.erase(event.worker_id);
    apply_history_.forget(event.worker_id);
    wants_contradicted_.erase(event.worker_id);
    const bool gone = event.kind == MemberEvent::Kind::kLost || event.kind == MemberEvent::Kind::kLeft;
    // The control thread tells us after it changed the membership, so the
    // last formation may already have read this change: it counted the
    // member that joined, or left out the one that went. Only a change it
    // did not read needs another group.
    const bool in_group = std::find(group_.begin(), group_.end(), event.worker_id) != group_.end();
    const bool seen = event.generation <= formed_generation_ && in_group == !gone;
    if (!seen && (rank > 0 || (!gone && groups_.epoch() > 0))) needs_reform_ = true;
    // A member that already applied the update in flight forwarded every
    // byte it had to; only an unfinished one breaks the collective. One that
    // rejoined with a rank left that group too (ControlServer): it will not
    // take this broadcast, and waiting for it would last stall_timeout.
    const bool left_group = gone || event.kind == MemberEvent::Kind::kRejoined;
    if (left_group && rank > 0 && !round_.applied_ok(event.worker_id)) to_abort = active_comm_;
    // No later update starts on this group, even one past its group check.
    if (left_group && rank > 0 && in_group && !seen && departed_.empty())
      departed_ = "subscriber '" + event.worker_id + "' " + member_event_name(event.kind) + " (it left the group of epoch " +
                  std::to_string(groups_.epoch()) + ")";
  }
  cv_.notify_all();
  groups_.on_member_gone(event.worker_id);
  if (to_abort) to_abort->abort("subscriber '" + event.worker_id + "' " + member_event_name(event.kind));
}

// ------------------------------------------------------------------ misc
void PublisherImpl::set_progress(std::function<void(uint64_t, uint64_t, uint64_t)> callback) {
  if (update_mu_.held_by_me()) {  // inside a stream this thread holds open
    progress_ = std::move(callback);
    return;
  }
  std::lock_guard<UpdateGate> lock(update_mu_);
  progress_ = std::move(callback);
}

std::optional<MemberEvent> PublisherImpl::poll_event() {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) return std::nullopt;
  MemberEvent e = events_.front();
  events_.pop_front();
  return e;
}

PublisherStats PublisherImpl::stats() const {
  PublisherStats s;
  s.epoch = groups_.epoch();
  s.dropped_frames = server_.dropped_frames();
  s.live_members = static_cast<int>(server_.live_ids().size());
  std::lock_guard<std::mutex> lock(mu_);
  s.published_version = published_version_;
  s.staging_peak_bytes = mem_ ? mem_->peak() : 0;
  s.baseline_bytes = baseline_.bytes();
  s.baseline_version = baseline_.version();
  return s;
}

void PublisherImpl::inject(const std::string& peer, const void* data, size_t size, const std::string& user) {
  server_.inject(peer, data, size, user);
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() > 1024) events_.clear();
}

// ------------------------------------------------------------ public handle
Publisher::Publisher(std::unique_ptr<PublisherImpl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() { impl_->shutdown(); }

StatusOr<std::unique_ptr<Publisher>> Publisher::create(const Config& config) {
  if (std::string why = backend_unavailable_reason(config.data_plane.backend); !why.empty())
    return unavailable(std::string("data_plane.backend ") + backend_name(config.data_plane.backend) +
                       " cannot run here: " + why);
  auto impl = std::make_unique<PublisherImpl>(config);
  PC_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

std::string Publisher::endpoint() const { return impl_->endpoint(); }
std::string Publisher::metrics_endpoint() const { return impl_->metrics_endpoint(); }
Status Publisher::start() { return impl_->start(); }

UpdateResult Publisher::weight_update(const std::vector<TensorView>& tensors, std::optional<uint64_t> version) {
  UpdateOptions options;
  options.version = version;
  return impl_->weight_update(tensors, options);
}

UpdateResult Publisher::weight_update_sharded(const std::vector<ShardView>& shards, const UpdateOptions& options) {
  return impl_->weight_update_sharded(shards, options);
}
UpdateResult Publisher::weight_update(const std::vector<TensorView>& tensors, const UpdateOptions& options) {
  return impl_->weight_update(tensors, options);
}

std::future<UpdateResult> Publisher::weight_update_async(std::vector<TensorView> tensors,
                                                         std::optional<uint64_t> version) {
  UpdateOptions options;
  options.version = version;
  return weight_update_async(std::move(tensors), std::move(options));
}

std::future<UpdateResult> Publisher::weight_update_async(std::vector<TensorView> tensors, UpdateOptions options) {
  return std::async(std::launch::async,
                    [this, t = std::move(tensors), options] { return impl_->weight_update(t, options); });
}

uint64_t Publisher::next_version() const { return impl_->next_version(); }
std::optional<MemberEvent> Publisher::poll_event() { return impl_->poll_event(); }
void Publisher::on_progress(std::function<void(uint64_t, uint64_t, uint64_t)> callback) {
  impl_->set_progress(std::move(callback));
}
PublisherStats Publisher::stats() const { return impl_->stats(); }
void Publisher::shutdown() { impl_->shutdown(); }
void Publisher::inject_control_frame(const std::string& peer, const void* data, size_t size,
                                     const std::string& user) {
  impl_->inject(peer, data, size, user);
}

}  // namespace paramcast
