#include "common/data/bucket_checksum.h"

#include <cstring>
#include <vector>

#include "common/xxhash.h"

namespace paramcast {

uint64_t combine_block_digests(const uint64_t* digests, size_t blocks, size_t bytes) {
  Xxh64 h(bytes);
  for (size_t i = 0; i < blocks; ++i) {
    uint8_t le[8];
    for (int b = 0; b < 8; ++b) le[b] = static_cast<uint8_t>(digests[i] >> (8 * b));
    h.update(le, sizeof le);
  }
  return h.digest();
}

uint64_t host_checksum(Checksum kind, const void* data, size_t bytes) {
  switch (kind) {
    case Checksum::kNone:
      return 0;
    case Checksum::kXxh64:
      return xxh64(data, bytes);
    case Checksum::kXxh64Blocks: {
      const auto* p = static_cast<const uint8_t*>(data);
      std::vector<uint64_t> d(checksum_blocks(bytes));
      for (size_t i = 0; i < d.size(); ++i) {
        const size_t off = i * kChecksumBlockBytes;
        d[i] = xxh64(p + off, std::min(kChecksumBlockBytes, bytes - off));
      }
      return combine_block_digests(d.data(), d.size(), bytes);
    }
  }
  return 0;
}

const char* checksum_name(Checksum kind) {
  switch (kind) {
    case Checksum::kNone: return "none";
    case Checksum::kXxh64: return "xxh64";
    case Checksum::kXxh64Blocks: return "xxh64-blocks";
  }
  return "?";
}

}  // namespace paramcast
