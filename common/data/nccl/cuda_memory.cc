// DeviceMemory for CUDA: cudaMalloc'd staging, copies on a dedicated copy
// stream (so they overlap the communicator's stream), checksums over a pinned
// host bounce buffer.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/data/device_memory.h"
#include "common/data/nccl/nccl_check.h"
#include "common/xxhash.h"

namespace paramcast::nccl_backend {
namespace {
class CudaMemory : public DeviceMemory {
 public:
  CudaMemory(int index, cudaStream_t stream) : index_(index), stream_(stream) {}
  ~CudaMemory() override {
    cudaSetDevice(index_);
    for (auto& [p, n] : allocations()) cudaFree(p);
    if (bounce_) cudaFreeHost(bounce_);
    cudaStreamDestroy(stream_);
  }
  StatusOr<void*> allocate(size_t bytes) override {
    cudaSetDevice(index_);
    void* p = nullptr;
    PC_CUDA_RETURN(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    remember(p, bytes);
    return p;
  }
  void release(void* ptr) override {
    if (!forget(ptr)) return;
    cudaSetDevice(index_);
    cudaFree(ptr);
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return Status();
    cudaSetDevice(index_);
    PC_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  Status copy_many(const std::vector<CopyOp>& ops) override {
    cudaSetDevice(index_);
    for (const auto& op : ops)
      if (op.bytes) PC_CUDA_RETURN(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  StatusOr<uint64_t> checksum(const void* ptr, size_t bytes) override {
    cudaSetDevice(index_);
    constexpr size_t kChunk = 64ull << 20;
    if (!bounce_) PC_CUDA_RETURN(cudaMallocHost(&bounce_, kChunk));
    Xxh64 h;
    for (size_t off = 0; off < bytes; off += kChunk) {
      const size_t n = std::min(kChunk, bytes - off);
      PC_CUDA_RETURN(cudaMemcpyAsync(bounce_, static_cast<const uint8_t*>(ptr) + off, n, cudaMemcpyDefault, stream_));
      PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
      h.update(bounce_, n);
    }
    return h.digest();
  }

 private:
  int index_;
  cudaStream_t stream_;
  void* bounce_ = nullptr;
};
}  // namespace

StatusOr<std::unique_ptr<DeviceMemory>> create_cuda_memory(int index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || index >= count) {
    cudaGetLastError();
    return unavailable("no CUDA device cuda:" + std::to_string(index) + " on this machine");
  }
  PC_CUDA_RETURN(cudaSetDevice(index));
  cudaStream_t stream;
  PC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<DeviceMemory>(new CudaMemory(index, stream));
}

}  // namespace paramcast::nccl_backend
