"""paramcast.Publisher: the trainer's side."""

import concurrent.futures
import threading

from . import _core
from . import _lifetime
from ._config import load_config
from ._tensors import for_dlpack, named_items
from .errors import UpdateError

# How often a blocking call wakes up to let Python handle signals (Ctrl-C).
_SLICE_SECONDS = 0.05


def _wait(handle):
    while not handle.wait(_SLICE_SECONDS):
        pass
    return handle.result()


class Publisher:
    """Broadcasts named tensors to every subscriber of a ParamCast group.

    ``config`` is a YAML path, a dict with the YAML's keys, or a
    :class:`paramcast.Config`. Creating it binds the control endpoint
    (``endpoint`` has the real port when the config says ``*``).
    """

    def __init__(self, config):
        self.config = load_config(config)
        self._core = _core.Publisher(self.config)
        self._lock = threading.Lock()
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

    def start(self):
        """Waits until the expected subscribers joined (control.join_timeout) and forms the group."""
        self._core.start()
        return self

    def weight_update(self, named_tensors, version=None):
        """Sends ``named_tensors`` (a dict or any iterable of ``(name, tensor)``) to every subscriber.

        Returns the :class:`paramcast.UpdateResult` when every subscriber has
        applied the update; raises :class:`paramcast.UpdateError` otherwise.
        The GIL is released while it waits. On Ctrl-C it raises
        KeyboardInterrupt at once; the update goes on in the background and
        the next call waits for it first (its result is then in
        ``interrupted_result``).
        """
        with self._lock:
            self._finish_interrupted()
            handle = self._submit(named_tensors, version)
            try:
                result = _wait(handle)
            except KeyboardInterrupt:
                self._inflight = handle
                raise
        if not result.ok:
            raise UpdateError(result)
        return result

    def weight_update_async(self, named_tensors, version=None):
        """Like weight_update, returning a concurrent.futures.Future of the result.

        The tensors must not change until the future is done.
        """
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
        }

    def close(self):
        """Tells subscribers to leave; an update in flight fails and is waited for."""
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _submit(self, named_tensors, version):
        items = []
        stream = None
        for name, tensor in named_items(named_tensors, "weight_update"):
            obj, dtype, s = for_dlpack(tensor)
            if s is not None and stream is None:
                stream = s
            items.append((name, obj, dtype, s))
        return self._core.submit(items, version, stream or 0)

    def _finish_interrupted(self):
        if self._inflight is not None:
            self.interrupted_result = _wait(self._inflight)
            self._inflight = None
