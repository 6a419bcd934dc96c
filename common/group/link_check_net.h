// The socket helpers both ends of a link check share (link_check.cc, the
// member's end; link_check_host.cc, the publisher's end). Internal to
// common/group: numeric addresses only, no name lookups.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace paramcast::group::link_net {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e);
// n bytes from getrandom (fewer only if it fails).
std::string random_bytes(size_t n);
// A numeric address and port as a sockaddr.
bool to_sockaddr(const std::string& address, uint16_t port, sockaddr_storage& out, socklen_t& len);
// "address:port" or "[address]:port".
bool parse_endpoint(const std::string& endpoint, std::string& address, uint16_t& port);
std::string endpoint_text(const std::string& address, uint16_t port);
// Milliseconds until t, for poll(): 0 when past, at most a minute.
int ms_until(Clock::time_point t);

}  // namespace paramcast::group::link_net
