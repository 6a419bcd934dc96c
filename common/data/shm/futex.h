// The shm plane's one wait: a futex word in the segment, bumped and woken
// after every change a waiter may wait for; waits are bounded so that each
// waiter also watches what no bump announces (a dead peer, a deadline).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace paramcast::shm_backend {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::milliseconds max) {
  timespec ts{0, static_cast<long>(std::chrono::nanoseconds(max).count())};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A change: every waiter on `word` (any rank's) looks again.
inline void bump(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_release);
  futex_wake_all(word);
}

}  // namespace paramcast::shm_backend
