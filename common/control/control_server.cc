#include "common/control/control_server.h"

#include <algorithm>

#include "common/control/messages.h"
#include "common/log.h"

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

namespace control {
namespace {
std::string join_ids(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ", ") + id;
  return s;
}
int64_t ms_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - t).count();
}
}  // namespace

ControlServer::ControlServer(ServerOptions options)
    : opt_(std::move(options)), incarnation_(new_incarnation()), router_(ctx_, zmq::socket_type::router) {}

ControlServer::~ControlServer() { stop("publisher shutting down"); }

Status ControlServer::start(Listener* listener) {
  listener_ = listener;
  const auto& c = opt_.control;
  try {
    // A new connection under a worker id takes it over: subscribers connect
    // under their id only after a probe showed the id is free (or theirs),
    // so this serves restarts and reconnects, never duplicates. ZMTP
    // heartbeats drop connections of processes that stopped answering.
    router_.set(zmq::sockopt::router_handover, 1);
    router_.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(c.heartbeat_interval.count()));
    router_.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(c.heartbeat_timeout.count()));
    router_.set(zmq::sockopt::router_mandatory, 1);
    router_.set(zmq::sockopt::linger, 0);
    router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(c.max_message_bytes + 1024));
    router_.bind(c.endpoint);
    endpoint_ = router_.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return unavailable("cannot bind control endpoint " + c.endpoint + ": " + e.what());
  }
  thread_ = std::thread([this] { loop(); });
  return Status();
}

void ControlServer::stop(const std::string& reason) {
  if (stopping_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, m] : members_)
      if (!m.lost)
        outbox_.emplace_back(id, make_message(epoch_, incarnation_, [&](auto b) { b.initLeave().setReason(reason); }));
  }
  wake_.notify();
  if (thread_.joinable()) thread_.join();
}

uint64_t ControlServer::send(const std::string& id, zmq::message_t frame) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.emplace_back(id, std::move(frame));
    seq = beat_seq_;
  }
  wake_.notify();
  return seq;
}

uint64_t ControlServer::send_to(const std::vector<std::string>& ids, const zmq::message_t& frame) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : ids) {
      zmq::message_t copy;
      copy.copy(const_cast<zmq::message_t&>(frame));
      outbox_.emplace_back(id, std::move(copy));
    }
    seq = beat_seq_;
  }
  wake_.notify();
  return seq;
}

void ControlServer::assign_ranks(const std::vector<std::string>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, m] : members_) m.rank = -1;
  for (size_t i = 0; i < group.size(); ++i) {
    auto it = members_.find(group[i]);
    if (it != members_.end()) it->second.rank = static_cast<int>(i + 1);
  }
}

std::vector<std::string> ControlServer::live_ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> ids;
  for (const auto& [id, m] : members_)
    if (!m.lost) ids.push_back(id);
  return ids;
}

bool ControlServer::is_live(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  return it != members_.end() && !it->second.lost;
}

void ControlServer::set_member_weights(const std::string& id, uint64_t version, proto::WeightState state) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return;
  if (state == proto::WeightState::CONSISTENT) it->second.weight_version = version;
  it->second.state = state;
}

std::optional<Member> ControlServer::member(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> ControlServer::missing() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> missing;
  if (!opt_.subscriber_ids.empty()) {
    for (const auto& id : opt_.subscriber_ids) {
      auto it = members_.find(id);
      if (it == members_.end() || it->second.lost) missing.push_back(id);
    }
    return missing;
  }
  // Any ids may join: name the lost members first, then count the rest.
  int live = 0;
  for (const auto& [id, m] : members_) live += !m.lost;
  const int absent = opt_.subscriber_count - live;
  for (const auto& [id, m] : members_)
    if (m.lost && static_cast<int>(missing.size()) < absent) missing.push_back(id);
  for (int i = static_cast<int>(missing.size()); i < absent; ++i)
    missing.push_back("<unnamed subscriber " + std::to_string(live + i + 1) + " of " +
                      std::to_string(opt_.subscriber_count) + ">");
  return missing;
}

bool ControlServer::has_free_slot_locked() const {
  int live = 0;
  for (const auto& [id, m] : members_) live += !m.lost;
  return live < opt_.subscriber_count;
}

// ------------------------------------------------------------ control thread

void ControlServer::loop() {
  const auto& c = opt_.control;
  auto next_beat = Clock::now();
  for (;;) {
    zmq::pollitem_t items[] = {{router_.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, wake_.fd(), ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(std::max<int64_t>(1, c.heartbeat_interval.count() / 4)));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) PC_ERROR("publisher: poll failed: " << e.what());
    }
    if (items[1].revents & ZMQ_POLLIN) wake_.drain();
    flush_outbox();
    if (stopping_) return;  // the Leaves queued by stop() went out above
    receive_burst();
    const auto now = Clock::now();
    settle_probes();
    if (now >= next_beat) {
      next_beat = now + c.heartbeat_interval;
      check_liveness(now);
    }
    flush_outbox();
  }
}

void ControlServer::receive_burst() {
  for (int i = 0; i < 1000; ++i) {
    zmq::message_t id, payload;
    if (!router_.recv(id, zmq::recv_flags::dontwait)) return;
    if (!router_.get(zmq::sockopt::rcvmore)) {
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
}

void ControlServer::flush_outbox() {
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

void ControlServer::inject(const std::string& peer, const void* data, size_t size) {
  zmq::message_t frame(data, size);
  handle(peer, frame);
  std::lock_guard<std::mutex> lock(mu_);
  if (outbox_.size() > 1024) outbox_.clear();
}

void ControlServer::note_dropped(const std::string& peer, const std::string& why) {
  ++dropped_frames_;
  PC_WARN("publisher: dropped frame from peer '" << peer << "': " << why);
}

void ControlServer::handle(const std::string& peer, const zmq::message_t& payload) {
  DecodeLimits limits;
  limits.max_bytes = opt_.control.max_message_bytes;
  auto decoded = decode(payload.data(), payload.size(), limits);
  if (!decoded.ok()) {
    note_dropped(peer, decoded.status().message());
    return;
  }
  try {
    auto envelope = decoded.value()->envelope();
    Deliveries d;
    {
      std::lock_guard<std::mutex> lock(mu_);
      d = dispatch_locked(peer, envelope);
    }
    deliver(d, peer, envelope);
  } catch (const kj::Exception& e) {
    note_dropped(peer, std::string("malformed message: ") + e.getDescription().cStr());
  }
}

void ControlServer::deliver(const Deliveries& d, const std::string& peer, proto::Envelope::Reader envelope) {
  if (!listener_) return;
  for (const auto& [event, rank] : d.events) listener_->on_member_event(event, rank);
  if (d.message) listener_->on_member_message(peer, envelope);
}

ControlServer::Deliveries ControlServer::dispatch_locked(const std::string& peer, proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  Deliveries out;
  auto body = env.getBody();
  const uint64_t inc = env.getIncarnation();
  if (body.which() == B::STATUS_REQUEST) {
    status_reply_locked(peer, body.getStatusRequest().getRequestId());
    return out;
  }
  if (body.which() == B::HELLO) {
    hello_locked(peer, inc, body.getHello(), out);
    return out;
  }
  auto it = members_.find(peer);
  if (it == members_.end() || it->second.incarnation != inc || it->second.lost) {
    if (body.which() != B::LEAVE)
      reject_locked(peer, inc, proto::RejectCode::NOT_MEMBER,
                    it != members_.end() && it->second.lost
                        ? "'" + peer + "' was declared lost and expelled from the group: say Hello again"
                        : "'" + peer + "' is not a member: say Hello first");
    return out;
  }
  Member& m = it->second;
  m.last_seen = Clock::now();
  switch (body.which()) {
    case B::HEARTBEAT: {
      auto h = body.getHeartbeat();
      m.weight_version = h.getWeightVersion();
      m.state = h.getState();
      m.dirty_version = h.getDirtyVersion();
      m.ack_seq = std::min(h.getAckSeq(), beat_seq_);  // a member cannot have seen a later one
      m.plan_version = h.getPlanVersion();
      m.answered_version = h.getAnsweredVersion();
      m.commit_version = h.getCommitVersion();
      m.applied_version = h.getAppliedVersion();
      out.message = true;  // the owner follows the update round with it
      break;
    }
    case B::LEAVE: {
      m.lost = true;
      const std::string reason = body.getLeave().getReason().cStr();
      PC_INFO("publisher: subscriber '" << peer << "' left: " << reason);
      out.events.push_back({MemberEvent{MemberEvent::Kind::kLeft, peer, reason}, m.rank});
      break;
    }
    default:
      out.message = true;
  }
  return out;
}

void ControlServer::hello_locked(const std::string& peer, uint64_t inc, proto::Hello::Reader h, Deliveries& out) {
  const std::string id = h.getWorkerId().cStr();
  if (h.getProtocolVersion() != proto::PROTOCOL_VERSION) {
    PC_WARN("publisher: rejected '" << id << "': protocol version " << h.getProtocolVersion() << ", publisher speaks "
                                    << proto::PROTOCOL_VERSION);
    reject_locked(peer, inc, proto::RejectCode::VERSION_MISMATCH,
                  "protocol version mismatch: subscriber speaks " + std::to_string(h.getProtocolVersion()) +
                      ", publisher speaks " + std::to_string(proto::PROTOCOL_VERSION),
                  h.getProtocolVersion());
    return;
  }
  const bool probe = peer != id;
  if (probe && peer.rfind("probe/" + id + "/", 0) != 0) {
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "worker id '" + id + "' differs from the connection's routing identity '" + peer + "'");
    return;
  }
  const auto& ids = opt_.subscriber_ids;
  if (!ids.empty() && std::find(ids.begin(), ids.end(), id) == ids.end()) {
    PC_WARN("publisher: rejected unknown worker id '" << id << "'");
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "worker id '" + id + "' is not in publisher.subscribers (" + join_ids(ids) + ")");
    return;
  }
  auto it = members_.find(id);
  const bool known = it != members_.end();
  if (!probe) {
    admit_locked(peer, inc, h, out);
    return;
  }
  // Another process holds this id while a live connection still carries
  // it: that is a duplicate, and the first keeps its place. A restarted
  // process finds the old connection gone (the router cannot route to it).
  if (known && !it->second.lost && it->second.incarnation != inc) {
    // Decide once the member had two heartbeat intervals to show it lives.
    probes_.push_back({peer, id, inc, Clock::now(), std::string(h.getHost().cStr()) + " pid " + std::to_string(h.getPid())});
    return;
  }
  if (!known && ids.empty() && !has_free_slot_locked()) {
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "the deployment expects " + std::to_string(opt_.subscriber_count) + " subscribers and all are present");
    return;
  }
  welcome_locked(peer, inc, /*probe=*/true);
}

// A Hello on the worker-id connection: the membership itself.
void ControlServer::admit_locked(const std::string& peer, uint64_t inc, proto::Hello::Reader h, Deliveries& out) {
  const std::string& id = peer;
  const auto now = Clock::now();
  auto it = members_.find(id);
  MemberEvent::Kind kind = MemberEvent::Kind::kJoined;
  int old_rank = -1;
  if (it != members_.end()) {
    Member& m = it->second;
    if (m.incarnation == inc && !m.lost) {  // a repeated Hello: answer it again
      m.last_seen = now;
      welcome_locked(peer, inc, false);
      return;
    }
    kind = MemberEvent::Kind::kRejoined;
    old_rank = m.rank;
  } else if (opt_.subscriber_ids.empty() && !has_free_slot_locked()) {
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "the deployment expects " + std::to_string(opt_.subscriber_count) + " subscribers and all are present");
    return;
  }
  Member m;
  m.id = id;
  m.incarnation = inc;
  m.host = h.getHost().cStr();
  m.pid = h.getPid();
  m.device = get_device(h.getDevice());
  m.last_seen = now;
  m.weight_version = h.getWeightVersion();
  m.state = h.getState();
  members_[id] = m;
  const std::string who = m.host + " pid " + std::to_string(m.pid);
  PC_INFO("publisher: subscriber '" << id << "' " << member_event_name(kind) << " (" << who << ", "
                                    << m.device.to_string() << ", holds v" << m.weight_version << " "
                                    << state_name(m.state) << ")");
  out.events.push_back({MemberEvent{kind, id, who}, old_rank});
  welcome_locked(peer, inc, false);
}

// Probes for an id held by a member: a live member is heard from within two
// heartbeat intervals, and then the newcomer is a duplicate; a dead one is
// not, and the newcomer (a restart) may proceed.
void ControlServer::settle_probes() {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto p = probes_.begin(); p != probes_.end();) {
    auto it = members_.find(p->id);
    const bool gone = it == members_.end() || it->second.lost || it->second.incarnation == p->incarnation;
    const bool alive = !gone && it->second.last_seen > p->arrived;
    if (!gone && !alive && now - p->arrived < 2 * opt_.control.heartbeat_interval) {
      ++p;
      continue;
    }
    if (alive) {
      const Member& m = it->second;
      PC_WARN("publisher: rejected duplicate worker id '" << p->id << "' from " << p->who << " (held by " << m.host
                                                          << " pid " << m.pid << ")");
      reject_locked(p->peer, p->incarnation, proto::RejectCode::DUPLICATE_ID,
                    "worker id '" + p->id + "' is already used by a live subscriber (" + m.host + " pid " +
                        std::to_string(m.pid) + ")");
    } else {
      welcome_locked(p->peer, p->incarnation, /*probe=*/true);
    }
    p = probes_.erase(p);
  }
}

void ControlServer::check_liveness(Clock::time_point now) {
  std::vector<std::pair<MemberEvent, int>> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++beat_seq_;
    for (auto& [id, m] : members_) {
      if (m.lost) continue;
      if (now - m.last_seen > opt_.control.heartbeat_timeout) {
        m.lost = true;
        const auto ms = ms_since(m.last_seen, now);
        PC_WARN("publisher: subscriber '" << id << "' lost: silent for " << ms << "ms (heartbeat_timeout "
                                          << opt_.control.heartbeat_timeout.count() << "ms)");
        lost.push_back({MemberEvent{MemberEvent::Kind::kLost, id, "silent for " + std::to_string(ms) + "ms"}, m.rank});
        continue;
      }
      outbox_.emplace_back(id, make_message(epoch_, incarnation_, [&](auto b) {
                             auto h = b.initHeartbeat();
                             h.setWeightVersion(published_version_);
                             h.setState(proto::WeightState::CONSISTENT);
                             h.setSeq(beat_seq_);
                           }));
    }
  }
  if (listener_)
    for (const auto& [event, rank] : lost) listener_->on_member_event(event, rank);
}

void ControlServer::welcome_locked(const std::string& peer, uint64_t inc, bool probe) {
  outbox_.emplace_back(peer, make_message(epoch_, incarnation_, [&](auto b) {
                         auto w = b.initWelcome();
                         w.setProbe(probe);
                         w.setProtocolVersion(proto::PROTOCOL_VERSION);
                         w.setHeartbeatIntervalMs(static_cast<uint32_t>(opt_.control.heartbeat_interval.count()));
                         w.setHeartbeatTimeoutMs(static_cast<uint32_t>(opt_.control.heartbeat_timeout.count()));
                         w.setPublisherIncarnation(incarnation_);
                       }));
}

void ControlServer::reject_locked(const std::string& peer, uint64_t target, proto::RejectCode code,
                                  const std::string& text, uint32_t peer_version) {
  outbox_.emplace_back(peer, make_message(epoch_, incarnation_, [&](auto b) {
                         auto r = b.initReject();
                         r.setCode(code);
                         r.setText(text);
                         r.setPublisherProtocolVersion(proto::PROTOCOL_VERSION);
                         r.setPeerProtocolVersion(peer_version);
                         r.setTargetIncarnation(target);
                       }));
}

void ControlServer::status_reply_locked(const std::string& peer, uint64_t request_id) {
  const auto now = Clock::now();
  outbox_.emplace_back(peer, make_message(epoch_, incarnation_, [&](auto b) {
    auto s = b.initStatusReply();
    s.setRequestId(request_id);
    s.setEpoch(epoch_);
    s.setPublishedVersion(published_version_);
    s.setExpected(static_cast<uint32_t>(opt_.subscriber_ids.empty() ? opt_.subscriber_count
                                                                    : static_cast<int>(opt_.subscriber_ids.size())));
    s.setBackend(opt_.backend == Backend::kNccl ? proto::Backend::NCCL : proto::Backend::GLOO);
    auto list = s.initMembers(static_cast<unsigned>(members_.size()));
    unsigned i = 0;
    for (auto& [id, m] : members_) {
      auto e = list[i++];
      e.setWorkerId(id);
      e.setRank(m.lost ? -1 : m.rank);
      e.setWeightVersion(m.weight_version);
      e.setState(m.state);
      e.setLastHeartbeatAgeMs(static_cast<uint64_t>(ms_since(m.last_seen, now)));
      e.setHost(m.host);
      e.setPid(m.pid);
      set_device(e.initDevice(), m.device);
      e.setLost(m.lost);
    }
  }));
}

}  // namespace control
}  // namespace paramcast
