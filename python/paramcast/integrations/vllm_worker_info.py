"""What a vLLM worker is given, and what it calls in vLLM besides its model: the worker's
``init_info`` (:class:`ParamCastInitInfo`) and ``update_info`` (:class:`ParamCastUpdateInfo`), each
checked as it is made, the worker's ParamCast id (:func:`worker_id_for`), and vLLM's loader hooks
(layerwise reload, the MTP completeness check), where vLLM is installed.

Part of ``paramcast.integrations.vllm`` (which re-exports every name here; import them from there). The
worker's engine that takes these is ``vllm.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from .vllm_base import DEFAULT_TIMEOUT_S, _check_rules, _InitInfoBase, _UpdateInfoBase

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
