// Link checks, the member's end and what both ends share: the data address
// (data_address), one bounded exchange over a real socket (run_link_check),
// the request as received (link_check_request) and the thread that runs the
// latest one (LinkCheckRunner). The publisher's end, which runs the checks
// and judges them, is link_check_host.cc; the protocol is in link_check.h.
#include "common/group/link_check.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/group/link_check_net.h"
#include "common/log.h"
#include "common/xxhash.h"

namespace paramcast::group::link_net {

std::string errno_text(int e) { return std::strerror(e); }

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return out;
}

// A numeric address and port as a sockaddr.
bool to_sockaddr(const std::string& address, uint16_t port, sockaddr_storage& out, socklen_t& len) {
  std::memset(&out, 0, sizeof out);
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    len = sizeof(sockaddr_in);
    return true;
  }
  if (inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

// "address:port" or "[address]:port".
bool parse_endpoint(const std::string& endpoint, std::string& address, uint16_t& port) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon + 1 >= endpoint.size()) return false;
  address = endpoint.substr(0, colon);
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']')
    address = address.substr(1, address.size() - 2);
  const std::string digits = endpoint.substr(colon + 1);
  if (digits.size() > 5 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return false;
  const long p = std::stol(digits);
  if (p <= 0 || p > 65535) return false;
  port = static_cast<uint16_t>(p);
  return true;
}

std::string endpoint_text(const std::string& address, uint16_t port) {
  std::string out = address.find(':') == std::string::npos ? address : "[" + address + "]";
  out += ":";
  out += std::to_string(port);
  return out;
}

int ms_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<Millis>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
}

}  // namespace paramcast::group::link_net

namespace paramcast::group {

using namespace link_net;

namespace {

// The member's side: whole reads and writes on a non-blocking socket, each
// bounded by `deadline`.
// In slices of 100 ms, so that `cancel` ends it soon.
Status wait_fd(int fd, short events, Clock::time_point deadline, const char* doing, const std::atomic<bool>* cancel) {
  for (;;) {
    if (cancel && *cancel) return aborted(std::string(doing) + ": cancelled");
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, std::min(ms_until(deadline), 100));
    if (n > 0) return Status();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return unavailable(std::string(doing) + ": poll: " + errno_text(errno));
    if (Clock::now() >= deadline) return timeout_error(doing);
  }
}

// The whole of `n` bytes sent from `out` (or, `out` null, received into
// `in`), each wait bounded by `deadline`; what failed names how far it got.
Status move_all(int fd, const char* out, char* in, size_t n, Clock::time_point deadline, const char* doing,
                const std::atomic<bool>* cancel) {
  size_t done = 0;
  while (done < n) {
    const ssize_t k = out ? ::send(fd, out + done, n - done, MSG_NOSIGNAL) : ::recv(fd, in + done, n - done, 0);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (k == 0 && !out) return unavailable(std::string(doing) + ": connection closed by the publisher");
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      Status s = wait_fd(fd, out ? POLLOUT : POLLIN, deadline, doing, cancel);
      if (!s.ok()) {
        std::string what = s.message();
        what += " (";
        what += std::to_string(done);
        what += " of ";
        what += std::to_string(n);
        what += " bytes)";
        return Status(s.code(), what);
      }
      continue;
    }
    return unavailable(std::string(doing) + ": " + errno_text(errno));
  }
  return Status();
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

StatusOr<std::string> data_address(const std::string& hostname, const std::string& iface) {
  if (!iface.empty()) {
    ifaddrs* all = nullptr;
    if (getifaddrs(&all) != 0) return unavailable("getifaddrs: " + errno_text(errno));
    std::string v4, v6;
    for (ifaddrs* a = all; a; a = a->ifa_next) {
      if (!a->ifa_addr || iface != a->ifa_name) continue;
      char text[INET6_ADDRSTRLEN] = {};
      if (a->ifa_addr->sa_family == AF_INET && v4.empty())
        v4 = inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
      else if (a->ifa_addr->sa_family == AF_INET6 && v6.empty())
        v6 = inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, text, sizeof text);
    }
    freeifaddrs(all);
    if (!v4.empty()) return v4;
    if (!v6.empty()) return v6;
    return invalid_argument("data_plane.gloo_interface '" + iface + "' has no IP address on this host");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(hostname.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) return invalid_argument("data_plane.gloo_hostname '" + hostname + "': " + gai_strerror(rc));
  char text[INET6_ADDRSTRLEN] = {};
  std::string out;
  if (res->ai_family == AF_INET)
    out = inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, text, sizeof text);
  else if (res->ai_family == AF_INET6)
    out = inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(res->ai_addr)->sin6_addr, text, sizeof text);
  freeaddrinfo(res);
  if (out.empty()) return invalid_argument("data_plane.gloo_hostname '" + hostname + "' resolves to no IP address");
  return out;
}

Status run_link_check(const LinkCheckRequest& r, const std::string& hostname, const std::string& iface,
                      const std::atomic<bool>* cancel) {
  const auto deadline = Clock::now() + r.timeout;
  std::string address;
  uint16_t port = 0;
  if (!parse_endpoint(r.endpoint, address, port))
    return invalid_argument("link check endpoint '" + r.endpoint + "' is not address:port");
  sockaddr_storage to{}, from{};
  socklen_t to_len = 0, from_len = 0;
  if (!to_sockaddr(address, port, to, to_len))
    return invalid_argument("link check endpoint '" + r.endpoint + "' is not a numeric address");
  auto own = data_address(hostname, iface);
  if (!own.ok()) return own.status().with_context("link check: this member's data address");
  if (!to_sockaddr(*own, 0, from, from_len)) return invalid_argument("link check: own address '" + *own + "'");
  if (from.ss_family != to.ss_family)
    return invalid_argument("link check: this member's data address " + *own + " cannot reach " + r.endpoint);
  Fd s;
  s.fd = ::socket(to.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.fd < 0) return unavailable("link check: socket: " + errno_text(errno));
  if (::bind(s.fd, reinterpret_cast<sockaddr*>(&from), from_len) != 0)
    return unavailable("link check: bind to this member's data address " + *own + ": " + errno_text(errno));
  if (::connect(s.fd, reinterpret_cast<sockaddr*>(&to), to_len) != 0 && errno != EINPROGRESS)
    return unavailable("link check: connect to " + r.endpoint + ": " + errno_text(errno));
  const std::string connecting = "link check: connect from " + *own + " to " + r.endpoint;
  if (Status w = wait_fd(s.fd, POLLOUT, deadline, connecting.c_str(), cancel); !w.ok()) return w;
  int err = 0;
  socklen_t el = sizeof err;
  ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &el);
  if (err != 0) return unavailable(connecting + ": " + errno_text(err));
  const int one = 1;
  ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::string out = r.token;
  out.resize(r.token.size() + r.bytes, '\x5a');
  if (Status w = move_all(s.fd, out.data(), nullptr, out.size(), deadline, "link check: sending to the publisher",
                          cancel);
      !w.ok())
    return w;
  std::string in(r.bytes, '\0');
  if (Status rd = move_all(s.fd, nullptr, in.data(), in.size(), deadline, "link check: receiving from the publisher",
                           cancel);
      !rd.ok())
    return rd;
  const uint64_t h = xxh64(in.data(), in.size());
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(h >> (8 * i));
  return move_all(s.fd, reinterpret_cast<const char*>(le), nullptr, 8, deadline, "link check: answering the publisher",
                  cancel);
}

StatusOr<LinkCheckRequest> link_check_request(proto::LinkCheck::Reader m) {
  LinkCheckRequest r;
  auto token = m.getToken();
  if (token.size() != kLinkCheckTokenBytes)
    return invalid_argument("LinkCheck token of " + std::to_string(token.size()) + " bytes, expected " +
                            std::to_string(kLinkCheckTokenBytes));
  r.token.assign(reinterpret_cast<const char*>(token.begin()), token.size());
  r.endpoint = m.getEndpoint().cStr();
  std::string address;
  uint16_t port = 0;
  sockaddr_storage sa{};
  socklen_t len = 0;
  if (!parse_endpoint(r.endpoint, address, port) || !to_sockaddr(address, port, sa, len))
    return invalid_argument("LinkCheck endpoint '" + r.endpoint.substr(0, 64) + "' is not address:port");
  r.bytes = m.getBytes();
  if (r.bytes > kMaxLinkCheckBytes)
    return invalid_argument("LinkCheck of " + std::to_string(r.bytes) + " bytes, at most " +
                            std::to_string(kMaxLinkCheckBytes));
  r.timeout = Millis(m.getTimeoutMs());
  if (r.timeout <= Millis(0) || r.timeout > kMaxLinkCheckTimeout)
    return invalid_argument("LinkCheck timeout of " + std::to_string(r.timeout.count()) + " ms, at most " +
                            std::to_string(kMaxLinkCheckTimeout.count()));
  return r;
}

void LinkCheckRunner::offer(LinkCheckRequest r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || running_) return;
  if (thread_.joinable()) thread_.join();  // finished: running_ is false
  running_ = true;
  thread_ = std::thread([this, r = std::move(r)] {
    const Status s = run_link_check(r, hostname_, iface_, &cancel_);
    if (cancel_) {
      running_ = false;
      return;
    }
    if (last_ok_ != int(s.ok())) {
      if (s.ok())
        PC_INFO(who_ << ": link check to the publisher's data address " << r.endpoint << " passed");
      else
        PC_WARN(who_ << ": link check to the publisher's data address failed: " << s.message());
    }
    last_ok_ = int(s.ok());
    running_ = false;
  });
}

void LinkCheckRunner::stop() {
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    t = std::move(thread_);
  }
  cancel_ = true;
  if (t.joinable()) t.join();  // within 100 ms
}
}  // namespace paramcast::group
