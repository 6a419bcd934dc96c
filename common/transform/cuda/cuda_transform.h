// Transforms on send for a CUDA tensor: the host entry to fp8_kernels.cu,
// for transform.cc (and the GPU tests). No CUDA header here: a stream is a
// cudaStream_t passed as void* (nullptr: the legacy default stream), as in
// DeviceMemory::order_after. Built only with CUDA (PARAMCAST_HAVE_NCCL).
//
// The bytes are transform::apply's on the host, bit for bit (scalar.h holds
// the conversions both run; docs/transforms.md says why they agree).
//
// Thread-safety: any thread; every call saves and restores the caller's
// current device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"
#include "common/transform/transform.h"

namespace paramcast::transform::cuda {

// Writes what travels for CUDA tensor `src` into `out_device` (on src's
// device; wire_specs(...)[0]'s bytes) and, for fp8, `scales_device`
// (wire_specs(...)[1]'s, float32): queued on `stream` after what is queued
// there, then waited on (the non-finite check needs the result). An error
// names the tensor and the first non-finite element's index, as the host
// apply does. Refused before anything runs: `src.data` not aligned to its
// elements (a float32 tensor at an address not a multiple of 4), `out_device`
// not aligned to a cast's output elements, `scales_device` not to 4 bytes
// (a misaligned access would be a sticky CUDA error, ending every later
// CUDA call of the process). Out of device memory is kUnavailable. A failed
// CUDA call leaves no error behind on the thread (a sticky one aside).
Status apply(const TensorView& src, const Transform& t, void* out_device, float* scales_device,
             void* stream = nullptr);

// Device memory on CUDA device `device` for a transform's output
// (cudaMallocAsync on the legacy default stream; kUnavailable when the
// device has none left), and its release (transform::BufferFree's).
//
// release is cudaFreeAsync on the legacy default stream: the memory is
// reused once the work queued there so far is done, and nothing orders it
// after work on other streams. Every consumer of a Buffer that reads it on
// another stream (an NCCL send, a copy on the caller's stream) must
// therefore have finished with it, or be waited on, before the Buffer is
// destroyed. (The publisher waits for its sends before it drops a
// Transformed.)
StatusOr<uint8_t*> allocate(int device, size_t bytes);
void release(int device, uint8_t* ptr);

// The ordinal of a CUDA device as this process sees it (a UUID resolved).
StatusOr<int> ordinal(const Device& device);

// For tests: codes[i] = the kernels' e4m3fn code of the float whose bits
// are first + i, for i < n (the conversion the quantizer runs, clamp
// included), on `stream`, not waited on.
Status encode_bits(uint32_t first, uint64_t n, uint8_t* codes_device, void* stream = nullptr);

// For tests: codes[i] = CUDA's own __nv_cvt_float_to_fp8(x,
// __NV_SATFINITE, __NV_E4M3) of the float whose bits are first + i (the
// hardware conversion on sm_89 and later), a reference that shares no code
// with encode_bits; the two agree for finite |x| <= 448. On `stream`, not
// waited on.
Status reference_bits(uint32_t first, uint64_t n, uint8_t* codes_device, void* stream = nullptr);

}  // namespace paramcast::transform::cuda
