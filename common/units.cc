#include "common/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace paramcast {
namespace {
// Splits "12.5MiB" into number and unit; returns false when no number leads.
bool split(std::string_view text, double& number, std::string_view& unit, bool& integral) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return false;
  std::string num(text.substr(0, i));
  integral = num.find('.') == std::string::npos;
  char* end = nullptr;
  number = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size()) return false;
  unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  return true;
}
}  // namespace

std::optional<std::chrono::nanoseconds> parse_duration(std::string_view text) {
  double n;
  std::string_view unit;
  bool integral;
  if (!split(text, n, unit, integral)) return std::nullopt;
  double scale;
  if (unit == "ns") scale = 1;
  else if (unit == "us") scale = 1e3;
  else if (unit == "ms") scale = 1e6;
  else if (unit == "s") scale = 1e9;
  else if (unit == "m" || unit == "min") scale = 60e9;
  else if (unit == "h") scale = 3600e9;
  else return std::nullopt;
  const double ns = n * scale;
  if (!(ns < 9e18)) return std::nullopt;
  return std::chrono::nanoseconds(static_cast<int64_t>(std::llround(ns)));
}

std::optional<uint64_t> parse_size(std::string_view text) {
  double n;
  std::string_view unit;
  bool integral;
  if (!split(text, n, unit, integral)) return std::nullopt;
  double scale;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB") scale = 1024.0;
  else if (unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  else return std::nullopt;
  if (scale == 1 && !integral) return std::nullopt;  // "1.5" bytes makes no sense
  const double bytes = n * scale;
  if (!(bytes < 1.8e19) || bytes != std::floor(bytes)) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) { v /= 1024; ++u; }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

std::string format_rate(double bytes_per_second) {
  char buf[32];
  if (bytes_per_second >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB/s", bytes_per_second / 1e9);
  else std::snprintf(buf, sizeof buf, "%.2f MB/s", bytes_per_second / 1e6);
  return buf;
}

std::string format_duration(std::chrono::nanoseconds d) {
  char buf[32];
  const double s = std::chrono::duration<double>(d).count();
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

}  // namespace paramcast
