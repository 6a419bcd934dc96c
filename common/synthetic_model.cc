#include "common/synthetic_model.h"

#include <cstring>
#include <string>

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

void fill_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, void* dst, uint64_t nbytes) {
  uint64_t x = stream_seed(spec, seed, version);
  uint8_t* p = static_cast<uint8_t*>(dst);
  uint64_t i = 0;
  for (; i + 8 <= nbytes; i += 8) {
    const uint64_t v = splitmix(x);
    std::memcpy(p + i, &v, 8);
  }
  if (i < nbytes) {
    const uint64_t v = splitmix(x);
    std::memcpy(p + i, &v, nbytes - i);
  }
}

int64_t verify_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, const void* data, uint64_t nbytes) {
  uint64_t x = stream_seed(spec, seed, version);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (uint64_t i = 0; i < nbytes; i += 8) {
    const uint64_t v = splitmix(x);
    const uint64_t n = std::min<uint64_t>(8, nbytes - i);
    if (std::memcmp(p + i, &v, n) != 0) {
      const uint8_t* e = reinterpret_cast<const uint8_t*>(&v);
      for (uint64_t k = 0; k < n; ++k)
        if (p[i + k] != e[k]) return static_cast<int64_t>(i + k);
    }
  }
  return -1;
}

}  // namespace paramcast
