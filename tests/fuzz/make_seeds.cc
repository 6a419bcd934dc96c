// Writes one valid control frame of each kind into a directory: the fuzzer's
// seed corpus (checked in under tests/fuzz/corpus/).
#include <cstdio>
#include <fstream>
#include <string>

#include "common/control/messages.h"
#include "common/plan.h"
#include "common/plan_proto.h"

using namespace paramcast;

namespace {
void write(const std::string& dir, const std::string& name, const zmq::message_t& m) {
  std::ofstream(dir + "/" + name, std::ios::binary).write(static_cast<const char*>(m.data()), m.size());
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  using control::make_message;
  write(dir, "hello", make_message(0, 7, [](auto b) {
    auto h = b.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerId("worker-1");
    h.setHost("host");
    h.setPid(42);
    h.initCapabilities(1).set(0, "xxh64");
  }));
  write(dir, "welcome", make_message(0, 9, [](auto b) { b.initWelcome().setProtocolVersion(proto::PROTOCOL_VERSION); }));
  write(dir, "welcome_probe", make_message(0, 9, [](auto b) { b.initWelcome().setProbe(true); }));
  write(dir, "link_check", make_message(0, 9, [](auto b) {
    auto c = b.initLinkCheck();
    const std::string token(16, 't');
    c.setToken(kj::arrayPtr(reinterpret_cast<const kj::byte*>(token.data()), token.size()));
    c.setEndpoint("127.0.0.1:9");
    c.setBytes(1024);
    c.setTimeoutMs(500);
  }));
  write(dir, "reject", make_message(0, 9, [](auto b) {
    auto r = b.initReject();
    r.setCode(proto::RejectCode::NOT_MEMBER);
    r.setText("not a member");
  }));
  write(dir, "join_group", make_message(1, 9, [](auto b) {
    auto j = b.initJoinGroup();
    j.setRank(1);
    j.setWorldSize(3);
    j.setBootstrap(kj::arrayPtr(reinterpret_cast<const kj::byte*>("paramcast/epoch-1"), 17));
    auto m = j.initMembers(3);
    m.set(0, "publisher");
    m.set(1, "worker-1");
    m.set(2, "worker-2");
    j.setInitTimeoutMs(1);
    j.setOpTimeoutMs(1);
  }));
  write(dir, "group_ready", make_message(1, 7, [](auto b) { b.initGroupReady().setRank(1); }));
  write(dir, "group_failed", make_message(1, 7, [](auto b) { b.initGroupFailed().setReason("x"); }));
  write(dir, "heartbeat", make_message(1, 7, [](auto b) { b.initHeartbeat().setWeightVersion(3); }));
  write(dir, "leave", make_message(1, 7, [](auto b) { b.initLeave().setReason("bye"); }));
  write(dir, "store_set", make_message(1, 7, [](auto b) {
    auto s = b.initStoreSet();
    s.setKey("k");
    s.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>("v"), 1));
  }));
  write(dir, "store_get", make_message(1, 7, [](auto b) { b.initStoreGet().setKey("k"); }));
  write(dir, "store_value", make_message(1, 9, [](auto b) { b.initStoreValue().setKey("k"); }));
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {4, 4}}, {"b", DType::kBF16, {3}}, {"c", DType::kU8, {5000}}};
  DataPlaneOptions o;
  o.bucket_bytes = 4096;
  o.direct_min_bytes = 1024;
  auto plan = build_plan(1, specs, o).value();
  write(dir, "plan", make_message(0, 9, [&](auto b) { plan_to_proto(plan, b.initPlan()); }));
  write(dir, "plan_precommitted", make_message(0, 9, [&](auto b) {
    auto p = b.initPlan();
    plan_to_proto(plan, p);
    p.setPrecommitted(true);
  }));
  // A sharded (many-sender) plan: rank 0 holds rows 0-1 of `a`, rank 1 the
  // rest and `b` and `c`; rank 2 wants a slice of `a`.
  UpdatePlan sharded = plan;
  sharded.buckets.clear();
  sharded.sharded = true;
  sharded.holders = {{0, 0, {0, 0}, {2, 4}, 0}, {1, 0, {2, 0}, {2, 4}, 3}, {1, 1, {0}, {3}, 3}, {1, 2, {0}, {5000}, 3}};
  sharded.wanters = {{2, 0, {0, 0}, {4, 2}, 0}, {2, 1, {0}, {3}, 0}, {2, 2, {0}, {5000}, 0}};
  write(dir, "plan_sharded", make_message(0, 9, [&](auto b) { plan_to_proto(sharded, b.initPlan()); }));
  for (const char* kind : {"holdings", "wants"})
    write(dir, kind, make_message(1, 7, [&](auto b) {
      auto h = std::string(kind) == "holdings" ? b.initHoldings() : b.initWants();
      h.setSeq(2);
      h.setStep(2);
      auto t = h.initTensors(1);
      t[0].setName("a");
      t[0].setDtype("F32");
      t[0].initShape(2).set(0, 4);
      t[0].getShape().set(1, 4);
      t[0].setNbytes(64);
      auto r = h.initHolds(1);
      r[0].setTensor(0);
      r[0].initOffsets(2).set(0, 2);
      r[0].initLengths(2).set(0, 2);
      r[0].getLengths().set(1, 4);
    }));
  write(dir, "plan_accept", make_message(1, 7, [](auto b) { b.initPlanAccept().setVersion(1); }));
  write(dir, "plan_reject", make_message(1, 7, [](auto b) {
    auto r = b.initPlanReject();
    r.setVersion(1);
    auto m = r.initMismatches(1)[0];
    m.setName("a");
    m.setExpected("[4]");
    m.setGot("[5]");
  }));
  write(dir, "commit", make_message(0, 9, [](auto b) { b.initCommit().setVersion(1); }));
  write(dir, "abandon", make_message(0, 9, [](auto b) { b.initAbandon().setVersion(1); }));
  write(dir, "bucket_checksums", make_message(0, 9, [](auto b) {
    auto c = b.initBucketChecksums();
    c.setVersion(1);
    c.initValues(2).set(1, 99);
  }));
  write(dir, "applied", make_message(1, 7, [](auto b) {
    auto a = b.initApplied();
    a.setVersion(1);
    a.setOk(true);
  }));
  write(dir, "status_request", make_message(0, 7, [](auto b) { b.initStatusRequest().setRequestId(1); }));
  write(dir, "status_reply", make_message(0, 9, [](auto b) { b.initStatusReply().initMembers(1)[0].setWorkerId("w"); }));
  return 0;
}
