// BinomialTree: the shape of a Gloo-backend broadcast. Internal to data/gloo.
//
// The root sends to ranks root+2^k (largest subtree first); a rank whose
// distance from the root is v receives from v minus its highest set bit and
// sends to v+2^k for every 2^k above that bit. Depth is log2(world), and every
// rank knows its parent and children without talking to anyone.
//
// Thread-safety: plain values.
#pragma once

#include <cstddef>
#include <vector>

namespace paramcast::gloo_backend {

struct BinomialTree {
  int parent = -1;            // -1 at the root
  std::vector<int> children;  // largest subtree first

  static BinomialTree of(int rank, int world, int root) {
    BinomialTree t;
    const size_t n = static_cast<size_t>(world);
    const size_t v = (static_cast<size_t>(rank) + n - static_cast<size_t>(root)) % n;
    auto real = [&](size_t vr) { return static_cast<int>((vr + static_cast<size_t>(root)) % n); };
    size_t high = 0;  // the highest power of two <= v (0 at the root)
    for (size_t b = 1; b <= v; b <<= 1) high = b;
    if (v != 0) t.parent = real(v - high);
    size_t top = 1;
    while (top < n) top <<= 1;
    for (size_t b = top; b > high; b >>= 1)
      if (v + b < n) t.children.push_back(real(v + b));
    return t;
  }

  // Parent and children: the ranks this rank exchanges bytes with.
  std::vector<int> peers() const {
    std::vector<int> p = children;
    if (parent >= 0) p.push_back(parent);
    return p;
  }
};

}  // namespace paramcast::gloo_backend
