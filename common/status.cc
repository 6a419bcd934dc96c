#include "common/status.h"

namespace paramcast {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kTimeout: return "TIMEOUT";
    case Code::kPeerLost: return "PEER_LOST";
    case Code::kAborted: return "ABORTED";
    case Code::kRejected: return "REJECTED";
    case Code::kProtocol: return "PROTOCOL";
    case Code::kDataCorrupt: return "DATA_CORRUPT";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

namespace detail {
void check_failed(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "paramcast: %s:%d: %s failed\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

}  // namespace paramcast
