#include "common/transform/cuda/fp8_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>

#include "common/transform/scalar.h"

namespace paramcast::transform::cuda {
namespace {

namespace sc = ::paramcast::transform::scalar;

constexpr int kThreads = 256;
constexpr int64_t kTile = 128;       // fp8: block is kTile x kTile elements
constexpr int kRowSteps = 4;         // rows kernels: vectors per thread per chunk
constexpr int64_t kMaxGridX = 1 << 16;
constexpr int64_t kMaxGridY = 65535;

// Source element types: how a stored element becomes float32 (exactly).
struct SrcF32 {
  using T = float;
  static __device__ __forceinline__ float get(float v) { return v; }
};
struct SrcBF16 {
  using T = uint16_t;
  static __device__ __forceinline__ float get(uint16_t b) { return sc::bf16_to_float(b); }
};
struct SrcF16 {
  using T = uint16_t;
  static __device__ __forceinline__ float get(uint16_t h) { return sc::f16_to_float(h); }
};
// Cast destinations: how float32 becomes a stored element (round to nearest even).
struct DstF32 {
  using T = float;
  static __device__ __forceinline__ uint32_t put(float v) { return sc::bits_of(v); }
};
struct DstBF16 {
  using T = uint16_t;
  static __device__ __forceinline__ uint32_t put(float v) { return sc::bf16_from_float(v); }
};
struct DstF16 {
  using T = uint16_t;
  static __device__ __forceinline__ uint32_t put(float v) { return sc::f16_from_float(v); }
};

// V elements at p as float32 (V == 8: p is 16-byte aligned; one 16-byte
// load for 2-byte elements, two for float32).
template <class S, int V>
__device__ __forceinline__ void load(const typename S::T* p, float (&v)[V]) {
  if constexpr (V == 1) {
    v[0] = S::get(p[0]);
  } else if constexpr (sizeof(typename S::T) == 2) {
    static_assert(V == 8);
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // little-endian: element 2k is the low half
      v[2 * k] = S::get(static_cast<uint16_t>(w[k] & 0xFFFFu));
      v[2 * k + 1] = S::get(static_cast<uint16_t>(w[k] >> 16));
    }
  } else {
    static_assert(V == 8);
    const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
    v[0] = sc::float_of(a.x), v[1] = sc::float_of(a.y), v[2] = sc::float_of(a.z), v[3] = sc::float_of(a.w);
    v[4] = sc::float_of(b.x), v[5] = sc::float_of(b.y), v[6] = sc::float_of(b.z), v[7] = sc::float_of(b.w);
  }
}

// V converted elements at p (V == 8: p is 16-byte aligned).
template <class D, int V>
__device__ __forceinline__ void store(typename D::T* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    if constexpr (sizeof(typename D::T) == 4) p[0] = sc::float_of(D::put(v[0]));
    else p[0] = static_cast<typename D::T>(D::put(v[0]));
  } else if constexpr (sizeof(typename D::T) == 2) {
    static_assert(V == 8);
    uint4 u;
    u.x = D::put(v[0]) | (D::put(v[1]) << 16);
    u.y = D::put(v[2]) | (D::put(v[3]) << 16);
    u.z = D::put(v[4]) | (D::put(v[5]) << 16);
    u.w = D::put(v[6]) | (D::put(v[7]) << 16);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    static_assert(V == 8);
    reinterpret_cast<uint4*>(p)[0] = make_uint4(D::put(v[0]), D::put(v[1]), D::put(v[2]), D::put(v[3]));
    reinterpret_cast<uint4*>(p)[1] = make_uint4(D::put(v[4]), D::put(v[5]), D::put(v[6]), D::put(v[7]));
  }
}

// V codes of v under `scale` at q (V == 8: q is 8-byte aligned).
template <int V>
__device__ __forceinline__ void store_codes(uint8_t* q, const float (&v)[V], float scale) {
  if constexpr (V == 1) {
    q[0] = sc::quantize(v[0], scale);
  } else {
    static_assert(V == 8);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo |= static_cast<uint32_t>(sc::quantize(v[e], scale)) << (8 * e);
      hi |= static_cast<uint32_t>(sc::quantize(v[e + 4], scale)) << (8 * e);
    }
    *reinterpret_cast<uint2*>(q) = make_uint2(lo, hi);
  }
}

// max over |v|'s bits (they order as the values do); a non-finite element
// (bits at least inf's) lowers the thread's `first` to its flat index. A
// thread publishes its `first` with one atomicMin at the end of its kernel
// (report_bad), not one per non-finite element: an all-NaN tensor costs one
// atomic per thread, not one per element on a single address.
template <int V>
__device__ __forceinline__ uint32_t amax_of(const float (&v)[V], uint32_t m, uint64_t flat,
                                            unsigned long long& first) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const uint32_t a = sc::bits_of(v[e]) & sc::kAbsMask;
    m = a > m ? a : m;
    const unsigned long long at = flat + e;
    if (a >= sc::kInfBits && at < first) first = at;
  }
  return m;
}

constexpr unsigned long long kNoBad = ~0ull;

// The thread's first non-finite index into *bad (the smallest wins).
__device__ __forceinline__ void report_bad(unsigned long long first, unsigned long long* bad) {
  if (first != kNoBad) atomicMin(bad, first);
}

// The block's max of every thread's m, returned to every thread. Every
// thread of the block calls it (no thread returned early).
__device__ __forceinline__ uint32_t block_max(uint32_t m, uint32_t* warp_max) {
  m = __reduce_max_sync(0xffffffffu, m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = lane < kThreads / 32 ? warp_max[lane] : 0u;
  m = __reduce_max_sync(0xffffffffu, m);
  __syncthreads();  // warp_max is free again
  return m;
}

// fp8 per 128x128 block, one pass: a CUDA block loads a tensor block into
// registers (kPerRow threads across each of its rows), reduces its amax,
// and writes the scale and the codes from the registers.
template <class S, int V>
__global__ void __launch_bounds__(kThreads) fp8_block_kernel(const typename S::T* src, int64_t rows, int64_t cols,
                                                              uint8_t* q, float* scales, unsigned long long* bad) {
  constexpr int kPerRow = kTile / V;
  constexpr int kRowsPerStep = kThreads / kPerRow;
  constexpr int kSteps = kTile / kRowsPerStep;
  __shared__ uint32_t warp_max[kThreads / 32];
  const int64_t bcols = (cols + kTile - 1) / kTile;
  const int64_t tiles = (rows + kTile - 1) / kTile * bcols;
  const int64_t c = static_cast<int64_t>(threadIdx.x % kPerRow) * V;
  const int64_t ty = threadIdx.x / kPerRow;
  unsigned long long first = kNoBad;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {  // uniform across the block
    const int64_t r0 = tile / bcols * kTile, c0 = tile % bcols * kTile;
    const int64_t h = rows - r0 < kTile ? rows - r0 : kTile, w = cols - c0 < kTile ? cols - c0 : kTile;
    // Vectorized, the block stays in registers (64 per thread); element by
    // element it is read again for the codes (from the cache: 32-64 KiB).
    constexpr bool kHold = V > 1;
    float v[kHold ? kSteps : 1][V];
    uint32_t m = 0;
#pragma unroll(kHold ? kSteps : 4)
    for (int k = 0; k < kSteps; ++k) {
      const int64_t r = ty + k * kRowsPerStep;
      const int64_t at = (r0 + r) * cols + c0 + c;
      if (r < h && c < w) {
        float (&x)[V] = v[kHold ? k : 0];
        load<S, V>(src + at, x);
        m = amax_of<V>(x, m, static_cast<uint64_t>(at), first);
      }
    }
    const float scale = sc::scale_of(sc::float_of(block_max(m, warp_max)));
    if (threadIdx.x == 0) scales[tile] = scale;
#pragma unroll(kHold ? kSteps : 4)
    for (int k = 0; k < kSteps; ++k) {
      const int64_t r = ty + k * kRowsPerStep;
      const int64_t at = (r0 + r) * cols + c0 + c;
      if (r < h && c < w) {
        float (&x)[V] = v[kHold ? k : 0];
        if constexpr (!kHold) load<S, V>(src + at, x);
        store_codes<V>(q + at, x, scale);
      }
    }
  }
  report_bad(first, bad);
}

// fp8 per row, pass 1: blockIdx.y strides over the rows, x over each row's
// chunks of kThreads * V * kRowSteps elements; one atomicMax per chunk.
template <class S, int V>
__global__ void __launch_bounds__(kThreads) amax_rows_kernel(const typename S::T* src, int64_t rows, int64_t cols,
                                                              uint32_t* amax, unsigned long long* bad) {
  constexpr int64_t kChunk = int64_t{kThreads} * V * kRowSteps;
  __shared__ uint32_t warp_max[kThreads / 32];
  unsigned long long first = kNoBad;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c0 = blockIdx.x * kChunk; c0 < cols; c0 += gridDim.x * kChunk) {  // uniform across the block
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kRowSteps; ++k) {
        const int64_t c = c0 + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * V;
        if (c < cols) {
          float v[V];
          load<S, V>(src + r * cols + c, v);
          m = amax_of<V>(v, m, static_cast<uint64_t>(r * cols + c), first);
        }
      }
      m = block_max(m, warp_max);
      if (threadIdx.x == 0 && m) atomicMax(&amax[r], m);
    }
  }
  report_bad(first, bad);
}

// fp8 per row, pass 2: the row's scale and codes.
template <class S, int V>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const typename S::T* src, int64_t rows, int64_t cols,
                                                                  const uint32_t* amax, uint8_t* q, float* scales) {
  constexpr int64_t kChunk = int64_t{kThreads} * V * kRowSteps;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float scale = sc::scale_of(sc::float_of(amax[r]));
    if (blockIdx.x == 0 && threadIdx.x == 0) scales[r] = scale;
    for (int64_t c0 = blockIdx.x * kChunk; c0 < cols; c0 += gridDim.x * kChunk) {
#pragma unroll
      for (int k = 0; k < kRowSteps; ++k) {
        const int64_t c = c0 + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * V;
        if (c < cols) {
          float v[V];
          load<S, V>(src + r * cols + c, v);
          store_codes<V>(q + r * cols + c, v, scale);
        }
      }
    }
  }
}

// Cast: groups of V elements; the last, partial group element by element.
template <class S, class D, int V>
__global__ void __launch_bounds__(kThreads) cast_kernel(const typename S::T* src, uint64_t n, typename D::T* out) {
  const uint64_t groups = (n + V - 1) / V;
  for (uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; g < groups; g += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t i = g * V;
    if (i + V <= n) {
      float v[V];
      load<S, V>(src + i, v);
      store<D, V>(out + i, v);
    } else {
      for (uint64_t j = i; j < n; ++j) {
        float v[1];
        load<S, 1>(src + j, v);
        store<D, 1>(out + j, v);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) encode_bits_kernel(uint32_t first, uint64_t n, uint8_t* codes) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x)
    codes[i] = sc::encode(sc::float_of(static_cast<uint32_t>(first + i)));
}

__global__ void __launch_bounds__(kThreads) reference_bits_kernel(uint32_t first, uint64_t n, uint8_t* codes) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x)
    codes[i] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(__uint_as_float(static_cast<uint32_t>(first + i)), __NV_SATFINITE, __NV_E4M3));
}

// Runs `launch` (it queues kernels) and returns the error of its launches
// alone: an error an earlier failed runtime call left on this thread is
// cleared first, so it is not taken for this launch's. (A sticky error, one
// that broke the context, cannot be cleared; the launch then fails with it
// and reports it.)
template <class F>
cudaError_t launched(F&& launch) {
  (void)cudaGetLastError();
  return launch();
}

unsigned grid_for(uint64_t items) {
  return static_cast<unsigned>(std::clamp<uint64_t>((items + kThreads - 1) / kThreads, 1, kMaxGridX));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f with the source type's tag.
template <class F>
cudaError_t with_source(Float from, F&& f) {
  switch (from) {
    case Float::kF32: return f(SrcF32{});
    case Float::kBF16: return f(SrcBF16{});
    default: return f(SrcF16{});
  }
}

template <class S, class D>
cudaError_t cast_as(const void* src, uint64_t n, void* out, cudaStream_t stream) {
  const auto* s = static_cast<const typename S::T*>(src);
  auto* d = static_cast<typename D::T*>(out);
  return launched([&] {
    if (aligned16(src) && aligned16(out))
      cast_kernel<S, D, 8><<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(s, n, d);
    else
      cast_kernel<S, D, 1><<<grid_for(n), kThreads, 0, stream>>>(s, n, d);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t launch_cast(const void* src, Float from, uint64_t n, void* out, Float to, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return with_source(from, [&](auto s) {
    using S = decltype(s);
    switch (to) {
      case Float::kF32: return cast_as<S, DstF32>(src, n, out, stream);
      case Float::kBF16: return cast_as<S, DstBF16>(src, n, out, stream);
      default: return cast_as<S, DstF16>(src, n, out, stream);
    }
  });
}

cudaError_t launch_fp8_block(const void* src, Float from, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                             unsigned long long* bad, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t tiles = (rows + kTile - 1) / kTile * ((cols + kTile - 1) / kTile);
  const unsigned grid = static_cast<unsigned>(std::min(tiles, kMaxGridX));
  const bool vec = cols % 8 == 0 && aligned16(src) && aligned16(q);
  return launched([&] {
    return with_source(from, [&](auto s) {
      using S = decltype(s);
      const auto* p = static_cast<const typename S::T*>(src);
      if (vec) fp8_block_kernel<S, 8><<<grid, kThreads, 0, stream>>>(p, rows, cols, q, scales, bad);
      else fp8_block_kernel<S, 1><<<grid, kThreads, 0, stream>>>(p, rows, cols, q, scales, bad);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_fp8_rows(const void* src, Float from, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                            uint32_t* amax, unsigned long long* bad, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const bool vec = cols % 8 == 0 && aligned16(src) && aligned16(q);
  const int64_t chunk = int64_t{kThreads} * (vec ? 8 : 1) * kRowSteps;
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>((cols + chunk - 1) / chunk, 1, kMaxGridX)),
                  static_cast<unsigned>(std::min(rows, kMaxGridY)));
  return launched([&] {
    return with_source(from, [&](auto s) {
      using S = decltype(s);
      const auto* p = static_cast<const typename S::T*>(src);
      if (vec) {
        amax_rows_kernel<S, 8><<<grid, kThreads, 0, stream>>>(p, rows, cols, amax, bad);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        quantize_rows_kernel<S, 8><<<grid, kThreads, 0, stream>>>(p, rows, cols, amax, q, scales);
      } else {
        amax_rows_kernel<S, 1><<<grid, kThreads, 0, stream>>>(p, rows, cols, amax, bad);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        quantize_rows_kernel<S, 1><<<grid, kThreads, 0, stream>>>(p, rows, cols, amax, q, scales);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_encode_bits(uint32_t first, uint64_t n, uint8_t* codes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launched([&] {
    encode_bits_kernel<<<grid_for(n), kThreads, 0, stream>>>(first, n, codes);
    return cudaGetLastError();
  });
}

cudaError_t launch_reference_bits(uint32_t first, uint64_t n, uint8_t* codes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launched([&] {
    reference_bits_kernel<<<grid_for(n), kThreads, 0, stream>>>(first, n, codes);
    return cudaGetLastError();
  });
}

}  // namespace paramcast::transform::cuda
