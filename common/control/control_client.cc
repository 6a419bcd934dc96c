#include "common/control/control_client.h"

#include <unistd.h>

#include <cstdio>

#include "common/control/messages.h"
#include "common/log.h"

namespace paramcast::control {
namespace {
// "probe/<id>/<nonce>" or "member/<id>/<nonce>", a fresh nonce each time: a
// new connection never collides with an old one the publisher still holds.
std::string identity(const char* kind, const std::string& id) {
  char nonce[24];
  std::snprintf(nonce, sizeof nonce, "%016llx", static_cast<unsigned long long>(new_incarnation()));
  return std::string(kind) + "/" + id + "/" + nonce;
}
}  // namespace

ControlClient::ControlClient(ClientOptions options, Listener* listener)
    : opt_(std::move(options)), incarnation_(new_incarnation()), listener_(listener) {}

ControlClient::~ControlClient() { stop(); }

void ControlClient::start() {
  thread_ = std::thread([this] { loop(); });
}

void ControlClient::stop() {
  if (stopping_.exchange(true)) return;
  wake_.notify();
  if (thread_.joinable()) thread_.join();
}

void ControlClient::send(zmq::message_t frame) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.push_back(std::move(frame));
  }
  wake_.notify();
}

std::unique_ptr<zmq::socket_t> ControlClient::make_socket(const std::string& identity) {
  const auto& c = opt_.control;
  auto s = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
  s->set(zmq::sockopt::routing_id, identity);
  apply_client_auth(*s, opt_.auth);
  set_zmtp_heartbeats(*s, c);
  set_keepalive(*s, c);
  s->set(zmq::sockopt::linger, 0);
  s->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(opt_.control.max_message_bytes + 1024));
  s->set(zmq::sockopt::reconnect_ivl, 100);
  // A SYN into a dead link is abandoned and tried again, not left to the kernel's backoff.
  s->set(zmq::sockopt::connect_timeout, static_cast<int>(c.heartbeat_timeout.count()));
  s->set(zmq::sockopt::reconnect_ivl_max, static_cast<int>(opt_.control.reconnect_backoff_max.count()));
  s->connect(opt_.control.endpoint);
  return s;
}

void ControlClient::send_on(zmq::socket_t& socket, zmq::message_t frame) {
  try {
    if (!socket.send(frame, zmq::send_flags::dontwait)) PC_DEBUG(opt_.worker_id << ": control send queue full");
  } catch (const zmq::error_t& e) {
    PC_DEBUG(opt_.worker_id << ": control send failed: " << e.what());
  }
}

void ControlClient::flush_outbox() {
  std::deque<zmq::message_t> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(outbox_);
  }
  // Before the first probe answer there is no member connection, and nothing to say.
  if (dealer_)
    for (auto& f : out) send_on(*dealer_, std::move(f));
}

zmq::message_t ControlClient::hello_message() {
  const WeightReport w = listener_->weight_report();
  return make_message(0, incarnation_, [&](auto b) {
    auto h = b.initHello();
    h.setProtocolVersion(opt_.protocol_version_override ? opt_.protocol_version_override : proto::PROTOCOL_VERSION);
    h.setWorkerId(opt_.worker_id);
    h.setEngineId(opt_.worker_id);
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    h.setHost(host);
    h.setPid(static_cast<uint32_t>(getpid()));
    set_device(h.initDevice(), opt_.device);
    auto caps = h.initCapabilities(static_cast<unsigned>(opt_.capabilities.size()));
    for (size_t i = 0; i < opt_.capabilities.size(); ++i) caps.set(static_cast<unsigned>(i), opt_.capabilities[i]);
    h.setWeightVersion(w.version);
    h.setState(w.state);
    h.setDirtyVersion(w.dirty_version);
    h.setDeltaBase(w.delta_base);
    h.setHostIdentity(opt_.host_identity);
  });
}

void ControlClient::loop() {
  // The member connection opens only once a probe was answered, so a
  // duplicate never connects under an id that a live member holds.
  probe_ = make_socket(identity("probe", opt_.worker_id));
  phase_ = Phase::kProbing;
  next_hello_ = next_beat_ = last_heard_ = Clock::now();
  const auto interval = opt_.control.heartbeat_interval;
  LoopPause pause(interval / 4, interval);
  while (!stopping_) {
    poll_once();
    const auto now = Clock::now();
    last_heard_ = excuse(last_heard_, pause.away(now), now);  // this thread's pause is not the publisher's silence
    if (refused_) continue;  // refused for good: the owner reports it and decides
    if (fresh_probe_) {
      fresh_probe_ = false;
      probe_.reset();
    }
    if (phase_ != Phase::kMember && now >= next_hello_) {
      if (phase_ == Phase::kProbing && !probe_) probe_ = make_socket(identity("probe", opt_.worker_id));
      send_on(phase_ == Phase::kProbing ? *probe_ : *dealer_, hello_message());
      next_hello_ = now + backoff_;
      backoff_ = std::min(backoff_ * 2, opt_.control.reconnect_backoff_max);
    }
    keep_membership(now);
    if (phase_ == Phase::kProbing && rejoin_requested_) {
      rejoin_requested_ = false;
      // Fresh connections: the old ones may sit in TCP retransmission or
      // reconnect backoff long after the link healed.
      dealer_.reset();
      probe_ = make_socket(identity("probe", opt_.worker_id));
      backoff_ = std::chrono::milliseconds(100);
      next_hello_ = now;
    }
  }
  flush_outbox();
  if (phase_ == Phase::kMember && dealer_) {
    send_on(*dealer_, make_message(epoch_, incarnation_, [](auto b) { b.initLeave().setReason("subscriber stopping"); }));
    // Linger 0 would drop the Leave still queued for the I/O thread, and the
    // publisher would name this clean stop a loss a heartbeat timeout later.
    // The context's teardown waits at most this long for it.
    dealer_->set(zmq::sockopt::linger, 200);
  }
  probe_.reset();
  dealer_.reset();
}

void ControlClient::poll_once() {
  std::vector<zmq::pollitem_t> items = {{nullptr, wake_.fd(), ZMQ_POLLIN, 0}};
  if (dealer_) items.push_back({dealer_->handle(), 0, ZMQ_POLLIN, 0});
  if (probe_) items.push_back({probe_->handle(), 0, ZMQ_POLLIN, 0});
  try {
    zmq::poll(items.data(), items.size(),
              std::chrono::milliseconds(std::max<int64_t>(1, opt_.control.heartbeat_interval.count() / 4)));
  } catch (const zmq::error_t&) {
  }
  if (items[0].revents & ZMQ_POLLIN) wake_.drain();
  flush_outbox();
  receive_from(probe_.get());
  if (probe_ && phase_ != Phase::kProbing) after_probe_answer();
  else receive_from(dealer_.get());
  flush_outbox();  // answers (PlanAccept, StoreSet, ...) leave now, not after the next poll
}

void ControlClient::receive_from(zmq::socket_t* socket) {
  for (int i = 0; socket && i < 1000; ++i) {
    zmq::message_t msg;
    if (!socket->recv(msg, zmq::recv_flags::dontwait)) return;
    last_heard_ = Clock::now();
    handle(msg);
    if (socket == probe_.get() && phase_ != Phase::kProbing) return;  // probe answered
  }
}

void ControlClient::after_probe_answer() {
  probe_.reset();
  if (!dealer_) dealer_ = make_socket(identity("member", opt_.worker_id));
  next_hello_ = Clock::now();
}

void ControlClient::keep_membership(Clock::time_point now) {
  if (phase_ != Phase::kMember) return;
  if (now >= next_beat_) {
    next_beat_ = now + opt_.control.heartbeat_interval;
    // Report first, then flush: an answer the report says was queued leaves
    // before this heartbeat, on the same ordered connection.
    const WeightReport w = listener_->weight_report();
    flush_outbox();
    send_on(*dealer_, make_message(epoch_, incarnation_, [&](auto b) {
              auto h = b.initHeartbeat();
              h.setWeightVersion(w.version);
              h.setState(w.state);
              h.setDirtyVersion(w.dirty_version);
              h.setDeltaBase(w.delta_base);
              h.setAckSeq(ack_seq_);
              h.setPlanVersion(w.plan_version);
              h.setAnsweredVersion(w.answered_version);
              h.setCommitVersion(w.commit_version);
              h.setAppliedVersion(w.applied_version);
              h.setReceivingVersion(w.receiving_version);
              h.setReceivedBytes(w.received_bytes);
            }));
  }
  if (now - last_heard_ > opt_.control.heartbeat_timeout) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard_).count();
    PC_WARN(opt_.worker_id << ": publisher lost (silent for " << ms << "ms); reconnecting");
    lose_membership("publisher lost");
  }
}

void ControlClient::lose_membership(const std::string& why) {
  phase_ = Phase::kProbing;
  rejoin_requested_ = true;
  joined_ = false;
  listener_->on_membership_lost(why);
}

void ControlClient::inject(const void* data, size_t size) {
  zmq::message_t frame(data, size);
  handle(frame);
  std::lock_guard<std::mutex> lock(mu_);
  outbox_.clear();
}

void ControlClient::handle(const zmq::message_t& msg) {
  DecodeLimits limits;
  limits.max_bytes = opt_.control.max_message_bytes;
  auto decoded = decode(msg.data(), msg.size(), limits);
  if (!decoded.ok()) {
    PC_WARN(opt_.worker_id << ": dropped frame from the publisher: " << decoded.status().message());
    return;
  }
  try {
    dispatch(decoded.value()->envelope());
  } catch (const kj::Exception& e) {
    PC_WARN(opt_.worker_id << ": dropped malformed message from the publisher: " << e.getDescription().cStr());
  }
}

void ControlClient::dispatch(proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  auto body = env.getBody();
  switch (body.which()) {
    case B::WELCOME:
      if (body.getWelcome().getProbe()) {
        if (phase_ == Phase::kProbing) phase_ = Phase::kJoining;
        return;
      }
      phase_ = Phase::kMember;
      ack_seq_ = 0;  // heartbeat seqs count per publisher incarnation
      if (!joined_.exchange(true)) {
        PC_INFO(opt_.worker_id << ": joined publisher at " << opt_.control.endpoint);
        listener_->on_joined();
      }
      return;
    case B::REJECT: {
      auto r = body.getReject();
      if (r.getTargetIncarnation() != 0 && r.getTargetIncarnation() != incarnation_) return;
      if (r.getCode() == proto::RejectCode::NOT_MEMBER || r.getCode() == proto::RejectCode::STALE_EPOCH) {
        if (phase_ == Phase::kJoining) {  // the probe's admission expired: probe again
          phase_ = Phase::kProbing;
          rejoin_requested_ = true;
          return;
        }
        if (phase_ != Phase::kMember) return;  // already joining again
        PC_WARN(opt_.worker_id << ": publisher says: " << printable(r.getText().cStr(), 256) << "; rejoining");
        lose_membership("expelled by the publisher");
        return;
      }
      if (r.getCode() == proto::RejectCode::DUPLICATE_ID && opt_.wait_out_duplicate_id) {
        if (phase_ == Phase::kMember) return;
        phase_ = Phase::kProbing;
        if (const auto now = Clock::now(); now - duplicate_warned_ >= std::chrono::seconds(30)) {
          duplicate_warned_ = now;
          PC_WARN(opt_.worker_id << ": publisher says: " << printable(r.getText().cStr(), 256)
                                 << "; trying again until that member is gone (warned every 30 s)");
        }
        fresh_probe_ = true;  // at the next hello (backoff), not under this socket's read
        return;
      }
      refused_ = true;
      Status why = rejected(std::string("publisher rejected worker '") + opt_.worker_id + "': " + printable(r.getText().cStr(), 512));
      PC_ERROR(opt_.worker_id << ": " << why.message());
      listener_->on_refused(why);
      return;
    }
    case B::LEAVE:
      PC_INFO(opt_.worker_id << ": publisher left (" << printable(body.getLeave().getReason().cStr(), 256)
                             << "); will rejoin when one is back");
      lose_membership("publisher left");
      return;
    case B::HEARTBEAT:
      ack_seq_ = std::max(ack_seq_, body.getHeartbeat().getSeq());
      return;
    case B::STATUS_REPLY:
      return;
    default:
      break;
  }
  if (joined_) listener_->on_message(env);
}

}  // namespace paramcast::control
