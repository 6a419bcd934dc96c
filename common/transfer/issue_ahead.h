// How far ahead the transfer pipeline issues broadcasts. Internal to
// common/transfer.
//
// A bucket that lands in place (the caller's tensor on the sender; the
// engine's registered destination, or its bucket-layout arena, on the
// receiver) needs no staging slot, so it may be issued well before the
// buckets ahead of it complete: the data plane then always holds the next
// broadcasts (their receives posted), and a rank's caller that wakes late
// costs nothing while they last. A bucket that needs a staging slot (packed,
// a delta encoding, or a checksum slot on the sender) waits for the bucket
// two before it, which used the same slot, as before.
#pragma once

#include <cstddef>

namespace paramcast::transfer {

// Buckets in flight at most, per side.
constexpr size_t kIssueAhead = 32;
// Buckets in flight when a bucket needs a staging slot (two slots, k % 2).
constexpr size_t kIssueAheadStaged = 2;

}  // namespace paramcast::transfer
