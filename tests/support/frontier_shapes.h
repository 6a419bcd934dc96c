// The three frontier checkpoints ParamCast is sized for (DeepSeek-V3,
// Kimi-K2, Qwen3-235B-A22B: names and shapes of their published configs,
// BF16), laid out as a many-sender JobLayout: M trainer ranks (FSDP2
// Shard(0) everywhere, or experts whole on rank e mod M with the rest
// Shard(0)) to R engine replicas of TP = 8 (vLLM's slices: column-parallel
// rows, row-parallel columns, vocabulary rows; experts whole on their EP
// rank, EP = 8; norms and routers whole). Used by the planner benchmark
// and the scale tests. Header only.
#pragma once

#include <string>
#include <vector>

#include "common/reshard/layout.h"

namespace paramcast::testing {

enum class FrontierModel { kDeepSeekV3, kKimiK2, kQwen3_235B };
enum class TrainerLayout { kFsdp, kExpertParallel };

inline const char* model_name(FrontierModel m) {
  return m == FrontierModel::kDeepSeekV3 ? "DeepSeek-V3" : m == FrontierModel::kKimiK2 ? "Kimi-K2" : "Qwen3-235B";
}

class FrontierJob {
 public:
  static constexpr int kTp = 8;

  FrontierJob(FrontierModel model, TrainerLayout trainer, int m, int replicas)
      : model_(model), trainer_(trainer), m_(m), replicas_(replicas) {
    for (int i = 0; i < m; ++i) job_.rank_names.push_back("trainer-" + std::to_string(i));
    for (int i = 0; i < replicas * kTp; ++i) job_.rank_names.push_back("worker-" + std::to_string(i));
    std::vector<int> trainers, engines;
    for (int i = 0; i < m; ++i) trainers.push_back(i);
    for (int i = 0; i < replicas * kTp; ++i) engines.push_back(m + i);
    fsdp_ = place(mesh(m, 1, trainers), 0);
    rows_ = place(mesh(kTp, replicas, engines), 0);
    cols_ = place(mesh(kTp, replicas, engines), 1);
    whole_ = place(mesh(1, replicas * kTp, engines), 0);
    for (int ep = 0; ep < kTp; ++ep) {
      std::vector<int> r;
      for (int q = 0; q < replicas; ++q) r.push_back(m + q * kTp + ep);
      ep_rank_.push_back(place(mesh(1, replicas, r), 0));
    }
    if (trainer == TrainerLayout::kExpertParallel)
      for (int i = 0; i < m; ++i) on_trainer_.push_back(place(mesh(1, 1, {i}), 0));
    build();
  }
  reshard::JobLayout& job() { return job_; }
  int engines() const { return replicas_ * kTp; }

 private:
  uint32_t mesh(int parts, int reps, std::vector<int> ranks) {
    job_.meshes.push_back({parts, reps, std::move(ranks)});
    return static_cast<uint32_t>(job_.meshes.size() - 1);
  }
  uint32_t place(uint32_t m, int dim) {
    job_.placements.push_back({m, dim, {}, {}});
    return static_cast<uint32_t>(job_.placements.size() - 1);
  }
  void add(const std::string& name, std::vector<int64_t> shape, uint32_t wanted, uint32_t held = UINT32_MAX) {
    job_.tensors.push_back({name, DType::kBF16, std::move(shape)});
    job_.held.push_back(held == UINT32_MAX ? fsdp_ : held);
    job_.wanted.push_back(wanted);
  }
  void mlp(const std::string& p, int64_t hidden, int64_t inter) {
    add(p + "gate_proj.weight", {inter, hidden}, rows_);
    add(p + "up_proj.weight", {inter, hidden}, rows_);
    add(p + "down_proj.weight", {hidden, inter}, cols_);
  }
  void experts(const std::string& p, int count, int64_t hidden, int64_t inter) {
    for (int e = 0; e < count; ++e) {
      const uint32_t wanted = ep_rank_[static_cast<size_t>(e / (count / kTp))];
      const uint32_t held = trainer_ == TrainerLayout::kExpertParallel ? on_trainer_[static_cast<size_t>(e % m_)]
                                                                      : fsdp_;
      const std::string x = p + "experts." + std::to_string(e) + ".";
      add(x + "gate_proj.weight", {inter, hidden}, wanted, held);
      add(x + "up_proj.weight", {inter, hidden}, wanted, held);
      add(x + "down_proj.weight", {hidden, inter}, wanted, held);
    }
  }
  void mla(const std::string& p, int64_t q_b, int64_t kv_b, int64_t o_in) {
    add(p + "self_attn.q_a_proj.weight", {1536, 7168}, whole_);
    add(p + "self_attn.q_a_layernorm.weight", {1536}, whole_);
    add(p + "self_attn.q_b_proj.weight", {q_b, 1536}, rows_);
    add(p + "self_attn.kv_a_proj_with_mqa.weight", {576, 7168}, whole_);
    add(p + "self_attn.kv_a_layernorm.weight", {512}, whole_);
    add(p + "self_attn.kv_b_proj.weight", {kv_b, 512}, rows_);
    add(p + "self_attn.o_proj.weight", {7168, o_in}, cols_);
  }
  void deepseek(int dense, int experts_n, int64_t vocab, int64_t q_b, int64_t kv_b, int64_t o_in) {
    add("model.embed_tokens.weight", {vocab, 7168}, rows_);
    for (int l = 0; l < 61; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      mla(p, q_b, kv_b, o_in);
      add(p + "input_layernorm.weight", {7168}, whole_);
      add(p + "post_attention_layernorm.weight", {7168}, whole_);
      if (l < dense) {
        mlp(p + "mlp.", 7168, 18432);
        continue;
      }
      add(p + "mlp.gate.weight", {experts_n, 7168}, whole_);
      add(p + "mlp.gate.e_score_correction_bias", {experts_n}, whole_);
      experts(p + "mlp.", experts_n, 7168, 2048);
      mlp(p + "mlp.shared_experts.", 7168, 2048);
    }
    add("model.norm.weight", {7168}, whole_);
    add("lm_head.weight", {vocab, 7168}, rows_);
  }
  void qwen3() {
    add("model.embed_tokens.weight", {151936, 4096}, rows_);
    for (int l = 0; l < 94; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "self_attn.q_proj.weight", {8192, 4096}, rows_);
      add(p + "self_attn.k_proj.weight", {512, 4096}, rows_);
      add(p + "self_attn.v_proj.weight", {512, 4096}, rows_);
      add(p + "self_attn.o_proj.weight", {4096, 8192}, cols_);
      add(p + "self_attn.q_norm.weight", {128}, whole_);
      add(p + "self_attn.k_norm.weight", {128}, whole_);
      add(p + "input_layernorm.weight", {4096}, whole_);
      add(p + "post_attention_layernorm.weight", {4096}, whole_);
      add(p + "mlp.gate.weight", {128, 4096}, whole_);
      experts(p + "mlp.", 128, 4096, 1536);
    }
    add("model.norm.weight", {4096}, whole_);
    add("lm_head.weight", {151936, 4096}, rows_);
  }
  void build() {
    if (model_ == FrontierModel::kDeepSeekV3) deepseek(3, 256, 129280, 24576, 32768, 16384);
    if (model_ == FrontierModel::kKimiK2) deepseek(1, 384, 163840, 12288, 16384, 8192);
    if (model_ == FrontierModel::kQwen3_235B) qwen3();
  }

  FrontierModel model_;
  TrainerLayout trainer_;
  int m_, replicas_;
  reshard::JobLayout job_;
  uint32_t fsdp_ = 0, rows_ = 0, cols_ = 0, whole_ = 0;
  std::vector<uint32_t> ep_rank_, on_trainer_;
};

}  // namespace paramcast::testing
