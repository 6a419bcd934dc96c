"""paramcast.Subscriber: the inference engine's side."""

import time

from . import _core
from . import _lifetime
from ._config import load_config
from ._tensors import _torch_module, for_dlpack, named_items, to_framework
from .errors import DeadlineExceeded, Error

_SLICE_SECONDS = 0.05


class Subscriber:
    """Receives weight updates into an engine's tensors.

    ``config`` is a YAML path, a dict with the YAML's keys, or a
    :class:`paramcast.Config`; ``worker_id`` names this engine in every
    result and error. Register destinations and callbacks, then ``start()``.
    Callbacks run on ParamCast's data thread (with the GIL); an exception in
    one fails that update on the publisher with its type and message, and
    this engine's state becomes ``"dirty"`` until the next good update.
    """

    def __init__(self, config, worker_id):
        self.config = load_config(config)
        self.worker_id = worker_id
        self._core = _core.Subscriber(self.config, worker_id)
        self._last_failure = ""
        _lifetime.track(self)

    _exit_order = 0  # stopped at exit before the publishers

    def register(self, named_tensors):
        """Tensors written in place by every update that names them (``model.named_parameters()`` works).

        A :class:`paramcast.reshard.Shard` value registers a slice this engine serves (tensor
        parallelism: ``Shard(param_local, full_shape, offsets)``, anywhere in the engine's memory,
        e.g. a row range of a fused ``qkv_proj``): many-sender updates deliver only its bytes,
        straight into it (:func:`paramcast.reshard.tp_slices` computes a LLaMA's usual split)."""
        from .reshard import Shard
        for name, tensor in named_items(named_tensors, "register"):
            if isinstance(tensor, Shard):
                obj, dtype, _ = for_dlpack(tensor.local)
                self._core.register_slice(name, obj, dtype, tensor.shape, tensor.offsets, owner=tensor.local)
                continue
            obj, dtype, _ = for_dlpack(tensor)
            self._core.register_tensor(name, obj, dtype, owner=tensor)
        return self

    def on_weights(self, fn):
        """``fn(weights)`` receives every tensor not registered, as ``[(name, tensor)]``, like ``load_weights``.

        The tensor shares ParamCast's receive buffer and is valid only during
        the call: copy what you keep (``param.copy_(tensor)`` does). On CUDA
        such a copy is only queued on the current stream when ``fn`` returns;
        ParamCast waits for that stream before the buffer takes other bytes.
        """
        def deliver(ref):
            tensor = to_framework(ref)
            fn([(ref.name, tensor)])
            if getattr(tensor, "is_cuda", False):
                _torch_module().cuda.current_stream(tensor.device).synchronize()

        self._core.on_tensor(deliver)
        return fn

    def on_update_begin(self, fn):
        """``fn(version)`` before an update's bytes arrive (e.g. pause generation)."""
        self._core.on_update_begin(fn)
        return fn

    def on_update_end(self, fn):
        """``fn(version, error)`` after the bytes are in place (error None) or the update failed (error str)."""
        self._core.on_update_end(fn)
        return fn

    def start(self):
        """Joins the publisher; heartbeats and reconnects on its own threads."""
        self._core.start()
        return self

    def stop(self):
        """Leaves the group and stops ParamCast's threads."""
        self._core.stop()

    close = stop

    @property
    def state(self):
        """``"empty"``, ``"consistent"`` or ``"dirty"``."""
        return self._core.state()[0]

    @property
    def version(self):
        """The last version applied completely (0 before the first)."""
        return self._core.state()[1]

    @property
    def state_detail(self):
        """E.g. ``"version 4, consistent"`` or ``"dirty (v5 incomplete, last consistent v4)"``."""
        return self._core.state()[3]

    @property
    def metrics_endpoint(self):
        """Where ``metrics.listen`` serves this engine's Prometheus page, or ``""`` (set once started)."""
        return self._core.metrics_endpoint

    @property
    def joined(self):
        return self._core.joined()

    def wait_for_version(self, version, timeout=None, raise_on_failure=False):
        """Waits until version ``version`` (or a later one) is applied; returns the version held.

        Raises paramcast.DeadlineExceeded (a TimeoutError) after ``timeout`` seconds, naming the state and the
        last failed update. With ``raise_on_failure``, an update of ``version`` or later that fails on
        this engine raises :class:`paramcast.Error` at once, with its error. The GIL is released while
        waiting; Ctrl-C raises KeyboardInterrupt within a fraction of a second.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self._core.state()
            if state[0] == "consistent" and state[1] >= version:
                return state[1]
            left = _SLICE_SECONDS if deadline is None else min(_SLICE_SECONDS, deadline - time.monotonic())
            if left <= 0:
                failure = f"; last failed update: {self._last_failure}" if self._last_failure else ""
                raise DeadlineExceeded(
                    f"{self.worker_id}: version {version} not applied within {timeout}s "
                    f"(state: {state[3]}){failure}")
            report = self._core.next_report(left)
            if report is not None and report[1]:
                self._last_failure = f"v{report[0]}: {report[1]}"
                if raise_on_failure and report[0] >= version:
                    raise Error(f"{self.worker_id}: update v{report[0]} failed here: {report[1]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
