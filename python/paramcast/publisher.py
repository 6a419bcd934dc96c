"""paramcast.Publisher: the trainer's side."""

import concurrent.futures
import threading

from . import _core
from . import _lifetime
from ._config import load_config
from ._tensors import for_dlpack, manifest as make_manifest, named_items
from .errors import UpdateError

# How often a blocking call wakes up to let Python handle signals (Ctrl-C).
_SLICE_SECONDS = 0.05


def _wait(handle):
    while not handle.wait(_SLICE_SECONDS):
        pass
    return handle.result()


class _Sender:
    """What Publisher and PublisherRank share. One update call at a time, waited for in slices so
    that Ctrl-C stays responsive: an interrupted call's update goes on in the background, and the
    next call waits for it first (its result is then in ``interrupted_result``); each class sets
    ``_inflight`` and ``interrupted_result`` to None in its ``__init__``. A context manager that
    closes it on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _finish_interrupted(self):
        if self._inflight is not None:
            self.interrupted_result = _wait(self._inflight)
            self._inflight = None

    def _result_of(self, handle):
        """The update's result once it is done; raises UpdateError if it failed."""
        try:
            result = _wait(handle)
        except KeyboardInterrupt:
            self._inflight = handle
            raise
        if not result.ok:
            raise UpdateError(result)
        return result


class Publisher(_Sender):
    """Broadcasts named tensors to every subscriber of a ParamCast group.

    ``config`` is a YAML path, a dict with the YAML's keys, or a
    :class:`paramcast.Config`. Creating it binds the control endpoint
    (``endpoint`` has the real port when the config says ``*``).
    """

    def __init__(self, config):
        self.config = load_config(config)
        self._core = _core.Publisher(self.config)
        self._lock = threading.Lock()
        self._stream_thread = None  # the thread whose open stream holds _lock
        self._inflight = None  # the handle of an update interrupted by Ctrl-C
        self.interrupted_result = None
        self._members = {}
        self._events = []
        _lifetime.track(self)

    _exit_order = 1  # closed at exit after the subscribers

    @property
    def endpoint(self):
        """The bound control endpoint, e.g. ``tcp://127.0.0.1:41234``."""
        return self._core.endpoint

    @property
    def metrics_endpoint(self):
        """Where ``metrics.listen`` serves the Prometheus page (``http://127.0.0.1:9464/metrics``), or ``""``."""
        return self._core.metrics_endpoint

    def start(self):
        """Waits until the expected subscribers joined (control.join_timeout) and forms the group."""
        self._core.start()
        return self

    def weight_update(self, named_tensors, version=None, partial=False, transforms=None):
        """Sends ``named_tensors`` (a dict or any iterable of ``(name, tensor)``) to every subscriber.

        ``partial=True``: the tensors are a subset of the engines' (LoRA
        adapters, a trainable subset); the others keep their bytes.

        ``transforms``: what travels instead of the trainer's bytes for this
        update, as ``publisher.transforms`` takes it (a list of dicts:
        ``{"match": "*proj.weight", "fp8": "block"}``, ``{"match": "*",
        "cast": "bf16"}``, ``{"match": "*norm*", "keep": True}``; the first
        match decides); ``[]`` sends every tensor as it is; ``None`` uses the
        config's. docs/transforms.md.

        Returns the :class:`paramcast.UpdateResult` when every subscriber has
        applied the update; raises :class:`paramcast.UpdateError` otherwise.
        The GIL is released while it waits. On Ctrl-C it raises
        KeyboardInterrupt at once; the update goes on in the background and
        the next call waits for it first (its result is then in
        ``interrupted_result``).
        """
        self._not_inside_a_stream("weight_update")
        with self._lock:
            self._finish_interrupted()
            return self._result_of(self._submit(named_tensors, version, partial, transforms))

    def weight_update_sharded(self, named_tensors, version=None):
        """Rank 0's part of a many-sender update (``publisher.ranks`` > 1): every trainer rank
        publishes what it holds, at once, and no rank gathers a tensor.

        ``named_tensors`` are this rank's parameters as they are: DTensors
        (FSDP2's ``fully_shard``, a tensor-parallel layout) give the region
        their placements hold, plain tensors are whole. The other ranks call
        :meth:`PublisherRank.weight_update` with theirs. The plan is checked
        whole before any byte moves: a gap, an overlap or a disagreement
        between ranks raises :class:`paramcast.UpdateError` naming tensor,
        range and ranks. Returns the :class:`paramcast.UpdateResult`.
        """
        self._not_inside_a_stream("weight_update_sharded")
        with self._lock:
            self._finish_interrupted()
            items, stream = shard_items(named_tensors, "weight_update_sharded")
            return self._result_of(self._core.submit_sharded(items, version, stream))

    def stream(self, manifest, version=None, partial=False, transforms=None):
        """A streamed update: ``with pub.stream(manifest) as u: u.send(name, tensor)``.

        ``manifest`` names every tensor before any exists: a module (from its
        parameters' metadata, as :func:`paramcast.manifest`), or
        ``(name, dtype, shape)`` triples. Every engine checks the plan before
        the block runs (a rejected plan raises :class:`paramcast.UpdateError`
        naming every mismatch, and moves no byte). Each ``send`` returns once
        the tensor's bytes are staged or on the wire, so a sharded trainer
        can gather one parameter, send it and free it. Leaving the block
        finishes the update (``u.result``; an :class:`UpdateError` if it
        failed); an exception inside it aborts the update, leaving the
        engines dirty at its version until the next one. ``transforms`` as
        for :meth:`weight_update`: the manifest names the trainer's tensors,
        each is transformed as it is sent.
        """
        entries = make_manifest(manifest)
        self._not_inside_a_stream("stream")
        self._lock.acquire()
        try:
            self._finish_interrupted()
            core = self._core.begin_update(entries, version, partial, transforms)
        except BaseException:
            self._lock.release()
            raise
        self._stream_thread = threading.get_ident()
        return Stream(self, core)

    def weight_update_async(self, named_tensors, version=None):
        """Like weight_update, returning a concurrent.futures.Future of the result.

        The tensors must not change until the future is done.
        """
        self._not_inside_a_stream("weight_update_async")
        with self._lock:
            self._finish_interrupted()
            handle = self._submit(named_tensors, version)
        future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()

        def finish():
            try:
                result = _wait(handle)
            except BaseException as e:  # noqa: BLE001: handed to the future's owner
                future.set_exception(e)
                return
            if result.ok:
                future.set_result(result)
            else:
                future.set_exception(UpdateError(result))

        # Not a daemon: a daemon thread inside the C++ wait when the
        # interpreter finalizes would be torn down mid-call; exit waits for
        # the update instead (bounded by the config's deadlines).
        threading.Thread(target=finish, name="paramcast-update").start()
        return future

    def next_version(self):
        """The version an update submitted now would get: above every version this publisher issued
        (a failed update's too: versions are never reused) and every version a member holds. Waits
        for an update in progress."""
        return self._core.next_version()

    def status(self):
        """Members, epoch and versions as plain Python objects."""
        while (event := self._core.poll_event()) is not None:
            kind, worker, detail = event
            self._members[worker] = kind
            self._events.append({"event": kind, "worker": worker, "detail": detail})
        stats = self._core.stats()
        return {
            "endpoint": self.endpoint,
            "epoch": stats["epoch"],
            "version": stats["version"],
            "live_members": stats["live_members"],
            "members": dict(self._members),
            "events": list(self._events),
            "dropped_frames": stats["dropped_frames"],
            "staging_peak_bytes": stats["staging_peak_bytes"],
            "baseline_bytes": stats["baseline_bytes"],
            "baseline_version": stats["baseline_version"],
        }

    def close(self):
        """Tells subscribers to leave; an update in flight fails and is waited for."""
        self._core.close()

    def _submit(self, named_tensors, version, partial=False, transforms=None):
        items = []
        stream = None
        for name, tensor in named_items(named_tensors, "weight_update"):
            obj, dtype, s = for_dlpack(tensor)
            if s is not None and stream is None:
                stream = s
            items.append((name, obj, dtype, s))
        return self._core.submit(items, version, stream or 0, partial, transforms)

    def _not_inside_a_stream(self, what):
        # Waiting for the update lock that this thread's own open stream holds would never end.
        if self._stream_thread == threading.get_ident():
            raise RuntimeError(f"{what}: a streamed update is open on this thread (leave its block, or "
                               "finish or abort it, first)")



def shard_items(named_tensors, what):
    """(name, local tensor, dtype, full shape, offsets) for each of this rank's tensors, read
    from their placements (paramcast.reshard.region_of): the local shard only, never gathered;
    and the caller's current CUDA stream when they are on a GPU (0: none), which the update
    is ordered after."""
    from .reshard import region_of
    items, stream = [], None
    for name, tensor in named_items(named_tensors, what):
        shape, (offsets, _) = region_of(tensor, f"'{name}'")
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.is_contiguous():
            local = local.contiguous()  # this rank's own shard, in its row-major layout
        obj, dtype, s = for_dlpack(local)
        if s is not None and stream is None:
            stream = s
        items.append((name, obj, dtype, shape, offsets))
    return items, stream or 0


class PublisherRank(_Sender):
    """Trainer rank ``rank`` > 0 of a many-sender job (``publisher.ranks`` in the same config as
    rank 0's, ``control.endpoint`` rank 0's address). Each :meth:`weight_update` sends this
    rank's part of the update straight to the engines, in step with rank 0's
    :meth:`Publisher.weight_update_sharded`.

        rank = paramcast.PublisherRank(config, dist.get_rank())   # on ranks 1..M-1
        rank.start()
        rank.weight_update(model.named_parameters())              # every step, on every rank
    """

    def __init__(self, config, rank):
        self.config = load_config(config)
        self._core = _core.PublisherRank(self.config, int(rank))
        self._inflight = None  # a call interrupted by Ctrl-C, waited for before the next
        self.interrupted_result = None
        _lifetime.track(self)

    _exit_order = 1

    @property
    def id(self):
        return self._core.id

    def start(self):
        """Connects to rank 0's publisher (the group forms when rank 0 starts)."""
        self._core.start()
        return self

    def weight_update(self, named_tensors, version=None):
        """This rank's part of the next update; returns its UpdateResult (its ``version``) or raises
        :class:`paramcast.UpdateError` (an update abandoned, refused, or failed on this rank).

        ``version``: the version rank 0 gives ``weight_update_sharded`` (every rank the same, or
        none: then each rank's n-th call is part of rank 0's n-th). A call rank 0 gave up on ends
        with the reason, and is never combined with another step's."""
        self._finish_interrupted()  # one call at a time: an interrupted one ends first
        items, stream = shard_items(named_tensors, "PublisherRank.weight_update")
        return self._result_of(self._core.submit(items, version, stream))

    def close(self):
        self._core.close()


class Stream:
    """One streamed update (:meth:`Publisher.stream`); a context manager."""

    def __init__(self, publisher, core):
        self._publisher = publisher
        self._core = core
        self.result = None
        if not core.ok:
            self.result = core.finish()
            self._release()
            raise UpdateError(self.result)

    @property
    def version(self):
        return self._core.version

    def send(self, name, tensor):
        """Sends one tensor of the manifest; it may be freed or overwritten once this returns.

        A name outside the manifest, a second send of a name, or a wrong
        dtype or shape raises ValueError naming it, and ends the update.
        """
        if self._core is None:
            raise ValueError("the streamed update has ended")
        obj, dtype, stream = for_dlpack(tensor)
        self._core.send(name, obj, dtype, stream)

    def finish(self):
        """Ends the update; returns its UpdateResult or raises UpdateError."""
        if self.result is None:
            try:
                self.result = self._core.finish()
            finally:
                self._release()
        if not self.result.ok:
            raise UpdateError(self.result)
        return self.result

    def abort(self, why="aborted by the trainer"):
        if self._core is not None and self.result is None:
            self._core.abort(why)
            self.result = self._core.finish()
            self._release()

    def _release(self):
        if self._publisher is not None:
            self._publisher._stream_thread = None
            self._publisher._lock.release()
            self._publisher = None

    def __del__(self):
        # An abandoned stream (never finished) is aborted, and the publisher freed for the next update.
        try:
            self.abort("the stream was dropped before finish()")
        except Exception:  # noqa: BLE001: nothing to report to at collection time
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort(f"exception in the update's block: {exc_type.__name__}: {exc}")
            return False
        self.finish()
        return False
