// FaultInjection: test hooks of the transfer pipeline, read from the
// environment when a Publisher or Subscriber is created, so process-level
// tests can make a real rank misbehave at a chosen point of a real update.
//
//   PARAMCAST_FAULT_STALL_AFTER_BUCKET=K     stall after bucket K of every update
//   PARAMCAST_FAULT_STALL_AFTER_BUCKET=V:K   ... of version V only
//   PARAMCAST_FAULT_CORRUPT_BUCKET=K         flip one received bit of bucket K, once
//   PARAMCAST_FAULT_CORRUPT_BUCKET=V:K       ... of version V
//   PARAMCAST_FAULT_PAUSE_BEFORE_PLAN=V:MS   the publisher's update of version V pauses MS
//                                            milliseconds after its group was checked and
//                                            before its plan goes out (membership may change)
//   PARAMCAST_FAULT_PAUSE_BEFORE_COMMIT=V:MS ... after every member accepted its plan and
//                                            before the Commit goes out (a trainer rank's
//                                            publish call may end meanwhile)
//   PARAMCAST_FAULT_PAUSE_BEFORE_RECEIVE=V:MS an engine's data thread pauses MS milliseconds
//                                            after the Commit of version V and before its
//                                            transfer starts (the update may end meanwhile)
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace paramcast::transfer {

struct FaultInjection {
  int64_t stall_after_bucket = -1;
  uint64_t stall_version = 0;  // 0: any version
  int64_t corrupt_bucket = -1;
  uint64_t corrupt_version = 0;  // 0: the first update that has bucket K
  uint64_t pause_version = 0;
  uint64_t pause_ms = 0;
  uint64_t commit_pause_version = 0;
  uint64_t commit_pause_ms = 0;
  uint64_t receive_pause_version = 0;
  uint64_t receive_pause_ms = 0;

  bool corrupts(uint64_t version, size_t bucket) const {
    return corrupt_bucket == static_cast<int64_t>(bucket) && (corrupt_version == 0 || corrupt_version == version);
  }

  bool stalls_after(uint64_t version, size_t bucket) const {
    return stall_after_bucket == static_cast<int64_t>(bucket) && (stall_version == 0 || stall_version == version);
  }

  static FaultInjection from_env() {
    FaultInjection f;
    if (const char* v = std::getenv("PARAMCAST_FAULT_STALL_AFTER_BUCKET")) {
      const char* colon = std::strchr(v, ':');
      f.stall_version = colon ? std::strtoull(v, nullptr, 10) : 0;
      f.stall_after_bucket = std::atoll(colon ? colon + 1 : v);
    }
    if (const char* v = std::getenv("PARAMCAST_FAULT_CORRUPT_BUCKET")) {
      const char* colon = std::strchr(v, ':');
      f.corrupt_version = colon ? std::strtoull(v, nullptr, 10) : 0;
      f.corrupt_bucket = std::atoll(colon ? colon + 1 : v);
    }
    version_and_ms("PARAMCAST_FAULT_PAUSE_BEFORE_PLAN", f.pause_version, f.pause_ms);
    version_and_ms("PARAMCAST_FAULT_PAUSE_BEFORE_COMMIT", f.commit_pause_version, f.commit_pause_ms);
    version_and_ms("PARAMCAST_FAULT_PAUSE_BEFORE_RECEIVE", f.receive_pause_version, f.receive_pause_ms);
    return f;
  }

 private:
  // NAME=V:MS, else both left 0.
  static void version_and_ms(const char* name, uint64_t& version, uint64_t& ms) {
    const char* v = std::getenv(name);
    const char* colon = v ? std::strchr(v, ':') : nullptr;
    if (!colon) return;
    version = std::strtoull(v, nullptr, 10);
    ms = std::strtoull(colon + 1, nullptr, 10);
  }
};

}  // namespace paramcast::transfer
