// WorkState: the completion shared between a backend's worker and the Work
// handles it gave out. Internal to the data-plane backends.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

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

// The Work the host backends (gloo, shm) hand out: it waits for its
// WorkState; past the caller's deadline it aborts the communicator (the
// collective is half done on every rank) and says so.
class DeadlineWork : public Work {
 public:
  // `what` names the operation in errors ("broadcast", "send to rank 3").
  DeadlineWork(Communicator* comm, uint64_t epoch, int rank, std::string what = "broadcast")
      : comm_(comm), epoch_(epoch), rank_(rank), what_(std::move(what)) {}
  Status wait(Deadline deadline) override {
    Status s = state->wait_until(deadline);
    if (s.code() == Code::kTimeout && !state->done()) {  // the deadline, not a stalled link
      comm_->abort(what_ + " deadline passed");
      return timeout_error(what_ + " did not finish before its deadline (epoch " + std::to_string(epoch_) +
                           ", rank " + std::to_string(rank_) + "); communicator aborted");
    }
    return s;
  }
  const std::shared_ptr<WorkState> state = std::make_shared<WorkState>();

 private:
  Communicator* const comm_;
  const uint64_t epoch_;
  const int rank_;
  const std::string what_;
};

// The start every point-to-point move shares (Communicator::send/recv on the
// host backends): its Work, named `what` ("gloo group ...: send to rank 3"),
// already completed when there is nothing for the backend to do: an error
// naming the peer when `peer` is not another rank of the group, success for
// zero bytes. `finished` says which.
struct P2pStart {
  std::shared_ptr<DeadlineWork> work;
  bool finished = false;
};
inline P2pStart start_p2p(Communicator* comm, uint64_t epoch, int rank, int world_size, int peer, size_t bytes,
                          const std::string& what) {
  P2pStart s{std::make_shared<DeadlineWork>(comm, epoch, rank, what), true};
  if (peer < 0 || peer >= world_size || peer == rank) {
    std::string why = what;
    why += ": not a peer of rank ";
    why += std::to_string(rank);
    why += " in a group of ";
    why += std::to_string(world_size);
    s.work->state->complete(invalid_argument(why));
  } else if (bytes == 0) {
    s.work->state->complete(Status());
  } else {
    s.finished = false;
  }
  return s;
}

}  // namespace paramcast::data_internal
