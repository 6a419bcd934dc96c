"""Exits with a started Subscriber and Publisher and an async update in flight, closing nothing.

ParamCast's objects are closed at exit (atexit), before the interpreter
finalizes; the exit must be clean (code 0) and prompt.
"""

import torch

import paramcast
from cluster import config_dict

pub = paramcast.Publisher(config_dict(subscribers=1))
sub = paramcast.Subscriber(pub.config.with_endpoint(pub.endpoint), "engine-1")
received = []
sub.on_weights(lambda weights: received.extend(name for name, _ in weights))
sub.on_update_end(lambda version, error: received.append(version))
sub.start()
pub.start()
pub.weight_update({"a": torch.ones(3)})
future = pub.weight_update_async({"a": torch.ones(1000)})
print("exiting", received, flush=True)
