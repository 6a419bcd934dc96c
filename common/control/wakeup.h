// Wakeup: an eventfd that lets any thread wake a control thread blocked in
// zmq_poll. ZeroMQ sockets are owned by one thread; other threads hand work
// to it through a mutex-protected queue and then call notify().
#pragma once

namespace paramcast::control {

class Wakeup {
 public:
  Wakeup();
  ~Wakeup();
  Wakeup(const Wakeup&) = delete;
  Wakeup& operator=(const Wakeup&) = delete;

  int fd() const { return fd_; }
  void notify();
  void drain();  // called by the owning thread after poll reports fd readable

 private:
  int fd_;
};

}  // namespace paramcast::control
