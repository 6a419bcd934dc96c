// MemberEvent: what the control plane says happened to a subscriber's
// membership (joined, rejoined, lost, left). Produced by ControlServer,
// surfaced by Publisher::poll_event and the tools.
#pragma once

#include <string>

namespace paramcast {

struct MemberEvent {
  enum class Kind { kJoined, kRejoined, kLost, kLeft };
  Kind kind;
  std::string worker_id;
  std::string detail;
};
const char* member_event_name(MemberEvent::Kind k);

}  // namespace paramcast
