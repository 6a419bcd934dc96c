// The bucket checksums: xxh64-blocks on the host against a reference written
// here from the definition (a plain one-shot XXH64, independent of
// common/xxhash), and DeviceMemory's checksums against host_checksum.
#include "common/data/bucket_checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/data/device_memory.h"
#include "common/xxhash.h"

namespace paramcast {
namespace {

// XXH64 as the specification states it, one shot, little-endian reads.
uint64_t ref_xxh64(const uint8_t* p, size_t len, uint64_t seed) {
  const uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                 P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;
  auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  auto le64 = [](const uint8_t* q) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | q[i];
    return v;
  };
  auto rnd = [&](uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; };
  size_t i = 0;
  uint64_t h;
  if (len >= 32) {
    uint64_t v[4] = {seed + P1 + P2, seed + P2, seed, seed - P1};
    for (; i + 32 <= len; i += 32)
      for (int l = 0; l < 4; ++l) v[l] = rnd(v[l], le64(p + i + 8 * l));
    h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
    for (int l = 0; l < 4; ++l) h = (h ^ rnd(0, v[l])) * P1 + P4;
  } else {
    h = seed + P5;
  }
  h += len;
  for (; i + 8 <= len; i += 8) h = rotl(h ^ rnd(0, le64(p + i)), 27) * P1 + P4;
  if (i + 4 <= len) {
    const uint64_t w = uint64_t(p[i]) | uint64_t(p[i + 1]) << 8 | uint64_t(p[i + 2]) << 16 | uint64_t(p[i + 3]) << 24;
    h = rotl(h ^ (w * P1), 23) * P2 + P3;
    i += 4;
  }
  for (; i < len; ++i) h = rotl(h ^ (p[i] * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  return h ^ (h >> 32);
}

// xxh64-blocks from its definition (bucket_checksum.h).
uint64_t ref_blocks(const uint8_t* p, size_t n) {
  std::vector<uint8_t> digests;
  for (size_t off = 0; off < n; off += 4096) {
    const uint64_t d = ref_xxh64(p + off, std::min<size_t>(4096, n - off), 0);
    for (int b = 0; b < 8; ++b) digests.push_back(static_cast<uint8_t>(d >> (8 * b)));
  }
  return ref_xxh64(digests.data(), digests.size(), n);
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n + 16);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(BucketChecksumTest, ReferenceMatchesPublishedXxh64Vectors) {
  EXPECT_EQ(ref_xxh64(nullptr, 0, 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(ref_xxh64(reinterpret_cast<const uint8_t*>("abc"), 3, 0), 0x44BC2CF5AD770999ull);
  const auto v = random_bytes(1000, 7);
  for (size_t n : {0, 1, 4, 7, 8, 31, 32, 33, 100, 999}) EXPECT_EQ(ref_xxh64(v.data(), n, 5), xxh64(v.data(), n, 5)) << n;
}

TEST(BucketChecksumTest, BlocksOnHostEqualTheDefinition) {
  const auto v = random_bytes((1 << 20) + 4096, 11);
  const size_t sizes[] = {0, 1, 31, 32, 33, 4095, 4096, 4097, 3 * 4096 + 17, 65536, (1 << 20) + 3};
  for (size_t n : sizes) {
    for (size_t misalign : {0, 1, 3}) {
      const uint8_t* p = v.data() + misalign;
      EXPECT_EQ(host_checksum(Checksum::kXxh64Blocks, p, n), ref_blocks(p, n)) << n << " bytes at +" << misalign;
    }
    EXPECT_EQ(host_checksum(Checksum::kXxh64, v.data(), n), ref_xxh64(v.data(), n, 0)) << n;
  }
  EXPECT_EQ(host_checksum(Checksum::kNone, v.data(), 100), 0u);
}

TEST(BucketChecksumTest, BlocksDetectFlipsSwapsAndLength) {
  auto v = random_bytes(5 * 4096, 3);
  const size_t n = 5 * 4096;
  const uint64_t base = host_checksum(Checksum::kXxh64Blocks, v.data(), n);
  EXPECT_NE(base, host_checksum(Checksum::kXxh64, v.data(), n));
  v[2 * 4096 + 9] ^= 0x10;  // one bit in the third block
  EXPECT_NE(host_checksum(Checksum::kXxh64Blocks, v.data(), n), base);
  v[2 * 4096 + 9] ^= 0x10;
  std::vector<uint8_t> swapped(v.begin(), v.begin() + n);  // blocks 0 and 1 exchanged
  std::memcpy(swapped.data(), v.data() + 4096, 4096);
  std::memcpy(swapped.data() + 4096, v.data(), 4096);
  EXPECT_NE(host_checksum(Checksum::kXxh64Blocks, swapped.data(), n), base);
  std::vector<uint8_t> zeros(8192, 0);  // same digests of zero blocks, different length
  EXPECT_NE(host_checksum(Checksum::kXxh64Blocks, zeros.data(), 4096),
            host_checksum(Checksum::kXxh64Blocks, zeros.data(), 8192));
}

TEST(BucketChecksumTest, HostMemoryChecksumsEqualHostChecksum) {
  auto mem = create_device_memory(Device::cpu());
  ASSERT_TRUE(mem.ok());
  const auto v = random_bytes(70000, 5);
  for (Checksum kind : {Checksum::kXxh64, Checksum::kXxh64Blocks}) {
    auto sum = (*mem)->checksum(v.data(), 70000, kind);
    ASSERT_TRUE(sum.ok());
    EXPECT_EQ(*sum, kind == Checksum::kXxh64Blocks ? ref_blocks(v.data(), 70000) : ref_xxh64(v.data(), 70000, 0));
    ASSERT_TRUE((*mem)->checksum_start(1, v.data(), 70000, kind).ok());
    ASSERT_TRUE((*mem)->checksum_start(0, v.data(), 100, kind).ok());  // the other slot stays apart
    EXPECT_EQ((*mem)->checksum_result(1).value(), *sum);
    EXPECT_EQ((*mem)->checksum_result(0).value(), host_checksum(kind, v.data(), 100));
  }
  EXPECT_STREQ(checksum_name(Checksum::kXxh64Blocks), "xxh64-blocks");
}

}  // namespace
}  // namespace paramcast
