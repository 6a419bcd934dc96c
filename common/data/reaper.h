// Reaper: releases communicators on its own thread, so that no control thread
// and no caller ever waits on a communicator's teardown.
//
// adopt() wraps a communicator in a shared_ptr whose last owner, wherever it
// drops it (a control thread noticing a loss, a data thread replacing the
// group, a caller returning), only queues the communicator; the reaper thread
// destroys it. A backend's destructor may therefore wait for its I/O to wind
// down, and a new group can form while old communicators are being torn down.
//
// ~Reaper waits up to `drain` for the queue to empty; what is left is handed
// to a detached thread, so that a process stopping (SIGTERM) never waits on a
// data plane. A communicator whose last owner drops it after its reaper is
// gone is released on a detached thread of its own.
//
// Thread-safety: every method, and the wrappers' deleters, from any thread.
#pragma once

#include <chrono>
#include <memory>

#include "common/data/communicator.h"

namespace paramcast {

class Reaper {
 public:
  // Default: a process exits at most 1 s after its reaper is destroyed.
  explicit Reaper(std::chrono::milliseconds drain = std::chrono::milliseconds(1000));
  ~Reaper();
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  std::shared_ptr<Communicator> adopt(std::unique_ptr<Communicator> comm);
  // `comm` must not be shared with anyone else yet.
  std::shared_ptr<Communicator> adopt(std::shared_ptr<Communicator> comm);

  // Communicators queued or being destroyed now.
  size_t pending() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::chrono::milliseconds drain_;
};

}  // namespace paramcast
