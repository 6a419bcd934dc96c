// weight_update end to end, tier 1: one Publisher and several Subscribers in
// this process, on real ZeroMQ sockets and real Gloo TCP pairs.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "common/synthetic_model.h"
#include "tests/support/cluster.h"
#include "tests/support/update_fixture.h"

namespace paramcast {
namespace {

using test::HostTensors;
using test::WeightUpdateTest;
using test::Worker;

TEST_F(WeightUpdateTest, SeveralVersionsBitExactInBothModes) {
  auto specs = synthetic_llm_layout(4 << 20, 32, DType::kBF16);
  ASSERT_EQ(specs.size(), 291u);
  start(test::test_config(7), 7, specs, [](int i) { return i % 2 == 1; });
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 3; ++v) {
    t.fill(v);
    UpdateResult r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_EQ(r.version, v);
    EXPECT_EQ(r.tensors, 291u);
    EXPECT_EQ(r.subscribers.size(), 7u);
    for (auto& o : r.subscribers) EXPECT_TRUE(o.status.ok()) << o.worker_id << ": " << o.status.to_string();
    expect_holds(t, v);
  }
  for (auto& w : workers_) {
    EXPECT_EQ(w->begun, (std::vector<uint64_t>{1, 2, 3}));
    EXPECT_EQ(w->ended, (std::vector<uint64_t>{1, 2, 3}));
  }
  EXPECT_EQ(pub_->stats().published_version, 3u);
  // Staging stays within two buckets on the publisher.
  EXPECT_LE(pub_->stats().staging_peak_bytes, 2 * test::test_config(7).data_plane.bucket_bytes);
}

// The engine's post-processing is part of the update: Applied follows the
// on_update_end hook, and a failing hook fails the update naming the worker.
TEST_F(WeightUpdateTest, EndHookRunsBeforeAppliedAndItsFailureFailsTheUpdate) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {64}}, {"b", DType::kBF16, {300000}}};
  std::atomic<int> slow_hooks_done{0};
  end_status_ = [&](int worker, uint64_t v) {
    if (v == 1) {
      // A slow post-processing step (fusing, resharding): the trainer must wait for it.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ++slow_hooks_done;
    }
    if (v == 2 && worker == 1) return internal_error("fused qkv shape check failed");
    return Status();
  };
  start(test::test_config(3), 3, specs, [](int i) { return i == 2; });
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  UpdateResult r1 = pub_->weight_update(t.views());
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  EXPECT_EQ(slow_hooks_done.load(), 3) << "weight_update returned before every engine finished post-processing";
  // The result says where the time went: the 300 ms hooks after the data
  // plane, not in it (its rate is what ParamCast moved the bytes at).
  EXPECT_GE(r1.apply_seconds, 0.3) << r1.apply_seconds;
  EXPECT_GT(r1.data_seconds, 0.0);
  EXPECT_LE(r1.data_seconds + r1.apply_seconds, r1.seconds + 1e-6);
  EXPECT_FALSE(r1.last_to_apply.empty());
  EXPECT_GT(r1.data_gbps(), r1.gbps());

  t.fill(2);
  UpdateResult r2 = pub_->weight_update(t.views());
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status.code(), Code::kInternal) << r2.status.to_string();
  EXPECT_NE(r2.status.message().find("subscriber 'worker-2': on_update_end hook: fused qkv shape check failed"),
            std::string::npos)
      << r2.status.message();
  for (const auto& o : r2.subscribers) EXPECT_EQ(o.status.ok(), o.worker_id != "worker-2") << o.worker_id;
  // The engine could not finish v2: its state says so, and so does its own report.
  EXPECT_EQ(workers_[1]->sub->state().kind, WeightStateKind::kDirty);
  EXPECT_EQ(workers_[1]->sub->state().dirty_version, 2u);
  EXPECT_EQ(workers_[0]->sub->state().version, 2u);
  // The next update re-forms the group and succeeds everywhere.
  t.fill(3);
  UpdateResult r3 = pub_->weight_update(t.views());
  ASSERT_TRUE(r3.ok()) << r3.status.to_string();
  expect_holds(t, 3);
}

class TensorCountTest : public WeightUpdateTest, public ::testing::WithParamInterface<int> {};

TEST_P(TensorCountTest, ManySmallTensors) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < GetParam(); ++i)
    specs.push_back({"t." + std::to_string(i), DType::kF32, {static_cast<int64_t>(1 + (i * 37) % 200)}});
  start(test::test_config(3), 3, specs, [](int i) { return i == 2; });
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 2; ++v) ASSERT_NO_FATAL_FAILURE(publish_and_check(t, v));
}
INSTANTIATE_TEST_SUITE_P(Counts, TensorCountTest, ::testing::Values(1, 291, 10000));

// The report each worker gives of version `v`, skipping those of earlier
// versions; nullopt if none comes within `within`.
std::optional<UpdateReport> report_of(Subscriber& sub, uint64_t v, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  for (auto now = std::chrono::steady_clock::now(); now < until; now = std::chrono::steady_clock::now()) {
    auto r = sub.next_report(std::chrono::duration_cast<std::chrono::milliseconds>(until - now));
    if (r && r->version == v) return r;
  }
  return std::nullopt;
}

// An update that ends before its plan reaches the engines (refused on the
// publisher, or a group that does not form) tells every live engine that
// its version will not come: an engine waiting for it (a vLLM worker inside
// its round) stops now, naming the reason, instead of at its timeout.
TEST_F(WeightUpdateTest, AnUpdateThatEndsBeforeItsPlanEndsOnEveryEngineAtOnce) {
  auto specs = synthetic_llm_layout(1 << 20, 2, DType::kBF16);
  Config cfg = test::test_config(2);
  ASSERT_EQ(cfg.publisher.on_member_loss, MemberLossPolicy::kFail);
  start(cfg, 2, specs, [](int i) { return i == 1; });
  HostTensors t = test::make_tensors(specs);
  publish_and_check(t, 1);
  const auto one_d = std::find_if(specs.begin(), specs.end(), [](const TensorSpec& s) { return s.shape.size() == 1; });
  ASSERT_NE(one_d, specs.end());
  // Refused before its plan: fp8 takes 2-D tensors only. Version 5 is the
  // caller's; it was never reserved, and the engines hear of it.
  UpdateOptions fp8_on_a_vector;
  fp8_on_a_vector.version = 5;
  transform::Rule rule;
  rule.match = one_d->name;
  rule.fp8 = transform::Fp8Scaling::kBlock;
  fp8_on_a_vector.transforms = std::vector<transform::Rule>{rule};
  t.fill(5);
  UpdateResult refused = pub_->weight_update(t.views(), fp8_on_a_vector);
  ASSERT_FALSE(refused.ok());
  for (auto& w : workers_) {
    auto report = report_of(*w->sub, 5, std::chrono::seconds(10));
    ASSERT_TRUE(report.has_value()) << "an engine never heard that v5 will not come";
    EXPECT_FALSE(report->status.ok());
    EXPECT_NE(report->status.message().find("before any byte reached this engine"), std::string::npos)
        << report->status.to_string();
    EXPECT_NE(report->status.message().find(one_d->name), std::string::npos) << report->status.to_string();
    EXPECT_EQ(w->sub->state().version, 1u) << "nothing of v5 was applied";
  }
  // A streamed update refused the same way.
  auto stream = pub_->begin_update(t.specs, fp8_on_a_vector);
  ASSERT_FALSE(stream->ok());
  EXPECT_FALSE(stream->finish().ok());
  for (auto& w : workers_) {
    auto report = report_of(*w->sub, 5, std::chrono::seconds(10));
    ASSERT_TRUE(report.has_value()) << "an engine never heard that the streamed v5 will not come";
    EXPECT_NE(report->status.message().find(one_d->name), std::string::npos) << report->status.to_string();
  }
  // A group that does not form (on_member_loss: fail, worker-2 gone): the
  // engine still there hears of version 2's end with the reason.
  workers_[1]->sub->stop();
  // The leave must have reached the publisher: an update that starts before
  // it plans with worker-2 and fails mid-bucket instead (a different case).
  for (int i = 0; i < 200 && pub_->stats().live_members != 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(pub_->stats().live_members, 1) << "the publisher never saw worker-2 leave";
  t.fill(2);
  UpdateResult no_group = pub_->weight_update(t.views());
  ASSERT_FALSE(no_group.ok());
  EXPECT_EQ(no_group.version, 2u);
  auto report = report_of(*workers_[0]->sub, 2, std::chrono::seconds(10));
  ASSERT_TRUE(report.has_value()) << "worker-1 never heard that v2 will not come";
  EXPECT_NE(report->status.message().find("worker-2"), std::string::npos) << report->status.to_string();
  EXPECT_EQ(workers_[0]->sub->state().version, 1u);
  EXPECT_EQ(workers_[0]->sub->state().kind, WeightStateKind::kConsistent);
}

TEST_F(WeightUpdateTest, EdgeSizesAndEveryDType) {
  std::vector<TensorSpec> specs;
  int i = 0;
  for (DType d : all_dtypes()) {
    const std::string n = std::string(dtype_name(d)) + ".";
    specs.push_back({n + "empty", d, {0, 5}});
    specs.push_back({n + "scalar", d, {}});
    specs.push_back({n + "odd", d, {3, 5, 7 + i++}});
  }
  specs.push_back({"one_byte", DType::kU8, {1}});
  specs.push_back({"odd_large", DType::kU8, {4097 * 33}});          // direct, odd length
  specs.push_back({"larger_than_bucket", DType::kBF16, {1300000}});  // 2.5 MiB > 1 MiB bucket
  start(test::test_config(3), 3, specs, [](int i) { return i == 1; });
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 2; ++v) ASSERT_NO_FATAL_FAILURE(publish_and_check(t, v));
  // The callback saw each tensor's name, dtype and shape as published.
  Worker& cb = *workers_[1];
  for (const auto& s : specs) {
    ASSERT_TRUE(cb.seen_meta.count(s.name)) << s.name;
    EXPECT_EQ(cb.seen_meta[s.name].first, s.dtype) << s.name;
    EXPECT_EQ(cb.seen_meta[s.name].second, s.shape) << s.name;
  }
}

TEST_F(WeightUpdateTest, RejectedPlanReportsEveryMismatchAndMovesNoByte) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {4, 4}},
                                   {"b", DType::kBF16, {8}},
                                   {"c", DType::kF32, {300000}},
                                   {"d", DType::kI32, {2}}};
  start(test::test_config(3), 3, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub_->weight_update(t.views()).ok());

  // The trainer now publishes a different layout than the engines registered.
  std::vector<TensorSpec> wrong = {{"a", DType::kF32, {4, 5}},   // shape
                                   {"b", DType::kF16, {8}},      // dtype
                                   {"c", DType::kF32, {300000}},
                                   {"e", DType::kI32, {2}}};     // unexpected; "d" missing
  HostTensors w = test::make_tensors(wrong);
  w.fill(2);
  UpdateResult r = pub_->weight_update(w.views());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kRejected);
  EXPECT_NE(r.status.message().find("abandoned before any byte moved"), std::string::npos) << r.status.message();
  ASSERT_EQ(r.subscribers.size(), 3u);
  const std::vector<Mismatch> expected = {
      {Mismatch::Kind::kShape, "a", "[4, 4]", "[4, 5]"},
      {Mismatch::Kind::kDType, "b", "BF16", "F16"},
      {Mismatch::Kind::kUnexpectedName, "e", "no such tensor", "a tensor of shape [2]"},
      {Mismatch::Kind::kMissingName, "d", "a tensor of shape [2]", "absent"},
  };
  for (auto& o : r.subscribers) {
    EXPECT_EQ(o.status.code(), Code::kRejected) << o.worker_id;
    EXPECT_EQ(o.mismatches, expected) << o.worker_id;
  }
  EXPECT_NE(r.status.message().find("'a': shape expected [4, 4], got [4, 5]"), std::string::npos);
  // No byte moved: every destination still holds version 1, and says so.
  expect_holds(t, 1);

  // The group is intact: a matching update goes through.
  t.fill(3);
  UpdateResult ok = pub_->weight_update(t.views());
  ASSERT_TRUE(ok.ok()) << ok.status.to_string();
  EXPECT_EQ(ok.version, 3u);  // version 2 was consumed by the rejected attempt
  expect_holds(t, 3);
}

TEST_F(WeightUpdateTest, UnchangedManifestSkipsTheAcceptRoundAndStillRefusesAMismatch) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {4, 4}}, {"big", DType::kF32, {400000}}, {"c", DType::kI32, {3}}};
  start(test::test_config(3), 3, specs, [](int i) { return i == 2; });
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  UpdateResult r1 = pub_->weight_update(t.views());
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  EXPECT_FALSE(r1.precommitted) << "the first plan of a group is always checked in a round trip";
  t.fill(2);
  UpdateResult r2 = pub_->weight_update(t.views());
  ASSERT_TRUE(r2.ok()) << r2.status.to_string();
  EXPECT_TRUE(r2.precommitted) << "every member accepted this manifest in this epoch";
  expect_holds(t, 2);

  // worker-2's engine changes its mind about "a" between two updates: the
  // next precommitted plan no longer fits it.
  Worker& w2 = *workers_[1];
  std::vector<uint8_t> wider(4 * 5 * 4, 0xEE);
  ASSERT_TRUE(w2.sub->register_tensor(TensorView{{"a", DType::kF32, {4, 5}}, wider.data(), Device::cpu()}).ok());
  const std::vector<uint8_t> big_before = w2.dest["big"], c_before = w2.dest["c"];
  t.fill(3);
  UpdateResult r3 = pub_->weight_update(t.views());
  EXPECT_TRUE(r3.precommitted);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status.code(), Code::kRejected) << r3.status.to_string();
  ASSERT_EQ(r3.subscribers.size(), 3u);
  for (const auto& o : r3.subscribers) {
    if (o.worker_id != "worker-2") {
      EXPECT_TRUE(o.status.ok()) << o.worker_id << ": " << o.status.to_string();
      continue;
    }
    EXPECT_EQ(o.status.code(), Code::kRejected);
    EXPECT_NE(o.status.message().find("received and dropped, no tensor was written"), std::string::npos)
        << o.status.message();
    EXPECT_EQ(o.mismatches, (std::vector<Mismatch>{{Mismatch::Kind::kShape, "a", "[4, 5]", "[4, 4]"}}));
  }
  // worker-2 wrote nothing, ran no hook and still holds v2; the others hold v3.
  EXPECT_TRUE(std::all_of(wider.begin(), wider.end(), [](uint8_t b) { return b == 0xEE; }));
  EXPECT_EQ(w2.dest["big"], big_before);
  EXPECT_EQ(w2.dest["c"], c_before);
  EXPECT_EQ(w2.sub->state().kind, WeightStateKind::kConsistent);
  EXPECT_EQ(w2.sub->state().version, 2u);
  EXPECT_EQ(w2.begun, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(w2.ended, (std::vector<uint64_t>{1, 2}));
  for (int i : {0, 2}) {
    EXPECT_EQ(workers_[i]->sub->state().version, 3u);
    for (size_t k = 0; k < t.specs.size(); ++k) EXPECT_TRUE(workers_[i]->bytes(t.specs[k].name) == t.bytes[k]);
  }

  // A failure forgets the validated manifest: the next plan is checked in a
  // round trip again and refused before any byte moves.
  t.fill(4);
  UpdateResult r4 = pub_->weight_update(t.views());
  EXPECT_FALSE(r4.precommitted);
  ASSERT_FALSE(r4.ok());
  EXPECT_NE(r4.status.message().find("abandoned before any byte moved"), std::string::npos) << r4.status.message();

  // The engine takes "a" back as it was: updates flow again, then precommitted.
  ASSERT_TRUE(w2.sub->register_tensor(TensorView{specs[0], w2.dest["a"].data(), Device::cpu()}).ok());
  t.fill(5);
  UpdateResult r5 = pub_->weight_update(t.views());
  ASSERT_TRUE(r5.ok()) << r5.status.to_string();
  EXPECT_FALSE(r5.precommitted);
  t.fill(6);
  UpdateResult r6 = pub_->weight_update(t.views());
  ASSERT_TRUE(r6.ok()) << r6.status.to_string();
  EXPECT_TRUE(r6.precommitted);
  expect_holds(t, 6);
}

TEST_F(WeightUpdateTest, ReuseOfValidatedPlansCanBeTurnedOff) {
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {16}}};
  Config cfg = test::test_config(2);
  cfg.publisher.reuse_validated_plan = false;
  start(cfg, 2, specs);
  HostTensors t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 3; ++v) {
    t.fill(v);
    UpdateResult r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_FALSE(r.precommitted) << "v" << v;
  }
  expect_holds(t, 3);
}

TEST_F(WeightUpdateTest, CorruptedBucketFailsNamingBucketAndTensors) {
  std::vector<TensorSpec> specs = {{"small.a", DType::kF32, {100}}, {"small.b", DType::kF32, {100}},
                                   {"big", DType::kU8, {200000}}};
  // worker-2 flips one received bit of bucket 1 (the packed one) once: fault injection on the
  // real transport, switched on by the environment when it is created.
  Config cfg = test::test_config(3);
  auto p = Publisher::create(cfg);
  ASSERT_TRUE(p.ok());
  pub_ = std::move(p.value());
  cfg.control.endpoint = pub_->endpoint();
  for (int i = 0; i < 3; ++i) {
    if (i == 1) setenv("PARAMCAST_FAULT_CORRUPT_BUCKET", "1", 1);
    auto w = std::make_unique<Worker>();
    w->sub = std::move(Subscriber::create(cfg, "worker-" + std::to_string(i + 1)).value());
    unsetenv("PARAMCAST_FAULT_CORRUPT_BUCKET");
    for (const auto& s : specs) {
      auto& buf = w->dest[s.name];
      buf.assign(s.nbytes().value(), 0);
      ASSERT_TRUE(w->sub->register_tensor(TensorView{s, buf.data(), Device::cpu()}).ok());
    }
    ASSERT_TRUE(w->sub->start().ok());
    workers_.push_back(std::move(w));
  }
  ASSERT_TRUE(pub_->start().ok());
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kDataCorrupt) << r.status.to_string();
  EXPECT_NE(r.status.message().find("worker-2"), std::string::npos) << r.status.message();
  EXPECT_NE(r.status.message().find("checksum mismatch in bucket 1 of v1 (tensors small.a, small.b)"),
            std::string::npos)
      << r.status.message();
  EXPECT_NE(r.status.message().find("nothing was unpacked"), std::string::npos);
  EXPECT_EQ(workers_[1]->sub->state().kind, WeightStateKind::kDirty);
  EXPECT_EQ(workers_[1]->sub->state().dirty_version, 1u);
  // The corrupted packed bucket never reached worker-2's destinations.
  EXPECT_EQ(workers_[1]->dest["small.a"], std::vector<uint8_t>(400, 0));

  // The fault was one-shot: the next update re-forms the group and succeeds.
  t.fill(2);
  UpdateResult again = pub_->weight_update(t.views());
  ASSERT_TRUE(again.ok()) << again.status.to_string();
  EXPECT_GT(again.epoch, r.epoch);
  expect_holds(t, 2);
}

TEST_F(WeightUpdateTest, VersionsIncreaseAndAsyncUpdates) {
  std::vector<TensorSpec> specs = {{"w", DType::kF32, {1000}}};
  start(test::test_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(10);
  auto r = pub_->weight_update(t.views(), 10);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.version, 10u);
  auto stale = pub_->weight_update(t.views(), 10);
  EXPECT_EQ(stale.status.code(), Code::kInvalidArgument);
  EXPECT_NE(stale.status.message().find("does not exceed the last version 10"), std::string::npos);
  t.fill(11);
  auto fut = pub_->weight_update_async(t.views());  // assigned the next version
  UpdateResult a = fut.get();
  ASSERT_TRUE(a.ok()) << a.status.to_string();
  EXPECT_EQ(a.version, 11u);  // the refused call consumed no version
  expect_holds(t, 11);
}

TEST_F(WeightUpdateTest, BadTensorViewsAreRefusedBeforeAnythingIsSent) {
  std::vector<TensorSpec> specs = {{"w", DType::kF32, {4}}};
  start(test::test_config(1), 1, specs);
  std::vector<float> data(4);
  auto r = pub_->weight_update({TensorView{{"w", DType::kF32, {4}}, nullptr, Device::cpu()}});
  EXPECT_EQ(r.status.code(), Code::kInvalidArgument);
  EXPECT_NE(r.status.message().find("'w' has no data pointer"), std::string::npos);
  auto dup = pub_->weight_update({TensorView{specs[0], data.data(), Device::cpu()},
                                  TensorView{specs[0], data.data(), Device::cpu()}});
  EXPECT_NE(dup.status.message().find("'w' appears twice"), std::string::npos);
  auto dev = pub_->weight_update({TensorView{specs[0], data.data(), Device::cuda(0)}});
  EXPECT_NE(dev.status.message().find("is on cuda:0 but publisher.device is cpu"), std::string::npos);
  // More tensors than one update may name: refused here, not planned and
  // then refused by every engine.
  std::vector<TensorView> many;
  for (size_t i = 0; i <= kMaxPlanTensors; ++i) {
    std::string name = "t";  // appended: GCC 12 reports a false -Wrestrict for "t" + std::to_string(i) here
    name += std::to_string(i);
    many.push_back(TensorView{{name, DType::kF32, {1}}, data.data(), Device::cpu()});
  }
  auto big = pub_->weight_update(many);
  EXPECT_EQ(big.status.code(), Code::kInvalidArgument);
  EXPECT_NE(big.status.message().find("an update of 262145 tensors: more than the 262144 one update may name"),
            std::string::npos)
      << big.status.to_string();
  EXPECT_EQ(workers_[0]->sub->state().kind, WeightStateKind::kEmpty);
}

// Trainer tensors in one flat buffer and engine weights in one arena, back to
// back in plan order (sizes are multiples of 256 bytes, as weight shapes
// usually make them): packed buckets move in place, with no staging and no
// pack or unpack copy on either side.
TEST_F(WeightUpdateTest, ArenaLayoutsMoveInPlaceWithoutStaging) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 500; ++i) specs.push_back({"p." + std::to_string(i), DType::kBF16, {1 + i % 50, 128}});
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  for (const auto& s : specs) {
    offsets.push_back(total);
    total = (total + s.nbytes().value() + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
  }
  Config cfg = test::test_config(2);
  cfg.data_plane.bucket_bytes = 64 << 10;  // several packed buckets
  cfg.publisher.delta = DeltaMode::kOff;   // a delta is encoded through staging, whatever the layout
  auto pub = Publisher::create(cfg);
  ASSERT_TRUE(pub.ok());
  pub_ = std::move(pub.value());
  cfg.control.endpoint = pub_->endpoint();
  std::vector<std::vector<uint8_t>> arenas(2, std::vector<uint8_t>(total, 0));
  for (int w = 0; w < 2; ++w) {
    auto worker = std::make_unique<Worker>();
    worker->sub = std::move(Subscriber::create(cfg, "worker-" + std::to_string(w + 1)).value());
    for (size_t i = 0; i < specs.size(); ++i)
      ASSERT_TRUE(worker->sub->register_tensor(TensorView{specs[i], arenas[w].data() + offsets[i], Device::cpu()}).ok());
    ASSERT_TRUE(worker->sub->start().ok());
    workers_.push_back(std::move(worker));
  }
  ASSERT_TRUE(pub_->start().ok());
  std::vector<uint8_t> flat(total, 0);
  std::vector<TensorView> views;
  for (size_t i = 0; i < specs.size(); ++i) views.push_back(TensorView{specs[i], flat.data() + offsets[i], Device::cpu()});
  for (uint64_t v = 1; v <= 2; ++v) {
    for (size_t i = 0; i < specs.size(); ++i)
      fill_synthetic(specs[i], 1, v, flat.data() + offsets[i], specs[i].nbytes().value());
    UpdateResult r = pub_->weight_update(views);
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    EXPECT_GT(r.buckets, 2u);
    for (int w = 0; w < 2; ++w) {
      // As an engine does: its weights are read once its subscriber says
      // they are consistent at v. That read (under the subscriber's lock)
      // orders this thread after the data thread's receive; the publisher's
      // OK alone reached this thread through sockets, which ThreadSanitizer
      // cannot see (it then reported the arena's bytes as a race, taking
      // minutes over a report on this large range: the "hang" under TSan).
      const WeightState st = workers_[w]->sub->state();
      ASSERT_EQ(st.kind, WeightStateKind::kConsistent);
      ASSERT_EQ(st.version, v);
      for (size_t i = 0; i < specs.size(); ++i)
        ASSERT_EQ(verify_synthetic(specs[i], 1, v, arenas[w].data() + offsets[i], specs[i].nbytes().value()), -1)
            << specs[i].name << " in worker-" << w + 1 << " at v" << v;
    }
  }
  EXPECT_EQ(pub_->stats().staging_peak_bytes, 0u);
  for (auto& w : workers_) EXPECT_EQ(w->sub->staging_peak_bytes(), 0u);
}

// The same tensors in separate allocations never move in place, even when an
// allocator happens to put them close together: the bytes between them are
// not the tensors' own.
TEST_F(WeightUpdateTest, SeparateAllocationsAreStaged) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 200; ++i) specs.push_back({"p." + std::to_string(i), DType::kU8, {100 + i}});
  start(test::test_config(2), 2, specs);
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  UpdateResult r = pub_->weight_update(t.views());
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  expect_holds(t, 1);
  EXPECT_GT(pub_->stats().staging_peak_bytes, 0u);
  for (auto& w : workers_) EXPECT_GT(w->sub->staging_peak_bytes(), 0u);
}

}  // namespace
}  // namespace paramcast
