#include "common/control/codec.h"

#include <capnp/dynamic.h>

#include <cstring>
#include <string_view>

#include "common/control/log_guard.h"

namespace paramcast::control {
namespace {

// Length limits of text fields, by field name (see docs/protocol.md).
size_t text_limit(std::string_view field) {
  static constexpr std::string_view kNames[] = {"workerId", "engineId", "host",  "pciBusId",
                                                "key",      "dtype",    "members", "capabilities"};
  for (auto n : kNames)
    if (n == field) return kMaxIdBytes;
  if (field == "name") return kMaxNameBytes;
  return kMaxTextBytes;
}

void check_text(capnp::Text::Reader t, std::string_view field, std::string& problem) {
  if (problem.empty() && t.size() > text_limit(field))
    problem = "text field '" + std::string(field) + "' of " + std::to_string(t.size()) + " bytes exceeds its limit of " +
              std::to_string(text_limit(field)) + " (starts '" + printable({t.cStr(), std::min<size_t>(t.size(), 32)}, 32) + "')";
}

void check_struct(capnp::DynamicStruct::Reader s, std::string& problem);

void check_value(capnp::DynamicValue::Reader v, std::string_view field, std::string& problem) {
  switch (v.getType()) {
    case capnp::DynamicValue::TEXT: check_text(v.as<capnp::Text>(), field, problem); break;
    case capnp::DynamicValue::STRUCT: check_struct(v.as<capnp::DynamicStruct>(), problem); break;
    case capnp::DynamicValue::LIST:
      for (auto e : v.as<capnp::DynamicList>()) {
        if (!problem.empty()) return;
        check_value(e, field, problem);
      }
      break;
    default: break;
  }
}

void check_struct(capnp::DynamicStruct::Reader s, std::string& problem) {
  auto visit = [&](capnp::StructSchema::Field f) {
    if (!problem.empty() || !s.has(f)) return;
    const auto which = f.getType().which();
    if (which == capnp::schema::Type::TEXT || which == capnp::schema::Type::STRUCT ||
        which == capnp::schema::Type::LIST)
      check_value(s.get(f), f.getProto().getName().cStr(), problem);
  };
  for (auto f : s.getSchema().getNonUnionFields()) visit(f);
  KJ_IF_MAYBE(f, s.which()) { visit(*f); }
}

// Sender side: cuts a too-long text to its limit on a UTF-8 boundary.
std::string clamped(capnp::Text::Reader t, std::string_view field) {
  size_t n = text_limit(field) - 3;
  while (n > 0 && (static_cast<unsigned char>(t.cStr()[n]) & 0xc0) == 0x80) --n;
  return std::string(t.cStr(), n) + "...";
}

void clamp_struct(capnp::DynamicStruct::Builder s) {
  auto visit = [&](capnp::StructSchema::Field f) {
    if (!s.has(f)) return;
    const std::string_view name = f.getProto().getName().cStr();
    switch (f.getType().which()) {
      case capnp::schema::Type::TEXT: {
        auto t = s.get(f).as<capnp::Text>().asReader();
        if (t.size() > text_limit(name)) s.set(f, capnp::Text::Reader(clamped(t, name)));
        break;
      }
      case capnp::schema::Type::STRUCT: clamp_struct(s.get(f).as<capnp::DynamicStruct>()); break;
      case capnp::schema::Type::LIST: {
        auto list = s.get(f).as<capnp::DynamicList>();
        for (unsigned i = 0; i < list.size(); ++i) {
          auto e = list[i];
          if (e.getType() == capnp::DynamicValue::TEXT) {
            auto t = e.as<capnp::Text>().asReader();
            if (t.size() > text_limit(name)) list.set(i, capnp::Text::Reader(clamped(t, name)));
          } else if (e.getType() == capnp::DynamicValue::STRUCT) {
            clamp_struct(e.as<capnp::DynamicStruct>());
          }
        }
        break;
      }
      default: break;
    }
  };
  for (auto f : s.getSchema().getNonUnionFields()) visit(f);
  KJ_IF_MAYBE(f, s.which()) { visit(*f); }
}

}  // namespace

void clamp_text_fields(proto::Envelope::Builder envelope) { clamp_struct(capnp::toDynamic(envelope)); }

std::string check_text_limits(proto::Envelope::Reader envelope) {
  std::string problem;
  check_struct(capnp::toDynamic(envelope), problem);
  return problem;
}

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
    if (std::string problem = check_text_limits(out->envelope_); !problem.empty()) return protocol_error(problem);
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
