// xxHash64: the checksum of update buckets and of plan manifests.
// A self-contained implementation of the published XXH64 algorithm,
// streaming so that a bucket can be hashed piece by piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace paramcast {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  uint64_t v_[4];
  uint64_t total_ = 0;
  uint8_t buf_[32];
  size_t buf_len_ = 0;
  uint64_t seed_;
};

uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);
// A digest as messages show it: 16 hex digits.
std::string digest_hex(uint64_t digest);

}  // namespace paramcast
