// Test support: a Publisher in this process and paramcast-worker processes,
// all configured from one YAML file on an ephemeral port.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace paramcast::test {

class WorkerClusterTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("paramcast-cluster"); }
  void TearDown() override {
    workers_.clear();
    if (pub_) pub_->shutdown();
    pub_.reset();
    remove_tree(dir_);
  }

  // Writes the YAML and creates the publisher (not started).
  void make_publisher(const std::string& yaml) {
    yaml_path_ = write_file(dir_, "deploy.yaml", yaml);
    auto cfg = load_config_file(yaml_path_);
    ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
    config_ = cfg.value();
    auto pub = Publisher::create(config_);
    ASSERT_TRUE(pub.ok()) << pub.status().to_string();
    pub_ = std::move(pub.value());
  }

  Process& spawn_worker(const std::string& id, const std::vector<std::string>& env = {},
                        const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--config", yaml_path_, "--id", id, "--endpoint", pub_->endpoint(), "--updates", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = Process::start(binary("paramcast-worker"), args, env);
    EXPECT_TRUE(p != nullptr);
    Process& ref = *p;
    workers_[id] = std::move(p);
    return ref;
  }

  // Every worker's output, for failure messages.
  std::string outputs() {
    std::string all;
    for (auto& [id, p] : workers_) all += "--- " + id + ":\n" + p->output();
    return all;
  }

  // The synthetic model paramcast-worker expects, at `version`.
  UpdateResult publish(uint64_t version) {
    if (model_.specs.empty())
      model_ = make_tensors(synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers,
                                                 config_.trainer.dtype));
    model_.fill(version, config_.trainer.seed, config_.trainer.changes);
    return pub_->weight_update(model_.views(), version);
  }

  // Waits for a membership event of `kind` for `id`; other events are kept in seen_.
  bool wait_event(MemberEvent::Kind kind, const std::string& id, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      while (auto e = pub_->poll_event()) {
        seen_.push_back(*e);
        if (e->kind == kind && e->worker_id == id) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  std::string dir_, yaml_path_;
  Config config_;
  std::unique_ptr<Publisher> pub_;
  std::map<std::string, std::unique_ptr<Process>> workers_;
  HostTensors model_;
  std::vector<MemberEvent> seen_;
};

}  // namespace paramcast::test
