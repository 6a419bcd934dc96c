"""ParamCast for Python: weight sync from PyTorch trainers to inference engines.

    pub = paramcast.Publisher("deploy/x.yaml")          # trainer
    pub.start()
    result = pub.weight_update(model.named_parameters())
    with pub.stream(paramcast.manifest(model)) as u:     # a sharded trainer:
        for name, p in model.named_parameters():          # gather one, send one
            u.send(name, p.full_tensor())

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
from .publisher import Publisher, Stream
from .subscriber import Subscriber

__all__ = [
    "Config", "ConfigError", "DeadlineExceeded", "Error", "PeerLostError", "RejectedError", "UnavailableError", "Mismatch", "Publisher", "Stream", "Subscriber", "SubscriberOutcome",
    "UpdateError", "UpdateResult", "load_config", "manifest", "reshard",
]
