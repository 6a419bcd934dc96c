// The many-sender plan run for real: trainer ranks and engine ranks as
// separate processes in one Gloo group (point-to-point moves over TCP),
// each holding or wanting its part of a LLaMA-shaped model; every engine
// verifies every element it wanted, and receives exactly those bytes.
#include <gtest/gtest.h>

#include <unistd.h>

#include "tests/support/process.h"

namespace paramcast {
namespace {

using test::Process;

struct Job {
  std::string layout;
  int senders, replicas, tp;
  bool forward = true;
  std::string mode = "plan";  // or "funnel": gather on rank 0, then publish from it (the baseline)
};

// Runs the job; returns each rank's output.
std::vector<std::string> run(const Job& job) {
  const std::string dir = test::make_temp_dir("paramcast-reshard");
  const int world = job.senders + job.replicas * job.tp;
  std::vector<std::unique_ptr<Process>> ranks;
  const std::string prefix = "reshard-" + std::to_string(getpid()) + "-" + job.layout;
  for (int r = 0; r < world; ++r)
    ranks.push_back(Process::start(test::binary("reshard_rank"),
                                   {"--rank", std::to_string(r), "--senders", std::to_string(job.senders),
                                    "--replicas", std::to_string(job.replicas), "--tp", std::to_string(job.tp),
                                    "--layout", job.layout, "--forward", job.forward ? "1" : "0", "--mode", job.mode,
                                    "--store", dir,
                                    "--bootstrap", prefix}));
  std::vector<std::string> out;
  for (auto& p : ranks) {
    auto code = p->wait_for(std::chrono::seconds(180));
    EXPECT_TRUE(code.has_value()) << "rank hung:\n" << p->output();
    EXPECT_EQ(code.value_or(-1), 0) << p->output();
    EXPECT_NE(p->output().find("verified"), std::string::npos) << p->output();
    out.push_back(p->output());
  }
  test::remove_tree(dir);
  return out;
}

// "received N, wanted M" of an engine's output.
std::pair<uint64_t, uint64_t> received_wanted(const std::string& out) {
  const auto r = out.find("received "), w = out.find("wanted ");
  if (r == std::string::npos || w == std::string::npos) return {0, 1};
  return {std::stoull(out.substr(r + 9)), std::stoull(out.substr(w + 7))};
}

TEST(ReshardExecTest, FsdpShardsFromFourRanksToTwoWholeEngines) {
  auto out = run({"fsdp", 4, 2, 1});
  for (size_t r = 4; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

// Megatron-style trainer (column weights by rows, row weights by columns)
// to 2 replicas x TP=2: each engine rank receives its slices only, and
// dim-1 slices are packed and unpacked on the way.
TEST(ReshardExecTest, MegatronShardsToTensorParallelEnginesReceiveTheirSlicesOnly) {
  auto out = run({"megatron", 2, 2, 2});
  uint64_t whole = 0;
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
    whole = std::max(whole, want);
  }
  EXPECT_GT(whole, 0u);
}

TEST(ReshardExecTest, PipelineStagesToTensorParallelEngines) {
  auto out = run({"pipeline", 2, 1, 2});
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

TEST(ReshardExecTest, WithoutForwardingEverySenderFeedsEveryReplica) {
  auto out = run({"fsdp", 3, 2, 2, false});
  for (size_t r = 3; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

// The benchmark's baseline (bench/reshard_bench.py): rank 0 gathers every
// tensor, then sends it whole to each engine; bit-exact too.
TEST(ReshardExecTest, GatherThenPublishBaselineIsBitExact) {
  auto out = run({"fsdp", 3, 2, 1, false, "funnel"});
  EXPECT_NE(out[0].find("link out"), std::string::npos) << out[0];
}

}  // namespace
}  // namespace paramcast
