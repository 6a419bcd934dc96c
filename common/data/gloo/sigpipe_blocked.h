// SigpipeBlocked: blocks SIGPIPE in the calling thread for its lifetime.
// Internal to the Gloo backend.
//
// Gloo writes with writev(), which raises SIGPIPE when the peer has closed;
// that would kill the process. Threads that Gloo writes from are started
// with SIGPIPE blocked (its I/O loop, the runner, the watcher), and a foreign
// thread blocks it around its own writes; one raised meanwhile is consumed.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <ctime>

namespace paramcast::gloo_backend {

class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeBlocked() {
    if (!sigismember(&old_, SIGPIPE)) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) > 0) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
};

}  // namespace paramcast::gloo_backend
