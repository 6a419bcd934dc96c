// The fixture of the many-sender tests (sharded_update_test.cc,
// sharded_ranks_test.cc): a publisher (rank 0) and a PublisherRank (rank 1)
// in this process, engines as paramcast-worker processes that verify every
// byte of the synthetic model; each trainer rank holds only its rows.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <future>
#include <map>

#include "common/synthetic_model.h"
#include "tests/support/worker_cluster.h"

namespace paramcast::sharded_test {

using namespace std::chrono_literals;

class ShardedUpdateTest : public test::WorkerClusterTest {
 protected:
  void SetUp() override { start_cluster("  ranks: 2\n"); }
  // worker-1 registered in place, worker-2 through the callback, unless
  // `engines` gives each its paramcast-worker flags; on the Gloo plane, or
  // on `backend` (every rank on this host shares the group's memory: shm).
  void start_cluster(const std::string& publisher_extra,
                     std::vector<std::vector<std::string>> engines = {{}, {"--mode", "callback"}},
                     const std::string& backend = "gloo", const std::string& sections = "") {
    WorkerClusterTest::SetUp();
    std::string yaml = test::test_config_yaml(2 + extra_engines_, publisher_extra) + sections;
    yaml.replace(yaml.find("backend: gloo"), 13, "backend: " + backend);
    make_publisher(yaml);
    Config cfg = config_;
    cfg.control.endpoint = pub_->endpoint();
    if (rank1_update_timeout_.count() > 0) cfg.publisher.update_timeout = rank1_update_timeout_;
    for (const auto& [name, value] : rank1_env_) ::setenv(name.c_str(), value.c_str(), 1);  // read on create
    auto rank = PublisherRank::create(cfg, 1);
    for (const auto& [name, value] : rank1_env_) ::unsetenv(name.c_str());  // not the engines'
    ASSERT_TRUE(rank.ok()) << rank.status().to_string();
    rank1_ = std::move(rank.value());
    ASSERT_TRUE(rank1_->start().ok());
    for (size_t i = 0; i < engines.size(); ++i)
      spawn_worker("worker-" + std::to_string(i + 1), i < engine_env_.size() ? engine_env_[i] : std::vector<std::string>{},
                   engines[i]);
    if (before_start_) before_start_();
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
    model_ = test::make_tensors(
        synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers, config_.trainer.dtype));
  }
  void TearDown() override {
    if (rank1_) rank1_->stop();
    WorkerClusterTest::TearDown();
  }

  // Rank `r` of 2's rows of every tensor, copied out of the whole model (so
  // that each rank's buffer holds only its shard), shifted by `shift` rows
  // for rank 1 (a negative shift overlaps rank 0, a positive one leaves a gap).
  // Rank 0 holds each tensor's first rows up to half of them (moved by
  // `cut`), rank 1 the rest (from `shift` rows later).
  std::vector<ShardView> shards(int r, int64_t shift = 0, int64_t cut = 0) {
    std::vector<ShardView> out;
    auto& keep = r == 0 ? rows0_ : rows1_;
    // The last call's rows stay alive, holding its bytes: these are new addresses.
    if (fresh_addresses_) (r == 0 ? last_rows0_ : last_rows1_) = std::move(keep);
    keep.clear();
    keep.reserve(model_.specs.size());
    for (size_t i = 0; i < model_.specs.size(); ++i) {
      const TensorSpec& t = model_.specs[i];
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      int64_t half = std::clamp<int64_t>((rows + 1) / 2 + cut, 0, rows);
      int64_t begin = r == 0 ? 0 : std::clamp<int64_t>(half + shift, 0, rows);
      int64_t end = r == 0 ? half : rows;
      const uint64_t row_bytes = model_.bytes[i].size() / static_cast<uint64_t>(rows);
      keep.emplace_back(model_.bytes[i].begin() + static_cast<int64_t>(row_bytes) * begin,
                        model_.bytes[i].begin() + static_cast<int64_t>(row_bytes) * end);
      ShardView s;
      s.local.spec = t;
      s.local.spec.shape[0] = end - begin;
      s.local.data = keep.back().data();
      s.full_shape = t.shape;
      s.offsets.assign(t.shape.size(), 0);
      s.offsets[0] = begin;
      out.push_back(std::move(s));
    }
    return out;
  }

  std::pair<UpdateResult, UpdateResult> publish_both(uint64_t version, int64_t shift = 0, int64_t cut = 0) {
    model_.fill(version, config_.trainer.seed, config_.trainer.changes);
    auto s0 = shards(0, 0, cut);
    auto s1 = shards(1, shift, cut);
    // Every rank names the step (the version): the calls pair by it.
    auto other = std::async(std::launch::async, [&] { return rank1_->weight_update(s1, version); });
    UpdateOptions o;
    o.version = version;
    UpdateResult r0 = pub_->weight_update_sharded(s0, o);
    return {r0, other.get()};
  }

  // Rank 0 refuses step `version` at once (its update's transforms differ
  // from publisher.transforms, which rank 1 applies) while rank 1's part
  // comes a second later: both calls end with rank 0's reason, rank 1's when
  // its part arrives, not at its own timeout.
  void expect_refused_before_the_late_rank(uint64_t version) {
    auto s0 = shards(0);
    auto s1 = shards(1);
    auto late = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(1s);
      return rank1_->weight_update(s1, version);
    });
    UpdateOptions o;
    o.version = version;
    o.transforms = std::vector<transform::Rule>{transform::Rule{}};
    o.transforms->front().match = "*";
    o.transforms->front().cast = DType::kF16;
    const UpdateResult r0 = pub_->weight_update_sharded(s0, o);
    const UpdateResult r1 = late.get();
    for (const UpdateResult* r : {&r0, &r1}) {
      ASSERT_FALSE(r->ok());
      EXPECT_NE(r->status.message().find("differ from publisher.transforms"), std::string::npos)
          << r->status.to_string();
    }
    EXPECT_LT(r1.seconds, 5.0) << "ended when its part arrived, not at its timeout: " << r1.status.to_string();
  }

  std::unique_ptr<PublisherRank> rank1_;
  int extra_engines_ = 0;              // engines a test runs in this process, beside the two paramcast-workers
  std::function<void()> before_start_;  // starts them (the publisher's endpoint is known, start() not called)
  Millis rank1_update_timeout_{0};  // rank 1's own publisher.update_timeout, when set
  std::vector<std::vector<std::string>> engine_env_;  // each engine's environment, when set
  std::map<std::string, std::string> rank1_env_;       // rank 1's test hooks (PARAMCAST_FAULT_*)
  std::vector<std::vector<uint8_t>> rows0_, rows1_;
  bool fresh_addresses_ = false;  // each call's shards in new buffers, the last call's kept alive
  std::vector<std::vector<uint8_t>> last_rows0_, last_rows1_;
};

}  // namespace paramcast::sharded_test
