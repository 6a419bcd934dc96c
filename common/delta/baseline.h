// Baseline: a copy of one version of an update's tensors in host memory,
// what a delta is computed against (publisher) or applied onto (an engine
// that lands weights through a callback and so has no buffers of its own).
//
// Owner: the publisher's update thread, or an engine's data thread. Its
// size is the tensors' bytes; it is (re)allocated only when the manifest
// changes. Its storage is host memory, or what a DeltaCodec gives
// (codec.h: CUDA device memory, or pinned host memory). version() is the version it holds, 0 while an update is writing
// it or after one failed: only a complete, applied version is a baseline.
//
// Thread-safety: one owning thread; bytes() may be read from any thread.
#pragma once

#include <atomic>
#include <functional>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/plan.h"

namespace paramcast::delta {

class Baseline {
 public:
  using Allocate = std::function<uint8_t*(size_t)>;  // null on failure
  using Free = std::function<void(uint8_t*)>;
  Baseline() = default;
  Baseline(const Baseline&) = delete;
  Baseline& operator=(const Baseline&) = delete;
  ~Baseline() { clear(); }
  // Where its tensors live from now on (drops what it holds).
  void set_storage(Allocate allocate, Free free) {
    clear();
    allocate_ = std::move(allocate);
    free_ = std::move(free);
  }

  // Makes room for `plan`'s tensors, those `keep(i)` selects (kept when
  // the manifest and the selection are the same: bytes and version stay).
  // Marks it being written (version 0). A failed allocation is a Status,
  // and leaves it empty.
  template <typename Keep>
  Status prepare(const UpdatePlan& plan, Keep&& keep) {
    kept_version_ = 0;
    restorable_ = true;
    const uint64_t before = version_;
    version_ = 0;
    std::vector<bool> selected(plan.tensors.size());
    for (size_t i = 0; i < selected.size(); ++i) selected[i] = keep(i);
    if (manifest_ == plan.manifest_hash && selected == selected_ && !buffers_.empty()) {
      kept_version_ = before;
      return Status();
    }
    clear();
    uint64_t total = 0;
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      if (!selected[i]) {
        buffers_.emplace_back();
        continue;
      }
      buffers_.push_back(allocate_(plan.nbytes[i]));
      if (!buffers_.back()) {
        const uint64_t n = plan.nbytes[i];
        clear();
        return unavailable("no memory for the delta baseline: tensor '" + plan.tensors[i].name + "' needs " +
                           std::to_string(n) + " bytes after " + std::to_string(total) + " (set delta off, or "
                           "give the process more memory)");
      }
      index_[plan.tensors[i].name] = i;
      total += plan.nbytes[i];
    }
    manifest_ = plan.manifest_hash;
    selected_ = std::move(selected);
    bytes_ = total;
    return Status();
  }
  Status prepare(const UpdatePlan& plan) {
    return prepare(plan, [](size_t) { return true; });
  }
  // The version it now holds completely (an applied update).
  void set_version(uint64_t version) {
    version_ = version;
    restorable_ = false;
  }
  void invalidate() {
    version_ = 0;
    restorable_ = false;
  }
  // After prepare(), for an update that moved no byte (its plan refused):
  // the version it held before, when prepare() kept its bytes.
  // The update's bytes start moving: restore() no longer applies.
  void begin_writing() { restorable_ = false; }
  // Nothing happens unless prepare() ran since the last set_version() or
  // begin_writing().
  void restore() {
    if (restorable_) version_ = kept_version_.load();
    restorable_ = false;
  }
  uint64_t version() const { return version_; }
  uint64_t manifest_hash() const { return manifest_; }
  // Tensor i of the manifest it was prepared for (null: not selected).
  uint8_t* tensor(size_t i) const { return buffers_[i]; }
  // By name (engines: the plan's tensor order may differ); null when absent.
  uint8_t* tensor(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : buffers_[it->second];
  }
  uint64_t bytes() const { return bytes_; }
  // Lets go of its storage without freeing it (a transfer that did not
  // settle may still write there): deliberately leaked, then empty.
  void abandon() {
    new std::vector<uint8_t*>(std::move(buffers_));  // deliberately leaked
    buffers_.clear();
    clear();
  }
  void clear() {
    for (uint8_t* p : buffers_)
      if (p) free_(p);
    buffers_.clear();
    selected_.clear();
    index_.clear();
    manifest_ = 0;
    version_ = 0;
    bytes_ = 0;
  }

 private:
  Allocate allocate_ = [](size_t n) -> uint8_t* { return new (std::nothrow) uint8_t[n ? n : 1]; };
  Free free_ = [](uint8_t* p) { delete[] p; };
  std::vector<uint8_t*> buffers_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<bool> selected_;
  uint64_t manifest_ = 0;
  std::atomic<uint64_t> version_{0};
  std::atomic<uint64_t> kept_version_{0};
  bool restorable_ = false;
  std::atomic<uint64_t> bytes_{0};
};

}  // namespace paramcast::delta
