"""The vLLM backend on tensor-parallel workers of a Mixture-of-Experts model: each worker registers, for every
expert it holds, only its slices of the expert's gate, up and down weights, written in place into its slot of
vLLM's fused expert parameters; an expert-parallel worker registers its experts whole and the others as empty
boxes, so that no byte of them reaches it.

A Hugging Face Qwen2-MoE trainer (one rank, bf16: 4 routed experts of intermediate size 42, a shared expert of
38, q/k/v biases, a vocabulary vLLM pads) publishes its checkpoint's tensors (each expert's
``mlp.experts.<e>.gate_proj/up_proj/down_proj.weight``, as the checkpoint names them) through the backend's
trainer engine; two TP=2 worker processes, each made and driven as vLLM 0.33.0's worker does
(vllm_contract.py's RPC sequence), hold vLLM's Qwen2MoeForCausalLM layout on their rank (vllm_moe_model.py:
vLLM's layer classes and attributes imitated on the CPU, ``w13_weight``/``w2_weight`` of its RoutedExperts
included; vLLM's real layers need a GPU). Real: the processes, ZeroMQ, Gloo, ParamCast's plan and its
point-to-point sends, the backend. Checked per worker: every parameter bit for bit the trainer's slices (gate
then up rows of each expert in its w13_weight slot, down columns in w2_weight; the shared expert through the
ordinary merged/row-parallel layers; the router whole), over a dense round, a round after an optimizer step
and a delta round, load_weights never called, and the bytes ParamCast delivered to it (the UpdateResult's
per-worker count) exactly its slices' bytes, which with expert parallelism leave out the other rank's experts.
A quantized MoE layer fails the worker's init naming its parameter, or, with whole_fallback, loads through
load_weights."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from paramcast.integrations import vllm as backend  # noqa: E402

from vllm_contract import ParamMeta, WorkerError, serve_worker, slice_report, start_cluster  # noqa: E402

TP = 2
QWEN2_MOE = dict(vocab_size=100, hidden_size=64, intermediate_size=64, moe_intermediate_size=42,
                 shared_expert_intermediate_size=38, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 max_position_embeddings=64)
FLAGS = ("ep", "quantized_moe")


def worker_main(conn, rank, tp, spec, engine_cls_path):
    """One vLLM worker (vllm_contract.serve_worker: gpu_worker.py's RPCs), its model vllm_moe_model's
    Qwen2MoeForCausalLM."""
    import vllm_moe_model
    spec = dict(spec)
    ep, quantized = (spec.pop(f, False) for f in FLAGS)

    def make_model():
        cfg = transformers.Qwen2MoeConfig(**spec)
        return cfg, vllm_moe_model.Qwen2MoeForCausalLM(cfg, rank, tp, ep=ep, quantized=quantized)

    def make_checks(cfg, model, engine):
        def check(ckpt):
            """What this worker holds against the trainer's checkpoint tensors, and what its slices weigh."""
            report = slice_report(model, vllm_moe_model.expected_params(cfg, ckpt, rank, tp, ep),
                                  vllm_moe_model.expected_slices(cfg, ckpt, rank, tp, ep), ckpt)
            report["experts"] = vllm_moe_model.held_experts(cfg, rank, tp, ep)
            return report

        return (check,)

    serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks)


def checkpoint_tensors(model):
    """The trainer's tensors under its checkpoint's names: transformers keeps a MoE block's experts fused
    (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first; ``mlp.experts.down_proj`` [E, H, I]) and
    writes them per expert, as vLLM's expert params mapping names them; views, no copies."""
    for name, p in model.named_parameters():
        p = p.detach()
        base, _, leaf = name.rpartition(".")
        if base.endswith("mlp.experts") and leaf == "gate_up_proj":
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                yield f"{base}.{e}.gate_proj.weight", p[e, :inter]
                yield f"{base}.{e}.up_proj.weight", p[e, inter:]
        elif base.endswith("mlp.experts") and leaf == "down_proj":
            for e in range(p.shape[0]):
                yield f"{base}.{e}.down_proj.weight", p[e]
        else:
            yield name, p


class CheckpointSource:
    """vLLM's WeightSource over the trainer: ``metadata`` and ``iter_full()`` of its checkpoint tensors."""

    def __init__(self, model):
        self.model = model
        self.metadata = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in checkpoint_tensors(model)]

    def iter_full(self):
        yield from checkpoint_tensors(self.model)


def _trainer_model(spec):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # the experts' plain loop: grouped_mm wants 16-byte strides, which an intermediate size of 42 in bf16 is not
    cfg = transformers.Qwen2MoeConfig(**{k: v for k, v in spec.items() if k not in FLAGS},
                                      experts_implementation="eager")
    return transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)


def _cluster(spec, engine_init=None):
    return start_cluster(TP, spec, worker_main, lambda: _trainer_model(spec), source=CheckpointSource,
                         engine_init=engine_init)


def _state(model):
    return {n: t.clone() for n, t in checkpoint_tensors(model)}


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices-of-every-expert", "ep-whole-experts-of-its-own"])
def test_each_worker_receives_only_its_expert_slices_into_its_fused_expert_parameters(ep):
    spec = dict(QWEN2_MOE, ep=ep)
    client, trainer, model = _cluster(spec)
    try:
        before = None
        for step in range(3):
            if step == 1:  # an optimizer step: every weight changes, the experts' included
                opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1)
                tokens = torch.randint(0, spec["vocab_size"], (2, 8))
                model(tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad()
                unchanged = [n for n, t in _state(model).items() if torch.equal(t, before[n])]
                assert unchanged == [], f"the optimizer step left {unchanged} as they were"
            elif step == 2:  # only the first layer changes: a delta of each worker's slices
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.startswith("model.layers.0."):
                            p.mul_(1.5)
            result = trainer.send_weights()
            before = _state(model)
            assert result.ok and result.tensors == len(before)
            delivered = {o.worker_id: o.bytes for o in result.subscribers}
            reports = client.rpc("check", ckpt=before)
            assert [r["experts"] for r in reports] == ([[0, 1], [2, 3]] if ep else [[0, 1, 2, 3]] * TP)
            for rank, report in enumerate(reports):
                who = f"vllm-dp0-r{rank}"
                assert report["bad"] == [], f"{who}: parameters differ from the trainer's slices: {report['bad']}"
                assert report["padding_written"] == [], f"{who}: rows past the vocabulary written: " \
                                                        f"{report['padding_written']}"
                assert report["load_calls"] == 0, f"{who}: {report['load_calls']} full tensors " \
                                                  f"({report['load_bytes']} bytes) went through load_weights"
                if step < 2:  # dense: exactly its slices (half of each expert, or its two experts whole)
                    assert delivered[who] == report["slice_bytes"], (who, delivered, report)
                    assert delivered[who] < 0.75 * report["whole_bytes"], (who, delivered, report)
                else:  # the delta: at most its slices of the first layer (plus framing)
                    assert result.delta, result.dense_because
                    assert 0 < delivered[who] <= 1.1 * report["layer0_slice_bytes"], (who, delivered, report)
        assert trainer.send == "whole"  # learned from the publisher: the workers serve slices
    finally:
        trainer.shutdown()
        client.close()


def test_a_quantized_moe_layer_fails_the_workers_init_naming_it():
    with pytest.raises(WorkerError, match=r"vllm-dp0-r0: cannot state the slice .* parameter "
                                          r"'model\.layers\.0\.mlp\.experts\.routed_experts\.w13_weight' "
                                          r"\(RoutedExperts\): its experts are quantized \(Fp8MoEMethod\)"
                                          r".*whole_fallback"):
        _cluster(dict(QWEN2_MOE, quantized_moe=True))


def test_whole_fallback_loads_the_experts_through_load_weights():
    client, trainer, model = _cluster(dict(QWEN2_MOE, quantized_moe=True), engine_init={"whole_fallback": True})
    try:
        result = trainer.send_weights()
        assert result.ok and trainer.send == "auto"  # streamed: no worker serves slices
        for rank, report in enumerate(client.rpc("check", ckpt=_state(model))):
            assert report["bad"] == [] and report["padding_written"] == [], (rank, report)
            assert report["load_calls"] == result.tensors and report["load_bytes"] == report["whole_bytes"], report
    finally:
        trainer.shutdown()
        client.close()


def test_destinations_follow_the_models_expert_mapping_and_the_expert_map():
    """In-process: a model-level expert params mapping (vLLM's make_expert_params_mapping, Mixtral's
    w1/w3/w2 names) and round-robin expert placement: rank 1 of 2 holds experts 1 and 3 in slots 0, 1,
    and declares experts 0 and 2 as empty boxes."""
    import vllm_moe_model
    cfg = transformers.Qwen2MoeConfig(**QWEN2_MOE)
    model = vllm_moe_model.Qwen2MoeForCausalLM(cfg, 1, 2, ep=True, placement="round_robin")
    mapping = vllm_moe_model.RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", cfg.num_experts)
    got = {n: (v, shape, offsets) for n, v, shape, offsets in backend.tp_destinations(model, expert_mapping=mapping)
           if ".experts." in n and ".layers.1." in n}
    routed = model.model.layers[1].mlp.experts.routed_experts
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    want = {}
    for slot, e in enumerate([1, 3]):
        pre = f"model.layers.1.mlp.experts.{e}."
        want[pre + "w1.weight"] = (routed.w13_weight[slot, :inter], [inter, hidden])
        want[pre + "w3.weight"] = (routed.w13_weight[slot, inter:], [inter, hidden])
        want[pre + "w2.weight"] = (routed.w2_weight[slot], [hidden, inter])
    for e in (0, 2):  # rank 0's: declared, as empty boxes, so that the plan sends this worker none of them
        for part, shape in (("w1", [inter, hidden]), ("w3", [inter, hidden]), ("w2", [hidden, inter])):
            want[f"model.layers.1.mlp.experts.{e}.{part}.weight"] = (None, shape)
    assert sorted(got) == sorted(want)
    for name, (view, shape) in want.items():
        local, full, offsets = got[name]
        assert (full, offsets) == (shape, [0, 0]), name
        if view is None:
            assert local.numel() == 0, name
        else:
            assert (local.data_ptr(), list(local.shape)) == (view.data_ptr(), list(view.shape)), name


def test_a_fused_moe_layer_of_earlier_vllm_gets_the_usual_expert_names():
    """In-process: earlier vLLM's FusedMoE (the experts' parameters on the block's ``experts`` itself, no
    expert params mapping of its own): recognized by class name, each expert's TP slices under the usual
    ``mlp.experts.<e>.gate_proj/up_proj/down_proj.weight``."""
    import vllm_moe_model

    class FusedMoE(vllm_moe_model.RoutedExperts):
        get_expert_mapping = None  # earlier vLLM's layer states no mapping

    cfg = transformers.Qwen2MoeConfig(**QWEN2_MOE)
    model = vllm_moe_model.Qwen2MoeForCausalLM(cfg, 1, 2)
    layer = FusedMoE("model.layers.1.mlp.experts", cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                     1, 2, False, torch.bfloat16)
    for name in ("ckpt_gate_proj_name", "ckpt_down_proj_name", "ckpt_up_proj_name"):
        delattr(layer, name)  # nor its checkpoint names
    model.model.layers[1].mlp.experts = layer
    got = {n: (v, shape, offsets) for n, v, shape, offsets in backend.tp_destinations(model)
           if n.startswith("model.layers.1.mlp.experts.")}
    per, hidden = cfg.moe_intermediate_size // 2, cfg.hidden_size
    want = {}
    for e in range(cfg.num_experts):
        pre = f"model.layers.1.mlp.experts.{e}."
        want[pre + "gate_proj.weight"] = (layer.w13_weight[e, :per], [2 * per, hidden], [per, 0])
        want[pre + "up_proj.weight"] = (layer.w13_weight[e, per:], [2 * per, hidden], [per, 0])
        want[pre + "down_proj.weight"] = (layer.w2_weight[e], [hidden, 2 * per], [0, per])
    assert sorted(got) == sorted(want)
    for name, (view, shape, offsets) in want.items():
        local, full, at = got[name]
        assert (local.data_ptr(), list(local.shape), full, at) == \
               (view.data_ptr(), list(view.shape), shape, offsets), name
