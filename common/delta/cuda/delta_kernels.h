// The delta codec's device steps (delta_kernels.cu), for cuda_codec.cc.
// Each launcher queues work on `stream` and returns the launch's error;
// nothing here waits. Compaction and prefix sums are CUB's (CUDA's CCCL):
// `temp`/`temp_bytes` are CUB's temporary storage (a null `temp` asks for
// the size, as CUB does). The wire format is delta_codec.h's; the host
// codec (delta_codec.cc) is the reference the GPU suite compares against.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace paramcast::delta::cuda {

// One piece of a bucket, as the device sees it (delta::Segment).
struct DeviceSegment {
  const uint8_t* now;  // encode: the new bytes
  uint8_t* base;       // encode: the baseline (moved to `now`); apply: the destination
  uint64_t bucket_offset;
  uint64_t length;
};

// Counters of one step, in device memory (the host copies them back).
struct Counters {
  unsigned long long changed;    // encode: changed units found by compare
  long long selected;            // CUB's selection count; apply: terminators or marked bits counted
  unsigned long long gap_bytes;  // encode: the varint gaps' total size
  unsigned long long bad;        // apply: (first bad change << 3) | BadReason, or ~0
  unsigned long long last_ends;  // apply: 1 when the last gap byte ends a gap
};
enum BadReason : unsigned { kGapTooLong = 1, kPastBucket = 2, kBetweenPieces = 3, kMaskPastBucket = 4 };

// Encode, step 1: for every unit of every segment, out[bucket_offset + u] =
// now[u] (the dense bucket), flags[unit] = 1 where now differs from base,
// bit for bit, and base = now; the changed units are added to
// counters->changed. `flags` holds bucket_bytes / unit bytes, zeroed by the
// caller; `longest` is the longest segment's length. Every pointer, offset
// and length is a multiple of `unit` (1, 2, 4 or 8).
cudaError_t launch_compare(const DeviceSegment* segments, uint32_t count, uint64_t longest, uint32_t unit,
                           uint8_t* out, uint8_t* flags, Counters* counters, cudaStream_t stream);

// Encode, step 2: the changed units' indices (uint32) and values (`unit`
// bytes each, read from the dense bucket `dense`) compacted in unit order;
// counters->selected = their count.
cudaError_t select_changes(void* temp, size_t& temp_bytes, const uint8_t* dense, const uint8_t* flags,
                           uint64_t units, uint32_t unit, uint32_t* indices, uint8_t* values, Counters* counters,
                           cudaStream_t stream);

// Encode, step 3: where each change's LEB128 gap ends in the gap stream
// (`ends`, `changed` entries: the inclusive sum of the gaps' sizes), and
// the total in counters->gap_bytes.
cudaError_t gap_layout(void* temp, size_t& temp_bytes, const uint32_t* indices, uint64_t changed, uint64_t* ends,
                       Counters* counters, cudaStream_t stream);

// Encode, step 4: the gaps written at `tail` (kIndices), or the bitmask of
// `units` units from `flags` (kBitmask).
cudaError_t write_gaps(const uint32_t* indices, const uint64_t* ends, uint64_t changed, uint8_t* tail,
                       cudaStream_t stream);
cudaError_t write_bitmask(const uint8_t* flags, uint64_t units, uint8_t* tail, cudaStream_t stream);

// Apply, kIndices, step 1: term[j] = byte j of the gap stream ends a gap
// (its top bit clear); counters->selected = their count, last_ends whether
// the last byte ends one. The caller checks the count is the header's
// `changed` and the last byte ends a gap before step 2.
cudaError_t count_terminators(const uint8_t* tail, uint64_t tail_bytes, uint8_t* term, Counters* counters,
                              cudaStream_t stream);
// Apply, kIndices, step 2: each change's unit index (`indices`, `changed`
// entries; `ends`, `changed` uint32 of scratch); a gap longer than 5 bytes
// is recorded in counters->bad.
cudaError_t decode_gaps(void* temp, size_t& temp_bytes, const uint8_t* tail, uint64_t tail_bytes, uint64_t changed,
                        const uint8_t* term, uint32_t* ends, uint64_t* indices, Counters* counters,
                        cudaStream_t stream);

// Apply, kBitmask, step 1: flags[i] = bit i of the bitmask at `tail`;
// counters->selected = the bits set; a bit set past `units` is recorded in
// counters->bad. The caller checks the count is the header's `changed`.
cudaError_t expand_bitmask(const uint8_t* tail, uint64_t units, uint8_t* flags, Counters* counters,
                           cudaStream_t stream);
// Apply, kBitmask, step 2: the marked units' indices, in order.
cudaError_t select_marked(void* temp, size_t& temp_bytes, const uint8_t* flags, uint64_t units, uint64_t* indices,
                          Counters* counters, cudaStream_t stream);

// Apply: checks every index (inside the bucket, increasing, inside a
// segment: the segments are sorted by bucket_offset) and records the first
// bad one in counters->bad (which the caller set to ~0).
cudaError_t validate(const uint64_t* indices, uint64_t changed, uint64_t units, uint32_t unit,
                     const DeviceSegment* segments, uint32_t count, Counters* counters, cudaStream_t stream);
// Apply, once validated: writes change k's value (`values` + k * unit)
// where its index lands.
cudaError_t scatter(const uint64_t* indices, const uint8_t* values, uint64_t changed, uint32_t unit,
                    const DeviceSegment* segments, uint32_t count, cudaStream_t stream);

}  // namespace paramcast::delta::cuda
