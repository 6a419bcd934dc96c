// Bucket checksums, defined once for host and device.
//
// kXxh64: XXH64 (seed 0) of the bucket's bytes. Sequential by nature, so a
// CUDA bucket is hashed on the host through a bounce buffer.
//
// kXxh64Blocks ("xxh64-blocks"): a checksum that a GPU computes in parallel
// and a CPU computes with the same result:
//   the bucket's n bytes are cut into blocks of kChecksumBlockBytes (4 KiB;
//   the last block may be shorter, an empty bucket has no blocks);
//   d[i] = XXH64(block i, seed 0);
//   checksum = XXH64(d[0..m) as little-endian 64-bit words, seed n).
// The CUDA kernel (data/nccl/kernels.cu) computes each d[i] on its own
// thread; the host combines the m digests (1/512 of the bytes).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/config.h"

namespace paramcast {

inline constexpr size_t kChecksumBlockBytes = 4096;

// Number of per-block digests of an n-byte bucket under kXxh64Blocks.
inline size_t checksum_blocks(size_t bytes) { return (bytes + kChecksumBlockBytes - 1) / kChecksumBlockBytes; }

// The second step of kXxh64Blocks: combines the per-block digests.
uint64_t combine_block_digests(const uint64_t* digests, size_t blocks, size_t bytes);

// The checksum of `bytes` host bytes under `kind` (0 for kNone).
uint64_t host_checksum(Checksum kind, const void* data, size_t bytes);

const char* checksum_name(Checksum kind);

}  // namespace paramcast
