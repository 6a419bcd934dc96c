#include "common/control/log_guard.h"

#include <cstdio>

namespace paramcast::control {

std::string printable(std::string_view s, size_t max) {
  std::string out;
  out.reserve(std::min(s.size(), max) + 8);
  size_t i = 0;
  for (; i < s.size() && out.size() < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02x", c);
      out += esc;
    }
  }
  if (i < s.size()) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

bool LogLimiter::allow(const std::string& kind, uint64_t* suppressed, Clock::time_point now) {
  *suppressed = 0;
  const std::string key = kind.size() > 64 ? kind.substr(0, 64) : kind;
  auto it = kinds_.find(key);
  if (it == kinds_.end()) {
    // Kinds are the program's own words, a handful; start over rather than grow.
    if (kinds_.size() >= max_kinds_) kinds_.clear();
    it = kinds_.emplace(key, Window{now, 0, 0}).first;
  }
  Window& w = it->second;
  if (now - w.start >= window_) {
    w.start = now;
    w.used = 0;
  }
  if (now - total_.start >= window_) {
    total_.start = now;
    total_.used = 0;
  }
  if (w.used >= lines_ || total_.used >= total_lines_) {
    ++w.suppressed;
    ++total_suppressed_;
    return false;
  }
  ++w.used;
  ++total_.used;
  *suppressed = w.suppressed;
  w.suppressed = 0;
  return true;
}

}  // namespace paramcast::control
