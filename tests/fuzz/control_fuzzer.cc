// libFuzzer target: arbitrary bytes as one inbound control frame, fed to the
// decoder and dispatcher of both the publisher (as if from a subscriber) and
// the subscriber (as if from the publisher), and of a second publisher in
// auth.mode curve, whose frames claim a matching, a foreign or no key (the
// User-Id the ZAP handler would attach), and to the plan decoder alone.
// Any crash, sanitizer report or
// hang is a bug; each one found becomes a test in tests/fuzz/regressions/.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "common/control/auth.h"
#include "common/control/codec.h"
#include "common/plan_proto.h"

#include "common/log.h"
#include "inference_side/subscriber.h"
#include "trainer_side/publisher.h"

using namespace paramcast;

namespace {
// Key files for a publisher and worker-1/worker-2, in a fresh directory.
// Removed again when the fuzzer exits.
char dir[] = "/tmp/paramcast-fuzz-keysXXXXXX";
void remove_keys() {
  for (const char* f : {"publisher.key", "publisher.pub", "worker-1.key", "worker-1.pub", "worker-2.key",
                        "worker-2.pub", "authorized_keys"})
    std::remove((std::string(dir) + "/" + f).c_str());
  rmdir(dir);
}

AuthOptions curve_keys() {
  if (!mkdtemp(dir)) std::abort();
  std::atexit(remove_keys);
  AuthOptions a;
  a.mode = AuthMode::kCurve;
  std::string authorized;
  for (const char* name : {"publisher", "worker-1", "worker-2"}) {
    auto keys = control::generate_key_pair();
    if (!keys.ok() || !control::write_key_pair(std::string(dir) + "/" + name, *keys).ok()) std::abort();
    if (std::string(name) != "publisher") authorized += std::string(name) + " " + keys->public_key + "\n";
  }
  std::ofstream(std::string(dir) + "/authorized_keys") << authorized;
  a.publisher_key = std::string(dir) + "/publisher.key";
  a.publisher_public_key = std::string(dir) + "/publisher.pub";
  a.authorized_keys = std::string(dir) + "/authorized_keys";
  return a;
}

struct Targets {
  std::unique_ptr<Publisher> publisher;
  std::unique_ptr<Publisher> curve_publisher;  // auth.mode curve: frames carry a User-Id
  std::unique_ptr<Subscriber> subscriber;
  Targets() {
    set_log_level(LogLevel::kOff);
    Config cfg;
    cfg.control.endpoint = "tcp://127.0.0.1:*";
    cfg.publisher.subscriber_ids = {"worker-1", "worker-2"};
    cfg.publisher.subscriber_count = 2;
    publisher = std::move(Publisher::create(cfg).value());
    subscriber = std::move(Subscriber::create(cfg, "worker-1").value());
    cfg.auth = curve_keys();
    curve_publisher = std::move(Publisher::create(cfg).value());
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Targets* t = new Targets();
  // The first byte picks the peer, so that member and stranger paths both run.
  const char* peer = size > 0 && (data[0] & 1) ? "member/worker-1/0000000000000001" : "probe/worker-2/0000000000000001";
  t->publisher->inject_control_frame(peer, data, size);
  // With CURVE: the key matches the claimed id, belongs to another worker, or is absent.
  const char* users[] = {"worker-1", "worker-2", "", "status:ops"};
  t->curve_publisher->inject_control_frame(peer, data, size, users[size > 0 ? (data[0] >> 1) & 3 : 0]);
  t->subscriber->inject_control_frame(data, size);
  // The plan decoder on its own, whatever state the subscriber is in (it
  // reads plans only once joined): every size a peer sends is checked and
  // summed with overflow checks (common/plan_proto.cc).
  auto decoded = control::decode(data, size, control::DecodeLimits{});
  if (decoded.ok()) {
    try {
      auto body = decoded.value()->envelope().getBody();
      if (body.isPlan()) (void)plan_from_proto(body.getPlan());
    } catch (const kj::Exception&) {
    }
  }
  return 0;
}
