"""ParamCast as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "paramcast"}'``.

The contract is vLLM's pluggable weight-transfer API as of vLLM 0.33.0
(``vllm/distributed/weight_transfer/base.py``; docs/python.md says how it
was read). Each vLLM worker (every TP, PP and DP rank) is one ParamCast
subscriber; the trainer is the ParamCast publisher. One round:

    trainer                                 each vLLM worker (ParamCastWeightTransferEngine)
    client.start_weight_update()       ->   start_weight_update(): loads accepted from here on
    with pub.stream(manifest) as u:         (ParamCast checks the plan against nothing: the
      client.update_weights({version})  ->   model's load_weights does the mapping)
      u.send(name, tensor) ...         ->   each tensor, as it lands, goes to model.load_weights
                                            update_weights(): returns once this version is complete
    client.finish_weight_update()      ->   finish_weight_update()

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

Engine side, ``init_info`` (``ParamCastInitInfo``): ``endpoint`` (the
trainer's publisher), ``config`` (the subscribers' ParamCast config as a
dict with the YAML's keys; ``control.endpoint`` comes from ``endpoint``), and
``worker_id_prefix``; ``slices`` and ``whole_fallback`` (above);
``transforms`` (the trainer's rules, below). ``update_info``
(``ParamCastUpdateInfo``): ``version`` (the round takes the first version
applied at or above it), and optionally ``names`` (the checkpoint names the round
carries; a name that did not arrive fails the call).

Trainer side: ``ParamCastTrainerWeightTransferEngine.trainer_init(init_info,
client=..., source=...)`` then ``send_weights()`` per round (vLLM >= 0.28),
or ``ParamCastWeightTransferEngine.trainer_send_weights(iterator, args)``
(the static form of vLLM 0.20-0.27).

Several trainer ranks (``ParamCastTrainerInitInfo.ranks`` = M > 1; pipeline stages, FSDP or DTensor
owners): every rank 0..M-1 calls ``trainer_init`` and ``send_weights``, and each sends only the
parameters vLLM's ``ParamMeta.owners`` gives it (None: every rank), as yielded by the source's
``iter_full()``, through ParamCast's many senders (rank 0 ``Publisher.weight_update_sharded``, the
others a ``PublisherRank``; a tensor several ranks own is a replica, each byte sent by one of them).
Rank 0 hands its endpoint out and each round's checks are agreed over torch.distributed
(``init_info.group``, default: the default group), so every rank refuses alike, before any byte moves
and before the workers' round starts: a name owned by no rank of the job, a name declared twice, a
metadata that differs between ranks (e.g. another shape on rank 1), or a tensor that is not what the
metadata declares, each named. The workers are unchanged. Transforms (FP8) need ``ranks`` = 1. With
``ranks`` = 1, rank 0 sends everything as before, and a metadata giving a name only to other ranks is
refused naming it.

FP8 (docs/transforms.md): ``ParamCastTrainerInitInfo.transforms`` (rules as
``publisher.transforms`` takes them, e.g. ``[{"match": "*proj.weight", "fp8":
"block"}]``; None: the publisher config's) applies to every round
``send_weights`` sends. They are init info, not a ``send_weights`` argument,
because vLLM's contract puts a full-resync backend's wire parameters in its
``TrainerInitInfo``, which the sender passes on to the workers at the
handshake: the workers get them as ``init_info.transforms``. The static form
takes them per call (``ParamCastTrainerSendWeightsArgs.transforms``). On the
whole-tensor path, an FP8 tensor reaches ``model.load_weights`` as a
``torch.float8_e4m3fn`` tensor under its checkpoint name and its scales as
float32 ``<name>_scale_inv`` (for ``fp8: block``, ``[ceil(rows/128),
ceil(cols/128)]``: what vLLM's block-FP8 layers load, DeepSeek-V3's names),
bit for bit the publisher's quantization; ``update_info.names`` lists the
scales too, so a round whose scales did not arrive fails. Slices do not take
FP8: a worker that serves slices refuses, at ``init_transfer_engine``, a
tensor the rules send as FP8 (or cast to a dtype its parameter does not
hold), naming it; an FP8 vLLM model (quantized layers) is refused there too.
Such workers take ``slices: "off"`` (FP8 goes whole through ``load_weights``,
whose loaders cut each shard's weight rows and scale blocks, and vLLM's
layerwise reload processes them after loading).

Registered as ``"paramcast"`` with vLLM's factories by :func:`register`,
which vLLM calls in every worker through the ``vllm.general_plugins`` entry
point this package declares (``VLLM_PLUGINS``, where set, must name
``paramcast``), and which importing this module calls too where vLLM is
installed: a trainer loads no vLLM plugins, and
``WeightTransferTrainerFactory.trainer_init`` finds ``"paramcast"`` once this
module is imported. Importing it needs neither vLLM nor a GPU; without vLLM
the classes derive from ``object`` and follow the same contract.

Timeouts: a worker gives up on a round after ``update_info.timeout_s``
(``DEFAULT_TIMEOUT_S``, 270 s), before vLLM's HTTP client does (300 s), so
the trainer hears the worker's reason rather than a bare read timeout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import paramcast

_log = logging.getLogger(__name__)

BACKEND = "paramcast"
# How long a worker waits for a round (and ParamCast's data thread for vLLM's thread) by default: under
# the 300 s after which vLLM's HTTPVLLMWeightSyncClient gives up, so that the worker's error, which names
# what it was waiting for, reaches the trainer first.
DEFAULT_TIMEOUT_S = 270.0

try:  # vLLM >= 0.25
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _EngineBase
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo as _InitInfoBase
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo as _UpdateInfoBase
    HAVE_VLLM = True
except ImportError:  # no vLLM here: the same contract, without its base classes
    _EngineBase = object
    HAVE_VLLM = False

    @dataclass
    class _InitInfoBase:
        pass

    @dataclass
    class _UpdateInfoBase:
        pass

try:  # vLLM >= 0.28
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _TrainerInitInfoBase
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine as _TrainerBase
except ImportError:
    _TrainerBase = object

    @dataclass
    class _TrainerInitInfoBase:
        rank: int = field(default=0, kw_only=True)

        @property
        def is_sender(self):
            return self.rank == 0


@dataclass
class ParamCastInitInfo(_InitInfoBase):
    """What each vLLM worker needs to join the trainer's ParamCast group."""

    endpoint: str
    config: Any = None  # dict with the YAML's keys: the subscribers' ParamCast config
    worker_id_prefix: str = "vllm"
    # Copies of received tensors waiting for vLLM's thread to load them, at most (one is always let in).
    queue_bytes: int = 1 << 30
    # How long ParamCast's data thread waits for vLLM's thread (update_weights) to take a tensor, and
    # for the round's loads to finish, before it fails the update naming this worker.
    receive_timeout_s: float = DEFAULT_TIMEOUT_S
    # "auto": a worker whose model has vLLM's tensor-parallel layers registers only the slices it serves
    # (tp_destinations), written in place: no full tensor reaches it; a model without such layers gets
    # whole tensors through load_weights. "on": slices, or an error. "off": whole tensors, load_weights.
    slices: str = "auto"
    # With slices, a parameter whose slice cannot be stated (a quantized or unknown parallel layer) fails
    # init_transfer_engine naming it; True: that worker gets whole tensors through load_weights instead
    # (a log line names the parameter).
    whole_fallback: bool = False
    # The rules the trainer's rounds apply (publisher.transforms, from ParamCastTrainerInitInfo): a worker
    # that serves slices refuses at init a tensor they send in a dtype its parameter does not hold (FP8).
    transforms: Any = None

    def __post_init__(self):
        _check_rules(self.transforms, "paramcast init_info.transforms")
        if self.slices not in ("auto", "on", "off"):
            raise ValueError(f"paramcast init_info.slices: expected 'auto', 'on' or 'off', got {self.slices!r}")
        if not isinstance(self.whole_fallback, bool):
            raise ValueError(f"paramcast init_info.whole_fallback: expected true or false, got {self.whole_fallback!r}")
        for key in ("queue_bytes", "receive_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"paramcast init_info.{key}: expected a positive number, got {value!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"paramcast init_info.endpoint: expected the publisher's tcp:// endpoint, "
                             f"got {self.endpoint!r}")
        if "://0.0.0.0:" in self.endpoint or "://*:" in self.endpoint:
            raise ValueError(f"paramcast init_info.endpoint {self.endpoint!r} is the publisher's wildcard bind, "
                             "which no worker can connect to: give the trainer host's address")


@dataclass
class ParamCastUpdateInfo(_UpdateInfoBase):
    """One round: the ParamCast version the trainer is sending, and optionally the names it carries."""

    version: int
    names: list = field(default_factory=list)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"paramcast update_info.version: expected a version >= 1, got {self.version!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"paramcast update_info.timeout_s: expected a positive number of seconds, "
                             f"got {self.timeout_s!r}")


_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _check_rules(rules, what):
    """``rules`` is None or a list of transform rules ({"match": glob, ...}); ParamCast checks the rest."""
    if rules is None:
        return
    if not isinstance(rules, (list, tuple)):
        raise ValueError(f"{what}: expected a list of rules like {{'match': '*proj.weight', 'fp8': 'block'}}, "
                         f"got {type(rules).__name__}")
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
            raise ValueError(f"{what}[{i}]: expected a rule with a 'match' glob, e.g. "
                             f"{{'match': '*proj.weight', 'fp8': 'block'}}, got {rule!r}")


def _rule_for(rules, name):
    """(index, rule) of the first rule matching ``name``, or None (it travels as it is): ParamCast's own
    matching (docs/transforms.md), which also checks every rule."""
    if not rules:
        return None
    i = paramcast._core.transform_rule_index(list(rules), name)
    return None if i is None else (i, rules[i])


def _describe_rule(what, i, rule):
    kind = ", ".join(f"{k}: {v}" for k, v in rule.items() if k != "match")
    return f"{what}[{i}] (match {rule['match']!r}, {kind})"


def wire_names(names, rules):
    """The names a round carries for the trainer's ``names`` under ``rules``: each FP8 tensor is followed
    by its ``<name>_scale_inv``."""
    out = []
    for name in names:
        out.append(name)
        hit = _rule_for(rules, name)
        if hit is not None and hit[1].get("fp8"):
            out.append(name + "_scale_inv")
    return out


def worker_id_for(prefix, parallel_config):
    """The ParamCast worker id of one vLLM worker: ``<prefix>-dp<D>-r<R>`` (unique across TP, PP and DP)."""
    dp = getattr(parallel_config, "data_parallel_index", None)
    if dp is None:
        dp = getattr(parallel_config, "data_parallel_rank", 0)
    return f"{prefix}-dp{dp}-r{parallel_config.rank}"


def _layerwise(name):
    """vLLM's layerwise reload hooks (checkpoint-format loading), where vLLM is installed."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        return None
    return getattr(reload, name, None)


def _no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


# ---- the slices a tensor-parallel worker serves, read from its model's parallel layers ------------
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


class _End:
    """Queued by on_update_end after the last tensor of a version: vLLM's thread answers through ``done``."""

    def __init__(self, version, error):
        self.version, self.error = version, error
        self.done = threading.Event()
        self.load_error = None


class ParamCastWeightTransferEngine(_EngineBase):
    """The vLLM worker's side: a ParamCast subscriber whose tensors vLLM's own thread loads.

    ParamCast's data thread copies each tensor as it lands (its buffer is reused at once, and vLLM's
    loaders may keep what they are given until finish_weight_update) into a queue bounded by
    ``queue_bytes``; ``update_weights``, on vLLM's worker thread (its config context, its CUDA
    stream), drains the queue into ``model.load_weights``. The update is Applied on the publisher
    only once vLLM's thread has loaded its last tensor: a ``load_weights`` error fails the
    trainer's update, naming this worker.
    """

    init_info_cls = ParamCastInitInfo
    update_info_cls = ParamCastUpdateInfo
    supports_draft_weight_update = True
    defers_processing = False

    def __init__(self, config, vllm_config, device, model):
        if HAVE_VLLM:
            super().__init__(config, vllm_config, device, model)
        else:  # what vLLM's base class sets
            self.config = config
            self.vllm_config = vllm_config
            self.parallel_config = vllm_config.parallel_config
            self.model_config = getattr(vllm_config, "model_config", None)
            self.device = device
            self.model = model
            self._default_model = model
            self._default_model_config = self.model_config
        self._sub = None
        self._init = None
        self._cv = threading.Condition()
        self._queue = collections.deque()  # (name, tensor) or _End, oldest first
        self._queued_bytes = 0
        self._active = False
        self._closed = False
        self._reload_open = False  # vLLM's layerwise reload begun by start_weight_update, not yet finalized
        self._sliced = None  # with slices registered: the checkpoint names this worker serves
        self._staged = []  # (host buffer registered, the parameter's view it is copied into): off-device slices
        self._refused_outside = None  # the version on_update_begin refused outside a round
        self.worker_id = worker_id_for("vllm", self.parallel_config)

    # ---- vLLM's base-class behaviour, for when vLLM is not installed -------------------------
    if not HAVE_VLLM:
        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))
            torch = paramcast._tensors._torch_module()
            if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize") \
                    and getattr(self.device, "type", "cpu") != "cpu":
                torch.accelerator.synchronize()

        def set_weight_update_target(self, model, model_config):
            self.model = model
            self.model_config = model_config

        def reset_weight_update_target(self):
            self.model = self._default_model
            self.model_config = self._default_model_config

        def drain_pending(self):
            pass

    # ---- the contract ------------------------------------------------------------------------
    def init_transfer_engine(self, init_info):
        """Joins the trainer's ParamCast group as this worker's subscriber.

        Called at the start of training, and again after ``shutdown`` (vLLM's
        ``shutdown_weight_transfer_engine``) for a new trainer connection, any number of times. Called
        while joined, it leaves the old group first (a restarted trainer re-initializing).
        """
        with self._cv:
            if self._active:
                raise RuntimeError(f"paramcast: {self.worker_id}: init_transfer_engine during a weight update "
                                   "(finish it first)")
        if self._sub is not None:
            self.shutdown()
        cfg = {} if init_info.config is None else init_info.config
        if not isinstance(cfg, dict):  # init_info travels as JSON (vLLM's RPC and HTTP routes)
            raise ValueError(f"paramcast init_info.config: expected a dict with the config's YAML keys, "
                             f"got {type(cfg).__name__}")
        cfg = dict(cfg)
        cfg["control"] = {**cfg.get("control", {}), "endpoint": init_info.endpoint}
        backend = cfg.get("data_plane", {}).get("backend", "gloo")
        if getattr(self.device, "type", "cpu") == "cuda" and backend in ("nccl", "shm"):
            # Received straight into the worker's GPU; over gloo the bytes land in host memory and
            # load_weights copies them to the GPU.
            cfg["subscriber"] = {**cfg.get("subscriber", {}),
                                 "device": f"cuda:{self.device.index if self.device.index is not None else 0}"}
        self.worker_id = worker_id_for(init_info.worker_id_prefix, self.parallel_config)
        self._init = init_info
        with self._cv:  # a new connection: nothing of the previous one is left behind
            self._closed = False
            self._release_queue_locked("the transfer engine was re-initialized")
        sub = paramcast.Subscriber(cfg, self.worker_id)
        try:
            self._sliced, self._staged = None, []
            dests = self._destinations(init_info)
            if dests is None:
                sub.on_weights(self._on_weights)
            else:
                self._register_slices(sub, dests, cfg.get("subscriber", {}).get("device", "cpu"))
                sub.on_update_begin(self._on_update_begin)
            sub.on_update_end(self._on_update_end)
            sub.start()
        except BaseException:
            sub.stop()
            raise
        self._sub = sub

    def _destinations(self, init_info):
        """The slices this worker registers ([(name, view, full shape, offsets)]), or None: whole
        tensors through load_weights."""
        if init_info.slices == "off":
            return None
        if not any(_layer_kind(m) not in (None, _REPLICATED) for m in self.model.modules()):
            if init_info.slices == "on":
                raise ValueError(f"paramcast: {self.worker_id}: init_info.slices is 'on' but the model "
                                 f"({type(self.model).__name__}) has none of vLLM's tensor-parallel layers")
            _log.info("%s: the model (%s) has no vLLM tensor-parallel layers: whole tensors through load_weights",
                      self.worker_id, type(self.model).__name__)
            return None
        try:
            dests = tp_destinations(self.model)
            why = slice_refusal(dests, init_info.transforms)
        except UnmappedParameter as e:
            why = f"cannot state the slice this tensor-parallel worker serves of {e}"
        if why is None:
            return dests
        if not init_info.whole_fallback:
            raise UnmappedParameter(f"paramcast: {self.worker_id}: {why} (set init_info slices='off' or "
                                    "whole_fallback=true to receive whole tensors through load_weights instead)")
        _log.warning("%s: whole tensors through load_weights (init_info.whole_fallback), since it %s",
                     self.worker_id, why)
        return None

    def _register_slices(self, sub, dests, device):
        # Each slice straight into the parameter's view where it lives on the subscriber's device;
        # elsewhere (a GPU worker on the gloo data plane) into a host buffer of the slice's size, copied
        # into the parameter on vLLM's thread once the version is in (receive_weights).
        from paramcast.reshard import Shard
        torch = paramcast._tensors._torch_module()
        want = torch.device(device)
        named = []
        for name, view, shape, offsets in dests:
            target = view
            if view.device.type != want.type or (want.index is not None and view.device.index != want.index):
                target = torch.empty(view.shape, dtype=view.dtype, device=want,
                                     pin_memory=want.type == "cpu" and torch.cuda.is_available())
                target.copy_(view)
                self._staged.append((target, view))
            named.append((name, Shard(target, shape, offsets)))
        sub.register(named)
        self._sliced = [n for n, _ in named]
        whole = sum(1 for _, v, shape, _ in dests if list(v.shape) == list(shape))
        _log.info("%s: registered %d tensors: %d slices written in place, %d whole", self.worker_id, len(named),
                  len(named) - whole, whole)

    def start_weight_update(self):
        """Opens a round: tensors that arrive from now until finish_weight_update are loaded."""
        self._require_init("start_weight_update")
        init = _layerwise("initialize_layerwise_reload") if self._sliced is None else None
        if init is not None:
            init(self.model)
            self._reload_open = True
        # Failures of updates before this round (one refused outside a round) are not this round's: the
        # trainer may not know the version it sends to sliced workers before it submits it.
        while self._sub._core.next_report(0.0) is not None:
            pass
        with self._cv:
            self._active = True

    def receive_weights(self, update_info):
        """On vLLM's thread: loads every tensor of version ``update_info.version`` as it arrives.

        Returns once that version is applied here. Raises RuntimeError with ParamCast's error, the
        ``load_weights`` exception, or after ``update_info.timeout_s``; ValueError naming any of
        ``update_info.names`` that did not arrive. vLLM's worker ends the round when this raises
        (``finish_weight_update`` is not called), so before raising it ends the round here: the
        layerwise reload ``start_weight_update`` began is finalized (layers that received nothing get
        their previous weights back) and queued tensors are dropped; the next round starts clean.
        """
        self._require_init("receive_weights")
        if not self._active:
            raise RuntimeError(f"{self.worker_id}: receive_weights outside start/finish_weight_update")
        deadline = time.monotonic() + update_info.timeout_s
        received, load_error = set(), None
        try:
            if self._sliced is not None and update_info.names:
                # The plan refuses these before any byte moves, and then no end of the update comes here.
                listed = set(update_info.names)
                extra = [n for n in update_info.names if n not in set(self._sliced)]
                unsent = [n for n in self._sliced if n not in listed]
                if extra or unsent:
                    def show(ns):
                        return ", ".join(repr(n) for n in ns[:4]) + (f", +{len(ns) - 4} more" if len(ns) > 4 else "")
                    raise ValueError(f"{self.worker_id}: update v{update_info.version} "
                                     + "; ".join(w for w in (f"carries {show(extra)}, which this worker does not serve"
                                                             if extra else "",
                                                             f"does not carry {show(unsent)}, which it serves"
                                                             if unsent else "") if w))
            while True:
                item = self._take(deadline, update_info.version)
                if isinstance(item, _End):
                    item.load_error = load_error
                    if not item.error and load_error is None and self._staged:
                        try:  # before the data thread is released: the buffers hold this version's bytes
                            for buf, view in self._staged:
                                view.copy_(buf)
                        except Exception as e:  # noqa: BLE001 - reported to the publisher and raised below
                            load_error = item.load_error = f"copying received slices into the model: " \
                                                           f"{type(e).__name__}: {e}"
                    item.done.set()  # the data thread reports Applied (or the failure) now
                    if item.version < update_info.version:
                        received, load_error = set(), None  # an older update's end: not this round's
                        continue
                    if item.error:
                        raise RuntimeError(f"paramcast: {self.worker_id}: update v{item.version} failed here: "
                                           f"{item.error}")
                    if self._sliced is not None:
                        received.update(self._sliced)
                    break
                name, tensor = item
                if load_error is None:
                    try:
                        with _no_mtp_check():
                            self.model.load_weights([(name, tensor)])
                    except Exception as e:  # noqa: BLE001 - reported to the publisher and raised below
                        load_error = f"{type(e).__name__}: {e}"
                received.add(name)
            if load_error is not None:
                raise RuntimeError(f"{self.worker_id}: load_weights failed: {load_error}")
            self._wait_applied(update_info.version, max(1.0, deadline - time.monotonic()))
            missing = [n for n in update_info.names if n not in received]
            if missing:
                shown = ", ".join(repr(n) for n in missing[:4]) + \
                    (f", +{len(missing) - 4} more" if len(missing) > 4 else "")
                raise ValueError(f"{self.worker_id}: update v{update_info.version} did not carry {shown}")
        except BaseException as e:
            self._end_round(failed=e)
            raise

    def finish_weight_update(self):
        """Closes the round (vLLM's layerwise reload finalizes here, where installed)."""
        self._require_init("finish_weight_update")
        self._end_round()

    def shutdown(self):
        """Leaves the ParamCast group; the worker and its model stay. Safe to call more than once;
        ``init_transfer_engine`` joins again afterwards."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.stop()
        with self._cv:
            self._release_queue_locked("the transfer engine was shut down")

    # ---- internals ---------------------------------------------------------------------------
    def _end_round(self, failed=None):
        """Closes the round: no more loads, queued tensors dropped, vLLM's layerwise reload finalized."""
        with self._cv:
            self._active = False
            if failed is not None:
                self._release_queue_locked(f"receive_weights failed: {type(failed).__name__}")
            self._cv.notify_all()
        if not self._reload_open:
            return
        self._reload_open = False
        finalize = _layerwise("finalize_layerwise_reload")
        if finalize is None:
            return
        try:
            finalize(self.model, self.model_config)
        except Exception as e:
            if failed is None:
                raise
            raise RuntimeError(f"paramcast: {self.worker_id}: the round failed ({failed}), and closing vLLM's "
                               f"layerwise reload then failed too: {type(e).__name__}: {e}") from failed

    def _release_queue_locked(self, why):
        # Tensors nobody will load; an end marker's waiting data thread is told why (under self._cv).
        for item in self._queue:
            if isinstance(item, _End) and not item.done.is_set():
                item.load_error = why
                item.done.set()
        self._queue.clear()
        self._queued_bytes = 0
        self._cv.notify_all()

    def _require_init(self, what):
        if self._sub is None:
            if self._closed:
                raise RuntimeError(f"paramcast: {self.worker_id}: {what} after shutdown_weight_transfer_engine "
                                   "(call init_weight_transfer_engine again first)")
            raise RuntimeError(f"paramcast: {what} before init_transfer_engine")

    def _wait_applied(self, version, timeout):
        # Subscriber.wait_for_version(version, timeout, raise_on_failure=True), but a failure of the
        # update refused outside a round (whose report may come late) is not this round's.
        deadline = time.monotonic() + timeout
        while True:
            state = self._sub._core.state()
            if state[0] == "consistent" and state[1] >= version:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"paramcast: {self.worker_id}: version {version} not applied within {timeout}s "
                                   f"(state: {state[3]})")
            self._raise_if_failed(version, min(0.05, left))

    def _raise_if_failed(self, version, wait=0.0):
        # A failure ParamCast reported here for `version` or a later one (not the one refused outside a round).
        report = self._sub._core.next_report(wait)
        if report is not None and report[1] and report[0] >= version and report[0] != self._refused_outside:
            raise RuntimeError(f"paramcast: {self.worker_id}: update v{report[0]} failed here: {report[1]}")

    def _take(self, deadline, version):
        with self._cv:
            while not self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"paramcast: {self.worker_id}: update v{version} not complete within "
                                       f"timeout_s (state: {self._sub.state_detail})")
                if self._closed:
                    raise RuntimeError(f"paramcast: {self.worker_id}: shut down while receiving v{version}")
                self._raise_if_failed(version)  # e.g. a plan refused before any byte moved: no end comes
                self._cv.wait(min(left, 0.05))
            item = self._queue.popleft()
            if not isinstance(item, _End):
                self._queued_bytes -= item[1].element_size() * item[1].nelement()
            self._cv.notify_all()
            return item

    def _put(self, item, nbytes):
        deadline = time.monotonic() + self._init.receive_timeout_s
        with self._cv:
            while self._queue and self._queued_bytes + nbytes > self._init.queue_bytes:
                left = deadline - time.monotonic()
                if not self._active or self._closed or left <= 0:
                    raise RuntimeError(f"{self.worker_id}: vLLM's thread took no tensor within receive_timeout_s "
                                       f"({self._init.receive_timeout_s} s): was update_weights called?")
                self._cv.wait(min(left, 0.05))
            self._queue.append(item)
            self._queued_bytes += nbytes
            self._cv.notify_all()

    def _on_weights(self, weights):
        # ParamCast's data thread. The views are valid only during this call: each is copied.
        with self._cv:
            active = self._active
        if not active:
            raise RuntimeError(f"{self.worker_id}: weights arrived outside start/finish_weight_update "
                               "(the trainer must call start_weight_update on every worker first)")
        for name, tensor in weights:
            self._put((name, tensor.clone()), tensor.element_size() * tensor.nelement())

    def _on_update_begin(self, version):
        # ParamCast's data thread, before a version's bytes are written into the model's parameters.
        with self._cv:
            if self._active:
                return
            self._refused_outside = version  # its end, whenever it comes, ends no round
        raise RuntimeError(f"{self.worker_id}: weights arrived outside start/finish_weight_update "
                           "(the trainer must call start_weight_update on every worker first)")

    def _on_update_end(self, version, error):
        # ParamCast's data thread, after the last tensor: Applied leaves once vLLM's thread loaded them all.
        with self._cv:
            if error is not None and version == self._refused_outside:
                return None
            if not self._active:
                if error is None:
                    raise RuntimeError(f"{self.worker_id}: update v{version} ended outside a weight update round")
                return None
            end = _End(version, error)
            if error is not None:
                end.done.set()  # a failed update: vLLM's thread raises it; nothing to wait for here
            self._queue.append(end)
            self._cv.notify_all()
        if error is not None:
            return None
        if not end.done.wait(self._init.receive_timeout_s):
            with self._cv:
                if end in self._queue:
                    self._queue.remove(end)
            raise RuntimeError(f"{self.worker_id}: update v{version} was not loaded within receive_timeout_s "
                               f"({self._init.receive_timeout_s} s): was update_weights called?")
        if end.load_error is not None:
            raise RuntimeError(f"{self.worker_id}: load_weights failed: {end.load_error}")
        return None

    # ---- trainer side, static form (vLLM 0.20-0.27) ------------------------------------------
    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        """Sends ``(name, tensor)`` pairs from ``iterator`` as one ParamCast update.

        ``trainer_args``: a :class:`ParamCastTrainerSendWeightsArgs` (or a dict of its fields). With a
        ``manifest`` the update is streamed (each tensor may be freed once the next one is asked for);
        without one the iterator is gathered first. ``transforms``: the update's rules (FP8: the engines
        receive ``<name>`` in float8 e4m3fn and ``<name>_scale_inv``); None: the publisher config's.
        """
        args = trainer_args if isinstance(trainer_args, ParamCastTrainerSendWeightsArgs) \
            else ParamCastTrainerSendWeightsArgs(**trainer_args)
        _check_rules(args.transforms, "paramcast trainer_args.transforms")
        if args.manifest is None:
            return args.publisher.weight_update(list(iterator), version=args.version, transforms=args.transforms)
        with args.publisher.stream(args.manifest, version=args.version, transforms=args.transforms) as update:
            for name, tensor in iterator:
                update.send(name, tensor)
        return update.result


@dataclass
class ParamCastTrainerSendWeightsArgs:
    publisher: Any  # a started paramcast.Publisher
    manifest: Any = None  # (name, dtype, shape) triples or a module: streams the update
    version: Any = None
    transforms: Any = None  # the update's transform rules (docs/transforms.md); None: the publisher config's


# ---- trainer side (vLLM >= 0.28) ----------------------------------------------------------------
@dataclass
class ParamCastTrainerInitInfo(_TrainerInitInfoBase):
    """The trainer's ParamCast config (publisher and data plane) and the engines' config."""

    backend: ClassVar[str] = BACKEND
    config: Any = None  # dict or YAML path: the publisher's config (publisher.subscribers = the vLLM workers)
    engine_config: Any = None  # dict: the subscribers' config sent to every vLLM worker
    worker_id_prefix: str = "vllm"
    # The endpoint the workers connect to, when the publisher binds a wildcard (tcp://0.0.0.0:PORT or
    # tcp://*:PORT): tcp://<this host's address>:PORT. Default: the publisher's bound endpoint.
    advertise_endpoint: Any = None
    # How long each worker waits for a round (update_info.timeout_s); with a dict config that sets no
    # publisher.update_timeout, also the publisher's cap on the update. Keep it under the client's
    # timeout (vLLM's HTTPVLLMWeightSyncClient: 300 s) so that the workers' reason is what the trainer sees.
    update_timeout_s: float = DEFAULT_TIMEOUT_S
    # How send_weights sends a round. "stream": one tensor at a time (a sharded trainer gathers one at a
    # time). "whole": every tensor at once through weight_update, which goes point to point to workers
    # that serve slices (tensor parallelism), each receiving only its slices. "auto": streams until the
    # publisher says a worker serves slices, then "whole" from that round on.
    send: str = "auto"
    # More fields of the workers' ParamCastInitInfo, e.g. {"slices": "off"} or {"whole_fallback": True}.
    engine_init: Any = None
    # What every round sends instead of the trainer's bytes (docs/transforms.md), e.g.
    # [{"match": "*norm*", "keep": True}, {"match": "*proj.weight", "fp8": "block"}]: the workers' load_weights
    # gets <name> as float8 e4m3fn and <name>_scale_inv. [] sends every tensor as it is; None: the
    # publisher config's (publisher.transforms). The workers are told them (init_info.transforms).
    transforms: Any = None
    # How many trainer ranks publish each round together (ParamCast's many senders): 1 (default), rank 0
    # sends every tensor the source declares; M > 1, every rank 0..M-1 sends the parameters it owns
    # (ParamMeta.owners; None: every rank) and the plan takes each byte from one of its owners. With a
    # dict config, publisher.ranks is set from it (a YAML config must say publisher.ranks: M itself).
    ranks: int = 1
    # With ranks > 1: the torch.distributed group of the trainer ranks (group rank = TrainerInitInfo.rank),
    # over which rank 0's endpoint is handed out and each round's holdings are checked; None: the default
    # group (what vLLM's ModuleSource assumes).
    group: Any = None

    def __post_init__(self):
        _check_rules(self.transforms, "paramcast trainer init_info.transforms")
        r = self.ranks
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"paramcast trainer init_info.ranks: expected a number of trainer ranks >= 1, got {r!r}")
        if r > 1 and not 0 <= self.rank < r:
            raise ValueError(f"paramcast trainer init_info.rank {self.rank}: not one of the {r} trainer ranks "
                             f"(init_info.ranks)")
        if r > 1 and self.transforms:
            raise ValueError("paramcast trainer init_info.transforms: a round sent by several trainer ranks "
                             "(init_info.ranks > 1) sends every tensor as it is; transforms need ranks: 1")
        if self.send not in ("auto", "stream", "whole"):
            raise ValueError(f"paramcast trainer init_info.send: expected 'auto', 'stream' or 'whole', "
                             f"got {self.send!r}")
        t = self.update_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"paramcast trainer init_info.update_timeout_s: expected a positive number of seconds, "
                             f"got {t!r}")


class ParamCastTrainerWeightTransferEngine(_TrainerBase):
    """The trainer's side: rank 0 publishes; the other trainer ranks take part in gathering only."""

    init_info_cls = ParamCastTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, rank=0, publisher=None):
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.rank = rank
        self.publisher = publisher  # rank 0: the Publisher; with ranks > 1, ranks 1..M-1: their PublisherRank
        self.ranks = 1  # trainer ranks sending each round together (init_info.ranks)
        self.group = None  # with ranks > 1: their torch.distributed group (None: the default group)
        self.update_timeout_s = DEFAULT_TIMEOUT_S
        self.send = "auto"
        self.transforms = None  # passed to every round's update (None: the publisher config's)
        self._rules = None  # the rules in effect, where known: the scales' names for update_info.names

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """On every trainer rank. The sender binds the publisher, has every vLLM worker join, forms the group.

        With ``init_info.ranks`` > 1 every trainer rank takes part: rank 0 hands its endpoint to the
        others over ``init_info.group`` and each of them joins it as a ParamCast PublisherRank."""
        if init_info.ranks > 1:
            return cls._trainer_init_ranks(init_info, client, source)
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, rank=init_info.rank)
        config = init_info.config
        if isinstance(config, dict) and "update_timeout" not in (config.get("publisher") or {}):
            config = dict(config, publisher={**(config.get("publisher") or {}),
                                             "update_timeout": f"{int(init_info.update_timeout_s * 1000)}ms"})
        rules = init_info.transforms
        if rules is None and isinstance(config, dict):
            rules = (config.get("publisher") or {}).get("transforms")
        publisher = paramcast.Publisher(config)
        try:
            endpoint = init_info.advertise_endpoint or publisher.endpoint
            if init_info.advertise_endpoint:
                port = publisher.endpoint.rsplit(":", 1)[1]
                endpoint = endpoint.replace(":PORT", ":" + port)
            client.init_weight_transfer_engine({**(init_info.engine_init or {}),
                                                "endpoint": endpoint,
                                                "config": init_info.engine_config,
                                                "worker_id_prefix": init_info.worker_id_prefix,
                                                "transforms": None if rules is None else list(rules)})
            publisher.start()
        except BaseException:
            publisher.close()
            raise
        engine = cls(client=client, source=source, is_sender=True, rank=init_info.rank, publisher=publisher)
        engine.update_timeout_s = init_info.update_timeout_s
        engine.send = init_info.send
        engine.transforms = None if init_info.transforms is None else list(init_info.transforms)
        engine._rules = rules
        return engine

    @classmethod
    def _trainer_init_ranks(cls, init_info, client, source):
        dist, src = _trainer_group(init_info)
        ranks = init_info.ranks
        config = init_info.config
        if isinstance(config, dict):
            pub = dict(config.get("publisher") or {})
            if pub.get("ranks", ranks) != ranks:
                raise ValueError(f"paramcast trainer init_info.ranks {ranks} but config publisher.ranks "
                                 f"{pub['ranks']}: they must agree")
            if pub.get("transforms"):
                raise ValueError("paramcast trainer config publisher.transforms: a round sent by several trainer "
                                 "ranks (init_info.ranks > 1) sends every tensor as it is; transforms need ranks: 1")
            pub["ranks"] = ranks
            pub.setdefault("update_timeout", f"{int(init_info.update_timeout_s * 1000)}ms")
            config = dict(config, publisher=pub)
        box = [None]
        publisher = None
        if init_info.rank == 0:
            try:
                publisher = paramcast.Publisher(config)
                endpoint = init_info.advertise_endpoint or publisher.endpoint
                if init_info.advertise_endpoint:
                    endpoint = endpoint.replace(":PORT", ":" + publisher.endpoint.rsplit(":", 1)[1])
                box = [endpoint]
            except BaseException as e:
                box = [f"error: trainer rank 0 could not bind its publisher: {e}"]
                dist.broadcast_object_list(box, src=src, group=init_info.group)
                raise
            dist.broadcast_object_list(box, src=src, group=init_info.group)
            try:
                client.init_weight_transfer_engine({**(init_info.engine_init or {}),
                                                    "endpoint": endpoint,
                                                    "config": init_info.engine_config,
                                                    "worker_id_prefix": init_info.worker_id_prefix,
                                                    "transforms": None})
                publisher.start()  # waits for the workers and for trainer ranks 1..M-1
            except BaseException:
                publisher.close()
                raise
        else:
            dist.broadcast_object_list(box, src=src, group=init_info.group)
            endpoint = box[0]
            if not isinstance(endpoint, str) or endpoint.startswith("error: "):
                raise RuntimeError(f"paramcast trainer rank {init_info.rank}: no endpoint from trainer rank 0 "
                                   f"({endpoint})")
            from paramcast._config import load_config
            publisher = paramcast.PublisherRank(load_config(config).with_endpoint(endpoint), init_info.rank)
            try:
                publisher.start()
            except BaseException:
                publisher.close()
                raise
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0, rank=init_info.rank,
                     publisher=publisher)
        engine.update_timeout_s = init_info.update_timeout_s
        engine.ranks = ranks
        engine.group = init_info.group
        engine.send = "whole"
        return engine

    def send_weights(self):
        """One round: start, stream every tensor of the source while the workers receive, finish.

        ``finish_weight_update`` is given the ParamCast version as ``weight_version`` (a decimal string):
        vLLM sets its engine's weight version from it (``/weight_info``, ``LLM.get_weight_version()``).
        """
        missing = [a for a in ("metadata", "iter_full") if not hasattr(self.source, a)]
        if missing:
            raise TypeError(f"paramcast send_weights: the source ({type(self.source).__name__}) has no "
                            f"{' or '.join(missing)}: pass a vLLM WeightSource (e.g. ModuleSource(model))")
        if self.ranks > 1:
            return self._send_owned()
        not_ours = [m.name for m in self.source.metadata if getattr(m, "owners", None) is not None
                    and 0 not in m.owners]
        if not_ours:  # identical metadata on every rank: every rank refuses alike, before any collective
            raise ValueError(f"paramcast send_weights: trainer rank 0 sends every round alone (init_info.ranks "
                             f"is 1) but does not own {_names_list(not_ours)} (ParamMeta.owners): give "
                             f"ParamCastTrainerInitInfo ranks = the number of trainer ranks, so that each "
                             f"sends what it owns")
        if not self.is_sender:
            for _ in self.source.iter_full():  # collective gathers need every rank
                pass
            return None
        manifest = [(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata]
        self.client.start_weight_update()
        opened = None
        if self.send != "whole":
            try:
                opened = self.publisher.stream(manifest, transforms=self.transforms)
            except paramcast.UpdateError as e:
                # ParamCast refuses to stream to a worker that registered slices: those go point to point.
                if self.send == "stream" or "serves slices" not in str(e):
                    with contextlib.suppress(Exception):
                        self.client.finish_weight_update()
                    raise
                _log.info("paramcast: the vLLM workers serve slices (tensor parallelism): each round is sent "
                          "whole, point to point, each worker receiving only its slices")
                self.send = "whole"
            except BaseException:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                raise
        if opened is None:
            return self._send_whole(manifest)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = None
            try:
                with opened as update:
                    receiving = pool.submit(self.client.update_weights,
                                            {"version": update.version, "names": self._names(manifest),
                                             "timeout_s": self.update_timeout_s})
                    for name, tensor in self.source.iter_full():
                        if receiving.done() and receiving.exception() is not None:
                            break  # the workers gave up: their error says why (raised below)
                        update.send(name, tensor)
            except BaseException:
                if receiving is None:
                    # The workers are inside a round that nothing will end: close it (vLLM restores the
                    # previous weights when a layerwise reload received nothing), then report.
                    with contextlib.suppress(Exception):
                        self.client.finish_weight_update()
                    raise
                receiving.result()  # the workers' error first: it says what went wrong where
                raise
            receiving.result()
        self.client.finish_weight_update(weight_version=str(update.version))
        return update.result

    def _send_whole(self, manifest):
        # One weight_update: to workers that registered slices, the plan sends each only its slices. Its
        # version is assigned when it is submitted; the workers wait for the next one applied (a version
        # a failed update used is not applied, so the last applied + 1 is where they start waiting).
        try:
            tensors = list(self.source.iter_full())
            version = self.publisher.status()["version"] + 1
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = pool.submit(self.client.update_weights,
                                    {"version": version, "names": self._names(manifest),
                                     "timeout_s": self.update_timeout_s})
            try:
                result = self.publisher.weight_update(tensors, transforms=self.transforms)
            except BaseException:
                del tensors
                receiving.result()  # the workers' error first: it says what went wrong where
                raise
            del tensors
            receiving.result()
        self.client.finish_weight_update(weight_version=str(result.version))
        return result

    def _send_owned(self):
        # Many senders: every trainer rank sends what it owns, one version together. Everything that can
        # be refused is checked on every rank and agreed over the trainer group before any RPC's round
        # begins its transfer, so that every rank refuses alike and no byte moves.
        dist, _ = _trainer_group(self)
        metas = list(self.source.metadata)
        problems = _owner_problems(metas, self.ranks)
        declared = {}
        for m in metas:
            declared.setdefault(m.name, m)
        mine = [m.name for m in metas if _owners(m, self.ranks) is not None and self.rank in _owners(m, self.ranks)]
        tensors = []
        if not problems:
            try:
                got = set()
                for name, tensor in self.source.iter_full():
                    m = declared.get(name)
                    if m is None or self.rank not in (_owners(m, self.ranks) or ()):
                        problems.append(f"trainer rank {self.rank} yields {name!r}, which the metadata does not "
                                        f"give it (owners {None if m is None else m.owners})")
                    elif tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
                        problems.append(f"trainer rank {self.rank} holds {name!r} as {tensor.dtype} "
                                        f"{tuple(tensor.shape)}, declared {m.dtype} {tuple(m.shape)}")
                    got.add(name)
                    tensors.append((name, tensor))
                lost = [n for n in mine if n not in got]
                if lost:
                    problems.append(f"trainer rank {self.rank} owns {_names_list(lost)} but its source did not "
                                    "yield them")
            except Exception as e:  # noqa: BLE001: every rank is told, then it is raised
                problems.append(f"trainer rank {self.rank}: iterating its source raised {type(e).__name__}: {e}")
        version = started = None
        if self.is_sender and not problems:
            try:
                version = self.publisher.status()["version"] + 1
                self.client.start_weight_update()
                started = True
            except Exception as e:  # noqa: BLE001
                problems.append(f"trainer rank 0: start_weight_update failed: {type(e).__name__}: {e}")
        said = [None] * self.ranks
        dist.all_gather_object(said, (self.rank, problems, version,
                                      [(m.name, str(m.dtype), tuple(m.shape), m.owners) for m in metas]),
                               group=self.group)
        everyone = list(dict.fromkeys(p for _, ps, _, _ in said for p in ps))  # metadata problems: on every rank
        version = said[0][2]
        for rank, _, _, theirs in said[1:]:
            if theirs != said[0][3]:
                everyone.append(_metadata_difference(said[0][3], theirs, rank))
        if everyone:
            if started:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
            raise ValueError("paramcast send_weights refused before any byte moved: " + "; ".join(everyone))
        if not self.is_sender:
            try:
                return self.publisher.weight_update(tensors, version=version)
            finally:
                del tensors
        names = [m.name for m in metas]
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = pool.submit(self.client.update_weights,
                                    {"version": version, "names": names, "timeout_s": self.update_timeout_s})
            try:
                result = self.publisher.weight_update_sharded(tensors, version=version)
            except BaseException:
                del tensors
                receiving.result()  # the workers' error first: it says what went wrong where
                raise
            del tensors
            receiving.result()
        self.client.finish_weight_update(weight_version=str(result.version))
        return result

    def _names(self, manifest):
        # What the workers must receive this round: the source's names, each FP8 one with its scales.
        return wire_names([n for n, _, _ in manifest], self._rules)

    def shutdown(self):
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()


def _names_list(names, most=5):
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _owners(meta, ranks):
    """The trainer ranks that own ``meta`` (ParamMeta.owners; None: every one of ``ranks``)."""
    owners = getattr(meta, "owners", None)
    return tuple(range(ranks)) if owners is None else tuple(owners)


def _owner_problems(metas, ranks):
    """What in the (identical on every rank) metadata no round of ``ranks`` trainer ranks can send."""
    problems, seen = [], {}
    for m in metas:
        owners = _owners(m, ranks)
        outside = [r for r in owners if not 0 <= r < ranks]
        if not owners or len(outside) == len(owners):
            problems.append(f"{m.name!r} is owned by no trainer rank (owners {m.owners}, the job has ranks "
                            f"0..{ranks - 1})")
        elif outside:
            problems.append(f"{m.name!r} names owners {outside} outside the job's ranks 0..{ranks - 1}")
        first = seen.setdefault(m.name, m)
        if first is not m:
            problems.append(f"{m.name!r} is declared twice: {first.dtype} {tuple(first.shape)} owned by "
                            f"{_owners(first, ranks)}, {m.dtype} {tuple(m.shape)} owned by {owners}")
    return problems


def _metadata_difference(ours, theirs, rank):
    """Where trainer rank ``rank``'s metadata differs from rank 0's (vLLM: identical on every rank)."""
    a, b = {e[0]: e for e in ours}, {e[0]: e for e in theirs}
    for name in list(a) + [n for n in b if n not in a]:
        if a.get(name) != b.get(name):
            def say(e):
                return "does not declare it" if e is None else f"declares {e[1]} {e[2]} owned by {e[3]}"
            return (f"trainer ranks 0 and {rank} declare {name!r} differently: rank 0 {say(a.get(name))}, "
                    f"rank {rank} {say(b.get(name))}")
    return f"trainer rank {rank} declares the parameters in another order than rank 0"


def _trainer_group(info):
    """torch.distributed (initialized) and the global rank of trainer rank 0 in ``info.group``."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("paramcast: several trainer ranks (init_info.ranks > 1) agree over torch.distributed: "
                           "initialize its default process group (or pass init_info.group) first")
    src = 0 if info.group is None else dist.get_global_rank(info.group, 0)
    return dist, src


def register():
    """Registers ``"paramcast"`` with vLLM's weight-transfer factories (the vllm.general_plugins hook).

    Idempotent: vLLM may load its plugins more than once per process. Returns False without vLLM.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "ParamCastWeightTransferEngine")
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return True
    if BACKEND not in getattr(WeightTransferTrainerFactory, "_registry", {}):
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "ParamCastTrainerWeightTransferEngine")
    return True


# A trainer loads no vLLM plugins: importing this module is what registers "paramcast" there (and it is
# harmless in vLLM's workers, where the plugin entry point registers it too).
if HAVE_VLLM:
    register()
