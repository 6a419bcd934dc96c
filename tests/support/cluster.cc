#include "tests/support/cluster.h"

#include "common/synthetic_model.h"

namespace paramcast::test {

std::chrono::milliseconds test_heartbeat_timeout() { return std::chrono::milliseconds(1500); }

Config test_config(int subscribers) {
  Config c;
  c.control.endpoint = "tcp://127.0.0.1:*";
  c.control.heartbeat_interval = std::chrono::milliseconds(100);
  c.control.heartbeat_timeout = test_heartbeat_timeout();
  c.control.join_timeout = std::chrono::seconds(30);
  c.control.reconnect_backoff_max = std::chrono::milliseconds(500);
  c.data_plane.bucket_bytes = 1 << 20;
  c.data_plane.direct_min_bytes = 64 << 10;
  c.data_plane.checksum = Checksum::kXxh64;  // tests exercise the integrity check
  c.data_plane.stall_timeout = std::chrono::seconds(20);
  c.data_plane.init_timeout = std::chrono::seconds(30);
  c.publisher.subscriber_count = subscribers;
  c.publisher.update_timeout = std::chrono::seconds(60);
  c.trainer.model_bytes = 4 << 20;
  c.log_level = LogLevel::kWarn;
  return c;
}

std::string test_config_yaml(int subscribers, const std::string& extra_publisher, const std::string& extra_data_plane) {
  // Appended piece by piece: GCC 12 reports a false -Wrestrict for
  // "literal" + std::string&& at -O3.
  std::string yaml =
      "control:\n"
      "  endpoint: tcp://127.0.0.1:*\n"
      "  heartbeat_interval: 100ms\n"
      "  heartbeat_timeout: ";
  yaml += std::to_string(test_heartbeat_timeout().count());
  return yaml +
         "ms\n"
         "  join_timeout: 30s\n"
         "  reconnect_backoff_max: 500ms\n"
         "data_plane:\n"
         "  backend: gloo\n"
         "  bucket_size: 1MiB\n"
         "  direct_min_size: 64KiB\n"
         "  checksum: xxh64\n"
         "  stall_timeout: 20s\n"
         "  init_timeout: 30s\n" +
         extra_data_plane +
         "publisher:\n"
         "  subscribers: " +
         std::to_string(subscribers) + "\n" + extra_publisher +
         "trainer:\n"
         "  model_size: 4MiB\n"
         "  layers: 32\n"
         "  updates: 3\n"
         "logging:\n"
         "  level: info\n";
}

std::string with_heartbeat_timeout(std::string yaml, std::chrono::milliseconds timeout) {
  const std::string key = "  heartbeat_timeout: ";
  const size_t at = yaml.find(key);
  if (at == std::string::npos) return yaml;
  const size_t end = yaml.find('\n', at);
  std::string line = key;
  line += std::to_string(timeout.count());
  line += "ms";
  return yaml.replace(at, end - at, line);
}

HostTensors make_tensors(const std::vector<TensorSpec>& specs) {
  HostTensors t;
  t.specs = specs;
  for (const auto& s : specs) t.bytes.emplace_back(s.nbytes().value());
  return t;
}

std::vector<TensorView> HostTensors::views() {
  std::vector<TensorView> v;
  for (size_t i = 0; i < specs.size(); ++i) v.push_back(TensorView{specs[i], bytes[i].data(), Device::cpu()});
  return v;
}

void HostTensors::fill(uint64_t version, uint64_t seed, ModelChanges changes) {
  for (size_t i = 0; i < specs.size(); ++i) fill_synthetic(specs[i], seed, version, bytes[i].data(), bytes[i].size(), changes);
}

}  // namespace paramcast::test
