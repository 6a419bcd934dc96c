"""A vLLM LlamaForCausalLM on one tensor-parallel rank, imitated on the CPU (vLLM's layers need a GPU).

What is imitated: the module tree and parameter names of vLLM's ``LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.{qkv_proj,o_proj}``, ``model.layers.N.mlp.{gate_up_proj,down_proj}``, the norms,
``lm_head``, ``packed_modules_mapping``), built of vllm_layers.py's stand-ins for vLLM's layer classes
(re-exported here: vLLM's class names, with the attributes its layers carry). ``load_weights`` follows
vLLM's (``stacked_params_mapping``, each layer's ``weight_loader`` narrowing the full checkpoint tensor:
vllm_contract.load_stacked) and counts its calls: a full tensor reaching the worker shows there.

``expected_slices`` is the test's own statement of what rank ``rank`` holds of each checkpoint tensor,
written from vLLM's loaders, independently of ParamCast's mapping.
"""

import torch

import vllm_contract
from vllm_layers import (PAD, ColumnParallelLinear, Fp8LinearMethod, LinearBase, LlamaAttention,  # noqa: F401
                         LlamaDecoderLayer, LlamaMLP, LlamaModel, MergedColumnParallelLinear, ParallelLMHead,
                         QKVParallelLinear, RMSNorm, RowParallelLinear, UnquantizedEmbeddingMethod,
                         UnquantizedLinearMethod, VocabParallelEmbedding, UNQUANTIZED, _pad, _param)


class LlamaForCausalLM(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg, rank, tp, dtype=torch.bfloat16, linears=UNQUANTIZED):
        super().__init__()
        self.model = LlamaModel(cfg, rank, tp, dtype, linears)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, rank, tp, dtype)
        self.load_calls = 0  # tensors given to load_weights
        self.load_bytes = 0

    def load_weights(self, weights):
        """vLLM's LlamaForCausalLM.load_weights: stacked_params_mapping, then each layer's weight_loader."""
        stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                   (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
        return vllm_contract.load_stacked(self, weights, stacked)


def expected_slices(cfg, hf_state, rank, tp):
    """{checkpoint name: the slice rank `rank` of `tp` holds}, as vLLM's loaders cut them: q by heads,
    k and v by kv heads (replicated where tp exceeds them), gate/up, embeddings and lm_head by rows (the
    vocabulary's real rows only), o_proj/down_proj weights by columns; norms and o_proj's bias whole."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nq = cfg.num_attention_heads // tp
    reps = max(1, tp // cfg.num_key_value_heads)
    nkv = max(1, cfg.num_key_value_heads // tp)
    per_vocab = _pad(cfg.vocab_size) // tp
    out = {}
    for name, full in hf_state.items():
        if ".q_proj." in name:
            cut = full[rank * nq * hd:(rank + 1) * nq * hd]
        elif ".k_proj." in name or ".v_proj." in name:
            r = rank // reps
            cut = full[r * nkv * hd:(r + 1) * nkv * hd]
        elif ".gate_proj." in name or ".up_proj." in name:
            n = full.shape[0] // tp
            cut = full[rank * n:(rank + 1) * n]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            n = full.shape[1] // tp
            cut = full[:, rank * n:(rank + 1) * n]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start = min(rank * per_vocab, cfg.vocab_size)
            cut = full[start:min(start + per_vocab, cfg.vocab_size)]
        else:  # norms, o_proj.bias
            cut = full
        out[name] = cut.contiguous()
    return out


def expected_params(cfg, hf_state, rank, tp):
    """{vLLM parameter name: (the rows loaded, how many rows of it the checkpoint fills)} of rank `rank`."""
    return fused_params(expected_slices(cfg, hf_state, rank, tp))


def fused_params(cuts):
    """{checkpoint name: cut} as vLLM's fused parameters hold them: q, k, v back to back in qkv_proj,
    gate and up in gate_up_proj (in the order the checkpoint names them), the rest as they are."""
    fused = {}
    for name, cut in cuts.items():
        for part, whole in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                            (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj.")):
            if part in name:
                name = name.replace(part, whole)
                break
        fused.setdefault(name, []).append(cut)
    return {n: torch.cat(parts) if len(parts) > 1 else parts[0] for n, parts in fused.items()}
