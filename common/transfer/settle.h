// settle_works: what every half of the transfer pipeline does after a
// failure before its buffers may be reused. Each issued broadcast is waited
// for (a Work of an aborted communicator waits for the abort to finish), and
// then the copy stream, each at most until max(deadline, now +
// kSettleTimeout). Returns whether everything settled; if not, the caller
// lets its buffers go instead of reusing them.
//
// Thread-safety: the calling pipeline thread's own works and memory.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "common/data/communicator.h"
#include "common/data/device_memory.h"

namespace paramcast::transfer {

inline bool settle_works(std::vector<std::shared_ptr<Work>>& works, DeviceMemory& mem, Deadline deadline) {
  bool quiet = true;
  for (auto& w : works) {
    if (!w) continue;
    (void)w->wait(std::max(deadline, Clock::now() + kSettleTimeout));
    if (!w->settled()) quiet = false;
    w.reset();
  }
  if (!mem.synchronize().ok()) quiet = false;
  return quiet;
}

}  // namespace paramcast::transfer
