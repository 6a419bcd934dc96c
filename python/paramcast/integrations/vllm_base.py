"""What both sides of ParamCast's vLLM backend share: the backend's name and default timeout, vLLM's
base classes (stand-ins where vLLM is not installed), and the transform rules' helpers.

Part of ``paramcast.integrations.vllm`` (which re-exports every name here; import them from there). The
worker's engine (``vllm.py``), the slice mapping (``vllm_slices.py``) and the trainer side
(``vllm_trainer.py``) import this module, and it imports none of them, so ``HAVE_VLLM`` and the base
classes are the same objects everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import paramcast

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


# ---- transform rules (docs/transforms.md): what a round sends instead of the trainer's bytes ---------
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
