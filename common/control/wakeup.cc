#include "common/control/wakeup.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>

#include "common/status.h"

namespace paramcast::control {

Wakeup::Wakeup() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) { PC_CHECK(fd_ >= 0); }
Wakeup::~Wakeup() { ::close(fd_); }

void Wakeup::notify() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(fd_, &one, sizeof one);
}

void Wakeup::drain() {
  uint64_t v;
  [[maybe_unused]] ssize_t n = ::read(fd_, &v, sizeof v);
}

}  // namespace paramcast::control
