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
int64_t ms_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - t).count();
}
// A property the transport attached to a received frame ("" when absent).
std::string frame_property(const zmq::message_t& frame, const char* name) {
  const char* v = zmq_msg_gets(frame.handle(), name);
  return v ? v : "";
}
}  // namespace

Route parse_route(const std::string& r) {
  Route out;
  const auto first = r.find('/');
  const auto last = r.rfind('/');
  if (first == std::string::npos || last <= first + 1 || last + 1 == r.size()) return out;
  const std::string kind = r.substr(0, first);
  if (kind != "probe" && kind != "member") return out;
  out.kind = kind == "probe" ? Route::Kind::kProbe : Route::Kind::kMember;
  out.id = r.substr(first + 1, last - first - 1);
  return out;
}

ControlServer::ControlServer(ServerOptions options)
    : opt_(std::move(options)), incarnation_(new_incarnation()), router_(ctx_, zmq::socket_type::router) {}

ControlServer::~ControlServer() { stop("publisher shutting down"); }

Status ControlServer::start(Listener* listener) {
  listener_ = listener;
  const auto& c = opt_.control;
  try {
    auto auth = server_auth(opt_.auth);
    if (!auth.ok()) return auth.status();
    auth_ = std::move(*auth);
    if (auth_.curve) {
      zap_ = std::make_unique<ZapHandler>(ctx_, auth_.users);
      apply_server_auth(router_, auth_);
    }
    // No handover: a connection never takes over the routing identity of a
    // live one. Every subscriber connection carries a fresh nonce in its
    // identity, so a restart or reconnect needs no takeover either. ZMTP
    // heartbeats and TCP keepalive drop connections of peers that went
    // silent (a stopped process, a cut link): set_zmtp_heartbeats says when.
    router_.set(zmq::sockopt::router_handover, 0);
    set_zmtp_heartbeats(router_, c);
    set_keepalive(router_, c);
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
        outbox_.emplace_back(m.route, make_message(epoch_, incarnation_, [&](auto b) { b.initLeave().setReason(reason); }));
  }
  wake_.notify();
  if (thread_.joinable()) thread_.join();
}

uint64_t ControlServer::send(const std::string& id, zmq::message_t frame) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_locked(id, std::move(frame));
    seq = beat_seq_;
  }
  wake_.notify();
  return seq;
}

// To a member's current connection; nothing when it has none.
void ControlServer::queue_locked(const std::string& id, zmq::message_t frame) {
  auto it = members_.find(id);
  if (it == members_.end() || it->second.route.empty()) {
    PC_DEBUG("publisher: nothing sent to '" << id << "': no connection of that member");
    return;
  }
  outbox_.emplace_back(it->second.route, std::move(frame));
}

uint64_t ControlServer::send_to(const std::vector<std::string>& ids, const zmq::message_t& frame) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : ids) {
      zmq::message_t copy;
      copy.copy(const_cast<zmq::message_t&>(frame));
      queue_locked(id, std::move(copy));
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

std::vector<std::string> ControlServer::live_ids() const { return live().ids; }

ControlServer::Live ControlServer::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  Live live;
  for (const auto& [id, m] : members_)
    if (!m.lost) live.ids.push_back(id);
  live.generation = generation_;
  return live;
}

MemberEvent ControlServer::event_locked(MemberEvent::Kind kind, const std::string& id, std::string detail) {
  return MemberEvent{kind, id, std::move(detail), ++generation_};
}

bool ControlServer::is_live(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  return it != members_.end() && !it->second.lost;
}

void ControlServer::set_member_weights(const std::string& id, uint64_t version, proto::WeightState state,
                                       uint64_t delta_base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return;
  if (state == proto::WeightState::CONSISTENT) it->second.weight_version = version;
  it->second.state = state;
  it->second.delta_base = delta_base;
}

void ControlServer::set_member_last_update(const std::string& id, uint64_t version, bool ok, uint64_t bytes,
                                           uint64_t ms) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return;
  it->second.last_update_version = version;
  it->second.last_update_ok = ok;
  it->second.last_update_bytes = bytes;
  it->second.last_update_ms = ms;
  it->second.last_update_link_rate = 0;  // known once the publisher has every member's figures
  if (it->second.receiving_version == version) it->second.receiving_version = 0;  // done, whatever the next heartbeat says
}

void ControlServer::set_member_link_rate(const std::string& id, uint64_t version, uint64_t link_rate) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it != members_.end() && it->second.last_update_version == version) it->second.last_update_link_rate = link_rate;
}

std::optional<Member> ControlServer::member(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return std::nullopt;
  return it->second;
}

std::vector<Member> ControlServer::members() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Member> rows;
  rows.reserve(members_.size());
  for (const auto& [id, m] : members_) rows.push_back(m);
  return rows;
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
  // Any ids may join: the reserved ids by name, then the lost members, then
  // count the rest.
  const auto& reserved = opt_.reserved_ids;
  for (const auto& id : reserved) {
    auto it = members_.find(id);
    if (it == members_.end() || it->second.lost) missing.push_back(id);
  }
  int live = static_cast<int>(reserved.size() - missing.size());
  for (const auto& [id, m] : members_)
    live += !m.lost && std::find(reserved.begin(), reserved.end(), id) == reserved.end();
  const int absent = opt_.subscriber_count - live;
  for (const auto& [id, m] : members_)
    if (m.lost && static_cast<int>(missing.size()) < absent &&
        std::find(reserved.begin(), reserved.end(), id) == reserved.end())
      missing.push_back(id);
  for (int i = static_cast<int>(missing.size()); i < absent; ++i)
    missing.push_back("<unnamed subscriber " + std::to_string(live + i + 1) + " of " +
                      std::to_string(opt_.subscriber_count) + ">");
  return missing;
}

size_t ControlServer::table_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return members_.size();
}

bool ControlServer::has_free_slot_locked(const std::string& id) const {
  const auto& reserved = opt_.reserved_ids;
  const auto is_reserved = [&](const std::string& x) { return std::find(reserved.begin(), reserved.end(), x) != reserved.end(); };
  if (is_reserved(id)) return true;  // its own slot
  int live = 0;
  for (const auto& [other, m] : members_) live += !m.lost && !is_reserved(other);
  return live < opt_.subscriber_count - static_cast<int>(reserved.size());
}

// ------------------------------------------------------------ control thread

void ControlServer::loop() {
  const auto& c = opt_.control;
  auto next_beat = Clock::now();
  LoopPause pause(c.heartbeat_interval / 4, c.heartbeat_interval);
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
    if (const auto paused = pause.away(now); paused > Clock::duration::zero()) excuse_pause(paused, now);
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
    Sender from{id.to_string(), parse_route(id.to_string()), frame_property(payload, "User-Id"),
                frame_property(payload, "X-Key-Fingerprint")};
    if (router_.get(zmq::sockopt::rcvmore)) {
      zmq::message_t extra;
      while (router_.get(zmq::sockopt::rcvmore)) (void)router_.recv(extra, zmq::recv_flags::none);
      note_dropped(id.to_string(), "message of more than one frame");
      continue;
    }
    handle(from, payload);
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
        PC_DEBUG("publisher: could not send to '" << printable(peer) << "' (queue full)");
    } catch (const zmq::error_t& e) {
      PC_DEBUG("publisher: could not send to '" << printable(peer) << "': " << e.what());
    }
  }
}

void ControlServer::inject(const std::string& peer, const void* data, size_t size, const std::string& user) {
  zmq::message_t frame(data, size);
  handle(Sender{peer, parse_route(peer), user, user.empty() ? "" : "injected"}, frame);
  std::lock_guard<std::mutex> lock(mu_);
  if (outbox_.size() > 1024) outbox_.clear();
}

// Counted always; logged as a line of kind "dropped frame" (log_peer).
void ControlServer::note_dropped(const std::string& peer, const std::string& why) {
  ++dropped_frames_;
  log_peer("dropped frame", "dropped frame from peer '" + printable(peer) + "': " + why);
}

void ControlServer::log_peer(const char* kind, const std::string& line) {
  uint64_t held_back = 0;
  {
    std::lock_guard<std::mutex> lock(log_mu_);
    if (!log_limit_.allow(kind, &held_back)) return;
  }
  PC_WARN("publisher: " << line
                        << (held_back ? " (" + std::to_string(held_back) + " more '" + kind + "' lines not logged)"
                                      : ""));
}

void ControlServer::handle(const Sender& from, const zmq::message_t& payload) {
  DecodeLimits limits;
  limits.max_bytes = opt_.control.max_message_bytes;
  auto decoded = decode(payload.data(), payload.size(), limits);
  if (!decoded.ok()) {
    note_dropped(from.peer, decoded.status().message());
    return;
  }
  try {
    auto envelope = decoded.value()->envelope();
    if (!authorized(from, envelope)) return;
    Deliveries d;
    {
      std::lock_guard<std::mutex> lock(mu_);
      d = dispatch_locked(from, envelope);
    }
    deliver(d, from.route.id, envelope);
  } catch (const kj::Exception& e) {
    note_dropped(from.peer, std::string("malformed message: ") + e.getDescription().cStr());
  }
}

// Curve mode: a message counts only when the key that sent it is bound to
// the worker id its connection claims; status requests need any authorized
// key. Plain mode has no keys to check.
bool ControlServer::authorized(const Sender& from, proto::Envelope::Reader envelope) {
  if (opt_.auth.mode != AuthMode::kCurve) return true;  // start() refuses curve without its keys
  const bool status = envelope.getBody().which() == proto::Envelope::Body::STATUS_REQUEST;
  if (status && !from.user.empty()) return true;
  if (!status && from.route.kind != Route::Kind::kOther && !from.user.empty() && from.user == from.route.id)
    return true;
  note_dropped(from.peer, "key " + (from.fingerprint.empty() ? std::string("<none>") : from.fingerprint) +
                              (from.user.empty() ? std::string(" is not authorized")
                                                 : " is bound to '" + printable(from.user) + "'") +
                              ", not to the worker id this " + body_name(envelope) + " claims ('" +
                              printable(from.route.id) + "')");
  return false;
}

void ControlServer::deliver(const Deliveries& d, const std::string& id, proto::Envelope::Reader envelope) {
  if (!listener_) return;
  for (const auto& [event, rank] : d.events) listener_->on_member_event(event, rank);
  if (d.message) listener_->on_member_message(id, envelope);
}

ControlServer::Deliveries ControlServer::dispatch_locked(const Sender& from, proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  Deliveries out;
  auto body = env.getBody();
  const uint64_t inc = env.getIncarnation();
  const std::string& peer = from.peer;
  if (body.which() == B::STATUS_REQUEST) {
    status_reply_locked(peer, body.getStatusRequest().getRequestId());
    return out;
  }
  if (body.which() == B::HELLO) {
    hello_locked(from, inc, body.getHello(), out);
    return out;
  }
  // Only the member's own connection speaks for it.
  auto it = from.route.kind == Route::Kind::kMember ? members_.find(from.route.id) : members_.end();
  if (it == members_.end() || it->second.route != peer || it->second.incarnation != inc || it->second.lost) {
    if (body.which() != B::LEAVE) {
      // Appended piece by piece: GCC 12 reports a false -Wrestrict for
      // "literal" + std::string&& at -O3.
      std::string text = "this connection is not a member: say Hello first";
      if (it != members_.end() && it->second.lost) {
        text = "'";
        text.append(printable(from.route.id)).append("' was declared lost and expelled from the group: say Hello again");
      }
      reject_locked(peer, inc, proto::RejectCode::NOT_MEMBER, text);
    }
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
      m.delta_base = h.getDeltaBase();
      m.ack_seq = std::min(h.getAckSeq(), beat_seq_);  // a member cannot have seen a later one
      m.plan_version = h.getPlanVersion();
      m.answered_version = h.getAnsweredVersion();
      m.commit_version = h.getCommitVersion();
      m.applied_version = h.getAppliedVersion();
      if (h.getReceivingVersion() != m.receiving_version) m.receiving_since = m.last_seen;
      m.receiving_version = h.getReceivingVersion();
      m.received_bytes = h.getReceivedBytes();
      out.message = true;  // the owner follows the update round with it
      break;
    }
    case B::LEAVE: {
      m.lost = true;
      const std::string reason = body.getLeave().getReason().cStr();
      PC_INFO("publisher: subscriber '" << m.id << "' left: " << printable(reason, 256));
      out.events.push_back({event_locked(MemberEvent::Kind::kLeft, m.id, reason), m.rank});
      break;
    }
    default:
      out.message = true;
  }
  return out;
}

// Bounds the table: departed members beyond kMaxDeparted (oldest first), and
// probe answers nobody followed up within a reconnect cycle.
void ControlServer::prune_locked(Clock::time_point now) {
  const auto stale = 2 * opt_.control.heartbeat_timeout + opt_.control.reconnect_backoff_max;
  for (auto it = probed_.begin(); it != probed_.end();)
    it = now - it->second.second > stale ? probed_.erase(it) : std::next(it);
  std::vector<std::pair<Clock::time_point, std::string>> departed;
  for (const auto& [id, m] : members_)
    if (m.lost) departed.emplace_back(m.last_seen, id);
  if (departed.size() <= kMaxDeparted) return;
  std::sort(departed.begin(), departed.end());
  for (size_t i = 0; i + kMaxDeparted < departed.size(); ++i) members_.erase(departed[i].second);
}

// This thread was away (see LoopPause): its members' silence in that time
// is not theirs.
void ControlServer::excuse_pause(Clock::duration paused, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, m] : members_)
    if (!m.lost) m.last_seen = excuse(m.last_seen, paused, now);
  // A probe waits to see whether the member holding its id is heard after
  // it came: its arrival moves on with them, or a dead holder would look
  // alive and a restarted engine be refused as a duplicate.
  for (auto& p : probes_) p.arrived = excuse(p.arrived, paused, now);
  // Always where it could have cost a member; smaller ones once in 10 s.
  const bool costly = paused >= opt_.control.heartbeat_timeout;
  if (costly || (paused >= opt_.control.heartbeat_timeout / 4 && now - pause_logged_ > std::chrono::seconds(10))) {
    pause_logged_ = now;
    PC_WARN("publisher: the control thread did not run for "
            << std::chrono::duration_cast<std::chrono::milliseconds>(paused).count()
            << "ms (an overloaded or paused machine); members' silence in that time is not counted");
  }
}

void ControlServer::check_liveness(Clock::time_point now) {
  std::vector<std::pair<MemberEvent, int>> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    prune_locked(now);
    ++beat_seq_;
    for (auto& [id, m] : members_) {
      if (m.lost) continue;
      if (now - m.last_seen > opt_.control.heartbeat_timeout) {
        m.lost = true;
        const auto ms = ms_since(m.last_seen, now);
        PC_WARN("publisher: subscriber '" << id << "' lost: silent for " << ms << "ms (heartbeat_timeout "
                                          << opt_.control.heartbeat_timeout.count() << "ms)");
        lost.push_back({event_locked(MemberEvent::Kind::kLost, id, "silent for " + std::to_string(ms) + "ms"), m.rank});
        continue;
      }
      outbox_.emplace_back(m.route, make_message(epoch_, incarnation_, [&](auto b) {
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

}  // namespace control
}  // namespace paramcast
