// Helpers shared by both ends of the control channel: building envelopes,
// device descriptions, incarnation ids.
#pragma once

#include <capnp/message.h>

#include <algorithm>
#include <climits>
#include <random>
#include <string>
#include <zmq.hpp>

#include "common/config.h"
#include "common/control/codec.h"
#include "common/tensor.h"

namespace paramcast::control {

// Builds one Envelope; `fill` sets the body through Envelope::Body::Builder.
template <typename F>
zmq::message_t make_message(uint64_t epoch, uint64_t incarnation, F&& fill) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<proto::Envelope>();
  env.setEpoch(epoch);
  env.setIncarnation(incarnation);
  fill(env.initBody());
  clamp_text_fields(env);
  return encode(builder);
}

// ZMTP heartbeats on a control socket: every heartbeat_interval, and a
// connection silent for 4 x heartbeat_timeout is dropped (ours, and, by
// the TTL, the peer's). Who is lost is the members' and the publisher's own
// judgement at heartbeat_timeout (LoopPause excuses a process's own
// stall); this drop only frees a dead connection. At heartbeat_timeout it
// would also fire in a process resumed from a stall (libzmq runs its expired
// timers before it reads what arrived meanwhile) and in its peer: the
// peer's reconnect, under the routing id of a connection not yet dropped
// here, is held anonymous without handover, and that member heard nothing
// until its own heartbeat_timeout (PausedPublisherTest, now and then).
inline void set_zmtp_heartbeats(zmq::socket_t& s, const ControlOptions& c) {
  const int drop_ms = static_cast<int>(std::min<int64_t>(4 * c.heartbeat_timeout.count(), INT32_MAX));
  s.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(c.heartbeat_interval.count()));
  s.set(zmq::sockopt::heartbeat_ttl, std::min(drop_ms, 6553500));  // ZMTP carries the TTL in deciseconds (16 bits)
  s.set(zmq::sockopt::heartbeat_timeout, drop_ms);
}

// TCP keepalive on a control socket, so that a connection over a dead link
// is noticed by the kernel too (ZMTP heartbeats do it on the ZeroMQ level).
inline void set_keepalive(zmq::socket_t& s, const ControlOptions& c) {
  const int idle_s = static_cast<int>(std::max<int64_t>(1, c.heartbeat_timeout.count() / 1000));
  s.set(zmq::sockopt::tcp_keepalive, 1);
  s.set(zmq::sockopt::tcp_keepalive_idle, idle_s);
  s.set(zmq::sockopt::tcp_keepalive_intvl, 1);
  s.set(zmq::sockopt::tcp_keepalive_cnt, 3);
}

inline uint64_t new_incarnation() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v ? v : 1;
}

inline void set_device(proto::DeviceInfo::Builder b, Device d) {
  b.setKind(d.is_cuda() ? proto::DeviceKind::CUDA : proto::DeviceKind::CPU);
  b.setIndex(d.index);
}
inline Device get_device(proto::DeviceInfo::Reader r) {
  return r.getKind() == proto::DeviceKind::CUDA ? Device::cuda(r.getIndex()) : Device::cpu();
}

inline const char* state_name(proto::WeightState s) {
  switch (s) {
    case proto::WeightState::EMPTY: return "empty";
    case proto::WeightState::CONSISTENT: return "consistent";
    case proto::WeightState::DIRTY: return "dirty";
  }
  return "?";
}

}  // namespace paramcast::control
