// A trainer and an inference engine written against the installed headers
// (<paramcast/...>) and libparamcast.so: the smallest complete use of the
// C++ API.
//
//   weights_roundtrip publish ENDPOINT_FILE UPDATES   binds tcp://127.0.0.1:*, writes the
//                                                     endpoint to ENDPOINT_FILE, waits for one
//                                                     engine, sends UPDATES versions
//   weights_roundtrip engine ENDPOINT UPDATES         registers the same two tensors, checks
//                                                     every element of every version
//
// Both exit 0 only when every version arrived bit-exact.
#include <paramcast/publisher.h>
#include <paramcast/subscriber.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr uint64_t kElements = 1 << 18;   // 1 MiB of float32 per tensor

// The value element i of tensor t holds at version v: every version changes
// every element.
float expected(int t, uint64_t i, uint64_t v) { return static_cast<float>((i * 7 + t * 13 + v * 101) % 65521); }

std::string config_yaml(const std::string& endpoint) {
  return "control:\n  endpoint: " + endpoint +
         "\n  heartbeat_interval: 250ms\n  heartbeat_timeout: 5s\n  join_timeout: 60s\n"
         "data_plane:\n  backend: gloo\n  gloo_hostname: 127.0.0.1\n  checksum: xxh64\n"
         "publisher:\n  subscribers: 1\n  device: cpu\nsubscriber:\n  device: cpu\n"
         "auth:\n  mode: plain\n";
}

std::vector<paramcast::TensorSpec> specs() {
  return {{"model.embed.weight", paramcast::DType::kF32, {kElements}},
          {"model.head.weight", paramcast::DType::kF32, {512, kElements / 512}}};
}

int fail(const std::string& what) {
  std::fprintf(stderr, "weights_roundtrip: %s\n", what.c_str());
  return 1;
}

int publish(const std::string& endpoint_file, uint64_t updates) {
  auto config = paramcast::load_config_string(config_yaml("tcp://127.0.0.1:*"), "weights_roundtrip");
  if (!config.ok()) return fail(config.status().to_string());
  auto pub = paramcast::Publisher::create(config.value());
  if (!pub.ok()) return fail(pub.status().to_string());
  std::ofstream(endpoint_file) << pub.value()->endpoint() << "\n";
  if (auto s = pub.value()->start(); !s.ok()) return fail("start: " + s.to_string());
  std::vector<std::vector<float>> data(2, std::vector<float>(kElements));
  for (uint64_t v = 1; v <= updates; ++v) {
    std::vector<paramcast::TensorView> views;
    for (int t = 0; t < 2; ++t) {
      for (uint64_t i = 0; i < kElements; ++i) data[t][i] = expected(t, i, v);
      views.push_back({specs()[t], data[t].data(), paramcast::Device::cpu()});
    }
    paramcast::UpdateResult r = pub.value()->weight_update(views, v);
    if (!r.ok()) return fail("update " + std::to_string(v) + ": " + r.status.to_string());
    std::printf("published version %llu\n", static_cast<unsigned long long>(v));
  }
  return 0;
}

int engine(const std::string& endpoint, uint64_t updates) {
  auto config = paramcast::load_config_string(config_yaml(endpoint), "weights_roundtrip");
  if (!config.ok()) return fail(config.status().to_string());
  auto sub = paramcast::Subscriber::create(config.value(), "engine-0");
  if (!sub.ok()) return fail(sub.status().to_string());
  std::vector<std::vector<float>> data(2, std::vector<float>(kElements));
  for (int t = 0; t < 2; ++t) {
    if (auto s = sub.value()->register_tensor({specs()[t], data[t].data(), paramcast::Device::cpu()}); !s.ok())
      return fail(s.to_string());
  }
  // Checked where the engine would use its weights: after each update's bytes
  // are in place and before it reports Applied (the next update cannot begin
  // writing into the buffers meanwhile). A mismatch fails the update.
  sub.value()->on_update_end([&data](uint64_t version, const paramcast::Status& status) -> paramcast::Status {
    if (!status.ok()) return paramcast::Status();
    for (int t = 0; t < 2; ++t)
      for (uint64_t i = 0; i < kElements; ++i)
        if (data[t][i] != expected(t, i, version))
          return paramcast::Status(paramcast::Code::kInternal, specs()[t].name + "[" + std::to_string(i) +
                                                                    "] differs at version " + std::to_string(version));
    return paramcast::Status();
  });
  if (auto s = sub.value()->start(); !s.ok()) return fail("start: " + s.to_string());
  for (uint64_t v = 1; v <= updates; ++v) {
    auto report = sub.value()->next_report(std::chrono::seconds(120));
    if (!report) return fail("no update " + std::to_string(v) + " within 120 s");
    if (!report->status.ok()) return fail("update " + std::to_string(v) + ": " + report->status.to_string());
    if (report->version != v) return fail("got version " + std::to_string(report->version) + ", expected " + std::to_string(v));
    std::printf("engine has version %llu, %s\n", static_cast<unsigned long long>(v),
                sub.value()->state().to_string().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return fail("usage: weights_roundtrip publish ENDPOINT_FILE UPDATES | engine ENDPOINT UPDATES");
  const std::string mode = argv[1];
  const uint64_t updates = std::strtoull(argv[3], nullptr, 10);
  if (mode == "publish") return publish(argv[2], updates);
  if (mode == "engine") return engine(argv[2], updates);
  return fail("unknown mode " + mode);
}
