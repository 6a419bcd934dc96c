// Link checks over real sockets on loopback: the publisher's end judges a
// member's data path on what it saw itself (its token, every byte, the hash
// of bytes only it knew), within the check's bound; the member's end is the
// one a subscriber runs. Members that connect and stall, never connect,
// answer a wrong hash or send an unknown token fail, naming what was missing.
#include "common/group/link_check.h"

#include <arpa/inet.h>
#include <capnp/message.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace paramcast::group {
namespace {

using Clock = std::chrono::steady_clock;

// A publisher's end on loopback; `member` plays the member for each request.
class Host {
 public:
  explicit Host(std::function<void(const LinkCheckRequest&)> member, std::vector<std::string> due = {"worker-1"})
      : member_(std::move(member)),
        host_("127.0.0.1", "",
              LinkCheckHost::Hooks{[this] {
                                     std::lock_guard<std::mutex> lock(mu_);
                                     return due_;
                                   },
                                   [this](const std::string&, const LinkCheckRequest& r) {
                                     std::lock_guard<std::mutex> lock(mu_);
                                     ++sent_;
                                     threads_.emplace_back([this, r] { member_(r); });
                                   }}) {
    due_ = std::move(due);
  }
  ~Host() {
    stop_asking();
    host_.stop();
    std::vector<std::thread> t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      t.swap(threads_);
    }
    for (auto& x : t) x.join();
  }
  LinkCheckHost& host() { return host_; }
  void stop_asking() {
    std::lock_guard<std::mutex> lock(mu_);
    due_.clear();
  }
  int sent() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }
  // The first finished check of worker-1, waiting up to `limit`.
  std::optional<LinkCheckResult> result(std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      if (auto r = host_.last("worker-1")) return r;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::nullopt;
  }

 private:
  std::function<void(const LinkCheckRequest&)> member_;
  std::mutex mu_;
  std::vector<std::string> due_;
  std::vector<std::thread> threads_;
  int sent_ = 0;
  LinkCheckHost host_;
};

// A raw client: connects to the request's endpoint and runs `script` on it.
void raw(const LinkCheckRequest& r, const std::function<void(int fd)>& script) {
  const auto colon = r.endpoint.rfind(':');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(r.endpoint.substr(colon + 1))));
  inet_pton(AF_INET, r.endpoint.substr(0, colon).c_str(), &to.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0) script(fd);  // refused once the host stopped
  ::close(fd);
}

void send_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string recv_all(int fd, size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::recv(fd, out.data() + done, n - done, 0);
    if (got <= 0) break;
    done += static_cast<size_t>(got);
  }
  out.resize(done);
  return out;
}

TEST(LinkCheckTest, AMemberWhoseDataPathWorksPasses) {
  Host h([](const LinkCheckRequest& r) { (void)run_link_check(r, "127.0.0.1", ""); });
  ASSERT_TRUE(h.host().start().ok());
  EXPECT_EQ(h.host().endpoint().rfind("127.0.0.1:", 0), 0u) << h.host().endpoint();
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->passed) << r->why;
}

TEST(LinkCheckTest, TheMembersEndBindsItsOwnDataInterface) {
  Host h([](const LinkCheckRequest& r) { (void)run_link_check(r, "", "lo"); });
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->passed) << r->why;
}

TEST(LinkCheckTest, AMemberThatNeverConnectsFailsAtTheBound) {
  Host h([](const LinkCheckRequest&) {});
  const auto t0 = Clock::now();
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->passed);
  EXPECT_NE(r->why.find("no connection from its data address to 127.0.0.1:"), std::string::npos) << r->why;
  EXPECT_GE(Clock::now() - t0, kLinkCheckTimeout);
}

TEST(LinkCheckTest, AMemberThatStallsAfterItsTokenFailsNamingTheBytesThatArrived) {
  Host h([](const LinkCheckRequest& r) {
    raw(r, [&](int fd) {
      send_all(fd, r.token + std::string(1000, 'x'));
      std::this_thread::sleep_for(kLinkCheckTimeout + std::chrono::milliseconds(500));
    });
  });
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->passed);
  EXPECT_NE(r->why.find("1000 of its " + std::to_string(kLinkCheckBytes) + " bytes arrived"), std::string::npos)
      << r->why;
}

TEST(LinkCheckTest, AWrongHashFails) {
  Host h([](const LinkCheckRequest& r) {
    raw(r, [&](int fd) {
      send_all(fd, r.token + std::string(r.bytes, 'x'));
      recv_all(fd, r.bytes);
      send_all(fd, std::string(8, '\0'));  // not the hash of what came
      recv_all(fd, 1);
    });
  });
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->passed);
  EXPECT_NE(r->why.find("hash of bytes the publisher did not send"), std::string::npos) << r->why;
}

// A connection with a token the publisher never minted is closed at once
// and counts for nobody; the member's real check still passes.
TEST(LinkCheckTest, AnUnknownTokenIsClosedAndCountsForNobody) {
  Host h([](const LinkCheckRequest& r) {
    raw(r, [&](int fd) {
      send_all(fd, std::string(kLinkCheckTokenBytes, 'f') + std::string(100, 'x'));
      EXPECT_EQ(recv_all(fd, 1).size(), 0u) << "closed without a byte";  // (or refused: the host stopped)
    });
    (void)run_link_check(r, "127.0.0.1", "");
  });
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->passed) << r->why;
}

// Connections that never name a check are closed after kTokenTimeout, and
// when every slot is taken the oldest of them gives way: a peer holding
// connections open cannot keep a member's check out.
TEST(LinkCheckTest, ConnectionsThatNameNoCheckCannotCrowdOutAMembersCheck) {
  std::vector<int> hogs;
  std::mutex hogs_mu;
  Host h([&](const LinkCheckRequest& r) {
    {
      std::lock_guard<std::mutex> lock(hogs_mu);
      if (hogs.empty())  // the first request: fill every slot first, then check
        for (size_t i = 0; i < kMaxConnections + 4; ++i) {
          const auto colon = r.endpoint.rfind(':');
          sockaddr_in to{};
          to.sin_family = AF_INET;
          to.sin_port = htons(static_cast<uint16_t>(std::stoi(r.endpoint.substr(colon + 1))));
          inet_pton(AF_INET, r.endpoint.substr(0, colon).c_str(), &to.sin_addr);
          const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
          if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0) hogs.push_back(fd);
          else ::close(fd);
        }
    }
    (void)run_link_check(r, "127.0.0.1", "");
  });
  ASSERT_TRUE(h.host().start().ok());
  auto r = h.result();
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->passed) << r->why;
  std::lock_guard<std::mutex> lock(hogs_mu);
  EXPECT_EQ(hogs.size(), kMaxConnections + 4);
  for (int fd : hogs) ::close(fd);
}

// Checks repeat every kLinkCheckInterval while a member is due, not faster.
TEST(LinkCheckTest, ChecksRepeatAtTheirIntervalWhileDue) {
  Host h([](const LinkCheckRequest& r) { (void)run_link_check(r, "127.0.0.1", ""); });
  ASSERT_TRUE(h.host().start().ok());
  std::this_thread::sleep_for(kLinkCheckInterval * 2 + std::chrono::milliseconds(500));
  h.stop_asking();
  EXPECT_GE(h.sent(), 2);
  EXPECT_LE(h.sent(), 4);
}

TEST(LinkCheckTest, TheMembersEndRefusesABadRequestNamingWhatIsWrong) {
  auto make = [](size_t token, const std::string& endpoint, uint32_t bytes, uint32_t ms) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<proto::LinkCheck>();
    std::string t(token, 'a');
    m.setToken(kj::arrayPtr(reinterpret_cast<const kj::byte*>(t.data()), t.size()));
    m.setEndpoint(endpoint);
    m.setBytes(bytes);
    m.setTimeoutMs(ms);
    return link_check_request(m.asReader());
  };
  EXPECT_TRUE(make(16, "10.0.0.1:5000", 1024, 2000).ok());
  EXPECT_TRUE(make(16, "[::1]:5000", 1024, 2000).ok());
  EXPECT_NE(make(15, "10.0.0.1:5000", 1024, 2000).status().message().find("token of 15 bytes, expected 16"),
            std::string::npos);
  EXPECT_NE(make(16, "host:5000", 1024, 2000).status().message().find("'host:5000' is not address:port"),
            std::string::npos);
  EXPECT_NE(make(16, "10.0.0.1:99999", 1024, 2000).status().message().find("is not address:port"),
            std::string::npos);
  EXPECT_NE(make(16, "10.0.0.1:5000", kMaxLinkCheckBytes + 1, 2000).status().message().find("at most"),
            std::string::npos);
  EXPECT_NE(make(16, "10.0.0.1:5000", 1024, 0).status().message().find("timeout of 0 ms"), std::string::npos);
  EXPECT_NE(make(16, "10.0.0.1:5000", 1024, 600000).status().message().find("timeout of 600000 ms"),
            std::string::npos);
}

TEST(LinkCheckTest, TheDataAddressIsWhereGlooWouldListen) {
  auto lo = data_address("", "lo");
  ASSERT_TRUE(lo.ok()) << lo.status().message();
  EXPECT_EQ(*lo, "127.0.0.1");
  auto host = data_address("127.0.0.1", "");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(*host, "127.0.0.1");
  auto none = data_address("", "pcnosuch0");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("gloo_interface 'pcnosuch0' has no IP address"), std::string::npos)
      << none.status().message();
}

}  // namespace
}  // namespace paramcast::group
