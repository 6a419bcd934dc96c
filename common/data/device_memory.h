// DeviceMemory: staging buffers, copies and checksums on one device, so that
// the bucket pipeline (trainer_side / inference_side) is written once for
// host memory (Gloo) and CUDA memory (NCCL). On CUDA, copies and checksums
// run on one copy stream owned by the object, ordered after the caller's
// stream by order_after(); the communicator orders its broadcasts after the
// copy stream (Communicator::order_after(stream())).
//
// Thread-safety: one instance per pipeline thread; allocated() and peak()
// may be read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "common/config.h"
#include "common/device.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

// Released staging kept for reuse by each DeviceMemory (data/block_pool.h).
inline constexpr uint64_t kStagingCacheBytes = 2ull << 30;

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // From the pool (data/block_pool.h): no allocator call once warm.
  virtual StatusOr<void*> allocate(size_t bytes) = 0;
  // Back to the pool. The caller guarantees no queued work touches it.
  virtual void release(void* ptr) = 0;
  // Copies and waits until the copy is complete.
  virtual Status copy(void* dst, const void* src, size_t bytes) = 0;
  // Many copies (bucket packing and unpacking) queued as one batch on the
  // copy stream without a host wait (one gather kernel per batch on CUDA);
  // synchronize() or a later order_after(stream()) waits for them.
  struct CopyOp {
    void* dst;
    const void* src;
    size_t bytes;
  };
  virtual Status copy_many(const std::vector<CopyOp>& ops) = 0;
  // Waits until everything queued on the copy stream is complete.
  virtual Status synchronize() { return Status(); }
  // The bucket checksum (data/bucket_checksum.h) of device bytes, waited on.
  virtual StatusOr<uint64_t> checksum(const void* ptr, size_t bytes, Checksum kind) = 0;
  // The same, split: checksum_start queues it on the copy stream (after the
  // copies queued so far) in one of two slots; checksum_result waits for
  // it. The bytes must stay unchanged until the result is taken.
  virtual Status checksum_start(int slot, const void* ptr, size_t bytes, Checksum kind) {
    auto sum = checksum(ptr, bytes, kind);
    if (!sum.ok()) return sum.status();
    pending_[slot & 1] = *sum;
    return Status();
  }
  virtual StatusOr<uint64_t> checksum_result(int slot) { return pending_[slot & 1]; }
  // Orders this memory's later copies after everything queued on `stream`
  // (a cudaStream_t; nullptr = the legacy default stream). Host memory has
  // no streams: no-op.
  virtual Status order_after(void* stream) {
    (void)stream;
    return Status();
  }
  // The copy stream (a cudaStream_t), for a Communicator's order_after;
  // nullptr for host memory.
  virtual void* stream() const { return nullptr; }
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

 private:
  std::unordered_map<void*, size_t> sizes_;
  std::atomic<uint64_t> allocated_{0};
  std::atomic<uint64_t> peak_{0};
  uint64_t pending_[2] = {0, 0};
};

StatusOr<std::unique_ptr<DeviceMemory>> create_device_memory(Device device);

// resolve_device and resolve_device_or_keep (a GPU named by UUID as this
// process's ordinal): common/device.h, included above.

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
  // Lets go without releasing: for a buffer that device work may still
  // write after an abort that did not finish (leaked rather than reused).
  void abandon() { mem_ = nullptr; ptr_ = nullptr; bytes_ = 0; }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  DeviceMemory* mem_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The two staging buffers of a double-buffered pipeline, kept across updates
// and resized only when the plan's largest staged bucket no longer fits or is
// far smaller. Which bucket uses which slot is decided in one place:
// transfer::StagingSlots (common/transfer/staging_slots.h).
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
  uint8_t* slot(size_t index) const { return slots_[index % 2].data(); }
  void reset() {
    for (auto& s : slots_) s.reset();
  }
  void abandon() {
    for (auto& s : slots_) s.abandon();
  }

 private:
  StagingBuffer slots_[2];
};

}  // namespace paramcast
