"""A vLLM Qwen2MoeForCausalLM on one tensor-parallel rank, imitated on the CPU (vLLM's layers need a GPU).

What is imitated, from vLLM 0.33.0 (``vllm/model_executor/models/qwen2_moe.py``,
``layers/fused_moe/layer.py``'s ``FusedMoEFactory``, ``fused_moe/routed_experts.py``,
``fused_moe/runner/moe_runner.py``, ``fused_moe/expert_map_manager.py``,
``fused_moe/router/gate_linear.py``): the module tree and parameter names (each MoE block's ``gate``
router, ``shared_expert_gate``, ``shared_expert`` MLP with fused ``gate_up_proj``, and ``experts``, a
``MoERunner`` whose ``routed_experts`` holds ``w13_weight`` [local experts, 2 * I/tp, hidden] and
``w2_weight`` [local experts, hidden, I/tp]), the layer classes under vLLM's class names carrying the
attributes vLLM's carry (``moe_config`` with its ``moe_parallel_config``: tp/ep rank and size,
``use_ep``; ``global_num_experts``/``local_num_experts``, ``_expert_map`` from vLLM's
``determine_expert_map`` (linear or round-robin placement), ``ckpt_*_proj_name``,
``intermediate_size_per_partition``, ``quant_method``, ``layer_name``), and ``get_expert_mapping()``
as ``RoutedExperts.build_expert_params_mapping`` states it. Attention, embeddings and norms are
vllm_tp_model's. ``load_weights`` follows vLLM's (vllm_contract.load_stacked: the stacked mapping,
then for experts the RoutedExperts loader: global to local expert id, gate/up rows and down columns
narrowed per TP rank, other ranks' experts skipped) and counts its calls.

``expected_slices`` is the test's own statement of what rank ``rank`` holds of each checkpoint tensor,
written from vLLM's loaders, independently of ParamCast's mapping.
"""

import types

import torch

import vllm_contract
import vllm_tp_model
from vllm_layers import (LinearBase, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                         RowParallelLinear, VocabParallelEmbedding, _param)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size, output_size, bias, rank, tp, dtype):
        super().__init__(input_size, output_size, rank, tp, dtype)
        self.output_partition_sizes = [output_size]
        self.weight = _param(output_size, input_size, dtype=dtype)
        self.bias = _param(output_size, dtype=dtype) if bias else None

    def weight_loader(self, param, full, shard_id=None):
        param.data.copy_(full)


class GateLinear(ReplicatedLinear):  # vLLM 0.33's MoE router (fused_moe/router/gate_linear.py)
    pass


class UnquantizedFusedMoEMethod:
    pass


class Fp8MoEMethod:  # quantized experts: their parameters are not the checkpoint's bytes
    pass


def determine_expert_map(ep_size, ep_rank, global_num_experts, placement="linear"):
    """vLLM's determine_expert_map: (local_num_experts, expert_map or None)."""
    if ep_size == 1:
        return global_num_experts, None
    base, remainder = divmod(global_num_experts, ep_size)
    local = base + 1 if ep_rank < remainder else base
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int32)
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        expert_map[start:start + local] = torch.arange(0, local, dtype=torch.int32)
    else:  # round_robin
        expert_map[torch.arange(ep_rank, global_num_experts, ep_size)] = torch.arange(0, local, dtype=torch.int32)
    return local, expert_map


class RoutedExperts(torch.nn.Module):
    """vLLM 0.33's RoutedExperts (unquantized, gated, no bias) on TP rank ``rank`` of ``tp``; with ``ep``
    the MoE's TP size is 1 and the experts are divided among the ``tp`` ranks (FusedMoEParallelConfig)."""

    def __init__(self, layer_name, num_experts, hidden, intermediate, rank, tp, ep, dtype, placement="linear",
                 ckpt_names=("gate_proj", "down_proj", "up_proj")):
        super().__init__()
        mtp, mrank = (1, 0) if ep else (tp, rank)
        par = types.SimpleNamespace(tp_size=mtp, tp_rank=mrank, ep_size=tp if ep else 1, ep_rank=rank if ep else 0,
                                    dp_size=1, dp_rank=0, use_ep=ep, enable_eplb=False)
        local, expert_map = determine_expert_map(par.ep_size, par.ep_rank, num_experts, placement)
        per = intermediate // mtp
        self.moe_config = types.SimpleNamespace(
            num_experts=num_experts, num_logical_experts=num_experts, num_local_experts=local, hidden_dim=hidden,
            hidden_dim_unpadded=hidden, intermediate_size=intermediate, intermediate_size_per_partition=per,
            moe_parallel_config=par, is_act_and_mul=True, has_bias=False, tp_rank=mrank, tp_size=mtp)
        self.layer_name = layer_name
        self.ckpt_gate_proj_name, self.ckpt_down_proj_name, self.ckpt_up_proj_name = ckpt_names
        self.hidden_size, self.intermediate_size_per_partition = hidden, per
        self.global_num_experts, self.local_num_experts = num_experts, local
        self.register_buffer("_expert_map", expert_map, persistent=False)
        self.quant_method = UnquantizedFusedMoEMethod()
        self.w13_weight = _param(local, 2 * per, hidden, dtype=dtype)
        self.w2_weight = _param(local, hidden, per, dtype=dtype)

    @property
    def expert_map(self):
        return self._expert_map

    def _map_global_expert_id_to_local_expert_id(self, expert_id):
        return expert_id if self._expert_map is None else int(self._expert_map[expert_id])

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        """RoutedExperts.weight_loader for one unquantized expert weight (_load_w13, _load_w2)."""
        expert_id = self._map_global_expert_id_to_local_expert_id(expert_id)
        if expert_id == -1:
            return False  # not local to this rank
        shard_dim = {"w1": 0, "w2": 1, "w3": 0}[shard_id]
        expert_data = param.data[expert_id]
        tp, tp_rank = self.moe_config.tp_size, self.moe_config.tp_rank
        per_rank = loaded_weight.shape[shard_dim] // tp
        loaded_weight = loaded_weight.narrow(shard_dim, per_rank * tp_rank, per_rank)
        if shard_id == "w2":
            expert_data.copy_(loaded_weight)
        else:
            size = expert_data.shape[0] // 2
            expert_data.narrow(0, 0 if shard_id == "w1" else size, size).copy_(loaded_weight)
        return True

    @staticmethod
    def build_expert_params_mapping(gate, down, up, num_experts, routed_experts_prefix="routed_experts"):
        """RoutedExperts.build_expert_params_mapping's per-expert entries (no EPLB, no LoRA)."""
        prefix = f"{routed_experts_prefix}." if routed_experts_prefix else ""
        return [(f"experts.{prefix}w13_" if name in (gate, up) else f"experts.{prefix}w2_",
                 f"experts.{e}.{name}.", e, shard_id)
                for e in range(num_experts) for shard_id, name in (("w1", gate), ("w2", down), ("w3", up))]

    def get_expert_mapping(self):
        return self.build_expert_params_mapping(self.ckpt_gate_proj_name, self.ckpt_down_proj_name,
                                                self.ckpt_up_proj_name, self.global_num_experts,
                                                routed_experts_prefix="")

    def load_weights(self, weights):
        """RoutedExperts.load_weights for per-expert checkpoint names (relative to the MoE block's experts)."""
        for expert_name, loaded_weight in weights:
            qual_name = f"{self.layer_name}.{expert_name}"
            for param_name, weight_name, expert_id, shard_id in self.get_expert_mapping():
                if weight_name not in qual_name:
                    continue
                param = getattr(self, qual_name.replace(weight_name, param_name).removeprefix(f"{self.layer_name}."))
                self.weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)
                break
            else:
                raise KeyError(f"{qual_name}: no expert mapping entry")


class SharedExperts(torch.nn.Module):  # runner/shared_experts.py: wraps the block's shared_expert
    def __init__(self, layer):
        super().__init__()
        self._layer = layer


class MoERunner(torch.nn.Module):  # what FusedMoEFactory returns: the block's `experts`
    def __init__(self, routed_experts, shared_experts=None):
        super().__init__()
        self.routed_experts = routed_experts
        self._shared_experts = None if shared_experts is None else SharedExperts(shared_experts)

    def load_weights(self, weights):
        return self.routed_experts.load_weights(weights)


class Qwen2MoeMLP(torch.nn.Module):
    def __init__(self, hidden, intermediate, rank, tp, dtype, expert_gate=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, rank, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, rank, tp, dtype)
        self.expert_gate = expert_gate


class Qwen2MoeSparseMoeBlock(torch.nn.Module):
    def __init__(self, cfg, prefix, rank, tp, ep, dtype, placement, quantized):
        super().__init__()
        h = cfg.hidden_size
        self.gate = GateLinear(h, cfg.num_experts, False, rank, tp, dtype)
        self.shared_expert_gate = ReplicatedLinear(h, 1, False, rank, tp, dtype)
        self.shared_expert = Qwen2MoeMLP(h, cfg.shared_expert_intermediate_size, rank, tp, dtype,
                                         expert_gate=self.shared_expert_gate)
        routed = RoutedExperts(f"{prefix}.experts", cfg.num_experts, h, cfg.moe_intermediate_size, rank, tp, ep,
                               dtype, placement)
        if quantized:
            routed.quant_method = Fp8MoEMethod()
        self.experts = MoERunner(routed, shared_experts=self.shared_expert)


class Qwen2MoeAttention(torch.nn.Module):
    def __init__(self, cfg, rank, tp, dtype):
        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          True, rank, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, False, rank, tp, dtype)


class Qwen2MoeDecoderLayer(torch.nn.Module):
    def __init__(self, cfg, prefix, rank, tp, ep, dtype, placement, quantized):
        super().__init__()
        self.self_attn = Qwen2MoeAttention(cfg, rank, tp, dtype)
        self.mlp = Qwen2MoeSparseMoeBlock(cfg, f"{prefix}.mlp", rank, tp, ep, dtype, placement, quantized)
        self.input_layernorm = RMSNorm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, dtype)


class Qwen2MoeModel(torch.nn.Module):
    def __init__(self, cfg, rank, tp, ep, dtype, placement, quantized):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, tp, dtype)
        self.layers = torch.nn.ModuleList(
            Qwen2MoeDecoderLayer(cfg, f"model.layers.{i}", rank, tp, ep, dtype, placement, quantized and i == 0)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, dtype)


class Qwen2MoeForCausalLM(torch.nn.Module):
    """``ep``: expert parallelism (the MoE layers' experts divided among the ``tp`` ranks, whole);
    ``placement``: vLLM's expert_placement_strategy; ``quantized``: layer 0's experts are FP8."""

    def __init__(self, cfg, rank, tp, ep=False, dtype=torch.bfloat16, placement="linear", quantized=False):
        super().__init__()
        # qwen2_moe.py: q/k/v packed, and gate/up where the model has shared experts
        self.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                       "gate_up_proj": ["gate_proj", "up_proj"]}
        self.model = Qwen2MoeModel(cfg, rank, tp, ep, dtype, placement, quantized)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, rank, tp, dtype)
        self.load_calls = 0
        self.load_bytes = 0

    def load_weights(self, weights):
        """qwen2_moe.py's: hf_to_vllm_mapper's stacked names, the experts through their MoERunner."""
        stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                   (".shared_expert.gate_up_proj", ".shared_expert.gate_proj", 0),
                   (".shared_expert.gate_up_proj", ".shared_expert.up_proj", 1)]

        def experts(name, full):
            if ".mlp.experts." not in name:
                return False
            block, _, rest = name.partition(".mlp.experts.")
            self.get_submodule(f"{block}.mlp.experts").load_weights([(rest, full)])
            return True

        vllm_contract.load_stacked(self, weights, stacked, route=experts)  # returns nothing, as before


def held_experts(cfg, rank, tp, ep):
    """The experts rank ``rank`` holds, in its slot order: every one, or with expert parallelism its
    contiguous share (vLLM's linear placement)."""
    if not ep:
        return list(range(cfg.num_experts))
    per = cfg.num_experts // tp
    return list(range(rank * per, (rank + 1) * per))


def expected_slices(cfg, ckpt, rank, tp, ep=False):
    """{checkpoint name: the slice rank ``rank`` of ``tp`` holds} of the checkpoint tensors ``ckpt``, as
    vLLM's loaders cut them: the experts' gate/up rows and down columns per TP rank, or with ``ep`` the
    experts this rank holds whole and no other; everything else as vllm_tp_model.expected_slices."""
    mine = set(held_experts(cfg, rank, tp, ep))
    out, rest = {}, {}
    for name, full in ckpt.items():
        if ".mlp.experts." not in name:
            rest[name] = full
            continue
        expert = int(name.split(".mlp.experts.")[1].split(".")[0])
        if expert not in mine:
            continue
        if ep:
            out[name] = full.contiguous()
        elif name.endswith("down_proj.weight"):  # [hidden, I]
            n = full.shape[1] // tp
            out[name] = full[:, rank * n:(rank + 1) * n].contiguous()
        else:  # gate_proj, up_proj [I, hidden]
            n = full.shape[0] // tp
            out[name] = full[rank * n:(rank + 1) * n].contiguous()
    out.update(vllm_tp_model.expected_slices(cfg, rest, rank, tp))
    return out


def expected_params(cfg, ckpt, rank, tp, ep=False):
    """{vLLM parameter name: what it must hold (its first rows, for the padded vocabulary)} of rank ``rank``."""
    cuts = expected_slices(cfg, ckpt, rank, tp, ep)
    out = vllm_tp_model.expected_params(cfg, {n: t for n, t in ckpt.items() if ".mlp.experts." not in n}, rank, tp)
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        held = held_experts(cfg, rank, tp, ep)
        out[pre + "routed_experts.w13_weight"] = torch.stack(
            [torch.cat([cuts[f"{pre}{e}.gate_proj.weight"], cuts[f"{pre}{e}.up_proj.weight"]]) for e in held])
        out[pre + "routed_experts.w2_weight"] = torch.stack([cuts[f"{pre}{e}.down_proj.weight"] for e in held])
    return out
