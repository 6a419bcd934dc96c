"""FP8 through the vLLM backend: a BF16 trainer's rounds reach an FP8 vLLM model as its checkpoint does.

A Hugging Face Llama trainer in BF16 (hidden size 200: edge blocks of 72 rows and columns; head_dim 128,
GQA) publishes through the backend's trainer engine with ``transforms`` that send every projection as
block FP8. Two TP=2 worker processes, made and driven as vLLM 0.33.0's worker does (vllm_contract.py's RPC
sequence), hold vllm_fp8_model's block-FP8 LlamaForCausalLM (vLLM's Fp8LinearMethod layout: fused
qkv_proj/gate_up_proj, float8 ``weight`` and float32 ``weight_scale_inv`` per 128x128 block) and take
whole tensors through its ``load_weights`` (``slices: "off"``). Real: the processes, ZeroMQ, Gloo,
ParamCast's quantizer, the backend. Checked per worker, over a streamed dense round and, after a real
AdamW step, a round sent whole: every tensor given to ``load_weights`` has the checkpoint's name, dtype
(float8_e4m3fn, float32 ``<name>_scale_inv``, BF16 norms and embeddings) and shape, and its bytes are
fp8_reference.py's quantization of the trainer's BF16 weights bit for bit (norms and embeddings the
trainer's); every parameter holds its shard of those bytes, each part's scale rows where its shard id
puts them. Channel and tensor scaling reach ``load_weights`` under the same ``<name>_scale_inv`` names.
A worker that serves slices refuses FP8 at init, naming the tensor."""

import json
import threading
import types

import pytest

try:
    import torch
except ImportError:
    torch = None
try:
    import transformers
except ImportError:
    transformers = None
import paramcast  # noqa: E402
from paramcast.integrations import vllm as backend  # noqa: E402

if torch is not None:  # the helpers import torch
    import fp8_reference as ref
    from cluster import config_dict
    from vllm_contract import ModuleSource, WorkerError, serve_worker, start_cluster
    from vllm_fixtures import one_engine

needs_fp8 = pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn") or transformers is None,
                               reason="needs PyTorch with torch.float8_e4m3fn (>= 2.1) and transformers; here: "
                                      f"PyTorch {getattr(torch, '__version__', 'absent')}, transformers "
                                      f"{getattr(transformers, '__version__', 'absent')}")

TP = 2
LLAMA = dict(vocab_size=100, hidden_size=200, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, max_position_embeddings=64)
RULES = [{"match": "*norm*", "keep": True}, {"match": "*proj.weight", "fp8": "block"}]


def worker_main(conn, rank, tp, spec, engine_cls_path):
    """One vLLM worker (vllm_contract.serve_worker: gpu_worker.py's RPCs): vllm_fp8_model's block-FP8 model,
    or with ``spec["bf16_model"]`` vllm_tp_model's unquantized one."""
    import vllm_fp8_model
    import vllm_tp_model
    spec = dict(spec)
    bf16 = spec.pop("bf16_model", False)

    def make_model():
        cfg = transformers.LlamaConfig(**spec)
        return cfg, (vllm_tp_model if bf16 else vllm_fp8_model).LlamaForCausalLM(cfg, rank, tp)

    def make_checks(cfg, model, engine):
        def check(ckpt):
            """What load_weights was given this round, and the parameters against the checkpoint's shards."""
            want = vllm_fp8_model.expected_params(cfg, vllm_fp8_model.unpack(ckpt), rank, tp)
            bad = []
            for name, param in model.named_parameters():
                loaded = want.get(name)
                got = param.data[:0 if loaded is None else loaded.shape[0]]
                if loaded is None or got.dtype != loaded.dtype or \
                        not torch.equal(got.contiguous().view(torch.uint8), loaded.contiguous().view(torch.uint8)):
                    bad.append(name)
            clobbered = sum(1 for t, raw in model.kept if not torch.equal(t.contiguous().view(torch.uint8), raw))
            report = {"given": list(model.given), "bad": bad, "clobbered": clobbered,
                      "other_threads": len(model.threads - {threading.get_ident()})}
            model.given.clear()
            model.kept.clear()
            model.threads.clear()
            return report

        return (check,)

    serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks)


def _trainer_model():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)


def _adamw_step(model, opt):
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 8))
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


def _scaling(name, rules):
    hit = backend._rule_for(rules, name)
    return None if hit is None else hit[1].get("fp8")


def checkpoint(model, rules=RULES):
    """The FP8 checkpoint of the trainer's BF16 weights, as fp8_reference.py quantizes them: each
    quantized tensor in float8, followed by its float32 `<name>_scale_inv`; the others as they are."""
    out = {}
    for name, p in model.named_parameters():
        scaling = _scaling(name, rules)
        if scaling is None:
            out[name] = p.detach().clone()
        else:
            out[name], out[name + "_scale_inv"] = ref.quantize(p, scaling)
    return out


def _digest(t):
    import hashlib
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def assert_round(client, ckpt):
    """Each worker was given exactly `ckpt` (names, dtypes, shapes, bytes) and holds its shards of it."""
    import vllm_fp8_model
    want = sorted((n, str(t.dtype), tuple(t.shape), _digest(t)) for n, t in ckpt.items())
    for rank, report in enumerate(client.rpc("check", ckpt=vllm_fp8_model.pack(ckpt))):
        who = f"vllm-dp0-r{rank}"
        given = sorted(report["given"])
        assert [g[:3] for g in given] == [w[:3] for w in want], \
            f"{who}: load_weights was given other names, dtypes or shapes than the FP8 checkpoint's: " \
            f"{sorted(set(g[:3] for g in given) ^ set(w[:3] for w in want))[:6]}"
        differ = [g[0] for g, w in zip(given, want) if g[3] != w[3]]
        assert differ == [], f"{who}: bytes differ from fp8_reference's quantization of the trainer's weights: {differ}"
        assert report["bad"] == [], f"{who}: parameters differ from their shards of the checkpoint: {report['bad']}"
        assert report["clobbered"] == 0, f"{who}: {report['clobbered']} tensors given to load_weights changed"
        assert report["other_threads"] == 0, f"{who}: load_weights ran off the worker's RPC thread"


def _cluster(spec, engine_init, transforms=RULES):
    return start_cluster(TP, spec, worker_main, _trainer_model, transforms=transforms, engine_init=engine_init)


@needs_fp8
def test_block_fp8_weights_and_scales_reach_an_fp8_models_load_weights_as_its_checkpoint():
    client, trainer, model = _cluster(dict(LLAMA), {"slices": "off"})
    try:
        ckpt = checkpoint(model)
        first = trainer.send_weights()  # streamed: each tensor quantized as it is sent
        params = len(list(model.parameters()))
        fp8 = [n for n in ckpt if n.endswith("_scale_inv")]
        assert len(fp8) == 14 and first.ok and first.transformed == len(fp8), first
        assert first.tensors == params + len(fp8)  # each FP8 tensor travels with its scales
        assert_round(client, ckpt)

        _adamw_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        after = checkpoint(model)
        moved = [n for n in fp8 if not torch.equal(after[n[:-len("_scale_inv")]].view(torch.uint8),
                                                   ckpt[n[:-len("_scale_inv")]].view(torch.uint8))]
        assert len(moved) == len(fp8), f"the AdamW step left FP8 weights unchanged: {set(fp8) - set(moved)}"
        trainer.send = "whole"  # the one-weight_update form (tensor-parallel rounds)
        second = trainer.send_weights()
        assert second.ok and second.version == first.version + 1 and second.transformed == len(fp8), second
        assert_round(client, after)
    finally:
        trainer.shutdown()
        client.close()


@needs_fp8
@pytest.mark.parametrize("model_kind", ["bf16-model", "fp8-model"])
def test_a_worker_that_serves_slices_refuses_fp8_at_init_naming_the_tensor(model_kind):
    if model_kind == "bf16-model":  # unquantized parallel layers: slices, which cannot take the rules' FP8
        spec = dict(LLAMA, bf16_model=True)
        match = (r"worker 0: UnmappedParameter: paramcast: vllm-dp0-r0: cannot receive "
                 r"'model\.layers\.0\.self_attn\.q_proj\.weight' as a slice: init_info\.transforms\[1\] "
                 r"\(match '\*proj\.weight', fp8: block\) sends it as FP8 \(F8_E4M3\) with "
                 r"'model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv'.*\(torch\.bfloat16\).*"
                 r"slices='off'")
    else:  # an FP8 model's quantized layers do not hold the checkpoint's bytes
        spec = dict(LLAMA)
        match = (r"vllm-dp0-r0: cannot state the slice .* parameter 'model\.layers\.0\.self_attn\.qkv_proj\.weight' "
                 r"\(QKVParallelLinear\): its layer is quantized \(Fp8LinearMethod\).*slices='off'")
    with pytest.raises(WorkerError, match=match):
        _cluster(spec, None)


class _RecordingModel(torch.nn.Module if torch is not None else object):
    """A model without vLLM's parallel layers (whole tensors) whose load_weights keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.given = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.given[name] = t.clone()
        return {name for name, _ in weights}


class _InProcessClient:
    """VLLMWeightSyncClient over one engine in this process (vLLM's worker RPCs, called directly)."""

    def __init__(self, engine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        self.engine.start_weight_update()

    def update_weights(self, update_info):
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.engine.finish_weight_update()


@needs_fp8
@pytest.mark.parametrize("form", ["dict", "yaml"])
def test_channel_and_tensor_scales_reach_load_weights_under_their_wire_names(form, tmp_path):
    # The config as a dict, or as a YAML file (JSON is YAML): either way the workers are told the
    # config's publisher.transforms, so they know the scales' names.
    rules = [{"match": "*norm*", "keep": True}, {"match": "*k_proj.weight", "fp8": "channel"},
             {"match": "*v_proj.weight", "fp8": "tensor"}, {"match": "*proj.weight", "fp8": "block"}]
    model = _trainer_model()
    recording = _RecordingModel()
    parallel = types.SimpleNamespace(rank=0, world_size=1, data_parallel_index=0, data_parallel_rank=0)
    engine = backend.ParamCastWeightTransferEngine(
        types.SimpleNamespace(backend="paramcast"), types.SimpleNamespace(parallel_config=parallel),
        torch.device("cpu"), recording)
    cfg = config_dict(subscribers=1)
    config = dict(cfg, publisher=dict(cfg["publisher"], transforms=rules))
    if form == "yaml":
        path = tmp_path / "trainer.yaml"
        path.write_text(json.dumps(config))
        config = str(path)
    info = backend.ParamCastTrainerInitInfo(config=config,
                                            engine_config={k: v for k, v in cfg.items() if k != "publisher"}, rank=0)
    trainer = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=_InProcessClient(engine),
                                                                        source=ModuleSource(model))
    try:
        assert engine._init.transforms == rules  # the config's rules, passed on to the workers
        result = trainer.send_weights()
        want = checkpoint(model, rules)
        assert result.ok and sorted(recording.given) == sorted(want)
        for name, t in want.items():
            got = recording.given[name]
            assert (got.dtype, tuple(got.shape)) == (t.dtype, tuple(t.shape)), (name, got.dtype, got.shape)
            assert _digest(got) == _digest(t), f"'{name}' differs from fp8_reference's bytes"
        k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
        assert recording.given[k + "_scale_inv"].shape == (256, 1)  # channel: one scale per row
        assert recording.given[v + "_scale_inv"].shape == (1,)  # tensor: one scale
    finally:
        trainer.shutdown()
        engine.shutdown()


@needs_fp8
def test_the_static_trainer_send_weights_form_takes_transforms():
    """vLLM 0.20-0.27's trainer_send_weights(iterator, args), streamed and gathered, with the rules per call."""
    model = _trainer_model()
    with one_engine() as (pub, sub, got):
        source = ModuleSource(model)
        manifest = [(m.name, m.dtype, m.shape) for m in source.metadata]
        want = {n: _digest(t) for n, t in checkpoint(model).items()}
        streamed = backend.ParamCastWeightTransferEngine.trainer_send_weights(
            source.iter_full(), backend.ParamCastTrainerSendWeightsArgs(publisher=pub, manifest=manifest,
                                                                        transforms=RULES))
        assert streamed.ok and sub.wait_for_version(streamed.version, timeout=60)
        assert {n: _digest(t) for n, t in got.items()} == want
        assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
        got.clear()
        gathered = backend.ParamCastWeightTransferEngine.trainer_send_weights(
            source.iter_full(), {"publisher": pub, "transforms": RULES})
        assert gathered.ok and sub.wait_for_version(gathered.version, timeout=60)
        assert {n: _digest(t) for n, t in got.items()} == want


def test_transform_rules_are_checked_and_matched_as_paramcasts_globs():
    eng = backend.ParamCastWeightTransferEngine.__new__(backend.ParamCastWeightTransferEngine)
    with pytest.raises(ValueError, match=r"init_info\.transforms\[0\]: expected a rule with a 'match' glob"):
        eng.parse_init_info({"endpoint": "tcp://10.0.0.1:5555", "transforms": [{"fp8": "block"}]})
    with pytest.raises(ValueError, match=r"trainer init_info\.transforms: expected a list of rules"):
        backend.ParamCastTrainerInitInfo(rank=0, transforms={"match": "*", "fp8": "block"})
    assert backend.wire_names(["a.q_proj.weight", "a.norm.weight", "a.q_proj.bias"], RULES) == \
        ["a.q_proj.weight", "a.q_proj.weight_scale_inv", "a.norm.weight", "a.q_proj.bias"]
    def matches(pattern, name):
        return backend._rule_for([{"match": pattern, "fp8": "block"}], name) is not None
    assert matches("l.?_proj.*", "l.q_proj.weight") and not matches("l.?_proj", "l.qq_proj")
    assert matches("a[0].*", "a[0].w") and not matches("a.b", "axb")  # no [] classes, . is a dot
    # The first matching rule decides, as in the core.
    assert backend._rule_for([{"match": "*.norm.*", "keep": True}, {"match": "*", "fp8": "block"}],
                             "a.norm.weight")[0] == 0
