"""paramcast.integrations.vllm driven as vLLM 0.33.0 drives a weight-transfer backend (vllm_contract.py):
a Hugging Face Llama trainer (random weights from a config) and two tensor-parallel vLLM-style workers in
their own processes, with fused qkv/gate_up parameters loaded through load_weights."""

import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import paramcast  # noqa: E402
from paramcast.integrations import vllm as backend  # noqa: E402

from cluster import config_dict  # noqa: E402
from vllm_contract import Client, ModuleSource, WorkerError  # noqa: E402
from vllm_fixtures import LLAMA, hf_state, make_model, one_engine, renamed  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    return make_model()


@pytest.fixture
def cluster(trained):
    client = Client(TP, LLAMA)
    pub_cfg = config_dict(subscribers=TP)
    engine_cfg = {k: v for k, v in config_dict().items() if k != "publisher"}
    info = backend.ParamCastTrainerInitInfo(config=pub_cfg, engine_config=engine_cfg, rank=0)
    trainer = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                                        source=ModuleSource(trained))
    yield client, trainer
    trainer.shutdown()
    client.close()


def assert_workers_hold(client, model):
    for rank, report in enumerate(client.rpc("check", hf_state=hf_state(model))):
        assert report["bad"] == [], f"worker {rank}: parameters differ from the trainer's shards: {report['bad']}"
        assert report["untouched"] == [], f"worker {rank}: never loaded: {report['untouched']}"
        assert report["clobbered"] == 0, f"worker {rank}: {report['clobbered']} tensors given to load_weights changed"
        assert report["other_threads"] == 0, f"worker {rank}: load_weights ran off the worker's RPC thread"


def test_rounds_load_the_trainers_weights_into_fused_tp_shards(cluster, trained):
    client, trainer = cluster
    first = trainer.send_weights()
    assert first.ok and first.tensors == len(list(trained.parameters()))
    assert_workers_hold(client, trained)

    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16))
    trained(tokens, labels=tokens).loss.backward()
    opt.step()
    second = trainer.send_weights()
    assert second.ok and second.version == first.version + 1
    assert_workers_hold(client, trained)


def test_weights_outside_a_round_fail_the_update_naming_the_worker(cluster, trained):
    client, trainer = cluster
    # No start_weight_update: the workers must refuse the bytes, and the trainer hear which worker did.
    with pytest.raises(paramcast.UpdateError, match=r"vllm-dp0-r[01].*outside start/finish_weight_update"):
        trainer.publisher.weight_update(ModuleSource(trained).iter_full())
    trainer.send_weights()  # the next round is whole again
    assert_workers_hold(client, trained)


def test_a_round_the_workers_cannot_load_fails_there_with_the_reason(cluster, trained):
    client, trainer = cluster

    trainer.source = renamed(trained)
    with pytest.raises(WorkerError, match=r"update_weights: worker 0: RuntimeError: .*load_weights failed: KeyError"):
        trainer.send_weights()
    trainer.source = ModuleSource(trained)
    trainer.send_weights()
    assert_workers_hold(client, trained)


def test_a_round_that_fails_before_the_workers_are_told_still_ends_theirs(cluster, trained):
    client, trainer = cluster

    class Duplicated(ModuleSource):
        def __init__(self, module):
            super().__init__(module)
            self.metadata = self.metadata + self.metadata[:1]  # the publisher refuses a name twice

    trainer.source = Duplicated(trained)
    with pytest.raises((paramcast.Error, ValueError)):
        trainer.send_weights()
    trainer.source = ModuleSource(trained)
    trainer.send_weights()  # not "weight update already active": the failed round was closed
    assert_workers_hold(client, trained)


def test_update_info_names_that_did_not_arrive_are_named(cluster, trained):
    client, trainer = cluster
    source = ModuleSource(trained)
    manifest = [(m.name, m.dtype, m.shape) for m in source.metadata]
    client.start_weight_update()
    with pytest.raises(WorkerError, match=r"did not carry 'model.extra.weight'"):
        with trainer.publisher.stream(manifest) as update:
            names = [n for n, _, _ in manifest] + ["model.extra.weight"]
            errors = []
            t = threading.Thread(target=lambda: _call(client.update_weights, {"version": update.version,
                                                                              "names": names}, errors))
            t.start()
            for name, tensor in source.iter_full():
                update.send(name, tensor)
        t.join(120)
        if errors:
            raise errors[0]
    # vLLM's worker ends the round when update_weights raises: finish is refused, the next round works.
    with pytest.raises(WorkerError, match="no active weight update"):
        client.finish_weight_update()
    trainer.send_weights()
    assert_workers_hold(client, trained)


def _call(fn, arg, errors):
    try:
        fn(arg)
    except Exception as e:  # noqa: BLE001 - re-raised by the test
        errors.append(e)


def test_parse_errors_are_value_errors():
    eng = backend.ParamCastWeightTransferEngine.__new__(backend.ParamCastWeightTransferEngine)
    with pytest.raises(ValueError, match="version >= 1"):
        eng.parse_update_info({"version": 0})
    with pytest.raises(ValueError, match="Invalid update_info"):
        eng.parse_update_info({"version": 1, "dtype_names": []})
    with pytest.raises(ValueError, match="tcp:// endpoint"):
        eng.parse_init_info({"endpoint": "localhost:5555"})
    with pytest.raises(ValueError, match="wildcard bind"):
        eng.parse_init_info({"endpoint": "tcp://0.0.0.0:5555"})
    with pytest.raises(ValueError, match="Invalid init_info"):
        eng.parse_init_info({"master_address": "10.0.0.1"})
    info = eng.parse_update_info({"version": 3, "names": ["a"]})
    assert info.version == 3 and info.names == ["a"]


def test_the_static_trainer_send_weights_form(trained):
    """vLLM 0.20-0.27's trainer_send_weights(iterator, args), streamed and gathered."""
    with one_engine() as (pub, sub, got):
        source = ModuleSource(trained)
        manifest = [(m.name, m.dtype, m.shape) for m in source.metadata]
        streamed = backend.ParamCastWeightTransferEngine.trainer_send_weights(
            source.iter_full(), backend.ParamCastTrainerSendWeightsArgs(publisher=pub, manifest=manifest))
        assert streamed.ok and sub.wait_for_version(streamed.version, timeout=60)
        assert all(torch.equal(got[n], t) for n, t in hf_state(trained).items())
        gathered = backend.ParamCastWeightTransferEngine.trainer_send_weights(source.iter_full(), {"publisher": pub})
        assert gathered.ok and gathered.version == streamed.version + 1


def test_register_without_vllm_says_so():
    if backend.HAVE_VLLM:
        pytest.skip("vLLM is installed: register() registers for real")
    assert backend.register() is False
