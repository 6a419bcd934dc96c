"""The slices a tensor-parallel vLLM worker serves, read from its model's parallel layers.

Part of ``paramcast.integrations.vllm`` (which re-exports every name here; import them from there).

Tensor-parallel workers receive only their slices. A worker whose model has
vLLM's parallel layers (Column/MergedColumn/QKV/RowParallelLinear,
VocabParallelEmbedding, recognized by class name or by the attributes they
carry) registers, per checkpoint tensor, the slice it serves
(:func:`tp_destinations`: q, k and v as row ranges of ``qkv_proj``, gate and
up of ``gate_up_proj``, row-parallel weights along dim 1, norms and
row-parallel biases whole), written in place; the trainer sends whole tensors
under their Hugging Face names with one ``weight_update`` and ParamCast's plan
sends each worker only its slices, point to point. ``init_info.slices``
("auto", "on", "off") and ``whole_fallback`` choose; a parameter whose slice
cannot be stated fails ``init_transfer_engine`` naming it.

Slices do not take FP8 (:func:`slice_refusal`): a worker that serves slices
refuses, at ``init_transfer_engine``, a tensor the rules send as FP8 (or cast
to a dtype its parameter does not hold), naming it; an FP8 vLLM model
(quantized layers) is refused there too. Such workers take ``slices: "off"``
(FP8 goes whole through ``load_weights``, whose loaders cut each shard's
weight rows and scale blocks, and vLLM's layerwise reload processes them
after loading).
"""

from __future__ import annotations

import paramcast

from .vllm_base import _CASTS, _describe_rule, _rule_for

# vLLM's parallel layers, by class name (the layer classes import CUDA-bound parts of vLLM, so they are
# recognized by name, and then by the attributes they carry, never imported).
_QKV, _MERGED, _COLUMN, _ROW, _VOCAB, _REPLICATED = "qkv", "merged", "column", "row", "vocab", "replicated"
_KIND_BY_CLASS = {"QKVParallelLinear": _QKV, "MergedColumnParallelLinear": _MERGED,
                  "ColumnParallelLinear": _COLUMN, "RowParallelLinear": _ROW,
                  "VocabParallelEmbedding": _VOCAB, "ReplicatedLinear": _REPLICATED}
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


def tp_destinations(model, packed=None):
    """What one tensor-parallel vLLM worker serves of each checkpoint tensor, read from ``model``'s own
    parallel layers: ``[(checkpoint name, local tensor, full shape, offsets)]``, each local tensor a
    view of the worker's parameter (a row range of a fused ``qkv_proj``/``gate_up_proj`` for q, k, v,
    gate and up), to be written in place.

    Column-parallel (and merged, QKV) layers and vocabulary-parallel embeddings cut dim 0 (QKV by
    heads, GQA's kv heads replicated where the TP size exceeds them), row-parallel layers dim 1
    (their bias whole); every other parameter (norms) is whole. ``packed``: a fused layer's
    checkpoint parts (default: the model's ``packed_modules_mapping``, else LLaMA's). Raises
    :class:`UnmappedParameter` naming the parameter a layer cannot be mapped for (an unknown
    tensor-parallel layer, a quantized one, a shape the layer's attributes do not give).
    """
    packed = dict(packed or getattr(model, "packed_modules_mapping", None) or _PACKED)
    out, seen = [], {}

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
