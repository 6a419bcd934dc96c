// The control plane's defences, piece by piece: text limits on decode, the
// one escaping helper, per-peer log limiting, routing identities, the auth
// block of the config, key files, and the rendezvous store's scoping.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "common/config.h"
#include "common/data/communicator.h"
#include "common/control/auth.h"
#include "common/control/control_server.h"
#include "common/control/log_guard.h"
#include "common/control/messages.h"
#include "common/group/rendezvous_store.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using control::printable;

zmq::message_t hello_with(const std::string& id, const std::string& host) {
  // Built by hand: make_message would clamp the texts.
  capnp::MallocMessageBuilder b;
  auto env = b.initRoot<proto::Envelope>();
  auto h = env.initBody().initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  h.setWorkerId(id);
  h.setHost(host);
  return control::encode(b);
}

TEST(TextLimits, OversizedIdsAndHostsAreRefusedOnDecode) {
  auto ok = hello_with("worker-1", "node-a");
  EXPECT_TRUE(control::decode(ok.data(), ok.size(), {}).ok());
  auto long_id = hello_with(std::string(control::kMaxIdBytes + 1, 'w'), "node-a");
  auto d = control::decode(long_id.data(), long_id.size(), {});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Code::kProtocol);
  EXPECT_NE(d.status().message().find("text field 'workerId' of 256 bytes exceeds its limit of 255"), std::string::npos)
      << d.status().message();
  auto huge_host = hello_with("worker-1", std::string(1 << 20, 'h'));
  d = control::decode(huge_host.data(), huge_host.size(), {});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("'host'"), std::string::npos) << d.status().message();
}

// A plan's tensor list is read through its own fast path (codec.cc,
// check_tensor_entries): a name or a dtype over its limit in the last of
// many tensors is refused all the same, naming the field.
TEST(TextLimits, ATensorsNameOrDtypeOverItsLimitIsRefusedInAListOfMany) {
  auto plan_with = [](const std::string& name, const std::string& dtype) {
    capnp::MallocMessageBuilder b;
    auto plan = b.initRoot<proto::Envelope>().initBody().initPlan();
    auto tensors = plan.initTensors(1000);
    for (unsigned i = 0; i < 999; ++i) {
      tensors[i].setName("layers." + std::to_string(i) + ".weight");
      tensors[i].setDtype("BF16");
    }
    tensors[999].setName(name);
    tensors[999].setDtype(dtype);
    return control::encode(b);
  };
  auto ok = plan_with(std::string(control::kMaxNameBytes, 'n'), std::string(control::kMaxIdBytes, 'd'));
  EXPECT_TRUE(control::decode(ok.data(), ok.size(), {}).ok());
  auto long_name = plan_with(std::string(control::kMaxNameBytes + 1, 'n'), "BF16");
  auto d = control::decode(long_name.data(), long_name.size(), {});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Code::kProtocol);
  EXPECT_NE(d.status().message().find("text field 'name' of 1025 bytes exceeds its limit of 1024"), std::string::npos)
      << d.status().message();
  auto long_dtype = plan_with("last.weight", std::string(control::kMaxIdBytes + 1, 'd'));
  d = control::decode(long_dtype.data(), long_dtype.size(), {});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("text field 'dtype' of 256 bytes"), std::string::npos) << d.status().message();
}

TEST(TextLimits, SendersClampLongTextsInsteadOfBeingRefused) {
  auto m = control::make_message(1, 1, [](auto b) { b.initGroupFailed().setReason(std::string(100000, 'r')); });
  auto d = control::decode(m.data(), m.size(), {});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  auto reason = d.value()->envelope().getBody().getGroupFailed().getReason();
  EXPECT_EQ(reason.size(), control::kMaxTextBytes);
  EXPECT_TRUE(std::string(reason.cStr()).ends_with("..."));
}

TEST(Printable, EscapesControlBytesAndCutsLongStrings) {
  EXPECT_EQ(printable("worker-1"), "worker-1");
  EXPECT_EQ(printable("a\nW 123 forged line"), "a\\x0aW 123 forged line");
  EXPECT_EQ(printable(std::string("\x1b[31m\\\xff", 7)), "\\x1b[31m\\x5c\\xff");
  const std::string cut = printable(std::string(1 << 20, 'x'), 16);
  EXPECT_EQ(cut, std::string(16, 'x') + "...(1048576 bytes)");
}

TEST(LogLimiter, AllowsAFewLinesPerKindAndInAllAndCountsTheRest) {
  control::LogLimiter limit(3, std::chrono::seconds(10), 5, 4);
  const auto t0 = control::LogLimiter::Clock::now();
  uint64_t held = 0;
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(limit.allow("dropped frame", &held, t0));
  for (int i = 0; i < 97; ++i) EXPECT_FALSE(limit.allow("dropped frame", &held, t0));
  EXPECT_TRUE(limit.allow("unexpected message", &held, t0)) << "one kind's flood must not silence another";
  EXPECT_TRUE(limit.allow("wrong protocol version", &held, t0));
  EXPECT_FALSE(limit.allow("duplicate worker id", &held, t0)) << "5 lines in all per window";
  EXPECT_TRUE(limit.allow("dropped frame", &held, t0 + std::chrono::seconds(11)));
  EXPECT_EQ(held, 97u) << "the next line says how many were held back";
  EXPECT_TRUE(limit.allow("duplicate worker id", &held, t0 + std::chrono::seconds(11)));
  EXPECT_EQ(held, 1u);
  EXPECT_EQ(limit.total_suppressed(), 98u);
  for (int i = 0; i < 10000; ++i) limit.allow("kind-" + std::to_string(i), &held, t0);
  EXPECT_LE(limit.kinds(), 4u);
}

TEST(Routes, ProbeAndMemberIdentitiesCarryTheWorkerId) {
  auto r = control::parse_route("member/worker-3/00000000deadbeef");
  EXPECT_EQ(r.kind, control::Route::Kind::kMember);
  EXPECT_EQ(r.id, "worker-3");
  EXPECT_EQ(control::parse_route("probe/w/1").kind, control::Route::Kind::kProbe);
  for (const char* other : {"worker-3", "member/worker-3", "member//x", "status-12", "member/w/", "x/w/1"})
    EXPECT_EQ(control::parse_route(other).kind, control::Route::Kind::kOther) << other;
}

TEST(AuthConfig, PlainModeMustBeExplicitOffLoopback) {
  const std::string remote = "control:\n  endpoint: tcp://10.0.0.1:29500\n";
  auto c = load_config_string(remote, "remote.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("remote.yaml:2:13: key 'auth.mode'"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("is not a loopback address"), std::string::npos);
  EXPECT_TRUE(load_config_string(remote + "auth:\n  mode: plain\n").ok());
  EXPECT_TRUE(load_config_string("control:\n  endpoint: tcp://127.0.0.1:1\n").ok());
  auto curve = load_config_string(remote + "auth:\n  mode: curve\n", "c.yaml");
  ASSERT_FALSE(curve.ok());
  EXPECT_NE(curve.status().message().find("auth.publisher_public_key"), std::string::npos)
      << curve.status().message();
  auto rel = load_config_string("auth:\n  mode: curve\n  publisher_public_key: k/p.pub\n  authorized_keys: /abs/a\n",
                                "/etc/pc/d.yaml");
  ASSERT_TRUE(rel.ok()) << rel.status().to_string();
  EXPECT_EQ(rel->auth.publisher_public_key, "/etc/pc/k/p.pub");
  EXPECT_EQ(rel->auth.authorized_keys, "/abs/a");
}

TEST(AuthConfig, ReservedAndInvalidWorkerIdsAreRefused) {
  EXPECT_FALSE(valid_worker_id("publisher"));
  EXPECT_FALSE(valid_worker_id(std::string(65, 'a')));
  EXPECT_FALSE(valid_worker_id("a/b"));
  EXPECT_TRUE(valid_worker_id("worker-1"));
  auto c = load_config_string("publisher:\n  subscribers: [a, publisher]\n", "ids.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("reserved"), std::string::npos) << c.status().message();
}

TEST(KeyFiles, KeygenWritesASecretFileOnlyTheOwnerReadsAndTheLoaderChecksIt) {
  if (!control::curve_unavailable_reason().empty()) GTEST_SKIP() << control::curve_unavailable_reason();
  const std::string dir = test::make_temp_dir("paramcast-keys");
  auto keys = control::generate_key_pair();
  ASSERT_TRUE(keys.ok());
  ASSERT_TRUE(control::write_key_pair(dir + "/w", *keys).ok());
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/w.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_FALSE(control::write_key_pair(dir + "/w", *keys).ok()) << "an existing key is never overwritten";
  auto back = control::read_key_file(dir + "/w.key", true);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->secret_key, keys->secret_key);
  auto pub = control::read_key_file(dir + "/w.pub", true);
  ASSERT_FALSE(pub.ok());
  EXPECT_NE(pub.status().message().find("no secret-key line"), std::string::npos);
  test::write_file(dir, "authorized", "# workers\nworker-1 " + keys->public_key + "   # node a\n\nworker-2 short\n");
  auto list = control::read_authorized_keys(dir + "/authorized", "");
  ASSERT_FALSE(list.ok());
  EXPECT_NE(list.status().message().find("authorized:4: 'short' is not a 40-character Z85 public key"),
            std::string::npos)
      << list.status().message();
  test::remove_tree(dir);
}

// ------------------------------------------------------------ rendezvous store

class StoreScopeTest : public ::testing::Test {
 protected:
  group::HostedStore store_{[this](const std::string& peer, uint64_t, const std::string& key, const std::string& v) {
    replies_.push_back(peer + " " + key + "=" + v);
  }};
  std::vector<std::string> replies_;
};

TEST_F(StoreScopeTest, MembersWriteOnlyTheirOwnRanksKeysOfTheCurrentEpoch) {
  store_.begin_epoch(3);
  EXPECT_TRUE(store_.remote_set("w1", 1, "paramcast/epoch-3/1", "addr").ok());
  EXPECT_TRUE(store_.remote_set("w1", 1, "paramcast/epoch-3/rank_1", "host").ok());
  Status s = store_.remote_set("w1", 1, "paramcast/epoch-3/2", "forged");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a member writes only keys of its own rank 1"), std::string::npos) << s.message();
  s = store_.remote_set("w1", 1, "paramcast/epoch-4/1", "future");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not a key of the forming group's epoch"), std::string::npos) << s.message();
  EXPECT_FALSE(store_.remote_set("w1", 1, "paramcast/epoch-3/x11", "x").ok());  // names rank 11
  EXPECT_FALSE(store_.remote_set("w1", 1, "paramcast/epoch-3/1", "again").ok()) << "a key is written once";
  EXPECT_FALSE(store_.remote_set("gone", -1, "paramcast/epoch-3/1", "x").ok()) << "not in the group";
  EXPECT_FALSE(store_.remote_get("w1", 1, 7, "other/1").ok());
  EXPECT_TRUE(store_.remote_get("w1", 1, 8, "paramcast/epoch-3/rank_1").ok());
  ASSERT_EQ(replies_.size(), 1u);
  EXPECT_EQ(replies_[0], "w1 paramcast/epoch-3/rank_1=host");
}

TEST_F(StoreScopeTest, QuotaPerMemberAndEverythingDroppedWhenTheEpochEnds) {
  store_.begin_epoch(1);
  const std::string big(group::HostedStore::kMemberBytes, 'x');
  Status s = store_.remote_set("w2", 2, "paramcast/epoch-1/2", big);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("quota"), std::string::npos) << s.message();
  EXPECT_TRUE(store_.remote_set("w2", 2, "paramcast/epoch-1/2", std::string(1000, 'a')).ok());
  for (size_t i = 0; i < group::HostedStore::kMemberGets; ++i)
    EXPECT_TRUE(store_.remote_get("w2", 2, i + 1, "paramcast/epoch-1/" + std::to_string(9)).ok());
  EXPECT_FALSE(store_.remote_get("w2", 2, 999, "paramcast/epoch-1/9").ok()) << "parked gets are bounded";
  EXPECT_GT(store_.bytes(), 0u);
  store_.end_epoch();
  EXPECT_EQ(store_.size(), 0u);
  EXPECT_EQ(store_.bytes(), 0u);
  EXPECT_FALSE(store_.remote_set("w2", 2, "paramcast/epoch-1/rank_2", "late").ok()) << "between epochs: nothing";
  store_.begin_epoch(2);
  EXPECT_TRUE(store_.remote_set("w2", 2, "paramcast/epoch-2/2", big.substr(0, 1000)).ok()) << "quota is per epoch";
}

// What Gloo writes to the store for a group of two: every address record has
// the bytes past its sockaddr zeroed, so no uninitialised memory reaches a peer.
TEST(GlooAddressBlobs, CarryNoUnsetBytes) {
  group::HostedStore store([](const std::string&, uint64_t, const std::string&, const std::string&) {});
  std::vector<std::thread> ranks;
  std::vector<Status> results(2);
  std::vector<std::unique_ptr<Communicator>> comms(2);
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      GroupOptions o;
      o.epoch = 1;
      o.rank = r;
      o.world_size = 2;
      o.bootstrap = "paramcast/epoch-1";
      o.init_timeout = std::chrono::seconds(30);
      auto c = create_communicator(o, store);
      results[r] = c.status();
      if (c.ok()) comms[r] = std::move(c.value());
    });
  for (auto& t : ranks) t.join();
  for (const auto& s : results) ASSERT_TRUE(s.ok()) << s.to_string();
  for (const char* key : {"paramcast/epoch-1/0", "paramcast/epoch-1/1"}) {
    auto blob = store.get(key, std::chrono::seconds(1));
    ASSERT_TRUE(blob.ok()) << key;
    constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(ssize_t);
    ASSERT_EQ(blob->size() % kRecord, 0u) << key << ": " << blob->size() << " bytes";
    for (size_t at = 0; at < blob->size(); at += kRecord) {
      sockaddr_storage ss;
      std::memcpy(&ss, blob->data() + at, sizeof ss);
      ASSERT_EQ(ss.ss_family, AF_INET) << key;
      const auto* tail = reinterpret_cast<const unsigned char*>(&ss) + sizeof(sockaddr_in) - 8;  // sin_zero on
      for (size_t i = 0; i < sizeof ss - (sizeof(sockaddr_in) - 8); ++i) EXPECT_EQ(tail[i], 0) << key << " byte " << i;
    }
  }
}

}  // namespace
}  // namespace paramcast
