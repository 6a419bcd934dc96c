// The control-plane room on its own: ControlServer and ControlClient over
// real ZeroMQ sockets on loopback, without tensors or groups. Join, routing
// both ways, duplicate ids, a silent member declared lost within its bound,
// and a client that rejoins a publisher restarted on the same endpoint.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/control/control_client.h"
#include "common/control/control_server.h"
#include "common/control/messages.h"
#include "common/log.h"

namespace paramcast::control {
namespace {

using namespace std::chrono_literals;

ControlOptions fast_options() {
  ControlOptions c;
  c.endpoint = "tcp://127.0.0.1:*";
  c.heartbeat_interval = 100ms;
  c.heartbeat_timeout = 800ms;
  c.reconnect_backoff_max = 300ms;
  return c;
}

// Waits on a predicate over recorded callbacks.
class Recorder {
 public:
  template <typename Pred>
  bool wait(Pred pred, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return pred(); });
  }
  // Reads recorded state under the lock (callbacks may still be running).
  template <typename F>
  auto get(F f) {
    std::lock_guard<std::mutex> lock(mu_);
    return f();
  }
  void note(const std::function<void()>& f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      f();
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

struct ServerSide : ControlServer::Listener, Recorder {
  std::vector<MemberEvent> events;
  std::vector<std::pair<std::string, std::string>> messages;  // id, body name
  std::map<std::string, Clock::time_point> lost_at;
  void on_member_message(const std::string& id, proto::Envelope::Reader env) override {
    note([&] { messages.push_back({id, body_name(env)}); });
  }
  void on_member_event(const MemberEvent& e, int) override {
    note([&] {
      events.push_back(e);
      if (e.kind == MemberEvent::Kind::kLost) lost_at[e.worker_id] = Clock::now();
    });
  }
  bool has(MemberEvent::Kind kind, const std::string& id) {
    for (const auto& e : events)
      if (e.kind == kind && e.worker_id == id) return true;
    return false;
  }
};

struct ClientSide : ControlClient::Listener, Recorder {
  int joins = 0;
  std::vector<std::string> lost;
  Status refused;
  std::vector<std::string> messages;
  uint64_t version = 7;
  void on_joined() override { note([&] { ++joins; }); }
  void on_membership_lost(const std::string& why) override { note([&] { lost.push_back(why); }); }
  void on_refused(const Status& why) override { note([&] { refused = why; }); }
  void on_message(proto::Envelope::Reader env) override { note([&] { messages.push_back(body_name(env)); }); }
  WeightReport weight_report() override { return {version, proto::WeightState::CONSISTENT, 0}; }
};

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }

  std::unique_ptr<ControlServer> start_server(ServerSide& listener, int count, std::string endpoint = "",
                                              const ControlOptions& control = fast_options()) {
    ServerOptions o;
    o.control = control;
    if (!endpoint.empty()) o.control.endpoint = endpoint;
    o.subscriber_count = count;
    auto s = std::make_unique<ControlServer>(o);
    Status st = s->start(&listener);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return s;
  }
  std::unique_ptr<ControlClient> start_client(ClientSide& listener, const std::string& id, const std::string& endpoint,
                                              bool wait_out_duplicate_id = false,
                                              const ControlOptions& control = fast_options()) {
    ClientOptions o;
    o.control = control;
    o.control.endpoint = endpoint;
    o.worker_id = id;
    o.wait_out_duplicate_id = wait_out_duplicate_id;
    auto c = std::make_unique<ControlClient>(o, &listener);
    c->start();
    return c;
  }
};

TEST_F(ControlPlaneTest, MembersJoinAndMessagesFlowBothWays) {
  ServerSide server_events;
  auto server = start_server(server_events, 2);
  ClientSide a_events, b_events;
  auto a = start_client(a_events, "worker-a", server->endpoint());
  auto b = start_client(b_events, "worker-b", server->endpoint());
  ASSERT_TRUE(a_events.wait([&] { return a_events.joins == 1; }));
  ASSERT_TRUE(b_events.wait([&] { return b_events.joins == 1; }));
  EXPECT_EQ(server->live_ids(), (std::vector<std::string>{"worker-a", "worker-b"}));
  EXPECT_TRUE(server->missing().empty());
  ASSERT_TRUE(server_events.wait([&] {
    return server_events.has(MemberEvent::Kind::kJoined, "worker-a") && server_events.has(MemberEvent::Kind::kJoined, "worker-b");
  }));
  // Heartbeats carry the weights each member reports.
  ASSERT_TRUE(server_events.wait([&] { return server->member("worker-a")->weight_version == 7; }, 5s));

  // Member -> server: anything but Hello/Heartbeat/Leave reaches the listener, tagged with the id.
  b->send(make_message(0, b->incarnation(), [](auto m) { m.initGroupReady().setRank(2); }));
  ASSERT_TRUE(server_events.wait([&] {
    for (const auto& [id, name] : server_events.messages)
      if (id == "worker-b" && name == std::string("groupReady")) return true;
    return false;
  })) << "messages seen: " << server_events.messages.size();
  // Server -> member.
  server->send("worker-a", make_message(0, server->incarnation(), [](auto m) { m.initCommit().setVersion(3); }));
  ASSERT_TRUE(a_events.wait([&] { return !a_events.messages.empty(); }));
  EXPECT_EQ(a_events.get([&] { return a_events.messages[0]; }), "commit");
  EXPECT_TRUE(b_events.get([&] { return b_events.messages.empty(); }));
}

// Every membership change has a generation, and by the time the listener
// hears of it the live view already holds it: a reader of live() at that
// generation or later has seen the change (the publisher relies on this not
// to re-form for a member its last formation already counted).
TEST_F(ControlPlaneTest, MembershipEventsCarryTheGenerationTheLiveViewAlreadyShows) {
  struct Seen : ServerSide {
    ControlServer* server = nullptr;
    std::vector<ControlServer::Live> live_at_event;
    void on_member_event(const MemberEvent& e, int rank) override {
      auto live = server->live();
      note([&] { live_at_event.push_back(live); });
      ServerSide::on_member_event(e, rank);
    }
  } seen;
  ServerOptions o;
  o.control = fast_options();
  o.subscriber_count = 2;
  auto server = std::make_unique<ControlServer>(o);
  seen.server = server.get();
  ASSERT_TRUE(server->start(&seen).ok());
  EXPECT_EQ(server->live().generation, 0u);
  ClientSide a_events, b_events;
  auto a = start_client(a_events, "worker-a", server->endpoint());
  ASSERT_TRUE(seen.wait([&] { return seen.events.size() == 1; }));
  auto b = start_client(b_events, "worker-b", server->endpoint());
  ASSERT_TRUE(seen.wait([&] { return seen.events.size() == 2; }));
  ASSERT_TRUE(b_events.wait([&] { return b_events.joins == 1; }));  // a member says Leave
  b->stop();
  ASSERT_TRUE(seen.wait([&] { return seen.events.size() == 3; }));
  seen.get([&] {
    const std::vector<std::pair<MemberEvent::Kind, std::string>> want = {
        {MemberEvent::Kind::kJoined, "worker-a"}, {MemberEvent::Kind::kJoined, "worker-b"}, {MemberEvent::Kind::kLeft, "worker-b"}};
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(seen.events[i].kind, want[i].first) << i;
      EXPECT_EQ(seen.events[i].worker_id, want[i].second) << i;
      EXPECT_EQ(seen.events[i].generation, i + 1) << "one generation per change, in order";
      EXPECT_GE(seen.live_at_event[i].generation, seen.events[i].generation) << i;
    }
    const auto& after_join = seen.live_at_event[1].ids;
    EXPECT_NE(std::find(after_join.begin(), after_join.end(), "worker-b"), after_join.end());
    return 0;
  });
  const auto live = server->live();
  EXPECT_EQ(live.generation, 3u);
  EXPECT_EQ(live.ids, (std::vector<std::string>{"worker-a"}));
}

TEST_F(ControlPlaneTest, DuplicateIdIsRefusedAndTheFirstMemberStays) {
  ServerSide server_events;
  auto server = start_server(server_events, 2);
  ClientSide first_events, second_events;
  auto first = start_client(first_events, "worker-1", server->endpoint());
  ASSERT_TRUE(first_events.wait([&] { return first_events.joins == 1; }));
  auto second = start_client(second_events, "worker-1", server->endpoint());
  ASSERT_TRUE(second_events.wait([&] { return !second_events.refused.ok(); }));
  const Status refused = second_events.get([&] { return second_events.refused; });
  EXPECT_EQ(refused.code(), Code::kRejected);
  EXPECT_NE(refused.message().find("already used by a live subscriber"), std::string::npos) << refused.message();
  EXPECT_EQ(second_events.get([&] { return second_events.joins; }), 0);
  EXPECT_TRUE(first->joined());
  EXPECT_TRUE(server->is_live("worker-1"));
  EXPECT_FALSE(server_events.get([&] { return server_events.has(MemberEvent::Kind::kRejoined, "worker-1"); }));
}

// A trainer rank (wait_out_duplicate_id) whose id another live member holds
// (in plain mode ids are not owned: a squatter) is not refused for good: it
// stays out while the other is live and joins once it is gone.
TEST_F(ControlPlaneTest, AnIdWaitedOutJoinsOnceTheMemberHoldingItIsGone) {
  // A holder whose heartbeat is late by two intervals is taken for a
  // process gone (a restart's rule): intervals wide enough for a loaded
  // machine, since each probe of the waiting rank tries that rule again.
  ControlOptions steady = fast_options();
  steady.heartbeat_interval = 300ms;
  steady.heartbeat_timeout = 3000ms;
  steady.reconnect_backoff_max = 600ms;
  ServerSide server_events;
  auto server = start_server(server_events, 2, "", steady);
  ClientSide squatter_events, rank_events;
  auto squatter = start_client(squatter_events, "trainer-1", server->endpoint(), false, steady);
  ASSERT_TRUE(squatter_events.wait([&] { return squatter_events.joins == 1; }));
  auto rank = start_client(rank_events, "trainer-1", server->endpoint(), true, steady);
  std::this_thread::sleep_for(1500ms);  // several probes, each refused
  EXPECT_TRUE(rank_events.get([&] { return rank_events.refused.ok(); })) << "refused for good";
  EXPECT_EQ(rank_events.get([&] { return rank_events.joins; }), 0);
  EXPECT_TRUE(squatter->joined());
  squatter->stop();
  ASSERT_TRUE(rank_events.wait([&] { return rank_events.joins == 1; })) << "never came back to its id";
  EXPECT_TRUE(server->is_live("trainer-1"));
}

TEST_F(ControlPlaneTest, SilentMemberIsDeclaredLostWithinItsBound) {
  ServerSide server_events;
  auto server = start_server(server_events, 1);
  // A member that joins by the protocol and then falls silent (a stopped
  // process), spoken with raw DEALER sockets.
  zmq::context_t ctx;
  auto hello = [&](zmq::socket_t& s, uint64_t inc) {
    s.send(make_message(0, inc, [](auto b) {
      auto h = b.initHello();
      h.setProtocolVersion(proto::PROTOCOL_VERSION);
      h.setWorkerId("worker-s");
      h.setHost("test");
    }), zmq::send_flags::none);
    zmq::message_t reply;
    s.set(zmq::sockopt::rcvtimeo, 10000);
    return s.recv(reply).has_value();
  };
  zmq::socket_t probe(ctx, zmq::socket_type::dealer), member(ctx, zmq::socket_type::dealer);
  probe.set(zmq::sockopt::routing_id, "probe/worker-s/0000000000000042");
  member.set(zmq::sockopt::routing_id, "member/worker-s/0000000000000043");
  probe.set(zmq::sockopt::linger, 0);
  member.set(zmq::sockopt::linger, 0);
  probe.connect(server->endpoint());
  ASSERT_TRUE(hello(probe, 0x42));
  member.connect(server->endpoint());
  // Taken before the Hello goes out: the server hears it (last_seen) later,
  // and the reply may reach this thread later still on a loaded machine.
  const auto silent_since = Clock::now();
  ASSERT_TRUE(hello(member, 0x42));
  ASSERT_TRUE(server->is_live("worker-s"));
  ASSERT_TRUE(server_events.wait([&] { return server_events.lost_at.count("worker-s") > 0; }, 10s));
  const auto lost_at = server_events.get([&] { return server_events.lost_at["worker-s"]; });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(lost_at - silent_since);
  const auto timeout = fast_options().heartbeat_timeout, interval = fast_options().heartbeat_interval;
  EXPECT_GE(ms, timeout) << "declared lost before heartbeat_timeout";
  // Bound: timeout + one interval of liveness checks; 1.5 s of slack for a loaded machine.
  EXPECT_LE(ms, timeout + interval + 1500ms) << "declared lost after " << ms.count() << " ms";
  EXPECT_FALSE(server->is_live("worker-s"));
  EXPECT_EQ(server->missing(), (std::vector<std::string>{"worker-s"}));
}

TEST_F(ControlPlaneTest, ClientRejoinsAPublisherRestartedOnTheSameEndpoint) {
  ServerSide first_events;
  auto first = start_server(first_events, 1);
  const std::string endpoint = first->endpoint();
  ClientSide client_events;
  auto client = start_client(client_events, "worker-r", endpoint);
  ASSERT_TRUE(client_events.wait([&] { return client_events.joins == 1; }));
  first->stop("restarting");
  ASSERT_TRUE(client_events.wait([&] { return !client_events.lost.empty(); }));
  EXPECT_EQ(client_events.get([&] { return client_events.lost[0]; }), "publisher left");
  EXPECT_FALSE(client->joined());
  first.reset();
  ServerSide second_events;
  auto second = start_server(second_events, 1, endpoint);
  ASSERT_TRUE(client_events.wait([&] { return client_events.joins == 2; }, 15s));
  EXPECT_TRUE(second->is_live("worker-r"));
  EXPECT_TRUE(second_events.get([&] { return second_events.has(MemberEvent::Kind::kJoined, "worker-r"); }));
}

TEST_F(ControlPlaneTest, StoppedClientSaysLeave) {
  ServerSide server_events;
  auto server = start_server(server_events, 1);
  ClientSide client_events;
  auto client = start_client(client_events, "worker-l", server->endpoint());
  ASSERT_TRUE(client_events.wait([&] { return client_events.joins == 1; }));
  client->stop();
  ASSERT_TRUE(server_events.wait([&] { return server_events.has(MemberEvent::Kind::kLeft, "worker-l"); }, 5s));
  EXPECT_FALSE(server->is_live("worker-l"));
  EXPECT_EQ(server_events.get([&] { return server_events.lost_at.count("worker-l"); }), 0u);
}

}  // namespace
}  // namespace paramcast::control
