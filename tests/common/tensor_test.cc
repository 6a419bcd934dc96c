#include "common/tensor.h"

#include <gtest/gtest.h>

#include <cstring>

#include "common/synthetic_model.h"
#include "common/xxhash.h"

namespace paramcast {
namespace {

TEST(TensorTest, DTypesRoundTripSafetensorsNames) {
  const std::vector<std::pair<std::string, size_t>> expected = {
      {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I8", 1},
      {"U8", 1},  {"I16", 2}, {"I32", 4},  {"I64", 8},     {"BOOL", 1},    {"F64", 8}};
  ASSERT_EQ(all_dtypes().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    DType d = all_dtypes()[i];
    EXPECT_EQ(dtype_name(d), expected[i].first);
    EXPECT_EQ(dtype_size(d), expected[i].second);
    EXPECT_EQ(parse_dtype(expected[i].first), d);
  }
  EXPECT_FALSE(parse_dtype("bf16"));
}

TEST(TensorTest, SizesAreOverflowChecked) {
  TensorSpec t{"w", DType::kBF16, {4096, 11008}};
  EXPECT_EQ(t.numel().value(), 4096ull * 11008);
  EXPECT_EQ(t.nbytes().value(), 4096ull * 11008 * 2);
  TensorSpec scalar{"s", DType::kF32, {}};
  EXPECT_EQ(scalar.nbytes().value(), 4u);
  TensorSpec empty{"e", DType::kF32, {0, 7}};
  EXPECT_EQ(empty.nbytes().value(), 0u);
  TensorSpec huge{"huge", DType::kF64, {1ll << 40, 1ll << 30}};
  ASSERT_FALSE(huge.numel().ok());
  EXPECT_NE(huge.numel().status().message().find("'huge'"), std::string::npos);
  TensorSpec bytes_overflow{"b", DType::kF64, {1ll << 62}};
  EXPECT_TRUE(bytes_overflow.numel().ok());
  EXPECT_FALSE(bytes_overflow.nbytes().ok());
  TensorSpec negative{"n", DType::kF32, {3, -1}};
  ASSERT_FALSE(negative.nbytes().ok());
  EXPECT_NE(negative.nbytes().status().message().find("dimension 1 is negative"), std::string::npos);
}

TEST(TensorTest, Devices) {
  EXPECT_EQ(parse_device("cpu").value(), Device::cpu());
  EXPECT_EQ(parse_device("cuda:3").value(), Device::cuda(3));
  EXPECT_EQ(parse_device("cuda").value(), Device::cuda(0));
  EXPECT_FALSE(parse_device("cuda:").ok());
  EXPECT_FALSE(parse_device("cuda:x").ok());
  EXPECT_EQ(Device::cuda(2).to_string(), "cuda:2");
}

TEST(XxhashTest, KnownVectors) {
  // Reference values of XXH64 with seed 0.
  EXPECT_EQ(xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(xxh64("a", 1), 0xD24EC4F1A98C6E5BULL);
  EXPECT_EQ(xxh64("abc", 3), 0x44BC2CF5AD770999ULL);
  const std::string s = "Nobody inspects the spammish repetition";
  EXPECT_EQ(xxh64(s.data(), s.size()), 0xFBCEA83C8A378BF1ULL);
}

TEST(XxhashTest, StreamingEqualsOneShot) {
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 31 + 7);
  for (size_t split : {0, 1, 31, 32, 33, 500, 999}) {
    Xxh64 h;
    h.update(data.data(), split);
    h.update(data.data() + split, data.size() - split);
    EXPECT_EQ(h.digest(), xxh64(data.data(), data.size())) << split;
  }
}

TEST(SyntheticModelTest, LlamaLayoutWith291Tensors) {
  auto specs = synthetic_llm_layout(64ull << 20, 32, DType::kBF16);
  ASSERT_EQ(specs.size(), 291u);
  EXPECT_EQ(specs.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(specs[1].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  uint64_t total = 0;
  for (auto& s : specs) total += s.nbytes().value();
  EXPECT_LE(total, 64ull << 20);
  EXPECT_GT(total, 50ull << 20);
}

// A trainer rank fills only the rows it holds: any byte range of a tensor,
// computed alone, equals that range of the whole tensor, in both change modes.
TEST(SyntheticModelTest, AnyByteRangeEqualsThatRangeOfTheWholeTensor) {
  TensorSpec t{"model.layers.3.mlp.up_proj.weight", DType::kBF16, {301, 37}};
  const uint64_t n = t.nbytes().value();
  for (ModelChanges c : {ModelChanges::kEvery, ModelChanges::kUneven}) {
    std::vector<uint8_t> whole(n);
    fill_synthetic(t, 7, 12, whole.data(), n, c);
    for (uint64_t off : {uint64_t{0}, uint64_t{3}, uint64_t{74}, uint64_t{8}, n - 5}) {
      for (uint64_t len : {uint64_t{1}, uint64_t{5}, uint64_t{74 * 3}, n - off}) {
        if (off + len > n) continue;
        std::vector<uint8_t> part(len, 0xee);
        fill_synthetic_range(t, 7, 12, part.data(), off, len, c);
        ASSERT_EQ(0, std::memcmp(part.data(), whole.data() + off, len)) << "offset " << off << " length " << len;
      }
    }
  }
}

TEST(SyntheticModelTest, ContentIsReproducibleAndChangesPerVersion) {
  TensorSpec t{"x", DType::kU8, {1001}};
  std::vector<uint8_t> a(1001), b(1001);
  fill_synthetic(t, 1, 5, a.data(), a.size());
  fill_synthetic(t, 1, 5, b.data(), b.size());
  EXPECT_EQ(a, b);
  EXPECT_EQ(verify_synthetic(t, 1, 5, a.data(), a.size()), -1);
  EXPECT_EQ(verify_synthetic(t, 1, 6, a.data(), a.size()), 0);
  a[1000] ^= 1;
  EXPECT_EQ(verify_synthetic(t, 1, 5, a.data(), a.size()), 1000);
}

// trainer.changes: uneven: across versions, each tensor is unchanged, a few
// elements, wholesale, or alternate 256 KiB blocks; the content at v is
// found again without v-1's, and every 8th version is new wholesale.
TEST(SyntheticModelTest, UnevenChangesMixEveryKindAndAreReproducible) {
  const uint64_t n = 1 << 20;  // 4 blocks of 256 KiB
  std::vector<uint8_t> prev(n), cur(n);
  int none = 0, sparse = 0, whole = 0, alternate = 0;
  for (int t = 0; t < 12; ++t) {
    TensorSpec spec{"layer." + std::to_string(t), DType::kBF16, {static_cast<int64_t>(n / 2)}};
    fill_synthetic(spec, 3, 1, prev.data(), n, ModelChanges::kUneven);
    for (uint64_t v = 2; v <= 9; ++v) {
      fill_synthetic(spec, 3, v, cur.data(), n, ModelChanges::kUneven);
      ASSERT_EQ(verify_synthetic(spec, 3, v, cur.data(), n, ModelChanges::kUneven), -1);
      uint64_t changed = 0, changed_in_block[4] = {0, 0, 0, 0};
      for (uint64_t w = 0; w < n / 8; ++w)
        if (std::memcmp(&prev[w * 8], &cur[w * 8], 8) != 0) {
          ++changed;
          ++changed_in_block[w * 8 / (256 << 10)];
        }
      const uint64_t words = n / 8, block = words / 4;
      if (v == 9) {
        EXPECT_GT(changed, words * 99 / 100) << "every 8th version is new wholesale";
      }
      if (changed == 0) ++none;
      else if (changed < words / 20) ++sparse;
      else if (changed > words * 99 / 100) ++whole;
      else if (changed_in_block[0] > block * 99 / 100 && changed_in_block[1] == 0 &&
               changed_in_block[2] > block * 99 / 100 && changed_in_block[3] == 0)
        ++alternate;
      else
        ADD_FAILURE() << spec.name << " v" << v << ": " << changed << " of " << words << " words changed";
      prev.swap(cur);
    }
  }
  EXPECT_GT(none, 5);
  EXPECT_GT(sparse, 5);
  EXPECT_GT(whole, 5);
  EXPECT_GT(alternate, 5);
  // The default is every byte new at every version, as before.
  TensorSpec spec{"x", DType::kU8, {1001}};
  std::vector<uint8_t> a(1001);
  fill_synthetic(spec, 1, 5, a.data(), a.size(), ModelChanges::kEvery);
  EXPECT_EQ(verify_synthetic(spec, 1, 5, a.data(), a.size()), -1);
}

}  // namespace
}  // namespace paramcast
