// The transfer pipeline (BucketSender / BucketReceiver) over a real Gloo
// communicator between separate processes: one sender, receivers in every
// landing mode, bit-exact across bucket boundaries, direct and chunked
// tensors, in-place buckets without staging, and a checksum failure that
// names its bucket and tensors.
#include <gtest/gtest.h>


#include "tests/support/process.h"

namespace paramcast {
namespace {

using test::Process;

class BucketPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("paramcast-transfer"); }
  void TearDown() override { test::remove_tree(dir_); }

  // Runs `world` ranks to completion; returns each rank's exit code and output.
  std::vector<std::pair<int, std::string>> run(int world, const std::vector<std::string>& extra) {
    std::vector<std::unique_ptr<Process>> ranks;
    // Built with += rather than "t" + std::to_string(...): GCC 12 at -O3
    // reports a bogus -Wrestrict inside that operator+ (GCC bug 105329).
    std::string prefix = "t";
    prefix += std::to_string(++runs_);
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> args = {"--rank", std::to_string(r), "--world", std::to_string(world),
                                       "--store", dir_, "--prefix", prefix};
      args.insert(args.end(), extra.begin(), extra.end());
      ranks.push_back(Process::start(test::binary("transfer_rank"), args));
    }
    std::vector<std::pair<int, std::string>> out;
    for (auto& p : ranks) {
      auto code = p->wait_for(std::chrono::seconds(120));
      out.push_back({code.value_or(-1), p->output()});
    }
    return out;
  }

  static uint64_t staging_peak(const std::string& output) {
    const auto at = output.find("staging_peak=");
    if (at == std::string::npos) return ~0ull;
    return std::stoull(output.substr(at + 13));
  }

  std::string dir_;
  int runs_ = 0;
};

TEST_F(BucketPipelineTest, EveryLandingModeIsBitExact) {
  auto ranks = run(4, {});
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].first, 0) << "rank " << r << ":\n" << ranks[r].second;
  EXPECT_NE(ranks[1].second.find("verified 62 tensors"), std::string::npos) << ranks[1].second;
  EXPECT_NE(ranks[2].second.find("(callback)"), std::string::npos) << ranks[2].second;
  EXPECT_NE(ranks[3].second.find("(in place)"), std::string::npos) << ranks[3].second;
  // Separate allocations stage packed buckets; bucket layout needs no staging at all.
  EXPECT_GT(staging_peak(ranks[1].second), 0u) << ranks[1].second;
  EXPECT_EQ(staging_peak(ranks[3].second), 0u) << ranks[3].second;
  EXPECT_GT(staging_peak(ranks[0].second), 0u) << ranks[0].second;
}

// The same over the shm plane (engines beside the trainer): every landing
// mode reads the publisher's memory, bit-exact.
TEST_F(BucketPipelineTest, EveryLandingModeIsBitExactOverShm) {
  auto ranks = run(4, {"--backend", "shm", "--checksum"});
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].first, 0) << "rank " << r << ":\n" << ranks[r].second;
  EXPECT_NE(ranks[1].second.find("verified 62 tensors"), std::string::npos) << ranks[1].second;
  EXPECT_NE(ranks[2].second.find("(callback)"), std::string::npos) << ranks[2].second;
  EXPECT_NE(ranks[3].second.find("(in place)"), std::string::npos) << ranks[3].second;
  for (const auto& [code, out] : ranks) EXPECT_NE(out.find("backend shm"), std::string::npos) << out;
}

TEST_F(BucketPipelineTest, SenderInPlaceWhenItsTensorsLieInBucketLayout) {
  auto ranks = run(4, {"--root-layout", "arena", "--checksum"});
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].first, 0) << "rank " << r << ":\n" << ranks[r].second;
  EXPECT_EQ(staging_peak(ranks[0].second), 0u) << ranks[0].second;
}

TEST_F(BucketPipelineTest, ChecksumFailureNamesTheBucketAndItsTensors) {
  auto ranks = run(4, {"--checksum", "--corrupt-last"});
  EXPECT_EQ(ranks[1].first, 5) << ranks[1].second;
  EXPECT_NE(ranks[1].second.find("DATA_CORRUPT"), std::string::npos) << ranks[1].second;
  const auto at = ranks[1].second.find("checksum mismatch in bucket ");
  ASSERT_NE(at, std::string::npos) << ranks[1].second;
  EXPECT_NE(ranks[1].second.find(" of v1 (tensors small.", at), std::string::npos) << ranks[1].second;
  // The corrupted bucket was the last one: the other ranks completed bit-exact.
  for (int r : {0, 2, 3}) EXPECT_EQ(ranks[r].first, 0) << "rank " << r << ":\n" << ranks[r].second;
}

}  // namespace
}  // namespace paramcast
