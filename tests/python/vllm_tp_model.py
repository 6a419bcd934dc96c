"""A vLLM LlamaForCausalLM on one tensor-parallel rank, imitated on the CPU (vLLM's layers need a GPU).

What is imitated: the module tree and parameter names of vLLM's ``LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.{qkv_proj,o_proj}``, ``model.layers.N.mlp.{gate_up_proj,down_proj}``, the norms,
``lm_head``, ``packed_modules_mapping``), and its layer classes under vLLM's class names, carrying the
attributes vLLM 0.33.0's layers carry (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``): ``tp_rank``/``tp_size``, ``output_size_per_partition``,
``output_sizes``, ``total_num_heads``/``num_heads``/``num_kv_heads``/``num_kv_head_replicas``/``head_size``,
``input_size_per_partition``/``input_is_parallel``, ``shard_indices`` (vocabulary padded to 64 rows per
rank), ``quant_method``, with parameters of the shapes those layers allocate. ``load_weights`` follows
vLLM's (``stacked_params_mapping``, each layer's ``weight_loader`` narrowing the full checkpoint tensor:
vllm_contract.load_stacked) and counts its calls: a full tensor reaching the worker shows there.

``expected_slices`` is the test's own statement of what rank ``rank`` holds of each checkpoint tensor,
written from vLLM's loaders, independently of ParamCast's mapping.
"""

import types

import torch

import vllm_contract

PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _pad(n, to=PAD):
    return (n + to - 1) // to * to


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


class Fp8LinearMethod:  # a quantized layer: its parameters are not the checkpoint's bytes
    pass


def _param(*shape, dtype):
    return torch.nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)


class LinearBase(torch.nn.Module):
    def __init__(self, input_size, output_size, rank, tp, dtype):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = rank, tp
        self.params_dtype = dtype
        self.quant_method = UnquantizedLinearMethod()


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias, rank, tp, dtype):
        super().__init__(input_size, output_size, rank, tp, dtype)
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size // tp
        self.output_partition_sizes = [s // tp for s in getattr(self, "output_sizes", [output_size])]
        self.gather_output = False
        self.weight = _param(sum(self.output_partition_sizes), input_size, dtype=dtype)
        self.bias = _param(self.output_size_per_partition, dtype=dtype) if bias else None

    def weight_loader(self, param, full, shard_id=None):
        n = param.shape[0]
        param.data.copy_(full.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_sizes, bias, rank, tp, dtype):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, rank, tp, dtype)

    def weight_loader(self, param, full, shard_id):
        at = sum(self.output_sizes[:shard_id]) // self.tp_size
        n = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, at, n).copy_(full.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias, rank, tp, dtype):
        self.hidden_size, self.head_size, self.v_head_size = hidden_size, head_size, head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp
        if tp >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp // total_num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = total_num_kv_heads // tp, 1
        self.output_sizes = [self.num_heads * head_size * tp, self.num_kv_heads * head_size * tp,
                             self.num_kv_heads * head_size * tp]
        super().__init__(hidden_size, sum(self.output_sizes), bias, rank, tp, dtype)

    def weight_loader(self, param, full, shard_id):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        at, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, at, n).copy_(full.narrow(0, shard_rank * n, n))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias, rank, tp, dtype):
        super().__init__(input_size, output_size, rank, tp, dtype)
        self.input_size_per_partition = input_size // tp
        self.output_size_per_partition = output_size
        self.input_is_parallel, self.reduce_results = True, True
        self.weight = _param(output_size, self.input_size_per_partition, dtype=dtype)
        self.bias = _param(output_size, dtype=dtype) if bias else None  # added after the all-reduce: whole

    def weight_loader(self, param, full, shard_id=None):
        if param.dim() == 1:
            param.data.copy_(full)
            return
        n = param.shape[1]
        param.data.copy_(full.narrow(1, self.tp_rank * n, n))


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, rank, tp, dtype):
        super().__init__()
        self.tp_rank, self.tp_size = rank, tp
        self.num_embeddings = self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = _pad(num_embeddings)  # divided among the ranks
        self.num_embeddings_per_partition = self.num_embeddings_padded // tp
        per = self.num_embeddings_per_partition
        start = min(rank * per, num_embeddings)
        end = min(start + per, num_embeddings)
        self.shard_indices = types.SimpleNamespace(  # vLLM's VocabParallelEmbeddingShardIndices
            padded_org_vocab_start_index=rank * per, padded_org_vocab_end_index=(rank + 1) * per,
            padded_added_vocab_start_index=(rank + 1) * per, padded_added_vocab_end_index=(rank + 1) * per,
            org_vocab_start_index=start, org_vocab_end_index=end,
            added_vocab_start_index=num_embeddings, added_vocab_end_index=num_embeddings)
        self.quant_method = UnquantizedEmbeddingMethod()
        self.weight = _param(per, embedding_dim, dtype=dtype)

    def weight_loader(self, param, full, shard_id=None):
        i = self.shard_indices
        n = i.org_vocab_end_index - i.org_vocab_start_index
        param.data[:n].copy_(full[i.org_vocab_start_index:i.org_vocab_end_index])


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden, dtype):
        super().__init__()
        self.weight = _param(hidden, dtype=dtype)


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype):
        super().__init__()
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias, rank, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias, rank, tp, dtype)


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False,
                                                       rank, tp, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, rank, tp, dtype)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rank, tp, dtype)
        self.mlp = LlamaMLP(cfg, rank, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, dtype)


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, tp, dtype)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, rank, tp, dtype)
                                          for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, dtype)


class LlamaForCausalLM(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg, rank, tp, dtype=torch.bfloat16):
        super().__init__()
        self.model = LlamaModel(cfg, rank, tp, dtype)
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
    cuts = expected_slices(cfg, hf_state, rank, tp)
    fused = {}
    for name, cut in cuts.items():
        for part, whole in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                            (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj.")):
            if part in name:
                name = name.replace(part, whole)
                break
        fused.setdefault(name, []).append(cut)
    return {n: torch.cat(parts) if len(parts) > 1 else parts[0] for n, parts in fused.items()}
