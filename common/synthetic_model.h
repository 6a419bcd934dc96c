// A synthetic decoder-only LLM: tensor names and shapes of a Llama-style
// layout (embeddings, per-layer q/k/v/o, gate/up/down, norms, lm_head) scaled
// to a byte budget, filled with reproducible bytes that change every version.
// paramcast-trainer publishes it; paramcast-worker regenerates it to verify
// every received byte. 32 layers give 291 tensors, as a 7B model has.
#pragma once

#include <cstdint>
#include <vector>

#include "common/config.h"
#include "common/tensor.h"

namespace paramcast {

std::vector<TensorSpec> synthetic_llm_layout(uint64_t target_bytes, int layers, DType dtype);

// Deterministic content of one tensor at one version. With
// ModelChanges::kUneven, version v differs from v-1 as an RL step makes it:
// each tensor, at each version, is unchanged, changed in about 1 of 61
// 8-byte words, changed wholesale, or changed wholesale in every other
// 256 KiB block (the others unchanged); every 8th version (and v1) is new
// wholesale. The content at v is computed without v-1's (from at most the
// last 8 versions' choices), so a verifier needs no history.
void fill_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, void* dst, uint64_t nbytes,
                    ModelChanges changes = ModelChanges::kEvery);
// Offset of the first byte that differs from the expected content, or -1.
int64_t verify_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, const void* data, uint64_t nbytes,
                         ModelChanges changes = ModelChanges::kEvery);

}  // namespace paramcast
