// Many-sender updates on GPUs, end to end: paramcast-trainer ranks holding
// only their rows of the synthetic model in a GPU's memory, paramcast-worker
// engines receiving into the GPU (whole tensors, or their tensor-parallel
// slices), over NCCL (ncclSend/ncclRecv groups, round by round). Every
// engine verifies every byte of every version against the generator. Skips
// without a CUDA device (tests/gpu/run.sh runs it: the sharded_nccl stage).
// On one GPU the processes share it, each with its own NCCL_HOSTID.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <thread>
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

std::string config_yaml(size_t engines, int updates, const std::string& model_size = "64MiB") {
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
         "  model_size: " + model_size + "\n"
         "  layers: 8\n"
         "  updates: " + std::to_string(updates) + "\n"
         "  interval: 0s\n"
         "logging:\n"
         "  level: info\n";
}

// The processes of one job: rank 0 (the publisher), rank 1, the engines.
struct Job {
  std::string dir;
  std::unique_ptr<Process> trainer, rank1;
  std::vector<std::unique_ptr<Process>> workers;
  ~Job() {
    if (!dir.empty()) test::remove_tree(dir);
  }
};

std::unique_ptr<Job> start_job(const std::vector<Engine>& engines, int updates, const std::string& model_size = "64MiB") {
  auto job = std::make_unique<Job>();
  job->dir = test::make_temp_dir("paramcast-sharded-nccl");
  const std::string config =
      test::write_file(job->dir, "deploy.yaml", config_yaml(engines.size(), updates, model_size));
  const std::string endpoint_file = job->dir + "/endpoint";
  auto host = [](const std::string& who) { return "NCCL_HOSTID=paramcast-sharded-" + who; };
  job->trainer = Process::start(test::binary("paramcast-trainer"),
                                {"--config", config, "--endpoint-file", endpoint_file, "--updates",
                                 std::to_string(updates)},
                                {host("trainer-0")});
  EXPECT_TRUE(job->trainer && job->trainer->wait_for_output("control endpoint", seconds(60)))
      << (job->trainer ? job->trainer->output() : "");
  std::string endpoint;
  std::ifstream(endpoint_file) >> endpoint;
  EXPECT_FALSE(endpoint.empty());
  job->rank1 = Process::start(test::binary("paramcast-trainer"),
                              {"--config", config, "--rank", "1", "--endpoint", endpoint, "--updates",
                               std::to_string(updates)},
                              {host("trainer-1")});
  for (const auto& e : engines) {
    std::vector<std::string> args = {"--config", config, "--id", e.id, "--endpoint", endpoint, "--updates",
                                     std::to_string(updates)};
    args.insert(args.end(), e.flags.begin(), e.flags.end());
    job->workers.push_back(Process::start(test::binary("paramcast-worker"), args, {host(e.id)}));
  }
  return job;
}

// Runs rank 0, rank 1 and the engines to the end of `updates` updates
// (processes still running `engine_wait` after rank 0 ended are killed).
Outcome run_job(const std::vector<Engine>& engines, int updates, int engine_wait = 60) {
  Outcome o;
  auto job = start_job(engines, updates);
  auto code = job->trainer->wait_for(seconds(240));
  o.trainer_code = code.value_or(-1);
  o.trainer = job->trainer->output();
  code = job->rank1->wait_for(seconds(engine_wait));
  o.rank1_code = code.value_or(-1);
  o.rank1 = job->rank1->output();
  for (auto& w : job->workers) {
    code = w->wait_for(seconds(engine_wait));
    o.engine_codes.push_back(code.value_or(-1));
    o.engines.push_back(w->output());
  }
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

// A trainer rank killed while its pieces move (a 512 MiB model: each update
// takes seconds on a shared GPU): rank 0's update fails naming trainer-1
// within heartbeat_timeout (3 s) + 2 s of the kill, and every engine stays
// at the version it verified or says its state is dirty; none hangs.
TEST_F(ShardedNcclTest, AKilledTrainerRankFailsTheUpdateNamingItWithinSeconds) {
  const std::vector<Engine> engines = {{"worker-1", {}}, {"worker-2", {}}};
  auto job = start_job(engines, 3, "512MiB");
  ASSERT_TRUE(job->rank1->wait_for_output("trainer-1: v1 sent", seconds(180)))
      << job->rank1->output() << job->trainer->output();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // inside v2's moves
  const auto killed = std::chrono::steady_clock::now();
  job->rank1->kill(SIGKILL);
  ASSERT_TRUE(job->trainer->wait_for_output("update v2 FAILED", seconds(60))) << job->trainer->output();
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string out = job->trainer->output();
  const std::string line = out.substr(out.find("update v2 FAILED"), out.find('\n', out.find("update v2 FAILED")) - out.find("update v2 FAILED"));
  std::printf("sharded_nccl killed trainer-1 named after %.2f s: %s\n", after, line.c_str());
  EXPECT_NE(line.find("trainer-1"), std::string::npos) << out;
  EXPECT_LT(after, 3.0 + 2.0 + 1.0) << "(heartbeat_timeout + 2 s, and 1 s for the output to arrive)\n" << out;
  for (size_t i = 0; i < engines.size(); ++i) {
    auto& w = job->workers[i];
    EXPECT_TRUE(w->wait_for_output(engines[i].id + ": v1 verified", seconds(30))) << w->output();
    EXPECT_EQ(w->output().find("differs"), std::string::npos) << w->output();
    EXPECT_EQ(w->output().find("v2 verified"), std::string::npos) << "v2 cannot have landed whole:\n" << w->output();
  }
  job->trainer->kill(SIGKILL);
  for (auto& w : job->workers) w->kill(SIGKILL);
}

}  // namespace
}  // namespace paramcast
