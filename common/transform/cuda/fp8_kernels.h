// The quantizer's device steps (fp8_kernels.cu), for cuda_transform.cc.
// Each launcher queues work on `stream` and returns its launches' own
// error (an error an earlier failed call left on the thread is cleared
// first, not reported as this launch's; a sticky one is reported, as the
// launch fails with it); nothing here waits or allocates. Every element goes through scalar.h, the
// code the host apply runs, so the bytes are the host's.
//
// Vectorized (8 elements per thread, 16-byte loads) where the source and
// output are 16-byte aligned and a row is a multiple of 8 elements; element
// by element otherwise (same bytes, fewer of them per second).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace paramcast::transform::cuda {

enum class Float : uint8_t { kF32, kBF16, kF16 };

// out[i] = src[i] converted from `from` to `to` (round to nearest even),
// i < n.
cudaError_t launch_cast(const void* src, Float from, uint64_t n, void* out, Float to, cudaStream_t stream);

// fp8 per 128x128 block, one pass: each CUDA block holds a block of the
// tensor in registers, takes its amax, writes its scale
// (scales[(r / 128) * ceil(cols / 128) + c / 128]) and its codes.
// The first non-finite element's flat index lands in *bad (atomicMin; the
// caller sets it to ~0 first).
cudaError_t launch_fp8_block(const void* src, Float from, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                             unsigned long long* bad, cudaStream_t stream);

// fp8 per row (channel; `fp8: tensor` is the tensor as one row of
// rows * cols), two passes: amax of each row into amax[row] (float bits,
// zeroed by the caller), then scales[row] and the codes.
cudaError_t launch_fp8_rows(const void* src, Float from, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                            uint32_t* amax, unsigned long long* bad, cudaStream_t stream);

// codes[i] = e4m3fn code of the float with bits first + i (clamp included).
cudaError_t launch_encode_bits(uint32_t first, uint64_t n, uint8_t* codes, cudaStream_t stream);

// For tests, a reference the quantizer shares no code with: codes[i] =
// CUDA's own __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) of the
// float x with bits first + i (the hardware cvt.rn.satfinite on sm_89 and
// later, cuda_fp8.hpp's emulation before).
cudaError_t launch_reference_bits(uint32_t first, uint64_t n, uint8_t* codes, cudaStream_t stream);

}  // namespace paramcast::transform::cuda
