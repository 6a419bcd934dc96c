// Delta updates whose buckets travel differently, with real processes: a
// Publisher in this process and paramcast-worker engines of every landing
// mode (a callback engine keeping its own copy, `delta_baseline: host`;
// registered buffers, where large tensors land direct; one arena in bucket
// layout, where packed buckets land in place). The model changes unevenly
// (trainer.changes: uneven): per tensor and version unchanged, a few
// elements, wholesale, or wholesale in alternate blocks, so in one update
// buckets go dense, encoded and unchanged in alternating and random orders.
// Every update must succeed and every engine verifies every byte.
#include <gtest/gtest.h>

#include <string>

#include "common/synthetic_model.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using test::WorkerClusterTest;

class DeltaLandingTest : public WorkerClusterTest {
 protected:
  void start_engines(const std::string& extra_data_plane = "", const std::string& extra_publisher = "",
                     const std::vector<std::string>& env3 = {}) {
    make_publisher(
        "control:\n"
        "  endpoint: tcp://127.0.0.1:*\n"
        "  heartbeat_interval: 100ms\n"
        "  heartbeat_timeout: 3s\n"
        "  join_timeout: 30s\n"
        "data_plane:\n"
        "  backend: gloo\n"
        "  bucket_size: 256KiB\n"
        "  direct_min_size: 64KiB\n"
        "  stall_timeout: 20s\n"
        "  init_timeout: 30s\n" +
        extra_data_plane +
        "publisher:\n"
        "  subscribers: 3\n" +
        extra_publisher +
        "subscriber:\n"
        "  delta_baseline: host\n"
        "trainer:\n"
        "  model_size: 8MiB\n"
        "  layers: 8\n"
        "  changes: uneven\n");
    ASSERT_EQ(config_.publisher.delta, DeltaMode::kAuto);  // the default: deltas on
    spawn_worker("worker-1", {}, {"--mode", "callback"});
    spawn_worker("worker-2", {}, {"--mode", "registered"});
    spawn_worker("worker-3", env3, {"--mode", "arena"});
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
  }

  // The synthetic model at `version`, as a streamed update (tensor by tensor).
  UpdateResult publish_streamed(uint64_t version) {
    model_.fill(version, config_.trainer.seed, config_.trainer.changes);
    UpdateOptions o;
    o.version = version;
    auto u = pub_->begin_update(model_.specs, o);
    if (u->ok())
      for (const TensorView& t : model_.views())
        if (!u->send(t).ok()) break;
    return u->finish();
  }

  // Every worker verified `version` bit for bit (it prints CORRUPT and
  // exits otherwise).
  void expect_verified(uint64_t version) {
    for (auto& [id, p] : workers_) {
      const std::string needle = id + ": v" + std::to_string(version) + " verified";
      EXPECT_TRUE(p->wait_for_output(needle, std::chrono::seconds(30))) << needle << "\n" << outputs();
    }
  }

  void run_updates(int n, bool streamed_too) {
    int mixed = 0;  // updates with dense and encoded buckets both on the wire
    for (uint64_t v = 1; v <= static_cast<uint64_t>(n); ++v) {
      UpdateResult r = streamed_too && v % 3 == 0 ? publish_streamed(v) : publish(v);
      ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status.to_string() << "\n" << outputs();
      if (v > 1 && v % 8 != 1) {
        EXPECT_TRUE(r.delta) << "v" << v << ": " << r.dense_because;
        if (r.wire_bytes > r.bytes / 10 && r.wire_bytes < r.bytes * 9 / 10) ++mixed;
      }
      expect_verified(v);
      if (HasFailure()) return;
    }
    EXPECT_GE(mixed, n / 3) << "the uneven model should make most updates a mix of dense and encoded buckets";
    for (auto& [id, p] : workers_) {
      EXPECT_TRUE(p->running()) << id << "\n" << outputs();
      EXPECT_EQ(p->output().find("CORRUPT"), std::string::npos) << outputs();
      EXPECT_EQ(p->output().find("failed"), std::string::npos) << outputs();
    }
  }
};

TEST_F(DeltaLandingTest, MixedBucketsAreBitExactInEveryLandingMode) {
  start_engines();
  run_updates(18, /*streamed_too=*/false);
}

TEST_F(DeltaLandingTest, MixedBucketsAreBitExactWhenStreamedAndWithChecksums) {
  start_engines("  checksum: xxh64\n");
  run_updates(12, /*streamed_too=*/true);
}

// A member that claims it takes deltas and then refuses them (its Hello
// and heartbeats say it can): the first refusal costs it that version (the
// others apply it; it is named), its claim is dropped until it applied a
// dense version; the second is a strike, and the group goes on without it,
// as deltas again. No update fails for the honest members.
TEST_F(DeltaLandingTest, AMemberThatRefusesDeltasItClaimedCostsNoUpdateOfTheOthers) {
  start_engines("", "  on_member_loss: continue\n", {"PARAMCAST_FAULT_REFUSE_DELTA=1"});
  auto verified_by = [&](const std::string& id, uint64_t v) {
    return workers_[id]->wait_for_output(id + ": v" + std::to_string(v) + " verified", std::chrono::seconds(30));
  };
  UpdateResult r = publish(1);  // dense: no baseline yet
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_FALSE(r.delta);
  r = publish(2);  // a precommitted delta plan: worker-3 refuses it, the others apply it
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_TRUE(r.precommitted);
  EXPECT_TRUE(r.delta);
  ASSERT_EQ(r.refused_delta, std::vector<std::string>{"worker-3"});
  for (const auto& o : r.subscribers) {
    if (o.worker_id != "worker-3") {
      EXPECT_TRUE(o.status.ok()) << o.status.to_string();
      continue;
    }
    EXPECT_TRUE(o.refused_delta);
    EXPECT_NE(o.status.message().find("worker-3' refused the delta of v2 onto v1 it had claimed it could take"),
              std::string::npos)
        << o.status.message();
  }
  EXPECT_TRUE(verified_by("worker-1", 2) && verified_by("worker-2", 2)) << outputs();
  r = publish(3);  // dense, for everyone: worker-3 has no delta claim
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_FALSE(r.delta);
  EXPECT_NE(r.dense_because.find("worker-3 refused the delta of v2"), std::string::npos) << r.dense_because;
  EXPECT_TRUE(r.refused_delta.empty());
  EXPECT_TRUE(verified_by("worker-3", 3)) << outputs();
  r = publish(4);  // its claim is back; it refuses again: a strike
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_TRUE(r.delta);
  EXPECT_EQ(r.refused_delta, std::vector<std::string>{"worker-3"});
  for (uint64_t v = 5; v <= 7; ++v) {  // without it, deltas again
    r = publish(v);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status.to_string() << outputs();
    EXPECT_TRUE(r.delta) << "v" << v << ": " << r.dense_because;
    EXPECT_EQ(r.subscribers.size(), 2u);
    EXPECT_EQ(r.missing, std::vector<std::string>{"worker-3"});
    EXPECT_TRUE(verified_by("worker-1", v) && verified_by("worker-2", v)) << outputs();
  }
}

// Every member refuses a precommitted delta it claimed: nothing was applied,
// so the same version goes again, dense, in the same call, and succeeds.
TEST_F(DeltaLandingTest, ADeltaEveryMemberRefusesIsSentAgainDenseInTheSameCall) {
  make_publisher(test::test_config_yaml(2));
  for (const char* id : {"worker-1", "worker-2"}) spawn_worker(id, {"PARAMCAST_FAULT_REFUSE_DELTA=1"});
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  r = publish(2);  // a delta plan (every member claims the baseline), precommitted
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_EQ(r.version, 2u);
  EXPECT_FALSE(r.delta);
  EXPECT_NE(r.dense_because.find("every member refused the delta (worker-1, worker-2)"), std::string::npos)
      << r.dense_because;
  EXPECT_EQ(r.subscribers.size(), 2u);
  for (auto& [id, p] : workers_)
    EXPECT_TRUE(p->wait_for_output(id + ": v2 verified", std::chrono::seconds(30))) << outputs();
}

}  // namespace
}  // namespace paramcast
