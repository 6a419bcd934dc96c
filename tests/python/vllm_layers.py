"""vLLM's layers imitated on the CPU, shared by the imitation models (vllm_tp_model.py,
vllm_fp8_model.py, vllm_moe_model.py): vLLM 0.33.0's layer classes under their own names, carrying
the attributes its layers carry (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``): ``tp_rank``/``tp_size``, ``output_size_per_partition``,
``output_sizes``, ``total_num_heads``/``num_heads``/``num_kv_heads``/``num_kv_head_replicas``/``head_size``,
``input_size_per_partition``/``input_is_parallel``, ``shard_indices`` (vocabulary padded to 64 rows per
rank), ``quant_method``, with parameters of the shapes those layers allocate (NaN until loaded) and each
layer's ``weight_loader`` narrowing the full checkpoint tensor as vLLM's does.

And the Llama blocks built of them (attention, MLP, decoder layer, model), whose linear layers are
the ``Linears`` given: vLLM's unquantized ones, or the block-FP8 ones of vllm_fp8_model.py.
"""

import collections
import types

import torch

PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _pad(n, to=PAD):
    return (n + to - 1) // to * to


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


BLOCK = 128  # the block of vLLM's block FP8 (weight_block_size [128, 128])


class Fp8Config:  # vLLM's Fp8Config for a serialized block-FP8 checkpoint
    is_checkpoint_fp8_serialized = True
    activation_scheme = "dynamic"
    weight_block_size = [BLOCK, BLOCK]


class Fp8LinearMethod:  # vLLM's: a quantized layer, whose parameters hold what its loaders made of the checkpoint
    def __init__(self):
        self.quant_config = Fp8Config()
        self.block_quant = True
        self.weight_block_size = self.quant_config.weight_block_size


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


# The linear layer classes a Llama block is built of.
Linears = collections.namedtuple("Linears", "qkv merged row")
UNQUANTIZED = Linears(QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype, linears=UNQUANTIZED):
        super().__init__()
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = linears.qkv(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                    bias, rank, tp, dtype)
        self.o_proj = linears.row(cfg.num_attention_heads * hd, cfg.hidden_size, bias, rank, tp, dtype)


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype, linears=UNQUANTIZED):
        super().__init__()
        self.gate_up_proj = linears.merged(cfg.hidden_size, [cfg.intermediate_size] * 2, False, rank, tp, dtype)
        self.down_proj = linears.row(cfg.intermediate_size, cfg.hidden_size, False, rank, tp, dtype)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype, linears=UNQUANTIZED):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rank, tp, dtype, linears)
        self.mlp = LlamaMLP(cfg, rank, tp, dtype, linears)
        self.input_layernorm = RMSNorm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, dtype)


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype, linears=UNQUANTIZED):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, tp, dtype)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, rank, tp, dtype, linears)
                                          for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, dtype)
