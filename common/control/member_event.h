// MemberEvent: what the control plane says happened to a subscriber's
// membership (joined, rejoined, lost, left). Produced by ControlServer,
// surfaced by Publisher::poll_event and the tools.
#pragma once

#include <cstdint>
#include <string>

namespace paramcast {

struct MemberEvent {
  enum class Kind { kJoined, kRejoined, kLost, kLeft };
  Kind kind;
  std::string worker_id;
  std::string detail;
  // The membership generation this event produced (ControlServer::live()):
  // a reader of the membership at that generation or later has seen it.
  uint64_t generation = 0;
};
const char* member_event_name(MemberEvent::Kind k);

}  // namespace paramcast
