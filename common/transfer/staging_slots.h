// StagingSlots: the one rule for which staging slot a bucket uses, on every
// side of the pipeline (BucketSender, BucketReceiver, stream::StreamSender).
//
// Each side has two staging slots (StagingPair). The buckets that need one on
// that side (decided by that side alone: packed and not in place; a delta
// encoding; the sender's every bucket of a delta update; an assembled dense
// chunk needs none) take them in turn: the i-th of them uses slot i % 2, and
// may be issued only once the bucket that used the slot before it (the
// (i-2)-th) has finished. Buckets that need no slot (direct, in place,
// unchanged) take none and do not advance the turn. The rule never looks at
// a bucket's index or kind, so a dense bucket and an encoded one of the same
// update can never share a slot while either is in flight, whatever order
// they come in. A side's slots are its own memory: the sender's and a
// receiver's choices need not agree, only each side's with itself.
//
// Thread-safety: none; one per update, owned by the thread running it.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

namespace paramcast::transfer {

class StagingSlots {
 public:
  static constexpr size_t kSlots = 2;

  // The slot the next bucket that needs one will use.
  size_t next_slot() const { return users_.size() % kSlots; }
  // The bucket that used next_slot() last: it must have finished before the
  // next bucket may be written there. nullopt: the slot has not been used
  // in this update.
  std::optional<size_t> blocker() const {
    if (users_.size() < kSlots) return std::nullopt;
    return users_[users_.size() - kSlots];
  }
  // Bucket k takes next_slot() (the caller has finished blocker()); returns it.
  size_t take(size_t k) {
    users_.push_back(k);
    return (users_.size() - 1) % kSlots;
  }
  void reset() { users_.clear(); }

 private:
  std::vector<size_t> users_;  // the buckets that took a slot, in order
};

}  // namespace paramcast::transfer
