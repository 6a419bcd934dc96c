// The transforms' pure part: rules, wire specs, the scalar conversions
// against brute force, and the FP8 groups. The bit-for-bit check against
// PyTorch's own conversions is tests/python/test_transforms.py.
#include "common/transform/transform.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__))
#include <xmmintrin.h>
#define PC_TEST_HAVE_MXCSR 1
#else
#define PC_TEST_HAVE_MXCSR 0
#endif

namespace paramcast::transform {
namespace {

TEST(TransformRulesTest, GlobsMatchTheWholeName) {
  EXPECT_TRUE(glob_match("*.weight", "layers.0.mlp.up_proj.weight"));
  EXPECT_FALSE(glob_match("*.weight", "layers.0.mlp.up_proj.weight_scale_inv"));
  EXPECT_TRUE(glob_match("layers.?.mlp.*", "layers.3.mlp.down_proj.weight"));
  EXPECT_FALSE(glob_match("layers.?.mlp.*", "layers.13.mlp.down_proj.weight"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("*proj*", "q_proj.weight"));
  EXPECT_FALSE(glob_match("", "x"));
}

TEST(TransformRulesTest, TheFirstMatchingRuleDecidesAndKeepExempts) {
  std::vector<Rule> rules(3);
  rules[0].match = "*norm*";
  rules[0].keep = true;
  rules[1].match = "*.weight";
  rules[1].fp8 = Fp8Scaling::kBlock;
  rules[2].match = "*";
  rules[2].cast = DType::kBF16;
  auto w = resolve(rules, TensorSpec{"l.q_proj.weight", DType::kBF16, {256, 300}});
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(w->kind, Transform::Kind::kFp8);
  EXPECT_EQ(w->rule, 1);
  auto specs = wire_specs(TensorSpec{"l.q_proj.weight", DType::kBF16, {256, 300}}, *w);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0], (TensorSpec{"l.q_proj.weight", DType::kF8E4M3, {256, 300}}));
  EXPECT_EQ(specs[1], (TensorSpec{"l.q_proj.weight_scale_inv", DType::kF32, {2, 3}}));
  auto norm = resolve(rules, TensorSpec{"l.input_norm.weight", DType::kF32, {256}});
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(norm->none());
  auto bias = resolve(rules, TensorSpec{"l.bias", DType::kF32, {256}});
  ASSERT_TRUE(bias.ok());
  EXPECT_EQ(bias->kind, Transform::Kind::kCast);
  EXPECT_EQ(wire_specs(TensorSpec{"l.bias", DType::kF32, {256}}, *bias)[0].dtype, DType::kBF16);
  // Already the dtype the rule casts to: as is.
  EXPECT_TRUE(resolve(rules, TensorSpec{"l.b", DType::kBF16, {4}})->none());
  // Nothing matches: as is.
  EXPECT_TRUE(resolve({rules[1]}, TensorSpec{"l.b", DType::kF32, {4}})->none());
}

TEST(TransformRulesTest, ARuleThatCannotApplyNamesTheTensorAndTheRule) {
  std::vector<Rule> rules(1);
  rules[0].match = "*";
  rules[0].fp8 = Fp8Scaling::kBlock;
  rules[0].where = "job.yaml:7 publisher.transforms[0]";
  auto v = resolve(rules, TensorSpec{"l.norm.weight", DType::kBF16, {4096}});
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().message(),
            "tensor 'l.norm.weight' [4096] (BF16): fp8 takes a 2-D tensor (a weight matrix); job.yaml:7 "
            "publisher.transforms[0] (match '*') matches it (exempt it with keep: true ahead of that rule)");
  auto i = resolve(rules, TensorSpec{"step", DType::kI64, {2, 2}});
  ASSERT_FALSE(i.ok());
  EXPECT_NE(i.status().message().find("fp8 takes a float tensor"), std::string::npos);
}

// Brute force: the finite e4m3fn nearest to x, ties to the even code.
uint8_t nearest_e4m3fn(float x) {
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    const float v = e4m3fn_to_float(static_cast<uint8_t>(c));
    if (std::signbit(v) != std::signbit(x)) continue;
    const double d = std::fabs(static_cast<double>(v) - static_cast<double>(x));
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(TransformScalarTest, E4m3fnRoundsToTheNearestEvenCode) {
  EXPECT_EQ(e4m3fn_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(e4m3fn_to_float(0x7F)));
  // Every finite code round-trips, and every midpoint between neighbours
  // goes to the even one.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    const float v = e4m3fn_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(e4m3fn_from_float(v), c == 0x80 ? 0x80 : c) << c;
    if ((c & 0x7F) < 0x7E) {
      const float next = e4m3fn_to_float(static_cast<uint8_t>(c + 1));
      const float mid = (v + next) / 2;
      EXPECT_EQ(e4m3fn_from_float(mid), nearest_e4m3fn(mid)) << "between codes " << c << " and " << c + 1;
      EXPECT_EQ(e4m3fn_from_float(mid) & 1, 0) << mid;
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-12.0f, 8.8f);
  for (int i = 0; i < 200000; ++i) {
    float x = std::exp2(mag(rng));
    if (x > 448.0f) x = 448.0f;
    if (i % 2) x = -x;
    ASSERT_EQ(e4m3fn_from_float(x), nearest_e4m3fn(x)) << x;
  }
}

TEST(TransformScalarTest, Bf16AndF16RoundToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(std::nanf("")), 0x7FC0);
  uint32_t tie;  // 1 + 2^-8: halfway between bf16 1.0 and 1.0078125
  const float one_and_half_ulp = 1.0f + std::ldexp(1.0f, -8);
  std::memcpy(&tie, &one_and_half_ulp, 4);
  EXPECT_EQ(bf16_from_float(one_and_half_ulp), 0x3F80);  // to even
  EXPECT_EQ(f16_from_float(65504.0f), 0x7BFF);
  EXPECT_EQ(f16_from_float(65520.0f), 0x7C00);  // rounds up to infinity
  EXPECT_EQ(f16_from_float(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f16_from_float(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f16_from_float(v), h) << h;
    ASSERT_EQ(bf16_from_float(bf16_to_float(static_cast<uint16_t>(h))), h) << h;
  }
}

std::vector<float> ramp(int64_t rows, int64_t cols) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) * (1 + i % 7);
  return x;
}

TEST(TransformFp8Test, BlocksScaleByTheirOwnAmaxAndEdgeBlocksAreWhatIsThere) {
  const int64_t rows = 130, cols = 260;
  auto x = ramp(rows, cols);
  for (int64_t r = 0; r < 128; ++r)  // block (0, 1) all zero
    for (int64_t c = 128; c < 256; ++c) x[static_cast<size_t>(r * cols + c)] = 0;
  x[static_cast<size_t>(129 * cols + 259)] = -1000.0f;  // in the last (partial) block only
  TensorView v{TensorSpec{"w", DType::kF32, {rows, cols}}, x.data(), Device::cpu()};
  Transform t{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kBlock, 0};
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  std::vector<float> s(2 * 3);
  ASSERT_TRUE(apply(v, t, q.data(), s.data()).ok());
  for (int64_t br = 0; br < 2; ++br)
    for (int64_t bc = 0; bc < 3; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      EXPECT_EQ(s[static_cast<size_t>(br * 3 + bc)], amax == 0 ? 1.0f : amax / 448.0f) << br << "," << bc;
    }
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(s[5], 1000.0f / 448.0f);
  EXPECT_EQ(q[static_cast<size_t>(129 * cols + 259)], 0xFE);  // -448
  // Every element dequantizes to within half an e4m3 step of x.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = s[static_cast<size_t>((r / 128) * 3 + c / 128)];
      const float back = e4m3fn_to_float(q[static_cast<size_t>(r * cols + c)]) * scale;
      const float xv = x[static_cast<size_t>(r * cols + c)];
      ASSERT_LE(std::fabs(back - xv), std::max(std::fabs(xv) / 16, scale * std::ldexp(1.0f, -10))) << r << "," << c;
    }
}

TEST(TransformFp8Test, ChannelAndTensorScalingAndNonFiniteValuesAreRefused) {
  const int64_t rows = 3, cols = 5;
  auto x = ramp(rows, cols);
  TensorView v{TensorSpec{"w", DType::kF32, {rows, cols}}, x.data(), Device::cpu()};
  std::vector<uint8_t> q(15);
  std::vector<float> s(3);
  ASSERT_TRUE(apply(v, Transform{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kChannel, 0}, q.data(), s.data()).ok());
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
    EXPECT_EQ(s[static_cast<size_t>(r)], amax / 448.0f);
  }
  float one = 0;
  ASSERT_TRUE(apply(v, Transform{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kTensor, 0}, q.data(), &one).ok());
  EXPECT_EQ(one, std::max(s[0], std::max(s[1], s[2])));
  x[7] = std::numeric_limits<float>::infinity();
  Status bad = apply(v, Transform{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kBlock, 0}, q.data(), s.data());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.message(), "tensor 'w': element [1, 2] is not finite (inf): fp8: block cannot scale it; nothing was sent");
}

// A block whose amax is so small that amax / 448 is 0 in float32 is scaled
// as a zero block (scale 1), not divided by zero.
TEST(TransformFp8Test, ABlockOfTinyValuesIsScaledAsAZeroBlock) {
  std::vector<float> x = {1e-45f, -2e-45f, 0.0f, 3e-45f};
  TensorView v{TensorSpec{"w", DType::kF32, {2, 2}}, x.data(), Device::cpu()};
  std::vector<uint8_t> q(4);
  float s = 0;
  ASSERT_TRUE(apply(v, Transform{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kBlock, 0}, q.data(), &s).ok());
  EXPECT_EQ(s, 1.0f);
  for (uint8_t c : q) EXPECT_EQ(c & 0x7F, 0) << int(c);
}

TEST(TransformFp8Test, ShardsWhoseBoxIsNotInsideOrHasNoDataAreRefused) {
  std::vector<Rule> rules(1);
  rules[0].match = "*";
  rules[0].fp8 = Fp8Scaling::kBlock;
  std::vector<uint16_t> x(128 * 4);
  ShardView ok{TensorView{TensorSpec{"w", DType::kBF16, {128, 4}}, x.data(), Device::cpu()}, {256, 4}, {128, 0}};
  auto t = apply_shards({ok}, rules);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->views.size(), 2u);
  EXPECT_EQ(t->views[1].offsets, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(t->views[1].full_shape, (std::vector<int64_t>{2, 1}));
  ShardView one_offset = ok;
  one_offset.offsets = {128};
  auto bad = apply_shards({one_offset}, rules);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("is not inside [256, 4]"), std::string::npos) << bad.status().message();
  ShardView flat = ok;
  flat.local.spec.shape = {512};
  EXPECT_FALSE(apply_shards({flat}, rules).ok());
  ShardView no_data = ok;
  no_data.local.data = nullptr;
  auto none = apply_shards({no_data}, rules);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("has no data pointer"), std::string::npos);
}

TEST(TransformCastTest, CastsEveryElement) {
  std::vector<float> x = {1.0f, -2.5f, 3.14159f, 1e-40f, 70000.0f};
  TensorView v{TensorSpec{"b", DType::kF32, {5}}, x.data(), Device::cpu()};
  std::vector<uint16_t> out(5);
  ASSERT_TRUE(apply(v, Transform{Transform::Kind::kCast, DType::kBF16, Fp8Scaling::kBlock, 0}, out.data(), nullptr).ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(out[i], bf16_from_float(x[i]));
  ASSERT_TRUE(apply(v, Transform{Transform::Kind::kCast, DType::kF16, Fp8Scaling::kBlock, 0}, out.data(), nullptr).ok());
  EXPECT_EQ(out[4], 0x7C00);  // beyond half's range: infinity, as PyTorch does
  std::vector<float> back(5);
  TensorView h{TensorSpec{"b", DType::kF16, {5}}, out.data(), Device::cpu()};
  ASSERT_TRUE(apply(h, Transform{Transform::Kind::kCast, DType::kF32, Fp8Scaling::kBlock, 0}, back.data(), nullptr).ok());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -2.5f);
}

#if PC_TEST_HAVE_MXCSR
constexpr unsigned kDazFtz = 0x8040u;  // MXCSR: DAZ (bit 6), FTZ (bit 15)
constexpr unsigned kModes = ~0x3Fu;    // MXCSR less its exception flags (bits 0-5), which float work sets

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// What apply writes for `src` under `t`, and its Status.
struct Applied {
  Status status;
  std::vector<uint8_t> out;
  std::vector<uint8_t> scales;
  unsigned mxcsr_after = 0;  // the thread's MXCSR modes right after apply returned
};
Applied apply_with_mxcsr(const TensorView& src, const Transform& t, unsigned mxcsr) {
  const auto specs = wire_specs(src.spec, t);
  Applied a;
  a.out.assign(specs[0].nbytes().value(), 0xAB);
  a.scales.assign(specs.size() > 1 ? specs[1].nbytes().value() : 0, 0xAB);
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(mxcsr);
  a.status = apply(src, t, a.out.data(), reinterpret_cast<float*>(a.scales.data()));
  a.mxcsr_after = _mm_getcsr() & kModes;
  _mm_setcsr(saved);
  return a;
}
#endif

// A process may run with denormals-are-zero and flush-to-zero on
// (torch.set_flush_denormal(True), a library built with -ffast-math): the
// host apply clears them for its loops, so a block whose amax is a
// subnormal float gets the scale and codes it gets without them (and that
// the GPU gets), and puts the caller's modes back.
TEST(TransformFp8Test, DenormalsAreZeroAndFlushToZeroChangeNoByte) {
#if !PC_TEST_HAVE_MXCSR
  GTEST_SKIP() << "denormals-are-zero / flush-to-zero here are x86 MXCSR modes; this is not x86";
#else
  // [130, 256] F32, four blocks:
  //   (0, 0): subnormal values, max |x| 1e-40 in row 5 (rows 0-4 at most
  //           3e-41: the block's max is taken across rows);
  //   (0, 1): max |x| 5e-43, below 448 x 2^-149 (scale 1);
  //   (1, 0): normal values;  (1, 1): normal values and subnormal ones.
  constexpr int64_t kRows = 130, kCols = 256;
  std::mt19937 rng(17);
  std::vector<float> x(kRows * kCols);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      const float frac = static_cast<float>(rng() % 1000) / 1000.0f;
      float v;
      if (r < 128 && c < 128) v = (r < 5 ? 3e-41f : 1e-40f) * frac;
      else if (r < 128) v = 5e-43f * frac;
      else if (c < 128) v = std::ldexp(1.0f + frac, static_cast<int>(rng() % 20) - 10);
      else v = (c % 2) ? 2e-39f * frac : std::ldexp(1.0f + frac, static_cast<int>(rng() % 20) - 10);
      x[static_cast<size_t>(r * kCols + c)] = (rng() & 1) ? v : -v;
    }
  x[5 * kCols + 7] = 1e-40f;
  x[6 * kCols + 9] = -1e-40f;
  x[3 * kCols + 200] = 5e-43f;
  const TensorView src{TensorSpec{"tiny", DType::kF32, {kRows, kCols}}, x.data(), Device::cpu()};
  const unsigned exact = _mm_getcsr() & kModes & ~kDazFtz;
  const unsigned flushing = exact | kDazFtz;
  for (Fp8Scaling s : {Fp8Scaling::kBlock, Fp8Scaling::kChannel, Fp8Scaling::kTensor}) {
    const Transform t{Transform::Kind::kFp8, DType::kF8E4M3, s, 0};
    const Applied want = apply_with_mxcsr(src, t, exact);
    const Applied got = apply_with_mxcsr(src, t, flushing);
    ASSERT_TRUE(want.status.ok()) << want.status.to_string();
    ASSERT_TRUE(got.status.ok()) << got.status.to_string();
    EXPECT_EQ(got.mxcsr_after, flushing) << describe(t) << ": the caller's MXCSR is not what it was";
    EXPECT_EQ(want.mxcsr_after, exact);
    EXPECT_EQ(want.scales, got.scales) << describe(t);
    EXPECT_EQ(want.out, got.out) << describe(t);
    if (s == Fp8Scaling::kBlock) {
      ASSERT_EQ(want.scales.size(), 2u * 2u * 4u);
      float s00, s01;
      std::memcpy(&s00, want.scales.data(), 4);
      std::memcpy(&s01, want.scales.data() + 4, 4);
      EXPECT_EQ(bits(s00), bits(1e-40f / 448.0f)) << "block (0, 0): a subnormal scale, not 0";
      EXPECT_NE(bits(s00), 0u);
      EXPECT_EQ(s01, 1.0f) << "block (0, 1): amax below 448 x 2^-149";
      EXPECT_EQ(want.out[5 * kCols + 7], 0x7E);   // 1e-40 / scale: 448
      EXPECT_EQ(want.out[6 * kCols + 9], 0xFE);   // -448
      EXPECT_EQ(want.out[3 * kCols + 200], 0x00);  // 5e-43 / 1: 0
    }
  }
  for (DType to : {DType::kBF16, DType::kF16}) {
    const Transform t{Transform::Kind::kCast, to, Fp8Scaling::kBlock, 0};
    const Applied want = apply_with_mxcsr(src, t, exact);
    const Applied got = apply_with_mxcsr(src, t, flushing);
    ASSERT_TRUE(got.status.ok());
    EXPECT_EQ(got.mxcsr_after, flushing);
    EXPECT_EQ(want.out, got.out) << describe(t);
  }
  // A refusal (a non-finite element) puts the modes back too.
  auto with_nan = x;
  with_nan[100] = std::nanf("");
  const TensorView bad{TensorSpec{"tiny", DType::kF32, {kRows, kCols}}, with_nan.data(), Device::cpu()};
  const Applied refused = apply_with_mxcsr(bad, Transform{Transform::Kind::kFp8, DType::kF8E4M3, Fp8Scaling::kBlock, 0},
                                           flushing);
  EXPECT_FALSE(refused.status.ok());
  EXPECT_EQ(refused.mxcsr_after, flushing);
#endif
}

}  // namespace
}  // namespace paramcast::transform
