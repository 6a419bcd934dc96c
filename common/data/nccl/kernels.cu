#include "common/data/nccl/kernels.h"

#include <algorithm>

namespace paramcast::nccl_backend {
namespace {

// ---- batched copies ------------------------------------------------------

struct GatherBatch {
  int count;
  CopyDesc ops[kGatherBatch];
};

constexpr int kCopyThreads = 256;
constexpr size_t kSliceBytes = 64 << 10;  // one block's share per step
constexpr unsigned kMaxSlicesPerOp = 64;

// blockIdx.y picks the descriptor; the x blocks stride over its bytes.
__global__ void gather_kernel(const __grid_constant__ GatherBatch batch) {
  const CopyDesc op = batch.ops[blockIdx.y];
  const auto d = reinterpret_cast<uintptr_t>(op.dst), s = reinterpret_cast<uintptr_t>(op.src);
  const size_t step = static_cast<size_t>(gridDim.x) * kCopyThreads;
  const size_t first = static_cast<size_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if (((d | s | op.bytes) & 15) == 0) {
    const auto* src = reinterpret_cast<const uint4*>(op.src);
    auto* dst = reinterpret_cast<uint4*>(op.dst);
    for (size_t i = first, n = op.bytes / 16; i < n; i += step) dst[i] = __ldg(src + i);
  } else if (((d | s | op.bytes) & 3) == 0) {
    const auto* src = reinterpret_cast<const uint32_t*>(op.src);
    auto* dst = reinterpret_cast<uint32_t*>(op.dst);
    for (size_t i = first, n = op.bytes / 4; i < n; i += step) dst[i] = __ldg(src + i);
  } else {
    const auto* src = static_cast<const uint8_t*>(op.src);
    auto* dst = static_cast<uint8_t*>(op.dst);
    for (size_t i = first; i < op.bytes; i += step) dst[i] = src[i];
  }
}

// ---- xxh64 of 4 KiB blocks -------------------------------------------------

constexpr uint64_t P1 = 11400714785074694791ULL;
constexpr uint64_t P2 = 14029467366897019727ULL;
constexpr uint64_t P3 = 1609587929392839161ULL;
constexpr uint64_t P4 = 9650029242287828579ULL;
constexpr uint64_t P5 = 2870177450012600261ULL;
constexpr size_t kBlock = 4096;  // kChecksumBlockBytes

__device__ __forceinline__ uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
__device__ __forceinline__ uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round1(0, v)) * P1 + P4; }

template <bool kAligned>
__device__ __forceinline__ uint64_t load64(const uint8_t* p) {
  if constexpr (kAligned) return __ldg(reinterpret_cast<const unsigned long long*>(p));
  uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = (v << 8) | p[b];
  return v;
}

template <bool kAligned>
__device__ uint64_t xxh64_block(const uint8_t* p, size_t len) {
  const uint8_t* const end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v0 = P1 + P2, v1 = P2, v2 = 0, v3 = 0 - P1;
    for (; p + 32 <= end; p += 32) {
      v0 = round1(v0, load64<kAligned>(p));
      v1 = round1(v1, load64<kAligned>(p + 8));
      v2 = round1(v2, load64<kAligned>(p + 16));
      v3 = round1(v3, load64<kAligned>(p + 24));
    }
    h = rotl(v0, 1) + rotl(v1, 7) + rotl(v2, 12) + rotl(v3, 18);
    h = merge(merge(merge(merge(h, v0), v1), v2), v3);
  } else {
    h = P5;
  }
  h += len;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ round1(0, load64<false>(p)), 27) * P1 + P4;
  if (p + 4 <= end) {
    const uint32_t w = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
    h = rotl(h ^ (static_cast<uint64_t>(w) * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

template <bool kAligned>
__global__ void block_digest_kernel(const uint8_t* data, size_t bytes, size_t blocks, uint64_t* digests) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const size_t off = i * kBlock;
  digests[i] = xxh64_block<kAligned>(data + off, min(kBlock, bytes - off));
}

// One thread per block digest of all pieces; the piece by binary search
// (the last one whose first block is at or before this one: empty pieces
// share their successor's first block and are skipped).
__global__ void piece_digest_kernel(const PieceDesc* pieces, uint32_t count, uint64_t blocks, uint64_t* digests) {
  const uint64_t g = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= blocks) return;
  long lo = 0, hi = static_cast<long>(count) - 1, at = 0;
  while (lo <= hi) {
    const long mid = (lo + hi) / 2;
    if (pieces[mid].first_block <= g) {
      at = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  const PieceDesc p = pieces[at];
  const size_t off = (g - p.first_block) * kBlock;
  const auto* data = static_cast<const uint8_t*>(p.data) + off;
  const size_t len = min(kBlock, static_cast<size_t>(p.bytes - off));
  digests[g] = reinterpret_cast<uintptr_t>(data) % 8 == 0 ? xxh64_block<true>(data, len) : xxh64_block<false>(data, len);
}

}  // namespace

cudaError_t launch_piece_digests(const PieceDesc* pieces, uint32_t count, uint64_t blocks, uint64_t* digests,
                                 cudaStream_t stream) {
  if (blocks == 0 || count == 0) return cudaSuccess;
  constexpr unsigned kThreads = 128;
  const unsigned grid = static_cast<unsigned>((blocks + kThreads - 1) / kThreads);
  piece_digest_kernel<<<grid, kThreads, 0, stream>>>(pieces, count, blocks, digests);
  return cudaGetLastError();
}

cudaError_t launch_gather(const CopyDesc* ops, size_t count, cudaStream_t stream) {
  GatherBatch batch;
  for (size_t first = 0; first < count; first += kGatherBatch) {
    batch.count = static_cast<int>(std::min<size_t>(kGatherBatch, count - first));
    size_t longest = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.ops[i] = ops[first + i];
      longest = std::max(longest, batch.ops[i].bytes);
    }
    const unsigned slices = static_cast<unsigned>(
        std::clamp<size_t>((longest + kSliceBytes - 1) / kSliceBytes, 1, kMaxSlicesPerOp));
    gather_kernel<<<dim3(slices, static_cast<unsigned>(batch.count)), kCopyThreads, 0, stream>>>(batch);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_block_digests(const void* data, size_t bytes, uint64_t* digests, cudaStream_t stream) {
  const size_t blocks = (bytes + kBlock - 1) / kBlock;
  if (blocks == 0) return cudaSuccess;
  constexpr unsigned kThreads = 128;
  const unsigned grid = static_cast<unsigned>((blocks + kThreads - 1) / kThreads);
  const auto* p = static_cast<const uint8_t*>(data);
  if (reinterpret_cast<uintptr_t>(p) % 8 == 0)
    block_digest_kernel<true><<<grid, kThreads, 0, stream>>>(p, bytes, blocks, digests);
  else
    block_digest_kernel<false><<<grid, kThreads, 0, stream>>>(p, bytes, blocks, digests);
  return cudaGetLastError();
}

}  // namespace paramcast::nccl_backend
