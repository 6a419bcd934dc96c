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

Engine side, ``init_info`` (``ParamCastInitInfo``): ``endpoint`` (the
trainer's publisher), ``config`` (the subscribers' ParamCast config as a
dict with the YAML's keys; ``control.endpoint`` comes from ``endpoint``), and
``worker_id_prefix``. ``update_info`` (``ParamCastUpdateInfo``):
``version``, and optionally ``names`` (the checkpoint names the round
carries; a name that did not arrive fails the call).

Trainer side: ``ParamCastTrainerWeightTransferEngine.trainer_init(init_info,
client=..., source=...)`` then ``send_weights()`` per round (vLLM >= 0.28),
or ``ParamCastWeightTransferEngine.trainer_send_weights(iterator, args)``
(the static form of vLLM 0.20-0.27).

Registered as ``"paramcast"`` with vLLM's factories by :func:`register`,
which vLLM calls in every worker through the ``vllm.general_plugins`` entry
point this package declares. Importing this module needs neither vLLM nor a
GPU; the classes then derive from ``object`` and follow the same contract.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import paramcast

BACKEND = "paramcast"

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

    def __post_init__(self):
        if not isinstance(self.endpoint, str) or not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"paramcast init_info.endpoint: expected the publisher's tcp:// endpoint, "
                             f"got {self.endpoint!r}")


@dataclass
class ParamCastUpdateInfo(_UpdateInfoBase):
    """One round: the ParamCast version the trainer is sending, and optionally the names it carries."""

    version: int
    names: list = field(default_factory=list)
    timeout_s: float = 600.0

    def __post_init__(self):
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"paramcast update_info.version: expected a version >= 1, got {self.version!r}")


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


class ParamCastWeightTransferEngine(_EngineBase):
    """The vLLM worker's side: a ParamCast subscriber that feeds ``model.load_weights``."""

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
        self._lock = threading.Lock()
        self._active = False
        self._received = set()
        self._errors = []

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
        """Joins the trainer's ParamCast group as this worker's subscriber (once, at the start of training)."""
        if self._sub is not None:
            raise RuntimeError(f"{self.worker_id}: init_transfer_engine was already called")
        cfg = {} if init_info.config is None else init_info.config
        if not isinstance(cfg, dict):  # init_info travels as JSON (vLLM's RPC and HTTP routes)
            raise ValueError(f"paramcast init_info.config: expected a dict with the config's YAML keys, "
                             f"got {type(cfg).__name__}")
        cfg = dict(cfg)
        cfg["control"] = {**cfg.get("control", {}), "endpoint": init_info.endpoint}
        device = self.device
        if getattr(device, "type", "cpu") == "cuda":
            sub_cfg = dict(cfg.get("subscriber", {}))
            sub_cfg["device"] = f"cuda:{device.index if device.index is not None else 0}"
            cfg["subscriber"] = sub_cfg
        self.worker_id = worker_id_for(init_info.worker_id_prefix, self.parallel_config)
        sub = paramcast.Subscriber(cfg, self.worker_id)
        sub.on_weights(self._on_weights)
        sub.start()
        self._sub = sub

    def start_weight_update(self):
        """Opens a round: tensors that arrive from now until finish_weight_update go to load_weights."""
        self._require_init("start_weight_update")
        init = _layerwise("initialize_layerwise_reload")
        if init is not None:
            init(self.model)
        with self._lock:
            self._active = True
            self._received = set()
            self._errors = []

    def receive_weights(self, update_info):
        """Returns once version ``update_info.version`` is applied here, each tensor through load_weights.

        Raises RuntimeError when the update failed on this worker (with ParamCast's error) or did not
        complete within ``update_info.timeout_s``, and ValueError naming any of ``update_info.names``
        that did not arrive.
        """
        self._require_init("receive_weights")
        if not self._active:
            raise RuntimeError(f"{self.worker_id}: receive_weights outside start/finish_weight_update")
        try:
            self._sub.wait_for_version(update_info.version, timeout=update_info.timeout_s, raise_on_failure=True)
        except paramcast.Error as e:
            with self._lock:
                self._active = False  # vLLM's worker ends the round when this raises
                errors = list(self._errors)
            if errors:
                raise RuntimeError(f"{self.worker_id}: load_weights failed: {errors[0]}") from e
            raise RuntimeError(f"paramcast: {e}") from e
        with self._lock:
            errors = list(self._errors)
            missing = [n for n in update_info.names if n not in self._received]
            if errors or missing:
                self._active = False
        if errors:
            raise RuntimeError(f"{self.worker_id}: load_weights failed: {errors[0]}")
        if missing:
            shown = ", ".join(repr(n) for n in missing[:4]) + (f", +{len(missing) - 4} more" if len(missing) > 4 else "")
            raise ValueError(f"{self.worker_id}: update v{update_info.version} did not carry {shown}")

    def finish_weight_update(self):
        """Closes the round (vLLM's layerwise reload finalizes here, where installed)."""
        self._require_init("finish_weight_update")
        with self._lock:
            self._active = False
        finalize = _layerwise("finalize_layerwise_reload")
        if finalize is not None:
            finalize(self.model, self.model_config)

    def shutdown(self):
        """Leaves the ParamCast group; the worker and its model stay. Safe to call more than once."""
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.stop()

    # ---- internals ---------------------------------------------------------------------------
    def _require_init(self, what):
        if self._sub is None:
            raise RuntimeError(f"paramcast: {what} before init_transfer_engine")

    def _on_weights(self, weights):
        # ParamCast's data thread; the views are valid only during this call, and vLLM's loaders may keep
        # what they are given until finish_weight_update: each tensor is copied first.
        with self._lock:
            active = self._active
        if not active:
            raise RuntimeError(f"{self.worker_id}: weights arrived outside start/finish_weight_update "
                               "(the trainer must call start_weight_update on every worker first)")
        owned = [(name, tensor.clone()) for name, tensor in weights]
        try:
            torch = paramcast._tensors._torch_module()
            device_ctx = torch.cuda.device(self.device) if getattr(self.device, "type", "cpu") == "cuda" \
                else contextlib.nullcontext()
            with device_ctx, _no_mtp_check():
                self.model.load_weights(owned)
        except Exception as e:
            with self._lock:
                self._errors.append(f"{type(e).__name__}: {e}")
            raise
        with self._lock:
            self._received.update(name for name, _ in owned)

    # ---- trainer side, static form (vLLM 0.20-0.27) ------------------------------------------
    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        """Sends ``(name, tensor)`` pairs from ``iterator`` as one ParamCast update.

        ``trainer_args``: a :class:`ParamCastTrainerSendWeightsArgs` (or a dict of its fields). With a
        ``manifest`` the update is streamed (each tensor may be freed once the next one is asked for);
        without one the iterator is gathered first.
        """
        args = trainer_args if isinstance(trainer_args, ParamCastTrainerSendWeightsArgs) \
            else ParamCastTrainerSendWeightsArgs(**trainer_args)
        if args.manifest is None:
            return args.publisher.weight_update(list(iterator), version=args.version)
        with args.publisher.stream(args.manifest, version=args.version) as update:
            for name, tensor in iterator:
                update.send(name, tensor)
        return update.result


@dataclass
class ParamCastTrainerSendWeightsArgs:
    publisher: Any  # a started paramcast.Publisher
    manifest: Any = None  # (name, dtype, shape) triples or a module: streams the update
    version: Any = None


# ---- trainer side (vLLM >= 0.28) ----------------------------------------------------------------
@dataclass
class ParamCastTrainerInitInfo(_TrainerInitInfoBase):
    """The trainer's ParamCast config (publisher and data plane) and the engines' config."""

    backend: ClassVar[str] = BACKEND
    config: Any = None  # dict or YAML path: the publisher's config (publisher.subscribers = the vLLM workers)
    engine_config: Any = None  # dict: the subscribers' config sent to every vLLM worker
    worker_id_prefix: str = "vllm"


class ParamCastTrainerWeightTransferEngine(_TrainerBase):
    """The trainer's side: rank 0 publishes; the other trainer ranks take part in gathering only."""

    init_info_cls = ParamCastTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, rank=0, publisher=None):
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.rank = rank
        self.publisher = publisher

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """On every trainer rank. The sender binds the publisher, has every vLLM worker join, forms the group."""
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, rank=init_info.rank)
        publisher = paramcast.Publisher(init_info.config)
        try:
            client.init_weight_transfer_engine({"endpoint": publisher.endpoint,
                                                "config": init_info.engine_config,
                                                "worker_id_prefix": init_info.worker_id_prefix})
            publisher.start()
        except BaseException:
            publisher.close()
            raise
        return cls(client=client, source=source, is_sender=True, rank=init_info.rank, publisher=publisher)

    def send_weights(self):
        """One round: start, stream every tensor of the source while the workers receive, finish."""
        if not self.is_sender:
            for _ in self.source.iter_full():  # collective gathers need every rank
                pass
            return None
        manifest = [(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata]
        self.client.start_weight_update()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = None
            try:
                with self.publisher.stream(manifest) as update:
                    receiving = pool.submit(self.client.update_weights,
                                            {"version": update.version, "names": [n for n, _, _ in manifest]})
                    for name, tensor in self.source.iter_full():
                        update.send(name, tensor)
            finally:
                if receiving is not None:
                    receiving.result()  # the workers' errors first: they say what went wrong where
        self.client.finish_weight_update()
        return update.result

    def shutdown(self):
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()


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
