// What an update reports, with real processes. A many-sender update (rank 0
// and rank 1 in this process, engines as paramcast-worker processes) whose
// engines are gone fails as a single sender's does with no subscriber
// (UNAVAILABLE), for every trainer rank, and the next engine to join gets
// the next update.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <thread>

#include "tests/e2e/sharded_fixture.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using sharded_test::ShardedUpdateTest;

class ShardedNoEngineTest : public ShardedUpdateTest {
 protected:
  void SetUp() override { start_cluster("  ranks: 2\n  on_member_loss: continue\n"); }

  // Waits for an event of one of `kinds` for `id`.
  bool wait_any(const std::string& id, std::initializer_list<MemberEvent::Kind> kinds) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < deadline) {
      while (auto e = pub_->poll_event())
        if (e->worker_id == id && std::find(kinds.begin(), kinds.end(), e->kind) != kinds.end()) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
};

// Both engines leave (with on_member_loss: continue): the update that
// follows reached nobody and was reported as success ("ok ... dense (no
// engine in the group) ... to 1 members"), update after update.
TEST_F(ShardedNoEngineTest, AnUpdateThatReachesNoEngineFailsAsASingleSendersWithNoSubscriber) {
  auto [r0, r1] = publish_both(1);
  ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  for (const char* id : {"worker-1", "worker-2"}) {
    ASSERT_TRUE(workers_[id]->wait_for_output(std::string(id) + ": v1 verified", 30s)) << outputs();
    workers_[id]->kill(SIGKILL);
  }
  for (const char* id : {"worker-1", "worker-2"})
    ASSERT_TRUE(wait_any(id, {MemberEvent::Kind::kLost, MemberEvent::Kind::kLeft})) << id;
  for (uint64_t v = 2; v <= 3; ++v) {
    auto [n0, n1] = publish_both(v);
    for (const UpdateResult* r : {&n0, &n1}) {
      ASSERT_FALSE(r->ok()) << "v" << v << " reached no engine, yet succeeded";
      EXPECT_NE(r->status.message().find("no engine in the group"), std::string::npos) << r->status.to_string();
    }
    // Rank 0's call fails UNAVAILABLE (a single sender's with no live
    // subscriber: "no live subscriber to form a group with"); rank 1's ends
    // as on any refusal of rank 0's, ABORTED with rank 0's reason.
    EXPECT_EQ(n0.status.code(), Code::kUnavailable) << n0.status.to_string();
    EXPECT_NE(n0.status.message().find("absent: worker-1, worker-2"), std::string::npos) << n0.status.to_string();
    EXPECT_TRUE(n0.subscribers.empty());
  }
  // An engine that joins gets the next update, from both ranks.
  spawn_worker("worker-1");
  ASSERT_TRUE(wait_any("worker-1", {MemberEvent::Kind::kJoined, MemberEvent::Kind::kRejoined})) << outputs();
  auto [a0, a1] = publish_both(4);
  ASSERT_TRUE(a0.ok()) << a0.status.to_string() << outputs();
  ASSERT_TRUE(a1.ok()) << a1.status.to_string();
  EXPECT_TRUE(workers_["worker-1"]->wait_for_output("worker-1: v4 verified", 30s)) << outputs();
}

}  // namespace
}  // namespace paramcast
