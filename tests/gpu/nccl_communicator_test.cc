// The NCCL communicator on a real device, one rank (no peer needed):
// creation with its warm-up broadcast, ordering after a caller's stream,
// the Work woken by the host function, and abort(): immediate, then every
// operation fails fast. Skips, saying so, where there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/data/communicator.h"
#include "common/data/file_store.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)";
    dir_ = test::make_temp_dir("paramcast-nccl1");
    GroupOptions g;
    g.backend = Backend::kNccl;
    g.device = Device::cuda(0);
    g.bootstrap = mint_bootstrap(Backend::kNccl, 1).value();
    g.init_timeout = std::chrono::seconds(60);
    g.op_timeout = std::chrono::seconds(60);
    FileStore store(dir_);
    auto c = create_communicator(g, store);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    comm_ = std::move(c.value());
  }
  void TearDown() override {
    comm_.reset();
    if (!dir_.empty()) test::remove_tree(dir_);
  }
  std::string dir_;
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclCommunicatorTest, BroadcastOrderedAfterTheCallersStreamCompletes) {
  cudaStream_t caller;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 64 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(buf, 7, 64 << 20, caller), cudaSuccess);
  ASSERT_TRUE(comm_->order_after(caller).ok());
  auto work = comm_->broadcast(buf, 64 << 20, 0);
  EXPECT_TRUE(work->wait(Clock::now() + std::chrono::seconds(60)).ok());
  EXPECT_TRUE(work->settled());
  EXPECT_TRUE(comm_->async_error().ok());
  cudaFree(buf);
  cudaStreamDestroy(caller);
}

TEST_F(NcclCommunicatorTest, AbortReturnsAtOnceAndLaterWorkFailsFast) {
  const auto t0 = Clock::now();
  comm_->abort("test abort");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));  // ncclCommAbort runs on the reaper
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 4096), cudaSuccess);
  Status s = comm_->broadcast(buf, 4096, 0)->wait(Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(s.code(), Code::kAborted) << s.to_string();
  EXPECT_NE(s.message().find("test abort"), std::string::npos) << s.to_string();
  EXPECT_EQ(comm_->order_after(nullptr).code(), Code::kAborted);
  comm_.reset();  // never blocks on the teardown
  cudaFree(buf);
}

}  // namespace
}  // namespace paramcast
