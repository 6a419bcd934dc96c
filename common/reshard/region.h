// Region: a box of a tensor, per dimension [offset, offset + length), the
// unit of the many-sender plan's geometry (as the chunks of
// torch.distributed.checkpoint are): what a trainer rank holds (a whole
// tensor, a Shard(d) of it) and what an engine rank wants (the whole
// tensor, its tensor-parallel slice) are regions, and what moves from one
// to the other is their intersection.
// Pure: no I/O; every function is total on regions of the same rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace paramcast::reshard {

struct Region {
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;

  static Region whole(const std::vector<int64_t>& shape);
  // [start, start + length) along `dim`, whole in every other dimension.
  static Region slice(const std::vector<int64_t>& shape, int dim, int64_t start, int64_t length);

  size_t rank() const { return lengths.size(); }
  // Elements in the box (regions inside a validated shape cannot overflow).
  uint64_t elements() const;
  bool empty() const { return elements() == 0; }
  // Inside a tensor of `shape`: same rank, every range within its dimension.
  bool inside(const std::vector<int64_t>& shape) const;
  // The rows [a, b) of a row-major tensor: contiguous in memory.
  bool contiguous_in(const std::vector<int64_t>& shape) const;
  std::string to_string() const;  // "[0:64, 0:4096]" (a malformed region says so)
  bool operator==(const Region&) const = default;
  bool operator<(const Region& o) const {
    return offsets != o.offsets ? offsets < o.offsets : lengths < o.lengths;
  }
};

// The common part of two regions of the same rank, or nullopt if empty.
std::optional<Region> intersect(const Region& a, const Region& b);
// `inner` is not empty and lies in `box` (same rank): intersect(box, inner)
// == inner, allocating nothing (the per-move buffer lookup).
bool contains(const Region& box, const Region& inner);
// `a` less `b`: disjoint boxes covering exactly the elements of a not in b
// (at most two per dimension).
std::vector<Region> subtract(const Region& a, const Region& b);

// Buffers: a rank keeps a box of a tensor row-major, `element` bytes each.
// The byte offset of `region` (inside `box`) in such a buffer when its
// elements lie there back to back (every dimension after its first longer
// than one is whole in the box: a row range), else nullopt.
std::optional<uint64_t> contiguous_at(const Region& box, const Region& region, size_t element);
// Calls run(from_byte, to_byte, bytes) for each run of `region` (its last
// dimension, row by row) between a buffer holding `from` and one holding
// `to`; `region` is inside both. The one walk every copy of a region takes,
// host memcpy or a device batch.
void for_each_run(const Region& from, const Region& to, const Region& region, size_t element,
                  const std::function<void(uint64_t from_byte, uint64_t to_byte, size_t bytes)>& run);

}  // namespace paramcast::reshard
