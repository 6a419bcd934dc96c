// How far ahead the transfer pipeline issues broadcasts. Internal to
// common/transfer.
//
// A bucket that lands in place (the caller's tensor on the sender; the
// engine's registered destination, or its bucket-layout arena, on the
// receiver) needs no staging slot, so it may be issued well before the
// buckets ahead of it complete: the data plane then always holds the next
// broadcasts (their receives posted), and a rank's caller that wakes late
// costs nothing while they last. A bucket that needs a staging slot (packed,
// a delta encoding) waits for the slot's previous user (staging_slots.h: the
// one rule for every kind of bucket, on every side); with checksums the
// sender keeps two buckets in flight (their checksum slot is k % 2).
#pragma once

#include <cstddef>

namespace paramcast::transfer {

// Buckets in flight at most, per side.
constexpr size_t kIssueAhead = 32;
// Buckets in flight when a bucket needs a staging slot (two slots, k % 2).
constexpr size_t kIssueAheadStaged = 2;

}  // namespace paramcast::transfer
