// Framing of control messages: one Cap'n Proto Envelope per ZeroMQ frame.
//
// encode() flattens a builder into a frame. decode() reads a frame with
// explicit limits (size, traversal, nesting, length of every text field) so that a hostile or broken peer
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

// Text fields longer than these are refused on decode: ids, host names, keys
// and dtypes; tensor names; free texts (reasons, errors).
inline constexpr size_t kMaxIdBytes = 255;
inline constexpr size_t kMaxNameBytes = 1024;
inline constexpr size_t kMaxTextBytes = 4096;

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

// Empty, or which text field of `envelope` exceeds its length limit.
std::string check_text_limits(proto::Envelope::Reader envelope);

// Cuts every text field of `envelope` to its limit (make_message does this,
// so that a long error text is shortened rather than refused by the peer).
void clamp_text_fields(proto::Envelope::Builder envelope);

// Name of the union member, for log lines ("hello", "plan", ...).
const char* body_name(proto::Envelope::Reader envelope);

}  // namespace paramcast::control
