// DeviceMemory for CUDA: pooled cudaMalloc'd staging (no cudaMalloc/cudaFree
// between buckets once warm), copies and checksums on a dedicated copy
// stream (so they overlap the communicator's stream), ordered after the
// caller's stream with an event. Packing is one gather kernel per batch of
// pieces; the xxh64-blocks checksum is a kernel whose per-block digests come
// back to a pinned buffer and are combined on the host. xxh64 (sequential)
// goes through a pinned host bounce buffer.
//
// Thread-safety: one owning thread (the pipeline's); every call saves and
// restores the caller's current device (DeviceGuard).
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "common/data/block_pool.h"
#include "common/data/bucket_checksum.h"
#include "common/data/device_memory.h"
#include "common/data/nccl/device_guard.h"
#include "common/data/nccl/kernels.h"
#include "common/data/nccl/nccl_check.h"
#include "common/xxhash.h"

namespace paramcast::nccl_backend {
namespace {

class CudaMemory : public DeviceMemory {
 public:
  CudaMemory(int index, cudaStream_t stream, cudaEvent_t caller_done)
      : index_(index), stream_(stream), caller_done_(caller_done) {}
  ~CudaMemory() override {
    DeviceGuard g(index_);
    cudaStreamSynchronize(stream_);
    pool_.trim(0);
    for (auto& s : sums_) {
      if (s.host) cudaFreeHost(s.host);
      if (s.done) cudaEventDestroy(s.done);
    }
    if (bounce_) cudaFreeHost(bounce_);
    cudaEventDestroy(caller_done_);
    cudaStreamDestroy(stream_);
  }
  StatusOr<void*> allocate(size_t bytes) override {
    DeviceGuard g(index_);
    void* p = pool_.take(bytes);
    if (!p) return resource_error(bytes);
    remember(p, bytes);
    return p;
  }
  void release(void* ptr) override {
    if (forget(ptr)) pool_.give_back(ptr);
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return Status();
    DeviceGuard g(index_);
    PC_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  Status copy_many(const std::vector<CopyOp>& ops) override {
    if (ops.empty()) return Status();
    DeviceGuard g(index_);
    std::vector<CopyDesc> descs;
    descs.reserve(ops.size());
    for (const auto& op : ops)
      if (op.bytes) descs.push_back({op.dst, op.src, op.bytes});
    PC_CUDA_RETURN(launch_gather(descs.data(), descs.size(), stream_));
    return Status();
  }
  Status synchronize() override {
    DeviceGuard g(index_);
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  StatusOr<uint64_t> checksum(const void* ptr, size_t bytes, Checksum kind) override {
    PC_RETURN_IF_ERROR(checksum_start(2, ptr, bytes, kind));
    return checksum_result(2);
  }
  Status checksum_start(int slot, const void* ptr, size_t bytes, Checksum kind) override;
  StatusOr<uint64_t> checksum_result(int slot) override;
  Status order_after(void* stream) override {
    DeviceGuard g(index_);
    cudaStream_t caller = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
    PC_CUDA_RETURN(cudaEventRecord(caller_done_, caller));
    PC_CUDA_RETURN(cudaStreamWaitEvent(stream_, caller_done_, 0));
    return Status();
  }
  void* stream() const override { return stream_; }

 private:
  // A checksum in flight: digests on the device, copied to pinned memory.
  struct PendingSum {
    Checksum kind = Checksum::kNone;
    size_t bytes = 0;
    uint64_t value = 0;        // kXxh64 (computed at start) or kNone
    uint64_t* device = nullptr;  // from the pool
    uint64_t* host = nullptr;    // pinned
    size_t capacity = 0;         // digests
    cudaEvent_t done = nullptr;
  };

  Status hash_on_host(const void* ptr, size_t bytes, uint64_t& out);
  Status reserve_digests(PendingSum& s, size_t blocks);
  Status resource_error(size_t bytes) {
    return internal_error("cannot allocate " + std::to_string(bytes) + " bytes of CUDA staging memory on cuda:" +
                          std::to_string(index_));
  }

  int index_;
  cudaStream_t stream_;
  cudaEvent_t caller_done_;
  void* bounce_ = nullptr;
  PendingSum sums_[3];  // two pipeline slots + one for checksum()
  BlockPool pool_{[](size_t n) -> void* {
                    void* p = nullptr;
                    if (cudaMalloc(&p, std::max<size_t>(n, 1)) != cudaSuccess) {
                      cudaGetLastError();
                      return nullptr;
                    }
                    return p;
                  },
                  [](void* p) { cudaFree(p); }, kStagingCacheBytes};
};

Status CudaMemory::checksum_start(int slot, const void* ptr, size_t bytes, Checksum kind) {
  PendingSum& s = sums_[std::clamp(slot, 0, 2)];
  s.kind = kind;
  s.bytes = bytes;
  s.value = 0;
  if (kind == Checksum::kNone) return Status();
  DeviceGuard g(index_);
  if (kind == Checksum::kXxh64) return hash_on_host(ptr, bytes, s.value);
  const size_t blocks = checksum_blocks(bytes);
  PC_RETURN_IF_ERROR(reserve_digests(s, blocks));
  if (!blocks) return Status();
  PC_CUDA_RETURN(launch_block_digests(ptr, bytes, s.device, stream_));
  PC_CUDA_RETURN(cudaMemcpyAsync(s.host, s.device, blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream_));
  PC_CUDA_RETURN(cudaEventRecord(s.done, stream_));
  return Status();
}

StatusOr<uint64_t> CudaMemory::checksum_result(int slot) {
  PendingSum& s = sums_[std::clamp(slot, 0, 2)];
  if (s.kind != Checksum::kXxh64Blocks) return s.value;
  const size_t blocks = checksum_blocks(s.bytes);
  if (blocks) {
    DeviceGuard g(index_);
    PC_CUDA_RETURN(cudaEventSynchronize(s.done));
  }
  return combine_block_digests(s.host, blocks, s.bytes);
}

Status CudaMemory::reserve_digests(PendingSum& s, size_t blocks) {
  if (!s.done) PC_CUDA_RETURN(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming | cudaEventBlockingSync));
  if (s.capacity >= blocks) return Status();
  if (s.device) release(s.device);
  if (s.host) cudaFreeHost(s.host);
  s.device = nullptr;
  s.host = nullptr;
  s.capacity = 0;
  auto d = allocate(blocks * sizeof(uint64_t));
  if (!d.ok()) return d.status();
  s.device = static_cast<uint64_t*>(*d);
  PC_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&s.host), blocks * sizeof(uint64_t)));
  s.capacity = blocks;
  return Status();
}

// xxh64 is sequential: the bytes come to the host in 64 MiB pieces.
Status CudaMemory::hash_on_host(const void* ptr, size_t bytes, uint64_t& out) {
  constexpr size_t kChunk = 64ull << 20;
  if (!bounce_) PC_CUDA_RETURN(cudaMallocHost(&bounce_, kChunk));
  Xxh64 h;
  for (size_t off = 0; off < bytes; off += kChunk) {
    const size_t n = std::min(kChunk, bytes - off);
    PC_CUDA_RETURN(cudaMemcpyAsync(bounce_, static_cast<const uint8_t*>(ptr) + off, n, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    h.update(bounce_, n);
  }
  out = h.digest();
  return Status();
}

}  // namespace

StatusOr<std::unique_ptr<DeviceMemory>> create_cuda_memory(int index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || index >= count) {
    cudaGetLastError();
    return unavailable("no CUDA device cuda:" + std::to_string(index) + " on this machine (" +
                       std::to_string(count) + " visible)");
  }
  DeviceGuard g(index);
  cudaStream_t stream;
  PC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t caller_done;
  if (Status s = cuda_status(cudaEventCreateWithFlags(&caller_done, cudaEventDisableTiming), "cudaEventCreate");
      !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<DeviceMemory>(new CudaMemory(index, stream, caller_done));
}

}  // namespace paramcast::nccl_backend
