#include "common/synthetic_model.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/xxhash.h"

namespace paramcast {
namespace {
uint64_t bytes_for(uint64_t h, int layers, uint64_t esize) {
  const uint64_t inter = h * 43 / 16;  // 11008 / 4096
  const uint64_t vocab = std::min<uint64_t>(32000, 32 * h);
  const uint64_t per_layer = 4 * h * h + 3 * h * inter + 2 * h;
  return (static_cast<uint64_t>(layers) * per_layer + 2 * vocab * h + h) * esize;
}

inline uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t stream_seed(const TensorSpec& spec, uint64_t seed, uint64_t version) {
  return xxh64(spec.name.data(), spec.name.size(), seed * 0x100000001B3ULL + version);
}
}  // namespace

std::vector<TensorSpec> synthetic_llm_layout(uint64_t target_bytes, int layers, DType dtype) {
  const uint64_t esize = dtype_size(dtype);
  uint64_t h = 8;
  while (bytes_for(h + 8, layers, esize) <= target_bytes) h += 8;
  const int64_t H = static_cast<int64_t>(h);
  const int64_t I = static_cast<int64_t>(h * 43 / 16);
  const int64_t V = static_cast<int64_t>(std::min<uint64_t>(32000, 32 * h));
  std::vector<TensorSpec> out;
  out.push_back({"model.embed_tokens.weight", dtype, {V, H}});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "self_attn.q_proj.weight", dtype, {H, H}});
    out.push_back({p + "self_attn.k_proj.weight", dtype, {H, H}});
    out.push_back({p + "self_attn.v_proj.weight", dtype, {H, H}});
    out.push_back({p + "self_attn.o_proj.weight", dtype, {H, H}});
    out.push_back({p + "mlp.gate_proj.weight", dtype, {I, H}});
    out.push_back({p + "mlp.up_proj.weight", dtype, {I, H}});
    out.push_back({p + "mlp.down_proj.weight", dtype, {H, I}});
    out.push_back({p + "input_layernorm.weight", dtype, {H}});
    out.push_back({p + "post_attention_layernorm.weight", dtype, {H}});
  }
  out.push_back({"model.norm.weight", dtype, {H}});
  out.push_back({"lm_head.weight", dtype, {V, H}});
  return out;
}

namespace {
// Word w (8 bytes) of the stream of `x0`: what the w-th splitmix(x) gives.
inline uint64_t word_at(uint64_t x0, uint64_t w) {
  uint64_t x = x0 + w * 0x9E3779B97F4A7C15ULL;
  return splitmix(x);
}

// ModelChanges::kUneven: how a tensor changes at version u.
enum class Change { kNone, kSparse, kWhole, kAlternate };
constexpr uint64_t kBlockWords = 32768;  // 256 KiB: alternate blocks
constexpr uint64_t kSparseOneIn = 61;

Change change_at(const TensorSpec& spec, uint64_t seed, uint64_t u) {
  if (u <= 1 || u % 8 == 1) return Change::kWhole;
  const uint64_t h = xxh64(spec.name.data(), spec.name.size(), seed * 0x2545F4914F6CDD1DULL + u * 0x9E3779B97F4A7C15ULL);
  return static_cast<Change>(h % 4);
}

bool changes_word(Change c, uint64_t salt, uint64_t w) {
  switch (c) {
    case Change::kNone: return false;
    case Change::kWhole: return true;
    case Change::kAlternate: return (w / kBlockWords) % 2 == 0;
    case Change::kSparse: {
      uint64_t x = salt ^ (w * 0xD1B54A32D192ED03ULL);
      return splitmix(x) % kSparseOneIn == 0;
    }
  }
  return true;
}

// Calls out(w, word) for every word of the tensor at `version` (words
// [first, first + count) of it when count is given).
template <typename F>
void generate(const TensorSpec& spec, uint64_t seed, uint64_t version, uint64_t nbytes, ModelChanges changes, F&& out,
              uint64_t first = 0, uint64_t count = ~uint64_t{0}) {
  const uint64_t words = std::min((nbytes + 7) / 8, count == ~uint64_t{0} ? ~uint64_t{0} : first + count);
  if (changes == ModelChanges::kEvery) {
    const uint64_t x0 = stream_seed(spec, seed, version);
    for (uint64_t w = first; w < words; ++w) out(w, word_at(x0, w));
    return;
  }
  // The versions since the last wholesale change, newest first: a word holds
  // the value of the newest of them that changed it.
  struct Step { Change change; uint64_t x0, salt; };
  std::vector<Step> steps;
  for (uint64_t u = version;; --u) {
    const Change c = change_at(spec, seed, u);
    steps.push_back({c, stream_seed(spec, seed, u), stream_seed(spec, seed ^ 0x5bd1e995, u)});
    if (c == Change::kWhole || u <= 1) break;
  }
  for (uint64_t w = first; w < words; ++w)
    for (const Step& s : steps)
      if (changes_word(s.change, s.salt, w)) {
        out(w, word_at(s.x0, w));
        break;
      }
}
}  // namespace

void fill_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, void* dst, uint64_t nbytes,
                    ModelChanges changes) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  generate(spec, seed, version, nbytes, changes, [&](uint64_t w, uint64_t v) {
    std::memcpy(p + w * 8, &v, std::min<uint64_t>(8, nbytes - w * 8));
  });
}

void fill_synthetic_range(const TensorSpec& spec, uint64_t seed, uint64_t version, void* dst, uint64_t offset,
                          uint64_t length, ModelChanges changes) {
  if (length == 0) return;
  auto total = spec.nbytes();
  const uint64_t nbytes = total.ok() ? *total : 0;
  uint8_t* p = static_cast<uint8_t*>(dst);
  const uint64_t first = offset / 8, last = (offset + length + 7) / 8;
  generate(
      spec, seed, version, nbytes, changes,
      [&](uint64_t w, uint64_t v) {
        const uint64_t begin = std::max(w * 8, offset), end = std::min({w * 8 + 8, offset + length, nbytes});
        if (begin < end) std::memcpy(p + (begin - offset), reinterpret_cast<const uint8_t*>(&v) + (begin - w * 8), end - begin);
      },
      first, last - first);
}

std::pair<int64_t, int64_t> synthetic_shard_rows(int64_t rows, int rank, int ranks) {
  const int64_t base = rows / ranks, extra = rows % ranks;
  const int64_t first = rank * base + std::min<int64_t>(rank, extra);
  return {first, base + (rank < extra ? 1 : 0)};
}

TpSlice synthetic_tp_slice(const TensorSpec& spec, int tp, int rank) {
  if (tp <= 1 || spec.shape.size() != 2) return {};
  const auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return spec.name.size() >= s.size() && spec.name.compare(spec.name.size() - s.size(), s.size(), s) == 0;
  };
  const int dim = ends_with("o_proj.weight") || ends_with("down_proj.weight") ? 1 : 0;
  const int64_t n = spec.shape[static_cast<size_t>(dim)], per = (n + tp - 1) / tp;
  const int64_t start = std::min<int64_t>(n, per * rank);
  return {dim, start, std::min<int64_t>(per, n - start)};
}

int64_t verify_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, const void* data, uint64_t nbytes,
                         ModelChanges changes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  int64_t first = -1;
  generate(spec, seed, version, nbytes, changes, [&](uint64_t w, uint64_t v) {
    const uint64_t i = w * 8;
    const uint64_t n = std::min<uint64_t>(8, nbytes - i);
    if (first >= 0 || std::memcmp(p + i, &v, n) == 0) return;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(&v);
    for (uint64_t k = 0; k < n; ++k)
      if (p[i + k] != e[k]) {
        first = static_cast<int64_t>(i + k);
        return;
      }
  });
  return first;
}

}  // namespace paramcast
