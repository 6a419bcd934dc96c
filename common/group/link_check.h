// Link checks: a member out of the group proves, off the update path, that
// its data path works before it is tried in a formation again.
//
// A member quarantined after failed formations (group_host.h) would
// otherwise be tried again when its backoff ends, and a still-broken data
// path (a firewall on the data ports, a cut link while the control path
// stays up) would cost that update a whole formation (init_timeout) every
// time. Instead, while a member on a network data plane (Gloo) is out, the
// publisher asks it every kLinkCheckInterval for a check over real sockets
// on both ends' data-plane addresses (data_plane.gloo_interface or
// gloo_hostname, where Gloo listens and connects):
//
//   member -> publisher  connect to LinkCheck.endpoint, send the 16-byte
//                        token, then `bytes` bytes
//   publisher -> member  `bytes` bytes of its own (fresh random per check)
//   member -> publisher  xxh64 of the bytes it read (8 bytes, little endian)
//
// within `timeout`. The publisher judges the check on what it saw itself:
// the token it minted, every byte it expected, the hash of the bytes only it
// knew. A member whose check has not passed since its last failed formation
// is not tried (GroupHost::excluded); one out for a data-path failure whose
// check passes is tried again at once, once per quarantine (group_host.h).
//
// LinkCheckHost is the publisher's end: one listening socket on its data
// address and one thread that polls it, the checks in flight, and the
// scheduler that asks whoever is due (`Hooks::due`). run_link_check() is
// the member's end: one blocking, bounded exchange.
//
// Bounds: at most kMaxChecksInFlight checks (and their payloads) at a time,
// one connection per check, kMaxConnections open; a connection must name
// its check within kTokenTimeout, one with an unknown token is closed at
// once, and when all are taken the oldest that named none goes; the
// members due are checked longest-unchecked first; results are kept per
// member, pruned after an hour.
//
// Threads: LinkCheckHost's hooks are called on its own thread without its
// lock held; every public method may be called from any thread (its lock is
// a leaf). run_link_check() blocks its caller up to the request's timeout.
//
// Files: link_check.cc (the member's end), link_check_host.cc (the
// publisher's end), link_check_net.h (the socket helpers both share).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "schemas/control.capnp.h"

namespace paramcast::group {

inline constexpr uint32_t kLinkCheckBytes = 256u << 10;
inline constexpr Millis kLinkCheckTimeout{2000};
inline constexpr Millis kLinkCheckInterval{1000};
inline constexpr size_t kLinkCheckTokenBytes = 16;
inline constexpr size_t kMaxChecksInFlight = 16;
inline constexpr size_t kMaxConnections = 32;  // open at once, checks and strays
inline constexpr Millis kTokenTimeout{500};     // a connection names its check by then
// What a member accepts from a LinkCheck message.
inline constexpr uint32_t kMaxLinkCheckBytes = 4u << 20;
inline constexpr Millis kMaxLinkCheckTimeout{60000};

struct LinkCheckRequest {
  std::string token;     // kLinkCheckTokenBytes bytes
  std::string endpoint;  // "address:port", "[address]:port" for IPv6
  uint32_t bytes = kLinkCheckBytes;
  Millis timeout = kLinkCheckTimeout;
};

// A finished check.
struct LinkCheckResult {
  bool passed = false;
  std::string why;  // what failed, when it did not pass
  std::chrono::steady_clock::time_point at;  // when the check started
};

class LinkCheckHost {
 public:
  struct Hooks {
    // Who needs a check now (called every few hundred ms).
    std::function<std::vector<std::string>()> due;
    // Delivers a request to a member (its LinkCheck control message).
    std::function<void(const std::string& id, const LinkCheckRequest&)> send;
  };
  // `hostname` / `iface`: the publisher's data-plane address, as
  // data_plane.gloo_hostname / gloo_interface give it.
  LinkCheckHost(std::string hostname, std::string iface, Hooks hooks);
  ~LinkCheckHost();
  LinkCheckHost(const LinkCheckHost&) = delete;
  LinkCheckHost& operator=(const LinkCheckHost&) = delete;

  // Binds the listening socket (an ephemeral port on the data address) and
  // starts the thread.
  Status start();
  void stop();
  std::string endpoint() const { return endpoint_; }
  // Its thread stopped on an error: no check will finish any more.
  bool failed() const { return failed_; }

  // The last finished check of `id`, if any.
  std::optional<LinkCheckResult> last(const std::string& id) const;
  // Starts a check of `id` now, unless one is in flight (the scheduler does
  // this for the members `due` lists, at most every kLinkCheckInterval).
  void check_now(const std::string& id);

 private:
  struct Pending;
  struct Conn;
  void loop();
  void schedule(std::chrono::steady_clock::time_point now);
  void accept_all();
  // Advances `c` on readable/writable; false when it is finished (closed).
  bool step(Conn& c);
  void finish_locked(const std::string& token, bool passed, const std::string& why);
  void expire(std::chrono::steady_clock::time_point now);

  const std::string hostname_, iface_;
  const Hooks hooks_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::string endpoint_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::chrono::steady_clock::time_point accept_paused_until_{};  // the thread's only

  mutable std::mutex mu_;  // guards the maps below; a leaf lock
  std::map<std::string, Pending> pending_;  // by token
  std::map<std::string, LinkCheckResult> results_;  // by member id
  std::map<std::string, std::chrono::steady_clock::time_point> started_;  // last check started, by member id
  std::vector<std::string> requested_;  // check_now() ids for the thread
  std::vector<Conn> conns_;             // the thread's only
};

// The address Gloo would use: `iface`'s first IPv4 (else IPv6) address, or
// `hostname` resolved; "ip" or "ip6" text.
StatusOr<std::string> data_address(const std::string& hostname, const std::string& iface);

// The member's end: one check from this process's data address
// (`hostname`/`iface`, as the member's data_plane config gives it). OK when
// every step completed within r.timeout; else what failed, and where.
// `cancel` (optional) set ends it within 100 ms.
Status run_link_check(const LinkCheckRequest& r, const std::string& hostname, const std::string& iface,
                      const std::atomic<bool>* cancel = nullptr);

// A LinkCheck message as a request, or what is wrong with it (token size,
// bytes or timeout beyond the bounds above, an endpoint that is not
// address:port).
StatusOr<LinkCheckRequest> link_check_request(proto::LinkCheck::Reader m);

// The member's side of the checks the publisher asks for: one at a time on
// its own thread (a request while one runs is dropped: the publisher asks
// again), its outcome logged when it changes.
class LinkCheckRunner {
 public:
  LinkCheckRunner(std::string who, std::string hostname, std::string iface)
      : who_(std::move(who)), hostname_(std::move(hostname)), iface_(std::move(iface)) {}
  ~LinkCheckRunner() { stop(); }
  LinkCheckRunner(const LinkCheckRunner&) = delete;
  LinkCheckRunner& operator=(const LinkCheckRunner&) = delete;
  // Starts `r` unless a check is running or the runner stopped.
  void offer(LinkCheckRequest r);
  void stop();

 private:
  const std::string who_, hostname_, iface_;
  std::mutex mu_;  // guards thread_ and stopped_
  std::thread thread_;
  bool stopped_ = false;
  std::atomic<bool> running_{false};
  std::atomic<bool> cancel_{false};  // stop(): the check in flight ends
  int last_ok_ = -1;  // the last outcome logged (its thread only, one at a time)
};

}  // namespace paramcast::group
