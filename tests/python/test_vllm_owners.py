"""The vLLM backend's trainer side with partitioned owners (issue #37): a pipeline-split trainer of two
ranks (torch.distributed gloo; this process is rank 0, a spawned process rank 1), each owning half the
layers of a transformers Llama as vLLM 0.33.0's ``ParamMeta.owners`` says, publishes one version
together through ParamCast's many senders (``ParamCastTrainerInitInfo.ranks = 2``) to two imitated
tensor-parallel vLLM workers (vllm_contract.py). Each rank sends only its own parameters (the others it
holds are NaN), the workers hold the trainer's bytes after a round and after an optimizer step, and a
name no rank owns or two ranks declare with different shapes is refused before any byte moves."""

import copy
import dataclasses
import os
import socket

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import paramcast  # noqa: E402
from paramcast.integrations import vllm as backend  # noqa: E402

from cluster import config_dict  # noqa: E402
from vllm_contract import Client  # noqa: E402
from vllm_fixtures import LLAMA, hf_state, make_model, train_step  # noqa: E402

TP = 2


@dataclasses.dataclass(frozen=True)
class ParamMeta:  # vLLM 0.33.0's ParamMeta(name, dtype, shape, *, owners=None, ...)
    name: str
    dtype: torch.dtype
    shape: tuple
    owners: tuple = None


def stage_of(name):
    """Pipeline stage 0: embeddings and layer 0; stage 1: layer 1, the final norm and lm_head."""
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


class StageSource:
    """A vLLM WeightSource of one pipeline stage: ``metadata`` declares the whole model (identical on every
    rank, owners included); ``iter_full()`` yields exactly the names this rank owns."""

    def __init__(self, model, rank, change=None):
        self.model, self.rank = model, rank
        self.metadata = [ParamMeta(n, p.dtype, tuple(p.shape), owners=(stage_of(n),))
                         for n, p in model.named_parameters()]
        if change:
            self.metadata = change(self.metadata, rank)

    def iter_full(self):
        params = dict(self.model.named_parameters())
        self.yielded = {}  # what this rank handed the engine this round: {name: bytes}
        for m in self.metadata:
            if m.owners is None or self.rank in m.owners:
                self.yielded[m.name] = m.dtype.itemsize * torch.Size(m.shape).numel()
                yield m.name, params[m.name].detach() if m.name in params else torch.zeros(m.shape, dtype=m.dtype)


def forget_others(model, rank):
    """A copy of ``model`` holding only this rank's stage (the others NaN): sending one of them shows.
    (Both ranks train the whole model alike, a stand-in for the pipeline's step.)"""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if stage_of(n) != rank:
                p.fill_(float("nan"))
    return model


# What a round's source declares, per test phase (every rank the same unless a phase says otherwise).
def unowned(metas, rank):  # a name owned by trainer rank 2 of a 2-rank job: owned by no rank
    return [dataclasses.replace(m, owners=(2,)) if m.name == "lm_head.weight" else m for m in metas]


def two_shapes(metas, rank):  # both ranks own the final norm, rank 1 declaring (and holding) another shape
    return [dataclasses.replace(m, owners=(0, 1), shape=m.shape if rank == 0 else (m.shape[0] * 2,))
            if m.name == "model.norm.weight" else m for m in metas]


PHASES = {"unowned": unowned, "two_shapes": two_shapes}


def own_bytes(model, rank):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if stage_of(n) == rank)


def trainer_rank1(port, commands, answers):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=1, world_size=2)
    engine = None
    try:
        model = make_model()
        info = backend.ParamCastTrainerInitInfo(config=config_dict(subscribers=TP), ranks=2, rank=1)
        engine = backend.ParamCastTrainerWeightTransferEngine.trainer_init(
            info, client=None, source=StageSource(model, 1))
        while True:
            what = commands.get(timeout=120)
            if what == "exit":
                return
            if what == "step":
                train_step(model)
            engine.source = StageSource(forget_others(model, 1), 1, PHASES.get(what))
            try:
                r = engine.send_weights()
                answers.put(("ok", r.version, engine.source.yielded, own_bytes(model, 1)))
            except Exception as e:  # noqa: BLE001 - the test reads it
                answers.put(("error", type(e).__name__, str(e)))
    finally:
        if engine is not None:
            engine.shutdown()
        dist.destroy_process_group()


def assert_workers_hold(client, state):
    for rank, report in enumerate(client.rpc("check", hf_state=state)):
        assert report["bad"] == [], f"worker {rank}: parameters differ from the trainer's: {report['bad']}"
        assert report["untouched"] == [], f"worker {rank}: never loaded: {report['untouched']}"


def test_two_pipeline_ranks_each_send_only_what_they_own():
    import spawning

    import torch.distributed as dist

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = spawning.context(spawning.LLAMA)
    commands, answers = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=trainer_rank1, args=(port, commands, answers), daemon=True, name="trainer-rank-1")
    peer.start()
    client = Client(TP, LLAMA)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=2)
    engine = None
    try:
        model = make_model()
        pub_cfg = config_dict(subscribers=TP)
        engine_cfg = {k: v for k, v in config_dict().items() if k != "publisher"}
        info = backend.ParamCastTrainerInitInfo(config=pub_cfg, engine_config=engine_cfg, ranks=2, rank=0)
        engine = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                                           source=StageSource(model, 0))
        n_params = len(list(model.parameters()))

        def round_(what):
            if what == "step":
                train_step(model)
            want = hf_state(model)  # the whole model, before this rank forgets the other stage
            commands.put(what)
            engine.source = StageSource(forget_others(model, 0), 0, PHASES.get(what))
            try:
                mine = ("ok", engine.send_weights())
            except ValueError as e:
                mine = ("error", str(e))
            return mine, answers.get(timeout=120), want

        versions = []
        for what in ("first", "step"):
            (status, result), peer_said, want = round_(what)
            assert status == "ok" and peer_said[0] == "ok", (result, peer_said)
            assert result.ok and result.tensors == n_params, result
            assert peer_said[1] == result.version, "both trainer ranks took part in the same version"
            assert sorted(o.worker_id for o in result.subscribers) == ["trainer-1", "vllm-dp0-r0", "vllm-dp0-r1"]
            # Each worker receives every tensor whole (load_weights cuts its TP shards): rank 1 sends its
            # stage once to each of the TP workers, and the workers receive exactly the model once each.
            # No per-rank sent-bytes figure exists (a PublisherRank's result.bytes is the update's, per
            # worker), so: what each rank handed the engine is exactly its stage, the two stages are the
            # model once (no byte from two ranks), and each worker received the model once. The parameters
            # a rank does not own are NaN there: one sent by it would show in assert_workers_hold.
            for rank, (sent, own) in enumerate(((engine.source.yielded, own_bytes(model, 0)), peer_said[2:4])):
                assert sorted(sent) == sorted(n for n in want if stage_of(n) == rank), (rank, sorted(sent))
                assert sum(sent.values()) == own, (rank, sum(sent.values()), own)
            model_bytes = sum(t.numel() * t.element_size() for t in want.values())
            assert own_bytes(model, 0) + peer_said[3] == model_bytes
            assert result.bytes == model_bytes and result.wire_bytes == TP * model_bytes, result
            assert all(o.bytes == model_bytes for o in result.subscribers if o.worker_id.startswith("vllm")), \
                [(o.worker_id, o.bytes) for o in result.subscribers]
            assert_workers_hold(client, want)
            versions.append(result.version)
        assert versions[1] == versions[0] + 1

        for what, named in (("unowned", r"'lm_head.weight' is owned by no trainer rank"),
                            ("two_shapes", r"declare 'model.norm.weight' differently")):
            (status, message), peer_said, _ = round_(what)
            assert status == "error" and peer_said[0] == "error", (message, peer_said)
            for said in (message, peer_said[2]):
                assert "refused before any byte moved" in said and __import__("re").search(named, said), said
            assert engine.publisher.status()["version"] == versions[-1], "a refused round published a version"
            assert_workers_hold(client, want)  # the last round's bytes, untouched

        # Refusals left nothing behind: the next round is whole again.
        (status, result), peer_said, want = round_("again")
        assert status == "ok" and peer_said[0] == "ok" and result.version == versions[-1] + 1, (result, peer_said)
        assert_workers_hold(client, want)
    finally:
        commands.put("exit")
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        if engine is not None:
            engine.shutdown()
        client.close()
        dist.destroy_process_group()


def test_one_sender_refuses_names_rank_0_does_not_own():
    """ranks = 1 (today's path): rank 0 sends alone, so metadata giving a name to another rank is refused
    before the round starts, naming it (it used to be declared and never sent)."""

    class NoClient:
        def __getattr__(self, name):
            raise AssertionError(f"the round must be refused before the client is called ({name})")

    model = make_model()
    engine = backend.ParamCastTrainerWeightTransferEngine(client=NoClient(), source=StageSource(model, 0))
    with pytest.raises(ValueError, match=r"does not own 'model.layers.1.*ranks = the number of trainer ranks"):
        engine.send_weights()
    with pytest.raises(ValueError, match=r"ranks: expected a number of trainer ranks >= 1"):
        backend.ParamCastTrainerInitInfo(ranks=0, rank=0)
