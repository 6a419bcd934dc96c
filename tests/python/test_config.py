"""Configurations from YAML files and from dicts with the same keys."""

import os

import pytest

import paramcast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dict_and_yaml_file_give_the_same_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("control:\n  endpoint: tcp://127.0.0.1:29999\n  heartbeat_timeout: 2s\n"
                    "publisher:\n  subscribers: [a, b]\n")
    from_file = paramcast.load_config(str(path))
    from_dict = paramcast.load_config({"control": {"endpoint": "tcp://127.0.0.1:29999", "heartbeat_timeout": "2s"},
                                       "publisher": {"subscribers": ["a", "b"]}})
    for c in (from_file, from_dict):
        assert c.endpoint == "tcp://127.0.0.1:29999"
        assert c.heartbeat_timeout == 2.0
        assert c.worker_ids == ["a", "b"]
    assert paramcast.load_config(os.path.join(ROOT, "deploy", "local-cpu.yaml")).worker_ids[0] == "worker-1"


def test_bad_values_name_the_key_and_what_was_expected():
    with pytest.raises(paramcast.ConfigError, match=r"key 'control.heartbeat_interval': bad value '5 parsecs': "
                                                    r"expected a duration") as err:
        paramcast.Publisher({"control": {"heartbeat_interval": "5 parsecs"}})
    assert isinstance(err.value, ValueError) and err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(paramcast.ConfigError, match=r"control.heartbeet"):
        paramcast.load_config({"control": {"heartbeet": "1s"}})
    with pytest.raises(TypeError, match=r"config key 'publisher.subscribers': a value of type set cannot be written"):
        paramcast.load_config({"publisher": {"subscribers": {"a"}}})
    with pytest.raises(paramcast.ConfigError, match=r"nope.yaml"):
        paramcast.load_config("/nonexistent/nope.yaml")
    with pytest.raises(TypeError, match=r"config: expected a YAML path, a dict or a paramcast.Config, got int"):
        paramcast.Subscriber(3, "engine-1")
