#include "common/control/codec.h"

#include <cstring>

namespace paramcast::control {

zmq::message_t encode(capnp::MessageBuilder& message) {
  kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
  auto bytes = flat.asBytes();
  return zmq::message_t(bytes.begin(), bytes.size());
}

StatusOr<std::unique_ptr<Decoded>> decode(const void* data, size_t size, const DecodeLimits& limits) {
  if (size > limits.max_bytes)
    return protocol_error("frame of " + std::to_string(size) + " bytes exceeds max_message_size " +
                          std::to_string(limits.max_bytes));
  if (size == 0 || size % sizeof(capnp::word) != 0)
    return protocol_error("frame of " + std::to_string(size) + " bytes is not a whole number of 8-byte words");
  auto out = std::make_unique<Decoded>();
  // ZeroMQ gives no alignment guarantee; Cap'n Proto needs word alignment.
  out->words_ = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  std::memcpy(out->words_.begin(), data, size);
  capnp::ReaderOptions options;
  options.traversalLimitInWords = limits.traversal_words ? limits.traversal_words : (size / 8) * 4 + 1024;
  options.nestingLimit = limits.nesting;
  try {
    out->reader_ = std::make_unique<capnp::FlatArrayMessageReader>(out->words_.asPtr(), options);
    out->envelope_ = out->reader_->getRoot<proto::Envelope>();
    // Touch the union discriminant so that a broken root pointer fails here.
    (void)out->envelope_.getBody().which();
  } catch (const kj::Exception& e) {
    return protocol_error(std::string("undecodable frame: ") + e.getDescription().cStr());
  }
  return out;
}

const char* body_name(proto::Envelope::Reader envelope) {
  using B = proto::Envelope::Body;
  try {
    switch (envelope.getBody().which()) {
      case B::HELLO: return "hello";
      case B::WELCOME: return "welcome";
      case B::REJECT: return "reject";
      case B::JOIN_GROUP: return "joinGroup";
      case B::GROUP_READY: return "groupReady";
      case B::GROUP_FAILED: return "groupFailed";
      case B::HEARTBEAT: return "heartbeat";
      case B::LEAVE: return "leave";
      case B::ERROR: return "error";
      case B::STORE_SET: return "storeSet";
      case B::STORE_GET: return "storeGet";
      case B::STORE_VALUE: return "storeValue";
      case B::PLAN: return "plan";
      case B::PLAN_ACCEPT: return "planAccept";
      case B::PLAN_REJECT: return "planReject";
      case B::COMMIT: return "commit";
      case B::ABANDON: return "abandon";
      case B::BUCKET_CHECKSUMS: return "bucketChecksums";
      case B::APPLIED: return "applied";
      case B::STATUS_REQUEST: return "statusRequest";
      case B::STATUS_REPLY: return "statusReply";
    }
  } catch (const kj::Exception&) {
  }
  return "unknown";
}

}  // namespace paramcast::control
