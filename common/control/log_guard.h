// Bounded logging of what hostile peers send.
//
// printable() is the one helper through which every string that came from
// the network reaches a log line or an error text: control characters and
// non-ASCII bytes become \xNN escapes, and the result is cut at `max` bytes
// (marked "...(N bytes)"), so that a peer can neither forge log lines nor
// make one line large.
//
// LogLimiter allows a few lines per kind of event ("dropped frame",
// "wrong protocol version", "unexpected message", ...) and window, and a few
// more in all kinds together; what it holds back is counted and reported
// with the next line of that kind it lets through. It is keyed by kind, never
// by peer: a flood of fresh identities or connections gets no more lines
// than one peer would. It remembers a bounded number of kinds.
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
  // `lines_per_window` of each kind, and `total_per_window` of all kinds.
  LogLimiter(int lines_per_window, std::chrono::milliseconds window, int total_per_window = 20, size_t max_kinds = 64)
      : lines_(lines_per_window), total_lines_(total_per_window), window_(window), max_kinds_(max_kinds) {}

  // True when a line of `kind` may be logged now; `suppressed` is set to the
  // lines of that kind held back since the last one let through.
  bool allow(const std::string& kind, uint64_t* suppressed, Clock::time_point now = Clock::now());
  uint64_t total_suppressed() const { return total_suppressed_; }
  size_t kinds() const { return kinds_.size(); }

 private:
  struct Window {
    Clock::time_point start;
    int used = 0;
    uint64_t suppressed = 0;
  };
  const int lines_;
  const int total_lines_;
  const std::chrono::milliseconds window_;
  const size_t max_kinds_;
  std::map<std::string, Window> kinds_;
  Window total_;
  uint64_t total_suppressed_ = 0;
};

}  // namespace paramcast::control
