// Many-sender updates through the publisher, beyond one plane and two
// whole-tensor engines: engines with tensor parallelism (each rank receives
// only its slices), the shm plane, a one-rank trainer, engines that change
// what they want, the trainer ranks' slots, a missing or killed trainer
// rank, and each rank's memory. Real ZeroMQ, real Gloo or shm point-to-point
// moves, engines as paramcast-worker processes that verify every byte.
#include <gtest/gtest.h>

#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <future>
#include <map>

#include "common/reshard/executor_steps.h"
#include "common/synthetic_model.h"
#include "tests/e2e/sharded_fixture.h"
#include "tests/support/sanitizer.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using sharded_test::ShardedUpdateTest;

// Two engines of one tensor-parallel group (TP=2): each registers only its
// slices (column-parallel weights cut along dim 0, row-parallel ones along
// dim 1, norms whole) and receives exactly those bytes, straight into them,
// from both trainer ranks; each checks every row of its slices.
class ShardedTpTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    start_cluster("  ranks: 2\n", {{"--tp", "2", "--tp-rank", "0"}, {"--tp", "2", "--tp-rank", "1"}});
  }
};

TEST_F(ShardedTpTest, EachEngineRankReceivesOnlyItsSlicesBitExact) {
  uint64_t model = 0, slice[2] = {0, 0};
  for (const auto& t : model_.specs) {
    const uint64_t n = t.nbytes().value();
    model += n;
    for (int k = 0; k < 2; ++k) {
      const TpSlice cut = synthetic_tp_slice(t, 2, k);
      slice[k] += cut.dim < 0 ? n : n / static_cast<uint64_t>(t.shape[static_cast<size_t>(cut.dim)]) *
                                        static_cast<uint64_t>(cut.length);
    }
  }
  for (uint64_t v = 1; v <= 2; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    std::string needle = "v";
    needle += std::to_string(v);
    needle += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(needle, 20s)) << id << p->output();
    for (const auto& o : r0.subscribers) {
      if (o.worker_id.rfind("worker-", 0) != 0) continue;
      const int k = o.worker_id == "worker-1" ? 0 : 1;
      EXPECT_EQ(o.bytes, slice[k]) << o.worker_id << " received other bytes than its slices";
      EXPECT_LT(o.bytes, model * 6 / 10) << o.worker_id;
    }
  }
}

// The same many-sender updates on the shm plane (every rank on this host):
// the moves go through the group segment's point-to-point channels, the
// engines verify every byte, densely and as deltas per piece.
class ShardedShmTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    start_cluster("  ranks: 2\n", {{}, {"--mode", "callback"}}, "shm", "subscriber:\n  delta_baseline: host\n");
  }
};

TEST_F(ShardedShmTest, EveryTrainerRankSendsItsRowsThroughSharedMemoryBitExact) {
  for (uint64_t v = 1; v <= 3; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << r1.status.to_string();
    EXPECT_EQ(r0.subscribers.size(), 3u);
    std::string needle = "v";
    needle += std::to_string(v);
    needle += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(needle, 20s)) << id << p->output();
    // After the first, each version goes as deltas per piece (the engines hold the last one).
    if (v > 1) {
      EXPECT_TRUE(r0.delta) << "v" << v << ": " << r0.dense_because;
    }
  }
}

// A trainer rank that leaves as soon as its own call returned (its sends
// done, the engines still copying its last chunks out) costs nobody the
// update: its leaving is not a failure of the group. (Before, a move was
// counted out only after its Work completed, and a rank that left in that
// window failed the group: every engine dirty, naming it.)
TEST_F(ShardedShmTest, ATrainerRankThatLeavesRightAfterItsCallCostsNoUpdate) {
  model_.fill(1, config_.trainer.seed, config_.trainer.changes);
  auto s0 = shards(0);
  auto s1 = shards(1);
  auto other = std::async(std::launch::async, [&] {
    UpdateResult r = rank1_->weight_update(s1, 1);
    rank1_->stop();
    return r;
  });
  UpdateOptions o;
  o.version = 1;
  const UpdateResult r0 = pub_->weight_update_sharded(s0, o);
  const UpdateResult r1 = other.get();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 20s)) << id << p->output();
}

class ShardedShmTpTest : public ShardedUpdateTest {
 protected:
  void SetUp() override {
    start_cluster("  ranks: 2\n", {{"--tp", "2", "--tp-rank", "0"}, {"--tp", "2", "--tp-rank", "1"}}, "shm");
  }
};

// Dim-1 slices too (packed by the sender, unpacked by the receiver): each
// engine rank gets exactly its slices' bytes.
TEST_F(ShardedShmTpTest, EachEngineRankReceivesOnlyItsSlicesThroughSharedMemory) {
  uint64_t slice[2] = {0, 0};
  for (const auto& t : model_.specs) {
    const uint64_t n = t.nbytes().value();
    for (int k = 0; k < 2; ++k) {
      const TpSlice cut = synthetic_tp_slice(t, 2, k);
      slice[k] += cut.dim < 0 ? n : n / static_cast<uint64_t>(t.shape[static_cast<size_t>(cut.dim)]) *
                                        static_cast<uint64_t>(cut.length);
    }
  }
  auto [r0, r1] = publish_both(1);
  ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 20s)) << id << p->output();
  for (const auto& o : r0.subscribers) {
    if (o.worker_id.rfind("worker-", 0) != 0) continue;
    EXPECT_EQ(o.bytes, slice[o.worker_id == "worker-1" ? 0 : 1]) << o.worker_id;
  }
}

// A trainer of one rank (publisher.ranks: 1, plain weight_update) and two
// replicas of a TP=2 engine (4 processes): engines that registered slices
// make the update go point to point, each engine rank receiving exactly its
// slices, bit-exact; a streamed update, a broadcast, is refused naming one.
class ShardedOneRankTest : public test::WorkerClusterTest {
 protected:
  void SetUp() override {
    WorkerClusterTest::SetUp();
    make_publisher(test::test_config_yaml(4));
    for (int i = 0; i < 4; ++i)
      spawn_worker("worker-" + std::to_string(i + 1), {}, {"--tp", "2", "--tp-rank", std::to_string(i % 2)});
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
  }
};

TEST_F(ShardedOneRankTest, AOneRankTrainersWeightUpdateReachesTensorParallelEnginesAsSlices) {
  auto model = test::make_tensors(
      synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers, config_.trainer.dtype));
  uint64_t slice[2] = {0, 0}, whole = 0;
  for (const auto& t : model.specs) {
    const uint64_t n = t.nbytes().value();
    whole += n;
    for (int k = 0; k < 2; ++k) {
      const TpSlice cut = synthetic_tp_slice(t, 2, k);
      slice[k] += cut.dim < 0 ? n : n / static_cast<uint64_t>(t.shape[static_cast<size_t>(cut.dim)]) *
                                        static_cast<uint64_t>(cut.length);
    }
  }
  for (uint64_t v = 1; v <= 2; ++v) {
    model.fill(v, config_.trainer.seed, config_.trainer.changes);
    UpdateOptions o;
    o.version = v;
    UpdateResult r = pub_->weight_update(model.views(), o);
    ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
    EXPECT_EQ(r.buckets, 0u) << "a broadcast went to engines that serve slices";
    ASSERT_EQ(r.subscribers.size(), 4u);
    for (const auto& s : r.subscribers) {
      const int k = (s.worker_id.back() - '1') % 2;
      EXPECT_EQ(s.bytes, slice[k]) << s.worker_id << " received other bytes than its slices";
    }
    std::string needle = "v";
    needle += std::to_string(v);
    needle += " verified";
    for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output(needle, 20s)) << id << p->output();
  }
  EXPECT_LT(slice[0] + slice[1], whole * 11 / 10);
  // A streamed update is a broadcast: refused, naming an engine with slices.
  auto streamed = pub_->begin_update(model.specs);
  UpdateResult refused = streamed->finish();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.status.message().find("serves slices"), std::string::npos) << refused.status.to_string();
}

// An engine that registers a slice, then the whole tensor under the same
// name, wants it whole again: the publisher drops its slices and the next
// update is an ordinary broadcast the engine takes, bit-exact.
TEST(ShardedWantsTest, AnEngineThatRegistersTheWholeTensorAgainIsPlannedWhole) {
  const std::string dir = test::make_temp_dir("paramcast-wants");
  auto cfg = load_config_file(test::write_file(dir, "deploy.yaml", test::test_config_yaml(1)));
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto pub = Publisher::create(cfg.value());
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  Config sub_cfg = cfg.value();
  sub_cfg.control.endpoint = pub.value()->endpoint();
  auto sub = Subscriber::create(sub_cfg, "worker-1");
  ASSERT_TRUE(sub.ok()) << sub.status().to_string();
  const TensorSpec w{"w", DType::kF32, {8, 4}}, b{"b", DType::kF32, {4}};
  std::vector<float> src_w(32), src_b(4), dst_w(32, -1.f), dst_half(16, -1.f), dst_b(4, -1.f);
  ASSERT_TRUE(sub.value()->register_slice(ShardView{TensorView{TensorSpec{"w", DType::kF32, {4, 4}}, dst_half.data(),
                                                               Device::cpu()},
                                                    {8, 4}, {4, 0}})
                  .ok());
  ASSERT_TRUE(sub.value()->register_tensor(TensorView{b, dst_b.data(), Device::cpu()}).ok());
  ASSERT_TRUE(sub.value()->start().ok());
  ASSERT_TRUE(pub.value()->start().ok());
  auto publish = [&](uint64_t v) {
    for (int i = 0; i < 32; ++i) src_w[static_cast<size_t>(i)] = static_cast<float>(v * 100 + static_cast<uint64_t>(i));
    for (int i = 0; i < 4; ++i) src_b[static_cast<size_t>(i)] = static_cast<float>(v * 1000 + static_cast<uint64_t>(i));
    UpdateOptions o;
    o.version = v;
    return pub.value()->weight_update({TensorView{w, src_w.data(), Device::cpu()}, TensorView{b, src_b.data(), Device::cpu()}}, o);
  };
  // The engine's buffers are read once its own report of the version came
  // (the data thread wrote them; the report is the hand-over).
  auto applied = [&](uint64_t v) {
    for (int i = 0; i < 200; ++i) {
      auto report = sub.value()->next_report(std::chrono::milliseconds(100));
      if (report && report->version >= v) return report->status.ok();
    }
    return false;
  };
  UpdateResult r1 = publish(1);
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  ASSERT_TRUE(applied(1));
  EXPECT_EQ(r1.buckets, 0u);  // point to point: rows 4..7 of w and b
  ASSERT_EQ(r1.subscribers.size(), 1u);
  EXPECT_EQ(r1.subscribers[0].bytes, 16u * 4 + 4u * 4);
  EXPECT_TRUE(std::equal(dst_half.begin(), dst_half.end(), src_w.begin() + 16));
  // The whole tensor under the same name: planned whole from now on.
  ASSERT_TRUE(sub.value()->register_tensor(TensorView{w, dst_w.data(), Device::cpu()}).ok());
  UpdateResult r2;
  for (int attempt = 0; attempt < 50; ++attempt) {  // its Wants travels on the control channel
    r2 = publish(2 + static_cast<uint64_t>(attempt));
    if (r2.ok() && r2.buckets > 0) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(r2.ok()) << r2.status.to_string();
  EXPECT_GT(r2.buckets, 0u) << "still planned as a slice";
  ASSERT_TRUE(applied(r2.version));
  EXPECT_EQ(dst_w, src_w);
  EXPECT_EQ(dst_b, src_b);
  sub.value()->stop();
  pub.value()->shutdown();
  test::remove_tree(dir);
}

// One trainer rank (publisher.ranks: 1): an engine whose Wants no plan can
// use (a slice of the first tensor under another dtype and shape) is left
// out and named in every update's result; the honest paramcast-worker
// verifies every version. Before, its Wants turned every update sharded
// and rank 0 refused each one.
class WantsLeftOutTest : public test::WorkerClusterTest {};

TEST_F(WantsLeftOutTest, OneRankAnEngineWhoseWantsNoPlanCanUseIsLeftOutAndTheOtherGetsEveryUpdate) {
  make_publisher(test::test_config_yaml(2));
  spawn_worker("worker-1");
  Config cfg = config_;
  cfg.control.endpoint = pub_->endpoint();
  auto hostile = Subscriber::create(cfg, "worker-2");
  ASSERT_TRUE(hostile.ok()) << hostile.status().to_string();
  const std::string first =
      synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers, config_.trainer.dtype)[0].name;
  std::vector<float> cell(1);
  ASSERT_TRUE(hostile.value()
                  ->register_slice(ShardView{TensorView{TensorSpec{first, DType::kF32, {1, 1}}, cell.data(), Device::cpu()},
                                             {1, 1}, {0, 0}})
                  .ok());
  ASSERT_TRUE(hostile.value()->start().ok());  // its Wants come before its answer to the start-up formation
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  for (uint64_t v = 1; v <= 3; ++v) {
    const UpdateResult r = publish(v);
    ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
    ASSERT_EQ(r.left_out.size(), 1u) << "v" << v;
    EXPECT_EQ(r.left_out[0].first, "worker-2");
    EXPECT_NE(r.left_out[0].second.find(first), std::string::npos) << r.left_out[0].second;
    ASSERT_EQ(r.subscribers.size(), 1u);
    EXPECT_EQ(r.subscribers[0].worker_id, "worker-1");
    std::string verified = std::to_string(v);
    verified.insert(verified.begin(), 'v');
    verified += " verified";
    EXPECT_TRUE(workers_["worker-1"]->wait_for_output(verified, 20s)) << outputs();
  }
  hostile.value()->stop();
}

// A trainer rank that never joined is the cause of the update's failure,
// named as such ("trainer-1 (not joined)"), not the engine wants that no
// other rank holds; nothing is planned, no byte moves, no version is spent.
TEST(ShardedMissingRankTest, ARankNotInTheGroupIsNamedAsTheCause) {
  const std::string dir = test::make_temp_dir("paramcast-missing-rank");
  const std::string path = test::write_file(
      dir, "deploy.yaml",
      test::test_config_yaml(1, "  ranks: 2\n  on_missing_at_start: start_with_present\n"));
  auto cfg = load_config_file(path);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  cfg->control.join_timeout = 2s;
  auto pub = Publisher::create(*cfg);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  auto w1 = test::Process::start(test::binary("paramcast-worker"), {"--config", path, "--id", "worker-1", "--endpoint",
                                                                    pub.value()->endpoint(), "--updates", "0"});
  ASSERT_TRUE(w1->wait_for_output("joined publisher", 20s)) << w1->output();
  ASSERT_TRUE(pub.value()->start().ok());
  const TensorSpec w{"w", DType::kF32, {8, 4}};
  std::vector<float> rows(16, 1.f);
  ShardView mine{TensorView{TensorSpec{"w", DType::kF32, {4, 4}}, rows.data(), Device::cpu()}, {8, 4}, {0, 0}};
  UpdateOptions o;
  o.version = 1;
  const UpdateResult r = pub.value()->weight_update_sharded({mine}, o);
  ASSERT_FALSE(r.ok());
  const std::string msg = r.status.message();
  EXPECT_NE(msg.find("trainer-1 (not joined)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("which no rank holds"), std::string::npos) << msg;
  EXPECT_EQ(r.version, 0u) << "refused before a version was assigned";
  pub.value()->shutdown();
  test::remove_tree(dir);
}

// The same refusal through paramcast-trainer (rank 0 alone, trainer-1
// never started): its own line and the publisher's log name the update as
// refused before a version was assigned, never "v0", which no update has.
TEST(ShardedMissingRankTest, ARefusalBeforeAnyVersionIsNotCalledV0) {
  const std::string dir = test::make_temp_dir("paramcast-missing-rank-label");
  std::string yaml = test::test_config_yaml(1, "  ranks: 2\n  on_missing_at_start: start_with_present\n");
  yaml.replace(yaml.find("join_timeout: 30s"), 17, "join_timeout: 2s");
  const std::string path = test::write_file(dir, "deploy.yaml", yaml);
  auto rank0 = test::Process::start(test::binary("paramcast-trainer"),
                                    {"--config", path, "--endpoint-file", dir + "/endpoint", "--updates", "1"});
  const std::string endpoint = test::read_when_written(dir + "/endpoint");
  ASSERT_FALSE(endpoint.empty()) << rank0->output();
  auto w1 = test::Process::start(test::binary("paramcast-worker"),
                                 {"--config", path, "--id", "worker-1", "--endpoint", endpoint, "--updates", "0"});
  EXPECT_NE(rank0->wait_for(120s), 0) << rank0->output();
  const std::string out = rank0->output();
  EXPECT_NE(out.find("trainer-1 (not joined)"), std::string::npos) << out;
  EXPECT_NE(out.find("update (refused before a version was assigned) FAILED"), std::string::npos) << out;
  EXPECT_NE(out.find("publisher: update (refused before a version was assigned) failed"), std::string::npos) << out;
  EXPECT_EQ(out.find("update v0"), std::string::npos) << out;
  test::remove_tree(dir);
}

// Count mode (any worker ids): the trainer ranks' slots are their own. An
// extra engine that joins first takes no trainer rank's place.
TEST(ShardedSlotsTest, AnExtraEngineCannotTakeATrainerRanksSlot) {
  const std::string dir = test::make_temp_dir("paramcast-slots");
  const std::string path = test::write_file(dir, "deploy.yaml", test::test_config_yaml(1, "  ranks: 2\n"));
  auto cfg = load_config_file(path);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto pub = Publisher::create(*cfg);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  auto engine = [&](const char* id) {
    return test::Process::start(test::binary("paramcast-worker"),
                                {"--config", path, "--id", id, "--endpoint", pub.value()->endpoint(), "--updates", "0"});
  };
  auto w1 = engine("worker-1");
  ASSERT_TRUE(w1->wait_for_output("joined publisher", 20s)) << w1->output();
  auto extra = engine("worker-9");  // the one engine slot is taken: refused, whatever the ranks' slots
  EXPECT_TRUE(extra->wait_for(20s).has_value()) << extra->output();
  EXPECT_NE(extra->output().find("all are present"), std::string::npos) << extra->output();
  Config rank_cfg = *cfg;
  rank_cfg.control.endpoint = pub.value()->endpoint();
  auto rank1 = PublisherRank::create(rank_cfg, 1);
  ASSERT_TRUE(rank1.ok());
  ASSERT_TRUE(rank1.value()->start().ok());
  Status s = pub.value()->start();
  EXPECT_TRUE(s.ok()) << s.to_string() << w1->output();
  rank1.value()->stop();
  pub.value()->shutdown();
  test::remove_tree(dir);
}

// Rank 1 as a process of its own (paramcast-trainer --rank 1), killed.
class ShardedProcessTest : public test::WorkerClusterTest {
 protected:
  // Rank 0's rows of every tensor at `version`, filled from the generator
  // alone (as paramcast-trainer's ranks do).
  std::vector<ShardView> rank0(uint64_t version) {
    const auto specs = synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers, config_.trainer.dtype);
    rows_.clear();
    rows_.reserve(specs.size());
    std::vector<ShardView> out;
    for (const auto& t : specs) {
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      auto [first, count] = synthetic_shard_rows(rows, 0, config_.publisher.ranks);
      const uint64_t row_bytes = t.nbytes().value() / static_cast<uint64_t>(rows);
      rows_.emplace_back(row_bytes * static_cast<uint64_t>(count));
      fill_synthetic_range(t, config_.trainer.seed, version, rows_.back().data(), row_bytes * static_cast<uint64_t>(first),
                           rows_.back().size(), config_.trainer.changes);
      ShardView v;
      v.local = TensorView{t, rows_.back().data(), Device{}};
      if (!t.shape.empty()) v.local.spec.shape[0] = count;
      v.full_shape = t.shape;
      v.offsets.assign(t.shape.size(), 0);
      out.push_back(std::move(v));
    }
    return out;
  }
  std::vector<std::vector<uint8_t>> rows_;
};

TEST_F(ShardedProcessTest, AKilledTrainerRankFailsTheUpdateWithinTheHeartbeatBoundNamingIt) {
  make_publisher(test::test_config_yaml(2, "  ranks: 2\n"));
  auto rank1 = test::Process::start(test::binary("paramcast-trainer"),
                                    {"--config", yaml_path_, "--rank", "1", "--endpoint", pub_->endpoint(), "--updates",
                                     "20"});
  spawn_worker("worker-1");
  spawn_worker("worker-2", {}, {"--mode", "callback"});
  Status s = pub_->start();
  ASSERT_TRUE(s.ok()) << s.to_string() << outputs() << rank1->output();
  UpdateOptions o;
  o.version = 1;
  UpdateResult r1 = pub_->weight_update_sharded(rank0(1), o);
  ASSERT_TRUE(r1.ok()) << r1.status.to_string() << outputs() << rank1->output();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 20s)) << id << p->output();
  EXPECT_TRUE(rank1->wait_for_output("trainer-1: v1 sent", 20s)) << rank1->output();

  rank1->kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  o.version = 2;
  UpdateResult r2 = pub_->weight_update_sharded(rank0(2), o);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status.message().find("trainer-1"), std::string::npos) << r2.status.to_string();
  // heartbeat_timeout + 2 s, and slack for a loaded machine (as tests/python/cluster.py).
  EXPECT_LT(took, std::chrono::duration<double>(config_.control.heartbeat_timeout).count() + 6.0)
      << r2.status.to_string();
  // Rank 1 may have stated its part of v2 before it died (v2 began) or not
  // (the publisher abandoned v2 before its plan went out): each engine
  // either never started it and stays consistent at v1 (told of the
  // abandon, or not at all), or says it is dirty, naming the dead rank;
  // none claims v2.
  std::this_thread::sleep_for(500ms);
  for (auto& [id, p] : workers_) {
    const std::string out = p->output();
    EXPECT_EQ(out.find("v2 verified"), std::string::npos) << out;
    const auto failed = out.find(id + ": update v2 failed");
    if (failed != std::string::npos) {  // named the dead rank, or the peer that aborted the group after it did
      const std::string line = out.substr(failed, out.find('\n', failed) - failed);
      if (line.find("before any byte reached this engine") != std::string::npos)
        EXPECT_NE(line.find("(state version 1, consistent)"), std::string::npos) << line;
      else
        EXPECT_NE(line.find("dirty (v2 incomplete, last consistent v1)"), std::string::npos) << line;
    }
  }
}

// Every rank a process (paramcast-trainer on ranks 0 and 1): the engines
// verify every byte, and a trainer rank's memory grows by less than three
// buckets over its own rows while it publishes (its sends leave from them);
// with deltas on, by the baseline of what it sent (at most its rows) more.
struct MemoryCase {
  bool delta;
};
class ShardedMemoryTest : public ShardedProcessTest, public ::testing::WithParamInterface<MemoryCase> {};

TEST_P(ShardedMemoryTest, EachTrainerRankSendsFromItsRowsAndGrowsByLessThanThreeBucketsPlusItsBaseline) {
  const bool delta = GetParam().delta;
  const int updates = delta ? 3 : 2;
  std::string yaml = test::test_config_yaml(2, std::string("  ranks: 2\n  delta: ") + (delta ? "auto" : "off") + "\n");
  yaml.replace(yaml.find("model_size: 4MiB"), 16, "model_size: 64MiB");
  // With deltas: an RL step's changes (unchanged, a few elements, wholesale).
  if (delta) yaml.replace(yaml.find("  updates: 3\n"), 13, "  updates: 3\n  changes: uneven\n");
  const std::string path = test::write_file(dir_, "deploy.yaml", yaml);
  const std::string n = std::to_string(updates);
  auto rank0 = test::Process::start(test::binary("paramcast-trainer"),
                                    {"--config", path, "--endpoint-file", dir_ + "/endpoint", "--updates", n});
  const std::string endpoint = test::read_when_written(dir_ + "/endpoint");
  ASSERT_FALSE(endpoint.empty()) << rank0->output();
  auto rank1 = test::Process::start(test::binary("paramcast-trainer"),
                                    {"--config", path, "--rank", "1", "--endpoint", endpoint, "--updates", n});
  std::vector<std::unique_ptr<test::Process>> engines;
  for (const char* id : {"worker-1", "worker-2"})
    engines.push_back(test::Process::start(test::binary("paramcast-worker"),
                                           {"--config", path, "--id", id, "--endpoint", endpoint, "--updates", n}));
  EXPECT_EQ(rank0->wait_for(120s), 0) << rank0->output();
  EXPECT_EQ(rank1->wait_for(60s), 0) << rank1->output();
  for (auto& e : engines) {
    EXPECT_EQ(e->wait_for(60s), 0) << e->output();
    EXPECT_NE(e->output().find("v" + n + " verified"), std::string::npos) << e->output();
  }
  if (delta) {  // the later versions went as deltas from both ranks, bit-exact on the engines
    EXPECT_NE(rank0->output().find("update v3: "), std::string::npos) << rank0->output();
    EXPECT_NE(rank0->output().find(" as a delta from 2 trainer ranks "), std::string::npos) << rank0->output();
  }
  const std::string out = rank1->output();
  const auto at = out.find("growth_bytes="), b = out.find("baseline_bytes=");
  ASSERT_NE(at, std::string::npos) << out;
  ASSERT_NE(b, std::string::npos) << out;
  const uint64_t growth = std::stoull(out.substr(at + 13)), baseline = std::stoull(out.substr(b + 15));
  // Its rows are half of the model (31.75 MiB): the baseline is at most
  // them, and none without deltas.
  if (delta) {
    EXPECT_GT(baseline, 16u << 20) << out;
    EXPECT_LE(baseline, 32u << 20) << out;
  } else {
    EXPECT_EQ(baseline, 0u) << out;
  }
  // Its staging window (three 1 MiB buckets), or one bundle of small
  // pieces where that is larger (a bundle goes whole, up to kBundleMax),
  // and 6 MiB for the runtime's own (threads, Gloo's pairs), over the
  // baseline; with deltas, the encoder's output for the piece it encodes
  // (at most the rank's largest piece) too. Seen without deltas: +5.2 MiB
  // before bundles, +8.7 to +9.4 MiB with them (2026-12-06). A sanitizer's
  // allocator keeps freed memory for a while, so the bound holds in the
  // plain build only.
  uint64_t largest = 0;
  for (const auto& t : synthetic_llm_layout(64ull << 20, 32, DType::kBF16)) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const uint64_t row_bytes = t.nbytes().value() / static_cast<uint64_t>(rows);
    largest = std::max(largest, row_bytes * static_cast<uint64_t>(synthetic_shard_rows(rows, 1, 2).second));
  }
#if defined(PARAMCAST_TEST_ASAN) || defined(PARAMCAST_TEST_TSAN)
  std::printf("memory bound not checked under a sanitizer (growth %llu bytes)\n", static_cast<unsigned long long>(growth));
#else
  const uint64_t staging = std::max<uint64_t>(3 * (1u << 20), reshard::detail::kBundleMax);
  EXPECT_LT(growth, baseline + (delta ? largest : 0) + staging + 6 * (1u << 20)) << out << "largest piece " << largest;
#endif
}

INSTANTIATE_TEST_SUITE_P(DeltaOffAndOn, ShardedMemoryTest, ::testing::Values(MemoryCase{false}, MemoryCase{true}),
                         [](const auto& info) { return std::string(info.param.delta ? "DeltaOn" : "DeltaOff"); });

}  // namespace
}  // namespace paramcast
