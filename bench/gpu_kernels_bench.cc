// paramcast-gpu-bench: the device-side figures of the GPU plan
// (docs/PERFORMANCE.md), on one GPU: device-to-device memcpy bandwidth (the
// yardstick), bucket packing and unpacking through the gather kernel
// (10,000 pieces and 291 pieces), the xxh64-blocks checksum rate, and the
// sender's host overhead per bucket on a one-rank NCCL communicator.
// Targets: checksum >= 100 GB/s (H100), pack/unpack >= 0.8 x memcpy.
//   usage: paramcast-gpu-bench [--size 256MiB] [--repeats 10] [--json FILE]
//          paramcast-gpu-bench --devices   (prints the CUDA runtime's device count)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

#include "common/cli.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/plan.h"
#include "common/transfer/bucket_sender.h"
#include "common/units.h"

using namespace paramcast;

namespace {

double seconds_of(cudaStream_t s, int repeats, const std::function<void()>& body) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  body();  // warm
  cudaStreamSynchronize(s);
  cudaEventRecord(a, s);
  for (int i = 0; i < repeats; ++i) body();
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3 / repeats;
}

// Pieces of `total` bytes: `count` sizes, 256-aligned in the bucket,
// scattered (not back to back) in the source.
std::vector<DeviceMemory::CopyOp> pieces(uint8_t* bucket, uint8_t* scattered, uint64_t total, size_t count,
                                         bool unpack) {
  std::vector<DeviceMemory::CopyOp> ops;
  const uint64_t each = total / count / 256 * 256;
  for (size_t i = 0; i < count; ++i) {
    uint8_t* b = bucket + i * each;
    uint8_t* s = scattered + i * (each + 512);
    ops.push_back(unpack ? DeviceMemory::CopyOp{s, b, each} : DeviceMemory::CopyOp{b, s, each});
  }
  return ops;
}

// Host time per bucket of BucketSender on a one-rank NCCL communicator.
double per_bucket_us(DeviceMemory& mem, uint8_t* src, int buckets) {
  auto id = mint_bootstrap(Backend::kNccl, 1);
  if (!id.ok()) return -1;
  GroupOptions g;
  g.backend = Backend::kNccl;
  g.device = Device::cuda(0);
  g.bootstrap = *id;
  FileStore store("/tmp");
  auto comm = create_communicator(g, store);
  if (!comm.ok()) {
    std::fprintf(stderr, "per-bucket overhead: %s\n", comm.status().to_string().c_str());
    return -1;
  }
  std::vector<TensorSpec> specs;
  for (int i = 0; i < buckets; ++i) {
    std::string name = "t";  // not "t" + ...: GCC 12's -Wrestrict false positive at -O3
    name += std::to_string(i);
    specs.push_back({name, DType::kU8, {4096}});
  }
  DataPlaneOptions o;
  o.bucket_bytes = 4096;
  o.direct_min_bytes = 1 << 30;
  UpdatePlan plan = build_plan(1, specs, o).value();
  std::vector<TensorView> views;
  for (int i = 0; i < buckets; ++i) views.push_back(TensorView{specs[i], src + i * 8192, Device::cuda(0)});
  transfer::BucketSender sender(&mem);
  (void)sender.send(plan, views, **comm, {}, Clock::now() + std::chrono::seconds(60));
  const auto t0 = std::chrono::steady_clock::now();
  Status s = sender.send(plan, views, **comm, {}, Clock::now() + std::chrono::seconds(60));
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  if (!s.ok()) std::fprintf(stderr, "per-bucket overhead: %s\n", s.to_string().c_str());
  return s.ok() ? us / plan.buckets.size() : -1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f = parse_flags(argc, argv, 1, std::vector<std::string>{"devices"});
  if (f.has("devices")) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    std::printf("%d\n", n);
    return 0;
  }
  const uint64_t size = parse_size(f.get("size", "256MiB")).value_or(0);
  if (size < (16u << 20)) {
    std::fprintf(stderr, "paramcast-gpu-bench: --size must be at least 16MiB\n");
    return 2;
  }
  const int repeats = std::atoi(f.get("repeats", "10").c_str());
  auto m = create_device_memory(Device::cuda(0));
  if (!m.ok()) {
    std::fprintf(stderr, "paramcast-gpu-bench: %s\n", m.status().to_string().c_str());
    return 3;
  }
  DeviceMemory& mem = **m;
  auto stream = static_cast<cudaStream_t>(mem.stream());
  auto* a = static_cast<uint8_t*>(mem.allocate(size).value());
  auto* b = static_cast<uint8_t*>(mem.allocate(size * 3).value());  // room for gaps between pieces
  cudaMemset(a, 1, size);
  cudaMemset(b, 2, size * 3);
  cudaDeviceSynchronize();
  const double gb = size / 1e9;
  const double memcpy_s = seconds_of(stream, repeats, [&] { cudaMemcpyAsync(b, a, size, cudaMemcpyDeviceToDevice, stream); });
  std::ostringstream json;
  json << "{\"device\":\"cuda:0\",\"bytes\":" << size << ",\"memcpy_gbps\":" << gb / memcpy_s;
  std::printf("memcpy d2d        %8.1f GB/s\n", gb / memcpy_s);
  for (size_t count : {size_t(10000), size_t(291)}) {
    for (bool unpack : {false, true}) {
      auto ops = pieces(a, b, size, count, unpack);
      const double s = seconds_of(stream, repeats, [&] { (void)mem.copy_many(ops); });
      const double moved = ops.size() * ops[0].bytes / 1e9;
      const char* what = unpack ? "unpack" : "pack";
      std::printf("%-6s %5zu pieces %8.1f GB/s  %.2f x memcpy (target >= 0.8)\n", what, count, moved / s,
                  (moved / s) / (gb / memcpy_s));
      json << ",\"" << what << "_" << count << "_gbps\":" << moved / s << ",\"" << what << "_" << count
           << "_vs_memcpy\":" << (moved / s) / (gb / memcpy_s);
    }
  }
  (void)mem.checksum(a, size, Checksum::kXxh64Blocks);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) (void)mem.checksum(a, size, Checksum::kXxh64Blocks);
  const double cs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
  std::printf("xxh64-blocks      %8.1f GB/s (target >= 100, host combine included)\n", gb / cs);
  json << ",\"checksum_gbps\":" << gb / cs;
  auto* small = static_cast<uint8_t*>(mem.allocate(2000 * 8192).value());
  const double per_bucket = per_bucket_us(mem, small, 2000);
  mem.release(small);
  std::printf("per-bucket host   %8.1f us (BucketSender, 2000 packed 4 KiB buckets, 1-rank NCCL)\n", per_bucket);
  json << ",\"per_bucket_us\":" << per_bucket << "}";
  std::printf("JSON %s\n", json.str().c_str());
  if (f.has("json")) std::ofstream(f.get("json")) << json.str() << "\n";
  mem.release(a);
  mem.release(b);
  return 0;
}
