// WorkState: the completion shared between a backend's worker and the Work
// handles it gave out. Internal to the data-plane backends.
#pragma once

#include <condition_variable>
#include <mutex>

#include "common/data/communicator.h"

namespace paramcast::data_internal {

class WorkState {
 public:
  void complete(Status status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      done_ = true;
      status_ = std::move(status);
    }
    cv_.notify_all();
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  Status wait_until(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return done_; }))
      return timeout_error("data-plane operation did not finish before its deadline");
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace paramcast::data_internal
