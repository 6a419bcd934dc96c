// Security of the control plane with real processes and sockets: CURVE keys
// decide who joins, reads status or sees a group's bootstrap; a key speaks
// only for its own worker id; without CURVE too, nobody steals a live
// member's route or id; the rendezvous store refuses what is not the
// writer's; a stopped trainer gets its whole group back within seconds.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <sstream>

#include "common/control/auth.h"
#include "common/control/messages.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using test::count;
using test::Process;
using Clock = std::chrono::steady_clock;

class SecurityTest : public test::WorkerClusterTest {
 protected:
  // `paramcast keygen` into dir_/keys; returns name -> public key.
  std::map<std::string, std::string> keygen(const std::vector<std::string>& names) {
    std::vector<std::string> args = {"keygen", "--dir", dir_ + "/keys"};
    args.insert(args.end(), names.begin(), names.end());
    auto p = Process::start(test::binary("paramcast"), args);
    EXPECT_EQ(p->wait_for(20s), 0) << p->output();
    std::map<std::string, std::string> keys;
    std::istringstream is(p->output());
    std::string name, key;
    while (is >> name >> key) keys[name] = key;
    EXPECT_EQ(keys.size(), names.size()) << p->output();
    return keys;
  }

  // A CURVE deployment: `workers` in authorized_keys, "status" in status_keys.
  std::string curve_yaml(int subscribers, const std::vector<std::string>& workers, const std::string& publisher = "",
                         const std::string& worker_key = "keys/{id}.key") {
    std::string authorized;
    for (const auto& w : workers) authorized += w + " " + keys_.at(w) + "\n";
    test::write_file(dir_ + "/keys", "authorized_keys", authorized);
    test::write_file(dir_ + "/keys", "status_keys", "status " + keys_.at("status") + "\n");
    return test::test_config_yaml(subscribers, publisher) +
           "auth:\n  mode: curve\n  publisher_key: keys/publisher.key\n  publisher_public_key: keys/publisher.pub\n"
           "  authorized_keys: keys/authorized_keys\n  status_keys: keys/status_keys\n  worker_key: " +
           worker_key + "\n  status_key: keys/status.key\n";
  }

  // A worker process started from another config file (another key).
  std::unique_ptr<Process> spawn_with(const std::string& yaml_name, const std::string& yaml, const std::string& id) {
    const std::string path = test::write_file(dir_, yaml_name, yaml);
    return Process::start(test::binary("paramcast-worker"),
                          {"--config", path, "--id", id, "--endpoint", pub_->endpoint(), "--updates", "0"});
  }

  // `paramcast status` against the publisher; returns exit code and output.
  std::pair<int, std::string> status(const std::vector<std::string>& extra, const std::vector<std::string>& env = {}) {
    std::vector<std::string> args = {"status", pub_->endpoint(), "--timeout", "1500ms"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = Process::start(test::binary("paramcast"), args, env);
    auto code = p->wait_for(20s);
    return {code.value_or(-1), p->output()};
  }

  // Puts the key pair of `from` where a worker with id `as` looks for its own.
  void copy_key(const std::string& from, const std::string& subdir, const std::string& as) {
    ::mkdir((dir_ + "/" + subdir).c_str(), 0700);
    std::ifstream in(dir_ + "/keys/" + from + ".key");
    std::stringstream text;
    text << in.rdbuf();
    test::write_file(dir_ + "/" + subdir, as + ".key", text.str());
    ::chmod((dir_ + "/" + subdir + "/" + as + ".key").c_str(), 0600);
  }

  std::map<std::string, std::string> keys_;
};

#define REQUIRE_CURVE()                                                                \
  if (!control::curve_unavailable_reason().empty()) GTEST_SKIP() << control::curve_unavailable_reason()

TEST_F(SecurityTest, UnauthorizedKeyGetsNoJoinNoStatusNoBootstrap) {
  REQUIRE_CURVE();
  keys_ = keygen({"publisher", "worker-1", "worker-2", "status", "intruder"});
  // A count deployment: before keys, any process could take a free slot.
  make_publisher(curve_yaml(2, {"worker-1", "worker-2"}));
  copy_key("intruder", "stolen", "worker-2");
  auto squatter = spawn_with("squatter.yaml", curve_yaml(2, {"worker-1", "worker-2"}, "", "stolen/{id}.key"), "worker-2");
  std::this_thread::sleep_for(1s);  // the squatter is first in line
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  Status s = pub_->start();
  ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 10s)) << id << p->output();
  EXPECT_EQ(pub_->stats().live_members, 2);
  // The squatter never joined, never saw a JoinGroup (the bootstrap) or a plan.
  EXPECT_TRUE(squatter->running());
  EXPECT_EQ(squatter->output().find("joined publisher"), std::string::npos) << squatter->output();
  EXPECT_EQ(squatter->output().find("verified"), std::string::npos) << squatter->output();

  auto [code_ok, out_ok] = status({"--key", dir_ + "/keys/status.key", "--config", yaml_path_});
  EXPECT_EQ(code_ok, 0) << out_ok;
  EXPECT_NE(out_ok.find("worker-1"), std::string::npos) << out_ok;
  auto [code_bad, out_bad] = status({"--key", dir_ + "/keys/intruder.key", "--config", yaml_path_});
  EXPECT_EQ(code_bad, 1) << out_bad;
  EXPECT_EQ(out_bad.find("worker-1"), std::string::npos) << out_bad;
  auto [code_plain, out_plain] = status({});  // no key at all
  EXPECT_EQ(code_plain, 1) << out_plain;
  EXPECT_NE(out_plain.find("no answer"), std::string::npos) << out_plain;
}

// A refused key ends the connection at its handshake, which can come before
// the status request is queued: the request then has nowhere to go, and the
// command must still end at its timeout (it hung, seen once in CI).
TEST_F(SecurityTest, StatusWithARefusedKeyEndsAtItsTimeoutEvenWhenTheRefusalComesFirst) {
  REQUIRE_CURVE();
  keys_ = keygen({"publisher", "worker-1", "status", "intruder"});
  make_publisher(curve_yaml(1, {"worker-1"}));
  spawn_worker("worker-1");
  Status s = pub_->start();
  ASSERT_TRUE(s.ok()) << s.to_string() << outputs();
  for (int i = 0; i < 3; ++i) {
    auto [code, out] = status({"--key", dir_ + "/keys/intruder.key", "--config", yaml_path_},
                              {"PARAMCAST_FAULT_STATUS_SEND_AFTER_MS=400"});
    EXPECT_EQ(code, 1) << out;
    EXPECT_NE(out.find("no answer"), std::string::npos) << out;
  }
  auto [code_ok, out_ok] = status({"--key", dir_ + "/keys/status.key", "--config", yaml_path_},
                                  {"PARAMCAST_FAULT_STATUS_SEND_AFTER_MS=400"});
  EXPECT_EQ(code_ok, 0) << out_ok;
  EXPECT_NE(out_ok.find("worker-1"), std::string::npos) << out_ok;
}

TEST_F(SecurityTest, KeyBoundToWorker1CannotActAsWorker3) {
  REQUIRE_CURVE();
  keys_ = keygen({"publisher", "worker-1", "worker-2", "worker-3", "status"});
  const std::string ids = "  subscribers: [worker-1, worker-2, worker-3]\n";
  std::string yaml = curve_yaml(3, {"worker-1", "worker-2", "worker-3"});
  yaml.replace(yaml.find("  subscribers: 3\n"), 16, ids);
  make_publisher(yaml);
  copy_key("worker-1", "borrowed", "worker-3");
  std::string fake_yaml = yaml;
  fake_yaml.replace(fake_yaml.find("keys/{id}.key"), 13, "borrowed/{id}.key");
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  const uint64_t dropped_before = pub_->stats().dropped_frames;
  auto fake = spawn_with("fake.yaml", fake_yaml, "worker-3");
  auto started = std::async(std::launch::async, [&] { return pub_->start(); });
  // worker-1's key claiming worker-3: every frame is dropped, nothing answered.
  const auto deadline = Clock::now() + 20s;
  while (pub_->stats().dropped_frames < dropped_before + 3 && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  EXPECT_GE(pub_->stats().dropped_frames, dropped_before + 3);
  std::this_thread::sleep_for(1s);
  EXPECT_EQ(fake->output().find("joined publisher"), std::string::npos) << fake->output();
  EXPECT_EQ(started.wait_for(0s), std::future_status::timeout) << "start() must still wait for the real worker-3";
  spawn_worker("worker-3");
  ASSERT_TRUE(started.get().ok()) << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 10s)) << id << p->output();
  EXPECT_EQ(fake->output().find("verified"), std::string::npos) << fake->output();
}

int free_port();

// The publisher as a process, so that its log can be read: a foreign key is
// named by its fingerprint, a few times per window, then counted.
TEST_F(SecurityTest, ForeignKeyIsLoggedByFingerprintAndRateLimited) {
  REQUIRE_CURVE();
  keys_ = keygen({"publisher", "worker-1", "worker-3", "status"});
  std::string yaml = curve_yaml(2, {"worker-1", "worker-3"});
  yaml.replace(yaml.find("  subscribers: 2\n"), 16, "  subscribers: [worker-1, worker-3]\n");
  yaml.replace(yaml.find("tcp://127.0.0.1:*"), 17, "tcp://127.0.0.1:" + std::to_string(free_port()));
  const std::string path = test::write_file(dir_, "deploy.yaml", yaml);
  copy_key("worker-1", "borrowed", "worker-3");
  std::string fake_yaml = yaml;
  fake_yaml.replace(fake_yaml.find("keys/{id}.key"), 13, "borrowed/{id}.key");
  const std::string fake_path = test::write_file(dir_, "fake.yaml", fake_yaml);
  auto trainer = Process::start(test::binary("paramcast-trainer"), {"--config", path});
  auto fake = Process::start(test::binary("paramcast-worker"), {"--config", fake_path, "--id", "worker-3"});
  const std::string line = "key " + control::key_fingerprint(keys_.at("worker-1")) +
                           " is bound to 'worker-1', not to the worker id this hello claims ('worker-3')";
  ASSERT_TRUE(trainer->wait_for_output(line, 20s)) << trainer->output();
  std::this_thread::sleep_for(4s);  // the fake keeps saying Hello, with backoff
  const std::string out = trainer->output();
  EXPECT_LE(count(out, line), 5u) << out;
  EXPECT_EQ(fake->output().find("joined publisher"), std::string::npos) << fake->output();
  trainer->kill(SIGTERM);
  fake->kill(SIGTERM);
}

// ---------------------------------------------------------------- plain mode

// A DEALER that speaks the protocol by hand.
struct RawPeer {
  zmq::socket_t socket;
  RawPeer(zmq::context_t& ctx, const std::string& routing_id, const std::string& endpoint)
      : socket(ctx, zmq::socket_type::dealer) {
    socket.set(zmq::sockopt::routing_id, routing_id);
    socket.set(zmq::sockopt::linger, 0);
    socket.connect(endpoint);
  }
  void hello(const std::string& id, uint64_t incarnation) {
    socket.send(control::make_message(0, incarnation, [&](auto b) {
                  auto h = b.initHello();
                  h.setProtocolVersion(proto::PROTOCOL_VERSION);
                  h.setWorkerId(id);
                  h.setHost("intruder");
                }),
                zmq::send_flags::none);
  }
  template <typename F>
  void send(uint64_t incarnation, F&& fill) {
    socket.send(control::make_message(0, incarnation, fill), zmq::send_flags::none);
  }
  // Names of the bodies received within `wait` (e.g. "reject", "welcome").
  std::vector<std::string> receive(std::chrono::milliseconds wait, std::string* reject_text = nullptr) {
    std::vector<std::string> got;
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    const auto deadline = Clock::now() + wait;
    while (Clock::now() < deadline) {
      if (zmq::poll(&item, 1, 20ms) <= 0) continue;
      zmq::message_t m;
      (void)socket.recv(m, zmq::recv_flags::none);
      auto d = control::decode(m.data(), m.size(), {});
      if (!d.ok()) continue;
      got.push_back(control::body_name(d.value()->envelope()));
      if (reject_text && got.back() == "reject")
        *reject_text += std::string(d.value()->envelope().getBody().getReject().getText().cStr()) + "\n";
    }
    return got;
  }
};

bool only_rejects(const std::vector<std::string>& got) {
  return std::all_of(got.begin(), got.end(), [](const std::string& n) { return n == "reject"; });
}

TEST_F(SecurityTest, RouteStealAndIdTakeoverLeaveTheRealMemberUntouched) {
  std::string yaml = test::test_config_yaml(2);
  yaml.replace(yaml.find("  subscribers: 2\n"), 16, "  subscribers: [worker-1, worker-2]\n");
  make_publisher(yaml);
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  ASSERT_TRUE(publish(1).ok());
  zmq::context_t ctx;
  const auto ep = pub_->endpoint();
  // 1. The bare worker id as routing identity (what handover used to give away).
  RawPeer bare(ctx, "worker-1", ep);
  // 2. A member identity that skipped the probe.
  RawPeer unprobed(ctx, "member/worker-1/00000000000000aa", ep);
  // 3. A probe for the live id from another incarnation: a duplicate.
  RawPeer probe(ctx, "probe/worker-1/00000000000000bb", ep);
  // 4. The reserved name.
  RawPeer reserved(ctx, "probe/publisher/00000000000000cc", ep);
  bare.hello("worker-1", 77);
  unprobed.hello("worker-1", 77);
  unprobed.send(77, [](auto b) { b.initHeartbeat().setWeightVersion(99); });
  probe.hello("worker-1", 77);
  reserved.hello("publisher", 78);
  auto update = std::async(std::launch::async, [&] { return publish(2); });
  std::string texts;
  auto got_bare = bare.receive(2s, &texts);
  auto got_unprobed = unprobed.receive(500ms, &texts);
  auto got_probe = probe.receive(500ms, &texts);
  auto got_reserved = reserved.receive(200ms, &texts);
  UpdateResult r = update.get();
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  EXPECT_EQ(r.epoch, 1u) << "the group never changed";
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v2 verified", 10s)) << id << p->output();
  // Every intruder got refusals only: no heartbeat, plan, JoinGroup or checksum.
  for (auto* got : {&got_bare, &got_unprobed, &got_probe, &got_reserved}) {
    EXPECT_FALSE(got->empty()) << texts;
    EXPECT_TRUE(only_rejects(*got)) << texts;
  }
  EXPECT_NE(texts.find("differs from the connection's routing identity"), std::string::npos) << texts;
  EXPECT_NE(texts.find("say Hello from the probe identity first"), std::string::npos) << texts;
  EXPECT_NE(texts.find("already used by a live subscriber"), std::string::npos) << texts;
  EXPECT_NE(texts.find("'publisher' is reserved"), std::string::npos) << texts;
  EXPECT_EQ(texts.find("pid"), std::string::npos) << "refusals name no host or pid: " << texts;
  while (auto e = pub_->poll_event())
    EXPECT_NE(e->kind, MemberEvent::Kind::kLost) << "member " << e->worker_id << " was disturbed";
  EXPECT_EQ(pub_->stats().live_members, 2);
}

TEST_F(SecurityTest, StoreRequestsOutsideTheWritersGroupAreRefused) {
  make_publisher(test::test_config_yaml(2));
  zmq::context_t ctx;
  const auto ep = pub_->endpoint();
  // A proper member (probe, then member connection) that abuses the store.
  RawPeer probe(ctx, "probe/evil-1/0000000000000001", ep);
  probe.hello("evil-1", 5);
  ASSERT_EQ(probe.receive(1s), std::vector<std::string>{"welcome"});
  RawPeer member(ctx, "member/evil-1/0000000000000002", ep);
  member.hello("evil-1", 5);
  auto welcomed = member.receive(1s);
  ASSERT_FALSE(welcomed.empty());
  ASSERT_EQ(welcomed[0], "welcome");
  const uint64_t before = pub_->stats().dropped_frames;
  const std::string mib(1 << 20, 'x');
  int sent = 0;
  for (int epoch = 1; epoch <= 4; ++epoch)
    for (int rank = 1; rank <= 2; ++rank, ++sent)
      member.send(5, [&](auto b) {
        auto s = b.initStoreSet();
        s.setKey("paramcast/epoch-" + std::to_string(epoch) + "/" + std::to_string(rank));
        s.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(mib.data()), mib.size()));
      });
  member.send(5, [](auto b) {
    auto g = b.initStoreGet();
    g.setRequestId(1);
    g.setKey("paramcast/epoch-1/1");
  });
  ++sent;
  const auto deadline = Clock::now() + 10s;
  while (pub_->stats().dropped_frames < before + sent && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(pub_->stats().dropped_frames, before + sent) << "every out-of-group store request is refused";
  auto answers = member.receive(300ms);  // heartbeats: it is a member, but of no group
  EXPECT_EQ(std::count(answers.begin(), answers.end(), "storeValue"), 0) << "nothing is answered";
  member.send(5, [](auto b) { b.initLeave().setReason("done"); });
  // The real workers form epoch 1 (and 2) as if the keys had never been sent.
  spawn_worker("worker-1");
  spawn_worker("worker-2");
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string();
  for (auto& [id, p] : workers_) EXPECT_TRUE(p->wait_for_output("v1 verified", 10s)) << id << p->output();
}

// ------------------------------------------------------------ fast rejoin

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST_F(SecurityTest, GroupIsWholeAgainSecondsAfterAStoppedTrainerResumes) {
  std::string yaml = test::test_config_yaml(2);
  yaml.replace(yaml.find("tcp://127.0.0.1:*"), 17, "tcp://127.0.0.1:" + std::to_string(free_port()));
  yaml.replace(yaml.find("  updates: 3\n"), 13, "  updates: 100000\n  interval: 200ms\n");
  const std::string path = test::write_file(dir_, "deploy.yaml", yaml);
  auto cfg = load_config_file(path);
  ASSERT_TRUE(cfg.ok());
  auto trainer = Process::start(test::binary("paramcast-trainer"), {"--config", path});
  std::map<std::string, std::unique_ptr<Process>> w;
  for (const char* id : {"worker-1", "worker-2"})
    w[id] = Process::start(test::binary("paramcast-worker"), {"--config", path, "--id", id});
  for (auto& [id, p] : w) ASSERT_TRUE(p->wait_for_output("v2 verified", 30s)) << id << p->output() << trainer->output();
  // Silent for longer than heartbeat_timeout: both sides declare the other lost.
  trainer->kill(SIGSTOP);
  for (auto& [id, p] : w) ASSERT_TRUE(p->wait_for_output("publisher lost", 10s)) << id << p->output();
  std::this_thread::sleep_for(cfg->control.heartbeat_timeout);
  trainer->kill(SIGCONT);
  const auto resumed = Clock::now();
  // Whole again: each worker joined a second time and verified a later version.
  const auto deadline = resumed + 30s;
  bool whole = false;
  while (!whole && Clock::now() < deadline) {
    whole = true;
    for (auto& [id, p] : w) whole &= count(p->output(), "joined publisher") >= 2;
    if (!whole) std::this_thread::sleep_for(20ms);
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - resumed);
  ASSERT_TRUE(whole) << trainer->output();
  // Bound: heartbeat_timeout + reconnect_backoff_max (2 s), plus slack for a loaded machine.
  const auto bound = cfg->control.heartbeat_timeout + cfg->control.reconnect_backoff_max + 4s;
  EXPECT_LE(took, bound) << took.count() << " ms to rejoin after the trainer resumed";
  std::printf("rejoined %lld ms after the trainer resumed (bound %lld ms)\n", static_cast<long long>(took.count()),
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(bound).count()));
  // And an update reaches both soon after: an update in flight across the
  // stop fails at once (its members left its group), and the next forms a
  // new group, without waiting out stall_timeout (20 s in this config).
  const size_t before = count(w["worker-1"]->output(), "verified");
  const auto update_bound = bound + 6s;
  for (auto& [id, p] : w) {
    const auto until = resumed + update_bound;
    while (count(p->output(), "verified") <= before && Clock::now() < until) std::this_thread::sleep_for(20ms);
    EXPECT_GT(count(p->output(), "verified"), before)
        << id << " got no update within " << std::chrono::duration_cast<std::chrono::milliseconds>(update_bound).count()
        << " ms of the trainer's resume:\n" << p->output() << "--- trainer:\n" << trainer->output();
  }
  std::printf("updated %lld ms after the trainer resumed\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - resumed).count()));
  trainer->kill(SIGTERM);
  for (auto& [id, p] : w) p->kill(SIGTERM);
}

}  // namespace
}  // namespace paramcast
