"""A PyTorch trainer and three PyTorch engine processes kept bit-identical by paramcast."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

import tinylm as tinymodel  # noqa: E402
from cluster import Engine, config_dict  # noqa: E402


class Cluster:
    """The trainer (this process) and engine-1 (in place), engine-2 (fused load_weights), engine-3 (in place)."""

    def __init__(self, dtype):
        torch.set_num_threads(1)
        self.dtype = dtype
        self.model = tinymodel.TinyLM(0, getattr(torch, dtype))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.pub = paramcast.Publisher(config_dict())
        self.engines = [Engine(self.pub.endpoint, "engine-1", "inplace", dtype, 1),
                        Engine(self.pub.endpoint, "engine-2", "fused", dtype, 2),
                        Engine(self.pub.endpoint, "engine-3", "inplace", dtype, 3)]
        for e in self.engines:
            e.wait_ready()
        self.pub.start()

    def engine(self, worker_id):
        return next(e for e in self.engines if e.worker_id == worker_id)

    def assert_identical(self):
        want = tinymodel.logits(self.model)
        for e in self.engines:
            got = e.call("logits")
            assert torch.equal(got, want), f"{e.worker_id}: logits differ from the trainer's"

    def update(self, version=None):
        result = self.pub.weight_update(self.model.named_parameters(), version=version)
        for e in self.engines:
            assert e.call("state") == ("consistent", result.version), e.worker_id
        return result

    def close(self):
        for e in self.engines:
            e.close()
        self.pub.close()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cluster(request):
    c = Cluster(request.param)
    yield c
    c.close()


def test_updates_keep_engines_bit_identical(cluster):
    want = tinymodel.logits(cluster.model)
    assert not torch.equal(cluster.engine("engine-1").call("logits"), want), "engines start with other weights"
    result = cluster.update()
    assert result.ok and result.tensors == len(list(cluster.model.parameters()))
    param_bytes = sum(p.numel() * p.element_size() for p in cluster.model.parameters())
    assert result.bytes == param_bytes
    assert result.seconds > 0 and result.gbps > 0
    assert sorted(o.worker_id for o in result.subscribers) == ["engine-1", "engine-2", "engine-3"]
    assert all(o.ok for o in result.subscribers)
    cluster.assert_identical()
    # engine-2 received q, k and v of every layer through its fusing load_weights.
    shards = cluster.engine("engine-2").call("shards", result.version)
    assert sorted(shards) == sorted(f"blocks.{i}.{p}_proj.{k}" for i in range(tinymodel.LAYERS)
                                    for p in "qkv" for k in ("weight", "bias"))
    events = cluster.engine("engine-3").call("events")
    assert ("begin", result.version) in events and ("end", result.version, None) in events

    # One optimizer step later the engines differ, and the next update makes them equal again.
    tinymodel.train_step(cluster.model, cluster.optimizer, seed=7)
    assert not torch.equal(cluster.engine("engine-1").call("logits"), tinymodel.logits(cluster.model))
    second = cluster.update(version=result.version + 10)
    assert second.version == result.version + 10
    cluster.assert_identical()
    assert cluster.pub.status()["version"] == second.version


def test_mismatch_lists_each_one_and_touches_nothing(cluster):
    cluster.update()
    before = {e.worker_id: e.call("logits") for e in cluster.engines}
    versions = {e.worker_id: e.call("state") for e in cluster.engines}
    wrong, want_dtype, got_dtype = ((torch.float64, "F32", "F64") if cluster.dtype == "float32"
                                    else (torch.float32, "BF16", "F32"))
    tensors = {n: p.detach() + 1 for n, p in cluster.model.named_parameters()}
    tensors["blocks.0.query.weight"] = tensors.pop("blocks.0.q_proj.weight")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].reshape(500, 128)
    tensors["ln_f.weight"] = tensors["ln_f.weight"].to(wrong)
    with pytest.raises(paramcast.UpdateError) as err:
        cluster.pub.weight_update(tensors)
    message = str(err.value)
    assert err.value.code == "REJECTED"
    for worker in ("engine-1", "engine-3"):  # the in-place engines check every name, shape and dtype
        assert worker in message
        found = {(m.name, m.expected, m.got) for w, m in err.value.result.mismatches if w == worker}
        assert ("blocks.0.query.weight", "no such tensor", "a tensor of shape [64, 64]") in found
        assert any(name == "blocks.0.q_proj.weight" for name, _, _ in found)
        assert ("lm_head.weight", "[1000, 64]", "[500, 128]") in found
        assert ("ln_f.weight", want_dtype, got_dtype) in found
    for e in cluster.engines:
        assert torch.equal(e.call("logits"), before[e.worker_id]), f"{e.worker_id}: weights were touched"
        assert e.call("state") == versions[e.worker_id]


def test_raising_callbacks_fail_the_update_and_the_next_one_heals(cluster):
    engine2, engine3 = cluster.engine("engine-2"), cluster.engine("engine-3")
    engine2.call("set", "raise_in", "on_weights")
    with pytest.raises(paramcast.UpdateError) as err:
        cluster.pub.weight_update(cluster.model.named_parameters())
    assert "engine-2" in str(err.value) and "KeyError" in str(err.value) and "cannot load" in str(err.value)
    assert engine2.call("state")[0] == "dirty"
    engine2.call("set", "raise_in", None)

    engine3.call("set", "raise_in", "on_update_begin")
    with pytest.raises(paramcast.UpdateError) as err:
        cluster.pub.weight_update(cluster.model.named_parameters())
    assert "engine-3" in str(err.value) and "RuntimeError: engine-3 cannot pause" in str(err.value)
    assert engine3.call("state")[0] == "dirty"
    engine3.call("set", "raise_in", None)

    cluster.update()
    cluster.assert_identical()


def test_weight_update_releases_the_gil(cluster):
    cluster.engine("engine-3").call("set", "sleep_once", 1.5)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    start = time.monotonic()
    future = cluster.pub.weight_update_async(cluster.model.named_parameters())
    result = future.result(timeout=60)
    elapsed = time.monotonic() - start
    done.set()
    t.join()
    assert result.ok and elapsed >= 1.5
    during = [x for x in ticks if start <= x <= start + elapsed]
    # A thread holding the GIL for the whole update would leave ~0 ticks; 100 Hz gives ~150.
    assert len(during) >= 30, f"only {len(during)} ticks in {elapsed:.2f}s"
    for e in cluster.engines:
        assert e.call("state") == ("consistent", result.version)
