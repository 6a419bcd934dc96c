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

Where things are (every name below is importable from this module):

- ``vllm.py`` (here): the worker's side, ``ParamCastWeightTransferEngine``,
  and :func:`register`.
- ``vllm_worker_info.py``: what the worker is given, ``ParamCastInitInfo`` and
  ``ParamCastUpdateInfo``, its worker id (:func:`worker_id_for`), and the vLLM
  loader hooks it calls.
- ``vllm_slices.py``: the slices a tensor-parallel worker serves, read from
  its model's parallel layers (:func:`tp_destinations`, :func:`slice_refusal`).
- ``vllm_trainer.py``: the trainer's side,
  ``ParamCastTrainerWeightTransferEngine`` with its ``ParamCastTrainerInitInfo``
  (several trainer ranks, FP8 transforms), and ``ParamCastTrainerSendWeightsArgs``.
- ``vllm_base.py``: what both sides share: ``BACKEND``, ``DEFAULT_TIMEOUT_S``,
  vLLM's base classes (``HAVE_VLLM``) and the transform rules' helpers
  (:func:`wire_names`).

Engine side, ``init_info`` (``ParamCastInitInfo``): ``endpoint`` (the
trainer's publisher), ``config`` (the subscribers' ParamCast config as a
dict with the YAML's keys; ``control.endpoint`` comes from ``endpoint``), and
``worker_id_prefix``; ``slices`` and ``whole_fallback`` (``vllm_slices.py``);
``transforms`` (the trainer's rules, below). ``update_info``
(``ParamCastUpdateInfo``): ``version`` (the round takes the first version
applied at or above it), and optionally ``names`` (the checkpoint names the round
carries; a name that did not arrive fails the call).

FP8 (docs/transforms.md; the trainer's ``transforms``, ``vllm_trainer.py``):
on the whole-tensor path an FP8 tensor reaches ``model.load_weights`` as a
``torch.float8_e4m3fn`` tensor under its checkpoint name, with its float32
``<name>_scale_inv``; workers that serve slices refuse FP8 (``vllm_slices.py``).

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
import importlib as _importlib
import logging
import sys as _sys
import threading
import time

import paramcast

# importlib.reload of this module (a test that puts vLLM on sys.path after importing it) re-reads its
# parts first, so that HAVE_VLLM and the base classes are what that import finds, in every part.
if "_PARTS" in globals():
    for _part in _PARTS:
        if _part in _sys.modules:
            _importlib.reload(_sys.modules[_part])
_PARTS = tuple(f"{__package__}.{p}" for p in ("vllm_base", "vllm_worker_info", "vllm_slices", "vllm_trainer"))

# Re-exported: every name this module held before its parts got their own files.
from .vllm_base import (BACKEND, DEFAULT_TIMEOUT_S, HAVE_VLLM, _CASTS, _EngineBase, _InitInfoBase,  # noqa: E402,F401
                        _TrainerBase, _TrainerInitInfoBase, _UpdateInfoBase, _check_rules, _describe_rule,
                        _rule_for, wire_names)
from .vllm_slices import (_COLUMN, _KIND_BY_CLASS, _MERGED, _PACKED, _QKV, _REPLICATED, _ROW,  # noqa: E402,F401
                          _VOCAB, UnmappedParameter, _full_name, _layer_kind, slice_refusal, tp_destinations)
from .vllm_trainer import (ParamCastTrainerInitInfo, ParamCastTrainerSendWeightsArgs,  # noqa: E402,F401
                           ParamCastTrainerWeightTransferEngine, _metadata_difference, _names_list,
                           _owner_problems, _owners, _trainer_group)
from .vllm_worker_info import (ParamCastInitInfo, ParamCastUpdateInfo, _layerwise, _no_mtp_check,  # noqa: E402,F401
                               worker_id_for)

_log = logging.getLogger(__name__)


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
