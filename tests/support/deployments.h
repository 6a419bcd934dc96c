// Whole-deployment scenarios more than one suite runs: a deployment file
// through `paramcast launch` with every worker verified, and a publisher
// SIGKILLed in the middle of an update.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"
#include "tests/support/sanitizer.h"

namespace paramcast::test {

// Runs `paramcast launch deploy/<file>` and expects every one of its 8 roles
// to succeed, each of the 7 workers with 5 verified updates. Returns the
// launch's output for further checks. Under a sanitizer the file's model
// is a quarter of its size (the same tensors, fewer bytes each).
inline std::string launch_and_expect_every_worker_verified(const std::string& deploy_file) {
  std::string path = std::string(PARAMCAST_SOURCE_DIR) + "/" + deploy_file, dir;
  if (kSanitized) {
    std::ifstream in(path);
    std::string yaml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string from = "model_size: 128MiB";
    const size_t at = yaml.find(from);
    EXPECT_NE(at, std::string::npos) << deploy_file << " no longer says " << from;
    if (at != std::string::npos) yaml.replace(at, from.size(), "model_size: 32MiB");
    dir = make_temp_dir("paramcast-deploy");
    path = dir + "/" + deploy_file.substr(deploy_file.rfind('/') + 1);
    std::ofstream(path) << yaml;
  }
  auto launch = Process::start(binary("paramcast"), {"launch", path});
  auto code = launch->wait_for(std::chrono::seconds(300));
  if (!dir.empty()) remove_tree(dir);
  EXPECT_TRUE(code.has_value()) << "launch hung:\n" << launch->output();
  const std::string out = launch->output();
  EXPECT_EQ(code.value_or(-1), 0) << out;
  EXPECT_NE(out.find("8 roles, all succeeded"), std::string::npos) << out;
  EXPECT_NE(out.find("paramcast-trainer: 5 updates, 0 failed"), std::string::npos) << out;
  for (int i = 1; i <= 7; ++i) {
    const std::string w = "worker-" + std::to_string(i);
    EXPECT_NE(out.find("[" + w + " ] " + w + ": 5 updates verified, 0 failed; state version 5, consistent"),
              std::string::npos)
        << w << ":\n" << out;
  }
  return out;
}

// A trainer (`yaml_path`, 3 workers) that stalls after bucket 1 of v2 is
// SIGKILLed once all three workers hold part of v2. Expects each worker to
// notice within heartbeat_timeout + 2 s, dirty at v2 and still running.
// Returns the workers and the endpoint the dead trainer had.
struct KilledMidUpdate {
  std::vector<std::unique_ptr<Process>> workers;
  std::string endpoint;
};
inline KilledMidUpdate kill_publisher_mid_update(const std::string& dir, const std::string& yaml_path,
                                                 const Config& config) {
  KilledMidUpdate k;
  const std::string endpoint_file = dir + "/endpoint";
  auto trainer = Process::start(binary("paramcast-trainer"),
                                {"--config", yaml_path, "--endpoint-file", endpoint_file, "--updates", "5"},
                                {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=2:1"});
  EXPECT_TRUE(trainer->wait_for_output("control endpoint", std::chrono::seconds(10))) << trainer->output();
  std::ifstream(endpoint_file) >> k.endpoint;
  EXPECT_FALSE(k.endpoint.empty());
  if (k.endpoint.empty()) return k;
  for (int i = 1; i <= 3; ++i)
    k.workers.push_back(Process::start(binary("paramcast-worker"),
                                       {"--config", yaml_path, "--id", "worker-" + std::to_string(i), "--endpoint",
                                        k.endpoint, "--updates", "0"}));
  for (auto& w : k.workers)
    if (!w->wait_for_output("v1 verified", std::chrono::seconds(20))) {
      ADD_FAILURE() << w->output();
      return k;
    }
  if (!trainer->wait_for_output("stalling after bucket 1 of v2", std::chrono::seconds(20))) {
    ADD_FAILURE() << trainer->output();
    return k;
  }
  // The trainer stalls once it has issued bucket 1; the engines take v2's
  // first bytes when they get to it (on a loaded machine, later). Killed
  // before that, they would rightly still hold v1 consistent. Their
  // heartbeats say when all three hold part of v2.
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
       std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(std::chrono::milliseconds(100))) {
    auto status = Process::start(binary("paramcast"), {"status", k.endpoint, "--json"});
    EXPECT_EQ(status->wait_for(std::chrono::seconds(10)), 0) << status->output();
    if (count(status->output(), "\"state\":\"dirty\"") == 3) break;
  }
  trainer->kill(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  const auto bound = config.control.heartbeat_timeout + std::chrono::seconds(2);
  for (auto& w : k.workers) {
    EXPECT_TRUE(w->wait_for_output("publisher lost", bound + std::chrono::seconds(1))) << w->output();
    EXPECT_LE(std::chrono::steady_clock::now() - killed, bound);
    bool warned = false;
    for (const auto& l : log_lines(w->output()))
      warned |= l.level == 'W' && l.member.rfind("worker-", 0) == 0 && l.message.rfind("publisher lost (silent", 0) == 0;
    EXPECT_TRUE(warned) << "a publisher lost without a word is a warning:\n" << w->output();
    // The state it keeps is its next line (a loaded machine may print it a
    // little after the first).
    EXPECT_TRUE(w->wait_for_output("dirty (v2 incomplete, last consistent v1)", std::chrono::seconds(5)))
        << w->output();
    EXPECT_TRUE(w->running());  // the engine and its weights stay
  }
  return k;
}

}  // namespace paramcast::test
