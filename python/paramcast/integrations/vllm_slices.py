"""The slices a tensor-parallel vLLM worker serves, read from its model's parallel layers.

Part of ``paramcast.integrations.vllm`` (which re-exports every name here; import them from there).

Tensor-parallel workers receive only their slices. A worker whose model has
vLLM's parallel layers (Column/MergedColumn/QKV/RowParallelLinear,
VocabParallelEmbedding, the fused Mixture-of-Experts layer, recognized by class
name or by the attributes they carry) registers, per checkpoint tensor, the
slice it serves (:func:`tp_destinations`: q, k and v as row ranges of
``qkv_proj``, gate and up of ``gate_up_proj``, row-parallel weights along dim
1, norms and row-parallel biases whole; each expert this worker holds as rows
of its slot in ``w13_weight`` and columns of ``w2_weight``, the experts other
expert-parallel ranks hold as empty boxes: declared, no byte sent), written in
place; the trainer sends whole tensors under their Hugging Face names with one
``weight_update`` and ParamCast's plan sends each worker only its slices, point
to point. ``init_info.slices`` ("auto", "on", "off") and ``whole_fallback``
choose; a parameter whose slice cannot be stated fails ``init_transfer_engine``
naming it.

Slices do not take FP8 (:func:`slice_refusal`): a worker that serves slices
refuses, at ``init_transfer_engine``, a tensor the rules send as FP8 (or cast
to a dtype its parameter does not hold), naming it; an FP8 vLLM model
(quantized layers) is refused there too. Such workers take ``slices: "off"``
(FP8 goes whole through ``load_weights``, whose loaders cut each shard's
weight rows and scale blocks, and vLLM's layerwise reload processes them
after loading).
"""

from __future__ import annotations

import re

import paramcast

from .vllm_base import _CASTS, _describe_rule, _rule_for

# vLLM's parallel layers, by class name (the layer classes import CUDA-bound parts of vLLM, so they are
# recognized by name, and then by the attributes they carry, never imported).
_QKV, _MERGED, _COLUMN, _ROW, _VOCAB, _REPLICATED = "qkv", "merged", "column", "row", "vocab", "replicated"
# vLLM's fused Mixture-of-Experts layer: all experts of one MoE block in two parameters. The layout
# follows vLLM 0.33.0's vllm/model_executor/layers/fused_moe/routed_experts.py (RoutedExperts: the
# parameters of UnquantizedFusedMoEMethod.create_weights, weight_loader/_load_w13/_load_w2,
# build_expert_params_mapping; the block's `experts` is a MoERunner holding it as `routed_experts`),
# which earlier vLLM kept on FusedMoE itself (fused_moe/layer.py):
#   w13_weight [local experts, 2 * I/tp, hidden]: per local expert slot, its gate rows (shard "w1")
#              then its up rows ("w3"), each rows tp_rank * I/tp.. of the checkpoint's [I, hidden];
#   w2_weight  [local experts, hidden, I/tp]: down_proj ("w2") cut along its dim 1.
# With expert parallelism the MoE's tp_size is 1 (each rank holds whole experts) and expert_map maps a
# global expert id to its local slot (-1: another rank's, declared here as an empty box: a subscriber
# names every tensor of an update, and wants none of its bytes). The router (gate) is a ReplicatedLinear.
_MOE = "moe"
_KIND_BY_CLASS = {"QKVParallelLinear": _QKV, "MergedColumnParallelLinear": _MERGED,
                  "ColumnParallelLinear": _COLUMN, "RowParallelLinear": _ROW,
                  "VocabParallelEmbedding": _VOCAB, "ReplicatedLinear": _REPLICATED,
                  "RoutedExperts": _MOE, "FusedMoE": _MOE}
# The checkpoint names of a fused layer's parts, where the model states no packed_modules_mapping
# (vLLM's LLaMA, Qwen2/3, Mistral state this one).
_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class UnmappedParameter(ValueError):
    """A parameter of the worker's model whose slice ParamCast cannot state (the message names it)."""


def _layer_kind(module):
    """The vLLM parallel layer ``module`` is (_QKV, ..., None: not a parallel layer), by class, then by
    the attributes vLLM's layers carry; "unknown" for a tensor-parallel module of another kind."""
    for cls in type(module).__mro__:
        if cls.__name__ in _KIND_BY_CLASS:
            return _KIND_BY_CLASS[cls.__name__]
    has = lambda *a: all(hasattr(module, x) for x in a)  # noqa: E731
    own = getattr(module, "_parameters", None) or {}
    if "w13_weight" in own and "w2_weight" in own and has("local_num_experts", "global_num_experts"):
        return _MOE
    if has("total_num_heads", "num_heads", "num_kv_heads", "head_size", "output_sizes", "tp_rank", "tp_size"):
        return _QKV
    if has("output_sizes", "output_size_per_partition", "tp_rank", "tp_size"):
        return _MERGED
    if has("output_size_per_partition", "tp_rank", "tp_size"):
        return _COLUMN
    if has("input_is_parallel", "input_size_per_partition", "tp_rank", "tp_size"):
        return _ROW
    if has("num_embeddings_per_partition", "tp_rank", "tp_size") or has("shard_indices", "tp_size"):
        return _VOCAB
    if hasattr(module, "tp_size") or hasattr(module, "tp_rank"):
        return "unknown"
    return None


def _full_name(prefix, leaf):
    return f"{prefix}.{leaf}" if prefix else leaf


def tp_destinations(model, packed=None, expert_mapping=None):
    """What one tensor-parallel vLLM worker serves of each checkpoint tensor, read from ``model``'s own
    parallel layers: ``[(checkpoint name, local tensor, full shape, offsets)]``, each local tensor a
    view of the worker's parameter (a row range of a fused ``qkv_proj``/``gate_up_proj`` for q, k, v,
    gate and up; of an expert's slot in ``w13_weight``/``w2_weight``), to be written in place.

    Column-parallel (and merged, QKV) layers and vocabulary-parallel embeddings cut dim 0 (QKV by
    heads, GQA's kv heads replicated where the TP size exceeds them), row-parallel layers dim 1
    (their bias whole); every other parameter (norms, a MoE block's router) is whole. A fused MoE
    layer serves, for each expert this worker holds, its gate and up rows ``tp_rank * I/tp`` (into
    its slot's rows ``0..I/tp`` and ``I/tp..2I/tp`` of ``w13_weight``) and its down columns (into
    ``w2_weight``), or with expert parallelism the whole expert; other ranks' experts are served as
    empty boxes (the round's names stay every worker's, and the plan sends none of their bytes here).
    ``packed``: a fused layer's checkpoint parts (default: the model's
    ``packed_modules_mapping``, else LLaMA's). ``expert_mapping``: the experts' checkpoint names, as
    vLLM's ``make_expert_params_mapping`` states them (``[(param_name, weight_name, expert_id,
    shard_id)]``, matched against full parameter names); default: the model's
    ``get_expert_mapping()``, else each MoE layer's own, else ``experts.{e}.<gate>/<up>/<down>.``
    with the layer's ``ckpt_*_proj_name`` (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's
    ``w1``, ``w3``, ``w2``). Raises :class:`UnmappedParameter` naming the parameter a layer cannot be
    mapped for (an unknown tensor-parallel layer, a quantized one, a shape the layer's attributes do
    not give, biased or padded experts, experts that EPLB moves).
    """
    packed = dict(packed or getattr(model, "packed_modules_mapping", None) or _PACKED)
    out, seen = [], {}
    experts = _ExpertNames(model, expert_mapping)

    def fail(pname, module, why):
        raise UnmappedParameter(f"parameter '{pname}' ({type(module).__name__}): {why}")

    def add(pname, module, name, local, shape, offsets):
        for d, (o, n) in enumerate(zip(offsets, local.shape)):
            if o < 0 or o + n > shape[d]:
                fail(pname, module, f"its slice of '{name}' ({list(offsets)} + {list(local.shape)}) lies outside "
                                    f"the checkpoint tensor's shape {list(shape)}")
        out.append((name, local, [int(d) for d in shape], [int(o) for o in offsets]))

    for prefix, module in model.named_modules():
        kind = _layer_kind(module)
        if kind == _MOE:
            _expert_slices(prefix, module, experts, seen, fail, add)
            continue
        for leaf, param in module.named_parameters(recurse=False):
            pname = _full_name(prefix, leaf)
            if param is None:
                continue
            if id(param) in seen:  # tied (lm_head = embed_tokens): one destination, under its first name
                continue
            seen[id(param)] = pname
            data = param.data
            if not data.is_contiguous():
                fail(pname, module, f"is not contiguous (strides {list(data.stride())}): ParamCast writes "
                                    "only contiguous memory in place")
            if kind == "unknown":
                fail(pname, module, "its layer is tensor-parallel (it has tp_rank/tp_size) but is none of vLLM's "
                                    "Column/MergedColumn/QKV/RowParallelLinear or VocabParallelEmbedding")
            method = getattr(module, "quant_method", None)
            if kind is not None and method is not None and type(method).__name__ not in (
                    "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
                fail(pname, module, f"its layer is quantized ({type(method).__name__}): its parameters do not "
                                    "hold the checkpoint's bytes")
            if kind == _REPLICATED and hasattr(module, "output_sizes"):
                fail(pname, module, "a merged replicated layer: its checkpoint parts are not named by the model")
            if kind is None or kind == _REPLICATED:  # norms and other whole parameters
                add(pname, module, pname, data, list(data.shape), [0] * data.dim())
                continue
            rank, tp = int(module.tp_rank), int(module.tp_size)
            if kind == _ROW:
                if leaf == "bias" or data.dim() == 1:  # added after the reduction: whole on every rank
                    add(pname, module, pname, data, list(data.shape), [0] * data.dim())
                    continue
                per = int(module.input_size_per_partition)
                if data.dim() != 2 or data.shape[1] != per:
                    fail(pname, module, f"shape {list(data.shape)}, expected [*, {per}] (input_size_per_partition)")
                add(pname, module, pname, data, [data.shape[0], int(module.input_size)], [0, rank * per])
            elif kind == _COLUMN:
                per = int(module.output_size_per_partition)
                if data.shape[0] != per:
                    fail(pname, module, f"shape {list(data.shape)}, expected [{per}, ...] (output_size_per_partition)")
                add(pname, module, pname, data, [int(module.output_size)] + list(data.shape[1:]),
                    [rank * per] + [0] * (data.dim() - 1))
            elif kind == _VOCAB:
                idx = getattr(module, "shard_indices", None)
                if idx is not None:
                    start, end = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
                    added = int(getattr(idx, "added_vocab_end_index", 0)) \
                        - int(getattr(idx, "added_vocab_start_index", 0))
                    if added:
                        fail(pname, module, f"it carries {added} added (LoRA) vocabulary rows, which no checkpoint "
                                            "tensor holds")
                else:
                    per = int(module.num_embeddings_per_partition)
                    start = min(rank * per, int(module.org_vocab_size))
                    end = min(start + per, int(module.org_vocab_size))
                vocab = int(getattr(module, "org_vocab_size", getattr(module, "num_embeddings", 0)))
                if data.shape[0] < end - start:
                    fail(pname, module, f"shape {list(data.shape)} holds fewer than its {end - start} vocabulary rows")
                add(pname, module, pname, data[:end - start], [vocab] + list(data.shape[1:]),
                    [start] + [0] * (data.dim() - 1))
            else:  # _QKV, _MERGED: each checkpoint part a row range of the fused parameter
                mod_prefix, _, last = prefix.rpartition(".")
                parts = packed.get(last)
                if parts is None:
                    fail(pname, module, f"a fused layer named '{last}', which the model's packed_modules_mapping "
                                        f"({sorted(packed)}) does not split into checkpoint tensors")
                if kind == _QKV:
                    hs = int(module.head_size)
                    vhs = int(getattr(module, "v_head_size", hs))
                    nq, nkv = int(module.num_heads), int(module.num_kv_heads)
                    reps = int(getattr(module, "num_kv_head_replicas", 1))
                    rows = [nq * hs, nkv * hs, nkv * vhs]
                    totals = [int(module.total_num_heads) * hs, int(module.total_num_kv_heads) * hs,
                              int(module.total_num_kv_heads) * vhs]
                    starts = [rank * rows[0], (rank // reps) * rows[1], (rank // reps) * rows[2]]
                else:
                    totals = [int(s) for s in module.output_sizes]
                    rows = [s // tp for s in totals]
                    starts = [rank * r for r in rows]
                if len(parts) != len(rows):
                    fail(pname, module, f"packed into {len(rows)} parts, but packed_modules_mapping names "
                                        f"{len(parts)} ({parts})")
                if data.shape[0] != sum(rows):
                    fail(pname, module, f"shape {list(data.shape)}, expected {sum(rows)} rows "
                                        f"({' + '.join(map(str, rows))})")
                at = 0
                for part, n, total, start in zip(parts, rows, totals, starts):
                    name = _full_name(_full_name(mod_prefix, part), leaf)
                    add(pname, module, name, data[at:at + n], [total] + list(data.shape[1:]),
                        [start] + [0] * (data.dim() - 1))
                    at += n
    return out


_PER_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.[^.]+\.$")  # "experts.<e>.<proj>." (not a fused tensor)


def _at(name, part):
    """Where ``part`` starts in ``name`` at a component boundary (-1: nowhere)."""
    return ("." + name).find("." + part)


class _ExpertNames:
    """The experts' checkpoint names: vLLM's expert params mapping ``[(param_name, weight_name,
    expert_id, shard_id)]`` (a loader turns checkpoint name ``n`` into parameter ``n.replace(weight_name,
    param_name)``; here the other way), from the caller, the model, or each MoE layer."""

    def __init__(self, model, given):
        self.model, self.given, self._model_mapping = model, given, None

    def _of_model(self):
        if self.given is not None:
            return list(self.given)
        if self._model_mapping is None:
            self._model_mapping = []
            get = getattr(self.model, "get_expert_mapping", None)
            if callable(get):
                try:
                    self._model_mapping = list(get() or [])
                except Exception:  # noqa: BLE001 - a model that cannot state it: each layer's own is used
                    self._model_mapping = []
        return self._model_mapping

    def entries(self, prefix, module, base, leaf, gated):
        """``[(checkpoint name, expert_id, shard_id)]`` for parameter ``leaf`` of the MoE layer at
        ``prefix`` (``base``: the layer's name in the checkpoint, ``prefix`` without vLLM 0.33's
        ``.routed_experts``)."""
        mapping, names = self._of_model(), [_full_name(prefix, leaf), _full_name(base, leaf)]
        if not mapping:  # the layer's own (vLLM 0.33: relative to its layer_name), or the usual names
            get = getattr(module, "get_expert_mapping", None)
            if callable(get):
                mapping = list(get() or [])
            else:
                gate = getattr(module, "ckpt_gate_proj_name", None) or "gate_proj"
                down = getattr(module, "ckpt_down_proj_name", None) or "down_proj"
                up = getattr(module, "ckpt_up_proj_name", "up_proj") if gated else None
                parts = [("w1", gate), ("w2", down)] + ([("w3", up)] if up else [])
                mapping = [("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{e}.{ckpt}.", e, shard)
                           for e in range(int(module.global_num_experts)) for shard, ckpt in parts]
            names = names[1:]
        for name in names:
            found = []
            for param_name, weight_name, expert_id, shard_id in mapping:
                i = _at(name, param_name)
                # Only one expert's own tensor: not a fused checkpoint tensor of all experts (one name,
                # a box per expert), nor a per-expert gate_up_proj (two boxes of one name).
                if i < 0 or not _PER_EXPERT.search(weight_name):
                    continue
                found.append((name[:i] + weight_name + name[i + len(param_name):], int(expert_id), str(shard_id)))
            if found:
                return found
        return []


def _expert_slices(prefix, module, experts, seen, fail, add):
    """The slices of every expert a fused MoE layer holds on this worker (see the layout above)."""
    params = [(leaf, p) for leaf, p in module.named_parameters(recurse=False) if p is not None]
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedFusedMoEMethod":
        leaf = params[0][0] if params else "w13_weight"
        fail(_full_name(prefix, leaf), module, f"its experts are quantized ({type(method).__name__}): its "
                                               "parameters do not hold the checkpoint's bytes")
    for leaf, p in params:
        if leaf in ("w13_weight", "w2_weight") or id(p) in seen:  # another layer's, already mapped there
            continue
        why = ("its experts carry biases, which ParamCast does not serve as slices" if leaf in ("w13_bias", "w2_bias")
               else "a parameter of a fused MoE layer other than its experts' w13_weight and w2_weight")
        fail(_full_name(prefix, leaf), module, why)
    w13_name = _full_name(prefix, "w13_weight")
    own = getattr(module, "_parameters", None) or {}
    w13, w2 = own.get("w13_weight"), own.get("w2_weight")
    if w13 is None or w2 is None:
        fail(w13_name, module, "a fused MoE layer without parameters w13_weight and w2_weight of its own")
    for leaf, p in (("w13_weight", w13), ("w2_weight", w2)):
        seen[id(p)] = _full_name(prefix, leaf)
        if not p.data.is_contiguous():
            fail(_full_name(prefix, leaf), module, f"is not contiguous (strides {list(p.data.stride())}): ParamCast "
                                                   "writes only contiguous memory in place")
    cfg = getattr(module, "moe_config", None)
    par = getattr(cfg, "moe_parallel_config", None) or getattr(module, "moe_parallel_config", None)
    src = par if par is not None else module
    if not (hasattr(src, "tp_rank") and hasattr(src, "tp_size")):
        fail(w13_name, module, "its layer states no tp_rank/tp_size (moe_config.moe_parallel_config)")
    rank, tp = int(src.tp_rank), int(src.tp_size)
    global_n, local_n = int(module.global_num_experts), int(module.local_num_experts)
    logical_n = int(getattr(cfg, "num_logical_experts", None) or global_n)
    if getattr(src, "enable_eplb", False) or global_n != logical_n:
        fail(w13_name, module, "expert-parallel load balancing (EPLB) replicates experts and moves them between "
                               "ranks at run time")
    gated = bool(getattr(cfg, "is_act_and_mul", True))
    parts = 2 if gated else 1
    w13, w2 = w13.data, w2.data
    per = int(getattr(module, "intermediate_size_per_partition", None) or w2.shape[-1])
    full = int(getattr(cfg, "intermediate_size", None) or per * tp)
    hidden = int(getattr(cfg, "hidden_dim_unpadded", None) or getattr(cfg, "hidden_dim", None)
                 or getattr(module, "hidden_size", None) or w13.shape[-1])
    if full != per * tp:
        fail(w13_name, module, f"its experts' intermediate size {full} is not {tp} x {per} "
                               "(intermediate_size_per_partition): padded experts are not served as slices")
    if list(w13.shape) != [local_n, parts * per, hidden] or list(w2.shape) != [local_n, hidden, per]:
        fail(w13_name, module, f"shapes {list(w13.shape)} and {list(w2.shape)} (w2_weight), expected "
                               f"[{local_n}, {parts * per}, {hidden}] and [{local_n}, {hidden}, {per}] "
                               "(local_num_experts, intermediate_size_per_partition, hidden size unpadded)")
    emap = getattr(module, "_expert_map", None)  # vLLM 0.33 (its expert_map may be ROCm's 0/1 mask)
    if emap is None:
        emap = getattr(module, "expert_map", None)
    if emap is None and local_n != global_n:
        fail(w13_name, module, f"it holds {local_n} of {global_n} experts but states no expert_map")
    emap = None if emap is None else [int(x) for x in emap.tolist()]
    base = prefix[:-len(".routed_experts")] if prefix.endswith(".routed_experts") else prefix
    filled = {}
    for leaf, param, shards in (("w13_weight", w13, ("w1", "w3")[:parts]), ("w2_weight", w2, ("w2",))):
        pname = _full_name(prefix, leaf)
        found = experts.entries(prefix, module, base, leaf, gated)
        counts = {}
        for name, _, _ in found:
            counts[name] = counts.get(name, 0) + 1
        for name, expert, shard in found:
            if counts[name] > 1 or not 0 <= expert < global_n:  # one name, two boxes; no such expert here
                continue
            if shard not in shards:
                fail(pname, module, f"the expert mapping puts '{name}' (shard {shard!r}) into {leaf}")
            local = expert if emap is None else (emap[expert] if expert < len(emap) else -1)
            full_shape = [hidden, full] if shard == "w2" else [full, hidden]
            if local < 0:  # another expert-parallel rank's: served as an empty box, so no byte of it comes here
                add(pname, module, name, param.new_empty((0, full_shape[1])), full_shape, [0, 0])
                continue
            if local >= local_n or (leaf, local, shard) in filled:
                fail(pname, module, f"expert {expert} ('{name}') maps to local slot {local}, which "
                                    + ("another checkpoint tensor fills too" if local < local_n
                                       else f"this worker's {local_n} local experts do not have"))
            filled[(leaf, local, shard)] = name
            if shard == "w2":  # down_proj [hidden, I]: columns tp_rank * I/tp
                add(pname, module, name, param[local], full_shape, [0, rank * per])
            else:  # gate ("w1") then up ("w3") [I, hidden]: rows tp_rank * I/tp
                at = 0 if shard == "w1" else per
                add(pname, module, name, param[local, at:at + per], full_shape, [rank * per, 0])
        for local in range(local_n):
            for shard in shards:
                if (leaf, local, shard) not in filled:
                    fail(pname, module, f"the expert mapping names no checkpoint tensor for local expert slot "
                                        f"{local} (shard {shard!r}): a model whose checkpoint names its experts "
                                        "otherwise needs tp_destinations(expert_mapping=...)")


def slice_refusal(dests, rules):
    """Why a worker serving the slices ``dests`` (:func:`tp_destinations`) cannot receive the rounds that
    ``rules`` (the trainer's transforms) send, naming the first tensor; None where it can.

    Slices are written in place into parameters that hold the checkpoint's bytes as they are: a tensor
    the rules send as FP8 (its scales blocks of the whole tensor) or cast to a dtype the parameter does
    not hold cannot be. FP8 goes whole through ``load_weights`` instead, whose FP8 loaders cut each
    shard's rows and scale blocks.
    """
    torch = paramcast._tensors._torch_module()
    for name, local, _, _ in dests:
        hit = _rule_for(rules, name)
        if hit is None or hit[1].get("keep"):
            continue
        i, rule = hit
        rule_text = _describe_rule("init_info.transforms", i, rule)
        if rule.get("fp8"):
            return (f"cannot receive '{name}' as a slice: {rule_text} sends it as FP8 (F8_E4M3) with "
                    f"'{name}_scale_inv', and a worker that serves slices writes the checkpoint's bytes in place "
                    f"into its parameters as they are ({local.dtype}); FP8 weights and their scales go whole "
                    "through load_weights, whose FP8 loaders cut each shard's rows and scale blocks")
        cast = _CASTS.get(rule.get("cast"))
        if cast is not None and torch is not None and local.dtype != getattr(torch, cast):
            return (f"cannot receive '{name}' as a slice: {rule_text} sends it as {cast}, and the parameter it "
                    f"is written into in place holds {local.dtype}")
    return None
