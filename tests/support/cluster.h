// Test support: configs with ephemeral ports and short timeouts, and an
// in-process cluster (one Publisher + N Subscribers on real sockets).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/synthetic_model.h"
#include "inference_side/subscriber.h"
#include "trainer_side/publisher.h"

namespace paramcast::test {

// How long a silent member is given before it is declared lost (1.5 s):
// short, so that the loss tests end soon; every bound a loss test checks
// is derived from it.
std::chrono::milliseconds test_heartbeat_timeout();

// Gloo on loopback, ephemeral control port, timeouts sized for tests.
Config test_config(int subscribers);

// A YAML rendering of test_config for tools started as processes.
std::string test_config_yaml(int subscribers, const std::string& extra_publisher = "",
                             const std::string& extra_data_plane = "");
// `yaml` (a test_config_yaml) with another control.heartbeat_timeout.
std::string with_heartbeat_timeout(std::string yaml, std::chrono::milliseconds timeout);

// Host buffers holding one tensor set, filled from the synthetic generator.
struct HostTensors {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<TensorView> views();
  void fill(uint64_t version, uint64_t seed = 1, ModelChanges changes = ModelChanges::kEvery);
};
HostTensors make_tensors(const std::vector<TensorSpec>& specs);

}  // namespace paramcast::test
