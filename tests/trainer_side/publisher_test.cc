// Control plane, tier 2: the publisher in this process, subscribers as real
// paramcast-worker processes on tcp://127.0.0.1 with ephemeral ports.
#include "trainer_side/publisher.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <set>
#include <zmq.hpp>

#include "common/control/messages.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using test::WorkerClusterTest;

class PublisherTest : public WorkerClusterTest {};

TEST_F(PublisherTest, SevenProcessesFormAGroupAndLearnTheirRanks) {
  make_publisher(test::test_config_yaml(7));
  for (int i = 1; i <= 7; ++i) spawn_worker("worker-" + std::to_string(i));
  Status s = pub_->start();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(pub_->stats().epoch, 1u);
  std::set<std::string> ranks;
  for (auto& [id, p] : workers_) {
    ASSERT_TRUE(p->wait_for_output("of 8 in group epoch 1", std::chrono::seconds(10))) << p->output();
    const auto out = p->output();
    const auto at = out.find(": rank ");
    ranks.insert(out.substr(at + 7, out.find(' ', at + 7) - at - 7));
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"1", "2", "3", "4", "5", "6", "7"}));  // distinct; 0 is the publisher

  // The status tool reads members, ranks, epoch and versions from the running publisher.
  for (uint64_t v = 1; v <= 2; ++v) ASSERT_TRUE(publish(v).ok());
  for (auto& [id, p] : workers_)
    ASSERT_TRUE(p->wait_for_output("v2 verified", std::chrono::seconds(10))) << p->output();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a heartbeat carries the new version
  auto status = test::Process::start(test::binary("paramcast"), {"status", pub_->endpoint(), "--json"});
  ASSERT_EQ(status->wait_for(std::chrono::seconds(10)), 0) << status->output();
  const std::string json = status->output();
  EXPECT_NE(json.find("\"epoch\":1"), std::string::npos) << json;
  EXPECT_NE(json.find("\"published_version\":2"), std::string::npos) << json;
  for (int i = 1; i <= 7; ++i)
    EXPECT_NE(json.find("{\"id\":\"worker-" + std::to_string(i) + "\",\"rank\":" + std::to_string(i) +
                        ",\"version\":2,\"state\":\"consistent\""),
              std::string::npos)
        << json;
  auto table = test::Process::start(test::binary("paramcast"), {"status", pub_->endpoint()});
  ASSERT_EQ(table->wait_for(std::chrono::seconds(10)), 0);
  EXPECT_NE(table->output().find("WORKER"), std::string::npos);
  EXPECT_NE(table->output().find("worker-7"), std::string::npos) << table->output();
}

TEST_F(PublisherTest, RestartedSubscriberRejoinsAndANewEpochForms) {
  make_publisher(test::test_config_yaml(3));
  for (int i = 1; i <= 3; ++i) spawn_worker("worker-" + std::to_string(i));
  ASSERT_TRUE(pub_->start().ok());
  ASSERT_TRUE(publish(1).ok());
  workers_["worker-2"]->kill(SIGKILL);
  ASSERT_TRUE(workers_["worker-2"]->wait_for(std::chrono::seconds(5)).has_value());
  spawn_worker("worker-2");  // same id, new process
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-2", std::chrono::seconds(10)))
      << workers_["worker-2"]->output();
  UpdateResult r = publish(2);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(r.epoch, 2u);
  EXPECT_TRUE(workers_["worker-2"]->wait_for_output("v2 verified", std::chrono::seconds(10)))
      << workers_["worker-2"]->output();
  // Nobody else restarted.
  for (const char* id : {"worker-1", "worker-3"}) {
    EXPECT_TRUE(workers_[id]->running());
    EXPECT_TRUE(workers_[id]->wait_for_output("v2 verified", std::chrono::seconds(10)));
  }
}

TEST_F(PublisherTest, SilentSubscriberIsLostWithinTimeoutPlusOneInterval) {
  make_publisher(test::test_config_yaml(2));
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  ASSERT_TRUE(pub_->start().ok());
  const auto bound = config_.control.heartbeat_timeout + config_.control.heartbeat_interval;
  workers_["worker-2"]->kill(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kLost, "worker-2", std::chrono::seconds(10)));
  const auto took = std::chrono::steady_clock::now() - stopped;
  EXPECT_LE(took, bound + std::chrono::milliseconds(150))
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  EXPECT_GE(took, config_.control.heartbeat_timeout - config_.control.heartbeat_interval);
  // Resumed, it learns that it was expelled and joins again.
  workers_["worker-2"]->kill(SIGCONT);
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kRejoined, "worker-2", std::chrono::seconds(10)))
      << workers_["worker-2"]->output();
  const auto out = workers_["worker-2"]->output();
  EXPECT_TRUE(out.find("expelled") != std::string::npos || out.find("publisher lost") != std::string::npos) << out;
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_TRUE(workers_["worker-2"]->wait_for_output("v1 verified", std::chrono::seconds(10)));
}

TEST_F(PublisherTest, ProtocolVersionMismatchIsRejectedWithBothVersions) {
  make_publisher(test::test_config_yaml(1));
  auto& w = spawn_worker("worker-1", {"PARAMCAST_TEST_PROTOCOL_VERSION=99"});
  ASSERT_EQ(w.wait_for(std::chrono::seconds(10)), 1) << w.output();
  EXPECT_NE(w.output().find("protocol version mismatch: subscriber speaks 99, publisher speaks " +
                            std::to_string(proto::PROTOCOL_VERSION)),
            std::string::npos)
      << w.output();
}

TEST_F(PublisherTest, DuplicateIdIsRejectedAndTheFirstStays) {
  make_publisher(test::test_config_yaml(2));
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  Status started = pub_->start();
  ASSERT_TRUE(started.ok()) << started.to_string() << "\n" << outputs();
  auto dup = test::Process::start(test::binary("paramcast-worker"),
                                  {"--config", yaml_path_, "--id", "worker-1", "--endpoint", pub_->endpoint()});
  ASSERT_EQ(dup->wait_for(std::chrono::seconds(10)), 1) << dup->output();
  EXPECT_NE(dup->output().find("worker id 'worker-1' is already used by a live subscriber"), std::string::npos)
      << dup->output();
  EXPECT_EQ(pub_->stats().live_members, 2);
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(r.epoch, 1u);  // the group never changed
  EXPECT_TRUE(workers_["worker-1"]->wait_for_output("v1 verified", std::chrono::seconds(10)));
}

TEST_F(PublisherTest, UnknownIdIsRejectedWhenTheDeploymentListsIds) {
  std::string yaml = test::test_config_yaml(1);
  yaml.replace(yaml.find("  subscribers: 1\n"), 16, "  subscribers: [engine-a, engine-b]\n");
  make_publisher(yaml);
  auto& w = spawn_worker("engine-z");
  ASSERT_EQ(w.wait_for(std::chrono::seconds(10)), 1) << w.output();
  EXPECT_NE(w.output().find("worker id 'engine-z' is not one of this deployment's subscribers"), std::string::npos)
      << w.output();
  // A refusal never tells a stranger which ids would be taken.
  EXPECT_EQ(w.output().find("engine-a"), std::string::npos) << w.output();
}

TEST_F(PublisherTest, MalformedFramesAreDroppedAndOthersAreStillServed) {
  make_publisher(test::test_config_yaml(2));
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  ASSERT_TRUE(pub_->start().ok());
  zmq::context_t ctx;
  zmq::socket_t rogue(ctx, zmq::socket_type::dealer);
  rogue.set(zmq::sockopt::routing_id, "rogue");
  rogue.set(zmq::sockopt::linger, 0);
  rogue.connect(pub_->endpoint());
  auto valid = control::make_message(0, 1, [](auto b) { b.initHeartbeat(); });
  std::string bytes(static_cast<const char*>(valid.data()), valid.size());
  const uint64_t before = pub_->stats().dropped_frames;
  rogue.send(zmq::buffer(bytes.substr(0, bytes.size() - 8)), zmq::send_flags::none);      // truncated
  rogue.send(zmq::buffer(std::string(64, '\xa5')), zmq::send_flags::none);               // garbage
  rogue.send(zmq::buffer(std::string(13, 'x')), zmq::send_flags::none);                  // not whole words
  rogue.send(zmq::buffer(std::string("a")), zmq::send_flags::sndmore);                   // two frames
  rogue.send(zmq::buffer(std::string("b")), zmq::send_flags::none);
  // A well-formed message of a type the publisher never takes from a stranger.
  rogue.send(control::make_message(0, 1, [](auto b) { b.initPlanAccept().setVersion(1); }), zmq::send_flags::none);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (pub_->stats().dropped_frames < before + 4 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GE(pub_->stats().dropped_frames, before + 4);
  // The stranger's plan answer is refused by name, not acted on.
  zmq::pollitem_t items[] = {{rogue.handle(), 0, ZMQ_POLLIN, 0}};
  bool refused = false;
  while (!refused && zmq::poll(items, 1, std::chrono::milliseconds(2000)) > 0) {
    zmq::message_t m;
    (void)rogue.recv(m, zmq::recv_flags::none);
    auto d = control::decode(m.data(), m.size(), control::DecodeLimits{});
    if (d.ok() && d.value()->envelope().getBody().which() == proto::Envelope::Body::REJECT)
      refused = d.value()->envelope().getBody().getReject().getCode() == proto::RejectCode::NOT_MEMBER;
  }
  EXPECT_TRUE(refused);
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(pub_->stats().live_members, 2);
}

TEST_F(PublisherTest, OversizedFrameIsDroppedByTheLimit) {
  std::string yaml = test::test_config_yaml(1);
  yaml.replace(yaml.find("  reconnect_backoff_max"), 0, "  max_message_size: 64KiB\n");
  make_publisher(yaml);
  zmq::context_t ctx;
  zmq::socket_t rogue(ctx, zmq::socket_type::dealer);
  rogue.set(zmq::sockopt::linger, 0);
  rogue.connect(pub_->endpoint());
  rogue.send(zmq::buffer(std::string(1 << 20, '\0')), zmq::send_flags::none);
  spawn_worker("worker-1");
  ASSERT_TRUE(pub_->start().ok());  // the publisher kept serving
  ASSERT_TRUE(publish(1).ok());
}

TEST_F(PublisherTest, MissingSubscriberNamedAfterJoinTimeout) {
  std::string yaml = test::test_config_yaml(1);
  yaml.replace(yaml.find("  subscribers: 1\n"), 16, "  subscribers: [a, b, c]\n");
  yaml.replace(yaml.find("join_timeout: 30s"), 17, "join_timeout: 1s");
  make_publisher(yaml);
  spawn_worker("a");
  spawn_worker("c");
  const auto t0 = std::chrono::steady_clock::now();
  Status s = pub_->start();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kTimeout);
  EXPECT_NE(s.message().find("subscribers missing: b"), std::string::npos) << s.message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
}

TEST_F(PublisherTest, StartWithPresentAdmitsTheLateJoinerAtTheNextUpdate) {
  std::string yaml = test::test_config_yaml(1, "  on_missing_at_start: start_with_present\n  on_member_loss: continue\n");
  yaml.replace(yaml.find("  subscribers: 1\n"), 16, "  subscribers: [a, b]\n");
  yaml.replace(yaml.find("join_timeout: 30s"), 17, "join_timeout: 1s");
  make_publisher(yaml);
  spawn_worker("a");
  Status started = pub_->start();
  ASSERT_TRUE(started.ok()) << started.to_string();
  UpdateResult r1 = publish(1);
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  EXPECT_EQ(r1.missing, (std::vector<std::string>{"b"}));
  spawn_worker("b");
  ASSERT_TRUE(wait_event(MemberEvent::Kind::kJoined, "b", std::chrono::seconds(10)));
  UpdateResult r2 = publish(2);
  ASSERT_TRUE(r2.ok()) << r2.status.to_string();
  EXPECT_TRUE(r2.missing.empty());
  EXPECT_EQ(r2.subscribers.size(), 2u);
  EXPECT_TRUE(workers_["b"]->wait_for_output("v2 verified", std::chrono::seconds(10)));
}

}  // namespace
}  // namespace paramcast
