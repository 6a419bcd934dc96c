// A synthetic decoder-only LLM: tensor names and shapes of a Llama-style
// layout (embeddings, per-layer q/k/v/o, gate/up/down, norms, lm_head) scaled
// to a byte budget, filled with reproducible bytes that change every version.
// paramcast-trainer publishes it; paramcast-worker regenerates it to verify
// every received byte. 32 layers give 291 tensors, as a 7B model has.
#pragma once

#include <cstdint>
#include <utility>
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
// Bytes [offset, offset + length) of that content, into dst, computed
// without the rest of the tensor: a trainer rank fills only the rows it holds.
void fill_synthetic_range(const TensorSpec& spec, uint64_t seed, uint64_t version, void* dst, uint64_t offset,
                          uint64_t length, ModelChanges changes = ModelChanges::kEvery);
// The rows [first, first + count) of dim 0 that trainer rank `rank` of
// `ranks` holds of a tensor of `rows` rows in the synthetic many-sender job
// (paramcast-trainer --rank): even shares, one more row on each of the first
// rows % ranks ranks. A 0-d tensor: rank 0 holds it.
std::pair<int64_t, int64_t> synthetic_shard_rows(int64_t rows, int rank, int ranks);
// The slice engine rank `rank` of a tensor-parallel group of `tp` serves of
// a tensor of the synthetic layout, as vLLM cuts a LLaMA: row-parallel
// weights (o_proj, down_proj) along dim 1, the other matrices (q/k/v,
// gate/up, embeddings, lm_head) along dim 0, in ceil(n / tp) pieces (the
// last short or empty); 1-d tensors (norms) whole: {dim, start, length},
// dim -1 for whole.
struct TpSlice {
  int dim = -1;
  int64_t start = 0, length = 0;
};
TpSlice synthetic_tp_slice(const TensorSpec& spec, int tp, int rank);
// Offset of the first byte that differs from the expected content, or -1.
int64_t verify_synthetic(const TensorSpec& spec, uint64_t seed, uint64_t version, const void* data, uint64_t nbytes,
                         ModelChanges changes = ModelChanges::kEvery);

}  // namespace paramcast
