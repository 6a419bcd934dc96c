#include "common/xxhash.h"

#include <cstdio>
#include <cstring>

namespace paramcast {
namespace {
constexpr uint64_t P1 = 11400714785074694791ULL;
constexpr uint64_t P2 = 14029467366897019727ULL;
constexpr uint64_t P3 = 1609587929392839161ULL;
constexpr uint64_t P4 = 9650029242287828579ULL;
constexpr uint64_t P5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t read32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}
inline uint64_t merge(uint64_t acc, uint64_t val) {
  val = round(0, val);
  acc ^= val;
  return acc * P1 + P4;
}
}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed) {
  v_[0] = seed + P1 + P2;
  v_[1] = seed + P2;
  v_[2] = seed;
  v_[3] = seed - P1;
}

void Xxh64::update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + len;
  total_ += len;
  if (buf_len_ + len < 32) {
    if (len) std::memcpy(buf_ + buf_len_, p, len);
    buf_len_ += len;
    return;
  }
  if (buf_len_) {
    const size_t fill = 32 - buf_len_;
    std::memcpy(buf_ + buf_len_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(buf_ + 8 * i));
    p += fill;
    buf_len_ = 0;
  }
  uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
  while (p + 32 <= end) {
    v0 = round(v0, read64(p));
    v1 = round(v1, read64(p + 8));
    v2 = round(v2, read64(p + 16));
    v3 = round(v3, read64(p + 24));
    p += 32;
  }
  v_[0] = v0; v_[1] = v1; v_[2] = v2; v_[3] = v3;
  if (p < end) {
    buf_len_ = static_cast<size_t>(end - p);
    std::memcpy(buf_, p, buf_len_);
  }
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = merge(h, v_[i]);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const uint8_t* p = buf_;
  const uint8_t* end = buf_ + buf_len_;
  while (p + 8 <= end) {
    h ^= round(0, read64(p));
    h = rotl(h, 27) * P1 + P4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  while (p < end) {
    h ^= (*p) * P5;
    h = rotl(h, 11) * P1;
    ++p;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, len);
  return h.digest();
}

std::string digest_hex(uint64_t digest) {
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(digest));
  return text;
}

}  // namespace paramcast
