// The CUDA quantizer (common/transform/cuda/) against the host apply, its
// reference: the same tensors cast and quantized on both give the same
// bytes and scales, bit for bit, and the same refusal (the first non-finite
// element); the device's e4m3fn conversion equals the host's for all 2^32
// float bit patterns, and CUDA's own conversion (__nv_cvt_float_to_fp8, the
// hardware cvt) for every finite |x| <= 448; apply_all / apply_shards of
// CUDA tensors hand back device memory holding those bytes; a pointer not
// aligned to its elements is refused before any kernel runs, and an error
// an earlier CUDA call left on the thread is not taken for the
// transform's. Every test skips, saying so, where there is no CUDA device.
// CudaFp8Rate (disabled by default; run.sh's fp8_bench stage runs it)
// prints the quantizer's rate against a device-to-device cudaMemcpy of the
// same bytes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/transform/cuda/cuda_transform.h"
#include "common/transform/transform.h"
#include "tests/support/process.h"

namespace paramcast::transform {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)"

// Device memory for a test (16 bytes more than asked, for unaligned
// copies), freed at scope end. Check it with ASSERT_ALLOCATED before use.
struct DeviceBytes {
  explicit DeviceBytes(size_t n) : size(n) {
    error = cudaMalloc(&ptr, std::max<size_t>(n, 1) + 16);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      ptr = nullptr;
    }
  }
  ~DeviceBytes() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  uint8_t* at(size_t offset = 0) const { return static_cast<uint8_t*>(ptr) + offset; }
  void* ptr = nullptr;
  size_t size;
  cudaError_t error = cudaSuccess;
};

// Ends the test where a DeviceBytes could not be allocated.
#define ASSERT_ALLOCATED(bytes)                                                                    \
  ASSERT_EQ((bytes).error, cudaSuccess) << "cudaMalloc of " << (bytes).size << " bytes (" #bytes \
                                        << "): " << cudaGetErrorString((bytes).error)

std::vector<uint8_t> download(const void* p, size_t n) {
  std::vector<uint8_t> out(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

// A host tensor of `dtype` holding `values` (converted as the host does).
std::vector<uint8_t> encode_as(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? bf16_from_float(values[i]) : f16_from_float(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// Values with a spread of magnitudes: each 64-element run has its own
// exponent, some runs are zero, some tiny (an amax below 448 x 2^-149, or
// codes in e4m3's subnormal range), some hold one large value among small
// ones, some every element at +-amax (codes at +-448 after rounding).
std::vector<float> spread_values(size_t n, uint32_t seed, DType dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9), expo(-30, 30);
  const int max_exp = dtype == DType::kF16 ? 3 : 60;  // F16: 1000 x a run's magnitude stays finite
  std::vector<float> v(n);
  for (size_t run = 0; run < n; run += 64) {
    const int k = kind(rng);
    const float mag = std::ldexp(1.0f, std::clamp(expo(rng), -max_exp, max_exp));
    const float amax = std::fabs(normal(rng)) * mag + mag;
    for (size_t i = run; i < std::min(n, run + 64); ++i) {
      switch (k) {
        case 0: v[i] = 0.0f; break;
        case 1: v[i] = normal(rng) * (dtype == DType::kF16 ? 0x1.0p-24f : 0x1.0p-140f); break;  // tiny
        case 2: v[i] = (i == run ? 1000.0f : 1e-3f) * normal(rng) * mag; break;                  // e4m3 subnormals
        case 3: v[i] = (rng() & 1) ? amax : -amax; break;                                         // at +-448
        case 4: v[i] = (i % 3 == 0) ? -0.0f : normal(rng) * mag; break;
        default: v[i] = normal(rng) * mag;
      }
    }
  }
  return v;
}

struct Outcome {
  Status status;
  std::vector<uint8_t> out;
  std::vector<uint8_t> scales;
};

// apply on the host and on the device (src copied to the device at byte
// `offset`, 0 or an offset that breaks 16-byte alignment).
void expect_same(const TensorSpec& spec, const std::vector<uint8_t>& host_src, const Transform& t,
                 size_t offset = 0) {
  const auto specs = wire_specs(spec, t);
  const size_t out_bytes = specs[0].nbytes().value();
  const size_t scale_bytes = specs.size() > 1 ? specs[1].nbytes().value() : 0;

  Outcome host;
  host.out.assign(out_bytes, 0xAB);
  host.scales.assign(scale_bytes, 0xAB);
  host.status = apply(TensorView{spec, const_cast<uint8_t*>(host_src.data()), Device::cpu()}, t, host.out.data(),
                      reinterpret_cast<float*>(host.scales.data()));

  DeviceBytes src(host_src.size() + offset), out(out_bytes), scales(scale_bytes);
  ASSERT_ALLOCATED(src);
  ASSERT_ALLOCATED(out);
  ASSERT_ALLOCATED(scales);
  ASSERT_EQ(cudaMemset(out.ptr, 0xAB, out_bytes + 1), cudaSuccess);
  ASSERT_EQ(cudaMemset(scales.ptr, 0xAB, scale_bytes + 1), cudaSuccess);
  if (!host_src.empty()) {
    ASSERT_EQ(cudaMemcpy(src.at(offset), host_src.data(), host_src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Outcome dev;
  dev.status = apply(TensorView{spec, src.at(offset), Device::cuda(0)}, t, out.ptr,
                     reinterpret_cast<float*>(scales.ptr));
  std::string what = spec.name + " " + spec.shape_string();
  what += " ";
  what += dtype_name(spec.dtype);
  what += " ";
  what += describe(t);
  if (offset) what += " (unaligned)";
  ASSERT_EQ(host.status.ok(), dev.status.ok()) << what << ": host " << host.status.to_string() << ", device "
                                               << dev.status.to_string();
  if (!host.status.ok()) {
    EXPECT_EQ(host.status.to_string(), dev.status.to_string()) << what;
    return;
  }
  dev.out = download(out.ptr, out_bytes);
  dev.scales = download(scales.ptr, scale_bytes);
  ASSERT_EQ(host.scales.size(), dev.scales.size());
  for (size_t i = 0; i < host.scales.size(); i += 4)
    ASSERT_EQ(std::memcmp(&host.scales[i], &dev.scales[i], 4), 0)
        << what << ": scale " << i / 4 << " host " << *reinterpret_cast<const float*>(&host.scales[i]) << " device "
        << *reinterpret_cast<const float*>(&dev.scales[i]);
  const size_t unit = dtype_size(specs[0].dtype);
  for (size_t i = 0; i < out_bytes; i += unit)
    ASSERT_EQ(std::memcmp(&host.out[i], &dev.out[i], unit), 0) << what << ": element " << i / unit << " differs";
}

Transform fp8(Fp8Scaling s) {
  Transform t;
  t.kind = Transform::Kind::kFp8;
  t.to = DType::kF8E4M3;
  t.scaling = s;
  return t;
}
Transform cast_to(DType d) {
  Transform t;
  t.kind = Transform::Kind::kCast;
  t.to = d;
  return t;
}

const DType kFloats[] = {DType::kF32, DType::kBF16, DType::kF16};
const Fp8Scaling kScalings[] = {Fp8Scaling::kBlock, Fp8Scaling::kChannel, Fp8Scaling::kTensor};

TEST(CudaTransformTest, Fp8MatchesHostBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::vector<int64_t>> shapes = {{200, 328}, {1, 1}, {129, 127}, {256, 256}, {128, 1024},
                                                    {3, 8},     {1, 5000}, {300, 1}, {0, 5},   {5, 0},
                                                    {257, 136}, {1000, 2048},
                                                    // more rows than gridDim.y's 65535 (channel: rows by stride)
                                                    {70000, 8},
                                                    // channel: several CUDA blocks atomicMax one row's amax
                                                    {4, 20000}};
  uint32_t seed = 1;
  for (DType d : kFloats)
    for (const auto& shape : shapes) {
      const TensorSpec spec{"w", d, shape};
      const auto values = spread_values(static_cast<size_t>(shape[0] * shape[1]), seed++, d);
      const auto bytes = encode_as(d, values);
      for (Fp8Scaling s : kScalings) {
        expect_same(spec, bytes, fp8(s));
        expect_same(spec, bytes, fp8(s), dtype_size(d));  // element-by-element path
        if (HasFatalFailure()) return;
      }
    }
}

// A 256x256 tensor of `dtype` (F32 or BF16) whose four 128x128 blocks
// have amaxes at the edges of the scale. Every element at +-amax in a
// quarter of places: amax / scale rounds to 448 or just above it (clamped).
//   F32:  (0, 0) normal; (0, 1) just above 448 x 2^-149 (subnormal
//         scales); (1, 0) 2^-145, below the tiny amax (scale 1); (1, 1)
//         exactly 448 x 2^-149; float32 subnormal elements throughout.
//   BF16: (0, 0) normal; (0, 1) BF16 subnormals, 2^-133 x (1..127)
//         (subnormal float scales); (1, 0) 2^-133 alone, BF16's smallest
//         (elements 0 or +-2^-133); (1, 1) BF16's smallest normals, 2^-126.
std::vector<float> edge_values(DType dtype) {
  std::mt19937 rng(7);
  std::vector<float> v(256 * 256);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t block = static_cast<uint32_t>((i / 256) / 128 * 2 + (i % 256) / 128);
    float amax;
    if (block == 0) {
      amax = std::ldexp(1.0f + (rng() % 1000) / 1000.0f, static_cast<int>(rng() % 40) - 20);
    } else if (dtype == DType::kBF16) {
      switch (block) {
        case 1: amax = 0x1.0p-133f * static_cast<float>(1 + rng() % 127); break;
        case 2: amax = 0x1.0p-133f; break;
        default: amax = 0x1.0p-126f * (1.0f + static_cast<float>(rng() % 8) / 8.0f); break;
      }
    } else {
      switch (block) {
        case 1: amax = 448.0f * 0x1.0p-149f * (1.0f + static_cast<float>(rng() % 8)); break;
        case 2: amax = 0x1.0p-145f; break;
        default: amax = 448.0f * 0x1.0p-149f; break;
      }
    }
    const float x = (rng() % 4 == 0) ? amax : static_cast<float>(rng() % 100000) / 100000.0f * amax;
    v[i] = (rng() & 1) ? x : -x;
  }
  return v;
}

TEST(CudaTransformTest, Fp8EdgesOfTheScale) {
  SKIP_WITHOUT_GPU();
  const TensorSpec spec{"edge", DType::kF32, {256, 256}};
  const auto bytes = encode_as(DType::kF32, edge_values(DType::kF32));
  for (Fp8Scaling s : kScalings) {
    expect_same(spec, bytes, fp8(s));
    expect_same(spec, bytes, fp8(s), 4);
    if (HasFatalFailure()) return;
  }
}

// BF16 reaches 2^-133 (its subnormals): amaxes and scales far below
// float32's normals, which F16 (down to 2^-24) never reaches.
TEST(CudaTransformTest, Fp8EdgesOfTheScaleBf16) {
  SKIP_WITHOUT_GPU();
  const TensorSpec spec{"edge", DType::kBF16, {256, 256}};
  const auto bytes = encode_as(DType::kBF16, edge_values(DType::kBF16));
  for (Fp8Scaling s : kScalings) {
    expect_same(spec, bytes, fp8(s));
    expect_same(spec, bytes, fp8(s), 2);
    if (HasFatalFailure()) return;
  }
}

TEST(CudaTransformTest, Fp8RefusesTheFirstNonFiniteElement) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> shape = {200, 328};
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (DType d : kFloats) {
    auto values = spread_values(200 * 328, 11, d);
    values[150 * 328 + 3] = inf;      // a later block row, first column block
    values[10 * 328 + 300] = nan;     // the first in flat order
    values[199 * 328 + 327] = -inf;   // the last element
    const auto bytes = encode_as(d, values);
    for (Fp8Scaling s : kScalings) {
      expect_same(TensorSpec{"bad", d, shape}, bytes, fp8(s));
      expect_same(TensorSpec{"bad", d, shape}, bytes, fp8(s), dtype_size(d));
    }
    // One bad element alone, in each position class.
    for (int64_t at : {int64_t{0}, int64_t{327}, int64_t{128 * 328 + 128}, int64_t{200 * 328 - 1}}) {
      auto one = spread_values(200 * 328, 12, d);
      one[static_cast<size_t>(at)] = -inf;
      for (Fp8Scaling s : kScalings) expect_same(TensorSpec{"bad", d, shape}, encode_as(d, one), fp8(s));
    }
  }
}

// Casts over random bit patterns (NaN payloads, infinities, subnormals,
// overflow to infinity included), odd lengths and unaligned sources.
TEST(CudaTransformTest, CastMatchesHostBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  for (DType from : kFloats)
    for (DType to : kFloats)
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{1000003}}) {
        std::vector<uint8_t> bytes(static_cast<size_t>(n) * dtype_size(from));
        for (auto& b : bytes) b = static_cast<uint8_t>(rng());
        const TensorSpec spec{"c", from, {n}};
        expect_same(spec, bytes, cast_to(to));
        expect_same(spec, bytes, cast_to(to), dtype_size(from));  // unaligned to 16 bytes, aligned to elements
        // The same as values of every magnitude too (not only random bits).
        const auto values = spread_values(static_cast<size_t>(n), static_cast<uint32_t>(n), from);
        expect_same(spec, encode_as(from, values), cast_to(to));
        if (HasFatalFailure()) return;
      }
}

// A code that differs: the float's bits, the device's code, the other's.
struct CodeMismatch {
  uint32_t bits;
  uint8_t device;
  uint8_t other;
  bool operator<(const CodeMismatch& o) const { return bits < o.bits; }
};

// The first few of `found` (each worker's first few, in order), one a line.
std::string first_mismatches(const std::vector<std::vector<CodeMismatch>>& found, const char* other) {
  std::vector<CodeMismatch> all;
  for (const auto& f : found) all.insert(all.end(), f.begin(), f.end());
  std::sort(all.begin(), all.end());
  std::string out;
  for (size_t i = 0; i < all.size() && i < 8; ++i) {
    char line[96];
    std::snprintf(line, sizeof(line), "\n  float bits 0x%08x: device 0x%02x, %s 0x%02x", all[i].bits, all[i].device,
                  other, all[i].other);
    out += line;
  }
  return out;
}

// The conversion the kernels run, for every float bit pattern (the clamp,
// e4m3's subnormals, ties, NaN and infinity included), against the host's
// (the same scalar.h: equal by construction unless the compilers differ)
// and, for finite |x| <= 448, against CUDA's own __nv_cvt_float_to_fp8(x,
// __NV_SATFINITE, __NV_E4M3), which shares no code with scalar.h (a
// rounding mistake in scalar.h would be on both host and device).
TEST(CudaTransformTest, E4m3ConversionEqualsHostAndCudaForAllFloats) {
  SKIP_WITHOUT_GPU();
  constexpr uint64_t kChunk = 1ull << 28;
  constexpr size_t kKeep = 8;  // mismatches kept per worker to print
  DeviceBytes codes(kChunk), reference(kChunk);
  ASSERT_ALLOCATED(codes);
  ASSERT_ALLOCATED(reference);
  std::vector<uint8_t> dev(kChunk), ref(kChunk);
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::vector<CodeMismatch>> vs_host(threads), vs_cuda(threads);
  std::atomic<uint64_t> host_mismatches{0}, cuda_mismatches{0}, cuda_compared{0};
  for (uint64_t first = 0; first < (1ull << 32); first += kChunk) {
    ASSERT_TRUE(cuda::encode_bits(static_cast<uint32_t>(first), kChunk, codes.at()).ok());
    ASSERT_TRUE(cuda::reference_bits(static_cast<uint32_t>(first), kChunk, reference.at()).ok());
    ASSERT_EQ(cudaMemcpy(dev.data(), codes.ptr, kChunk, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ref.data(), reference.ptr, kChunk, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < threads; ++w)
      pool.emplace_back([&, w] {
        uint64_t host_bad = 0, cuda_bad = 0, compared = 0;
        for (uint64_t i = w; i < kChunk; i += threads) {
          const uint32_t bits = static_cast<uint32_t>(first + i);
          float x;
          std::memcpy(&x, &bits, 4);
          const uint8_t host = e4m3fn_from_float(x);
          if (host != dev[i]) {
            ++host_bad;
            if (vs_host[w].size() < kKeep) vs_host[w].push_back({bits, dev[i], host});
          }
          if ((bits & 0x7FFFFFFFu) <= 0x43E00000u) {  // finite, |x| <= 448
            ++compared;
            if (ref[i] != dev[i]) {
              ++cuda_bad;
              if (vs_cuda[w].size() < kKeep) vs_cuda[w].push_back({bits, dev[i], ref[i]});
            }
          }
        }
        host_mismatches += host_bad;
        cuda_mismatches += cuda_bad;
        cuda_compared += compared;
      });
    for (auto& th : pool) th.join();
  }
  EXPECT_EQ(host_mismatches.load(), 0u) << "device != host; the first:" << first_mismatches(vs_host, "host");
  EXPECT_EQ(cuda_mismatches.load(), 0u) << "device != __nv_cvt_float_to_fp8; the first:"
                                        << first_mismatches(vs_cuda, "cuda");
  // 2 x (0x43E00000 + 1): both signs of every |x| up to 448.
  EXPECT_EQ(cuda_compared.load(), 2ull * (0x43E00000ull + 1));
  std::printf("e4m3fn: 2^32 float bit patterns, device == host for %s; finite |x| <= 448 (%llu), device == "
              "__nv_cvt_float_to_fp8 for %s\n",
              host_mismatches ? "NOT all" : "all", static_cast<unsigned long long>(cuda_compared.load()),
              cuda_mismatches ? "NOT all" : "all");
}

// A pointer a kernel would read or write elements through, not aligned to
// them, is refused naming the tensor before anything runs (a misaligned
// load would be a sticky error, ending every later CUDA call of this
// process); the context is usable afterwards.
TEST(CudaTransformTest, MisalignedPointersAreRefusedBeforeAnyKernel) {
  SKIP_WITHOUT_GPU();
  const TensorSpec spec{"odd", DType::kF32, {64, 64}};
  const auto bytes = encode_as(DType::kF32, spread_values(64 * 64, 31, DType::kF32));
  DeviceBytes src(bytes.size()), out(bytes.size()), scales(64 * 4);
  ASSERT_ALLOCATED(src);
  ASSERT_ALLOCATED(out);
  ASSERT_ALLOCATED(scales);
  ASSERT_EQ(cudaMemcpy(src.at(2), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  auto refused = [&](const TensorView& v, const Transform& t, void* o, void* sc, const std::string& says) {
    const Status st = apply(v, t, o, static_cast<float*>(sc));
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << describe(t) << ": " << st.to_string();
    EXPECT_NE(st.message().find("tensor 'odd'"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
  };
  const TensorView odd{spec, src.at(2), Device::cuda(0)};
  for (Fp8Scaling s : kScalings) refused(odd, fp8(s), out.ptr, scales.ptr, "is not aligned to its 4-byte F32 elements");
  refused(odd, cast_to(DType::kBF16), out.ptr, nullptr, "is not aligned to its 4-byte F32 elements");
  const TensorView even{spec, src.at(0), Device::cuda(0)};
  refused(even, cast_to(DType::kF16), out.at(1), nullptr, "the output buffer");
  refused(even, fp8(Fp8Scaling::kBlock), out.ptr, scales.at(2), "the scales buffer");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // The context still works.
  expect_same(spec, bytes, fp8(Fp8Scaling::kBlock));
  expect_same(spec, bytes, fp8(Fp8Scaling::kChannel), 4);
}

// An error an earlier, unrelated CUDA call left on the thread (here: a
// device that does not exist) is not reported as the transform's: each
// launch's check sees its own launch only; and a transform leaves no error
// behind.
TEST(CudaTransformTest, AnEarlierFailedCallIsNotTheTransformsError) {
  SKIP_WITHOUT_GPU();
  const TensorSpec spec{"w", DType::kBF16, {200, 328}};
  const auto bytes = encode_as(DType::kBF16, spread_values(200 * 328, 41, DType::kBF16));
  for (const Transform& t : {fp8(Fp8Scaling::kBlock), fp8(Fp8Scaling::kChannel), fp8(Fp8Scaling::kTensor),
                             cast_to(DType::kF16)}) {
    ASSERT_NE(cudaSetDevice(1 << 20), cudaSuccess);  // leaves cudaErrorInvalidDevice on this thread
    expect_same(spec, bytes, t);
    if (HasFatalFailure()) return;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << describe(t);
  }
}

// apply_all / apply_shards of CUDA tensors: device buffers on the tensor's
// device, holding the host's bytes.
TEST(CudaTransformTest, ApplyAllAndShardsHandBackDeviceMemory) {
  SKIP_WITHOUT_GPU();
  const std::vector<Rule> rules = {{"*.q", std::nullopt, Fp8Scaling::kBlock, false, "r0"},
                                   {"*.c", DType::kF16, std::nullopt, false, "r1"}};
  const auto qv = spread_values(256 * 200, 21, DType::kBF16);
  const auto cv = spread_values(1000, 22, DType::kBF16);
  const auto qb = encode_as(DType::kBF16, qv), cb = encode_as(DType::kBF16, cv);
  DeviceBytes dq(qb.size()), dc(cb.size());
  ASSERT_ALLOCATED(dq);
  ASSERT_ALLOCATED(dc);
  ASSERT_EQ(cudaMemcpy(dq.ptr, qb.data(), qb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dc.ptr, cb.data(), cb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const TensorSpec qs{"l.q", DType::kBF16, {256, 200}}, cs{"l.c", DType::kBF16, {1000}}, ks{"l.k", DType::kBF16, {4}};
  const uint16_t keep[4] = {1, 2, 3, 4};
  DeviceBytes dk(8);
  ASSERT_ALLOCATED(dk);
  ASSERT_EQ(cudaMemcpy(dk.ptr, keep, 8, cudaMemcpyHostToDevice), cudaSuccess);

  auto host = apply_all({TensorView{qs, const_cast<uint8_t*>(qb.data()), Device::cpu()},
                         TensorView{cs, const_cast<uint8_t*>(cb.data()), Device::cpu()},
                         TensorView{ks, const_cast<uint16_t*>(keep), Device::cpu()}},
                        rules);
  auto dev = apply_all({TensorView{qs, dq.ptr, Device::cuda(0)}, TensorView{cs, dc.ptr, Device::cuda(0)},
                        TensorView{ks, dk.ptr, Device::cuda(0)}},
                       rules);
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  ASSERT_EQ(host->views.size(), 4u);
  ASSERT_EQ(dev->views.size(), 4u);
  EXPECT_EQ(dev->transformed, 2u);
  EXPECT_EQ(dev->owned_bytes, host->owned_bytes);
  for (size_t i = 0; i < 4; ++i) {
    const auto& h = host->views[i];
    const auto& d = dev->views[i];
    EXPECT_EQ(h.spec.name, d.spec.name);
    EXPECT_TRUE(d.device.is_cuda()) << d.spec.name;
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, d.data), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << d.spec.name;
    const size_t n = h.spec.nbytes().value();
    const auto got = download(d.data, n);
    EXPECT_EQ(std::memcmp(got.data(), h.data, n), 0) << d.spec.name;
  }

  // A row shard of the fp8 tensor: rows [128, 256).
  ShardView hs{TensorView{TensorSpec{"l.q", DType::kBF16, {128, 200}},
                          const_cast<uint8_t*>(qb.data()) + 128 * 200 * 2, Device::cpu()},
               {256, 200},
               {128, 0}};
  ShardView ds = hs;
  ds.local.data = dq.at(128 * 200 * 2);
  ds.local.device = Device::cuda(0);
  auto hsh = apply_shards({hs}, rules);
  auto dsh = apply_shards({ds}, rules);
  ASSERT_TRUE(hsh.ok()) << hsh.status().to_string();
  ASSERT_TRUE(dsh.ok()) << dsh.status().to_string();
  ASSERT_EQ(dsh->views.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(dsh->views[i].local.device.is_cuda());
    EXPECT_EQ(dsh->views[i].offsets, hsh->views[i].offsets);
    const size_t n = hsh->views[i].local.spec.nbytes().value();
    const auto got = download(dsh->views[i].local.data, n);
    EXPECT_EQ(std::memcmp(got.data(), hsh->views[i].local.data, n), 0) << dsh->views[i].local.spec.name;
  }

  // A non-finite element refuses the update on the device as on the host.
  auto bad = qv;
  bad[77] = std::numeric_limits<float>::infinity();
  const auto bb = encode_as(DType::kBF16, bad);
  ASSERT_EQ(cudaMemcpy(dq.ptr, bb.data(), bb.size(), cudaMemcpyHostToDevice), cudaSuccess);
  auto hbad = apply_all({TensorView{qs, const_cast<uint8_t*>(bb.data()), Device::cpu()}}, rules);
  auto dbad = apply_all({TensorView{qs, dq.ptr, Device::cuda(0)}}, rules);
  ASSERT_FALSE(dbad.ok());
  EXPECT_EQ(hbad.status().to_string(), dbad.status().to_string());
}

// The rate of the quantizer on a 256 MiB BF16 tensor [16384, 8192] against
// a device-to-device cudaMemcpy of the same bytes (a figure, not a check).
TEST(CudaFp8Rate, DISABLED_Bf16_256MiB) {
  SKIP_WITHOUT_GPU();
  constexpr int64_t kRows = 16384, kCols = 8192;
  constexpr size_t kBytes = kRows * kCols * 2;
  constexpr int kRepeats = 10;
  DeviceBytes src(kBytes), copy(kBytes), q(kRows * kCols * 2), scales(kRows * 4);
  ASSERT_ALLOCATED(src);
  ASSERT_ALLOCATED(copy);
  ASSERT_ALLOCATED(q);
  ASSERT_ALLOCATED(scales);
  {
    std::vector<float> v = spread_values(1 << 20, 5, DType::kBF16);
    const auto b = encode_as(DType::kBF16, v);
    for (size_t at = 0; at < kBytes; at += b.size())
      ASSERT_EQ(cudaMemcpy(src.at(at), b.data(), std::min(b.size(), kBytes - at), cudaMemcpyHostToDevice), cudaSuccess);
  }
  const TensorView view{TensorSpec{"bench", DType::kBF16, {kRows, kCols}}, src.ptr, Device::cuda(0)};
  auto seconds = [&](auto&& step) {
    step();  // warm-up
    cudaDeviceSynchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kRepeats; ++i) step();
    cudaDeviceSynchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kRepeats;
  };
  const double memcpy_s = seconds([&] { (void)cudaMemcpyAsync(copy.ptr, src.ptr, kBytes, cudaMemcpyDeviceToDevice); });
  auto line = [&](const char* what, double s) {
    std::printf("fp8_bench %-22s %8.1f GB/s  %5.2f x memcpy  (%.3f ms per 256 MiB bf16)\n", what, kBytes / s / 1e9,
                memcpy_s / s, s * 1e3);
  };
  std::printf("fp8_bench %-22s %8.1f GB/s  (%.3f ms)\n", "cudaMemcpy d2d", kBytes / memcpy_s / 1e9, memcpy_s * 1e3);
  line("cast bf16->f16", seconds([&] { ASSERT_TRUE(apply(view, cast_to(DType::kF16), q.ptr, nullptr).ok()); }));
  for (Fp8Scaling s : kScalings) {
    const Transform t = fp8(s);
    line(describe(t).c_str(),
         seconds([&] { ASSERT_TRUE(apply(view, t, q.ptr, reinterpret_cast<float*>(scales.ptr)).ok()); }));
  }
}

}  // namespace
}  // namespace paramcast::transform
