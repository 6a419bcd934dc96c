// connect_mesh (common/data/gloo/mesh.h): real Gloo TCP pairs on loopback,
// one thread per rank, a store in memory. A peer that never publishes, one
// whose address refuses, and one the formation gave up on: each is named by
// rank, within the deadline, and the healthy ranks are never named.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "common/data/gloo/mesh.h"

namespace paramcast::gloo_backend {
namespace {

using Ms = std::chrono::milliseconds;

class MemoryStore : public Store {
 public:
  Status set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
    cv_.notify_all();
    return Status();
  }
  StatusOr<std::string> get(const std::string& key, Ms timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) || !cancelled_.empty(); }))
      return timeout_error("key '" + key + "' not set");
    if (!cancelled_.empty()) return unavailable(cancelled_);
    return values_[key];
  }
  std::string cancelled() override {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  void cancel(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = why;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
  std::string cancelled_;
};

struct Outcome {
  MeshResult result;
  double seconds = 0;
};

// Runs `ranks` of a world of `size` on threads, each with its own device.
std::map<int, Outcome> run_ranks(const std::vector<int>& ranks, int size, MemoryStore& store, Ms timeout) {
  std::map<int, Outcome> out;
  std::mutex mu;
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + timeout;
  for (int r : ranks)
    threads.emplace_back([&, r] {
      ::gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = ::gloo::transport::tcp::CreateDevice(attr);
      const auto t0 = Clock::now();
      auto result = connect_mesh(r, size, device, store, "mesh/", deadline, {"publisher", "worker-1", "worker-2"});
      const double took = std::chrono::duration<double>(Clock::now() - t0).count();
      std::lock_guard<std::mutex> lock(mu);
      out[r] = Outcome{std::move(result), took};
    });
  for (auto& t : threads) t.join();
  return out;
}

TEST(GlooMeshTest, EveryPairConnects) {
  MemoryStore store;
  auto out = run_ranks({0, 1, 2}, 3, store, Ms(20000));
  for (auto& [r, o] : out) {
    EXPECT_TRUE(o.result.context) << "rank " << r << ": " << o.result.error;
    EXPECT_TRUE(o.result.unreachable.empty() && o.result.no_address.empty());
  }
}

TEST(GlooMeshTest, PeerThatNeverPublishesIsNamedByTheDeadline) {
  MemoryStore store;
  const Ms timeout(1500);
  auto out = run_ranks({0, 1}, 3, store, timeout);  // rank 2 never starts
  for (auto& [r, o] : out) {
    EXPECT_FALSE(o.result.context);
    EXPECT_EQ(o.result.no_address, std::vector<int>{2}) << "rank " << r << ": " << o.result.error;
    EXPECT_TRUE(o.result.unreachable.empty()) << o.result.error;
    EXPECT_NE(o.result.error.find("worker-2: its address never arrived"), std::string::npos) << o.result.error;
    EXPECT_LT(o.seconds, 1.5 + 5.0);  // the deadline, plus slack for a loaded machine: never Gloo's 5x
  }
}

// Rank 1 never publishes: the ranks after it still connect to each other at
// once (each peer waits for its own address), so only rank 1 is named.
TEST(GlooMeshTest, OneMissingAddressDelaysNobodyElse) {
  MemoryStore store;
  auto out = run_ranks({0, 2, 3}, 4, store, Ms(2000));
  for (auto& [r, o] : out) {
    EXPECT_FALSE(o.result.context);
    EXPECT_EQ(o.result.no_address, std::vector<int>{1}) << "rank " << r << ": " << o.result.error;
    EXPECT_TRUE(o.result.unreachable.empty()) << "rank " << r << ": " << o.result.error;
  }
}

// Rank 2 publishes addresses of a port nobody listens on (as a member with a
// bad address would): both others name rank 2, and only rank 2.
TEST(GlooMeshTest, PeerWhoseAddressRefusesIsNamed) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sin), sizeof sin), 0);
  socklen_t len = sizeof sin;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&sin), &len), 0);
  ::close(fd);  // the port is free again: a connect to it is refused
  sockaddr_storage ss{};
  std::memcpy(&ss, &sin, sizeof sin);
  const auto record = ::gloo::transport::tcp::Address(ss, 0).bytes();
  std::string blob(record.begin(), record.end());
  MemoryStore store;
  ASSERT_TRUE(store.set("mesh/2", blob + blob).ok());
  auto out = run_ranks({0, 1}, 3, store, Ms(3000));
  for (auto& [r, o] : out) {
    EXPECT_FALSE(o.result.context);
    EXPECT_EQ(o.result.unreachable, std::vector<int>{2}) << "rank " << r << ": " << o.result.error;
    EXPECT_NE(o.result.error.find("worker-2: "), std::string::npos) << o.result.error;
    EXPECT_LT(o.seconds, 3.0 + 5.0);
  }
}

// Rank 2's address (127.0.0.2) sorts above the others', so each of them
// waits for rank 2 to connect, which it never does (as with a peer whose data
// port is firewalled): named at the deadline, not at Gloo's 5x its timeout.
TEST(GlooMeshTest, PeerThatNeverConnectsIsNamedAtTheDeadline) {
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(0x7f000002);
  sin.sin_port = htons(9);
  sockaddr_storage ss{};
  std::memcpy(&ss, &sin, sizeof sin);
  const auto record = ::gloo::transport::tcp::Address(ss, 0).bytes();
  std::string blob(record.begin(), record.end());
  MemoryStore store;
  ASSERT_TRUE(store.set("mesh/2", blob + blob).ok());
  auto out = run_ranks({0, 1}, 3, store, Ms(2000));
  for (auto& [r, o] : out) {
    EXPECT_FALSE(o.result.context);
    EXPECT_EQ(o.result.unreachable, std::vector<int>{2}) << "rank " << r << ": " << o.result.error;
    EXPECT_NE(o.result.error.find("worker-2: not connected by the deadline"), std::string::npos) << o.result.error;
    EXPECT_GE(o.seconds, 1.9);
    EXPECT_LT(o.seconds, 2.0 + 5.0);  // a loaded machine's slack; Gloo's own wait would be 10 s
  }
}

TEST(GlooMeshTest, MalformedAddressIsNamedNotTrusted) {
  MemoryStore store;
  ASSERT_TRUE(store.set("mesh/2", std::string(7, 'x')).ok());
  auto out = run_ranks({0, 1}, 3, store, Ms(3000));
  for (auto& [r, o] : out) {
    EXPECT_EQ(o.result.unreachable, std::vector<int>{2}) << "rank " << r << ": " << o.result.error;
    EXPECT_NE(o.result.error.find("malformed address (7 bytes"), std::string::npos) << o.result.error;
  }
}

// The formation ended elsewhere: the wait stops within a poll and no rank is
// named on evidence this rank did not finish gathering.
TEST(GlooMeshTest, CancelledFormationEndsTheWaitWithoutEvidence) {
  MemoryStore store;
  std::thread canceller([&] {
    std::this_thread::sleep_for(Ms(300));
    store.cancel("worker-1 said GroupFailed");
  });
  auto out = run_ranks({0}, 3, store, Ms(60000));
  canceller.join();
  const auto& o = out.at(0);
  EXPECT_FALSE(o.result.context);
  EXPECT_TRUE(o.result.unreachable.empty() && o.result.no_address.empty());
  EXPECT_NE(o.result.error.find("group formation ended: worker-1 said GroupFailed"), std::string::npos)
      << o.result.error;
  EXPECT_LT(o.seconds, 10.0);  // not the 60 s deadline
}

}  // namespace
}  // namespace paramcast::gloo_backend
