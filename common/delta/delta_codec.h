// Delta codec: one bucket of an update as the elements that changed since
// the baseline (the last version every member applied), bit for bit.
//
// The bucket's pieces are compared with the baseline in units of the
// bucket's smallest element size (bit patterns, not values: -0.0 vs 0.0 and
// NaN payloads are changes). The encoder picks the smallest of
//   kUnchanged  nothing changed: nothing is sent;
//   kIndices    the changed units' values, then their positions as gaps:
//               for each change, the units skipped since the previous one
//               (from the bucket's start for the first), LEB128 varints
//               (a gap below 128 is one byte);
//   kBitmask    the changed units' values, then one bit per unit of the
//               bucket (LSB first) marking the changed ones;
//   kDense      the bucket's bytes as a dense bucket carries them;
// a delta only when it is at most half the dense bytes (`always`: whenever
// it is smaller than dense). Alignment gaps between pieces are neither
// compared nor sent. Encoding also moves the baseline to the new bytes and
// hashes each piece's new bytes (xxh64), which every receiver checks after
// applying: a delta is verified end to end, whatever the transport did.
//
// Decoding treats the wire bytes as hostile: counts, sizes, indices (in
// range, increasing) and bitmask popcounts are checked before any byte is
// written, and a violation is a DATA_CORRUPT error naming the bucket.
//
// Thread-safety: free functions over the caller's buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"

namespace paramcast::delta {

enum class Kind : uint8_t { kDense = 0, kIndices = 1, kBitmask = 2, kUnchanged = 3 };
const char* kind_name(Kind kind);
// Whether a bucket so encoded went as a delta (against the baseline):
// encoded, or unchanged (an update in which nothing changed is a delta that
// moves nothing). What UpdateResult::delta counts, for every sender.
inline bool sent_against_baseline(Kind kind) { return kind != Kind::kDense; }

// One piece of a bucket: its new bytes and where the baseline of the same
// bytes lives (for the encoder), or where the piece lands (for the decoder).
struct Segment {
  const uint8_t* now = nullptr;  // encoder: the new bytes
  uint8_t* base = nullptr;       // encoder: the baseline, overwritten with `now`; decoder: the destination
  uint64_t bucket_offset = 0;
  uint64_t length = 0;
};

// What a receiver needs, beside the wire bytes, to apply one bucket.
struct Header {
  Kind kind = Kind::kDense;
  uint32_t unit = 1;                  // bytes per compared element (1, 2, 4 or 8)
  uint64_t changed = 0;               // units carried (delta kinds)
  uint64_t wire_bytes = 0;            // bytes broadcast for this bucket (0 when unchanged)
  std::vector<uint64_t> piece_hashes;  // hash of each piece's new bytes, in piece order
  // Which hash piece_hashes holds: xxh64 (host memory) or xxh64-blocks
  // (CUDA memory, computed on the device; data/bucket_checksum.h).
  Checksum piece_hash = Checksum::kXxh64;
};

// The largest bucket a delta describes (a gap is at most 5 varint bytes).
inline constexpr uint64_t kMaxDeltaUnits = 0xffffffffull;

// Bytes the bitmask encoding of `units` units with `changed` changes takes.
uint64_t bitmask_bytes(uint64_t units, uint64_t changed, uint32_t unit);

// Encodes the bucket whose pieces are `segments` (sorted by bucket_offset)
// into `out` (capacity: `bucket_bytes`): the dense bucket, or a delta. Moves
// each segment's baseline to its new bytes. `mask` is scratch, reused.
Header encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit, bool always, uint8_t* out,
              std::vector<uint8_t>& mask);

// Applies a delta `h` (kIndices or kBitmask) received in `wire` to the
// segments' destinations (`base`), which hold the baseline. `what` names
// the bucket in errors. Nothing is written unless the encoding is valid,
// and each byte of `wire` is read once (the index stream is copied into
// `indices`, scratch, reused: at most the encoding's size).
Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
             const std::string& what, std::vector<uint8_t>& indices);
Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
             const std::string& what);

// Checks that `h` is self-consistent for a bucket of `bucket_bytes` with
// `pieces` pieces before its wire bytes are received.
Status check_header(const Header& h, uint64_t bucket_bytes, size_t pieces, const std::string& what);

}  // namespace paramcast::delta
