#include "common/reshard/region.h"

#include <algorithm>

namespace paramcast::reshard {

Region Region::whole(const std::vector<int64_t>& shape) {
  return Region{std::vector<int64_t>(shape.size(), 0), shape};
}

Region Region::slice(const std::vector<int64_t>& shape, int dim, int64_t start, int64_t length) {
  Region r = whole(shape);
  if (dim >= 0 && static_cast<size_t>(dim) < shape.size()) {
    r.offsets[static_cast<size_t>(dim)] = start;
    r.lengths[static_cast<size_t>(dim)] = length;
  }
  return r;
}

uint64_t Region::elements() const {
  uint64_t n = 1;
  for (int64_t l : lengths) {
    if (l <= 0) return 0;
    n *= static_cast<uint64_t>(l);
  }
  return n;
}

bool Region::inside(const std::vector<int64_t>& shape) const {
  if (offsets.size() != shape.size() || lengths.size() != shape.size()) return false;
  for (size_t d = 0; d < shape.size(); ++d)
    if (offsets[d] < 0 || lengths[d] < 0 || offsets[d] > shape[d] || lengths[d] > shape[d] - offsets[d]) return false;
  return true;
}

bool Region::contiguous_in(const std::vector<int64_t>& shape) const {
  // Whole in every dimension after the first that is not a single index.
  size_t d = 0;
  while (d < lengths.size() && lengths[d] == 1) ++d;
  for (size_t e = d + 1; e < lengths.size(); ++e)
    if (offsets[e] != 0 || lengths[e] != shape[e]) return false;
  return true;
}

std::string Region::to_string() const {
  if (offsets.size() != lengths.size()) {  // built with += (GCC 12's bogus -Wrestrict on operator+, bug 105329)
    std::string s = "(";
    s += std::to_string(offsets.size());
    s += " offsets, ";
    s += std::to_string(lengths.size());
    s += " lengths)";
    return s;
  }
  std::string s = "[";
  for (size_t d = 0; d < lengths.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(offsets[d]);
    int64_t end = 0;
    if (__builtin_add_overflow(offsets[d], lengths[d], &end)) {  // a hostile region, said as it came
      s += "+";
      s += std::to_string(lengths[d]);
    } else {
      s += ":";
      s += std::to_string(end);
    }
  }
  return s + "]";
}

bool contains(const Region& box, const Region& inner) {
  if (box.rank() != inner.rank() || box.offsets.size() != box.rank() || inner.offsets.size() != inner.rank())
    return false;
  for (size_t d = 0; d < box.rank(); ++d)
    if (inner.lengths[d] <= 0 || inner.offsets[d] < box.offsets[d] ||
        inner.offsets[d] + inner.lengths[d] > box.offsets[d] + box.lengths[d])
      return false;
  return true;
}

std::optional<Region> intersect(const Region& a, const Region& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Region r;
  for (size_t d = 0; d < a.rank(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets.push_back(lo);
    r.lengths.push_back(hi - lo);
  }
  return r;
}

std::vector<Region> subtract(const Region& a, const Region& b) {
  auto common = intersect(a, b);
  if (!common) return a.empty() ? std::vector<Region>{} : std::vector<Region>{a};
  // Peel off, dimension by dimension, the slabs of `rest` below and above
  // the common part; what remains of `rest` is the common part itself.
  std::vector<Region> out;
  Region rest = a;
  for (size_t d = 0; d < a.rank(); ++d) {
    const int64_t lo = common->offsets[d], hi = lo + common->lengths[d];
    const int64_t rlo = rest.offsets[d], rhi = rlo + rest.lengths[d];
    if (lo > rlo) {
      Region below = rest;
      below.lengths[d] = lo - rlo;
      out.push_back(below);
    }
    if (hi < rhi) {
      Region above = rest;
      above.offsets[d] = hi;
      above.lengths[d] = rhi - hi;
      out.push_back(above);
    }
    rest.offsets[d] = lo;
    rest.lengths[d] = hi - lo;
  }
  return out;
}

namespace {

// Up to this many dimensions, a walk keeps its strides and place on the
// stack (no allocation a piece); more go on the heap.
constexpr size_t kInlineRank = 8;

// Row-major strides (in elements) of a buffer holding `box`, into `s`.
void strides(const Region& box, uint64_t* s) {
  const size_t n = box.rank();
  if (n == 0) return;
  s[n - 1] = 1;
  for (size_t d = n; d-- > 1;) s[d - 1] = s[d] * static_cast<uint64_t>(box.lengths[d]);
}

// Element offset of `at` (global indices) in a buffer holding `box`.
uint64_t offset_of(const Region& box, const uint64_t* stride, const int64_t* at) {
  uint64_t o = 0;
  for (size_t d = 0; d < box.rank(); ++d) o += static_cast<uint64_t>(at[d] - box.offsets[d]) * stride[d];
  return o;
}

}  // namespace

std::optional<uint64_t> contiguous_at(const Region& box, const Region& region, size_t element) {
  size_t d = 0;
  while (d < region.rank() && region.lengths[d] == 1) ++d;
  for (size_t e = d + 1; e < region.rank(); ++e)
    if (region.offsets[e] != box.offsets[e] || region.lengths[e] != box.lengths[e]) return std::nullopt;
  uint64_t at = 0, stride = 1;
  for (size_t e = box.rank(); e-- > 0;) {
    at += static_cast<uint64_t>(region.offsets[e] - box.offsets[e]) * stride;
    stride *= static_cast<uint64_t>(box.lengths[e]);
  }
  return at * element;
}

void for_each_run(const Region& from, const Region& to, const Region& region, size_t element,
                  const std::function<void(uint64_t, uint64_t, size_t)>& run) {
  if (region.empty()) return;
  const size_t n = region.rank();
  if (n == 0) {
    run(0, 0, element);
    return;
  }
  // Room for the widest of the three (they are of one rank wherever the
  // contract holds: `region` inside both boxes).
  const size_t room = std::max({n, from.rank(), to.rank()});
  uint64_t inline_strides[2 * kInlineRank];
  int64_t inline_at[kInlineRank];
  std::vector<uint64_t> heap_strides;
  std::vector<int64_t> heap_at;
  uint64_t* sf = inline_strides;
  int64_t* at = inline_at;  // the first element of the current run
  if (room > kInlineRank) {
    heap_strides.resize(2 * room);
    heap_at.resize(room);
    sf = heap_strides.data();
    at = heap_at.data();
  }
  uint64_t* st = sf + room;
  strides(from, sf);
  strides(to, st);
  std::copy(region.offsets.begin(), region.offsets.end(), at);
  const size_t last = n - 1;
  const size_t bytes = static_cast<size_t>(region.lengths[last]) * element;
  for (;;) {
    run(offset_of(from, sf, at) * element, offset_of(to, st, at) * element, bytes);
    // Next run: count up the dimensions before the last, like an odometer.
    size_t d = last;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++at[d] < region.offsets[d] + region.lengths[d]) break;
      at[d] = region.offsets[d];
    }
  }
}

}  // namespace paramcast::reshard
