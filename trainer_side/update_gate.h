// UpdateGate: the publisher's update lock. One update at a time (weight_update,
// a streamed update from begin_update to finish, start, shutdown's
// teardown). Unlike a std::mutex it may be released by another thread than
// the one that took it: a streamed Update is handed over (begin on one
// thread, finish or abort on another, a Python handle dropped on any), and it
// knows its holder, so a call that would wait for the update its own thread
// holds open fails instead of deadlocking (held_by_me()).
//
// Thread-safety: every member from any thread.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace paramcast {

class UpdateGate {
 public:
  void lock() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return !busy_; });
    busy_ = true;
    holder_ = std::this_thread::get_id();
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> l(mu_);
      busy_ = false;
      holder_ = std::thread::id();
    }
    cv_.notify_one();
  }
  // Whether the calling thread took it and has not released it.
  bool held_by_me() {
    std::lock_guard<std::mutex> l(mu_);
    return busy_ && holder_ == std::this_thread::get_id();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false;
  std::thread::id holder_;
};

}  // namespace paramcast
