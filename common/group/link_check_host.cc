// Link checks, the publisher's end (LinkCheckHost): the listening socket on
// its data address, the scheduler that asks the members due, and the verdict
// on each check from what the publisher saw itself (its token, every byte it
// expected, the hash of the bytes only it knew). The member's end is
// link_check.cc; the protocol and the bounds are in link_check.h.
#include "common/group/link_check.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/group/link_check_net.h"
#include "common/log.h"
#include "common/xxhash.h"

namespace paramcast::group {

using namespace link_net;

struct LinkCheckHost::Pending {
  std::string id;
  Clock::time_point started;
  Clock::time_point deadline;
  uint32_t bytes = 0;
  std::string payload;  // what the publisher sends back
  uint64_t hash = 0;    // its xxh64
  bool connected = false;
};

struct LinkCheckHost::Conn {
  int fd = -1;
  Clock::time_point accepted;
  Clock::time_point deadline;
  enum class Stage { kToken, kTheirs, kOurs, kHash } stage = Stage::kToken;
  std::string token;
  size_t done = 0;   // bytes of the current stage
  uint32_t bytes = 0;
  std::string ours;  // the payload to send (copied from Pending)
  uint64_t hash = 0;
  char buf[64 << 10];
};

LinkCheckHost::LinkCheckHost(std::string hostname, std::string iface, Hooks hooks)
    : hostname_(std::move(hostname)), iface_(std::move(iface)), hooks_(std::move(hooks)) {}

LinkCheckHost::~LinkCheckHost() { stop(); }

Status LinkCheckHost::start() {
  auto address = data_address(hostname_, iface_);
  if (!address.ok()) return address.status().with_context("link checks");
  sockaddr_storage sa{};
  socklen_t len = 0;
  if (!to_sockaddr(*address, 0, sa, len)) return invalid_argument("link checks: address '" + *address + "'");
  listen_fd_ = ::socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return unavailable("link checks: socket: " + errno_text(errno));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), len) != 0 || ::listen(listen_fd_, SOMAXCONN) != 0) {
    const int e = errno;
    ::close(listen_fd_);
    listen_fd_ = -1;
    return unavailable("link checks: listen on " + *address + ": " + errno_text(e));
  }
  sockaddr_storage bound{};
  socklen_t bl = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &bl);
  const uint16_t port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                                         : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  endpoint_ = endpoint_text(*address, port);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return unavailable("link checks: eventfd: " + errno_text(errno));
  thread_ = std::thread([this] { loop(); });
  return Status();
}

void LinkCheckHost::stop() {
  stop_ = true;
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }
  if (thread_.joinable()) thread_.join();
  for (auto& c : conns_) ::close(c.fd);
  conns_.clear();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
}

std::optional<LinkCheckResult> LinkCheckHost::last(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = results_.find(id);
  if (it == results_.end()) return std::nullopt;
  return it->second;
}

void LinkCheckHost::check_now(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    requested_.push_back(id);
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }
}

void LinkCheckHost::finish_locked(const std::string& token, bool passed, const std::string& why) {
  auto it = pending_.find(token);
  if (it == pending_.end()) return;
  const std::string id = it->second.id;
  const auto started = it->second.started;
  pending_.erase(it);
  auto prev = results_.find(id);
  if (prev == results_.end() || prev->second.passed != passed)
    PC_INFO("publisher: link check of '" << id << "' " << (passed ? "passed" : "failed: " + why));
  results_[id] = LinkCheckResult{passed, why, started};
}

void LinkCheckHost::schedule(Clock::time_point now) {
  std::vector<std::string> due = hooks_.due ? hooks_.due() : std::vector<std::string>{};
  std::vector<std::pair<std::string, LinkCheckRequest>> send;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> forced;
    forced.swap(requested_);
    // A check starts now, after every check_now() it takes: its result's
    // time is never before the request (GroupHost::probe_data_paths counts
    // only checks that started after it asked). `now`, the turn's time, may
    // be older.
    const auto start = Clock::now();
    for (const auto& id : forced)
      if (std::find(due.begin(), due.end(), id) == due.end()) due.push_back(id);
    // The longest unchecked first, so that no member waits behind others
    // that keep failing.
    std::stable_sort(due.begin(), due.end(), [&](const std::string& a, const std::string& b) {
      auto x = started_.find(a), y = started_.find(b);
      const auto ta = x == started_.end() ? Clock::time_point{} : x->second;
      const auto tb = y == started_.end() ? Clock::time_point{} : y->second;
      return ta < tb;
    });
    std::vector<std::string> later;  // asked for now, not started: asked again at the next turn
    for (const auto& id : due) {
      const bool asked = std::find(forced.begin(), forced.end(), id) != forced.end();
      bool in_flight = false;
      for (const auto& [t, p] : pending_) in_flight = in_flight || p.id == id;
      if (pending_.size() >= kMaxChecksInFlight || in_flight) {
        if (asked) later.push_back(id);
        continue;
      }
      auto s = started_.find(id);
      if (!asked && s != started_.end() && now - s->second < kLinkCheckInterval) continue;
      started_[id] = start;
      Pending p;
      p.id = id;
      p.started = start;
      p.deadline = start + kLinkCheckTimeout;
      p.bytes = kLinkCheckBytes;
      p.payload = random_bytes(p.bytes);
      p.hash = xxh64(p.payload.data(), p.payload.size());
      const std::string token = random_bytes(kLinkCheckTokenBytes);
      pending_[token] = std::move(p);
      send.emplace_back(id, LinkCheckRequest{token, endpoint_, kLinkCheckBytes, kLinkCheckTimeout});
    }
    for (const auto& id : later)
      if (std::find(requested_.begin(), requested_.end(), id) == requested_.end()) requested_.push_back(id);
    // Bounded: what is an hour old goes.
    for (auto it = results_.begin(); it != results_.end();)
      it = now - it->second.at > std::chrono::hours(1) ? results_.erase(it) : std::next(it);
    for (auto it = started_.begin(); it != started_.end();)
      it = now - it->second > std::chrono::hours(1) ? started_.erase(it) : std::next(it);
  }
  for (const auto& [id, r] : send)
    if (hooks_.send) hooks_.send(id, r);
}

void LinkCheckHost::expire(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> gone;
  for (const auto& [token, p] : pending_)
    if (p.deadline <= now && !p.connected) gone.push_back(token);
  for (const auto& t : gone) {
    std::string why = "no connection from its data address to ";
    why += endpoint_;
    why += " within ";
    why += std::to_string(kLinkCheckTimeout.count());
    why += " ms";
    finish_locked(t, false, why);
  }
}

void LinkCheckHost::accept_all() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors (or another error that leaves the socket
      // readable): not polled for a while, rather than spinning.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) accept_paused_until_ = Clock::now() + Millis(100);
      return;
    }
    if (conns_.size() >= kMaxConnections) {
      // Full: the oldest connection that has not named a check goes (a
      // peer holding connections open cannot keep honest members out).
      auto oldest = conns_.end();
      for (auto it = conns_.begin(); it != conns_.end(); ++it)
        if (it->token.empty() && (oldest == conns_.end() || it->accepted < oldest->accepted)) oldest = it;
      if (oldest == conns_.end()) {
        ::close(fd);
        continue;
      }
      ::close(oldest->fd);
      conns_.erase(oldest);
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Conn c;
    c.fd = fd;
    c.accepted = Clock::now();
    c.deadline = c.accepted + kTokenTimeout;  // its token comes first, at once
    conns_.push_back(std::move(c));
  }
}

// One connection's exchange: token, their bytes, ours, the hash of ours.
bool LinkCheckHost::step(Conn& c) {
  auto fail = [&](const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    finish_locked(c.token, false, why);
    return false;
  };
  for (;;) {
    ssize_t n = 0;
    switch (c.stage) {
      case Conn::Stage::kToken: {
        n = ::recv(c.fd, c.buf + c.done, kLinkCheckTokenBytes - c.done, 0);
        if (n <= 0) break;
        c.done += static_cast<size_t>(n);
        if (c.done < kLinkCheckTokenBytes) continue;
        c.token.assign(c.buf, kLinkCheckTokenBytes);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(c.token);
        if (it == pending_.end() || it->second.connected) {  // not a check of ours
          c.token.clear();
          return false;
        }
        it->second.connected = true;
        c.deadline = it->second.deadline;
        c.bytes = it->second.bytes;
        c.ours = it->second.payload;
        c.hash = it->second.hash;
        c.stage = Conn::Stage::kTheirs;
        c.done = 0;
        continue;
      }
      case Conn::Stage::kTheirs:
        if (c.done == c.bytes) {
          c.stage = Conn::Stage::kOurs;
          c.done = 0;
          continue;
        }
        n = ::recv(c.fd, c.buf, std::min<size_t>(sizeof c.buf, c.bytes - c.done), 0);
        if (n <= 0) break;
        c.done += static_cast<size_t>(n);
        continue;
      case Conn::Stage::kOurs:
        if (c.done == c.bytes) {
          c.stage = Conn::Stage::kHash;
          c.done = 0;
          continue;
        }
        n = ::send(c.fd, c.ours.data() + c.done, c.bytes - c.done, MSG_NOSIGNAL);
        if (n <= 0) break;
        c.done += static_cast<size_t>(n);
        continue;
      case Conn::Stage::kHash: {
        n = ::recv(c.fd, c.buf + c.done, 8 - c.done, 0);
        if (n <= 0) break;
        c.done += static_cast<size_t>(n);
        if (c.done < 8) continue;
        uint64_t h = 0;
        for (int i = 0; i < 8; ++i) h |= static_cast<uint64_t>(static_cast<unsigned char>(c.buf[i])) << (8 * i);
        std::lock_guard<std::mutex> lock(mu_);
        finish_locked(c.token, h == c.hash, h == c.hash ? "" : "it answered a hash of bytes the publisher did not send");
        return false;
      }
    }
    // n <= 0
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (c.token.empty()) return false;
    std::string why = n == 0 ? "the member closed the connection" : "connection failed: " + errno_text(errno);
    why += c.stage == Conn::Stage::kTheirs ? " after " + std::to_string(c.done) + " of its " +
                                                 std::to_string(c.bytes) + " bytes"
           : c.stage == Conn::Stage::kOurs ? " after " + std::to_string(c.done) + " of the publisher's " +
                                                 std::to_string(c.bytes) + " bytes"
                                           : " before its answer";
    return fail(why);
  }
}

void LinkCheckHost::loop() {
  auto next_schedule = Clock::now();
  while (!stop_) {
    const auto now = Clock::now();
    if (now >= next_schedule) {
      schedule(now);
      next_schedule = now + Millis(250);
    }
    expire(now);
    std::vector<pollfd> fds;
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({now >= accept_paused_until_ ? listen_fd_ : -1, POLLIN, 0});
    for (const auto& c : conns_)
      fds.push_back({c.fd, static_cast<short>(c.stage == Conn::Stage::kOurs ? POLLOUT : POLLIN), 0});
    auto wake_at = next_schedule;
    if (now < accept_paused_until_) wake_at = std::min(wake_at, accept_paused_until_);
    for (const auto& c : conns_) wake_at = std::min(wake_at, c.deadline);
    const int n = ::poll(fds.data(), fds.size(), ms_until(wake_at) + 1);
    if (n < 0 && errno != EINTR) {
      PC_WARN("publisher: link checks stop: poll: " << errno_text(errno));
      failed_ = true;  // GroupHost then goes by backoffs alone
      return;
    }
    if (fds[0].revents) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof v);
      next_schedule = Clock::now();  // check_now()
    }
    std::vector<Conn*> ready;
    for (size_t i = 2; i < fds.size(); ++i)
      if (fds[i].revents) ready.push_back(&conns_[i - 2]);
    std::vector<int> done;
    for (Conn* c : ready)
      if (!step(*c)) done.push_back(c->fd);
    const auto after = Clock::now();
    for (auto& c : conns_) {
      if (std::find(done.begin(), done.end(), c.fd) != done.end() || c.deadline > after) continue;
      std::string why = "not done within ";
      why += std::to_string(kLinkCheckTimeout.count());
      why += " ms: ";
      why += c.stage == Conn::Stage::kToken ? "no token"
             : c.stage == Conn::Stage::kTheirs ? std::to_string(c.done) + " of its " + std::to_string(c.bytes) +
                                                     " bytes arrived"
             : c.stage == Conn::Stage::kOurs ? std::to_string(c.done) + " of the publisher's " +
                                                   std::to_string(c.bytes) + " bytes sent"
                                             : "no answer";
      if (!c.token.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        finish_locked(c.token, false, why);
      }
      done.push_back(c.fd);
    }
    for (int fd : done) {
      ::close(fd);
      conns_.erase(std::remove_if(conns_.begin(), conns_.end(), [&](const Conn& c) { return c.fd == fd; }),
                   conns_.end());
    }
    if (fds[1].revents) accept_all();
  }
}

}  // namespace paramcast::group
