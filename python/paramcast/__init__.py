"""ParamCast for Python: weight sync from PyTorch trainers to inference engines.

    pub = paramcast.Publisher("deploy/x.yaml")          # trainer
    pub.start()
    result = pub.weight_update(model.named_parameters())
    pub.weight_update_sharded(model.named_parameters())  # a sharded trainer, rank 0:
    # ranks 1..M-1: paramcast.PublisherRank(config, rank).weight_update(...)
    # every rank sends its own shard; nothing is gathered

    sub = paramcast.Subscriber(config, "engine-1")        # inference engine
    sub.register(model.named_parameters())                # in place, or:
    sub.on_weights(model.load_weights)                    # transform on load
    sub.start()

See docs/python.md.
"""

from . import _core, reshard
from ._config import load_config
from ._core import Config, Mismatch, SubscriberOutcome, UpdateResult
from ._tensors import manifest
from .errors import (ConfigError, DeadlineExceeded, Error, PeerLostError, RejectedError, UnavailableError,
                     UpdateError)
from .publisher import Publisher, PublisherRank, Stream
from .subscriber import Subscriber

__all__ = [
    "Config", "ConfigError", "DeadlineExceeded", "Error", "PeerLostError", "RejectedError", "UnavailableError", "Mismatch", "Publisher", "PublisherRank", "Stream", "Subscriber", "SubscriberOutcome",
    "UpdateError", "UpdateResult", "load_config", "manifest", "reshard",
]
