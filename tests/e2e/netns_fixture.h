// The fixture of tests/e2e/netns_test.cc: a trainer and its workers, each in a
// network namespace of its own (tests/support/netns.h), `paramcast status` probed
// from the trainer's namespace, and the helpers the partition cases share.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>

#include "tests/support/netns.h"
#include "tests/support/process.h"
#include "tests/support/sanitizer.h"

namespace paramcast::netns_test {

using Ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using test::NetworkLab;
using test::Process;

inline constexpr int kWorkers = 3;
inline constexpr int kControlPort = 29500;
inline const Ms kHeartbeatTimeout(1500);

inline double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Waits until `needle` appears in `p`'s output at or after `from`; the
// seconds it took from `t0`, or -1 on timeout.
inline double wait_after(Process& p, size_t from, const std::string& needle, Clock::time_point t0, Ms timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (p.output().find(needle, from) != std::string::npos) return since(t0);
    std::this_thread::sleep_for(Ms(10));
  }
  return -1;
}

// Asks `paramcast status` in a loop, from the trainer's namespace, and keeps
// the worst answer time and every failure.
class StatusProbe {
 public:
  StatusProbe(const NetworkLab& lab, std::string endpoint, std::string yaml)
      : lab_(lab), endpoint_(std::move(endpoint)), yaml_(std::move(yaml)), thread_([this] { run(); }) {}
  ~StatusProbe() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int answered = 0;
  double worst = 0;
  std::string failures;

 private:
  void run() {
    while (!stop_) {
      const auto t0 = Clock::now();
      auto p = Process::start(lab_.exec_path(),
                              lab_.exec_args(0, test::binary("paramcast"),
                                             {"status", endpoint_, "--config", yaml_, "--timeout", "2s"}));
      auto code = p->wait_for(Ms(5000));
      const double took = since(t0);
      if (code == 0) {
        ++answered;
        worst = std::max(worst, took);
      } else {
        failures += "status failed after " + std::to_string(took) + " s:\n" + p->output() + "\n";
      }
      std::this_thread::sleep_for(Ms(100));
    }
  }
  const NetworkLab& lab_;
  const std::string endpoint_;
  const std::string yaml_;  // its auth block: the operator's status key
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// What differs between the deployments of these tests.
struct Deployment {
  std::string bucket_size = "1MiB";
  std::string model_size = "8MiB";
  std::string stall_timeout = "20s";
  std::string init_timeout = "10s";
  std::string quarantine_backoff = "30s";
  std::string publisher_extra;  // more publisher: keys, each line indented by two spaces
};

Deployment sized(const std::string& bucket, const std::string& model, const std::string& stall) {
  Deployment d;
  d.bucket_size = bucket;
  d.model_size = model;
  d.stall_timeout = stall;
  return d;
}

class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    lab_ = NetworkLab::create(kWorkers + 1, &why);
    if (!lab_) GTEST_SKIP() << "cannot build network namespaces here: " << why;
    dir_ = test::make_temp_dir("paramcast-netns");
    endpoint_ = "tcp://" + lab_->address(0) + ":" + std::to_string(kControlPort);
    make_keys();
  }

  // Starts the trainer and the workers, each in its namespace; returns once
  // the first update reached all of them.
  void start(const Deployment& d = {}) {
    yaml_ = test::write_file(dir_, "deploy.yaml", yaml(d));
    trainer_ = Process::start(lab_->exec_path(),
                              lab_->exec_args(0, test::binary("paramcast-trainer"), {"--config", yaml_}));
    ASSERT_TRUE(trainer_->wait_for_output("control endpoint", Ms(10000))) << trainer_->output();
    for (int i = 1; i <= kWorkers; ++i)
      workers_.push_back(Process::start(
          lab_->exec_path(), lab_->exec_args(i, test::binary("paramcast-worker"),
                                             {"--config", yaml_, "--id", id(i), "--endpoint", endpoint_, "--updates", "0"})));
    // Gloo on pc0 (10.77.0.x), control on 10.77.0.1: multi-host addressing works.
    ASSERT_TRUE(trainer_->wait_for_output("to 3 subscribers", Ms(30000))) << trainer_->output() << outputs();
  }

  void TearDown() override {
    workers_.clear();
    trainer_.reset();
    lab_.reset();  // deletes namespaces, veths and the bridge
    if (!dir_.empty()) test::remove_tree(dir_);
  }

  static std::string id(int node) { return "worker-" + std::to_string(node); }

  // CURVE, as deploy/multi-node.yaml: `paramcast keygen` for the publisher,
  // every worker and the operator's status key.
  void make_keys() {
    std::vector<std::string> args = {"keygen", "--dir", dir_ + "/keys", "publisher", "status"};
    for (int i = 1; i <= kWorkers; ++i) args.push_back(id(i));
    auto p = Process::start(test::binary("paramcast"), args);
    ASSERT_EQ(p->wait_for(Ms(20000)), 0) << p->output();
    std::map<std::string, std::string> keys;
    std::istringstream is(p->output());
    std::string name, key;
    while (is >> name >> key) keys[name] = key;
    std::string authorized;
    for (int i = 1; i <= kWorkers; ++i) authorized += id(i) + " " + keys[id(i)] + "\n";
    test::write_file(dir_ + "/keys", "authorized_keys", authorized);
    test::write_file(dir_ + "/keys", "status_keys", "status " + keys["status"] + "\n");
  }

  std::string yaml(const Deployment& d) const {
    return "control:\n  endpoint: " + endpoint_ +
           "\n  heartbeat_interval: 100ms\n  heartbeat_timeout: 1500ms\n  join_timeout: 30s\n"
           "  reconnect_backoff_max: 500ms\n"
           "data_plane:\n  backend: gloo\n  gloo_interface: " + NetworkLab::kInterface +
           "\n  bucket_size: " + d.bucket_size + "\n  checksum: xxh64\n  stall_timeout: " + d.stall_timeout +
           "\n  init_timeout: " + d.init_timeout + "\n"
           "publisher:\n  subscribers: [worker-1, worker-2, worker-3]\n  on_member_loss: continue\n"
           "  quarantine_backoff: " + d.quarantine_backoff + "\n" + d.publisher_extra +
           "trainer:\n  model_size: " + d.model_size + "\n  layers: 8\n  updates: 100000\n  interval: 100ms\n"
           "logging:\n  level: info\n"
           "auth:\n  mode: curve\n  publisher_key: keys/publisher.key\n  publisher_public_key: keys/publisher.pub\n"
           "  authorized_keys: keys/authorized_keys\n  status_keys: keys/status_keys\n"
           "  worker_key: keys/{id}.key\n  status_key: keys/status.key\n";
  }

  std::string outputs() {
    std::string all = "--- trainer:\n" + trainer_->output();
    for (size_t i = 0; i < workers_.size(); ++i) all += "--- " + id(int(i) + 1) + ":\n" + workers_[i]->output();
    return all;
  }

  // Slows the bytes towards the workers so that an update takes ~2 s, waits
  // for the next update to start, and returns once it is well under way.
  void slow_down_and_wait_mid_update() {
    for (int i = 1; i <= kWorkers; ++i) ASSERT_TRUE(lab_->shape(i, "32mbit"));
    const size_t from = trainer_->output().size();
    ASSERT_GE(wait_after(*trainer_, from, "\nupdate v", Clock::now(), Ms(20000)), 0) << trainer_->output();
    std::this_thread::sleep_for(Ms(700));
  }

  void full_speed() {
    for (int i = 1; i <= kWorkers; ++i) lab_->unshape(i);
  }

  // The bounds after a silence that started at `t0` and loses `lost`.
  void expect_named_and_returned(Clock::time_point t0, size_t from, const std::vector<int>& lost) {
    const double limit_named = std::chrono::duration<double>(kHeartbeatTimeout).count() + 1;
    for (int node : lost) {
      const double named = wait_after(*trainer_, from, "member " + id(node) + ": lost", t0, Ms(10000));
      std::printf("[figures] %s named lost %.2f s after the silence began\n", id(node).c_str(), named);
      EXPECT_GE(named, 0) << id(node) << " never named:\n" << outputs();
      EXPECT_LE(named, limit_named) << id(node);
    }
    const double returned = wait_after(*trainer_, from, "FAILED", t0, Ms(25000));
    std::printf("[figures] weight_update returned %.2f s after the silence began\n", returned);
    EXPECT_GE(returned, 0) << "no update failed:\n" << outputs();
    EXPECT_LE(returned, limit_named + 1) << trainer_->output().substr(from);
  }

  // After the heal at `t0`, an update reaches all three workers within 15 s.
  void expect_whole_again(Clock::time_point t0, size_t from) {
    const double whole = wait_after(*trainer_, from, "to 3 subscribers", t0, Ms(30000));
    std::printf("[figures] group whole again %.2f s after the heal\n", whole);
    EXPECT_GE(whole, 0) << "the group never became whole again:\n" << outputs();
    EXPECT_LE(whole, 15.0) << outputs();
  }

  void expect_status_answered(StatusProbe& probe) {
    probe.stop();
    std::printf("[figures] status answered %d times, worst %.2f s\n", probe.answered, probe.worst);
    EXPECT_TRUE(probe.failures.empty()) << probe.failures;
    EXPECT_GE(probe.answered, 3);
    EXPECT_LE(probe.worst, 2.0);
  }

  void cut_trainer_for(Ms partition, bool drop);
  void slow_link_case(int slow);

  std::unique_ptr<NetworkLab> lab_;
  std::string dir_, endpoint_, yaml_;
  std::unique_ptr<Process> trainer_;
  std::vector<std::unique_ptr<Process>> workers_;
};

}  // namespace paramcast::netns_test
