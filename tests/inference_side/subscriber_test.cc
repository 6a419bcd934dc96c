// Subscriber behaviour seen from the engine's side, tier 1: a Publisher and
// Subscribers in this process on real sockets.
#include "inference_side/subscriber.h"

#include <gtest/gtest.h>

#include "common/synthetic_model.h"
#include "tests/support/cluster.h"

namespace paramcast {
namespace {

using test::HostTensors;

Config config_for(const Publisher& pub, int subscribers) {
  Config c = test::test_config(subscribers);
  c.control.endpoint = pub.endpoint();
  return c;
}

TEST(SubscriberTest, RegistrationErrorsNameTheTensor) {
  Config cfg = test::test_config(1);
  auto sub = Subscriber::create(cfg, "worker-1").value();
  std::vector<uint8_t> buf(16);
  Status null_data = sub->register_tensor(TensorView{{"w", DType::kF32, {4}}, nullptr, Device::cpu()});
  EXPECT_EQ(null_data.code(), Code::kInvalidArgument);
  EXPECT_NE(null_data.message().find("'w' has no data pointer"), std::string::npos);
  Status device = sub->register_tensor(TensorView{{"w", DType::kF32, {4}}, buf.data(), Device::cuda(1)});
  EXPECT_NE(device.message().find("'w' is on cuda:1 but worker 'worker-1' receives on cpu"), std::string::npos)
      << device.message();
  Status negative = sub->register_tensor(TensorView{{"n", DType::kF32, {-4}}, buf.data(), Device::cpu()});
  EXPECT_NE(negative.message().find("'n': dimension 0 is negative"), std::string::npos);
  EXPECT_EQ(sub->state().kind, WeightStateKind::kEmpty);
  EXPECT_FALSE(Subscriber::create(cfg, "").ok());
}

TEST(SubscriberTest, FailingCallbackFailsTheUpdateNamingTheTensor) {
  auto pub = Publisher::create(test::test_config(1)).value();
  Config cfg = config_for(*pub, 1);
  auto sub = Subscriber::create(cfg, "worker-1").value();
  sub->on_tensor([](const TensorView& v) -> Status {
    if (v.spec.name == "bad") return invalid_argument("cannot shard a " + v.spec.shape_string() + " tensor");
    return Status();
  });
  ASSERT_TRUE(sub->start().ok());
  ASSERT_TRUE(pub->start().ok());
  HostTensors t = test::make_tensors({{"good", DType::kF32, {8}}, {"bad", DType::kF32, {3, 3}}});
  t.fill(1);
  UpdateResult r = pub->weight_update(t.views());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status.message().find("tensor callback for 'bad': cannot shard a [3, 3] tensor"), std::string::npos)
      << r.status.message();
  EXPECT_EQ(sub->state().kind, WeightStateKind::kDirty);
  EXPECT_EQ(sub->state().to_string(), "dirty (v1 incomplete, last consistent v0)");
  auto report = sub->next_report(std::chrono::seconds(5));
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->version, 1u);
  EXPECT_FALSE(report->status.ok());
}

TEST(SubscriberTest, SurvivesAPublisherRestartAndCatchesUp) {
  auto pub = Publisher::create(test::test_config(1)).value();
  const std::string endpoint = pub->endpoint();
  Config cfg = config_for(*pub, 1);
  std::vector<TensorSpec> specs = {{"w", DType::kBF16, {300, 7}}};
  HostTensors dest = test::make_tensors(specs);
  auto sub = Subscriber::create(cfg, "worker-1").value();
  ASSERT_TRUE(sub->register_tensor(dest.views()[0]).ok());
  ASSERT_TRUE(sub->start().ok());
  ASSERT_TRUE(pub->start().ok());
  HostTensors t = test::make_tensors(specs);
  t.fill(1);
  ASSERT_TRUE(pub->weight_update(t.views()).ok());
  EXPECT_EQ(sub->state().to_string(), "version 1, consistent");

  // The trainer restarts: a new publisher binds the same endpoint.
  pub->shutdown();
  pub.reset();
  Config again = test::test_config(1);
  again.control.endpoint = endpoint;
  auto pub2 = Publisher::create(again);
  ASSERT_TRUE(pub2.ok()) << pub2.status().to_string();
  ASSERT_TRUE(pub2.value()->start().ok());  // the subscriber found it on its own
  EXPECT_EQ(sub->state().to_string(), "version 1, consistent");  // its weights stayed
  t.fill(2);
  UpdateResult r = pub2.value()->weight_update(t.views(), 2);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(sub->state().to_string(), "version 2, consistent");
  EXPECT_TRUE(dest.bytes[0] == t.bytes[0]);
}

TEST(SubscriberTest, StopSaysLeaveAndThePublisherSeesIt) {
  auto pub = Publisher::create(test::test_config(1)).value();
  auto sub = Subscriber::create(config_for(*pub, 1), "worker-1").value();
  ASSERT_TRUE(sub->start().ok());
  ASSERT_TRUE(pub->start().ok());
  EXPECT_TRUE(sub->joined());
  sub->stop();
  bool left = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!left && std::chrono::steady_clock::now() < deadline) {
    while (auto e = pub->poll_event()) left = left || (e->kind == MemberEvent::Kind::kLeft && e->worker_id == "worker-1");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(left);
  EXPECT_EQ(pub->stats().live_members, 0);
}

}  // namespace
}  // namespace paramcast
