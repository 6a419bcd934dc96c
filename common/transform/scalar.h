// The quantizer's scalar steps, one source for the host loops
// (transform.cc) and the CUDA kernels (cuda/fp8_kernels.cu), so that both
// produce the same bytes by construction: the conversions are integer
// operations on a float's bits plus a few float32 multiplies, adds and
// divides that IEEE 754 defines exactly (round to nearest even). On the
// device those are written as __fmul_rn / __fadd_rn / __fdiv_rn, which nvcc
// neither contracts into an FMA nor approximates; fp8_kernels.cu is also
// compiled with -ftz=false -prec-div=true -fmad=false (common/CMakeLists.txt)
// so that subnormals are kept as the host keeps them; the host keeps them
// because transform.cc's apply clears the thread's denormals-are-zero and
// flush-to-zero modes (x86 MXCSR, Arm FPCR) for its loops, whatever the
// process set (torch.set_flush_denormal, a library built with -ffast-math).
//
// Pure: header only, no state.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PC_SCALAR __host__ __device__ __forceinline__
#else
#define PC_SCALAR inline
#endif

namespace paramcast::transform::scalar {

PC_SCALAR uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
PC_SCALAR float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float32 arithmetic, rounded to nearest even, never fused.
PC_SCALAR float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PC_SCALAR float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PC_SCALAR float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

inline constexpr float kFp8MaxValue = 448.0f;                  // the largest finite e4m3fn
// The smallest amax that gets the scale amax / 448; below it a block is
// scaled as a zero block is (scale 1), as the reference defines it
// (docs/transforms.md). Note that amax / 448 rounds to 0 in float32 only
// for amax <= 224 x 2^-149; between that and this bound it is 2^-149.
inline constexpr float kTinyAmax = 448.0f * 0x1.0p-149f;
inline constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kInfBits = 0x7F800000u;              // |x|'s bits at least this: not finite

// e4m3fn of finite x, saturated to +-448, without branches (the host loops
// vectorize): |x| is clamped on its bits; below 2^-6 the multiples of 2^-9
// (a * 512 + 2^23 rounds to nearest even in the float's low bits: the
// product is exact, a power of two times a float, so only the add rounds);
// above, the exponent and top 3 mantissa bits rounded to nearest even on
// the bits (the carry runs into the exponent; 960 = (127 - 7) << 3 moves
// the exponent bias from float32's to e4m3's).
PC_SCALAR uint8_t encode(float x) {
  const uint32_t w = bits_of(x);
  const uint32_t sign = (w >> 24) & 0x80;
  uint32_t u = w & kAbsMask;
  u = u < 0x43E00000u ? u : 0x43E00000u;  // 448
  const uint32_t sub = bits_of(add(mul(float_of(u), 512.0f), 8388608.0f)) - 0x4B000000u;
  const uint32_t norm = ((u + 0x7FFFFu + ((u >> 20) & 1)) >> 20) - 960u;
  return static_cast<uint8_t>((u < 0x3C800000u ? sub : norm) | sign);  // 2^-6
}

// The scale of a block whose max |x| is `amax` (non-negative, finite):
// amax / 448, or 1 below kTinyAmax. The comparison is on the bits (they
// order as non-negative values do), so that a host thread running with
// denormals-are-zero, where the subnormal kTinyAmax compares as 0, still
// takes this branch (transform.cc also clears DAZ/FTZ for the division).
PC_SCALAR float scale_of(float amax) {
  return bits_of(amax) < bits_of(kTinyAmax) ? 1.0f : div(amax, kFp8MaxValue);
}

// The quantized code of x under `scale` (x finite): e4m3fn(clamp(x / scale)).
PC_SCALAR uint8_t quantize(float x, float scale) { return encode(div(x, scale)); }

PC_SCALAR float bf16_to_float(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

PC_SCALAR uint16_t bf16_from_float(float x) {
  if (x != x) return 0x7FC0;  // NaN
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

PC_SCALAR float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) {
    const float v = mul(static_cast<float>(mant), 0x1.0p-24f);  // exact: 10 bits times a power of two
    return float_of(bits_of(v) | sign);
  }
  if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

// IEEE half, round to nearest even, overflow to infinity, NaN to 0x7E00.
PC_SCALAR uint16_t f16_from_float(float f) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = mul(mul(float_of(bits_of(f) & kAbsMask), scale_to_inf), scale_to_zero);
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = add(float_of((bias >> 1) + 0x07800000u), base);
  const uint32_t b = bits_of(base);
  const uint32_t exp_bits = (b >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = b & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace paramcast::transform::scalar
