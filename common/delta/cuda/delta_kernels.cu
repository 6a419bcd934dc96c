#include "common/delta/cuda/delta_kernels.h"

#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>

namespace paramcast::delta::cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr uint64_t kMaxGrid = 4096;

unsigned grid_for(uint64_t items) {
  return static_cast<unsigned>(std::clamp<uint64_t>((items + kThreads - 1) / kThreads, 1, kMaxGrid));
}

__device__ __forceinline__ uint64_t global_index() { return uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ uint64_t grid_step() { return uint64_t(gridDim.x) * blockDim.x; }

// Adds each thread's count into *total: one atomic per warp. Every thread of
// the block calls it (no thread returned early).
__device__ __forceinline__ void add_counts(unsigned long long mine, unsigned long long* total) {
  for (int o = 16; o > 0; o >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, o);
  if ((threadIdx.x & 31) == 0 && mine) atomicAdd(total, mine);
}

__device__ __forceinline__ void record_bad(Counters* c, uint64_t k, BadReason why) {
  atomicMin(&c->bad, (static_cast<unsigned long long>(k) << 3) | why);
}

__device__ __forceinline__ unsigned varint_size(uint64_t v) {
  unsigned n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// blockIdx.y strides over the segments, x over each one's units.
template <typename T>
__global__ void compare_kernel(const DeviceSegment* segments, uint32_t count, uint8_t* out, uint8_t* flags,
                               Counters* c) {
  unsigned long long found = 0;
  for (uint32_t s = blockIdx.y; s < count; s += gridDim.y) {
    const DeviceSegment seg = segments[s];
    const T* now = reinterpret_cast<const T*>(seg.now);
    T* base = reinterpret_cast<T*>(seg.base);
    T* dense = reinterpret_cast<T*>(out + seg.bucket_offset);
    uint8_t* f = flags + seg.bucket_offset / sizeof(T);
    const uint64_t n = seg.length / sizeof(T);
    for (uint64_t i = global_index(); i < n; i += grid_step()) {
      const T v = now[i];  // bit patterns: unsigned integers compare bits
      dense[i] = v;        // `now` may be `dense` itself (encoding in place)
      if (v != base[i]) {
        base[i] = v;
        f[i] = 1;
        ++found;
      }
    }
  }
  add_counts(found, &c->changed);
}

__global__ void gap_size_kernel(const uint32_t* indices, uint64_t changed, uint64_t* sizes) {
  for (uint64_t k = global_index(); k < changed; k += grid_step()) {
    const uint64_t prev = k ? uint64_t(indices[k - 1]) + 1 : 0;
    sizes[k] = varint_size(indices[k] - prev);
  }
}

__global__ void gap_total_kernel(const uint64_t* ends, uint64_t changed, Counters* c) {
  c->gap_bytes = changed ? ends[changed - 1] : 0;
}

__global__ void write_gaps_kernel(const uint32_t* indices, const uint64_t* ends, uint64_t changed, uint8_t* tail) {
  for (uint64_t k = global_index(); k < changed; k += grid_step()) {
    const uint64_t prev = k ? uint64_t(indices[k - 1]) + 1 : 0;
    uint64_t gap = indices[k] - prev;
    uint8_t* at = tail + ends[k] - varint_size(gap);
    for (;; gap >>= 7) {
      *at++ = static_cast<uint8_t>((gap & 0x7f) | (gap >= 0x80 ? 0x80 : 0));
      if (gap < 0x80) break;
    }
  }
}

__global__ void write_bitmask_kernel(const uint8_t* flags, uint64_t units, uint8_t* tail) {
  const uint64_t bytes = (units + 7) / 8;
  for (uint64_t b = global_index(); b < bytes; b += grid_step()) {
    unsigned v = 0;
    for (unsigned j = 0; j < 8 && 8 * b + j < units; ++j) v |= unsigned(flags[8 * b + j] != 0) << j;
    tail[b] = static_cast<uint8_t>(v);
  }
}

// term[j] = byte j ends a gap; counts them, and says whether the last byte does.
__global__ void terminator_kernel(const uint8_t* tail, uint64_t n, uint8_t* term, Counters* c) {
  unsigned long long found = 0;
  for (uint64_t j = global_index(); j < n; j += grid_step()) {
    const bool t = (tail[j] & 0x80) == 0;
    term[j] = t;
    found += t;
    if (j == n - 1) c->last_ends = t;
  }
  add_counts(found, reinterpret_cast<unsigned long long*>(&c->selected));
}

// Gap k spans (ends[k-1], ends[k]]; indices[k] = gap (+1 after the first),
// so that an inclusive sum gives each change's unit.
__global__ void decode_gap_kernel(const uint8_t* tail, const uint32_t* ends, uint64_t changed, uint64_t* indices,
                                  Counters* c) {
  for (uint64_t k = global_index(); k < changed; k += grid_step()) {
    const uint64_t start = k ? uint64_t(ends[k - 1]) + 1 : 0;
    const uint64_t len = uint64_t(ends[k]) + 1 - start;
    uint64_t gap = 0;
    if (len > 5) {
      record_bad(c, k, kGapTooLong);
    } else {
      for (uint64_t j = 0; j < len; ++j) gap |= uint64_t(tail[start + j] & 0x7f) << (7 * j);
    }
    indices[k] = gap + (k ? 1 : 0);
  }
}

__global__ void expand_bitmask_kernel(const uint8_t* tail, uint64_t units, uint8_t* flags, Counters* c) {
  unsigned long long found = 0;
  for (uint64_t i = global_index(); i < units; i += grid_step()) {
    const bool set = (tail[i >> 3] >> (i & 7)) & 1;
    flags[i] = set;
    found += set;
  }
  if (global_index() == 0 && units % 8) {
    const unsigned past = tail[units / 8] >> (units % 8);
    if (past) record_bad(c, 0, kMaskPastBucket);
  }
  add_counts(found, reinterpret_cast<unsigned long long*>(&c->selected));
}

// The segment holding byte `at` of the bucket (the last one starting at or
// before it), or -1.
__device__ __forceinline__ long find_segment(const DeviceSegment* segments, uint32_t count, uint64_t at) {
  long lo = 0, hi = static_cast<long>(count) - 1, found = -1;
  while (lo <= hi) {
    const long mid = (lo + hi) / 2;
    if (segments[mid].bucket_offset <= at) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return found;
}

__global__ void validate_kernel(const uint64_t* indices, uint64_t changed, uint64_t units, uint32_t unit,
                                const DeviceSegment* segments, uint32_t count, Counters* c) {
  for (uint64_t k = global_index(); k < changed; k += grid_step()) {
    const uint64_t i = indices[k];
    if (i >= units || (k && i <= indices[k - 1])) {  // a decrease: the sum wrapped
      record_bad(c, k, kPastBucket);
      continue;
    }
    const uint64_t at = i * unit;
    const long s = find_segment(segments, count, at);
    if (s < 0 || at + unit > segments[s].bucket_offset + segments[s].length) record_bad(c, k, kBetweenPieces);
  }
}

__global__ void scatter_kernel(const uint64_t* indices, const uint8_t* values, uint64_t changed, uint32_t unit,
                               const DeviceSegment* segments, uint32_t count) {
  for (uint64_t k = global_index(); k < changed; k += grid_step()) {
    const uint64_t at = indices[k] * unit;
    const DeviceSegment seg = segments[find_segment(segments, count, at)];
    uint8_t* dst = seg.base + (at - seg.bucket_offset);
    const uint8_t* src = values + k * unit;
    for (uint32_t b = 0; b < unit; ++b) dst[b] = src[b];  // destinations may be unaligned
  }
}

template <typename T>
cudaError_t select_typed(void* temp, size_t& temp_bytes, const uint8_t* dense, const uint8_t* flags, uint64_t units,
                         uint32_t* indices, uint8_t* values, Counters* c, cudaStream_t stream) {
  const auto n = static_cast<int64_t>(units);
  thrust::counting_iterator<uint32_t> unit_numbers(0);
  if (!temp) {
    size_t a = 0, b = 0;
    cudaError_t e = cub::DeviceSelect::Flagged(nullptr, a, unit_numbers, flags, indices, &c->selected, n, stream);
    if (e != cudaSuccess) return e;
    e = cub::DeviceSelect::Flagged(nullptr, b, reinterpret_cast<const T*>(dense), flags, reinterpret_cast<T*>(values),
                                   &c->selected, n, stream);
    temp_bytes = std::max(a, b);
    return e;
  }
  cudaError_t e = cub::DeviceSelect::Flagged(temp, temp_bytes, unit_numbers, flags, indices, &c->selected, n, stream);
  if (e != cudaSuccess) return e;
  return cub::DeviceSelect::Flagged(temp, temp_bytes, reinterpret_cast<const T*>(dense), flags,
                                    reinterpret_cast<T*>(values), &c->selected, n, stream);
}

template <typename T>
void launch_compare_typed(const DeviceSegment* segments, uint32_t count, uint64_t longest, uint8_t* out,
                          uint8_t* flags, Counters* c, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(std::clamp<uint64_t>((longest / sizeof(T) + 4 * kThreads - 1) / (4 * kThreads),
                                                             1, 256)),
                  std::min<uint32_t>(count, 65535));
  compare_kernel<T><<<grid, kThreads, 0, stream>>>(segments, count, out, flags, c);
}

}  // namespace

cudaError_t launch_compare(const DeviceSegment* segments, uint32_t count, uint64_t longest, uint32_t unit,
                           uint8_t* out, uint8_t* flags, Counters* counters, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (unit) {
    case 1: launch_compare_typed<uint8_t>(segments, count, longest, out, flags, counters, stream); break;
    case 2: launch_compare_typed<uint16_t>(segments, count, longest, out, flags, counters, stream); break;
    case 4: launch_compare_typed<uint32_t>(segments, count, longest, out, flags, counters, stream); break;
    case 8: launch_compare_typed<unsigned long long>(segments, count, longest, out, flags, counters, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t select_changes(void* temp, size_t& temp_bytes, const uint8_t* dense, const uint8_t* flags,
                           uint64_t units, uint32_t unit, uint32_t* indices, uint8_t* values, Counters* counters,
                           cudaStream_t stream) {
  switch (unit) {
    case 1: return select_typed<uint8_t>(temp, temp_bytes, dense, flags, units, indices, values, counters, stream);
    case 2: return select_typed<uint16_t>(temp, temp_bytes, dense, flags, units, indices, values, counters, stream);
    case 4: return select_typed<uint32_t>(temp, temp_bytes, dense, flags, units, indices, values, counters, stream);
    case 8:
      return select_typed<unsigned long long>(temp, temp_bytes, dense, flags, units, indices, values, counters, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t gap_layout(void* temp, size_t& temp_bytes, const uint32_t* indices, uint64_t changed, uint64_t* ends,
                       Counters* counters, cudaStream_t stream) {
  if (!temp) return cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, ends, static_cast<int64_t>(changed), stream);
  if (changed == 0) return cudaSuccess;
  gap_size_kernel<<<grid_for(changed), kThreads, 0, stream>>>(indices, changed, ends);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = cub::DeviceScan::InclusiveSum(temp, temp_bytes, ends, static_cast<int64_t>(changed), stream);
      e != cudaSuccess)
    return e;
  gap_total_kernel<<<1, 1, 0, stream>>>(ends, changed, counters);
  return cudaGetLastError();
}

cudaError_t write_gaps(const uint32_t* indices, const uint64_t* ends, uint64_t changed, uint8_t* tail,
                       cudaStream_t stream) {
  if (changed == 0) return cudaSuccess;
  write_gaps_kernel<<<grid_for(changed), kThreads, 0, stream>>>(indices, ends, changed, tail);
  return cudaGetLastError();
}

cudaError_t write_bitmask(const uint8_t* flags, uint64_t units, uint8_t* tail, cudaStream_t stream) {
  if (units == 0) return cudaSuccess;
  write_bitmask_kernel<<<grid_for((units + 7) / 8), kThreads, 0, stream>>>(flags, units, tail);
  return cudaGetLastError();
}

cudaError_t count_terminators(const uint8_t* tail, uint64_t tail_bytes, uint8_t* term, Counters* counters,
                              cudaStream_t stream) {
  if (tail_bytes == 0) return cudaSuccess;
  terminator_kernel<<<grid_for(tail_bytes), kThreads, 0, stream>>>(tail, tail_bytes, term, counters);
  return cudaGetLastError();
}

cudaError_t decode_gaps(void* temp, size_t& temp_bytes, const uint8_t* tail, uint64_t tail_bytes, uint64_t changed,
                        const uint8_t* term, uint32_t* ends, uint64_t* indices, Counters* counters,
                        cudaStream_t stream) {
  thrust::counting_iterator<uint32_t> byte_numbers(0);
  if (!temp) {
    size_t a = 0, b = 0;
    cudaError_t e = cub::DeviceSelect::Flagged(nullptr, a, byte_numbers, term, ends, &counters->selected,
                                               static_cast<int64_t>(tail_bytes), stream);
    if (e != cudaSuccess) return e;
    e = cub::DeviceScan::InclusiveSum(nullptr, b, indices, static_cast<int64_t>(changed), stream);
    temp_bytes = std::max(a, b);
    return e;
  }
  if (changed == 0) return cudaSuccess;
  cudaError_t e = cub::DeviceSelect::Flagged(temp, temp_bytes, byte_numbers, term, ends, &counters->selected,
                                             static_cast<int64_t>(tail_bytes), stream);
  if (e != cudaSuccess) return e;
  decode_gap_kernel<<<grid_for(changed), kThreads, 0, stream>>>(tail, ends, changed, indices, counters);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  return cub::DeviceScan::InclusiveSum(temp, temp_bytes, indices, static_cast<int64_t>(changed), stream);
}

cudaError_t expand_bitmask(const uint8_t* tail, uint64_t units, uint8_t* flags, Counters* counters,
                           cudaStream_t stream) {
  if (units == 0) return cudaSuccess;
  expand_bitmask_kernel<<<grid_for(units), kThreads, 0, stream>>>(tail, units, flags, counters);
  return cudaGetLastError();
}

cudaError_t select_marked(void* temp, size_t& temp_bytes, const uint8_t* flags, uint64_t units, uint64_t* indices,
                          Counters* counters, cudaStream_t stream) {
  thrust::counting_iterator<uint64_t> unit_numbers(0);
  return cub::DeviceSelect::Flagged(temp, temp_bytes, unit_numbers, flags, indices, &counters->selected,
                                    static_cast<int64_t>(units), stream);
}

cudaError_t validate(const uint64_t* indices, uint64_t changed, uint64_t units, uint32_t unit,
                     const DeviceSegment* segments, uint32_t count, Counters* counters, cudaStream_t stream) {
  if (changed == 0) return cudaSuccess;
  validate_kernel<<<grid_for(changed), kThreads, 0, stream>>>(indices, changed, units, unit, segments, count,
                                                              counters);
  return cudaGetLastError();
}

cudaError_t scatter(const uint64_t* indices, const uint8_t* values, uint64_t changed, uint32_t unit,
                    const DeviceSegment* segments, uint32_t count, cudaStream_t stream) {
  if (changed == 0) return cudaSuccess;
  scatter_kernel<<<grid_for(changed), kThreads, 0, stream>>>(indices, values, changed, unit, segments, count);
  return cudaGetLastError();
}

}  // namespace paramcast::delta::cuda
