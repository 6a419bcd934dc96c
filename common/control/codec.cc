#include "common/control/codec.h"

#include <capnp/dynamic.h>

#include <cstring>
#include <string_view>
#include <unordered_map>
#include <vector>

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

// The fields of a struct type worth visiting (texts, and structs and lists
// that hold texts), with
// their limits: computed once per type and thread, since schema lookups are
// slow next to reading a message.
struct FieldInfo {
  capnp::StructSchema::Field field;
  capnp::schema::Type::Which type;
  std::string_view name;
  size_t limit;
};
struct StructInfo {
  std::vector<FieldInfo> plain;
  std::unordered_map<uint16_t, FieldInfo> in_union;  // by field index
};

bool holds_text(capnp::Type type, int depth);

// Whether a struct type holds a text anywhere inside it: the walk skips
// those that hold none (a plan's 50,000 regions of numbers). A type nested
// deeper than any of the protocol's (or recursive) counts as holding one.
bool struct_holds_text(capnp::StructSchema schema, int depth) {
  if (depth > 16) return true;
  thread_local std::unordered_map<uint64_t, bool> memo;
  const uint64_t id = schema.getProto().getId();
  if (auto it = memo.find(id); it != memo.end()) return it->second;
  bool text = false;
  for (auto f : schema.getFields()) text = text || holds_text(f.getType(), depth + 1);
  memo[id] = text;
  return text;
}

bool holds_text(capnp::Type type, int depth) {
  switch (type.which()) {
    case capnp::schema::Type::TEXT: return true;
    case capnp::schema::Type::LIST: return holds_text(type.asList().getElementType(), depth + 1);
    case capnp::schema::Type::STRUCT: return struct_holds_text(type.asStruct(), depth + 1);
    default: return false;
  }
}

const StructInfo& info_for(capnp::StructSchema schema) {
  thread_local std::unordered_map<uint64_t, StructInfo> cache;
  auto found = cache.try_emplace(schema.getProto().getId());
  StructInfo& info = found.first->second;
  if (!found.second) return info;
  auto add = [](capnp::StructSchema::Field f, auto&& put) {
    const auto which = f.getType().which();
    if (!holds_text(f.getType(), 0)) return;
    const std::string_view name = f.getProto().getName().cStr();
    put(FieldInfo{f, which, name, text_limit(name)});
  };
  for (auto f : schema.getNonUnionFields()) add(f, [&](FieldInfo i) { info.plain.push_back(i); });
  for (auto f : schema.getUnionFields()) add(f, [&](FieldInfo i) { info.in_union.emplace(i.field.getIndex(), i); });
  return info;
}

// Calls visit(FieldInfo) for every set field of `s` worth visiting.
template <typename S, typename V>
void for_each_field(S s, V&& visit) {
  const StructInfo& info = info_for(s.getSchema());
  for (const auto& f : info.plain)
    if (s.has(f.field)) visit(f);
  if (info.in_union.empty()) return;
  KJ_IF_MAYBE(active, s.which()) {
    auto u = info.in_union.find(active->getIndex());
    if (u != info.in_union.end() && s.has(u->second.field)) visit(u->second);
  }
}

void check_text(capnp::Text::Reader t, const FieldInfo& f, std::string& problem) {
  if (problem.empty() && t.size() > f.limit)
    problem = "text field '" + std::string(f.name) + "' of " + std::to_string(t.size()) + " bytes exceeds its limit of " +
              std::to_string(f.limit) + " (starts '" + printable({t.cStr(), std::min<size_t>(t.size(), 32)}, 32) + "')";
}

void check_struct(capnp::DynamicStruct::Reader s, std::string& problem);

// A list of TensorEntry (a plan's or a statement's tensors, 50,000 of them
// at a frontier model's size) read through the generated API: the walk
// below reads each field through the schema, a seventh of an engine's CPU
// an update at 50,000 tensors. Taken only while TensorEntry's only texts
// are the direct fields `name` and `dtype` (checked once, against the
// schema); returns false otherwise, and the walk reads the list.
bool check_tensor_entries(capnp::DynamicList::Reader list, std::string& problem) {
  const auto schema = capnp::Schema::from<proto::TensorEntry>();
  if (list.getSchema().whichElementType() != capnp::schema::Type::STRUCT ||
      list.getSchema().getStructElementType() != schema)
    return false;
  static const std::vector<FieldInfo> texts = [&] {
    const StructInfo& info = info_for(schema);
    std::vector<FieldInfo> out;
    bool direct = info.in_union.empty() && info.plain.size() == 2;
    for (const auto& f : info.plain) direct = direct && f.type == capnp::schema::Type::TEXT;
    if (direct && info.plain[0].name == "name" && info.plain[1].name == "dtype") out = info.plain;
    return out;
  }();
  if (texts.empty()) return false;
  for (auto e : list.as<capnp::List<proto::TensorEntry>>()) {
    if (e.hasName()) check_text(e.getName(), texts[0], problem);
    if (e.hasDtype()) check_text(e.getDtype(), texts[1], problem);
    if (!problem.empty()) break;
  }
  return true;
}

void check_value(capnp::DynamicValue::Reader v, const FieldInfo& f, std::string& problem) {
  switch (v.getType()) {
    case capnp::DynamicValue::TEXT: check_text(v.as<capnp::Text>(), f, problem); break;
    case capnp::DynamicValue::STRUCT: check_struct(v.as<capnp::DynamicStruct>(), problem); break;
    case capnp::DynamicValue::LIST: {
      auto list = v.as<capnp::DynamicList>();
      if (check_tensor_entries(list, problem)) break;
      const auto elem = list.getSchema().whichElementType();
      if (elem != capnp::schema::Type::TEXT && elem != capnp::schema::Type::STRUCT && elem != capnp::schema::Type::LIST)
        break;  // numbers and enums: nothing to check
      for (auto e : list) {
        if (!problem.empty()) return;
        check_value(e, f, problem);
      }
      break;
    }
    default: break;
  }
}

void check_struct(capnp::DynamicStruct::Reader s, std::string& problem) {
  for_each_field(s, [&](const FieldInfo& f) {
    if (problem.empty()) check_value(s.get(f.field), f, problem);
  });
}

// Sender side: cuts a too-long text to its limit on a UTF-8 boundary.
std::string clamped(capnp::Text::Reader t, size_t limit) {
  size_t n = limit - 3;
  while (n > 0 && (static_cast<unsigned char>(t.cStr()[n]) & 0xc0) == 0x80) --n;
  return std::string(t.cStr(), n) + "...";
}

void clamp_struct(capnp::DynamicStruct::Builder s) {
  for_each_field(s, [&](const FieldInfo& f) {
    switch (f.type) {
      case capnp::schema::Type::TEXT: {
        auto t = s.get(f.field).as<capnp::Text>().asReader();
        if (t.size() > f.limit) s.set(f.field, capnp::Text::Reader(clamped(t, f.limit)));
        break;
      }
      case capnp::schema::Type::STRUCT: clamp_struct(s.get(f.field).as<capnp::DynamicStruct>()); break;
      case capnp::schema::Type::LIST: {
        auto list = s.get(f.field).as<capnp::DynamicList>();
        const auto elem = list.getSchema().whichElementType();
        for (unsigned i = 0; i < list.size(); ++i) {
          if (elem == capnp::schema::Type::TEXT) {
            auto t = list[i].as<capnp::Text>().asReader();
            if (t.size() > f.limit) list.set(i, capnp::Text::Reader(clamped(t, f.limit)));
          } else if (elem == capnp::schema::Type::STRUCT) {
            clamp_struct(list[i].as<capnp::DynamicStruct>());
          } else {
            break;
          }
        }
        break;
      }
      default: break;
    }
  });
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
      case B::BUCKET_LAYOUTS: return "bucketLayouts";
      case B::BUCKET_DELTA: return "bucketDelta";
      case B::HOLDINGS: return "holdings";
      case B::WANTS: return "wants";
      case B::LINK_CHECK: return "linkCheck";
    }
  } catch (const kj::Exception&) {
  }
  return "unknown";
}

}  // namespace paramcast::control
