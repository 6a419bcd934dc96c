"""A vLLM LlamaForCausalLM served in block FP8, on one tensor-parallel rank, imitated on the CPU.

The model vLLM builds for a checkpoint whose ``quantization_config`` is ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}`` (DeepSeek-V3's layout; Qwen3-FP8 and others): its linear layers
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) take vLLM 0.33.0's ``Fp8LinearMethod``
(``vllm/model_executor/layers/quantization/fp8.py``) with parameters ``weight`` in float8 e4m3fn
``[output_size_per_partition, input_size_per_partition]`` and ``weight_scale_inv`` in float32
``[ceil(out/128), ceil(in/128)]``; embeddings, ``lm_head`` and norms stay BF16. The layers are
vllm_tp_model's (vLLM's class names and attributes) with those parameters, checked as vLLM's
``validate_fp8_block_shape`` checks them (each TP partition a whole number of 128-row blocks, a
row-parallel layer's input partition of 128-column blocks).

``load_weights`` is vllm_tp_model's (vLLM's ``stacked_params_mapping``: ``<part>.weight`` and
``<part>.weight_scale_inv`` both map to the fused layer's parameter, with the part's shard id). The
layers' loaders follow vLLM's ``weight_loader_v2``: the weight as an unquantized one; the scale,
a ``BlockQuantScaleParameter``, in block units (``adjust_block_scale_shard``: a shard's offset and
size in the fused parameter divided by 128, rounded up; the checkpoint's rows narrowed at shard
rank x that size). They refuse a tensor whose dtype is not the parameter's (a BF16 weight would be
cast into float8, not loaded). The model records what each call was given (name, dtype, shape,
bytes) and keeps the tensors, as vLLM's layerwise reload does until the round finishes.

``expected_params`` is the test's own statement of what rank ``rank`` holds, from the FP8 checkpoint.
"""

import hashlib
import threading

import torch

import vllm_tp_model as tp
from vllm_layers import BLOCK, Fp8Config, Fp8LinearMethod, Linears  # noqa: F401


def _blocks(n):
    return -(-n // BLOCK)


class BlockFp8:
    """vllm_tp_model's linear layer with Fp8LinearMethod's parameters and loaders (mixed in first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        out, inp = self.weight.shape
        sizes = getattr(self, "output_partition_sizes", [out])
        tp_split = self.tp_size > 1 and self.output_size // sum(sizes) == self.tp_size
        check = sizes if tp_split else sizes[:-1]  # a merged layer's last part may end mid-block
        if any(s % BLOCK for s in check):
            raise ValueError(f"{type(self).__name__}: output partitions {sizes} are not multiples of the "
                             f"{BLOCK}-row block (vLLM's validate_fp8_block_shape)")
        if getattr(self, "input_is_parallel", False) and self.tp_size > 1 and inp % BLOCK:
            raise ValueError(f"{type(self).__name__}: input partition {inp} is not a multiple of the "
                             f"{BLOCK}-column block (vLLM's validate_fp8_block_shape)")
        self.quant_method = Fp8LinearMethod()
        self.weight_block_size = [BLOCK, BLOCK]
        self.weight = torch.nn.Parameter(torch.full((out, inp), float("nan"), dtype=torch.float8_e4m3fn),
                                         requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.full((_blocks(out), _blocks(inp)), float("nan")),
                                                   requires_grad=False)

    def weight_loader(self, param, full, shard_id=None):
        if full.dtype != param.dtype:
            raise TypeError(f"{type(self).__name__}: checkpoint tensor of dtype {full.dtype} for a parameter "
                            f"of dtype {param.dtype}")
        if param is self.weight_scale_inv:
            self.scale_loader(param, full, shard_id)
        else:
            super().weight_loader(param, full, shard_id)


class QKVParallelLinear(BlockFp8, tp.QKVParallelLinear):
    def scale_loader(self, param, full, shard_id):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        at, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        at, n = _blocks(at), _blocks(n)
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, at, n).copy_(full.narrow(0, shard_rank * n, n))


class MergedColumnParallelLinear(BlockFp8, tp.MergedColumnParallelLinear):
    def scale_loader(self, param, full, shard_id):
        at = _blocks(sum(self.output_sizes[:shard_id]) // self.tp_size)
        n = _blocks(self.output_sizes[shard_id] // self.tp_size)
        param.data.narrow(0, at, n).copy_(full.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(BlockFp8, tp.RowParallelLinear):
    def scale_loader(self, param, full, shard_id=None):
        n = param.shape[1]
        param.data.copy_(full.narrow(1, self.tp_rank * n, n))


BLOCK_FP8 = Linears(QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)


class LlamaForCausalLM(tp.LlamaForCausalLM):
    def __init__(self, cfg, rank, tp_size, dtype=torch.bfloat16):
        super().__init__(cfg, rank, tp_size, dtype, BLOCK_FP8)
        self.given = []  # (name, dtype, shape, sha256 of the bytes) of each tensor given to load_weights
        self.kept = []  # (tensor given, a copy of its bytes then): vLLM's loaders keep them until the round ends
        self.threads = set()

    def load_weights(self, weights):
        weights = list(weights)
        self.threads.add(threading.get_ident())
        for name, full in weights:
            raw = full.detach().contiguous().view(torch.uint8)
            self.given.append((name, str(full.dtype), tuple(full.shape), hashlib.sha256(raw.numpy().tobytes())
                               .hexdigest()))
            self.kept.append((full, raw.clone()))
        return super().load_weights(weights)


def _scale_cut(name, full, cfg, rank, tp_size):
    """Rank `rank`'s blocks of checkpoint scale `name` ([ceil(rows/128), ceil(cols/128)])."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if ".q_proj." in name:
        n = _blocks(cfg.num_attention_heads // tp_size * hd)
        return full[rank * n:(rank + 1) * n]
    if ".k_proj." in name or ".v_proj." in name:
        reps = max(1, tp_size // cfg.num_key_value_heads)
        n = _blocks(max(1, cfg.num_key_value_heads // tp_size) * hd)
        return full[rank // reps * n:(rank // reps + 1) * n]
    if ".gate_proj." in name or ".up_proj." in name:
        n = _blocks(cfg.intermediate_size // tp_size)
        return full[rank * n:(rank + 1) * n]
    if name.endswith(("o_proj.weight_scale_inv", "down_proj.weight_scale_inv")):
        cols = (cfg.num_attention_heads * hd) if "o_proj" in name else cfg.intermediate_size
        n = _blocks(cols // tp_size)
        return full[:, rank * n:(rank + 1) * n]
    raise KeyError(name)


def expected_params(cfg, ckpt, rank, tp_size):
    """{vLLM parameter name: what rank `rank` holds of it} after loading the FP8 checkpoint `ckpt`
    ({name: tensor}, scales as `<name>_scale_inv`): weights cut as vllm_tp_model.expected_slices cuts
    them, scales in 128-blocks of the same shards, parts back to back."""
    cuts = tp.expected_slices(cfg, {n: t for n, t in ckpt.items() if not n.endswith("_scale_inv")}, rank, tp_size)
    for name, full in ckpt.items():
        if name.endswith("_scale_inv"):
            cuts[name] = _scale_cut(name, full, cfg, rank, tp_size).contiguous()
    return tp.fused_params(cuts)


def pack(state):
    """{name: tensor} for a pipe: float8 tensors as (uint8 view, True) (PyTorch cannot pickle float8)."""
    return {n: (t.view(torch.uint8), True) if t.dtype == torch.float8_e4m3fn else (t, False)
            for n, t in state.items()}


def unpack(packed):
    return {n: t.view(torch.float8_e4m3fn) if fp8 else t for n, (t, fp8) in packed.items()}
