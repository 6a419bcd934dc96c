// Fail fast, name the right member, with the right code: lost control
// messages and failed group formations end an update within a few heartbeat
// intervals instead of update_timeout (60 s here) or init_timeout (30 s).
// Real worker processes on real sockets; a message is "lost" by the worker's
// PARAMCAST_FAULT_LOSE hook (inference_side/control_faults.h), as a
// connection that broke with it queued would lose it.
#include <gtest/gtest.h>
#include <signal.h>

#include <future>
#include <thread>

#include "tests/support/worker_cluster.h"
#include "trainer_side/apply_deadline.h"

namespace paramcast {
namespace {

using Ms = std::chrono::milliseconds;
using test::Process;
using test::WorkerClusterTest;

// Far below update_timeout (60 s) and init_timeout (30 s) of the test config,
// far above the few heartbeat intervals (100 ms) the detection needs.
constexpr auto kFast = std::chrono::seconds(10);

class FailFastTest : public WorkerClusterTest {
 protected:
  // Three workers; `faulty` gets `env`.
  void start_three(const std::string& faulty, const std::string& env, const std::string& policy = "fail",
                   const std::string& publisher_extra = "") {
    make_publisher(test::test_config_yaml(3, "  on_member_loss: " + policy + "\n" + publisher_extra));
    for (int i = 1; i <= 3; ++i) {
      const std::string id = "worker-" + std::to_string(i);
      spawn_worker(id, id == faulty ? std::vector<std::string>{env} : std::vector<std::string>{});
    }
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  // worker-2 with a data path that cannot work (a network interface that
  // does not exist) and a control path that is fine.
  void spawn_broken() {
    const std::string bad_yaml =
        test::write_file(dir_, "bad.yaml", test::test_config_yaml(3, "", "  gloo_interface: pcnosuch0\n"));
    workers_["worker-2"] = Process::start(test::binary("paramcast-worker"),
                                          {"--config", bad_yaml, "--id", "worker-2", "--endpoint", pub_->endpoint(),
                                           "--updates", "0"});
  }

  static std::chrono::duration<double> secs(const UpdateResult& r) { return std::chrono::duration<double>(r.seconds); }
};

// The first update of a group goes through the accept round (Plan, then
// Commit); later ones with the same manifest are precommitted (the Plan is
// the Commit).
TEST_F(FailFastTest, LostPlanFailsWithTimeoutNamingTheMemberBeforeAnyByteMoves) {
  start_three("worker-2", "PARAMCAST_FAULT_LOSE=plan:1");
  UpdateResult r = publish(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-2' did not receive the plan of v1"), std::string::npos)
      << r.status.message();
  EXPECT_NE(r.status.message().find("abandoned before any byte moved"), std::string::npos) << r.status.message();
  EXPECT_LT(secs(r), kFast) << r.seconds << " s";
  UpdateResult next = publish(2);
  EXPECT_TRUE(next.ok()) << next.status.to_string() << outputs();
  EXPECT_EQ(next.subscribers.size(), 3u);
}

TEST_F(FailFastTest, LostPrecommittedPlanAbortsTheBroadcastAndNamesTheMember) {
  start_three("worker-2", "PARAMCAST_FAULT_LOSE=plan:2");
  ASSERT_TRUE(publish(1).ok());
  UpdateResult r = publish(2);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.precommitted);
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-2' did not receive the commit of v2"), std::string::npos)
      << r.status.message();
  // Not data_plane.timeout (20 s): the broadcast is aborted when a heartbeat shows the loss.
  EXPECT_LT(secs(r), kFast) << r.seconds << " s";
  UpdateResult next = publish(3);
  EXPECT_TRUE(next.ok()) << next.status.to_string() << outputs();
}

TEST_F(FailFastTest, LostCommitAbortsTheBroadcastAndNamesTheMember) {
  start_three("worker-2", "PARAMCAST_FAULT_LOSE=commit:1");
  UpdateResult r = publish(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-2' did not receive the commit of v1"), std::string::npos)
      << r.status.message();
  EXPECT_LT(secs(r), kFast) << r.seconds << " s";
  UpdateResult next = publish(2);
  EXPECT_TRUE(next.ok()) << next.status.to_string() << outputs();
}

// The publisher abandons an update after its Commit and before a member's
// transfer began there (worker-1's data thread is held 8 s after the Commit
// of v2 by a test hook; worker-2 dies meanwhile, which ends v2): worker-1
// writes nothing of v2 and keeps v1, consistent, saying why. (Before, it
// started the transfer of an update already given up, failed it, and was
// left dirty at v2.) The next update lands on the survivors.
TEST_F(FailFastTest, AnUpdateAbandonedBeforeAMembersTransferBeganLeavesItsWeightsAsTheyWere) {
  start_three("worker-1", "PARAMCAST_FAULT_PAUSE_BEFORE_RECEIVE=2:8000", "continue");
  ASSERT_TRUE(publish(1).ok()) << outputs();
  auto second = std::async(std::launch::async, [&] { return publish(2); });
  ASSERT_TRUE(workers_["worker-1"]->wait_for_output("pausing 8000 ms before receiving v2", std::chrono::seconds(30)))
      << outputs();
  workers_["worker-2"]->kill(SIGKILL);
  UpdateResult r = second.get();
  ASSERT_FALSE(r.ok()) << "v2 cannot land on worker-1 while it is held";
  ASSERT_TRUE(workers_["worker-1"]->wait_for_output("before its transfer began here; nothing was written; state "
                                                    "version 1, consistent",
                                                    std::chrono::seconds(30)))
      << outputs();
  EXPECT_EQ(workers_["worker-1"]->output().find("v2 verified"), std::string::npos) << outputs();
  UpdateResult next = publish(3);
  EXPECT_TRUE(next.ok()) << next.status.to_string() << outputs();
}

TEST_F(FailFastTest, LostPlanAnswerIsNamed) {
  start_three("worker-3", "PARAMCAST_FAULT_LOSE=answer:1");
  UpdateResult r = publish(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-3' answered the plan of v1 but the answer never arrived"),
            std::string::npos)
      << r.status.message();
  EXPECT_LT(secs(r), kFast) << r.seconds << " s";
  EXPECT_TRUE(publish(2).ok());
}

// A member that is alive and heartbeats but never answers the Plan (stuck,
// or hostile) ends the update at plan_timeout, named, before any byte moves.
TEST_F(FailFastTest, MemberSilentOnThePlanIsNamedAtPlanTimeout) {
  start_three("worker-2", "PARAMCAST_FAULT_LOSE=mute-answer:1", "fail", "  plan_timeout: 2s\n");
  UpdateResult r = publish(1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-2' did not answer the plan within plan_timeout (2.000 s)"),
            std::string::npos)
      << r.status.message();
  EXPECT_NE(r.status.message().find("abandoned before any byte moved"), std::string::npos) << r.status.message();
  EXPECT_GE(r.seconds, 2.0);
  EXPECT_LT(r.seconds, 2.0 + 4.0) << "plan_timeout and a loaded machine's margin";
  UpdateResult next = publish(2);
  EXPECT_TRUE(next.ok()) << next.status.to_string() << outputs();
}

// One that never reports Applied ends the update apply_timeout after the
// data plane finished, named; the others applied it.
TEST_F(FailFastTest, MemberSilentOnAppliedIsNamedAtApplyTimeout) {
  start_three("worker-3", "PARAMCAST_FAULT_LOSE=mute-applied:2", "fail", "  apply_timeout: 3s\n");
  ASSERT_TRUE(publish(1).ok());
  UpdateResult r = publish(2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("subscriber 'worker-3' did not report applied v2 within apply_timeout (3.000 s) after "
                                    "the data plane finished"),
            std::string::npos)
      << r.status.message();
  EXPECT_LT(r.seconds, 3.0 + 5.0) << "apply_timeout and a loaded machine's margin";
  int applied = 0;
  for (const auto& o : r.subscribers) applied += o.status.ok();
  EXPECT_EQ(applied, 2) << r.status.to_string();
  EXPECT_TRUE(publish(3).ok()) << outputs();
}

// apply_timeout's default, auto: once the others applied in milliseconds, a
// member that never reports Applied is named at the floor (15 s), not a
// minute later, and the message says how the bound was derived.
TEST_F(FailFastTest, MemberSilentOnAppliedIsNamedAtTheAutoBoundDerivedFromItsPeers) {
  start_three("worker-3", "PARAMCAST_FAULT_LOSE=mute-applied:2", "fail");
  ASSERT_TRUE(publish(1).ok());
  UpdateResult r = publish(2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  // 15 s, the floor, unless the peers' Applied took over 1.9 s (8 x) on a loaded machine.
  EXPECT_NE(r.status.message().find("subscriber 'worker-3' did not report applied v2 within apply_timeout (auto: "),
            std::string::npos)
      << r.status.message();
  const double floor = std::chrono::duration<double>(ApplyRule::kFloor).count();
  EXPECT_GE(r.seconds, floor);
  EXPECT_LT(r.seconds, floor + 8.0) << "the floor and a loaded machine's margin, well under the 60 s ceiling";
  EXPECT_TRUE(publish(3).ok()) << outputs();
}

// With on_member_loss: continue, the same silence holds nobody else's
// update hostage: the update stands for the two that applied it, and the
// silent member is named dirty (unconfirmed); the next update reaches all.
TEST_F(FailFastTest, MemberSilentOnAppliedUnderContinueIsNamedDirtyAndTheUpdateStands) {
  start_three("worker-3", "PARAMCAST_FAULT_LOSE=mute-applied:2", "continue", "  apply_timeout: 3s\n");
  ASSERT_TRUE(publish(1).ok());
  UpdateResult r = publish(2);
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_EQ(r.unconfirmed, std::vector<std::string>{"worker-3"});
  int applied = 0;
  for (const auto& o : r.subscribers) {
    applied += o.status.ok();
    if (o.worker_id == "worker-3") {
      EXPECT_TRUE(o.unconfirmed);
      EXPECT_NE(o.status.message().find("did not report applied v2 within apply_timeout (3.000 s)"), std::string::npos)
          << o.status.to_string();
    }
  }
  EXPECT_EQ(applied, 2);
  EXPECT_LT(r.seconds, 3.0 + 5.0) << "apply_timeout and a loaded machine's margin";
  UpdateResult next = publish(3);
  ASSERT_TRUE(next.ok()) << next.status.to_string() << outputs();
  EXPECT_TRUE(next.unconfirmed.empty());
  EXPECT_EQ(next.subscribers.size(), 3u);
}

TEST_F(FailFastTest, LostAppliedIsRecoveredFromHeartbeats) {
  start_three("worker-1", "PARAMCAST_FAULT_LOSE=applied:2");
  ASSERT_TRUE(publish(1).ok());
  UpdateResult r = publish(2);
  // worker-1 applied v2 and says so in its heartbeats: the update succeeded.
  EXPECT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_LT(secs(r), kFast) << r.seconds << " s";
  EXPECT_TRUE(workers_["worker-1"]->wait_for_output("v2 verified", std::chrono::seconds(10))) << outputs();
}

TEST_F(FailFastTest, VersionsNeverGoBackwardsBelowWhatSubscribersHold) {
  start_three("", "");
  ASSERT_TRUE(publish(1).ok());
  ASSERT_TRUE(publish(5).ok());
  const std::string endpoint = pub_->endpoint();
  pub_->shutdown();
  pub_.reset();
  // A new publisher on the same endpoint (a restarted trainer): the workers
  // rejoin holding v5; it continues above, and refuses to go back.
  auto cfg = config_;
  cfg.control.endpoint = endpoint;
  auto second = Publisher::create(cfg);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  pub_ = std::move(second.value());
  Status started = pub_->start();
  ASSERT_TRUE(started.ok()) << started.to_string() << outputs();
  EXPECT_EQ(pub_->next_version(), 6u);
  UpdateResult back = publish(3);
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status.code(), Code::kInvalidArgument);
  EXPECT_NE(back.status.message().find("version 3 does not exceed version 5 held by subscriber 'worker-"),
            std::string::npos)
      << back.status.message();
  UpdateResult r = publish(pub_->next_version());
  EXPECT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(r.version, 6u);
}

// A worker whose data plane cannot start (no such network interface) says
// GroupFailed at once: formation ends then, naming it, not at init_timeout.
// Twice in a row and it is quarantined for quarantine_backoff, restarts or not;
// then it is tried again.
TEST_F(FailFastTest, GroupFailedEndsFormationAtOnceAndARepeatOffenderIsQuarantinedAcrossRestarts) {
  // The quarantine outlasts a restart on a loaded machine (a few seconds) by far.
  make_publisher(test::test_config_yaml(3, "  on_member_loss: continue\n  quarantine_backoff: 20s\n"));
  spawn_worker("worker-1");
  spawn_worker("worker-3");
  spawn_broken();
  auto t0 = std::chrono::steady_clock::now();
  Status s = pub_->start();
  auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("worker-2: "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("pcnosuch0"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("worker-1: "), std::string::npos) << "a bystander was blamed: " << s.message();
  // join_timeout waits for all three first; formation itself must be quick.
  EXPECT_LT(took, kFast) << std::chrono::duration_cast<Ms>(took).count() << " ms";

  t0 = std::chrono::steady_clock::now();
  UpdateResult second = publish(1);  // second strike: quarantined
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status.message().find("worker-2: "), std::string::npos) << second.status.message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kFast);
  const auto quarantined_at = std::chrono::steady_clock::now();

  UpdateResult without = publish(2);  // formed without worker-2
  ASSERT_TRUE(without.ok()) << without.status.to_string() << outputs();
  EXPECT_EQ(without.subscribers.size(), 2u);
  EXPECT_EQ(without.missing, std::vector<std::string>{"worker-2"});

  // It restarts, still broken: rejoining does not reset its strikes.
  workers_["worker-2"]->kill(SIGKILL);
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", std::chrono::seconds(10)));
  spawn_broken();
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-2", std::chrono::seconds(20))) << outputs();
  ASSERT_LT(std::chrono::steady_clock::now() - quarantined_at, std::chrono::seconds(18)) << "too slow to tell";
  UpdateResult restarted = publish(3);
  ASSERT_TRUE(restarted.ok()) << restarted.status.to_string() << outputs();
  EXPECT_EQ(restarted.missing, std::vector<std::string>{"worker-2"});

  // Fixed, it is tried again once its quarantine ends, and admitted; the
  // updates meanwhile reach the two others.
  workers_["worker-2"]->kill(SIGKILL);
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", std::chrono::seconds(10)));
  spawn_worker("worker-2");
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-2", std::chrono::seconds(20))) << outputs();
  uint64_t version = 4;
  const auto until = quarantined_at + std::chrono::seconds(20 + 30);
  size_t reached = 0;
  while (std::chrono::steady_clock::now() < until) {
    UpdateResult r = publish(version++);
    ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
    reached = r.subscribers.size();
    if (reached == 3) break;
    EXPECT_GE(std::chrono::steady_clock::now() - quarantined_at, std::chrono::seconds(0));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(reached, 3u) << "worker-2 was not admitted after its quarantine";
  EXPECT_GE(std::chrono::steady_clock::now() - quarantined_at, std::chrono::seconds(20))
      << "admitted before its quarantine ended";
}

TEST_F(FailFastTest, AMemberThatBreaksTheStartUpFormationIsLeftOutAndTheOthersStart) {
  make_publisher(test::test_config_yaml(
      3, "  on_member_loss: continue\n  on_missing_at_start: start_with_present\n  quarantine_backoff: 60s\n"));
  spawn_worker("worker-1");
  spawn_worker("worker-3");
  spawn_broken();
  Status s = pub_->start();
  ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_EQ(r.subscribers.size(), 2u);
  EXPECT_EQ(r.missing, std::vector<std::string>{"worker-2"});
}

TEST_F(FailFastTest, StartUpFormationBrokenByItsOnlyMemberStillFailsNamingIt) {
  make_publisher(test::test_config_yaml(1, "  on_missing_at_start: start_with_present\n"));
  const std::string bad_yaml =
      test::write_file(dir_, "bad1.yaml", test::test_config_yaml(1, "", "  gloo_interface: pcnosuch0\n"));
  workers_["worker-1"] = Process::start(test::binary("paramcast-worker"),
                                        {"--config", bad_yaml, "--id", "worker-1", "--endpoint", pub_->endpoint(),
                                         "--updates", "0"});
  Status s = pub_->start();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("worker-1: "), std::string::npos) << s.message();
}

// worker-2 publishes an address where nothing listens: every peer fails with
// it. The formation names worker-2 on that evidence, never the members that
// tried to reach it; worker-2 is quarantined at once and the others form
// again within the same call, so no update fails for them.
TEST_F(FailFastTest, AMemberWithABadAddressIsNamedByItsPeersAndTheOthersKeepGettingUpdates) {
  make_publisher(test::test_config_yaml(3, "  on_member_loss: continue\n  quarantine_backoff: 60s\n"));
  spawn_worker("worker-1");
  spawn_worker("worker-2", {"PARAMCAST_FAULT_BAD_ADDRESS=1"});
  spawn_worker("worker-3");
  ::testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = pub_->start();
  const auto took = std::chrono::steady_clock::now() - t0;
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.to_string() << "\n" << log << outputs();
  std::printf("[figures] start() took %.2f s; its log:\n%s", std::chrono::duration<double>(took).count(), log.c_str());
  EXPECT_LT(took, kFast) << std::chrono::duration_cast<Ms>(took).count() << " ms\n" << log;
  EXPECT_NE(log.find("worker-2: unreachable from "), std::string::npos) << log;
  EXPECT_NE(log.find("forming the group again without worker-2"), std::string::npos) << log;
  for (const char* honest : {"worker-1", "worker-3"}) {
    EXPECT_EQ(log.find(std::string(honest) + ": unreachable"), std::string::npos) << honest << " blamed:\n" << log;
    EXPECT_EQ(log.find("subscriber '" + std::string(honest) + "' quarantined"), std::string::npos) << log;
  }
  // Its data path itself works, so its link check passes and, out for a
  // data-path failure, it is tried once more before its backoff ends
  // (common/group/link_check.h). It breaks that formation too: the others
  // form again in the same call, and it now serves its whole doubled
  // backoff, never tried early again.
  ::testing::internal::CaptureStderr();
  for (uint64_t v = 1; v <= 30; ++v) {
    UpdateResult r = publish(v);
    ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
    EXPECT_EQ(r.subscribers.size(), 2u);
    EXPECT_EQ(r.missing, std::vector<std::string>{"worker-2"});
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  const std::string later = ::testing::internal::GetCapturedStderr();
  size_t tried = 0;
  const std::string again = "forming the group again without worker-2";
  for (size_t at = later.find(again); at != std::string::npos; at = later.find(again, at + 1)) ++tried;
  EXPECT_EQ(tried, 1u) << later;
  EXPECT_NE((log + later).find("link check of 'worker-2' passed"), std::string::npos) << log << later;
  EXPECT_NE(later.find("subscriber 'worker-2' quarantined for 120.000 s"), std::string::npos) << later;
}

// worker-2 says GroupReady without ever publishing an address (a member
// that lies about being ready): named for it at once, quarantined, and the
// others form again within the same call and keep getting updates.
TEST_F(FailFastTest, AMemberThatLiesAboutBeingReadyIsNamedAndTheOthersKeepGettingUpdates) {
  make_publisher(test::test_config_yaml(3, "  on_member_loss: continue\n  quarantine_backoff: 60s\n"));
  spawn_worker("worker-1");
  spawn_worker("worker-2", {"PARAMCAST_FAULT_FALSE_READY=1"});
  spawn_worker("worker-3");
  ::testing::internal::CaptureStderr();
  Status s = pub_->start();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.to_string() << "\n" << log << outputs();
  EXPECT_NE(log.find("worker-2: said GroupReady without having published its rendezvous address"), std::string::npos)
      << log;
  for (const char* honest : {"worker-1", "worker-3"})
    EXPECT_EQ(log.find("subscriber '" + std::string(honest) + "' quarantined"), std::string::npos) << log;
  for (uint64_t v = 1; v <= 2; ++v) {
    UpdateResult r = publish(v);
    ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
    EXPECT_EQ(r.subscribers.size(), 2u);
    EXPECT_EQ(r.missing, std::vector<std::string>{"worker-2"});
  }
}

}  // namespace
}  // namespace paramcast
