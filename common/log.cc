#include "common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <set>

namespace paramcast {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
std::mutex g_workers_mu;
std::set<std::string> g_workers;  // bounded: ids of this process's subscribers

const char* level_word(LogLevel level) {
  static const char* kWords[] = {"debug", "info", "warn", "error", "off"};
  return kWords[static_cast<int>(level)];
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c >= 0x7f) {  // control bytes, and bytes of no known encoding: always valid JSON
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// ISO 8601 UTC with milliseconds, the time of every line of both formats.
std::string iso_utc(long long unix_ms) {
  const std::time_t secs = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char time[96];
  std::snprintf(time, sizeof time, "%04d-%02d-%02dT%02d:%02d:%02d.%03lldZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, unix_ms % 1000);
  return time;
}

bool token(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.'))
      return false;
  return true;
}
}  // namespace

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void set_log_format(LogFormat format) { g_format.store(static_cast<int>(format)); }

void note_log_worker(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(g_workers_mu);
  if (g_workers.size() < 4096) g_workers.insert(worker_id);
}

std::string json_log_line(LogLevel level, long long unix_ms, const std::string& line) {
  // "component: message", the convention of every line (common/log.h).
  std::string component = "paramcast", worker, message = line;
  const size_t colon = line.find(": ");
  if (colon != std::string::npos && token(line.substr(0, colon))) {
    component = line.substr(0, colon);
    message = line.substr(colon + 2);
    std::lock_guard<std::mutex> lock(g_workers_mu);
    if (g_workers.count(component)) {
      worker = component;
      component = "subscriber";
    }
  }
  std::string out = "{\"time\":\"";
  out += iso_utc(unix_ms);
  out += "\",\"level\":\"";
  out += level_word(level);
  out += "\",\"component\":";
  json_string(out, component);
  if (!worker.empty()) {
    out += ",\"worker\":";
    json_string(out, worker);
  }
  out += ",\"message\":";
  json_string(out, message);
  out += '}';
  return out;
}

std::string text_log_line(LogLevel level, long long unix_ms, const std::string& line) {
  static const char* kNames[] = {"D", "I", "W", "E", "-"};
  std::string out = kNames[static_cast<int>(level)];
  out += ' ';
  out += iso_utc(unix_ms);
  out += ' ';
  out += line;
  return out;
}

void log_line(LogLevel level, const std::string& line) {
  using namespace std::chrono;
  const auto ms = duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
  // One fprintf per line: stdio locks the stream, so lines never interleave.
  if (static_cast<LogFormat>(g_format.load(std::memory_order_relaxed)) == LogFormat::kJson) {
    std::fprintf(stderr, "%s\n", json_log_line(level, static_cast<long long>(ms), line).c_str());
    return;
  }
  std::fprintf(stderr, "%s\n", text_log_line(level, static_cast<long long>(ms), line).c_str());
}

}  // namespace paramcast
