// ParamCast's CUDA kernels (kernels.cu): batched copies for bucket packing
// and unpacking, and the per-block digests of the xxh64-blocks checksum
// (common/data/bucket_checksum.h). Launchers queue work on `stream` and
// return the launch's error; nothing here waits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace paramcast::nccl_backend {

struct CopyDesc {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies every descriptor (device memory on the current device); one kernel
// launch per kGatherBatch descriptors, the descriptors travelling as kernel
// parameters (no descriptor upload, nothing to keep alive).
inline constexpr int kGatherBatch = 512;
cudaError_t launch_gather(const CopyDesc* ops, size_t count, cudaStream_t stream);

// digests[i] = XXH64(bytes [4096 i, min(4096 (i + 1), n)), seed 0) for each
// of the checksum_blocks(n) blocks of `data`.
cudaError_t launch_block_digests(const void* data, size_t bytes, uint64_t* digests, cudaStream_t stream);

// The same for many buffers at once (a bucket's pieces, for delta piece
// hashes): piece i's digests start at digests[first_block]; `pieces` is a
// device array sorted by first_block, `blocks` the total.
struct PieceDesc {
  const void* data;
  uint64_t bytes;
  uint64_t first_block;
};
cudaError_t launch_piece_digests(const PieceDesc* pieces, uint32_t count, uint64_t blocks, uint64_t* digests,
                                 cudaStream_t stream);

}  // namespace paramcast::nccl_backend
