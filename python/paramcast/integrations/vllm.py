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
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

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

    def __post_init__(self):
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
        sub.on_weights(self._on_weights)
        sub.on_update_end(self._on_update_end)
        try:
            sub.start()
        except BaseException:
            sub.stop()
            raise
        self._sub = sub

    def start_weight_update(self):
        """Opens a round: tensors that arrive from now until finish_weight_update are loaded."""
        self._require_init("start_weight_update")
        init = _layerwise("initialize_layerwise_reload")
        if init is not None:
            init(self.model)
            self._reload_open = True
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
            while True:
                item = self._take(deadline, update_info.version)
                if isinstance(item, _End):
                    item.load_error = load_error
                    item.done.set()  # the data thread reports Applied (or the failure) now
                    if item.version < update_info.version:
                        received, load_error = set(), None  # an older update's end: not this round's
                        continue
                    if item.error:
                        raise RuntimeError(f"paramcast: {self.worker_id}: update v{item.version} failed here: "
                                           f"{item.error}")
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
            try:
                self._sub.wait_for_version(update_info.version, timeout=max(1.0, deadline - time.monotonic()),
                                           raise_on_failure=True)
            except paramcast.Error as e:
                raise RuntimeError(f"paramcast: {e}") from e
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

    def _take(self, deadline, version):
        with self._cv:
            while not self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"paramcast: {self.worker_id}: update v{version} not complete within "
                                       f"timeout_s (state: {self._sub.state_detail})")
                if self._closed:
                    raise RuntimeError(f"paramcast: {self.worker_id}: shut down while receiving v{version}")
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

    def _on_update_end(self, version, error):
        # ParamCast's data thread, after the last tensor: Applied leaves once vLLM's thread loaded them all.
        with self._cv:
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
    # The endpoint the workers connect to, when the publisher binds a wildcard (tcp://0.0.0.0:PORT or
    # tcp://*:PORT): tcp://<this host's address>:PORT. Default: the publisher's bound endpoint.
    advertise_endpoint: Any = None
    # How long each worker waits for a round (update_info.timeout_s); with a dict config that sets no
    # publisher.update_timeout, also the publisher's cap on the update. Keep it under the client's
    # timeout (vLLM's HTTPVLLMWeightSyncClient: 300 s) so that the workers' reason is what the trainer sees.
    update_timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
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
        self.publisher = publisher
        self.update_timeout_s = DEFAULT_TIMEOUT_S

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """On every trainer rank. The sender binds the publisher, has every vLLM worker join, forms the group."""
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, rank=init_info.rank)
        config = init_info.config
        if isinstance(config, dict) and "update_timeout" not in (config.get("publisher") or {}):
            config = dict(config, publisher={**(config.get("publisher") or {}),
                                             "update_timeout": f"{int(init_info.update_timeout_s * 1000)}ms"})
        publisher = paramcast.Publisher(config)
        try:
            endpoint = init_info.advertise_endpoint or publisher.endpoint
            if init_info.advertise_endpoint:
                port = publisher.endpoint.rsplit(":", 1)[1]
                endpoint = endpoint.replace(":PORT", ":" + port)
            client.init_weight_transfer_engine({"endpoint": endpoint,
                                                "config": init_info.engine_config,
                                                "worker_id_prefix": init_info.worker_id_prefix})
            publisher.start()
        except BaseException:
            publisher.close()
            raise
        engine = cls(client=client, source=source, is_sender=True, rank=init_info.rank, publisher=publisher)
        engine.update_timeout_s = init_info.update_timeout_s
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
                                            {"version": update.version, "names": [n for n, _, _ in manifest],
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


# A trainer loads no vLLM plugins: importing this module is what registers "paramcast" there (and it is
# harmless in vLLM's workers, where the plugin entry point registers it too).
if HAVE_VLLM:
    register()
