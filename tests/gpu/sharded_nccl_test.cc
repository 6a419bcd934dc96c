// Many-sender updates on GPUs, end to end: paramcast-trainer ranks holding
// only their rows of the synthetic model in a GPU's memory, paramcast-worker
// engines receiving into the GPU (whole tensors, or their tensor-parallel
// slices), over NCCL (ncclSend/ncclRecv groups, round by round). Every
// engine verifies every byte of every version against the generator. Skips
// without a CUDA device (tests/gpu/run.sh runs it: the sharded_nccl stage).
// On one GPU the processes share it, each with its own NCCL_HOSTID.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <vector>

#include "common/data/communicator.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using std::chrono::seconds;
using test::Process;

struct Engine {
  std::string id;
  std::vector<std::string> flags;  // beyond --config, --id, --endpoint, --updates
};

struct Outcome {
  std::string trainer, rank1;
  std::vector<std::string> engines;
  int trainer_code = -1, rank1_code = -1;
  std::vector<int> engine_codes;
};

std::string config_yaml(size_t engines, int updates) {
  std::string workers;
  for (size_t i = 0; i < engines; ++i) workers += (i ? ", worker-" : "worker-") + std::to_string(i + 1);
  return "control:\n"
         "  endpoint: tcp://127.0.0.1:*\n"
         "  heartbeat_interval: 100ms\n"
         "  heartbeat_timeout: 3s\n"
         "  join_timeout: 60s\n"
         "data_plane:\n"
         "  backend: nccl\n"
         "  checksum: xxh64-blocks\n"
         "  stall_timeout: 60s\n"
         "  init_timeout: 120s\n"
         "publisher:\n"
         "  subscribers: " + std::to_string(engines) + "\n"
         "  ranks: 2\n"
         "  device: cuda:0\n"
         "  update_timeout: 120s\n"
         "subscriber:\n"
         "  device: cuda:0\n"
         "trainer:\n"
         "  model_size: 64MiB\n"
         "  layers: 8\n"
         "  updates: " + std::to_string(updates) + "\n"
         "  interval: 0s\n"
         "logging:\n"
         "  level: info\n";
}

// Runs rank 0, rank 1 and the engines to the end of `updates` updates
// (processes still running `engine_wait` after rank 0 ended are killed).
Outcome run_job(const std::vector<Engine>& engines, int updates, int engine_wait = 60) {
  Outcome o;
  const std::string dir = test::make_temp_dir("paramcast-sharded-nccl");
  const std::string config = test::write_file(dir, "deploy.yaml", config_yaml(engines.size(), updates));
  const std::string endpoint_file = dir + "/endpoint";
  auto host = [](const std::string& who) { return "NCCL_HOSTID=paramcast-sharded-" + who; };
  auto trainer = Process::start(test::binary("paramcast-trainer"),
                                {"--config", config, "--endpoint-file", endpoint_file, "--updates",
                                 std::to_string(updates)},
                                {host("trainer-0")});
  EXPECT_TRUE(trainer && trainer->wait_for_output("control endpoint", seconds(60)))
      << (trainer ? trainer->output() : "");
  std::string endpoint;
  std::ifstream(endpoint_file) >> endpoint;
  EXPECT_FALSE(endpoint.empty());
  auto rank1 = Process::start(test::binary("paramcast-trainer"),
                              {"--config", config, "--rank", "1", "--endpoint", endpoint, "--updates",
                               std::to_string(updates)},
                              {host("trainer-1")});
  std::vector<std::unique_ptr<Process>> workers;
  for (const auto& e : engines) {
    std::vector<std::string> args = {"--config", config, "--id", e.id, "--endpoint", endpoint, "--updates",
                                     std::to_string(updates)};
    args.insert(args.end(), e.flags.begin(), e.flags.end());
    workers.push_back(Process::start(test::binary("paramcast-worker"), args, {host(e.id)}));
  }
  auto code = trainer->wait_for(seconds(240));
  o.trainer_code = code.value_or(-1);
  o.trainer = trainer->output();
  code = rank1->wait_for(seconds(engine_wait));
  o.rank1_code = code.value_or(-1);
  o.rank1 = rank1->output();
  for (auto& w : workers) {
    code = w->wait_for(seconds(engine_wait));
    o.engine_codes.push_back(code.value_or(-1));
    o.engines.push_back(w->output());
  }
  test::remove_tree(dir);
  return o;
}

void expect_all_verified(const Outcome& o, const std::vector<Engine>& engines, int updates) {
  const std::string all = "--- trainer rank 0:\n" + o.trainer + "--- trainer rank 1:\n" + o.rank1;
  EXPECT_EQ(o.trainer_code, 0) << all;
  EXPECT_NE(o.trainer.find("paramcast-trainer: " + std::to_string(updates) + " updates, 0 failed"), std::string::npos)
      << all;
  EXPECT_EQ(o.rank1_code, 0) << all;
  for (size_t i = 0; i < engines.size(); ++i) {
    EXPECT_EQ(o.engine_codes[i], 0) << engines[i].id << ":\n" << o.engines[i] << all;
    EXPECT_NE(o.engines[i].find(engines[i].id + ": v" + std::to_string(updates) + " verified"), std::string::npos)
        << engines[i].id << ":\n" << o.engines[i] << all;
    EXPECT_EQ(o.engines[i].find("differs"), std::string::npos) << o.engines[i];
  }
  // The figures, for the record (tests/gpu/run.sh keeps this log).
  std::istringstream lines(o.trainer);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("update v", 0) == 0) std::printf("sharded_nccl %s\n", line.c_str());
}

class ShardedNcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)";
    if (const std::string why = backend_unavailable_reason(Backend::kNccl); !why.empty())
      GTEST_SKIP() << "nccl backend cannot run here: " << why;
  }
};

// Two trainer ranks, each holding half the rows of every tensor on the GPU,
// to two engines that register every tensor whole on the GPU: each byte
// comes from the rank that holds it, straight into the engines' buffers.
TEST_F(ShardedNcclTest, TwoTrainerRanksToTwoWholeEnginesBitExact) {
  const std::vector<Engine> engines = {{"worker-1", {}}, {"worker-2", {}}};
  expect_all_verified(run_job(engines, 3), engines, 3);
}

// The same trainer ranks to a tensor-parallel engine pair (TP=2: column-
// parallel weights cut along dim 0, row-parallel along dim 1, packed and
// unpacked on the GPU) and an engine that takes every tensor whole (the
// pieces both want are forwarded along them).
TEST_F(ShardedNcclTest, TrainerRanksToTensorParallelSlicesAndAWholeEngineBitExact) {
  const std::vector<Engine> engines = {
      {"worker-1", {"--tp", "2", "--tp-rank", "0"}}, {"worker-2", {"--tp", "2", "--tp-rank", "1"}}, {"worker-3", {}}};
  expect_all_verified(run_job(engines, 3), engines, 3);
}

// A CUDA engine whose tensors go to its callback cannot take a sharded
// update (its pieces land in place on the GPU): the plan is refused before
// any byte moves, naming the engine and a tensor, and the trainer says so.
TEST_F(ShardedNcclTest, ACallbackEngineOnAGpuIsRefusedBeforeAnyByteMoves) {
  const std::vector<Engine> engines = {{"worker-1", {"--mode", "callback"}}};
  Outcome o = run_job(engines, 1, 5);
  EXPECT_EQ(o.trainer_code, 1) << o.trainer;
  EXPECT_NE(o.trainer.find("update v1 FAILED"), std::string::npos) << o.trainer;
  EXPECT_NE(o.trainer.find("worker-1"), std::string::npos) << o.trainer;
  EXPECT_NE(o.trainer.find("got the tensor callback"), std::string::npos) << o.trainer;
}

}  // namespace
}  // namespace paramcast
