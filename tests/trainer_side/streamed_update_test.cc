// Streamed and partial updates end to end, tier 1: Publisher::begin_update
// with tensors handed over one at a time, in any order, each overwritten as
// soon as send() returns; real ZeroMQ sockets and Gloo TCP pairs.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <thread>

#include "common/synthetic_model.h"
#include "tests/support/cluster.h"
#include "tests/support/update_fixture.h"

namespace paramcast {
namespace {

using test::HostTensors;
using test::WeightUpdateTest;

using StreamedUpdateTest = WeightUpdateTest;

// Streams `t` in `order`, each tensor copied into one scratch buffer that
// is overwritten with garbage right after its send(): what the engines hold
// can only come from what send() staged or put on the wire.
UpdateResult stream(Publisher& pub, HostTensors& t, const std::vector<size_t>& order, const UpdateOptions& o = {}) {
  auto u = pub.begin_update(t.specs, o);
  if (!u->ok()) return u->finish();
  std::vector<uint8_t> scratch;
  for (size_t i : order) {
    scratch = t.bytes[i];
    Status s = u->send(TensorView{t.specs[i], scratch.data(), Device::cpu()});
    std::fill(scratch.begin(), scratch.end(), 0xA5);
    if (!s.ok()) return u->finish();
  }
  return u->finish();
}

// Polls `cond` for up to 30 s (a loaded machine delivers control messages late).
template <typename F>
bool eventually(F&& cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

std::vector<size_t> shuffled(size_t n, uint32_t seed) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  return order;
}

TEST_F(StreamedUpdateTest, OutOfOrderStreamIsBitExactInBothModesWithinTwoBuckets) {
  // 291 LLaMA-shaped tensors: packed ones (< 64 KiB), direct ones, and ones
  // larger than a 1 MiB bucket (sent in chunks).
  auto specs = synthetic_llm_layout(8 << 20, 32, DType::kBF16);
  Config cfg = test::test_config(4);
  cfg.data_plane.checksum = Checksum::kXxh64;
  start(cfg, 4, specs, [](int i) { return i % 2 == 1; });
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 3; ++v) {
    t.fill(v);
    UpdateResult r = stream(*pub_, t, shuffled(specs.size(), static_cast<uint32_t>(v)));
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_EQ(r.version, v);
    EXPECT_EQ(r.tensors, specs.size());
    EXPECT_GT(r.buckets, 5u);
    expect_holds(t, v);
  }
  // Then the whole-model call, and a stream again: both kinds mix.
  publish_and_check(t, 4);
  t.fill(5);
  UpdateResult r = stream(*pub_, t, shuffled(specs.size(), 5));
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  expect_holds(t, 5);
  EXPECT_LE(pub_->stats().staging_peak_bytes, 2 * cfg.data_plane.bucket_bytes);
}

// A small update's bucket is mostly alignment gaps: both sides stage what
// it can take (its bytes and gaps), not less, also as deltas.
TEST_F(StreamedUpdateTest, TinyTensorsInOneBucket) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 12; ++i) {
    std::string name = "tiny.";  // appended, not "t" + ...: GCC 12's -Wrestrict false positive at -O3
    name += std::to_string(i);
    specs.push_back({name, DType::kU8, {3 + i}});
  }
  Config cfg = test::test_config(2);
  cfg.subscriber.delta_baseline = true;
  start(cfg, 2, specs, [](int i) { return i == 1; });
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 3; ++v) {
    t.fill(v);
    UpdateResult r = stream(*pub_, t, shuffled(specs.size(), static_cast<uint32_t>(v)));
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_EQ(r.buckets, 1u);
    expect_holds(t, v);
  }
}

TEST_F(StreamedUpdateTest, RejectedManifestMovesNoByteAndNamesEveryMismatch) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {64}}, {"b", DType::kBF16, {1000}}};
  start(test::test_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  publish_and_check(t, 1);
  auto wrong = specs;
  wrong[1].shape = {999};
  auto u = pub_->begin_update(wrong);
  ASSERT_FALSE(u->ok());
  UpdateResult r = u->finish();
  EXPECT_EQ(r.status.code(), Code::kRejected) << r.status.to_string();
  EXPECT_NE(r.status.message().find("'b': shape expected [1000], got [999]"), std::string::npos) << r.status.to_string();
  ASSERT_EQ(r.subscribers.size(), 2u);
  for (auto& o : r.subscribers) EXPECT_EQ(o.mismatches.size(), 1u) << o.worker_id;
  expect_holds(t, 1);  // nothing touched
  publish_and_check(t, r.version + 1);
}

TEST_F(StreamedUpdateTest, BadSendFailsNamingTheTensorAndTheNextUpdateHeals) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {64}}, {"b", DType::kBF16, {1000}}, {"c", DType::kBF16, {300000}}};
  start(test::test_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  publish_and_check(t, 1);

  struct Case {
    TensorSpec spec;
    std::string says;
  } cases[] = {
      {{"nope", DType::kF32, {64}}, "tensor 'nope' is not in the update's manifest"},
      {{"b", DType::kF32, {1000}}, "tensor 'b': dtype expected BF16, got F32"},
      {{"b", DType::kBF16, {10, 100}}, "tensor 'b': shape expected [1000], got [10, 100]"},
  };
  for (const auto& c : cases) {
    auto u = pub_->begin_update(specs);
    ASSERT_TRUE(u->ok()) << u->status().to_string();
    const uint64_t v = u->version();
    ASSERT_TRUE(u->send(t.views()[0]).ok());
    std::vector<uint8_t> junk(c.spec.nbytes().value());
    Status s = u->send(TensorView{c.spec, junk.data(), Device::cpu()});
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.to_string();
    EXPECT_EQ(u->send(t.views()[1]).code(), Code::kInvalidArgument) << "the update ended with the bad send";
    UpdateResult r = u->finish();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.status.message().find(c.says), std::string::npos) << r.status.to_string();
    // Every engine took part in v and was told to give it up: dirty, saying so.
    ASSERT_TRUE(eventually([&] {
      for (auto& w : workers_)
        if (w->sub->state().kind != WeightStateKind::kDirty || w->sub->state().dirty_version != v) return false;
      return true;
    }));
    for (auto& w : workers_) EXPECT_EQ(w->sub->state().version, 1u) << "the last consistent version stays";
  }
  // A second send of a tensor, and a finish with tensors missing.
  {
    auto u = pub_->begin_update(specs);
    ASSERT_TRUE(u->send(t.views()[0]).ok());
    Status s = u->send(t.views()[0]);
    EXPECT_NE(s.message().find("tensor 'a' was sent already"), std::string::npos) << s.to_string();
  }
  {
    auto u = pub_->begin_update(specs);
    ASSERT_TRUE(u->send(t.views()[1]).ok());
    UpdateResult r = u->finish();
    EXPECT_NE(r.status.message().find("finished with 1 of its 3 tensors sent; not sent: 'a', 'c'"), std::string::npos)
        << r.status.to_string();
  }
  t.fill(9);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  expect_holds(t, r.version);
}

// Destroying an unfinished Update aborts it: each engine is dirty at its
// version and says so, never consistent with half of it; the next update
// (a new group) makes every engine consistent again.
TEST_F(StreamedUpdateTest, DestroyedUnfinishedUpdateLeavesEnginesDirtyUntilTheNext) {
  auto specs = synthetic_llm_layout(2 << 20, 4, DType::kBF16);
  start(test::test_config(3), 3, specs, [](int i) { return i == 2; });
  HostTensors t = test::make_tensors(specs);
  publish_and_check(t, 1);
  t.fill(2);
  uint64_t v = 0;
  {
    auto u = pub_->begin_update(t.specs);
    ASSERT_TRUE(u->ok());
    v = u->version();
    auto views = t.views();
    for (size_t i = 0; i < views.size() / 2; ++i) ASSERT_TRUE(u->send(views[i]).ok());
  }
  ASSERT_TRUE(eventually([&] {
    for (auto& w : workers_)
      if (w->sub->state().kind != WeightStateKind::kDirty) return false;
    return true;
  }));
  for (auto& w : workers_) {
    EXPECT_EQ(w->sub->state().dirty_version, v);
    EXPECT_EQ(w->sub->state().version, 1u);
    EXPECT_NE(w->sub->state().to_string().find("dirty (v2 incomplete, last consistent v1)"), std::string::npos);
  }
  t.fill(3);
  UpdateResult r = stream(*pub_, t, shuffled(specs.size(), 3));
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  expect_holds(t, r.version);
}

// LoRA-style partial updates: only the adapters move; every other tensor
// keeps its bytes and the engines are consistent at the new version.
TEST_F(StreamedUpdateTest, PartialUpdatesKeepEveryOtherTensor) {
  std::vector<TensorSpec> specs;
  for (int l = 0; l < 4; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.q_proj.";
    specs.push_back({p + "weight", DType::kBF16, {256, 256}});
    specs.push_back({p + "lora_A.weight", DType::kBF16, {8, 256}});
    specs.push_back({p + "lora_B.weight", DType::kBF16, {256, 8}});
  }
  start(test::test_config(2), 2, specs, [](int i) { return i == 1; });
  HostTensors all = test::make_tensors(specs);
  publish_and_check(all, 1);
  std::vector<TensorSpec> lora_specs;
  for (const auto& s : specs)
    if (s.name.find(".lora_") != std::string::npos) lora_specs.push_back(s);
  HostTensors lora = test::make_tensors(lora_specs);

  // Without `partial`, a subset is a mismatch naming what is missing.
  UpdateResult refused = pub_->weight_update(lora.views());
  EXPECT_EQ(refused.status.code(), Code::kRejected);
  EXPECT_NE(refused.status.message().find("'model.layers.0.self_attn.q_proj.weight': registered by the subscriber but "
                                          "missing from the update"),
            std::string::npos)
      << refused.status.to_string();

  UpdateOptions partial;
  partial.partial = true;
  for (uint64_t round = 0; round < 2; ++round) {
    lora.fill(10 + round);
    UpdateResult r = round == 0 ? pub_->weight_update(lora.views(), partial)
                                : stream(*pub_, lora, shuffled(lora_specs.size(), 7), partial);
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_EQ(r.bytes, 4u * 2 * 8 * 256 * 2);
    for (auto& w : workers_) {
      EXPECT_EQ(w->sub->state().kind, WeightStateKind::kConsistent);
      EXPECT_EQ(w->sub->state().version, r.version);
      std::lock_guard<std::mutex> lock(w->mu);  // the callback writes under it
      for (size_t i = 0; i < specs.size(); ++i) {
        const auto& name = specs[i].name;
        auto at = std::find_if(lora_specs.begin(), lora_specs.end(), [&](const TensorSpec& s) { return s.name == name; });
        const auto& want = at == lora_specs.end() ? all.bytes[i] : lora.bytes[static_cast<size_t>(at - lora_specs.begin())];
        if (w->callback && at == lora_specs.end()) continue;  // a callback engine sees only what moved
        EXPECT_TRUE(w->bytes(name) == want) << name << " in " << (w->callback ? "callback" : "registered") << " worker";
      }
    }
  }
  // A partial plan still refuses a name an engine does not have.
  std::vector<TensorSpec> unknown = {{"model.layers.9.mlp.lora_A.weight", DType::kBF16, {8, 256}}};
  HostTensors u = test::make_tensors(unknown);
  UpdateResult r = pub_->weight_update(u.views(), partial);
  EXPECT_EQ(r.status.code(), Code::kRejected);
  EXPECT_NE(r.status.message().find("'model.layers.9.mlp.lora_A.weight': in the update but not registered"),
            std::string::npos)
      << r.status.to_string();
}

// An Update may be finished on another thread than the one that began it
// (a handle handed to a worker, a Python handle dropped anywhere); a call on
// the thread that holds a stream open fails at once instead of waiting for
// it forever.
TEST_F(StreamedUpdateTest, FinishedOnAnotherThreadAndNoSelfDeadlock) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {5000}}, {"b", DType::kBF16, {300}}};
  start(test::test_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  auto u = pub_->begin_update(t.specs);
  ASSERT_TRUE(u->status().ok()) << u->status().to_string();
  UpdateResult inside = pub_->weight_update(t.views());
  EXPECT_EQ(inside.status.code(), Code::kInvalidArgument) << inside.status.to_string();
  EXPECT_NE(inside.status.message().find("a streamed update is open on this thread"), std::string::npos);
  EXPECT_EQ(pub_->begin_update(t.specs)->status().code(), Code::kInvalidArgument);
  for (size_t i = 0; i < specs.size(); ++i) ASSERT_TRUE(u->send(t.views()[i]).ok());
  UpdateResult r;
  std::thread other([&] { r = u->finish(); });
  other.join();
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  expect_holds(t, r.version);
  // The update lock was released by the other thread: this one updates again.
  publish_and_check(t, r.version + 1);
}

}  // namespace
}  // namespace paramcast
