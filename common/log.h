// Minimal leveled logging to stderr, one line per call, safe from any thread.
//
// The level is process-wide state set once by main() from the config
// (logging.level); libraries only read it. Lines carry a role prefix
// ("publisher", "worker-3") so interleaved output of launch stays readable.
#pragma once

#include <sstream>
#include <string>

namespace paramcast {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };
// text: "<LEVEL> <time> <line>"; json: one object per line (logging.format).
// Both write the time as ISO 8601 UTC with milliseconds: 2026-12-06T07:01:02.123Z.
enum class LogFormat { kText, kJson };

void set_log_level(LogLevel level);
LogLevel log_level();
void set_log_format(LogFormat format);
// Lines a subscriber writes start with its worker id ("worker-3: ..."):
// the json format puts that id in the "worker" field. Subscribers register
// their ids here when they are created.
void note_log_worker(const std::string& worker_id);
void log_line(LogLevel level, const std::string& line);
// One line as the json format writes it (without the newline), for tests:
// {"time":"2026-11-25T16:01:37.123Z","level":"warn","component":"subscriber","worker":"worker-3","message":"..."}
std::string json_log_line(LogLevel level, long long unix_ms, const std::string& line);
// One line as the text format writes it (without the newline), for tests:
// W 2026-11-25T16:01:37.123Z publisher: update v3 failed
std::string text_log_line(LogLevel level, long long unix_ms, const std::string& line);

}  // namespace paramcast

#define PC_LOG(level, expr)                                                  \
  do {                                                                       \
    if (::paramcast::LogLevel::level >= ::paramcast::log_level()) {          \
      std::ostringstream pc_log_os_;                                         \
      pc_log_os_ << expr;                                                    \
      ::paramcast::log_line(::paramcast::LogLevel::level, pc_log_os_.str()); \
    }                                                                        \
  } while (0)
#define PC_DEBUG(expr) PC_LOG(kDebug, expr)
#define PC_INFO(expr) PC_LOG(kInfo, expr)
#define PC_WARN(expr) PC_LOG(kWarn, expr)
#define PC_ERROR(expr) PC_LOG(kError, expr)
