"""paramcast.integrations.vllm under vLLM's own weight-transfer code (the pinned wheel, vllm_real.py).

The trainer goes through vLLM's WeightTransferTrainerFactory, vLLM's RayVLLMWeightSyncClient and the LLM's
RL methods (RLOfflineMixin); each of two tensor-parallel workers (processes) is made by vLLM's
WeightTransferEngineFactory and driven by vLLM's Worker methods. Checked: shutdown then init, any number
of times; a failed round, then a good one; the version reaching vLLM's weight_version.

vLLM's sources come from PyPI (fetch_vllm.py, cached): without network the test skips, saying so."""

import dataclasses
import importlib
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if sys.version_info < (3, 11):
    pytest.skip("vLLM 0.33.0's base.py needs Python >= 3.11 (typing.Self)", allow_module_level=True)

import fetch_vllm  # noqa: E402
import vllm_real  # noqa: E402

try:
    SRC = fetch_vllm.fetch(fetch_vllm.cache_root([]))
except RuntimeError as e:
    pytest.skip(f"vLLM {fetch_vllm.VERSION}'s wheel could not be fetched: {e}", allow_module_level=True)
_spec = importlib.util.find_spec("vllm")
if _spec is not None and _spec.origin is not None:
    pytest.skip(f"an installed vLLM ({_spec.origin}) would shadow the pinned {fetch_vllm.VERSION}",
                allow_module_level=True)
vllm_real.use(SRC)

from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient, WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer import base as vbase  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402

from cluster import config_dict  # noqa: E402
from vllm_contract import Client, WorkerError  # noqa: E402
from vllm_fixtures import LLAMA, hf_state, make_model  # noqa: E402

if "paramcast.integrations.vllm" in sys.modules:  # imported before vLLM was on the path: again, with it
    importlib.reload(sys.modules["paramcast.integrations.vllm"])
from paramcast.integrations import vllm as backend  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    return make_model()


@pytest.fixture(scope="module")
def llm():
    """vLLM's LLM (its RL methods) over TP worker processes, as a Ray actor for vLLM's Ray client."""
    workers = Client(TP, LLAMA, SRC, target=vllm_real.worker_main)
    llm = vllm_real.llm_class(SRC)()
    llm.llm_engine = vllm_real.EngineCore(workers)
    yield llm
    workers.close()


@pytest.fixture
def ray_client(llm, monkeypatch):
    ray = vllm_real.fake_ray()
    monkeypatch.setitem(sys.modules, "ray", ray)
    return RayVLLMWeightSyncClient(ray.Handle(llm))


def connect(client, trained):
    info = backend.ParamCastTrainerInitInfo(config=config_dict(subscribers=TP),
                                            engine_config={k: v for k, v in config_dict().items() if k != "publisher"},
                                            rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trained))


def assert_workers_hold(llm, model):
    for rank, report in enumerate(llm.llm_engine.workers.rpc("check", hf_state=hf_state(model))):
        assert report["bad"] == [], f"worker {rank}: parameters differ from the trainer's shards: {report['bad']}"
        assert report["untouched"] == [], f"worker {rank}: never loaded: {report['untouched']}"
        assert report["clobbered"] == 0, f"worker {rank}: {report['clobbered']} tensors given to load_weights changed"
        assert report["other_threads"] == 0, f"worker {rank}: load_weights ran off the worker's RPC thread"


def states(llm):
    return llm.llm_engine.workers.rpc("state")


def step(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def test_these_are_vllms_own_modules_and_the_trainer_import_registers(llm):
    assert vbase.__file__.startswith(SRC), vbase.__file__
    assert backend.HAVE_VLLM and issubclass(backend.ParamCastWeightTransferEngine, vbase.WeightTransferEngine)
    assert issubclass(backend.ParamCastTrainerWeightTransferEngine, vbase.TrainerWeightTransferEngine)
    # A trainer loads no vLLM plugins: importing the backend is what registers it with the trainer factory.
    assert backend.BACKEND in WeightTransferTrainerFactory._registry
    for s in states(llm):
        assert s["engine"] == "paramcast.integrations.vllm.ParamCastWeightTransferEngine" and s["real_base"], s
        assert s["base_file"].startswith(SRC), s


def test_shutdown_then_init_any_number_of_times(llm, ray_client, trained):
    for connection in range(3):
        trainer = connect(ray_client, trained)
        try:
            for _ in range(2):
                step(trained)
                result = trainer.send_weights()
                assert result.ok, result
                assert_workers_hold(llm, trained)
                # vLLM's weight_version (/weight_info, LLM.get_weight_version) is the ParamCast version.
                assert llm.get_weight_version() == str(result.version), f"connection {connection}"
        finally:
            # vLLM's shutdown_weight_transfer_engine: the trainer connection goes, inference stays.
            ray_client.shutdown_weight_transfer_engine()
            trainer.shutdown()
    with pytest.raises(WorkerError, match=r"start_weight_update after shutdown_weight_transfer_engine"):
        ray_client.start_weight_update()


def test_a_failed_round_is_closed_before_the_error_leaves_and_the_next_round_works(llm, ray_client, trained):
    trainer = connect(ray_client, trained)
    try:
        before = states(llm)

        class Renamed(ModuleSource):  # vLLM's ModuleSource, one name the workers' model does not have
            def __init__(self, module):
                super().__init__(module)
                self.__dict__["metadata"] = [dataclasses.replace(m, name=m.name.replace("lm_head", "output"))
                                             for m in super().metadata]

            def iter_full(self):
                for name, t in super().iter_full():
                    yield name.replace("lm_head", "output"), t

        step(trained)
        trainer.source = Renamed(trained)
        with pytest.raises(WorkerError, match=r"update_weights: worker 0: RuntimeError: .*load_weights failed: KeyError"):
            trainer.send_weights()
        for rank, (was, now) in enumerate(zip(before, states(llm))):
            # vLLM's worker ended the round (no finish_weight_update will come): the backend closed the
            # layerwise reload it opened in start_weight_update before raising.
            assert not now["active"], f"worker {rank}"
            assert not now["reload"]["open"], f"worker {rank}: layerwise reload left open after a failed round"
            assert now["reload"]["finalized"] == was["reload"]["finalized"] + 1, f"worker {rank}: {now}"

        trainer.source = ModuleSource(trained)
        result = trainer.send_weights()
        assert result.ok, result
        assert_workers_hold(llm, trained)
        assert llm.get_weight_version() == str(result.version)
        for rank, s in enumerate(states(llm)):
            assert s["reload"]["initialized_while_open"] == 0, f"worker {rank}: a round began inside an open reload"
            assert not s["reload"]["open"] and s["reload"]["initialized"] == s["reload"]["finalized"], s
    finally:
        ray_client.shutdown_weight_transfer_engine()
        trainer.shutdown()


def test_a_worker_timeout_leaves_the_worker_usable(llm, ray_client, trained):
    """update_weights with no update coming: the worker gives up after timeout_s, closed, and the next round works."""
    trainer = connect(ray_client, trained)
    try:
        ray_client.start_weight_update()
        with pytest.raises(WorkerError, match=r"not complete within timeout_s"):
            ray_client.update_weights({"version": trainer.publisher.status()["version"] + 1, "timeout_s": 0.5})
        assert all(not s["active"] and not s["reload"]["open"] for s in states(llm)), states(llm)
        step(trained)
        assert trainer.send_weights().ok
        assert_workers_hold(llm, trained)
    finally:
        ray_client.shutdown_weight_transfer_engine()
        trainer.shutdown()


def test_bad_init_and_update_info_name_the_field(llm, ray_client):
    with pytest.raises(WorkerError, match=r"receive_timeout_s: expected a positive number"):
        ray_client.init_weight_transfer_engine({"endpoint": "tcp://127.0.0.1:1", "receive_timeout_s": 0})
    with pytest.raises(ValueError, match=r"update_timeout_s: expected a positive number"):
        backend.ParamCastTrainerInitInfo(config={}, rank=0, update_timeout_s=-1)
