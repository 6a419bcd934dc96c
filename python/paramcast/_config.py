"""Turns what users pass as a configuration into a checked paramcast Config."""

import os

from . import _core


def load_config(config):
    """A :class:`paramcast.Config` from a YAML path, a dict with the YAML's keys, or a Config.

    Raises :class:`paramcast.ConfigError` naming the key, the bad value and
    what was expected (the same checks and messages as a YAML file).
    """
    if isinstance(config, _core.Config):
        return config
    if isinstance(config, dict):
        return _core.config_from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _core.load_config_file(os.fspath(config))
    raise TypeError(f"config: expected a YAML path, a dict or a paramcast.Config, got {type(config).__name__}")
