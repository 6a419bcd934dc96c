// Fault tolerance, tier 3: real processes, real sockets, faults injected by
// killing or stalling a process (SIGKILL, SIGSTOP, a wedged pipeline stage).
// Every wait has its own bound, so a hang fails the test instead of CI.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>

#include "tests/support/deployments.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using Ms = std::chrono::milliseconds;
using test::Process;
using test::WorkerClusterTest;

class FaultToleranceTest : public WorkerClusterTest {
 protected:
  // Four workers (world 5): in Gloo's binomial tree rank 1 forwards to rank 3,
  // so losing worker-1 mid-update leaves worker-3 short of bytes.
  void start_four(const std::string& policy) {
    make_publisher(test::test_config_yaml(4, "  on_member_loss: " + policy + "\n"));
    spawn_worker("worker-1", {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=1"});
    for (int i = 2; i <= 4; ++i) spawn_worker("worker-" + std::to_string(i));
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  // Starts v1, kills worker-1 while it is wedged mid-update, returns the result
  // and checks how fast the loss was named.
  UpdateResult kill_worker_mid_update() {
    model_ = test::make_tensors(synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers,
                                                     config_.trainer.dtype));
    model_.fill(1, config_.trainer.seed);
    auto fut = pub_->weight_update_async(model_.views(), 1);
    EXPECT_TRUE(workers_["worker-1"]->wait_for_output("stalling after bucket 1", std::chrono::seconds(20)))
        << workers_["worker-1"]->output();
    workers_["worker-1"]->kill(SIGKILL);
    const auto killed = std::chrono::steady_clock::now();
    const auto bound = config_.control.heartbeat_timeout + std::chrono::seconds(2);
    EXPECT_EQ(fut.wait_for(bound + std::chrono::seconds(5)), std::future_status::ready) << "weight_update hung";
    UpdateResult r = fut.get();
    const auto took = std::chrono::steady_clock::now() - killed;
    EXPECT_LE(took, bound) << std::chrono::duration_cast<Ms>(took).count() << " ms to name the lost worker";
    return r;
  }
};

TEST_F(FaultToleranceTest, SubscriberKilledMidUpdateIsNamedAndFailPolicyWaitsForIt) {
  start_four("fail");
  UpdateResult r = kill_worker_mid_update();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kPeerLost) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-1' was lost during update v1"), std::string::npos)
      << r.status.message();
  // worker-3 depended on worker-1 for its bytes: it says which version is incomplete.
  EXPECT_TRUE(workers_["worker-3"]->wait_for_output("state dirty (v1 incomplete, last consistent v0)",
                                                     std::chrono::seconds(10)))
      << workers_["worker-3"]->output();
  for (const char* id : {"worker-2", "worker-3", "worker-4"}) EXPECT_TRUE(workers_[id]->running()) << id;

  // on_member_loss: fail — the next update re-forms, waits one heartbeat
  // timeout for worker-1, and fails naming it.
  UpdateResult r2 = publish(2);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status.message().find("subscribers missing (on_member_loss: fail): worker-1"), std::string::npos)
      << r2.status.message();

  // worker-1 restarts on its own (same id); the next update reaches everyone.
  spawn_worker("worker-1");
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-1", std::chrono::seconds(10)));
  UpdateResult r3 = publish(3);
  ASSERT_TRUE(r3.ok()) << r3.status.to_string();
  EXPECT_GT(r3.epoch, 1u);
  for (auto& [id, p] : workers_)
    EXPECT_TRUE(p->wait_for_output("v3 verified", std::chrono::seconds(10))) << id << ":\n" << p->output();
}

TEST_F(FaultToleranceTest, ContinuePolicyProceedsWithSurvivorsAndReportsTheMissing) {
  start_four("continue");
  UpdateResult r = kill_worker_mid_update();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status.message().find("'worker-1'"), std::string::npos) << r.status.message();
  ::testing::internal::CaptureStderr();
  UpdateResult r2 = publish(2);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r2.ok()) << r2.status.to_string();
  EXPECT_EQ(r2.missing, (std::vector<std::string>{"worker-1"}));
  // The warning says what happened, in so many words.
  EXPECT_NE(log.find("update v2 applied to 3 of 4 subscribers; missing: worker-1"), std::string::npos) << log;
  EXPECT_EQ(r2.subscribers.size(), 3u);
  for (const char* id : {"worker-2", "worker-3", "worker-4"})
    EXPECT_TRUE(workers_[id]->wait_for_output("v2 verified", std::chrono::seconds(10))) << workers_[id]->output();
}

TEST_F(FaultToleranceTest, PublisherKilledMidUpdateSubscribersStayAndRejoinANewOne) {
  const std::string yaml_path = test::write_file(dir_, "deploy.yaml", test::test_config_yaml(3));
  yaml_path_ = yaml_path;
  config_ = load_config_file(yaml_path).value();
  auto killed = test::kill_publisher_mid_update(dir_, yaml_path, config_);
  ASSERT_FALSE(HasFailure());
  const std::string& endpoint = killed.endpoint;
  auto& workers = killed.workers;
  // A new publisher on the same endpoint: its first update makes everyone
  // consistent, and it goes on above the version the workers report (dirty
  // v2): versions never go backwards.
  auto second = Process::start(test::binary("paramcast-trainer"),
                               {"--config", yaml_path, "--endpoint", endpoint, "--updates", "1"});
  ASSERT_EQ(second->wait_for(std::chrono::seconds(60)), 0) << second->output();
  for (auto& w : workers) {
    const auto out = w->output();
    const auto lost_at = out.find("publisher lost");
    EXPECT_NE(out.find("v3 verified", lost_at), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace paramcast

namespace paramcast {
namespace {

// A member that leaves the group and rejoins on a new connection after an
// update checked its group but before its plan went out (the window a
// trainer stopped and resumed opens: SIGSTOP, a GC pause, a debugger): the
// update must not start on that group, whose member would never take its
// broadcasts (the publisher would wait out stall_timeout, 20 s here). It
// fails at once naming the member, and the next update forms a new group.
// The window is held open by PARAMCAST_FAULT_PAUSE_BEFORE_PLAN.
TEST_F(WorkerClusterTest, AMemberThatRejoinsBeforeThePlanFailsTheUpdateAtOnceAndTheNextFormsAgain) {
  // v2 pauses long enough for worker-2 to be lost and back: heartbeat_timeout + 2.5 s.
  std::string pause = "2:";
  pause += std::to_string((test::test_heartbeat_timeout() + std::chrono::milliseconds(2500)).count());
  setenv("PARAMCAST_FAULT_PAUSE_BEFORE_PLAN", pause.c_str(), 1);
  make_publisher(test::test_config_yaml(2));
  unsetenv("PARAMCAST_FAULT_PAUSE_BEFORE_PLAN");
  spawn_worker("worker-1");
  Process& w2 = spawn_worker("worker-2");
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  ASSERT_TRUE(publish(1).ok()) << outputs();
  model_.fill(2, config_.trainer.seed);
  auto fut = pub_->weight_update_async(model_.views(), 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // v2 is in its pause
  // Silent past heartbeat_timeout (1.5 s): lost, then back on a new connection.
  w2.kill(SIGSTOP);
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", std::chrono::seconds(10))) << outputs();
  w2.kill(SIGCONT);
  // Back on a new connection (its second join) while v2 still pauses: the
  // plan of epoch 1 would not reach it, and its idle communicator would
  // take nothing.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto joins = [&] {
    const std::string out = w2.output();
    size_t n = 0;
    for (size_t at = out.find("joined publisher"); at != std::string::npos; at = out.find("joined publisher", at + 1)) ++n;
    return n;
  };
  while (joins() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GE(joins(), 2u) << outputs();
  UpdateResult r = fut.get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kAborted) << r.status.to_string();
  EXPECT_NE(r.status.message().find("abandoned before any byte moved: subscriber 'worker-2'"), std::string::npos)
      << r.status.message();
  // The pause (4 s) and the loss, not stall_timeout (20 s).
  EXPECT_LT(r.seconds, 10.0) << r.status.to_string();
  UpdateResult next = publish(3);
  ASSERT_TRUE(next.ok()) << next.status.to_string() << outputs();
  EXPECT_EQ(next.subscribers.size(), 2u);
  EXPECT_LT(next.seconds, 10.0);
  for (auto& [id, p] : workers_)
    EXPECT_TRUE(p->wait_for_output(id + ": v3 verified", std::chrono::seconds(30))) << outputs();
}

}  // namespace
}  // namespace paramcast
