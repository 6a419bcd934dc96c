"""Engine processes for the Python API's tests, and their test configuration.

Each engine is a separate process (multiprocessing, forked from a server that imported
PyTorch once: spawning.py) holding a tiny transformer and a paramcast.Subscriber; the test
drives it over a pipe.
"""

import os
import time

import torch

import spawning


def config_dict(endpoint="tcp://127.0.0.1:*", subscribers=3):
    """Short heartbeats and deadlines that still hold on a loaded 2-core machine."""
    return {
        "control": {"endpoint": endpoint, "heartbeat_interval": "100ms", "heartbeat_timeout": "1500ms",
                    "join_timeout": "60s", "reconnect_backoff_max": "500ms"},
        "data_plane": {"backend": "gloo", "bucket_size": "64KiB", "direct_min_size": "16KiB",
                       "checksum": "xxh64", "stall_timeout": "10s", "init_timeout": "30s"},
        "publisher": {"subscribers": subscribers, "update_timeout": "60s"},
        "logging": {"level": "warn"},
    }


def cuda_config(cfg, device="cuda:0", side="subscriber"):
    """cfg on the NCCL data plane with `side` ("publisher" or "subscriber") on `device`."""
    cfg["data_plane"]["backend"] = "nccl"
    cfg.setdefault(side, {})["device"] = device
    return cfg


def share_one_gpu(name):
    """Lets this process be one of several NCCL ranks on one GPU (tests only, never a real node):
    NCCL refuses two ranks of a group on one device of one host, so each process claims a host of
    its own, and the ranks talk over loopback sockets."""
    os.environ["NCCL_HOSTID"] = f"paramcast-test-{name}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _engine_main(conn, endpoint, worker_id, mode, dtype, seed, device="cpu"):
    if device != "cpu":
        share_one_gpu(worker_id)  # before NCCL reads its environment
    import paramcast
    import tinylm as tinymodel

    torch.set_num_threads(1)
    model = (tinymodel.FusedTinyLM if mode == "fused" else tinymodel.TinyLM)(seed, getattr(torch, dtype)).to(device)
    ctl = {"raise_in": None, "sleep_begin": 0.0, "sleep_once": 0.0}
    events, shards = [], {}

    cfg = config_dict(endpoint)
    if device != "cpu":
        cuda_config(cfg, device)
    sub = paramcast.Subscriber(cfg, worker_id)
    if mode == "fused":
        def load_weights(weights):
            if ctl["raise_in"] == "on_weights":
                raise KeyError(f"{worker_id} cannot load")
            shards.setdefault(current[0], []).extend(model.load_weights(weights))
        sub.on_weights(load_weights)
    else:
        sub.register(model.named_parameters())
    current = [0]

    @sub.on_update_begin
    def begin(version):
        current[0] = version
        events.append(("begin", version))
        time.sleep(ctl["sleep_begin"] + ctl["sleep_once"])
        ctl["sleep_once"] = 0.0
        if ctl["raise_in"] == "on_update_begin":
            raise RuntimeError(f"{worker_id} cannot pause")

    @sub.on_update_end
    def end(version, error):
        events.append(("end", version, error))

    def set_ctl(key, value):
        ctl[key] = value

    _serve(conn, sub, {
        "logits": lambda: tinymodel.logits(model),
        "params": lambda: tinymodel.unfused_state(model),  # the trainer's names and layout, on the host
        "set": set_ctl,
        "events": lambda: list(events),
        "shards": lambda version: shards.get(version, []),
    })


def _serve(conn, sub, commands):
    """Starts `sub`, says "ready", then answers the test's commands until "stop":
    "state", "wait" and the engine's own `commands` (name -> function of the arguments)."""
    commands = {"state": lambda: (sub.state, sub.version), "wait": sub.wait_for_version, **commands}
    with sub:
        sub.start()
        conn.send("ready")
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            conn.send(commands[cmd](*args))
    conn.send("stopped")


def kill_and_expect_named(pub, model, engine, label="lost engine"):
    """Kills `engine`'s process; the next update must fail naming it within the heartbeat bound."""
    import paramcast
    import pytest

    pub.weight_update(model.named_parameters())
    engine.proc.kill()
    engine.proc.join()
    killed = time.monotonic()
    with pytest.raises(paramcast.UpdateError) as err:
        pub.weight_update(model.named_parameters())
    elapsed = time.monotonic() - killed
    print(f"{label} named after {elapsed:.2f}s: {err.value}")
    assert engine.worker_id in str(err.value)
    assert err.value.code in ("PEER_LOST", "ABORTED", "TIMEOUT")
    # heartbeat_timeout is 1.5 s (config_dict); the margin is for a loaded machine.
    assert elapsed < 1.5 + 6.0, f"the loss was named after {elapsed:.1f}s"
    return err.value


class Engine:
    """One engine process: mode "inplace" (register) or "fused" (on_weights + load_weights)."""

    def __init__(self, endpoint, worker_id, mode="inplace", dtype="float32", seed=1, device="cpu"):
        self._spawn(worker_id, _engine_main, (endpoint, worker_id, mode, dtype, seed, device))

    def _spawn(self, worker_id, target, args):
        ctx = spawning.context()
        self.worker_id = worker_id
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=worker_id, daemon=True)
        self.proc.start()

    def wait_ready(self, timeout=120):
        assert self.conn.poll(timeout), f"{self.worker_id} did not start within {timeout}s"
        assert self.conn.recv() == "ready"

    def call(self, *cmd, timeout=60):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"{self.worker_id}: no answer to {cmd[0]} within {timeout}s"
        return self.conn.recv()

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.poll(20)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _bulk_engine_main(conn, endpoint, worker_id, mode, cfg, specs, factory):
    """An engine of arbitrary tensors: `mode` "inplace" registers zeroed buffers
    built by `factory(specs)` (a picklable callable), "callback" keeps what
    on_weights hands it. Answers "digest" with {name: bytes hash}."""
    import hashlib

    import paramcast

    torch.set_num_threads(1)
    cfg = dict(cfg)
    cfg["control"] = dict(cfg["control"], endpoint=endpoint)
    sub = paramcast.Subscriber(cfg, worker_id)
    held = {}
    if mode == "inplace":
        held = factory(specs)
        sub.register(held.items())
    else:
        def keep(weights):
            for name, t in weights:
                held[name] = t.clone()
        sub.on_weights(keep)

    def digest():
        out = {}
        for name, t in held.items():
            raw = t.detach().contiguous().view(torch.uint8) if t.numel() else t.detach().new_empty(0, dtype=torch.uint8)
            out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        return out

    _serve(conn, sub, {"digest": digest})


class BulkEngine(Engine):
    """An engine process holding the tensors `specs` names (see _bulk_engine_main)."""

    def __init__(self, endpoint, worker_id, mode, cfg, specs, factory):  # pylint: disable=super-init-not-called
        self._spawn(worker_id, _bulk_engine_main, (endpoint, worker_id, mode, cfg, specs, factory))


def sha256_of(tensors):
    """{name: hash of the tensor's bytes}, as _bulk_engine_main's "digest" answers."""
    import hashlib

    out = {}
    for name, t in tensors.items():
        raw = t.detach().contiguous().view(torch.uint8)
        out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out
