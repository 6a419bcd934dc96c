// Many-sender updates through the publisher (Publisher::weight_update_sharded
// on rank 0, PublisherRank on rank 1): real ZeroMQ, real Gloo point-to-point
// moves, engines as paramcast-worker processes that verify every byte of the
// synthetic model, registered in place and through the tensor callback.
// Each trainer rank holds only its rows of each tensor; no rank holds a
// whole tensor, and the plan is refused before any byte moves when the
// ranks' holdings overlap or leave a gap, naming tensor, range and ranks.
#include <gtest/gtest.h>

#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <future>
#include <map>

#include "common/synthetic_model.h"
#include "inference_side/subscriber.h"
#include "tests/e2e/sharded_fixture.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using sharded_test::ShardedUpdateTest;

TEST_F(ShardedUpdateTest, EveryTrainerRankSendsItsRowsAndEveryEngineVerifiesBitExact) {
  for (uint64_t v = 1; v <= 3; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    EXPECT_EQ(r0.version, v);
    EXPECT_EQ(r1.version, v);
    // Both trainer ranks and both engines applied it.
    EXPECT_EQ(r0.subscribers.size(), 3u);
    std::string needle = "v";
    needle += std::to_string(v);
    needle += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(needle, 20s)) << id << p->output();
    // Each rank sent only what it holds: about half of every engine's bytes.
    EXPECT_GT(r0.wire_bytes, 0u);
  }
}

// A plan goes whole to a member once: later updates of the same shape name
// the plan it applied by its digest (Plan.shapeRef) and send only the
// version and the ranks' seqs, and every engine still verifies every byte.
// A member that restarted holds no plan: it gets the next one whole, the
// others by reference. (Before, every update sent every member the whole
// plan: tensors, and each rank's regions.)
TEST_F(ShardedUpdateTest, ALaterPlanOfTheSameShapeGoesByReferenceAndARestartedEngineGetsItWhole) {
  auto [first, first1] = publish_both(1);
  ASSERT_TRUE(first.ok()) << first.status.to_string() << outputs();
  ASSERT_TRUE(first1.ok()) << first1.status.to_string();
  EXPECT_EQ(first.plan_referred, 0u);
  EXPECT_GT(first.plan_whole_bytes, 0u);
  EXPECT_FALSE(first.plan_kept);
  EXPECT_EQ(first.parts_referred, 0u);
  std::printf("[figures] v1: plan %llu bytes whole to 3 members\n",
              static_cast<unsigned long long>(first.plan_whole_bytes));
  for (uint64_t v = 2; v <= 3; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    EXPECT_EQ(r0.plan_referred, 3u) << "trainer-1 and both engines applied a plan of this shape";
    EXPECT_TRUE(r0.plan_kept) << "the same parts, Wants and group: nothing planned";
    EXPECT_EQ(r0.parts_referred, 1u) << "trainer-1 states the part rank 0 planned last by reference";
    EXPECT_EQ(r0.plan_whole_bytes, 0u);
    EXPECT_LT(r0.plan_referred_bytes, 3u * 1024u);
    EXPECT_LT(r0.plan_referred_bytes * 20, first.plan_whole_bytes);
    std::printf("[figures] v%llu: plan %llu bytes by reference to 3 members\n", static_cast<unsigned long long>(v),
                static_cast<unsigned long long>(r0.plan_referred_bytes));
    for (auto& [id, p] : workers_)
      EXPECT_TRUE(p->wait_for_output("v" + std::to_string(v) + " verified", 20s)) << id << p->output();
  }
  workers_["worker-2"]->kill(SIGKILL);
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", 10s)) << outputs();
  spawn_worker("worker-2", {}, {"--mode", "callback"});
  bool back = false;  // joined anew, or as a restart of a known member
  for (const auto until = std::chrono::steady_clock::now() + 20s; !back && std::chrono::steady_clock::now() < until;) {
    while (auto e = pub_->poll_event())
      back = back || (e->worker_id == "worker-2" &&
                      (e->kind == MemberEvent::Kind::kJoined || e->kind == MemberEvent::Kind::kRejoined));
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(back) << outputs();
  auto [r0, r1] = publish_both(4);
  ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  EXPECT_EQ(r0.plan_referred, 2u) << "trainer-1 and worker-1 by reference, the restarted worker-2 whole";
  EXPECT_GT(r0.plan_whole_bytes, 0u);
  EXPECT_LT(r0.plan_whole_bytes, first.plan_whole_bytes);  // one member's whole plan, not three
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v4 verified", 20s)) << id << p->output();
}

// A kept plan is never reused across a change of the parts it was made
// from: when the ranks split the rows elsewhere, rank 0 plans afresh from
// trainer-1's part stated whole again, and every engine verifies every
// byte; the next update of that split is kept again. (Before the plan was
// kept, every update planned; a kept plan reused across the change would
// have had each rank send rows it no longer holds.)
TEST_F(ShardedUpdateTest, AKeptPlanServesOnlyTheSamePartsAndANewSplitIsPlannedAfresh) {
  const int64_t cuts[] = {0, 0, -1, -1, 0};
  const bool kept[] = {false, true, false, true, false};
  for (uint64_t v = 1; v <= 5; ++v) {
    auto [r0, r1] = publish_both(v, 0, cuts[v - 1]);
    ASSERT_TRUE(r0.ok()) << "v" << v << ": " << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << "v" << v << ": " << r1.status.to_string();
    EXPECT_EQ(r0.plan_kept, kept[v - 1]) << "v" << v;
    EXPECT_EQ(r0.parts_referred, kept[v - 1] ? 1u : 0u) << "v" << v << ": trainer-1's part";
    std::string verified = "v";
    verified += std::to_string(v);
    verified += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(verified, 20s)) << id << p->output();
  }
}

// A pipeline-style split: rank 0 holds the first half of the tensors whole,
// rank 1 the rest; each names only what it holds.
TEST_F(ShardedUpdateTest, PipelineStagesEachSendTheTensorsTheyHold) {
  for (uint64_t v = 1; v <= 2; ++v) {
    model_.fill(v, config_.trainer.seed, config_.trainer.changes);
    std::vector<ShardView> stage[2];
    for (size_t i = 0; i < model_.specs.size(); ++i) {
      ShardView s;
      s.local = TensorView{model_.specs[i], model_.bytes[i].data(), Device{}};
      stage[i < model_.specs.size() / 2 ? 0 : 1].push_back(std::move(s));
    }
    auto other = std::async(std::launch::async, [&] { return rank1_->weight_update(stage[1], v); });
    UpdateOptions o;
    o.version = v;
    UpdateResult r0 = pub_->weight_update_sharded(stage[0], o);
    UpdateResult r1 = other.get();
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    std::string needle = "v";
    needle += std::to_string(v);
    needle += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(needle, 20s)) << id << p->output();
  }
}

TEST_F(ShardedUpdateTest, OverlappingRowsAreRefusedBeforeAnyByteMovesNamingBothRanks) {
  auto [r0, r1] = publish_both(1, -1);  // rank 1 also claims rank 0's last row
  ASSERT_FALSE(r0.ok());
  EXPECT_EQ(r0.status.code(), Code::kInvalidArgument) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("publisher"), std::string::npos) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("trainer-1"), std::string::npos) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("refused before any byte moved"), std::string::npos) << r0.status.to_string();
  // Rank 1's call ends at once with the reason, not at its timeout.
  EXPECT_FALSE(r1.ok());
  EXPECT_NE(r1.status.message().find("trainer-1"), std::string::npos) << r1.status.to_string();
  EXPECT_LT(r1.seconds, 10.0);
  // No engine wrote anything; the next update with sound holdings lands.
  for (auto& [id, p] : workers_) EXPECT_EQ(p->output().find("verified"), std::string::npos) << p->output();
  auto [ok0, ok1] = publish_both(2);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
}

// Both trainer ranks hold every tensor whole (data-parallel replicas: the
// plan spreads the pieces over them), with checksums on (every rank gives
// the xxh64 of what it holds). Rank 1's copy of one tensor is stale (a
// byte differs): the update is refused before any byte moves, naming the
// tensor, both ranks and the two digests, instead of engines getting a mix
// of the two. With the same bytes the next update lands.
TEST_F(ShardedUpdateTest, ReplicasThatHoldDifferentBytesAreRefusedBeforeAnyByteMoves) {
  auto whole = [&](int r, bool stale) {
    auto& keep = r == 0 ? rows0_ : rows1_;
    keep.assign(model_.bytes.begin(), model_.bytes.end());
    if (stale) keep[0][keep[0].size() / 2] ^= 0x01;
    std::vector<ShardView> out;
    for (size_t i = 0; i < model_.specs.size(); ++i) {
      ShardView s;
      s.local.spec = model_.specs[i];
      s.local.data = keep[i].data();
      out.push_back(std::move(s));
    }
    return out;
  };
  auto publish = [&](uint64_t version, bool stale) {
    model_.fill(version, config_.trainer.seed, config_.trainer.changes);
    auto s0 = whole(0, false);
    auto s1 = whole(1, stale);
    auto other = std::async(std::launch::async, [&] { return rank1_->weight_update(s1, version); });
    UpdateOptions o;
    o.version = version;
    UpdateResult r0 = pub_->weight_update_sharded(s0, o);
    return std::make_pair(r0, other.get());
  };
  auto [r0, r1] = publish(1, true);
  ASSERT_FALSE(r0.ok());
  EXPECT_EQ(r0.status.code(), Code::kInvalidArgument) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("tensor '" + model_.specs[0].name + "': publisher and trainer-1 hold "),
            std::string::npos)
      << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("with different bytes (xxh64 "), std::string::npos) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("refused before any byte moved"), std::string::npos) << r0.status.to_string();
  EXPECT_FALSE(r1.ok());
  for (auto& [id, p] : workers_) EXPECT_EQ(p->output().find("verified"), std::string::npos) << p->output();
  auto [ok0, ok1] = publish(2, false);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
  // By reference, trainer-1 digests the boxes rank 0 holds too (all of
  // them): a stale one is still caught.
  auto [stale0, stale1] = publish(3, true);
  ASSERT_FALSE(stale0.ok());
  EXPECT_EQ(stale0.parts_referred, 1u);
  EXPECT_NE(stale0.status.message().find("with different bytes (xxh64 "), std::string::npos) << stale0.status.to_string();
  EXPECT_FALSE(stale1.ok());
}

// A trainer rank that shares no box with another (rows split between the
// ranks) states its part by reference with no digest at all: a few dozen
// bytes whatever the model (before, 8 a box, 400 KB at 50,000 tensors).
// When rank 0's part changes to hold trainer-1's rows too (the same boxes,
// a copy of its own), trainer-1's unchanged boxes become replicas without a
// digest: the update is refused before any byte moves, naming trainer-1 and
// the box, and trainer-1's next call states its part whole, with every
// digest, and lands.
TEST_F(ShardedUpdateTest, APartByReferenceDigestsOnlyTheBoxesAnotherRankHoldsToo) {
  for (uint64_t v = 1; v <= 2; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    std::printf("[figures] v%llu: trainer-1's part %llu bytes (%zu tensors)\n", static_cast<unsigned long long>(v),
                static_cast<unsigned long long>(r0.holdings_bytes), model_.specs.size());
    if (v == 2) {
      EXPECT_EQ(r0.parts_referred, 1u);
      EXPECT_LT(r0.holdings_bytes, 96u) << "no digest: no box of trainer-1 is a replica";
    }
  }
  ASSERT_GT(model_.specs.size() * 8, 96u) << "the model is too small to tell digests from none";
  std::vector<std::vector<uint8_t>> copy;  // rank 0's copy of trainer-1's rows
  auto publish_rank0_whole = [&](uint64_t version) {
    model_.fill(version, config_.trainer.seed, config_.trainer.changes);
    auto s0 = shards(0);
    auto theirs = shards(1);
    copy = rows1_;
    for (size_t i = 0; i < theirs.size(); ++i) {
      theirs[i].local.data = copy[i].data();
      s0.push_back(theirs[i]);
    }
    auto s1 = shards(1);
    auto other = std::async(std::launch::async, [&] { return rank1_->weight_update(s1, version); });
    UpdateOptions o;
    o.version = version;
    UpdateResult r0 = pub_->weight_update_sharded(s0, o);
    return std::make_pair(r0, other.get());
  };
  auto [refused0, refused1] = publish_rank0_whole(3);
  ASSERT_FALSE(refused0.ok()) << outputs();
  EXPECT_NE(refused0.status.message().find("': trainer-1 gave no digest of ["), std::string::npos)
      << refused0.status.to_string();
  EXPECT_NE(refused0.status.message().find("which publisher holds too"), std::string::npos)
      << refused0.status.to_string();
  EXPECT_NE(refused0.status.message().find("refused before any byte moved"), std::string::npos)
      << refused0.status.to_string();
  EXPECT_FALSE(refused1.ok());
  auto [ok0, ok1] = publish_rank0_whole(4);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  EXPECT_EQ(ok0.parts_referred, 0u) << "trainer-1's part whole, with its digests";
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v4 verified", 20s)) << id << p->output();
}

// Rank 0 refuses its call at once (its update's transforms differ from
// publisher.transforms, which rank 1 applies), before rank 1 publishes: rank
// 1's part, arriving a second later, ends its call at once with rank 0's
// reason, not at its own timeout. A retry of the same step then lands.
TEST_F(ShardedUpdateTest, ARankWhosePartArrivesAfterRank0RefusedTheStepIsEndedAtOnce) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  ASSERT_NO_FATAL_FAILURE(expect_refused_before_the_late_rank(1));
  auto [ok0, ok1] = publish_both(1);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 20s)) << id << p->output();
}

// The same step refused twice: first after rank 1's part arrived (its rows
// overlap rank 0's), then, retried, at once by rank 0 before rank 1's part
// of the retry arrives. That part ends at once too (each call of a step is
// judged afresh), and the next update lands.
TEST_F(ShardedUpdateTest, AStepRefusedTwiceEndsTheLateRankBothTimes) {
  auto [r0, r1] = publish_both(1, -1);
  ASSERT_FALSE(r0.ok());
  ASSERT_FALSE(r1.ok());
  ASSERT_NO_FATAL_FAILURE(expect_refused_before_the_late_rank(1));
  auto [ok0, ok1] = publish_both(2);  // the overlap's refusal used version 1 up
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
}

// A part that names a step ahead of rank 0's call (a rank that skipped
// ahead, or a claim of step 2^62) fails that call, and only that call: the
// part is dropped and its rank's call ended at once, naming the step, not
// left pending to fail every update until the rank's own bound passes.
TEST_F(ShardedUpdateTest, APartAheadOfRank0sStepFailsOnlyTheCallInFlight) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  auto s1 = shards(1);
  auto ahead = std::async(std::launch::async, [&] { return rank1_->weight_update(s1, uint64_t{1} << 62); });
  std::this_thread::sleep_for(500ms);  // its part is pending before rank 0 publishes
  UpdateOptions o;
  o.version = 1;
  const UpdateResult r0 = pub_->weight_update_sharded(shards(0), o);
  ASSERT_FALSE(r0.ok());
  EXPECT_NE(r0.status.message().find("trainer-1 publishes step 4611686018427387904, ahead of this call's step 1"),
            std::string::npos)
      << r0.status.to_string();
  const UpdateResult r1 = ahead.get();
  ASSERT_FALSE(r1.ok());
  EXPECT_NE(r1.status.message().find("ahead of this call's step 1"), std::string::npos) << r1.status.to_string();
  EXPECT_LT(r1.seconds, 10.0) << "ended with rank 0's call, not at its own bound: " << r1.status.to_string();
  for (uint64_t v : {2, 3}) {
    auto [ok0, ok1] = publish_both(v);
    ASSERT_TRUE(ok0.ok()) << "v" << v << ": " << ok0.status.to_string() << outputs();
    ASSERT_TRUE(ok1.ok()) << "v" << v << ": " << ok1.status.to_string();
  }
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v3 verified", 20s)) << id << p->output();
}

// Rank 0 one call behind (implicit steps: it skipped a call): its call
// fails, rank 1's part of the next step waits for rank 0's next call, and
// that one lands: the ranks realign instead of ending each other's calls.
TEST_F(ShardedUpdateTest, APartOneStepAheadWaitsForRank0sNextCall) {
  model_.fill(2, config_.trainer.seed, config_.trainer.changes);
  auto s1 = shards(1);
  auto ahead = std::async(std::launch::async, [&] { return rank1_->weight_update(s1, uint64_t{2}); });
  std::this_thread::sleep_for(500ms);
  UpdateOptions o;
  o.version = 1;
  const UpdateResult r0 = pub_->weight_update_sharded(shards(0), o);
  ASSERT_FALSE(r0.ok());
  EXPECT_NE(r0.status.message().find("trainer-1 publishes step 2, ahead of this call's step 1"), std::string::npos)
      << r0.status.to_string();
  o.version = 2;
  const UpdateResult next = pub_->weight_update_sharded(shards(0), o);
  ASSERT_TRUE(next.ok()) << next.status.to_string() << outputs();
  const UpdateResult r1 = ahead.get();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
}

TEST_F(ShardedUpdateTest, RowsNobodyHoldsAreRefusedNamingTheTensorAndRange) {
  auto [r0, r1] = publish_both(1, 1);  // rank 1 starts one row late: a gap
  ASSERT_FALSE(r0.ok());
  EXPECT_EQ(r0.status.code(), Code::kInvalidArgument) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find(model_.specs[0].name), std::string::npos) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("no rank holds"), std::string::npos) << r0.status.to_string();
  EXPECT_FALSE(r1.ok());
  for (auto& [id, p] : workers_) EXPECT_EQ(p->output().find("verified"), std::string::npos) << p->output();
}

// A trainer rank whose call gave up waiting (rank 0 came too late) has its
// shards back: rank 0's next update must not use them (they may have
// changed, or be freed), but wait for that rank's next call.
class ShardedLateRankTest : public ShardedUpdateTest {
 protected:
  void SetUp() override { start_cluster("  ranks: 2\n  update_timeout: 4s\n"); }
};

TEST_F(ShardedLateRankTest, AnEndedCallsShardsAreNeverSent) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  auto s1 = shards(1);
  UpdateResult r1 = rank1_->weight_update(s1);  // rank 0 does not come: it gives up
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status.code(), Code::kTimeout) << r1.status.to_string();
  for (auto& row : rows1_) std::fill(row.begin(), row.end(), 0xa5);  // "the next optimizer step"
  UpdateResult r0 = pub_->weight_update_sharded(shards(0));
  // Either the withdrawal reached rank 0 first (it waits for trainer-1's
  // next part: TIMEOUT), or rank 0 planned with the old part and trainer-1
  // refused that plan (REJECTED): no byte moved either way.
  ASSERT_FALSE(r0.ok()) << "rank 0 used the shards of a call that had ended";
  EXPECT_TRUE(r0.status.code() == Code::kTimeout || r0.status.code() == Code::kRejected) << r0.status.to_string();
  EXPECT_NE(r0.status.message().find("trainer-1"), std::string::npos) << r0.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_EQ(p->output().find("verified"), std::string::npos) << p->output();
  // In step again, both ranks' parts of one version land.
  auto [ok0, ok1] = publish_both(2);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
}

// Rank 0 holds its Commit of v1 back (a test hook) until trainer-1's call
// for step 1 has timed out (its own update_timeout is 6 s: it waits 7.5 s)
// and the caller has made its next call, with step 2's bytes. The late
// Commit must not send those under plan v1 (rank 0 checked v1's holdings,
// and the piece hashes would be of what was sent: the engines would commit
// v1 with half of step 2 in it), nor end the step-2 call with v1's outcome.
class ShardedStaleCommitTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    // Wide margins on a loaded machine: the Commit of v1 comes 11 s after
    // its plan was accepted, within trainer-1's second call (7.5 s to 15 s),
    // and the last step's new formation and update have 7.5 s.
    rank1_update_timeout_ = Millis(6000);
    ::setenv("PARAMCAST_FAULT_PAUSE_BEFORE_COMMIT", "1:11000", 1);  // read when the publisher is made
    start_cluster("  ranks: 2\n");
    ::unsetenv("PARAMCAST_FAULT_PAUSE_BEFORE_COMMIT");
  }
};

TEST_F(ShardedStaleCommitTest, ARankSendsOnlyTheShardsOfTheCallItsPlanTook) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  auto s0 = shards(0);
  auto s1 = shards(1);
  auto v1 = std::async(std::launch::async, [&] {
    UpdateOptions o;
    o.version = 1;
    return pub_->weight_update_sharded(s0, o);
  });
  const UpdateResult step1 = rank1_->weight_update(s1, 1);  // no Commit within its 7.5 s
  ASSERT_FALSE(step1.ok());
  EXPECT_EQ(step1.status.code(), Code::kTimeout) << step1.status.to_string();
  // The next optimizer step: new bytes, in a new call, while plan v1 waits
  // (rank 0 makes no update of step 2: this call ends at its own timeout).
  model_.fill(2, config_.trainer.seed, config_.trainer.changes);
  auto s1_next = shards(1);
  auto step2 = std::async(std::launch::async, [&] { return rank1_->weight_update(s1_next, 2); });
  const UpdateResult r1 = v1.get();
  ASSERT_FALSE(r1.ok()) << "v1 went out with trainer-1's bytes of step 2" << outputs();
  EXPECT_NE(r1.status.message().find("trainer-1"), std::string::npos) << r1.status.to_string();
  EXPECT_NE(r1.status.message().find("ended before its commit"), std::string::npos) << r1.status.to_string();
  const UpdateResult mine = step2.get();
  EXPECT_EQ(mine.status.code(), Code::kTimeout) << "the step-2 call took v1's outcome: " << mine.status.to_string();
  EXPECT_EQ(mine.version, 0u);
  for (auto& [id, p] : workers_) {
    EXPECT_EQ(p->output().find("CORRUPT"), std::string::npos) << id << p->output();
    EXPECT_EQ(p->output().find("v1 verified"), std::string::npos) << id << p->output();
  }
  // In step again, both ranks' parts of one version land.
  auto [ok0, ok1] = publish_both(3);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) {
    EXPECT_TRUE(p->wait_for_output("v3 verified", 20s)) << id << p->output();
    EXPECT_EQ(p->output().find("CORRUPT"), std::string::npos) << id << p->output();
  }
}

// An engine refuses the delta plan it was sent (its heartbeat had claimed
// the base: a test hook, PARAMCAST_FAULT_REFUSE_DELTA). Rank 0 abandons
// that plan and sends the same version again, dense, within the same call:
// trainer-1's call goes on and takes part in it, and it lands.
class ShardedRefusedDeltaTest : public ShardedUpdateTest {
 protected:
  void SetUp() override { start("  reuse_validated_plan: false\n"); }
  void start(const std::string& extra) {
    engine_env_ = {{}, {"PARAMCAST_FAULT_REFUSE_DELTA=1"}};
    start_cluster("  ranks: 2\n  delta: auto\n" + extra, {{}, {}});
  }
  void expect_delta_refused_then_dense();
};

TEST_F(ShardedRefusedDeltaTest, ADeltaRefusedByAnEngineGoesAgainDenseWithEveryTrainerRank) {
  expect_delta_refused_then_dense();
}

// The same with the default reuse_validated_plan: v2's plan has v1's
// manifest, yet a sharded delta goes through the answer round, so the
// engine's PlanReject turns it dense for every rank. (Before, it went out
// precommitted: the engine could only abort the moves, and v2 failed for
// every engine, naming it.)
class ShardedRefusedDeltaReusedPlanTest : public ShardedRefusedDeltaTest {
 protected:
  void SetUp() override { start(""); }
};

TEST_F(ShardedRefusedDeltaReusedPlanTest, ADeltaRefusedByAnEngineGoesAgainDenseWithEveryTrainerRank) {
  expect_delta_refused_then_dense();
}

void ShardedRefusedDeltaTest::expect_delta_refused_then_dense() {
  auto [a0, a1] = publish_both(1);
  ASSERT_TRUE(a0.ok()) << a0.status.to_string() << outputs();
  ASSERT_TRUE(a1.ok()) << a1.status.to_string();
  for (auto& [id, p] : workers_) ASSERT_TRUE(p->wait_for_output("v1 verified", 20s)) << id << p->output();
  auto [b0, b1] = publish_both(2);
  ASSERT_TRUE(b0.ok()) << b0.status.to_string() << outputs();
  EXPECT_TRUE(b1.ok()) << "trainer-1's call ended with the delta plan it was abandoned: " << b1.status.to_string();
  EXPECT_EQ(b1.version, 2u);
  EXPECT_FALSE(b0.delta);
  EXPECT_NE(b0.dense_because.find("worker-2 refused the delta"), std::string::npos) << b0.dense_because;
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
}

// An engine lost after a sharded update checked its group and before its
// plan went out (the window PARAMCAST_FAULT_PAUSE_BEFORE_PLAN holds open):
// the update fails at once naming it, and the engine still connected hears
// of the version's end (an Abandon of it), as a vLLM worker inside its round
// must: before, the engines got nothing and such a worker waited out its own
// timeout. The next update forms a new group.
class ShardedPausedPlanTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    ::setenv("PARAMCAST_FAULT_PAUSE_BEFORE_PLAN", "2:4000", 1);  // rank 0's, read when it is created
    start_cluster("  ranks: 2\n", {{}, {}});
    ::unsetenv("PARAMCAST_FAULT_PAUSE_BEFORE_PLAN");
  }
};

TEST_F(ShardedPausedPlanTest, AnEngineLostBeforeThePlanEndsTheUpdateAndTheOthersHearOfItsEnd) {
  auto [a0, a1] = publish_both(1);
  ASSERT_TRUE(a0.ok()) << a0.status.to_string() << outputs();
  ASSERT_TRUE(a1.ok()) << a1.status.to_string();
  auto v2 = std::async(std::launch::async, [&] { return publish_both(2); });
  std::this_thread::sleep_for(500ms);  // v2 is in its pause
  workers_["worker-2"]->kill(SIGSTOP);  // silent past heartbeat_timeout: lost
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", 10s)) << outputs();
  auto [b0, b1] = v2.get();
  workers_["worker-2"]->kill(SIGCONT);
  ASSERT_FALSE(b0.ok()) << outputs();
  EXPECT_NE(b0.status.message().find("abandoned before any byte moved: subscriber 'worker-2'"), std::string::npos)
      << b0.status.to_string();
  EXPECT_LT(b0.seconds, 10.0) << b0.status.to_string();
  EXPECT_FALSE(b1.ok()) << "trainer-1's call outlived the update";
  EXPECT_TRUE(workers_["worker-1"]->wait_for_output(
      "worker-1: update v2 failed: ABORTED: publisher abandoned update v2 before any byte reached this engine", 10s))
      << outputs();
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-2", 20s)) << outputs();  // back before v3
  auto [c0, c1] = publish_both(3);
  ASSERT_TRUE(c0.ok()) << c0.status.to_string() << outputs();
  ASSERT_TRUE(c1.ok()) << c1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(id + ": v3 verified", 30s)) << id << p->output();
}

// Trainer-1 accepts plan v1 and loses its Commit (a test hook, as a broken
// connection would). Rank 0 sees it in trainer-1's heartbeats and fails v1;
// trainer-1's call ends with it, within seconds, not at its own bound
// (update_timeout 20 s here; 600 s by default), and v2 lands.
class ShardedLostCommitTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    rank1_update_timeout_ = Millis(20000);
    rank1_env_ = {{"PARAMCAST_FAULT_LOSE", "commit:1"}};
    start_cluster("  ranks: 2\n");
  }
};

TEST_F(ShardedLostCommitTest, ATrainerRankWhoseCommitWasLostEndsItsCallWithTheUpdate) {
  auto [r0, r1] = publish_both(1);
  ASSERT_FALSE(r0.ok()) << outputs();
  EXPECT_NE(r0.status.message().find("trainer-1"), std::string::npos) << r0.status.to_string();
  ASSERT_FALSE(r1.ok());
  EXPECT_NE(r1.status.code(), Code::kTimeout) << "its call waited out its own bound: " << r1.status.to_string();
  EXPECT_LT(r1.seconds, 15.0) << r1.status.to_string();
  auto [ok0, ok1] = publish_both(2);
  ASSERT_TRUE(ok0.ok()) << ok0.status.to_string() << outputs();
  ASSERT_TRUE(ok1.ok()) << ok1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 20s)) << id << p->output();
}

// A broadcast (weight_update, begin_update) has no place in a many-sender job.
TEST_F(ShardedUpdateTest, ABroadcastUpdateIsRefusedInAManySenderJob) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  UpdateResult r = pub_->weight_update(model_.views());
  EXPECT_EQ(r.status.code(), Code::kInvalidArgument) << r.status.to_string();
  EXPECT_NE(r.status.message().find("weight_update_sharded"), std::string::npos) << r.status.to_string();
  auto u = pub_->begin_update(model_.specs);
  EXPECT_FALSE(u->ok());
  EXPECT_NE(u->status().message().find("PublisherRank"), std::string::npos) << u->status().to_string();
}

}  // namespace
}  // namespace paramcast
