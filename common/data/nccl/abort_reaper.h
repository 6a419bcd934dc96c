// AbortReaper: runs a communicator's teardown (ncclCommAbort, which joins
// NCCL's proxy threads, frees its memory and can hang on a wedged peer) on a
// thread of its own, so that abort() returns at once on any thread — a
// control thread keeps its heartbeats flowing.
//
// start() runs the function once (later calls are ignored) and returns
// without waiting. wait_for() lets a data thread wait, bounded, for the
// teardown to finish before it reuses memory that the aborted work wrote.
// The destructor never blocks: a finished thread is joined, an unfinished
// one is detached (it owns everything it touches through the shared state
// and the function's own captures).
//
// A process never exits under a running teardown: ncclCommAbort on a thread
// left behind would meet the CUDA runtime's own teardown at exit ("driver
// shutting down") and crash the process. The first start() registers an exit
// handler that waits, up to kExitWait, for every teardown still running. It
// is registered after the CUDA runtime initialised (a communicator exists),
// so it runs before the runtime unloads. Exits that skip exit handlers
// (_exit, quick_exit, Python's os._exit) are not covered. A child forked
// meanwhile starts with nothing in flight.
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace paramcast::nccl_backend {

class AbortReaper {
 public:
  static constexpr std::chrono::seconds kExitWait{20};

  AbortReaper() = default;
  AbortReaper(const AbortReaper&) = delete;
  AbortReaper& operator=(const AbortReaper&) = delete;
  ~AbortReaper() {
    std::lock_guard<std::mutex> lock(thread_mu_);
    if (!thread_.joinable()) return;
    if (finished()) thread_.join();
    else thread_.detach();
  }

  // Runs `teardown` on the reaper thread; true if this call started it.
  bool start(std::function<void()> teardown) {
    std::lock_guard<std::mutex> lock(thread_mu_);
    if (thread_.joinable() || state_->started) return false;
    state_->started = true;
    InFlight& all = in_flight();
    {
      std::lock_guard<std::mutex> l(all.mu);
      ++all.count;
    }
    static std::once_flag registered;
    std::call_once(registered, [] {
      std::atexit(wait_at_exit);
      // A forked child has none of the parent's threads: it starts with
      // nothing in flight (else its exit would wait out kExitWait), and the
      // lock is held across fork so that the child never inherits it taken.
      pthread_atfork([] { in_flight().mu.lock(); }, [] { in_flight().mu.unlock(); },
                     [] {
                       in_flight().count = 0;
                       in_flight().mu.unlock();
                     });
    });
    try {
      thread_ = std::thread([state = state_, fn = std::move(teardown)]() mutable {
        fn();
        fn = nullptr;  // its captures go before the exit handler is told
        {
          std::lock_guard<std::mutex> l(state->mu);
          state->finished = true;
        }
        state->cv.notify_all();
        InFlight& all = in_flight();
        std::lock_guard<std::mutex> l(all.mu);
        --all.count;
        all.cv.notify_all();
      });
    } catch (...) {  // no thread: nothing in flight for the exit handler to wait for
      std::lock_guard<std::mutex> l(all.mu);
      --all.count;
      throw;
    }
    return true;
  }

  // Teardowns started and not yet finished, in this process.
  static int running() {
    InFlight& all = in_flight();
    std::lock_guard<std::mutex> l(all.mu);
    return all.count;
  }

  bool started() const {
    std::lock_guard<std::mutex> lock(thread_mu_);
    return state_->started;
  }
  bool finished() const {
    std::lock_guard<std::mutex> l(state_->mu);
    return state_->finished;
  }
  // True once the teardown has finished; false if `timeout` passed first.
  bool wait_for(std::chrono::nanoseconds timeout) const {
    std::unique_lock<std::mutex> l(state_->mu);
    return state_->cv.wait_for(l, timeout, [&] { return state_->finished; });
  }

 private:
  struct InFlight {
    std::mutex mu;
    std::condition_variable cv;
    int count = 0;
  };
  // Never destroyed: read by the exit handler and by detached threads.
  static InFlight& in_flight() {
    static InFlight* all = new InFlight;
    return *all;
  }
  static void wait_at_exit() {
    InFlight& all = in_flight();
    std::unique_lock<std::mutex> l(all.mu);
    if (!all.cv.wait_for(l, kExitWait, [&] { return all.count == 0; }))
      std::fprintf(stderr, "paramcast: %d NCCL communicator teardown(s) still running %lld s after exit began\n",
                   all.count, static_cast<long long>(kExitWait.count()));
  }

  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    bool started = false;  // guarded by the reaper's thread_mu_
  };
  mutable std::mutex thread_mu_;
  std::thread thread_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace paramcast::nccl_backend
