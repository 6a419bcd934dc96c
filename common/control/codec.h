// Framing of control messages: one Cap'n Proto Envelope per ZeroMQ frame.
//
// encode() flattens a builder into a frame. decode() reads a frame with
// explicit limits (size, traversal, nesting) so that a hostile or broken peer
// cannot make a reader allocate or recurse without bound; any malformed frame
// becomes a kProtocol Status, never an exception or a crash.
//
// Thread-safety: stateless functions; a Decoded is owned by one thread.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <memory>
#include <zmq.hpp>

#include "common/status.h"
#include "schemas/control.capnp.h"

namespace paramcast::control {

struct DecodeLimits {
  uint64_t max_bytes = 64ull << 20;
  uint64_t traversal_words = 0;  // 0: derived from max_bytes
  int nesting = 16;
};

// A decoded envelope, keeping the bytes it points into alive.
class Decoded {
 public:
  proto::Envelope::Reader envelope() const { return envelope_; }

 private:
  friend StatusOr<std::unique_ptr<Decoded>> decode(const void*, size_t, const DecodeLimits&);
  kj::Array<capnp::word> words_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
  proto::Envelope::Reader envelope_;
};

zmq::message_t encode(capnp::MessageBuilder& message);
StatusOr<std::unique_ptr<Decoded>> decode(const void* data, size_t size, const DecodeLimits& limits);

// Name of the union member, for log lines ("hello", "plan", ...).
const char* body_name(proto::Envelope::Reader envelope);

}  // namespace paramcast::control
