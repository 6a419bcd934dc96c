// DeviceMemory: staging buffers, copies and checksums on one device, so that
// the bucket pipeline (trainer_side / inference_side) is written once for
// host memory (Gloo) and CUDA memory (NCCL).
//
// Thread-safety: one instance per pipeline thread; allocated() and peak()
// may be read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual StatusOr<void*> allocate(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  // Copies and waits until the copy is complete.
  virtual Status copy(void* dst, const void* src, size_t bytes) = 0;
  // Many copies, waited on once (one stream sync on CUDA): bucket packing.
  struct CopyOp {
    void* dst;
    const void* src;
    size_t bytes;
  };
  virtual Status copy_many(const std::vector<CopyOp>& ops) = 0;
  // xxh64 of the bytes (device bytes are hashed on the host for now).
  virtual StatusOr<uint64_t> checksum(const void* ptr, size_t bytes) = 0;
  // Orders this memory's later copies (and the communicator work that
  // follows them) after everything queued on `stream` (a cudaStream_t;
  // nullptr = the legacy default stream). Host memory has no streams: no-op.
  virtual Status order_after(void* stream) {
    (void)stream;
    return Status();
  }
  // Bytes currently allocated through this object, and the peak.
  // Readable from any thread (stats); written by the owning thread.
  uint64_t allocated() const { return allocated_.load(std::memory_order_relaxed); }
  uint64_t peak() const { return peak_.load(std::memory_order_relaxed); }

 protected:
  // Bookkeeping shared by the implementations: record an allocation, and
  // forget one (returns false for a pointer this object did not allocate).
  void remember(void* ptr, size_t bytes) {
    sizes_[ptr] = bytes;
    const uint64_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (now > peak_.load(std::memory_order_relaxed)) peak_.store(now, std::memory_order_relaxed);
  }
  bool forget(void* ptr) {
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return false;
    allocated_ -= it->second;
    sizes_.erase(it);
    return true;
  }
  const std::unordered_map<void*, size_t>& allocations() const { return sizes_; }

 private:
  std::unordered_map<void*, size_t> sizes_;
  std::atomic<uint64_t> allocated_{0};
  std::atomic<uint64_t> peak_{0};
};

StatusOr<std::unique_ptr<DeviceMemory>> create_device_memory(Device device);

// A buffer from a DeviceMemory, released on destruction.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(DeviceMemory* mem, void* ptr, size_t bytes) : mem_(mem), ptr_(ptr), bytes_(bytes) {}
  StagingBuffer(StagingBuffer&& o) noexcept { *this = std::move(o); }
  StagingBuffer& operator=(StagingBuffer&& o) noexcept {
    reset();
    mem_ = o.mem_; ptr_ = o.ptr_; bytes_ = o.bytes_;
    o.mem_ = nullptr; o.ptr_ = nullptr; o.bytes_ = 0;
    return *this;
  }
  ~StagingBuffer() { reset(); }
  void reset() {
    if (mem_ && ptr_) mem_->release(ptr_);
    mem_ = nullptr; ptr_ = nullptr; bytes_ = 0;
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  DeviceMemory* mem_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The two staging buffers of a double-buffered pipeline (bucket k uses slot
// k % 2), kept across updates and resized only when the plan's largest staged
// bucket no longer fits or is far smaller.
class StagingPair {
 public:
  Status reserve(DeviceMemory* mem, uint64_t bytes) {
    for (auto& s : slots_) {
      if (s.size() >= bytes && s.size() <= 2 * bytes + (1 << 20)) continue;
      s.reset();
      if (!bytes) continue;
      auto p = mem->allocate(bytes);
      if (!p.ok()) return p.status();
      s = StagingBuffer(mem, *p, bytes);
    }
    return Status();
  }
  uint8_t* slot(size_t bucket) const { return slots_[bucket % 2].data(); }
  void reset() {
    for (auto& s : slots_) s.reset();
  }

 private:
  StagingBuffer slots_[2];
};

}  // namespace paramcast
