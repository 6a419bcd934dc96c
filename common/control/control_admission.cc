// ControlServer's admission: Hello on the probe and member connections,
// duplicates, restarts, Welcome / Reject and StatusReply (see
// control_server.h and docs/protocol.md, "Joining").
#include <algorithm>

#include "common/control/control_server.h"
#include "common/control/messages.h"
#include "common/log.h"

namespace paramcast::control {
namespace {
int64_t ms_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - t).count();
}
constexpr size_t kMaxPendingProbes = 256;
constexpr size_t kMaxProbed = 1024;
}  // namespace

void ControlServer::hello_locked(const Sender& from, uint64_t inc, proto::Hello::Reader h, Deliveries& out) {
  const std::string& peer = from.peer;
  const std::string id = h.getWorkerId().cStr();
  if (h.getProtocolVersion() != proto::PROTOCOL_VERSION) {
    log_peer("wrong protocol version", "rejected '" + printable(id) + "': protocol version " +
                                           std::to_string(h.getProtocolVersion()) + ", publisher speaks " +
                                           std::to_string(proto::PROTOCOL_VERSION));
    reject_locked(peer, inc, proto::RejectCode::VERSION_MISMATCH,
                  "protocol version mismatch: subscriber speaks " + std::to_string(h.getProtocolVersion()) +
                      ", publisher speaks " + std::to_string(proto::PROTOCOL_VERSION),
                  h.getProtocolVersion());
    return;
  }
  if (!valid_worker_id(id)) {
    note_dropped(peer, "Hello with invalid worker id '" + printable(id) + "'");
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "worker id '" + printable(id) + "' is not valid: 1-64 of [A-Za-z0-9._-], and 'publisher' is reserved");
    return;
  }
  if (from.route.kind == Route::Kind::kOther || from.route.id != id) {
    note_dropped(peer, "Hello for '" + id + "' from a connection that does not carry that id");
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "worker id '" + id + "' differs from the connection's routing identity (expected probe/" + id +
                      "/NONCE or member/" + id + "/NONCE)");
    return;
  }
  const auto& ids = opt_.subscriber_ids;
  if (!ids.empty() && std::find(ids.begin(), ids.end(), id) == ids.end()) {
    note_dropped(peer, "Hello for unknown worker id '" + id + "'");
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "worker id '" + id + "' is not one of this deployment's subscribers");
    return;
  }
  if (from.route.kind == Route::Kind::kMember) {
    admit_locked(from, inc, h, out);
    return;
  }
  auto it = members_.find(id);
  const bool known = it != members_.end();
  // Another process holds this id while a live connection still carries
  // it: that is a duplicate, and the first keeps its place. A restarted
  // process finds the old member silent (or its connection gone).
  if (known && !it->second.lost && it->second.incarnation != inc) {
    if (probes_.size() >= kMaxPendingProbes) return;  // the prober retries with backoff
    // Decide once the member had two heartbeat intervals to show it lives.
    probes_.push_back({peer, id, inc, Clock::now(),
                       printable(h.getHost().cStr()) + " pid " + std::to_string(h.getPid())});
    return;
  }
  if (!known && ids.empty() && !has_free_slot_locked(id)) {
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "the deployment expects " + std::to_string(opt_.subscriber_count) + " subscribers and all are present");
    return;
  }
  welcome_probe_locked(peer, id, inc);
}

// A probe passed: its member connection may say Hello for a while.
void ControlServer::welcome_probe_locked(const std::string& peer, const std::string& id, uint64_t inc) {
  if (probed_.size() >= kMaxProbed) prune_locked(Clock::now());
  if (probed_.size() >= kMaxProbed) probed_.clear();  // a flood: its probers start over
  probed_[id] = {inc, Clock::now()};
  welcome_locked(peer, inc, /*probe=*/true);
}

// A Hello on the member connection: the membership itself. Taken only from
// the incarnation whose probe was just answered, or repeated on the same
// connection.
void ControlServer::admit_locked(const Sender& from, uint64_t inc, proto::Hello::Reader h, Deliveries& out) {
  const std::string& peer = from.peer;
  const std::string& id = from.route.id;
  const auto now = Clock::now();
  auto it = members_.find(id);
  if (it != members_.end() && it->second.incarnation == inc && !it->second.lost && it->second.route == peer) {
    it->second.last_seen = now;  // a repeated Hello: answer it again
    welcome_locked(peer, inc, false);
    return;
  }
  auto probed = probed_.find(id);
  if (probed == probed_.end() || probed->second.first != inc) {
    note_dropped(peer, "Hello for '" + id + "' from a connection that did not pass the probe");
    reject_locked(peer, inc, proto::RejectCode::NOT_MEMBER,
                  "worker id '" + id + "': say Hello from the probe identity first");
    return;
  }
  probed_.erase(probed);
  MemberEvent::Kind kind = MemberEvent::Kind::kJoined;
  int old_rank = -1;
  if (it != members_.end()) {
    // A restart (new incarnation), a return after being declared lost, or
    // the same process on a fresh connection after it lost us: either way it
    // left its group, so the next update re-forms one with it.
    kind = MemberEvent::Kind::kRejoined;
    old_rank = it->second.rank;
  } else if (opt_.subscriber_ids.empty() && !has_free_slot_locked(id)) {
    reject_locked(peer, inc, proto::RejectCode::UNKNOWN_ID,
                  "the deployment expects " + std::to_string(opt_.subscriber_count) + " subscribers and all are present");
    return;
  }
  Member m;
  m.id = id;
  m.incarnation = inc;
  m.route = peer;
  m.host = h.getHost().cStr();
  // Compared byte for byte with the publisher's own: bounded, never logged raw.
  if (h.getHostIdentity().size() <= 256) m.host_identity = h.getHostIdentity().cStr();
  m.pid = h.getPid();
  m.device = get_device(h.getDevice());
  m.last_seen = now;
  m.weight_version = h.getWeightVersion();
  m.delta_base = h.getDeltaBase();
  m.state = h.getState();
  m.dirty_version = h.getDirtyVersion();
  for (auto cap : h.getCapabilities()) {
    if (cap == "delta") m.delta = true;
    if (cap == "source") m.source = true;
    if (cap == "link_check") m.link_check = true;
  }
  members_[id] = m;
  const std::string who = printable(m.host) + " pid " + std::to_string(m.pid);
  PC_INFO("publisher: subscriber '" << id << "' " << member_event_name(kind) << " (" << who << ", "
                                    << m.device.to_string() << ", holds v" << m.weight_version << " "
                                    << state_name(m.state) << ")");
  out.events.push_back({event_locked(kind, id, who), old_rank});
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
      log_peer("duplicate worker id", "rejected duplicate worker id '" + p->id + "' from " + p->who +
                                          " (held by " + printable(m.host) + " pid " + std::to_string(m.pid) + ")");
      reject_locked(p->peer, p->incarnation, proto::RejectCode::DUPLICATE_ID,
                    "worker id '" + p->id + "' is already used by a live subscriber");
    } else {
      welcome_probe_locked(p->peer, p->id, p->incarnation);
    }
    p = probes_.erase(p);
  }
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
    s.setBackend(static_cast<proto::Backend>(backend_wire(opt_.backend)));
    s.setDelta(delta_.mode);
    s.setBaselineBytes(delta_.baseline_bytes);
    s.setBaselineVersion(delta_.baseline_version);
    s.setLastBytes(delta_.last_bytes);
    s.setLastWireBytes(delta_.last_wire_bytes);
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
      if (m.receiving_version) {
        e.setReceivingVersion(m.receiving_version);
        e.setReceivedBytes(m.received_bytes);
        e.setReceivingForMs(static_cast<uint64_t>(ms_since(m.receiving_since, now)));
      }
      e.setLastUpdateVersion(m.last_update_version);
      e.setLastUpdateOk(m.last_update_ok);
      e.setLastUpdateBytes(m.last_update_bytes);
      e.setLastUpdateMs(m.last_update_ms);
      e.setLastUpdateLinkRate(m.last_update_link_rate);
    }
  }));
}

}  // namespace paramcast::control
