#include "common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>

namespace paramcast {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

void log_line(LogLevel level, const std::string& line) {
  static const char* kNames[] = {"D", "I", "W", "E", "-"};
  using namespace std::chrono;
  const auto ms = duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
  // One fprintf per line: stdio locks the stream, so lines never interleave.
  std::fprintf(stderr, "%s %lld.%03lld %s\n", kNames[static_cast<int>(level)],
               static_cast<long long>(ms / 1000), static_cast<long long>(ms % 1000), line.c_str());
}

}  // namespace paramcast
