// CUDA DeviceMemory on a real device: the xxh64-blocks kernel against the
// host implementation, gather packing of many unaligned pieces, ordering
// after a caller's stream, and the caller's current device left alone.
// Every test skips, saying so, where there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/data/bucket_checksum.h"
#include "common/data/device_memory.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

class CudaMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)";
    auto m = create_device_memory(Device::cuda(0));
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    mem_ = std::move(m.value());
  }
  void* upload(const std::vector<uint8_t>& host) {
    void* p = mem_->allocate(host.size()).value();
    EXPECT_TRUE(mem_->copy(p, host.data(), host.size()).ok());
    return p;
  }
  std::vector<uint8_t> download(const void* p, size_t n) {
    std::vector<uint8_t> out(n);
    EXPECT_TRUE(mem_->copy(out.data(), p, n).ok());
    return out;
  }
  static std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
  }
  std::unique_ptr<DeviceMemory> mem_;
};

TEST_F(CudaMemoryTest, DeviceChecksumEqualsHost) {
  const auto host = random_bytes((64 << 20) + 4096, 1);
  void* dev = upload(host);
  const size_t sizes[] = {0, 1, 31, 32, 4095, 4096, 4097, 3 * 4096 + 17, 1 << 20, (64 << 20) + 5};
  for (size_t n : sizes)
    for (size_t off : {0, 1, 8}) {
      if (off + n > host.size()) continue;
      for (Checksum kind : {Checksum::kXxh64Blocks, Checksum::kXxh64}) {
        auto got = mem_->checksum(static_cast<uint8_t*>(dev) + off, n, kind);
        ASSERT_TRUE(got.ok()) << got.status().to_string();
        EXPECT_EQ(*got, host_checksum(kind, host.data() + off, n)) << checksum_name(kind) << " " << n << "+" << off;
      }
    }
  // The pipeline's two slots run beside each other.
  ASSERT_TRUE(mem_->checksum_start(0, dev, 1 << 20, Checksum::kXxh64Blocks).ok());
  ASSERT_TRUE(mem_->checksum_start(1, static_cast<uint8_t*>(dev) + 4096, 1 << 20, Checksum::kXxh64Blocks).ok());
  EXPECT_EQ(mem_->checksum_result(1).value(), host_checksum(Checksum::kXxh64Blocks, host.data() + 4096, 1 << 20));
  EXPECT_EQ(mem_->checksum_result(0).value(), host_checksum(Checksum::kXxh64Blocks, host.data(), 1 << 20));
  mem_->release(dev);
}

TEST_F(CudaMemoryTest, GatherPacksTenThousandUnalignedPieces) {
  const size_t pieces = 10000;
  std::mt19937 rng(3);
  std::vector<size_t> len(pieces), src_off(pieces), dst_off(pieces);
  size_t src_total = 0, dst_total = 0;
  for (size_t i = 0; i < pieces; ++i) {
    len[i] = i % 97 == 0 ? 0 : 1 + rng() % 3000;
    src_off[i] = src_total + (i % 3);  // some unaligned
    src_total = src_off[i] + len[i];
    dst_off[i] = (dst_total + 255) / 256 * 256;
    dst_total = dst_off[i] + len[i];
  }
  const auto host = random_bytes(src_total, 4);
  auto* src = static_cast<uint8_t*>(upload(host));
  auto* dst = static_cast<uint8_t*>(mem_->allocate(dst_total).value());
  std::vector<DeviceMemory::CopyOp> ops;
  for (size_t i = 0; i < pieces; ++i) ops.push_back({dst + dst_off[i], src + src_off[i], len[i]});
  ASSERT_TRUE(mem_->copy_many(ops).ok());
  ASSERT_TRUE(mem_->synchronize().ok());
  const auto out = download(dst, dst_total);
  for (size_t i = 0; i < pieces; ++i)
    ASSERT_EQ(0, std::memcmp(out.data() + dst_off[i], host.data() + src_off[i], len[i])) << "piece " << i;
  mem_->release(src);
  mem_->release(dst);
}

TEST_F(CudaMemoryTest, CopiesWaitForTheCallersStream) {
  const size_t n = 256 << 20;
  cudaStream_t caller;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n), cudaSuccess);
  std::memset(pinned, 0x5a, n);
  auto* t = static_cast<uint8_t*>(mem_->allocate(n).value());
  auto* staged = static_cast<uint8_t*>(mem_->allocate(n).value());
  ASSERT_EQ(cudaMemset(t, 0, n), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The "trainer" writes the tensor on its own stream; ParamCast then packs it.
  ASSERT_EQ(cudaMemcpyAsync(t, pinned, n, cudaMemcpyHostToDevice, caller), cudaSuccess);
  ASSERT_TRUE(mem_->order_after(caller).ok());
  ASSERT_TRUE(mem_->copy_many({{staged, t, n}}).ok());
  ASSERT_TRUE(mem_->synchronize().ok());
  const auto out = download(staged + n - 4096, 4096);
  EXPECT_EQ(out, std::vector<uint8_t>(4096, 0x5a)) << "packing read the tensor before the caller's write";
  mem_->release(t);
  mem_->release(staged);
  cudaFreeHost(pinned);
  cudaStreamDestroy(caller);
}

TEST_F(CudaMemoryTest, CallersCurrentDeviceIsRestored) {
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices (this machine has " << count << ")";
  auto other = create_device_memory(Device::cuda(1));
  ASSERT_TRUE(other.ok());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* p = (*other)->allocate(1 << 20).value();
  (*other)->release(p);
  int now = -1;
  cudaGetDevice(&now);
  EXPECT_EQ(now, 0);
}

}  // namespace
}  // namespace paramcast
