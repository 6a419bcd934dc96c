#include "common/delta/delta_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "common/xxhash.h"

namespace paramcast::delta {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kDense: return "dense";
    case Kind::kIndices: return "indices";
    case Kind::kBitmask: return "bitmask";
    case Kind::kUnchanged: return "unchanged";
  }
  return "?";
}

uint64_t bitmask_bytes(uint64_t units, uint64_t changed, uint32_t unit) { return changed * unit + (units + 7) / 8; }

namespace {

unsigned varint_size(uint64_t v) {
  unsigned n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Visits every set bit of `mask` in increasing order.
template <typename F>
void for_each_set(const std::vector<uint8_t>& mask, F&& f) {
  for (uint64_t byte = 0; byte < mask.size(); ++byte)
    for (unsigned bits = mask[byte]; bits; bits &= bits - 1) f(byte * 8 + static_cast<unsigned>(std::countr_zero(bits)));
}

// The state of one bucket's comparison, across its segments.
struct Scan {
  uint8_t* mask;
  uint8_t* values;      // the changed units' values, appended
  uint64_t changed = 0;
  uint64_t limit;       // more changes than this: a delta is not worth it
  uint64_t next = 0;    // the unit after the last change (for the gaps' varint sizes)
  uint64_t gap_bytes = 0;
};

// Compares one segment with its baseline, eight bytes at a time (after one
// small step most words are unchanged) and a differing word unit by unit;
// marks each changed unit in the mask, appends its value, moves its
// baseline to it (unchanged units are equal already). `values` may be the
// segment's own storage: a value is written at or before where it was read.
// Returns the offset it got to: the segment's length, or less once more
// than `limit` changes were found (it stops there).
template <uint32_t kUnit>
uint64_t compare(const Segment& s, Scan& c) {
  const uint8_t* now = s.now;
  uint8_t* base = s.base;
  const uint64_t first = s.bucket_offset / kUnit;
  constexpr uint64_t kUnitMask = kUnit == 8 ? ~0ull : (1ull << (8 * kUnit)) - 1;
  auto take = [&](uint64_t u) {
    std::memcpy(base + u, now + u, kUnit);
    const uint64_t i = first + u / kUnit;
    c.mask[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
    std::memmove(c.values + c.changed * kUnit, now + u, kUnit);
    c.gap_bytes += varint_size(i - c.next);
    c.next = i + 1;
    ++c.changed;
  };
  const uint64_t words = s.length / 8;
  for (uint64_t w = 0; w < words; ++w) {
    uint64_t a, b;
    std::memcpy(&a, now + 8 * w, 8);
    std::memcpy(&b, base + 8 * w, 8);
    uint64_t diff = a ^ b;
    if (!diff) continue;
    for (uint32_t j = 0; j < 8; j += kUnit) {
      if (diff & kUnitMask) {
        if (c.changed == c.limit) return 8 * w + j;
        take(8 * w + j);
      }
      if constexpr (kUnit < 8) diff >>= 8 * kUnit;
    }
  }
  for (uint64_t u = words * 8; u < s.length; u += kUnit) {  // the tail, shorter than a word
    if (std::memcmp(now + u, base + u, kUnit) == 0) continue;
    if (c.changed == c.limit) return u;
    take(u);
  }
  return s.length;
}

uint64_t compare(const Segment& s, uint32_t unit, Scan& c) {
  switch (unit) {
    case 1: return compare<1>(s, c);
    case 2: return compare<2>(s, c);
    case 4: return compare<4>(s, c);
    default: return compare<8>(s, c);
  }
}

void pack_dense(const std::vector<Segment>& segments, uint8_t* out) {
  for (const auto& s : segments)
    if (s.length) std::memcpy(out + s.bucket_offset, s.base, s.length);  // the baseline holds the new bytes now
}

}  // namespace

Header encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit, bool always, uint8_t* out,
              std::vector<uint8_t>& mask) {
  Header h;
  h.unit = unit;
  const uint64_t units = bucket_bytes / unit;
  h.piece_hashes.reserve(segments.size());
  for (const auto& s : segments) h.piece_hashes.push_back(xxh64(s.now, s.length));
  // A delta is worth sending up to `budget` bytes; its values alone bound
  // the changes worth counting.
  const uint64_t budget = always ? (bucket_bytes ? bucket_bytes - 1 : 0) : bucket_bytes / 2;
  const uint64_t limit = units <= kMaxDeltaUnits ? budget / unit : 0;
  mask.assign((units + 7) / 8, 0);
  bool fits = units <= kMaxDeltaUnits && bucket_bytes % unit == 0;
  for (const auto& s : segments) fits = fits && s.bucket_offset % unit == 0 && s.length % unit == 0;
  Scan scan{mask.data(), out, 0, limit};
  for (const auto& s : segments) {
    // The baseline moves to the new version: the changed units as they are
    // found, the rest of the segment once a delta is no longer worth it.
    const uint64_t done = fits ? compare(s, unit, scan) : 0;
    if (done < s.length) {
      fits = false;
      std::memmove(s.base + done, s.now + done, s.length - done);
    }
  }
  const uint64_t changed = scan.changed;
  const uint64_t by_index = changed * unit + scan.gap_bytes;
  const uint64_t by_mask = bitmask_bytes(units, changed, unit);
  if (fits && changed == 0) {
    h.kind = Kind::kUnchanged;
    return h;
  }
  if (!fits || std::min(by_index, by_mask) > budget) {
    h.kind = Kind::kDense;
    h.wire_bytes = bucket_bytes;
    pack_dense(segments, out);
    return h;
  }
  h.changed = changed;
  uint8_t* tail = out + changed * unit;
  if (by_index <= by_mask) {
    h.kind = Kind::kIndices;
    h.wire_bytes = by_index;
    uint64_t next = 0;
    for_each_set(mask, [&](uint64_t i) {
      for (uint64_t gap = i - next; ; gap >>= 7) {
        *tail++ = static_cast<uint8_t>((gap & 0x7f) | (gap >= 0x80 ? 0x80 : 0));
        if (gap < 0x80) break;
      }
      next = i + 1;
    });
  } else {
    h.kind = Kind::kBitmask;
    h.wire_bytes = by_mask;
    std::memcpy(tail, mask.data(), mask.size());
  }
  return h;
}

Status check_header(const Header& h, uint64_t bucket_bytes, size_t pieces, const std::string& what) {
  auto bad = [&](const std::string& why) { return data_corrupt("delta header of " + what + ": " + why); };
  if (h.unit != 1 && h.unit != 2 && h.unit != 4 && h.unit != 8) return bad("unit " + std::to_string(h.unit));
  if (bucket_bytes % h.unit) return bad("bucket of " + std::to_string(bucket_bytes) + " bytes is not whole units");
  if (h.piece_hashes.size() != pieces)
    return bad(std::to_string(h.piece_hashes.size()) + " piece hashes for " + std::to_string(pieces) + " pieces");
  const uint64_t units = bucket_bytes / h.unit;
  uint64_t want = 0;
  switch (h.kind) {
    case Kind::kDense: want = bucket_bytes; break;
    case Kind::kUnchanged:
      if (h.changed) return bad("an unchanged bucket with changes");
      want = 0;
      break;
    case Kind::kIndices:
    case Kind::kBitmask:
      if (units > kMaxDeltaUnits) return bad("a delta of a bucket of " + std::to_string(units) + " units");
      if (h.changed == 0 || h.changed > units)
        return bad(std::to_string(h.changed) + " changes in a bucket of " + std::to_string(units) + " units");
      if (h.kind == Kind::kIndices) {  // each gap takes 1 to 5 bytes; apply() checks the exact count
        if (h.wire_bytes < h.changed * (h.unit + 1ull) || h.wire_bytes > h.changed * (h.unit + 5ull))
          return bad("indices of " + std::to_string(h.wire_bytes) + " wire bytes cannot carry " +
                     std::to_string(h.changed) + " changes");
        return Status();
      }
      want = bitmask_bytes(units, h.changed, h.unit);
      break;
    default: return bad("unknown encoding " + std::to_string(static_cast<unsigned>(h.kind)));
  }
  if (h.wire_bytes != want)
    return bad(std::string(kind_name(h.kind)) + " of " + std::to_string(h.wire_bytes) + " wire bytes, expected " +
               std::to_string(want));
  return Status();
}

Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
             const std::string& what, std::vector<uint8_t>& indices) {
  PC_RETURN_IF_ERROR(check_header(h, bucket_bytes, segments.size(), what));
  if (h.kind != Kind::kIndices && h.kind != Kind::kBitmask) return Status();
  for (const auto& seg : segments)
    if (seg.bucket_offset % h.unit || seg.length % h.unit)
      return data_corrupt("delta of " + what + ": a piece at byte " + std::to_string(seg.bucket_offset) + " of " +
                          std::to_string(seg.length) + " bytes is not whole units of " + std::to_string(h.unit));
  const uint64_t units = bucket_bytes / h.unit;
  const uint8_t* values = wire;
  // The index stream (gaps or bitmask) is copied once into `indices`, and
  // both passes read the copy; the values are read once, in pass 2. So no
  // byte of the wire is read twice: a second read could see other bytes.
  // The copy is at most the encoding's own size (wire_bytes).
  indices.assign(wire + h.changed * h.unit, wire + h.wire_bytes);
  const uint8_t* tail = indices.data();
  // Pass 1 validates every index (in range, increasing, inside a piece);
  // pass 2 writes: nothing is written unless all of them are valid.
  auto visit = [&](auto&& each) -> Status {
    if (h.kind == Kind::kIndices) {
      const uint8_t* at = tail;
      const uint8_t* end = indices.data() + indices.size();
      uint64_t next = 0;
      for (uint64_t k = 0; k < h.changed; ++k) {
        uint64_t gap = 0;
        for (unsigned shift = 0;; shift += 7) {
          if (at == end || shift > 28)
            return data_corrupt("delta of " + what + ": gap #" + std::to_string(k) + " is cut short or too long");
          const uint8_t b = *at++;
          gap |= static_cast<uint64_t>(b & 0x7f) << shift;
          if (!(b & 0x80)) break;
        }
        const uint64_t i = next + gap;
        if (i >= units)
          return data_corrupt("delta of " + what + ": change #" + std::to_string(k) + " at unit " + std::to_string(i) +
                              " lies past the bucket's " + std::to_string(units) + " units");
        next = i + 1;
        PC_RETURN_IF_ERROR(each(k, i));
      }
      if (at != end)
        return data_corrupt("delta of " + what + ": " + std::to_string(end - at) + " bytes left after its " +
                            std::to_string(h.changed) + " changes");
      return Status();
    }
    uint64_t k = 0;
    const uint64_t bytes = (units + 7) / 8;
    for (uint64_t byte = 0; byte < bytes; ++byte) {
      for (unsigned bits = tail[byte]; bits; bits &= bits - 1) {
        const uint64_t i = byte * 8 + static_cast<unsigned>(std::countr_zero(bits));
        if (i >= units || k >= h.changed)
          return data_corrupt("delta of " + what + ": the bitmask marks more than its " + std::to_string(h.changed) +
                              " changes or a unit past the bucket");
        PC_RETURN_IF_ERROR(each(k++, i));
      }
    }
    if (k != h.changed)
      return data_corrupt("delta of " + what + ": the bitmask marks " + std::to_string(k) + " units, its header " +
                          std::to_string(h.changed));
    return Status();
  };
  // Indices increase, so the piece holding each one is found by walking.
  size_t seg = 0;
  auto locate = [&](uint64_t i) -> uint8_t* {
    const uint64_t at = i * h.unit;
    while (seg < segments.size() && segments[seg].bucket_offset + segments[seg].length <= at) ++seg;
    if (seg == segments.size() || at < segments[seg].bucket_offset ||
        at + h.unit > segments[seg].bucket_offset + segments[seg].length)
      return nullptr;
    return segments[seg].base + (at - segments[seg].bucket_offset);
  };
  PC_RETURN_IF_ERROR(visit([&](uint64_t, uint64_t i) -> Status {
    if (!locate(i))
      return data_corrupt("delta of " + what + ": unit " + std::to_string(i) + " lies between the bucket's tensors");
    return Status();
  }));
  seg = 0;
  return visit([&](uint64_t k, uint64_t i) -> Status {
    std::memcpy(locate(i), values + k * h.unit, h.unit);
    return Status();
  });
}

Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
             const std::string& what) {
  std::vector<uint8_t> indices;
  return apply(h, wire, bucket_bytes, segments, what, indices);
}

}  // namespace paramcast::delta
