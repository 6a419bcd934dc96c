// Bounded logging of what hostile peers send.
//
// printable() is the one helper through which every string that came from
// the network reaches a log line or an error text: control characters and
// non-ASCII bytes become \xNN escapes, and the result is cut at `max` bytes
// (marked "...(N bytes)"), so that a peer can neither forge log lines nor
// make one line large.
//
// LogLimiter allows a few lines per peer and window; what it holds back is
// counted and reported with the next line it lets through. It remembers a
// bounded number of peers (when full it starts over), so a flood of fresh
// identities costs no memory beyond that bound.
//
// Thread-safety: printable() is a pure function; LogLimiter is not
// synchronised (one owner thread, e.g. the control thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace paramcast::control {

std::string printable(std::string_view s, size_t max = 128);

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  LogLimiter(int lines_per_window, std::chrono::milliseconds window, size_t max_peers = 1024)
      : lines_(lines_per_window), window_(window), max_peers_(max_peers) {}

  // True when a line about `peer` may be logged now; `suppressed` is set to
  // the lines held back for this peer since the last one let through.
  bool allow(const std::string& peer, uint64_t* suppressed, Clock::time_point now = Clock::now());
  uint64_t total_suppressed() const { return total_suppressed_; }
  size_t peers() const { return peers_.size(); }

 private:
  struct Window {
    Clock::time_point start;
    int used = 0;
    uint64_t suppressed = 0;
  };
  const int lines_;
  const std::chrono::milliseconds window_;
  const size_t max_peers_;
  std::map<std::string, Window> peers_;
  uint64_t total_suppressed_ = 0;
};

}  // namespace paramcast::control
