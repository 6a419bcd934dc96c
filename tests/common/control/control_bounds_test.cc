// The publisher's memory stays flat under churn and hostile input: 10,000
// join/leave cycles over real sockets (100 ids, so departed members must be
// pruned), then 1,000,000 hostile frames through the in-process inject path.
// Meant to run under AddressSanitizer too (ctest label "bounds"); the
// quarantine is kept small so that RSS measures what the publisher holds.
#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <random>

#include "common/control/control_server.h"
#include "common/control/messages.h"
#include "common/log.h"
#include "tests/support/sanitizer.h"

#if defined(PARAMCAST_TEST_ASAN)
extern "C" const char* __asan_default_options() { return "quarantine_size_mb=16:detect_leaks=1"; }
#endif

namespace paramcast::control {
namespace {

// A sanitizer checks the locking and the memory accesses, not the volume (the
// plain build's million frames took 83 s under ASan on CI's 2 cores).
constexpr int kHostileFrames = test::kSanitized ? 100000 : 1000000;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double rss_mib() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

zmq::message_t hello(const std::string& id, uint64_t inc) {
  return make_message(0, inc, [&](auto b) {
    auto h = b.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerId(id);
    h.setHost("churn");
  });
}

// Sends on `s` and waits for the reply whose body is `expect` (heartbeats of
// an earlier membership may come first).
bool round_trip(zmq::socket_t& s, zmq::message_t frame, const char* expect) {
  s.send(frame, zmq::send_flags::none);
  for (;;) {
    zmq::message_t reply;
    if (!s.recv(reply)) return false;
    auto d = decode(reply.data(), reply.size(), {});
    if (!d.ok()) return false;
    const std::string got = body_name(d.value()->envelope());
    if (got != "heartbeat") return got == expect;
  }
}

class ControlBoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_log_level(LogLevel::kError);  // a million refusals are counted, not printed, here
    ServerOptions o;
    o.control.endpoint = "tcp://127.0.0.1:*";
    o.control.heartbeat_interval = 100ms;
    o.control.heartbeat_timeout = 2000ms;
    o.subscriber_count = 1000;  // a free slot for every id: churn, not admission, is measured
    server_ = std::make_unique<ControlServer>(o);
    ASSERT_TRUE(server_->start(nullptr).ok());
  }
  void TearDown() override {
    server_.reset();
    set_log_level(LogLevel::kInfo);
  }
  std::unique_ptr<ControlServer> server_;
};

TEST_F(ControlBoundsTest, MemoryStaysFlatUnderChurnAndHostileFrames) {
  constexpr int kIds = 100, kCyclesPerId = 100;  // 10,000 join/leave cycles
  zmq::context_t ctx;
  struct Pair {
    zmq::socket_t probe, member;
  };
  std::vector<std::unique_ptr<Pair>> peers;
  for (int i = 0; i < kIds; ++i) {
    auto p = std::make_unique<Pair>(Pair{zmq::socket_t(ctx, zmq::socket_type::dealer),
                                         zmq::socket_t(ctx, zmq::socket_type::dealer)});
    const std::string id = "churn-" + std::to_string(i);
    p->probe.set(zmq::sockopt::routing_id, "probe/" + id + "/0000000000000001");
    p->member.set(zmq::sockopt::routing_id, "member/" + id + "/0000000000000002");
    for (auto* s : {&p->probe, &p->member}) {
      s->set(zmq::sockopt::linger, 0);
      s->set(zmq::sockopt::rcvtimeo, 10000);
      s->connect(server_->endpoint());
    }
    peers.push_back(std::move(p));
  }
  double warm = 0;
  const auto t0 = Clock::now();
  for (int cycle = 0; cycle < kCyclesPerId; ++cycle) {
    if (cycle == 5) warm = rss_mib();
    for (int i = 0; i < kIds; ++i) {
      const std::string id = "churn-" + std::to_string(i);
      const uint64_t inc = static_cast<uint64_t>(cycle) * kIds + i + 1;
      ASSERT_TRUE(round_trip(peers[i]->probe, hello(id, inc), "welcome")) << id << " cycle " << cycle;
      ASSERT_TRUE(round_trip(peers[i]->member, hello(id, inc), "welcome")) << id << " cycle " << cycle;
      peers[i]->member.send(make_message(0, inc, [](auto b) { b.initLeave().setReason("cycle"); }),
                            zmq::send_flags::none);
    }
  }
  const auto churn_s = std::chrono::duration<double>(Clock::now() - t0).count();
  // Every Leave is in once the table is down to the pruning bound.
  const auto deadline = Clock::now() + 10s;
  while (!server_->live_ids().empty() && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(server_->live_ids().empty());
  std::this_thread::sleep_for(300ms);  // a liveness pass prunes
  EXPECT_LE(server_->table_size(), ControlServer::kMaxDeparted);
  const double after_churn = rss_mib();
  peers.clear();

  // kHostileFrames (1,000,000; 100,000 under a sanitizer) hostile frames, each from a fresh identity: garbage, invalid
  // ids, valid Hellos under fresh ids (probe answers), messages of non-members.
  std::mt19937_64 rng(7);
  std::vector<zmq::message_t> kinds;
  kinds.push_back(make_message(0, 1, [](auto b) { b.initHeartbeat().setWeightVersion(1); }));
  kinds.push_back(make_message(0, 1, [](auto b) { b.initStatusRequest().setRequestId(1); }));
  std::string garbage(256, '\0');
  for (auto& c : garbage) c = static_cast<char>(rng());
  const auto t1 = Clock::now();
  for (int i = 0; i < kHostileFrames; ++i) {
    const std::string id = "h" + std::to_string(i);
    switch (i % 4) {
      case 0: server_->inject("probe/" + id + "/1", garbage.data(), garbage.size()); break;
      case 1: {
        auto h = hello(i % 8 == 1 ? std::string(200, 'x') + id : id, i + 1);
        server_->inject("probe/" + id + "/1", h.data(), h.size());
        break;
      }
      case 2: server_->inject("member/" + id + "/1", kinds[0].data(), kinds[0].size()); break;
      default: server_->inject("status-" + id, kinds[1].data(), kinds[1].size()); break;
    }
  }
  const auto hostile_s = std::chrono::duration<double>(Clock::now() - t1).count();
  std::this_thread::sleep_for(300ms);
  const double after_hostile = rss_mib();
  std::printf("RSS: %.1f MiB after warm-up, %.1f MiB after 10,000 join/leave cycles (%.1f s), %.1f MiB after "
              "%d hostile frames (%.1f s); table %zu rows; %llu frames dropped\n",
              warm, after_churn, churn_s, after_hostile, kHostileFrames, hostile_s, server_->table_size(),
              static_cast<unsigned long long>(server_->dropped_frames()));
  EXPECT_LT(after_churn - warm, 64.0);
  EXPECT_LT(after_hostile - warm, 64.0);
  EXPECT_LE(server_->table_size(), ControlServer::kMaxDeparted);
  // Garbage and invalid ids are dropped; the rest are answered or refused.
  EXPECT_GE(server_->dropped_frames(), static_cast<uint64_t>(kHostileFrames) * 3 / 8);
}

}  // namespace
}  // namespace paramcast::control
