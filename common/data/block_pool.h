// BlockPool: allocations of one memory kind kept for reuse, so that a
// pipeline does not call the allocator (cudaMalloc/cudaFree synchronise the
// device) between buckets. A released block goes back to the pool; a
// request takes the smallest cached block that fits and is not more than
// twice as large (plus 1 MiB), else a fresh one. The cache holds at most
// `max_cached_bytes`; beyond it the largest cached blocks are freed. When
// the allocator fails, the cache is freed and the allocation retried once.
//
// Reuse is safe only for blocks that no queued device work still touches:
// the owners (BucketSender/BucketReceiver) settle their in-flight work
// before they release a buffer.
//
// Thread-safety: one owning thread (as DeviceMemory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <unordered_map>

namespace paramcast {

class BlockPool {
 public:
  using Alloc = std::function<void*(size_t)>;
  using Free = std::function<void(void*)>;

  BlockPool(Alloc alloc, Free free, uint64_t max_cached_bytes)
      : alloc_(std::move(alloc)), free_(std::move(free)), max_cached_(max_cached_bytes) {}
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;
  // Frees every block, cached or not.
  ~BlockPool() {
    for (auto& [p, n] : capacity_) free_(p);
  }

  // A block of at least `bytes`, or nullptr when the allocator fails.
  void* take(size_t bytes) {
    auto it = cached_.lower_bound(bytes);
    if (it != cached_.end() && it->first <= 2 * bytes + (1u << 20)) {
      void* p = it->second;
      cached_bytes_ -= it->first;
      cached_.erase(it);
      ++hits_;
      return p;
    }
    void* p = alloc_(bytes);
    if (!p && !cached_.empty()) {
      trim(0);
      p = alloc_(bytes);
    }
    if (p) {
      capacity_[p] = bytes;
      ++misses_;
    }
    return p;
  }

  // Returns a block from take() to the cache; false if it is not ours.
  bool give_back(void* p) {
    auto it = capacity_.find(p);
    if (it == capacity_.end()) return false;
    cached_.emplace(it->second, p);
    cached_bytes_ += it->second;
    trim(max_cached_);
    return true;
  }

  // Frees cached blocks, largest first, until at most `keep` bytes are cached.
  void trim(uint64_t keep) {
    while (cached_bytes_ > keep && !cached_.empty()) {
      auto it = std::prev(cached_.end());
      cached_bytes_ -= it->first;
      capacity_.erase(it->second);
      free_(it->second);
      cached_.erase(it);
    }
  }

  uint64_t cached_bytes() const { return cached_bytes_; }
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }

 private:
  Alloc alloc_;
  Free free_;
  const uint64_t max_cached_;
  std::unordered_map<void*, size_t> capacity_;  // every block we own
  std::multimap<size_t, void*> cached_;         // the free ones, by size
  uint64_t cached_bytes_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace paramcast
