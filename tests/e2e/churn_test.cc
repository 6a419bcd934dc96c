// Churn in a count deployment (real processes and sockets): identities that
// join and leave continuously, by hand over the control protocol, while two
// real workers take updates. A member that joins after a formation began
// waits for the next one; one that leaves during a formation is dropped and
// the formation completes without it in the same call; the honest members
// are never named for another member's churn, and the updates reach them.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "common/control/messages.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::WorkerClusterTest;

// One identity that joins (probe, then member connection) and leaves, over
// and over, staying `stay` each time.
class Churner {
 public:
  Churner(zmq::context_t& ctx, const std::string& endpoint, std::string id)
      : id_(std::move(id)), probe_(ctx, zmq::socket_type::dealer), member_(ctx, zmq::socket_type::dealer) {
    std::string probe = "probe/", member = "member/";
    probe += id_;
    member += id_;
    probe_.set(zmq::sockopt::routing_id, probe + "/0000000000000001");
    member_.set(zmq::sockopt::routing_id, member + "/0000000000000002");
    for (auto* s : {&probe_, &member_}) {
      s->set(zmq::sockopt::linger, 0);
      s->connect(endpoint);
    }
  }
  // One join/leave cycle; false when the publisher did not welcome it in time.
  bool cycle(uint64_t incarnation, std::chrono::milliseconds stay) {
    if (!round_trip(probe_, incarnation)) return false;
    if (!round_trip(member_, incarnation)) return false;
    std::this_thread::sleep_for(stay);
    member_.send(control::make_message(0, incarnation, [](auto b) { b.initLeave().setReason("churn"); }),
                 zmq::send_flags::none);
    return true;
  }

 private:
  bool round_trip(zmq::socket_t& s, uint64_t incarnation) {
    s.send(control::make_message(0, incarnation,
                                 [&](auto b) {
                                   auto h = b.initHello();
                                   h.setProtocolVersion(proto::PROTOCOL_VERSION);
                                   h.setWorkerId(id_);
                                   h.setHost("churn");
                                 }),
           zmq::send_flags::none);
    const auto deadline = Clock::now() + 5s;
    zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
    while (Clock::now() < deadline) {
      if (zmq::poll(&item, 1, 20ms) <= 0) continue;
      zmq::message_t m;
      (void)s.recv(m, zmq::recv_flags::none);
      auto d = control::decode(m.data(), m.size(), {});
      if (d.ok() && std::string(control::body_name(d.value()->envelope())) == "welcome") return true;
    }
    return false;
  }
  const std::string id_;
  zmq::socket_t probe_, member_;
};

class ChurnTest : public WorkerClusterTest {};

TEST_F(ChurnTest, JoinLeaveCyclesDuringUpdatesCostTheHonestMembersNothing) {
  // 2 honest workers and free slots for 8 churning identities.
  std::string yaml =
      test::test_config_yaml(10, "  on_member_loss: continue\n  on_missing_at_start: start_with_present\n");
  yaml.replace(yaml.find("join_timeout: 30s"), 17, "join_timeout: 2s");
  make_publisher(yaml);
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  // start() waits join_timeout for the 8 absent ones, then starts with those present.
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  constexpr int kChurners = 8, kCycles = 1000;
  std::atomic<int> cycles{0}, refused{0};
  std::atomic<bool> done{false};
  std::thread churn([&] {
    zmq::context_t ctx;
    std::vector<std::unique_ptr<Churner>> c;
    for (int i = 0; i < kChurners; ++i)
      {
        std::string id = "churn-";
        id += std::to_string(i);
        c.push_back(std::make_unique<Churner>(ctx, pub_->endpoint(), id));
      }
    std::mt19937 rng(7);
    for (int n = 0; n < kCycles; ++n) {
      // Stays 0-40 ms: often across a formation (JoinGroup unanswered, then gone).
      if (!c[n % kChurners]->cycle(static_cast<uint64_t>(n) + 1, std::chrono::milliseconds(rng() % 40))) ++refused;
      ++cycles;
    }
    done = true;
  });
  int ok = 0, failed = 0;
  std::string failures;
  uint64_t version = 1;
  const auto give_up = Clock::now() + 240s;
  while (!done && Clock::now() < give_up) {
    UpdateResult r = publish(version++);
    if (r.ok()) {
      ++ok;
      int honest = 0;
      for (const auto& o : r.subscribers) honest += (o.worker_id == "worker-1" || o.worker_id == "worker-2") && o.status.ok();
      EXPECT_EQ(honest, 2) << "v" << r.version << " missed an honest member";
    } else {
      ++failed;
      if (failures.size() < 4000) {
        failures += "v";
        failures += std::to_string(r.version);
        failures += ": ";
        failures += r.status.to_string();
        failures += "\n";
      }
      for (const char* honest : {"worker-1: ", "worker-2: "})
        EXPECT_EQ(r.status.message().find(honest), std::string::npos) << "an honest member named: " << r.status.message();
    }
  }
  churn.join();
  std::printf("[figures] %d join/leave cycles (%d not welcomed) during %d updates: %d ok, %d failed\n", cycles.load(),
              refused.load(), ok + failed, ok, failed);
  EXPECT_EQ(cycles.load(), kCycles);
  EXPECT_EQ(failed, 0) << failures;
  EXPECT_GE(ok, 10);
}

}  // namespace
}  // namespace paramcast
