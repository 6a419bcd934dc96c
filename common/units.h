// Parsing and printing of the human units used in configs and tool flags:
// durations ("250ms", "10s", "2m") and byte sizes ("4096", "256MiB", "1GB").
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace paramcast {

// Units: ns, us, ms, s, m, h. A bare number is rejected: a duration needs a unit.
std::optional<std::chrono::nanoseconds> parse_duration(std::string_view text);
// Units: B (or none), KiB, MiB, GiB, TiB, KB, MB, GB, TB. Overflow is rejected.
std::optional<uint64_t> parse_size(std::string_view text);

std::string format_bytes(uint64_t bytes);                    // "1.50 GiB"
// Every rate printed to a user, in decimal units: "2.35 GB/s", "248.74 MB/s".
std::string format_rate(double bytes_per_second);
std::string format_duration(std::chrono::nanoseconds d);     // "1.234 s"

}  // namespace paramcast
