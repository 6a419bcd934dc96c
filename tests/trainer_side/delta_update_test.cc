// Delta updates end to end, tier 1: one Publisher and several Subscribers in
// this process on real ZeroMQ sockets and Gloo TCP pairs; engines with
// registered buffers apply deltas in place, callback engines onto their own
// copy of the last version. Every update is checked bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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
using DeltaUpdateTest = WeightUpdateTest;

// Changes about `fraction` of every tensor's 2-byte units (bf16 elements).
void change(HostTensors& t, double fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> coin(0, 1);
  for (auto& b : t.bytes)
    for (size_t i = 0; i + 1 < b.size(); i += 2)
      if (coin(rng) < fraction) b[i] ^= static_cast<uint8_t>(1 + rng() % 255);
}

Config delta_config(int n) {
  Config cfg = test::test_config(n);
  cfg.subscriber.delta_baseline = true;  // the callback engines keep a copy
  return cfg;
}

TEST_F(DeltaUpdateTest, DeltasAreBitExactInBothModesAndAFractionOfTheBytes) {
  auto specs = synthetic_llm_layout(8 << 20, 8, DType::kBF16);
  start(delta_config(4), 4, specs, [](int i) { return i % 2 == 1; });
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_EQ(r.dense_because, "no baseline yet");
  EXPECT_GE(r.wire_bytes, r.bytes);  // dense: every byte, and the packing's alignment gaps
  EXPECT_LT(r.wire_bytes, r.bytes + r.bytes / 100);
  expect_holds(t, 1);
  for (uint64_t v = 2; v <= 6; ++v) {
    change(t, 0.03, static_cast<uint32_t>(v));
    r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_TRUE(r.delta) << "v" << v << ": " << r.dense_because;
    EXPECT_TRUE(r.dense_because.empty()) << r.dense_because;
    EXPECT_LT(r.wire_bytes, r.bytes / 10) << "v" << v << ": " << r.wire_bytes << " wire bytes of " << r.bytes;
    expect_holds(t, v);
  }
  // Nothing changed: a delta that moves nothing (every bucket unchanged).
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_TRUE(r.delta) << r.dense_because;
  EXPECT_EQ(r.wire_bytes, 0u);
  expect_holds(t, 7);
  // Everything changed: every bucket goes dense by itself, still right.
  change(t, 1.0, 99);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_GE(r.wire_bytes, r.bytes);
  expect_holds(t, 8);
  EXPECT_GE(pub_->stats().baseline_bytes, r.bytes);
  EXPECT_EQ(pub_->stats().baseline_version, 8u);
}

// Bit patterns, not values: 0.0 -> -0.0 and one NaN payload to another are
// changes, and arrive as such.
TEST_F(DeltaUpdateTest, SignedZerosAndNanPayloadsAreChanges) {
  std::vector<TensorSpec> specs = {{"w", DType::kF32, {4096}}, {"h", DType::kBF16, {4096}}};
  start(delta_config(2), 2, specs, [](int i) { return i == 1; });
  HostTensors t = test::make_tensors(specs);
  auto* w = reinterpret_cast<float*>(t.bytes[0].data());
  for (int i = 0; i < 4096; ++i) w[i] = 0.0f;
  w[10] = std::nanf("1");
  std::memset(t.bytes[1].data(), 0, t.bytes[1].size());
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  w[3] = -0.0f;          // equal as a value
  w[10] = std::nanf("2");  // NaN either way
  t.bytes[1][100] = 0x00;
  t.bytes[1][101] = 0x80;  // bf16 -0.0
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_TRUE(r.delta);
  EXPECT_GT(r.wire_bytes, 0u);
  expect_holds(t, r.version);
}

TEST_F(DeltaUpdateTest, ACallbackEngineWithoutACopyMakesItDenseAndSaysWho) {
  std::vector<TensorSpec> specs = {{"a", DType::kBF16, {100000}}, {"b", DType::kBF16, {3000}}};
  start(test::test_config(2), 2, specs, [](int i) { return i == 1; });  // no delta_baseline
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  change(t, 0.01, 2);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_NE(r.dense_because.find("worker-2 cannot apply deltas"), std::string::npos) << r.dense_because;
  expect_holds(t, 2);
}

// A member that is not at the baseline (dirty, or new) makes one update
// dense for the group, with `always` too; the next is a delta again.
TEST_F(DeltaUpdateTest, DirtyOrRejoinedMemberGetsADenseUpdateThenDeltas) {
  auto specs = synthetic_llm_layout(2 << 20, 4, DType::kBF16);
  Config cfg = delta_config(3);
  cfg.publisher.delta = DeltaMode::kAlways;
  end_status_ = [](int worker, uint64_t v) {
    return worker == 2 && v == 3 ? internal_error("engine hook failed") : Status();
  };
  start(cfg, 3, specs, [](int i) { return i == 0; });
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  change(t, 0.02, 2);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok() && r.delta) << r.status.to_string() << r.dense_because;
  change(t, 0.02, 3);
  r = pub_->weight_update(t.views());  // worker-3's hook fails: it stays dirty
  ASSERT_FALSE(r.ok());
  change(t, 0.02, 4);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_EQ(r.dense_because, "no baseline yet") << "a failed update leaves no baseline";
  expect_holds(t, r.version);
  change(t, 0.02, 5);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok() && r.delta) << r.status.to_string() << r.dense_because;
  expect_holds(t, r.version);

  // worker-2 restarts (a fresh process would hold nothing): dense for all, then deltas.
  workers_[1]->sub->stop();
  Config at = cfg;
  at.control.endpoint = pub_->endpoint();
  auto again = Subscriber::create(at, "worker-2");
  ASSERT_TRUE(again.ok());
  workers_[1]->sub = std::move(again.value());
  for (const auto& spec : specs) {
    auto& buf = workers_[1]->dest[spec.name];
    std::fill(buf.begin(), buf.end(), 0);
    ASSERT_TRUE(workers_[1]->sub->register_tensor(TensorView{spec, buf.data(), Device::cpu()}).ok());
  }
  ASSERT_TRUE(workers_[1]->sub->start().ok());
  change(t, 0.02, 6);
  for (int i = 0; i < 100 && !workers_[1]->sub->joined(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_EQ(r.dense_because, "worker-2 at v0");
  expect_holds(t, r.version);
  change(t, 0.02, 7);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok() && r.delta) << r.status.to_string() << r.dense_because;
  expect_holds(t, r.version);
}

// A member that holds the baseline but cannot take a delta right now (a
// buffer registered since the last update does not hold it) refuses only the
// delta: the update goes dense at once, says who, and is bit-exact; the
// baseline kept its version through the refused plan, so the next update is
// a delta again.
TEST_F(DeltaUpdateTest, AMemberThatCannotTakeTheDeltaNowGetsTheSameUpdateDense) {
  auto specs = synthetic_llm_layout(2 << 20, 4, DType::kBF16);
  Config cfg = delta_config(2);
  // Every plan waits for its answers, so the refusal is an answer whether or
  // not worker-1's heartbeat already said it cannot take a delta.
  cfg.publisher.reuse_validated_plan = false;
  start(cfg, 2, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  // worker-1 gets a fresh buffer for one tensor: it no longer holds v1 there.
  auto& buf = workers_[0]->dest[specs[0].name];
  std::fill(buf.begin(), buf.end(), 0);
  ASSERT_TRUE(workers_[0]->sub->register_tensor(TensorView{specs[0], buf.data(), Device::cpu()}).ok());
  change(t, 0.02, 2);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  EXPECT_NE(r.dense_because.find("worker-1"), std::string::npos) << r.dense_because;
  EXPECT_EQ(r.dense_because.find("worker-2"), std::string::npos) << r.dense_because;
  expect_holds(t, r.version);
  change(t, 0.02, 3);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok() && r.delta) << r.status.to_string() << r.dense_because;
  expect_holds(t, r.version);
}

// A plan every member refuses moves no byte: the baseline keeps its
// version, and the next good update is a delta.
TEST_F(DeltaUpdateTest, ARefusedPlanKeepsTheBaseline) {
  std::vector<TensorSpec> specs = {{"a", DType::kBF16, {100000}}, {"b", DType::kBF16, {3000}}};
  start(delta_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  HostTensors stranger = test::make_tensors({{"a", DType::kBF16, {100000}}, {"c", DType::kBF16, {3000}}});
  stranger.fill(2);
  UpdateResult refused = pub_->weight_update(stranger.views());
  ASSERT_EQ(refused.status.code(), Code::kRejected) << refused.status.to_string();
  change(t, 0.02, 3);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_TRUE(r.delta) << r.dense_because;
  expect_holds(t, r.version);
}

TEST_F(DeltaUpdateTest, CorruptedDeltaFailsDataCorruptNamingTheTensor) {
  std::vector<TensorSpec> specs = {{"layer.0.w", DType::kBF16, {200000}}, {"layer.1.w", DType::kBF16, {200000}}};
  // worker-2 flips one received bit of bucket 1 of v2 (a delta): fault
  // injection on the real transport, read when it is created.
  setenv("PARAMCAST_FAULT_CORRUPT_BUCKET", "2:1", 1);
  start(delta_config(2), 2, specs);
  unsetenv("PARAMCAST_FAULT_CORRUPT_BUCKET");
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  change(t, 0.01, 2);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kDataCorrupt) << r.status.to_string();
  EXPECT_NE(r.status.message().find("worker-2"), std::string::npos) << r.status.message();
  EXPECT_NE(r.status.message().find("tensor 'layer.1.w'"), std::string::npos) << r.status.message();
  EXPECT_EQ(workers_[1]->sub->state().kind, WeightStateKind::kDirty);
  // The next update is dense (no baseline after a failure) and heals it.
  change(t, 0.01, 3);
  r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  expect_holds(t, r.version);
}

// A streamed update (tensors handed over one at a time, in any order, each
// overwritten once sent) keeps the baseline and goes as a delta too, large
// tensors' chunks included.
TEST_F(DeltaUpdateTest, StreamedUpdatesGoAsDeltasInAnyOrder) {
  auto specs = synthetic_llm_layout(4 << 20, 4, DType::kBF16);
  start(delta_config(3), 3, specs, [](int i) { return i == 1; });
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  auto stream = [&](uint32_t seed) {
    auto u = pub_->begin_update(t.specs);
    EXPECT_TRUE(u->ok()) << u->status().to_string();
    std::vector<size_t> order(specs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    std::vector<uint8_t> scratch;
    for (size_t i : order) {
      scratch = t.bytes[i];
      EXPECT_TRUE(u->send(TensorView{t.specs[i], scratch.data(), Device::cpu()}).ok());
      std::fill(scratch.begin(), scratch.end(), 0xA5);
    }
    return u->finish();
  };
  UpdateResult r = stream(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_FALSE(r.delta);
  expect_holds(t, 1);
  for (uint32_t v = 2; v <= 4; ++v) {
    change(t, 0.03, v);
    r = v == 3 ? pub_->weight_update(t.views()) : stream(v);  // both kinds keep the one baseline
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_TRUE(r.delta) << r.dense_because;
    EXPECT_LT(r.wire_bytes, r.bytes / 5);
    expect_holds(t, v);
  }
}

// An empty tensor may be registered without a buffer (torch.empty(0)):
// deltas still apply and verify around it.
TEST_F(DeltaUpdateTest, EmptyTensorWithoutABufferDoesNotStopDeltas) {
  std::vector<TensorSpec> specs = {{"w", DType::kBF16, {50000}}, {"empty", DType::kF32, {0}}};
  start(delta_config(1), 1, specs);
  ASSERT_TRUE(workers_[0]->sub->register_tensor(TensorView{specs[1], nullptr, Device::cpu()}).ok());
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());
  for (uint32_t v = 2; v <= 3; ++v) {
    change(t, 0.01, v);
    UpdateResult r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_TRUE(r.delta) << r.dense_because;
    EXPECT_EQ(workers_[0]->sub->state().version, r.version);  // (also orders this read after the engine's writes)
    EXPECT_TRUE(workers_[0]->bytes("w") == t.bytes[0]);
  }
}

TEST_F(DeltaUpdateTest, OffKeepsNoBaselineAndSendsEveryByte) {
  std::vector<TensorSpec> specs = {{"a", DType::kBF16, {100000}}};
  Config cfg = delta_config(1);
  cfg.publisher.delta = DeltaMode::kOff;
  start(cfg, 1, specs);
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 2; ++v) {
    change(t, 0.01, static_cast<uint32_t>(v));
    UpdateResult r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r.delta);
    EXPECT_TRUE(r.dense_because.empty());
    EXPECT_EQ(r.wire_bytes, r.bytes);  // one direct tensor: no packing gaps
  }
  EXPECT_EQ(pub_->stats().baseline_bytes, 0u);
}

}  // namespace
}  // namespace paramcast
